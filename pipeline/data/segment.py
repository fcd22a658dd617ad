"""Segmentation: a cleaned document -> token ids with sentence ends and word starts.

Sentences are found on the text (English ``. ! ?``, Chinese ``。！？；…``, with closing
quotes and brackets, and paragraph breaks), words come from the tokenizer's
pre-tokenizer (``Encoding.word_ids``) or, for Chinese, from jieba. Both are character
positions first and are mapped to token offsets through ``Encoding.offsets``, so they
work with any of the three tokenizer kinds (WordPiece splits CJK text into single
characters, byte-level BPE and Unigram into multi-character pieces).

A document longer than ``max_doc_tokens`` is split into pieces at sentence ends; a
single sentence longer than that is cut at word starts (and a single word at the limit).

Entity spans (ERNIE's entity-level masking): with an entity list, every mention of a
listed entity in the text becomes a token span [start, end) in ``spans.npy``. Mentions
are found leftmost-first, longest entity first, never overlapping; an entity made of
Latin letters or digits only matches at word boundaries ("Paris" not in "Parisian"),
Chinese entities match anywhere (Chinese has no spaces to mark boundaries).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from tokenizers import Encoding, Tokenizer, models, pre_tokenizers

# Chinese terminators end a sentence wherever they stand. NFKC (the default cleaning)
# turns full-width ！？； into ASCII and … into "...", so ASCII terminators also end a
# sentence when a CJK character follows at once; otherwise . ! ? need whitespace or
# the end of the text after them (and a following lowercase letter means "e.g. this").
_CLOSERS = "[\"'”’)\\]}」』》〉）]*"
_CJK_CHARS = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef“‘「『《（"
# A run of Chinese terminators, or of ASCII ones before whitespace or CJK (the lookahead
# lets re drop "3.11", "os.path" without a Python step; the rest is checked in Python).
# Written to start with one character class, whatever the branch: re then jumps from one
# terminator to the next with its fast character-set search instead of trying both
# branches at every position (2-3x faster). The same matches as the two-branch form
# "([。！？；…]+)C|([.!?;]+)C(?=...)" (tests/unit/test_prepare_speed_parts.py); group 1 is
# the ASCII run after its first character, None for a Chinese run.
_TERMINATOR = re.compile(
    f"[。！？；….!?;](?:(?<=[。！？；…])[。！？；…]*{_CLOSERS}"
    f"|(?<=[.!?;])([.!?;]*){_CLOSERS}(?=[\\s{_CJK_CHARS}]))"
)
_UNK_NAMES = ("[UNK]", "<unk>")
_PARAGRAPH = re.compile(r"\n\s*\n")
_CJK_CHAR = re.compile(f"[{_CJK_CHARS}]")


@dataclass
class Piece:
    """A document, or one piece of a long one, ready for a shard."""

    tokens: np.ndarray  # int32 token ids, no special tokens
    sents: np.ndarray  # int32 sentence end offsets (exclusive), ascending, last == len(tokens)
    words: np.ndarray  # int32 word start offsets, ascending, first == 0
    spans: np.ndarray | None = None  # int32 (n, 2) entity token spans [start, end), or None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def sentence_ends(text: str) -> list[int]:
    """Character offsets (exclusive) where sentences end; the text's end is not listed."""
    ends = []
    n = len(text)
    for m in _TERMINATOR.finditer(text):
        end = m.end()
        if end >= n:
            continue
        # An ASCII terminator is followed by whitespace or CJK here (the lookahead).
        ascii_rest = m.group(1)
        if ascii_rest is not None and not _CJK_CHAR.match(text, end):
            if not ascii_rest and text[m.start()] == ";":
                continue  # "x; y": not a sentence end ("3.11", "a;b" never match)
            if text[end : end + 8].lstrip()[:1].islower():
                continue  # "e.g. this", "i.e. that"
        ends.append(end)
    ends.extend(m.start() for m in _PARAGRAPH.finditer(text))
    return sorted(set(e for e in ends if 0 < e < n))


