"""Segmentation: a cleaned document -> token ids with sentence ends and word starts.

Sentences are found on the text (English ``. ! ?``, Chinese ``。！？；…``, with closing
quotes and brackets, and paragraph breaks), words come from the tokenizer's
pre-tokenizer (``Encoding.word_ids``) or, for Chinese, from jieba. Both are character
positions first and are mapped to token offsets through ``Encoding.offsets``, so they
work with any of the three tokenizer kinds (WordPiece splits CJK text into single
characters, byte-level BPE and Unigram into multi-character pieces). ``Segmenter`` runs
this per batch, and has a faster path with the same result for WordPiece (its
docstring says when and why).

A document longer than ``max_doc_tokens`` is split into pieces at sentence ends; a
single sentence longer than that is cut at word starts (and a single word at the limit).

Entity spans (ERNIE's entity-level masking): with an entity list, every mention of a
listed entity in the text becomes a token span [start, end) in ``spans.npy``. Mentions
are found leftmost-first, longest entity first, never overlapping; an entity made of
Latin letters or digits only matches at word boundaries ("Paris" not in "Parisian"),
Chinese entities match anywhere (Chinese has no spaces to mark boundaries).
"""

from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from tokenizers import AddedToken, Encoding, Tokenizer, models, normalizers, pre_tokenizers

from pipeline.prepare.clean import _has_ascii_control

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
                sents=sents.astype(np.int32, copy=False),
                words=words.astype(np.int32, copy=False),
                spans=None if spans is None else spans.astype(np.int32, copy=False),
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


# Marks every sentence end in the texts of the batch path (``Segmenter``). clean() removes
# all C0 controls but tab and newline, so a cleaned document never holds it; a text that
# does (one that did not come through clean) takes the other path.
_MARK = "\x00"


def _char_class(test) -> str:
    """A regex character class of every code point for which ``test`` holds."""
    ranges, start = [], None
    for i in range(0x110001):
        inside = i < 0x110000 and test(chr(i))
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            ranges.append((start, i - 1))
            start = None
    esc = re.escape
    return (
        "[" + "".join(esc(chr(a)) + ("" if a == b else "-" + esc(chr(b))) for a, b in ranges) + "]"
    )


@lru_cache(maxsize=1)
def _batch_terminator() -> re.Pattern[str]:
    """``sentence_ends``' terminators as one regex with no Python step per match (for a
    whole batch joined by ``_DOC``): its checks after a match move into lookaheads. An ASCII run
    ends a sentence before CJK, or before whitespace unless a lowercase letter
    (``str.islower``) comes within the next 8 characters after the blanks; a lone ";"
    only before CJK. The same ends as ``sentence_ends`` (tests/unit/test_prepare_speed_parts.py
    compares them on random strings of the characters that matter and on real text)."""
    zh = "。！？；…"
    lower = _char_class(str.islower)  # ~0.1 s, once per process
    cjk = f"[{_CJK_CHARS}]"
    ok = f"(?={cjk}|(?=\\s)(?!\\s{{1,7}}{lower}))"
    return re.compile(
        f"[{zh}.!?;](?:(?<=[{zh}])[{zh}]*{_CLOSERS}"
        f"|(?<=[.!?])[.!?;]*{_CLOSERS}{ok}"
        f"|(?<=;)[.!?;]+{_CLOSERS}{ok}"
        f"|(?<=;){_CLOSERS}(?={cjk}))"
    )


# Joins a batch's texts for ``mark_batch`` (a C0 control: never in a cleaned text).
_DOC = "\x01"


def mark_batch(texts: list[str]) -> list[str]:
    """Each text with ``_MARK`` at the ends ``sentence_ends`` finds (an end at a text's
    start or end, or twice at one place, may get a mark of its own, which the batch path
    drops as it drops marks with no token between them). Two regex scans of the batch
    joined by ``_DOC``: ~2.5x cheaper than ``sentence_ends`` and a join per text."""
    return _mark_joined(texts).split(_DOC)