@lru_cache(maxsize=1)
def _jieba():
    """One private jieba tokenizer with the default dictionary, loaded quietly.

    jieba's segmentation is deterministic for a fixed dictionary (Viterbi on the prefix
    dictionary + HMM); a private instance is immune to ``jieba.add_word`` elsewhere.
    """
    import jieba

    jieba.setLogLevel(logging.WARNING)
    tokenizer = jieba.Tokenizer()
    tokenizer.initialize()
    return tokenizer


def jieba_word_starts(text: str) -> list[int]:
    """Character offsets where jieba words start.

    Whitespace is not a word; a word preceded by whitespace starts at that whitespace,
    because byte-level BPE ("Ġword") and Metaspace ("▁word") attach it to the next word.
    """
    starts, pos, space_from = [], 0, None
    for word in _jieba().cut(text, HMM=True):
        if word.isspace():
            space_from = pos if space_from is None else space_from
        else:
            starts.append(pos if space_from is None else space_from)
            space_from = None
        pos += len(word)
    return starts


def _token_starts(encoding: Encoding) -> np.ndarray:
    """Start character offsets of the tokens (non-decreasing)."""
    # A comprehension over the (start, end) tuples is ~3x cheaper than np.asarray on them.
    return np.array([start for start, _ in encoding.offsets], dtype=np.int64)


_NON_BLANK = re.compile(r"\S")


def _wordpiece_tokens_at(text: str, encoding: Encoding, chars: list[int]) -> np.ndarray | None:
    """For each sentence end, the first token starting at or after it (what searchsorted
    over ``_token_starts`` gives) for WordPiece behind a BERT pre-tokenizer, from the
    token holding the next non-blank character: one ``char_to_token`` per sentence
    instead of converting every token's offsets (~3x cheaper on python-docs).

    Why it is the same token there: no WordPiece token holds a blank, and none crosses a
    sentence end, which follows punctuation (a word of its own) or starts a blank line.
    None when that character is in no token (the tokenizer's normalizer dropped it, e.g.
    an accent): the caller then takes the general path.
    """
    tokens = []
    for char in chars:
        found = _NON_BLANK.search(text, char)
        token = encoding.char_to_token(found.start()) if found else None
        if token is None:
            return None
        tokens.append(token)
    return np.array(tokens, dtype=np.int64)


def _token_bounds(encoding: Encoding) -> tuple[np.ndarray, np.ndarray]:
    """Start and end character offsets of the tokens, both non-decreasing."""
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    return offsets[:, 0], np.maximum.accumulate(offsets[:, 1]) if len(offsets) else offsets[:, 1]


def _chars_to_word_tokens(token_ends: np.ndarray, chars: list[int]) -> np.ndarray:
    """For each word start, the first token reaching past it.

    A token that straddles two words (BPE may merge across a jieba boundary) belongs to
    the earlier word, so it never starts two words at once.
    """
    return np.searchsorted(token_ends, np.asarray(chars, dtype=np.int64), side="right")


def _cut_points(n: int, sents: np.ndarray, words: np.ndarray, max_len: int) -> list[int]:
    """Piece ends: the furthest sentence end within reach, else word start, else the limit."""
    cuts, start = [], 0
    while start < n:
        limit = start + max_len
        if limit >= n:
            end = n
        else:
            i = int(np.searchsorted(sents, limit, side="right")) - 1
            j = int(np.searchsorted(words, limit, side="right")) - 1
            if i >= 0 and sents[i] > start:
                end = int(sents[i])
            elif j >= 0 and words[j] > start:
                end = int(words[j])
            else:
                end = limit
        cuts.append(end)
        start = end
    return cuts


def _pieces(
    tokens: np.ndarray,
    sents: np.ndarray,
    words: np.ndarray,
    max_len: int,
    spans: np.ndarray | None = None,
) -> list[Piece]:
    if len(tokens) <= max_len:  # one piece (most documents): sents ends at n, words starts at 0
        return [
            Piece(
                tokens=tokens,
                sents=sents.astype(np.int32),
                words=words.astype(np.int32),
                spans=None if spans is None else spans.astype(np.int32),
            )
        ]
    pieces, start = [], 0
    for end in _cut_points(len(tokens), sents, words, max_len):
        s = sents[(sents > start) & (sents < end)] - start
        w = words[(words > start) & (words < end)] - start
        piece_spans = None
        if spans is not None:  # a mention cut by a piece boundary is dropped, never split
            inside = (spans[:, 0] >= start) & (spans[:, 1] <= end)
            piece_spans = (spans[inside] - start).astype(np.int32).reshape(-1, 2)
        pieces.append(
            Piece(
                tokens=tokens[start:end],
                sents=np.append(s, end - start).astype(np.int32),
                words=np.insert(w, 0, 0).astype(np.int32),
                spans=piece_spans,
            )
        )
        start = end
    return pieces


_LATIN_WORD = re.compile(r"[A-Za-z0-9]")


def entity_pattern(entities: list[str]) -> re.Pattern[str] | None:
    """One regex for the whole list: longest entity first, so "New York City" wins over
    "New York" at the same position; Latin-edged entities need word boundaries."""
    alternatives = []
    for entity in sorted(set(entities), key=lambda e: (-len(e), e)):
        body = re.escape(entity)
        if _LATIN_WORD.match(entity[0]):
            body = "(?<![A-Za-z0-9])" + body
        if _LATIN_WORD.match(entity[-1]):
            body += "(?![A-Za-z0-9])"
        alternatives.append(body)
    return re.compile("|".join(alternatives)) if alternatives else None