def _mark_joined(texts: list[str]) -> str:
    """``mark_batch``'s texts, still joined by ``_DOC``."""
    joined = _DOC.join(texts)
    ends = [m.end() for m in _batch_terminator().finditer(joined)]
    if "\n" in joined:
        ends.extend(m.start() for m in _PARAGRAPH.finditer(joined))
        ends.sort()
    bounds = [0, *ends, len(joined)]
    return _MARK.join([joined[a:b] for a, b in itertools.pairwise(bounds)])


# ``ChunkIds`` joins a batch's texts with this chunk, and the new chunks it encodes with
# ``_DOC`` (an added token of its tokenizer copy: a hard cut in the ids).
_DOC_CHUNK = f" {_DOC} "
_DOC_ID = -1  # the id ``ChunkIds`` gives ``_DOC``: where one text ends and the next starts


def _chunks_compose(tokenizer: Tokenizer, mark_id: int) -> bool:
    """Can ``ChunkIds`` stand in for ``tokenizer`` (a normalizer-less WordPiece copy behind
    a BERT pre-tokenizer)? Not when it truncates or pads, or when an added token other
    than the mark could match across a blank (a special one cannot: encode_special_tokens)."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return False
    added = tokenizer.get_added_tokens_decoder()
    return all(t.special or i == mark_id for i, t in added.items())


class ChunkIds:
    """Token ids of ASCII texts without controls (but ``_MARK``s), for a normalizer-less
    WordPiece tokenizer behind a BERT pre-tokenizer, one dict lookup per chunk (a run of
    non-blanks: ``str.split()``): the ids ``encode_batch_fast`` gives, with less CPU.

    Why the same: blanks (space, tab, newline in such text) split pre-tokens and are
    dropped, the added mark cuts the text before anything else, and WordPiece encodes
    each pre-token on its own; so a text's ids are its chunks' ids in order. A chunk's ids
    come from the tokenizer the first time it is seen (a batch's new chunks in one call,
    joined by ``_DOC``, an added token of this copy, then cut there) and are kept in a
    table of at most ``capacity`` chunks, emptied when full: memory stays bounded
    whatever the corpus. Natural text repeats its words, so most chunks are looked up
    (tests/unit/test_prepare_speed_parts.py compares with the tokenizer).
    """

    def __init__(self, tokenizer: Tokenizer, mark_id: int, capacity: int = 1 << 17):
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.add_tokens([AddedToken(_DOC, normalized=False, special=False)])
        self.tokenizer.encode_special_tokens = True
        self.doc_id = self.tokenizer.token_to_id(_DOC)
        self.mark_id, self.capacity = mark_id, capacity
        self.misses = 0  # chunks sent to the tokenizer (for tests)
        self._reset()

    def _reset(self) -> None:
        self.index: dict[str, int] = {}
        self.flat = np.zeros(1 << 16, dtype=np.int32)  # the chunks' ids, concatenated
        self.start = np.zeros(1 << 12, dtype=np.int64)  # per chunk: where its ids start
        self.length = np.zeros(1 << 12, dtype=np.int64)
        self.used = 0  # of flat
        self._add([_DOC], [np.array([_DOC_ID], dtype=np.int32)])

    def _add(self, chunks: list[str], ids: list[np.ndarray]) -> None:
        first = len(self.index)
        need = first + len(chunks)
        if need > len(self.start):
            size = max(need, 2 * len(self.start))
            self.start = np.resize(self.start, size)
            self.length = np.resize(self.length, size)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        if self.used + total > len(self.flat):
            self.flat = np.resize(self.flat, max(self.used + total, 2 * len(self.flat)))
        if total:
            self.flat[self.used : self.used + total] = np.concatenate(ids)
        self.length[first:need] = lengths
        self.start[first:need] = self.used + np.cumsum(lengths) - lengths
        self.used += total
        self.index.update(zip(chunks, range(first, need), strict=True))

    def _encode(self, chunks: list[str]) -> list[np.ndarray]:
        """Each chunk's ids from the tokenizer: one call on the chunks joined by ``_DOC``."""
        self.misses += len(chunks)
        [encoding] = self.tokenizer.encode_batch_fast([_DOC.join(chunks)], add_special_tokens=False)
        ids = np.array(encoding.ids, dtype=np.int32)
        cuts = np.flatnonzero(ids == self.doc_id)
        if len(cuts) == len(chunks) - 1:
            ends = np.append(cuts, len(ids))
            starts = np.insert(cuts + 1, 0, 0)
            return [ids[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        encodings = self.tokenizer.encode_batch_fast(chunks, add_special_tokens=False)
        return [np.array(e.ids, dtype=np.int32) for e in encodings]

    def __call__(self, text: str) -> np.ndarray:
        """The ids of ``text`` (a ``_DOC_CHUNK`` gives ``_DOC_ID``)."""
        chunks = text.split()
        if not chunks:
            return np.zeros(0, dtype=np.int32)
        rows = np.fromiter(
            map(self.index.get, chunks, itertools.repeat(-1)), dtype=np.int64, count=len(chunks)
        )
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            new = list(dict.fromkeys([chunks[i] for i in missing.tolist()]))
            if len(self.index) + len(new) > self.capacity and len(self.index) > 1:
                self._reset()  # full: start again (one text's own chunks always fit)
                return self(text)
            self._add(new, self._encode(new))
            index = self.index
            rows[missing] = [index[chunks[i]] for i in missing.tolist()]
        lengths = self.length[rows]
        ends = np.cumsum(lengths)
        shift = np.repeat(self.start[rows] - (ends - lengths), lengths)
        return self.flat[np.arange(int(ends[-1]), dtype=np.int64) + shift]

    def batch(self, joined: str) -> tuple[np.ndarray, np.ndarray]:
        """Texts joined by ``_DOC``: (their ids concatenated, each text's count)."""
        ids = self(joined.replace(_DOC, _DOC_CHUNK))
        docs = np.flatnonzero(ids == _DOC_ID)
        lengths = np.diff(docs, prepend=-1, append=len(ids)) - 1
        return np.delete(ids, docs), lengths


class Segmenter:
    """Tokenize and segment batches of cleaned documents with one tokenizer: what the
    `plm data prepare` write tasks run, one call per batch.

    Two paths, the same pieces (tests/unit/test_prepare_speed_parts.py compares them):

    - **Batch path**: WordPiece behind a BERT pre-tokenizer, documents not Chinese, no
      entity list. Each text gets ``_MARK`` at its sentence ends, and a copy of the
      tokenizer that has ``_MARK`` as an added token encodes them with
      ``encode_batch_fast``, which skips offsets (256 documents per call, python-docs:
      16% less CPU than ``encode_batch`` on its short documents, 44% on documents of ten
      joined). The k-th mark of a document, minus the k marks before it, is a
      sentence end in tokens, and word starts are the ids that are not "##" pieces: the
      whole batch is segmented in a few numpy calls over all its tokens.
      Why the other tokens stay the same: a sentence end always falls between two
      pre-tokens (after punctuation, which the BERT pre-tokenizer isolates, or at a
      blank), the added token cuts the text there before the normalizer runs, and
      BertNormalizer works character by character. ASCII texts without controls skip
      the normalizer and, through ``ChunkIds``, most of the tokenizer: their ids are
      looked up per blank-separated chunk (python-docs: see docs/benchmarks.md).
    - **Offsets path**: any other tokenizer, Chinese (jieba's word starts are character
      offsets), entity spans. ``encode_batch``, then ``segment_encoding`` per document.
    """

    def __init__(
        self, tokenizer: Tokenizer, max_doc_tokens: int, entities: re.Pattern[str] | None = None
    ):
        if max_doc_tokens <= 0:
            raise ValueError(f"max_doc_tokens must be positive, got {max_doc_tokens}")
        # Text that spells a special token ("<s>", "[MASK]") is text, not a control token.
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.max_doc_tokens = max_doc_tokens
        self.entities = entities
        self.specials, self.unk = _special_ids(tokenizer)
        self.continuation = wordpiece_continuations(tokenizer)  # reads the whole vocabulary
        self.marking: Tokenizer | None = None
        self.unnormalized: Tokenizer | None = None
        self.chunks: ChunkIds | None = None  # ASCII texts: one dict lookup per chunk
        self.lowercase = False
        if self.continuation is not None and entities is None:
            self.marking = Tokenizer.from_str(tokenizer.to_str())
            self.marking.add_tokens([AddedToken(_MARK, normalized=False, special=False)])
            self.marking.encode_special_tokens = True
            self.mark_id = self.marking.token_to_id(_MARK)
            normalizer = tokenizer.normalizer
            if isinstance(normalizer, normalizers.BertNormalizer):
                # On ASCII text without controls BertNormalizer only turns \t and \n into
                # spaces (which the BERT pre-tokenizer splits on as it splits on spaces) and,
                # when it lowercases, lowercases (accents: none in ASCII). So such texts
                # skip it: str.lower() when needed, then a copy without the normalizer
                # (about a quarter of encode_batch_fast's CPU on short English documents).
                self.unnormalized = Tokenizer.from_str(self.marking.to_str())
                self.unnormalized.normalizer = None
                self.unnormalized.encode_special_tokens = True
                self.lowercase = bool(normalizer.lowercase)
                if _chunks_compose(self.unnormalized, self.mark_id):
                    self.chunks = ChunkIds(self.unnormalized, self.mark_id)
        self.batched_documents = 0  # how many documents took the batch path (for tests)
        self.unnormalized_documents = 0  # of which skipped the normalizer (for tests)

    def __call__(self, texts: list[str], languages: list[str]) -> list[list[Piece]]:
        """Each document's pieces."""
        return self.batch(texts, languages).to_lists(len(texts))

    def batch(self, texts: list[str], languages: list[str]) -> PieceBatch:
        """The pieces of all the documents, concatenated in document order."""
        if len(texts) != len(languages):
            raise ValueError(f"{len(texts)} texts but {len(languages)} languages")
        batch, other = [], []
        if self.marking is not None:
            probe = _DOC.join(texts)
            clean_batch = _MARK not in probe and probe.count(_DOC) == len(texts) - 1
            if clean_batch and "zh" not in languages:  # every text takes the batch path
                batch = list(range(len(texts)))
        if not batch:
            for i, (text, language) in enumerate(zip(texts, languages, strict=True)):
                if (
                    self.marking is not None
                    and language != "zh"
                    and _MARK not in text
                    and _DOC not in text
                ):
                    batch.append(i)
                else:
                    other.append(i)
        found: list[PieceBatch] = []
        if batch:
            done = self._batch_path([texts[i] for i in batch] if other else texts)
            if done is None:  # a mark did not come out as one token: never seen, but safe
                other = sorted(other + batch)
            else:
                self.batched_documents += len(batch)
                if other:
                    done.docs = np.asarray(batch, dtype=np.int64)[done.docs]
                found.append(done)
        if other:
            encodings = self.tokenizer.encode_batch(
                [texts[i] for i in other], add_special_tokens=False
            )
            pieces = [
                segment_encoding(
                    texts[i],
                    languages[i],
                    encoding,
                    self.max_doc_tokens,
                    self.specials,
                    self.unk,
                    self.entities,
                    self.continuation,
                )
                for i, encoding in zip(other, encodings, strict=True)
            ]
            found.append(PieceBatch.from_pieces(pieces, other))
        if not found:
            return PieceBatch.empty(self.entities is not None)
        return PieceBatch.merge(found) if len(found) > 1 else found[0]

    def _encode_ids(self, texts: list[str], marked: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the marked texts (``marked``: joined by ``_DOC``), concatenated
        (int32), and each text's count.

        Texts that are ASCII without controls skip the normalizer (see __init__): through
        ``chunks`` when there is one, else ``encode_batch_fast`` of the copy without it; the
        others through ``marking``."""
        probe = "\n".join(texts)  # a newline is no control
        skip = self.unnormalized is not None
        if skip and probe.isascii() and not _has_ascii_control(probe):
            plain, rest = list(range(len(texts))), []  # the whole batch at once (usual)
            if self.chunks is not None:
                self.unnormalized_documents += len(plain)
                return self.chunks.batch(marked.lower() if self.lowercase else marked)
        else:
            plain, rest = [], []
            for i, text in enumerate(texts):
                ok = skip and text.isascii() and not _has_ascii_control(text)
                (plain if ok else rest).append(i)
        self.unnormalized_documents += len(plain)
        each = marked.split(_DOC)
        parts: list[np.ndarray | None] = [None] * len(texts)
        if plain and self.chunks is not None:
            joined = _DOC.join([each[i] for i in plain])
            ids, lengths = self.chunks.batch(joined.lower() if self.lowercase else joined)
            ends = np.cumsum(lengths)
            for i, a, b in zip(plain, (ends - lengths).tolist(), ends.tolist(), strict=True):
                parts[i] = ids[a:b]
            plain = []
        for rows, tokenizer, lower in (
            (plain, self.unnormalized, self.lowercase),
            (rest, self.marking, False),
        ):
            if rows:
                batch = [each[i].lower() if lower else each[i] for i in rows]
                encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
                for i, encoding in zip(rows, encodings, strict=True):
                    parts[i] = np.array(encoding.ids, dtype=np.int32)
        lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        return np.concatenate(parts) if parts else np.zeros(0, np.int32), lengths

    def _batch_path(self, texts: list[str]) -> PieceBatch | None:
        """The batch path (see the class docstring); None if a mark did not come out as
        its one token (never seen, but then the offsets path is safe)."""
        marked = _mark_joined(texts)
        ids, doc_lengths = self._encode_ids(texts, marked)
        is_mark = ids == self.mark_id
        marks = np.flatnonzero(is_mark)
        if len(marks) != marked.count(_MARK):
            return None
        tokens = ids[~is_mark]
        # Each mark is one token, so a document's marks are the mark tokens in its ids.
        n_docs = len(texts)
        doc_of_id = np.repeat(np.arange(n_docs), doc_lengths)
        doc_of_mark = doc_of_id[marks]
        n_marks = np.bincount(doc_of_mark, minlength=n_docs)
        # Token offsets of the documents in the batch, [d] to [d + 1] for document d.
        doc_starts = np.zeros(n_docs + 1, dtype=np.int64)
        np.cumsum(doc_lengths - n_marks, out=doc_starts[1:])
        # A mark's token offset: its index among all ids minus the marks before it. Sentence
        # ends strictly inside their document count (text before a mark may hold no token,
        # nor the text after it); two marks with no token between them are one end.
        sent_ends = marks - np.arange(len(marks))
        inside = (sent_ends > doc_starts[doc_of_mark]) & (sent_ends < doc_starts[doc_of_mark + 1])
        sent_ends = _sorted_unique(sent_ends[inside])
        # Word starts: the ids that are not "##" pieces (sentence and document starts
        # among them: a "##" piece never follows a pre-token boundary).
        words = ~self.continuation[tokens]
        # A special token written without punctuation ("SEP") is a word the model knows.
        if len(self.specials) and (tokens <= self.specials[-1]).any():
            tokens[np.isin(tokens, self.specials)] = self.unk
        has_tokens = doc_starts[1:] > doc_starts[:-1]
        doc_ends = doc_starts[1:][has_tokens]
        docs = np.flatnonzero(has_tokens)
        ends = doc_ends
        sents = np.sort(np.concatenate([sent_ends, doc_ends]))
        long = np.flatnonzero(doc_lengths - n_marks > self.max_doc_tokens)
        if len(long):  # cut long documents into pieces (see _pieces)
            cuts = []
            for d in long.tolist():
                a, b = int(doc_starts[d]), int(doc_starts[d + 1])
                s0, s1 = np.searchsorted(sents, [a, b], side="right")
                local_words = np.flatnonzero(words[a:b])
                cuts.extend(a + c for c in _cut_points(b - a, sents[s0:s1] - a, local_words,
                                                       self.max_doc_tokens)[:-1])  # fmt: skip
            cuts = np.asarray(cuts, dtype=np.int64)
            words[cuts] = True  # a piece starts with a word
            ends = np.sort(np.concatenate([doc_ends, cuts]))
            sents = _sorted_unique(np.sort(np.concatenate([sents, cuts])))
            docs = np.flatnonzero(has_tokens)[np.searchsorted(doc_ends, ends, side="left")]
        return PieceBatch(tokens, ends, sents, words, None, docs)


@dataclass
class PieceBatch:
    """The pieces of a batch of documents, concatenated: what a writer stores, without
    a Python object per document. Piece p is ``tokens[ends[p - 1]:ends[p]]``; offsets
    are into ``tokens``."""

    tokens: np.ndarray  # int32 token ids
    ends: np.ndarray  # int64 [n_pieces] end offset of each piece (ascending)
    sents: np.ndarray  # int64 sentence ends, ascending; every piece end among them
    words: np.ndarray  # bool [n_tokens] word-start flags; every piece start among them
    spans: np.ndarray | None  # int64 (n, 2) [start, end) entity spans, inside a piece
    docs: np.ndarray  # int64 [n_pieces] the document (index in the batch) of each piece

    @property
    def n_pieces(self) -> int:
        return int(self.ends.shape[0])

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    @classmethod
    def empty(cls, with_spans: bool = False) -> PieceBatch:
        i64 = np.zeros(0, dtype=np.int64)
        spans = np.zeros((0, 2), dtype=np.int64) if with_spans else None
        return cls(np.zeros(0, np.int32), i64, i64, np.zeros(0, bool), spans, i64)

    @classmethod
    def from_pieces(cls, pieces: list[list[Piece]], docs: list[int] | None = None) -> PieceBatch:
        """From each document's pieces (document d is ``docs[d]``, default d)."""
        flat = [p for doc_pieces in pieces for p in doc_pieces]
        if docs is None:
            docs = list(range(len(pieces)))
        doc_of = np.repeat(np.asarray(docs, dtype=np.int64),
                           [len(doc_pieces) for doc_pieces in pieces])  # fmt: skip
        if not flat:
            batch = cls.empty(with_spans=False)
            batch.docs = doc_of
            return batch
        lengths = np.fromiter((p.n_tokens for p in flat), dtype=np.int64, count=len(flat))
        ends = np.cumsum(lengths)
        starts = (ends - lengths).tolist()
        words = np.zeros(int(ends[-1]), dtype=bool)
        words[np.concatenate([p.words + a for p, a in zip(flat, starts, strict=True)])] = True
        spans = None
        if any(p.spans is not None for p in flat):
            spans = np.concatenate(
                [np.zeros((0, 2), np.int64)]
                + [
                    p.spans.astype(np.int64) + a
                    for p, a in zip(flat, starts, strict=True)
                    if p.spans is not None
                ]  # fmt: skip
            )
        return cls(
            tokens=np.concatenate([p.tokens for p in flat]).astype(np.int32, copy=False),
            ends=ends,
            sents=np.concatenate(
                [p.sents.astype(np.int64) + a for p, a in zip(flat, starts, strict=True)]
            ),
            words=words,
            spans=spans,
            docs=doc_of,
        )

    def select(self, keep: np.ndarray) -> PieceBatch:
        """The pieces where ``keep`` (bool per piece) holds, in order."""
        if keep.all():
            return self
        starts, ends = self.starts, self.ends
        lengths = ends - starts
        kept_lengths = lengths[keep]
        new_ends = np.cumsum(kept_lengths)
        shift = np.zeros(self.n_pieces, dtype=np.int64)  # new offset - old, per kept piece
        shift[keep] = (new_ends - kept_lengths) - starts[keep]
        tokens_kept = np.repeat(keep, lengths)
        # A sentence end belongs to the piece it ends or lies in; a span to the one it starts in.
        sent_piece = np.searchsorted(ends, self.sents, side="left")
        sent_keep = keep[sent_piece]
        spans = None
        if self.spans is not None:
            span_piece = np.searchsorted(ends, self.spans[:, 0], side="right")
            span_keep = keep[span_piece] if len(self.spans) else np.zeros(0, bool)
            spans = self.spans[span_keep] + shift[span_piece[span_keep]][:, None]
        return PieceBatch(
            tokens=self.tokens[tokens_kept],
            ends=new_ends,
            sents=self.sents[sent_keep] + shift[sent_piece[sent_keep]],
            words=self.words[tokens_kept],
            spans=spans,
            docs=self.docs[keep],
        )

    def to_lists(self, n_docs: int) -> list[list[Piece]]:
        """Each document's pieces (``Segmenter``'s answer)."""
        out: list[list[Piece]] = [[] for _ in range(n_docs)]
        starts = self.starts.tolist()
        ends = self.ends.tolist()
        s_at = np.searchsorted(self.sents, self.starts, side="right").tolist()
        s_to = np.searchsorted(self.sents, self.ends, side="right").tolist()
        word_starts = np.flatnonzero(self.words)
        w_at = np.searchsorted(word_starts, self.starts, side="left").tolist()
        w_to = np.searchsorted(word_starts, self.ends, side="left").tolist()
        if self.spans is not None:
            p_at = np.searchsorted(self.spans[:, 0], self.starts, side="left").tolist()
            p_to = np.searchsorted(self.spans[:, 0], self.ends, side="left").tolist()
        for p, d in enumerate(self.docs.tolist()):
            a = starts[p]
            spans = None
            if self.spans is not None:
                spans = (self.spans[p_at[p] : p_to[p]] - a).astype(np.int32).reshape(-1, 2)
            out[d].append(
                Piece(
                    tokens=self.tokens[a : ends[p]],
                    sents=(self.sents[s_at[p] : s_to[p]] - a).astype(np.int32),
                    words=(word_starts[w_at[p] : w_to[p]] - a).astype(np.int32),
                    spans=spans,
                )
            )
        return out

    @staticmethod
    def merge(batches: list[PieceBatch]) -> PieceBatch:
        """One batch of the pieces of several, ordered by document (stable)."""
        batches = [b for b in batches if b.n_pieces]
        if len(batches) == 1:
            return batches[0]
        if not batches:
            return PieceBatch.empty()
        offsets = np.cumsum([0] + [len(b.tokens) for b in batches])
        cat = PieceBatch(
            tokens=np.concatenate([b.tokens for b in batches]),
            ends=np.concatenate([b.ends + o for b, o in zip(batches, offsets, strict=False)]),
            sents=np.concatenate([b.sents + o for b, o in zip(batches, offsets, strict=False)]),
            words=np.concatenate([b.words for b in batches]),
            spans=None
            if all(b.spans is None for b in batches)
            else np.concatenate(
                [np.zeros((0, 2), np.int64)]
                + [
                    b.spans + o
                    for b, o in zip(batches, offsets, strict=False)
                    if b.spans is not None
                ]
            ),
            docs=np.concatenate([b.docs for b in batches]),
        )
        order = np.argsort(cat.docs, kind="stable")
        if np.array_equal(order, np.arange(len(order))):
            return cat
        return cat.reorder(order)

    def reorder(self, order: np.ndarray) -> PieceBatch:
        """The pieces in the order ``order`` (a permutation of the piece indexes)."""
        starts, ends = self.starts, self.ends
        lengths = ends - starts
        new_lengths = lengths[order]
        new_ends = np.cumsum(new_lengths)
        new_starts = new_ends - new_lengths
        shift = np.empty(self.n_pieces, dtype=np.int64)
        shift[order] = new_starts - starts[order]
        gather = np.repeat(starts[order] - new_starts, new_lengths) + np.arange(int(new_ends[-1]))
        sent_piece = np.searchsorted(ends, self.sents, side="left")
        sents = np.sort(self.sents + shift[sent_piece])
        spans = None
        if self.spans is not None:
            span_piece = np.searchsorted(ends, self.spans[:, 0], side="right")
            spans = self.spans + shift[span_piece][:, None]
            spans = spans[np.argsort(spans[:, 0], kind="stable")]
        return PieceBatch(self.tokens[gather], new_ends, sents, self.words[gather], spans,
                          self.docs[order])  # fmt: skip


def process_documents(
    texts: list[str],
    languages: list[str],
    tokenizer: Tokenizer,
    max_doc_tokens: int,
    entities: re.Pattern[str] | None = None,
) -> list[list[Piece]]:
    """Pieces of each document of a batch (a ``Segmenter`` for one call; a caller that
    segments many batches keeps one, which reads the vocabulary once)."""
    return Segmenter(tokenizer, max_doc_tokens, entities)(texts, languages)


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