def entity_token_spans(text: str, pattern: re.Pattern[str], encoding: Encoding) -> np.ndarray:
    """(n, 2) token spans [start, end) of the entity mentions in ``text``: the tokens that
    overlap the mention's characters."""
    chars = [(m.start(), m.end()) for m in pattern.finditer(text)]
    if not chars:
        return np.zeros((0, 2), dtype=np.int64)
    starts, ends = _token_bounds(encoding)
    c = np.asarray(chars, dtype=np.int64)
    first = np.searchsorted(ends, c[:, 0], side="right")  # first token ending after the start
    stop = np.searchsorted(starts, c[:, 1], side="left")  # first token starting at/after the end
    spans = np.stack([first, stop], axis=1)
    spans = spans[spans[:, 1] > spans[:, 0]]
    # Two mentions can share a token (a BPE piece spanning both): keep them disjoint.
    keep = np.ones(len(spans), dtype=bool)
    keep[1:] = spans[1:, 0] >= spans[:-1, 1]
    return spans[keep]


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of an already sorted array (without its sort and hashing: ~5x cheaper)."""
    if len(values) < 2:
        return values
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def segment_encoding(
    text: str,
    language: str,
    encoding: Encoding,
    max_doc_tokens: int,
    specials: np.ndarray | None = None,
    unk: int | None = None,
    entities: re.Pattern[str] | None = None,
    continuation: np.ndarray | None = None,
) -> list[Piece]:
    """Pieces of one document from its text and its encoding (``specials`` become ``unk``);
    with an ``entities`` pattern (``entity_pattern``) the pieces carry entity spans.

    ``continuation`` (``wordpiece_continuations``): for a WordPiece tokenizer behind a
    BERT pre-tokenizer, which ids are "##" pieces; the word starts are then the other
    tokens, read from the ids instead of converting ``Encoding.word_ids`` (the same
    answer: a word is its first piece and "##" pieces).
    """
    tokens = np.array(encoding.ids, dtype=np.int32)
    n = len(tokens)
    if n == 0:
        return []
    # Word starts as a mask over the tokens: sentence starts join it below, and
    # flatnonzero gives them sorted and unique (np.unique would sort and hash).
    word_start = np.empty(n, dtype=bool)
    if language != "zh":
        if continuation is not None:
            np.logical_not(continuation[tokens], out=word_start)
        else:
            word_ids = encoding.word_ids
            try:  # no None without special tokens: one C-level conversion
                ids = np.array(word_ids, dtype=np.int64)
            except TypeError:
                ids = np.array([-1 if w is None else w for w in word_ids], dtype=np.int64)
            np.not_equal(ids[1:], ids[:-1], out=word_start[1:])
    if unk is not None and specials is not None and len(specials):
        if (tokens <= specials[-1]).any():  # specials have the lowest ids: usually a no-op
            tokens[np.isin(tokens, specials)] = unk
    sent_chars = sentence_ends(text)
    if sent_chars:
        sents = None if continuation is None else _wordpiece_tokens_at(text, encoding, sent_chars)
        if sents is None:  # the offsets are the costliest attribute of an Encoding
            sents = np.searchsorted(_token_starts(encoding), sent_chars, side="left")
        sents = np.append(_sorted_unique(sents[(sents > 0) & (sents < n)]), n)
    else:
        sents = np.array([n], dtype=np.int64)
    if language == "zh":
        _, ends = _token_bounds(encoding)
        words = _chars_to_word_tokens(ends, jieba_word_starts(text))
        word_start[:] = False
        word_start[words[words < n]] = True
    # A sentence start is always a word start, and so is the first token.
    word_start[0] = True
    word_start[sents[:-1]] = True
    words = np.flatnonzero(word_start)
    spans = None if entities is None else entity_token_spans(text, entities, encoding)
    return _pieces(tokens, sents, words, max_doc_tokens, spans)


def wordpiece_continuations(tokenizer: Tokenizer) -> np.ndarray | None:
    """For a WordPiece model behind a BERT pre-tokenizer: a bool per id, True for the
    continuation ("##") pieces; None for any other tokenizer.

    The BERT pre-tokenizer makes every punctuation character (so "#") a word of its
    own, so no word starts with "##", and WordPiece writes every piece after a word's
    first with the prefix: word starts are exactly the ids that are not continuations.
    """
    model, pre = tokenizer.model, tokenizer.pre_tokenizer
    if not isinstance(model, models.WordPiece) or not isinstance(
        pre, pre_tokenizers.BertPreTokenizer
    ):
        return None
    prefix = model.continuing_subword_prefix
    if not prefix:
        return None
    flags = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=bool)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        flags[i] = token.startswith(prefix) and len(token) > len(prefix)
    return flags


def process_documents(
    texts: list[str],
    languages: list[str],
    tokenizer: Tokenizer,
    max_doc_tokens: int,
    entities: re.Pattern[str] | None = None,
    continuation: np.ndarray | None = None,
) -> list[list[Piece]]:
    """``process_document`` for a batch: one ``encode_batch`` call (parallel in Rust).

    ``continuation``: ``wordpiece_continuations(tokenizer)``, computed once by a caller
    that encodes many batches (it reads the whole vocabulary)."""
    if len(texts) != len(languages):
        raise ValueError(f"{len(texts)} texts but {len(languages)} languages")
    if max_doc_tokens <= 0:
        raise ValueError(f"max_doc_tokens must be positive, got {max_doc_tokens}")
    # Text that spells a special token ("<s>", "[MASK]") is text, not a control token.
    tokenizer.encode_special_tokens = True
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    specials, unk = _special_ids(tokenizer)
    return [
        segment_encoding(text, lang, enc, max_doc_tokens, specials, unk, entities, continuation)
        for text, lang, enc in zip(texts, languages, encodings, strict=True)
    ]


def _special_ids(tokenizer: Tokenizer) -> tuple[np.ndarray, int | None]:
    """Ids of the special tokens other than unk, and the unk id.

    A model can still reach a special piece from plain text (a Unigram model whose
    alphabet lacks the characters of "[MASK]"); such ids become unk, so a document never
    carries a control token the objectives would misread.
    """
    unk = next((i for name in _UNK_NAMES if (i := tokenizer.token_to_id(name)) is not None), None)
    ids = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special and i != unk]
    return np.asarray(sorted(ids), dtype=np.int32), unk


def process_document(
    text: str, language: str, tokenizer: Tokenizer, max_doc_tokens: int
) -> list[Piece]:
    """Tokenize one cleaned document and split it into pieces of <= max_doc_tokens tokens."""
    return process_documents([text], [language], tokenizer, max_doc_tokens)[0]
