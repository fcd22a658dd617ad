"""The fast paths of `plm data prepare` give exactly what the plain ways give.

Each speed-up of the prepare workers' work (tar headers from a template, the one-class sentence
regex, word starts from WordPiece ids, the ASCII control check, the packed batch rows)
is checked here against the slower reference it replaced, on real text and on edge
cases, so the shards stay byte-identical.
"""

import io
import json
import random
import re
import tarfile

import numpy as np
import pytest
import webdataset as wds

from pipeline.data.shards import _tar_header
from pipeline.prepare import clean as clean_mod
from pipeline.prepare import segment
from pipeline.prepare.clean import clean
from pipeline.prepare.readers import CORPORA_DIR
from pipeline.prepare.segment import _sorted_unique, sentence_ends, wordpiece_continuations
from pipeline.prepare.tokenizer import TokenizerSpec, load_tokenizer, train_tokenizer

ZH = (CORPORA_DIR / "zh_sample.txt").read_text(encoding="utf-8").split("\n\n")


def _en_docs(n: int = 80) -> list[str]:
    from pydoc_data.topics import topics

    return [clean(topics[k]) for k in sorted(topics)[:n]]


# -- tar headers --------------------------------------------------------------------------


def tarfile_header(name: str, size: int) -> bytes:
    """The header webdataset's TarWriter gets from tarfile: its TarInfo, the stream's
    default (pax) format, tarfile's encoding."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o644, "", ""
    return info.tobuf(tarfile.DEFAULT_FORMAT, tarfile.ENCODING, "surrogateescape")


NAMES = [
    "a.b",
    "0123456789abcdef-0000000001-0000.meta.json",
    "k" * 89 + ".tokens.npy",  # exactly 100 bytes: the longest plain ustar name
    "k" * 90 + ".tokens.npy",  # 101: tarfile writes a pax header first
    "clé-ключ-键.npy",  # non-ASCII: a pax header with the UTF-8 path
]
SIZES = [0, 1, 511, 512, 513, 0o7777777, 0o7777777 + 1, 2**21 + 5, 8**11 - 1, 8**11, 8**11 + 7]


@pytest.mark.parametrize("name", NAMES)
def test_tar_header_template_equals_tarfile(name):
    for size in SIZES:  # past 7 octal digits (2 MiB) and past 11 (8 GiB: pax size record)
        assert _tar_header(name, size) == tarfile_header(name, size), (name, size)


def test_tar_header_template_equals_webdataset_stream():
    """The first member of a TarWriter sample of 2 MiB + 5 bytes starts with our header."""
    data = bytes(range(256)) * (2**13) + b"12345"
    for key in ("0123456789abcdef-0000000001-0000", "x" * 95, "ключ"):
        buf = io.BytesIO()
        with wds.TarWriter(buf, user="", group="", mode=0o644, mtime=0) as tar:
            tar.write({"__key__": key, "bin": data})
        header = _tar_header(f"{key}.bin", len(data))
        assert buf.getvalue()[: len(header)] == header


# -- sentence ends ------------------------------------------------------------------------

# The two-branch form the one-class regex replaced (the same closers and CJK classes).
_REFERENCE = re.compile(
    f"([。！？；…]+){segment._CLOSERS}|([.!?;]+){segment._CLOSERS}(?=[\\s{segment._CJK_CHARS}])"
)


def reference_sentence_ends(text: str) -> list[int]:
    ends, n = [], len(text)
    for m in _REFERENCE.finditer(text):
        end = m.end()
        if end >= n:
            continue
        ascii_run = m.group(2)
        if ascii_run is not None and not segment._CJK_CHAR.match(text, end):
            if ascii_run == ";":
                continue
            if text[end : end + 8].lstrip()[:1].islower():
                continue
        ends.append(end)
    ends.extend(m.start() for m in segment._PARAGRAPH.finditer(text))
    return sorted({e for e in ends if 0 < e < n})


def test_sentence_ends_equal_the_two_branch_regex_on_real_text():
    texts = _en_docs() + ZH + [clean(t) for t in ZH]
    assert [sentence_ends(t) for t in texts] == [reference_sentence_ends(t) for t in texts]


def test_sentence_ends_equal_the_two_branch_regex_on_random_text():
    rng = random.Random(0)
    alphabet = list(".!?;。！？；…\"'”’)]}」』》〉）aZ中“ \n")
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert sentence_ends(text) == reference_sentence_ends(text), repr(text)


def test_batch_marks_equal_sentence_ends():
    """mark_batch's lookahead regexes put marks where sentence_ends finds ends (ends at a
    text's start or end, and repeats, are dropped by the batch path: dropped here too)."""
    rng = random.Random(2)
    alphabet = list(".!?;。！？；…\"'”’)」ab Zé中“（\n\t3ßÉ") + ["e.g. ", "3.11", ". \n\n", "   "]
    texts = _en_docs() + ZH + [clean(t) for t in ZH]
    texts += [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(40000)
    ]
    for i in range(0, len(texts), 300):
        batch = texts[i : i + 300]
        for text, marked in zip(batch, segment.mark_batch(batch), strict=True):
            assert marked.replace(segment._MARK, "") == text
            pieces = marked.split(segment._MARK)
            at = {sum(map(len, pieces[: k + 1])) for k in range(len(pieces) - 1)}
            assert sorted(e for e in at if 0 < e < len(text)) == sentence_ends(text), repr(text)


# -- word starts from WordPiece ids -------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _en_docs(40) + ZH))
    out = {}
    for kind in ("wordpiece", "bpe", "unigram"):
        spec = TokenizerSpec(kind=kind, vocab_size=2000)
        out[kind] = load_tokenizer(train_tokenizer([str(corpus)], spec, root / kind))[0]
    return out


@pytest.mark.slow  # over 5 s: out of the fast tier
def test_wordpiece_word_starts_from_ids_equal_word_ids(trained):
    tok = trained["wordpiece"]
    continuation = wordpiece_continuations(tok)
    assert continuation is not None and continuation.any()
    texts = _en_docs() + ZH + ["## ### #a ##b a##b [UNK] [MASK] x" * 3, "naïve café ÆØÅ " * 5]
    tok.encode_special_tokens = True
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False), strict=True):
        ids = np.array(enc.word_ids, dtype=np.int64)
        by_word_ids = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        by_ids = np.flatnonzero(~continuation[np.array(enc.ids)])
        assert np.array_equal(by_ids, by_word_ids), text[:60]
        # and the whole segmentation is the same with and without the shortcut
        for lang in ("other", "zh"):
            fast = segment.segment_encoding(text, lang, enc, 64, continuation=continuation)
            slow = segment.segment_encoding(text, lang, enc, 64)
            assert len(fast) == len(slow)
            for a, b in zip(fast, slow, strict=True):
                assert np.array_equal(a.tokens, b.tokens)
                assert np.array_equal(a.sents, b.sents)
                assert np.array_equal(a.words, b.words)


def test_word_start_shortcut_only_for_wordpiece(trained):
    assert wordpiece_continuations(trained["bpe"]) is None
    assert wordpiece_continuations(trained["unigram"]) is None


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list('.!?;。！？…"”)」ab Z中文\n\t\u3000\u0301é\ufffd') + [
        "  ", "\n\n", "e.g. x", "3.11", "[MASK]", "##ing", "Ab. Cd", "x" * 120, "QRS", "a; B",
    ]  # fmt: skip
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


@pytest.mark.slow  # over 5 s: out of the fast tier
@pytest.mark.parametrize("lowercase", [False, True])
def test_segmenter_batch_path_equals_the_offsets_path(trained, tmp_path, lowercase):
    """Sentence marks + encode_batch_fast give the pieces encode_batch + offsets give."""
    tok = trained["wordpiece"]
    if lowercase:  # BertNormalizer lowercasing and stripping accents (NFD per character)
        corpus = tmp_path / "c.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _en_docs(40) + ZH))
        spec = TokenizerSpec(kind="wordpiece", vocab_size=2000, lowercase=True)
        tok = load_tokenizer(train_tokenizer([str(corpus)], spec, tmp_path / "tok"))[0]
    texts = _en_docs() + [clean(t) for t in ZH] + _random_texts(1, 3000)
    texts += ["\ufffd\ufffd", "a" * 300 + ". " + "b" * 300]  # no token at all; [UNK] words
    rng = random.Random(3)  # ASCII only (the texts that skip the normalizer)
    ascii_parts = list("aZ.!?;,'\")#\n\t 3") + ["  ", "Ab. cd", "[SEP]", "##x", "e.g. y", "Hello"]
    texts += [
        "".join(rng.choice(ascii_parts) for _ in range(rng.randint(1, 40))) for _ in range(1500)
    ]
    languages = ["other"] * len(texts)
    for max_doc_tokens in (7, 64, 100_000):
        segmenter = segment.Segmenter(tok, max_doc_tokens)
        got = [
            p
            for i in range(0, len(texts), 256)
            for p in segmenter(texts[i : i + 256], languages[i : i + 256])
        ]
        assert segmenter.batched_documents == len(texts)  # no fallback to the other path
        # ASCII texts skipped the normalizer, the others did not
        n_ascii = sum(t.isascii() for t in texts)
        assert 1000 < segmenter.unnormalized_documents == n_ascii < len(texts)
        encodings = tok.encode_batch(texts, add_special_tokens=False)
        for text, enc, pieces in zip(texts, encodings, got, strict=True):
            want = segment.segment_encoding(
                text, "other", enc, max_doc_tokens, segmenter.specials, segmenter.unk
            )
            assert len(pieces) == len(want), repr(text)
            for a, b in zip(pieces, want, strict=True):
                assert a.tokens.tolist() == b.tokens.tolist(), repr(text)
                assert a.sents.tolist() == b.sents.tolist(), repr(text)
                assert a.words.tolist() == b.words.tolist(), repr(text)
                assert a.tokens.dtype == b.tokens.dtype and a.sents.dtype == np.int32


def _ascii_texts(seed: int, n: int) -> list[str]:
    """ASCII without controls but the mark: the texts ``ChunkIds`` takes."""
    rng = random.Random(seed)
    parts = list("aZ.!?;,'\")#\n\t 3-_~") + [segment._MARK, "  ", "Ab. cd", "[SEP]", "[MASK]",
             "##x", "e.g. y", "Hello", "x" * 99, "y" * 101, "1" * 150, "naive", "HELLO"]  # fmt: skip
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(0, 40))) for _ in range(n)]
    return texts + ["", " ", "\n\t", segment._MARK, _en_docs(1)[0]]


@pytest.mark.parametrize("capacity", [3, 50, 1 << 17])
def test_chunk_ids_equal_the_tokenizer(trained, capacity):
    """One dict lookup per blank-separated chunk gives encode_batch_fast's ids, across
    table resets (a small capacity) and through the per-chunk fallback."""
    segmenter = segment.Segmenter(trained["wordpiece"], 64)
    assert segmenter.chunks is not None
    tok = segmenter.unnormalized
    chunks = segment.ChunkIds(tok, segmenter.mark_id, capacity=capacity)
    texts = _ascii_texts(5, 2000) + [t for t in _en_docs() if t.isascii()]
    for i in range(0, len(texts), 100):
        batch = texts[i : i + 100]
        want = [e.ids for e in tok.encode_batch_fast(batch, add_special_tokens=False)]
        ids, lengths = chunks.batch(segment._DOC.join(batch))
        assert ids.dtype == np.int32 and lengths.tolist() == [len(w) for w in want]
        assert ids.tolist() == [t for w in want for t in w]
        assert [chunks(t).tolist() for t in batch[:20]] == want[:20]
        # bounded: a full table is emptied (one batch's own chunks always fit)
        assert len(chunks.index) <= max(capacity, 2 + len({c for t in batch for c in t.split()}))
    assert chunks.misses < sum(len(t.split()) for t in texts)  # some were looked up
    chunks.doc_id = -5  # as if the cuts did not come out as single tokens: per chunk
    chunks._reset()
    batch = texts[:300]
    want = [e.ids for e in tok.encode_batch_fast(batch, add_special_tokens=False)]
    assert chunks.batch(segment._DOC.join(batch))[0].tolist() == [t for w in want for t in w]


def test_chunk_ids_only_where_chunks_compose(trained):
    """A non-special added token can match across chunks, truncation cuts a whole text:
    then ``ChunkIds`` is not used (the same pieces as the offsets path)."""
    from tokenizers import Tokenizer

    texts = [t for t in _en_docs(30) if t.isascii()]
    texts += ["an added one: xq7z and xq7zxq7z", "yy " * 300]
    languages = ["other"] * len(texts)
    want = segment.Segmenter(trained["wordpiece"], 64)
    for change in ("added", "truncation"):
        tok = Tokenizer.from_str(trained["wordpiece"].to_str())
        if change == "added":
            tok.add_tokens(["xq7z"])
        else:
            tok.enable_truncation(100)
        segmenter = segment.Segmenter(tok, 64)
        assert segmenter.chunks is None and segmenter.unnormalized is not None
        got = segmenter(texts, languages)
        # (truncation cuts marks off: those batches fall back to the offsets path)
        assert segmenter.batched_documents == (len(texts) if change == "added" else 0)
        reference = segment.Segmenter(Tokenizer.from_str(tok.to_str()), 64)
        reference.marking = None  # the offsets path: encode_batch and offsets
        for a_pieces, b_pieces in zip(got, reference(texts, languages), strict=True):
            assert [p.tokens.tolist() for p in a_pieces] == [p.tokens.tolist() for p in b_pieces]
            assert [p.sents.tolist() for p in a_pieces] == [p.sents.tolist() for p in b_pieces]
    assert want.chunks is not None


def test_segmenter_routes_chinese_entities_and_other_kinds_to_the_offsets_path(trained):
    texts, languages = [_en_docs(1)[0], clean(ZH[0]), "a\x00b. Cd ef."], ["other", "zh", "other"]
    segmenter = segment.Segmenter(trained["wordpiece"], 64)
    assert all(segmenter(texts, languages))
    assert segmenter.batched_documents == 1  # Chinese and a text holding the mark go around
    with_entities = segment.Segmenter(trained["wordpiece"], 64, segment.entity_pattern(["x"]))
    with_entities(texts, languages)
    assert with_entities.batched_documents == 0
    for kind in ("bpe", "unigram"):
        other_kind = segment.Segmenter(trained[kind], 64)
        assert all(other_kind(texts, languages)) and other_kind.batched_documents == 0


def test_segmenter_falls_back_to_the_offsets_path_when_the_marks_do_not_add_up(trained):
    texts = _en_docs(20)
    languages = ["other"] * len(texts)
    want = segment.Segmenter(trained["wordpiece"], 64)(texts, languages)
    segmenter = segment.Segmenter(trained["wordpiece"], 64)
    segmenter.mark_id = -1  # as if a mark had not come out as its one token
    got = segmenter(texts, languages)
    assert segmenter.batched_documents == 0
    for a_pieces, b_pieces in zip(got, want, strict=True):
        assert [p.tokens.tolist() for p in a_pieces] == [p.tokens.tolist() for p in b_pieces]
        assert [p.sents.tolist() for p in a_pieces] == [p.sents.tolist() for p in b_pieces]
        assert [p.words.tolist() for p in a_pieces] == [p.words.tolist() for p in b_pieces]


def test_segmenter_batch_path_turns_a_special_spelled_as_a_word_into_unk():
    """A special token without punctuation ("SEP") is a plain word to the pre-tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {"[UNK]": 0, "SEP": 1, "a": 2, "b": 3, "##b": 4, ".": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(["[UNK]", "SEP"])
    segmenter = segment.Segmenter(tok, 64)
    [[piece]] = segmenter(["a SEP abb. SEP b"], ["other"])
    assert segmenter.batched_documents == 1
    assert piece.tokens.tolist() == [2, 0, 2, 4, 4, 5, 0, 3]
    assert piece.sents.tolist() == [6, 8] and piece.words.tolist() == [0, 1, 2, 5, 6, 7]


def test_sorted_unique_equals_np_unique():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 5, 100):
        values = np.sort(rng.integers(0, 10, n))
        assert np.array_equal(_sorted_unique(values), np.unique(values))


# -- cleaning -----------------------------------------------------------------------------


def test_ascii_control_check_matches_the_regex():
    for c in range(128):
        text = f"ab{chr(c)}cd"
        assert clean_mod._has_ascii_control(text) == bool(clean_mod._CONTROL.search(text))
    assert clean("a\x00b\x7fc\x1fd long enough text") == "abcd long enough text"


def _fold_whitespace_with_regexes(text: str) -> str:
    """The whitespace folding `clean` did with regexes before the str.replace passes."""
    text = re.sub(r"[^\S\n]+", " ", text)
    text = re.sub(r" ?\n ?", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def test_whitespace_folding_equals_the_regexes():
    from pydoc_data.topics import topics

    rng = random.Random(0)
    alphabet = ["a", "b", " ", " ", "\t", "\n", "\n", "é", "\u3000", "\u00a0", "."]
    texts = [topics[k] for k in sorted(topics)]  # indented code, blank lines
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    texts += [" " * 17 + "x\t \t y \n \n\n \n  z  ", "\t\t\n\t \n", "a" + " " * 1000 + "b"]
    for text in texts:
        # Controls and normalization are not what is compared: take them out first.
        text = clean(text, clean_mod.CleanConfig(fold_whitespace=False))
        assert clean(text) == _fold_whitespace_with_regexes(text), repr(text)


@pytest.mark.parametrize("fold", [True, False])
def test_clean_many_equals_clean_of_each(fold):
    """The batch check (ASCII, no control, nothing to fold) gives what clean gives, on
    batches that pass it and batches that do not."""
    rng = random.Random(5)
    cfg = clean_mod.CleanConfig(fold_whitespace=fold)
    plain = ["ab", "Cd.", "x y", "1,2"]
    odd = [
        "\t",
        "  ",
        " \n",
        "\n ",
        "\n\n\n",
        "\r",
        "\x00",
        "\x7f",
        "é",
        "\u3000",
        "ＡＢ",
        "\n",
        " z",
        "w ",
    ]
    fast = 0
    for case in range(400):
        parts = plain + (odd if case % 2 else [])
        texts = ["".join(rng.choice(parts) for _ in range(rng.randint(0, 6))) for _ in range(8)]
        probe = "\n".join(texts)  # the batch check passes: nothing but strip() to do
        fast += probe.isascii() and not any(
            p in probe for p in ("\t", "  ", " \n", "\n ", "\n\n\n", "\r", "\x00", "\x7f")
        )
        assert clean_mod.clean_many(texts, cfg) == [clean(t, cfg) for t in texts], texts
    assert fast > 100
    assert clean_mod.clean_many([], cfg) == []


# -- packed batch rows --------------------------------------------------------------------


# -- the txt reader -----------------------------------------------------------------------


def reference_iter_txt(source, max_doc_bytes: int):
    """The txt reader before the chunked one: a Python loop over bounded lines."""
    from pipeline.prepare.readers import (
        RawDocument,
        _bounded_lines,
        _decode,
        _open_text_stream,
        _strip_bom,
    )

    ordinal, parts, size, too_long, start = 0, [], 0, False, 0

    def flush():
        if too_long:
            detail = f"over {max_doc_bytes} bytes"
            return RawDocument(source.uri, ordinal, None, "too_long", start, detail)
        text, reject, detail = _decode(b"".join(parts))
        return RawDocument(source.uri, ordinal, text and text.strip(), reject, start, detail)

    with _open_text_stream(source) as stream:
        for number, line in enumerate(_bounded_lines(stream, max_doc_bytes), start=1):
            if line is not None:
                line = _strip_bom(line, number == 1)
            if line is not None and not line.strip():
                if parts or too_long:
                    yield flush()
                    ordinal += 1
                parts, size, too_long = [], 0, False
                continue
            if not parts and not too_long:
                start = number
            if line is None or size + len(line) > max_doc_bytes:
                too_long, parts, size = True, [], 0
            elif not too_long:
                parts.append(line)
                size += len(line)
        if parts or too_long:
            yield flush()


def check_chunked_txt_reader(tmp_path, cases: int, seed: int) -> None:
    from pipeline.prepare.readers import _iter_txt, resolve_inputs

    rng = random.Random(seed)
    pieces = [b"a", b"b ", b" ", b"\t", b"\r", b"\x0b", b"\n", b"\n", b"\n\n", b"\r\n",
              b"\xff", b"\x00", "\u00e9".encode(), b"aaaaaaaaaaa", b"           "]  # fmt: skip
    path = tmp_path / "c.txt"
    for case in range(cases):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        if case % 50 == 0:  # a BOM; the old loop counted it toward the limit, the new not
            data = b"\xef\xbb\xbf" + data
            max_doc_bytes = len(data) + rng.randint(0, 5)
        else:
            max_doc_bytes = rng.randint(1, 24)
        path.write_bytes(data)
        [source] = resolve_inputs([str(path)])
        want = list(reference_iter_txt(source, max_doc_bytes))
        for chunk_size in (1, 2, 3, 7, 1 << 20):
            got = list(_iter_txt(source, max_doc_bytes, chunk_size=chunk_size))
            assert got == want, (data, max_doc_bytes, chunk_size)


def test_chunked_txt_reader_equals_the_line_loop(tmp_path):
    check_chunked_txt_reader(tmp_path, 3000, seed=2)


# -- the jsonl reader ---------------------------------------------------------------------


def reference_iter_jsonl(source, max_doc_bytes: int, part=None):
    """The jsonl reader before the pyarrow batches: json.loads line by line."""
    from pipeline.prepare.readers import (
        RawDocument,
        _bounded_lines,
        _jsonl_line,
        _open_text_stream,
        _read_error,
        _strip_bom,
        _truncated,
    )

    ordinal, number = 0, 0
    start, end = (part.start, part.end) if part else (0, None)
    with _open_text_stream(source, start, end) as stream:
        for number, line in enumerate(_bounded_lines(stream, max_doc_bytes), start=1):
            if line is not None and not line.endswith(b"\n") and _read_error(stream):
                break
            if line is None:
                detail = f"over {max_doc_bytes} bytes"
                yield RawDocument(source.uri, ordinal, None, "too_long", number, detail)
                ordinal += 1
                continue
            line = _strip_bom(line, number == 1 and start == 0)
            if not line.strip():
                continue
            yield _jsonl_line(source, ordinal, number, line, source.text_field)
            ordinal += 1
        if error := _read_error(stream):
            yield _truncated(source, ordinal, number, error)


# Lines pyarrow reads like json.loads, and lines where the two could differ.
JSONL_LINES = [
    b'{"text": "plain words here"}',
    b'{"text": "x", "meta": {"text": 1, "n": [1, 2.5, null, true]}}',
    b'  {"id": 7, "text": "spaces around"}  ',
    b'{"text": "escapes \\t \\n \\" \\\\ \\/ \\u00e9 \\ud83d\\ude00"}',
    b'{"te\\u0078t": "an escaped key"}',
    '{"text": "caf\u00e9 \u4e2d\u6587"}'.encode(),
    b'{"text": "x", "big": 123456789012345678901234567890, "f": NaN, "g": -Infinity}',
    b'{"text": "x", "e": 1e400}',  # pyarrow refuses a double overflow, json.loads reads it
    b'{"text": null}',
    b'{"other": "no text field"}',
    b"{}",
    b'{"text": 5}',
    b'{"text": ["a"]}',
    b'{"text": {"a": 1}}',
    b"[1, 2]",
    b'"a string"',
    b'{"text": "a", "text": "twice"}',
    b'{"text": "a"} {"text": "two objects"}',
    b'{"text": "a"} trailing',
    b'{"text": "unclosed"',
    b'{"text": "lone \\ud800 surrogate"}',
    b'{"text": "x", "o": "\\udc00"}',
    b'{"text": "escaped \\u0000 nul"}',
    b'{"text": "raw \x00 nul"}',
    b'{"text": "x"}\x00',
    b'{"text": "bad \xff utf8"}',
    b'{"text": "x", "o": "bad \xc0\xaf utf8 elsewhere"}',
    b'{"text": "raw\ttab"}',
    b"\xef\xbb\xbf" + b'{"text": "a BOM inside the file"}',
    b' \xef\xbb\xbf{"text": "a BOM after a blank"}',
    '{"text": "a BOM \ufeff in the text"}'.encode(),
    b"",
    b"   ",
    b"\r",
    b'{"text": "' + b"y" * 60 + b'"}',  # over the small max_doc_bytes below
]


def check_jsonl_reader(tmp_path, cases: int, seed: int) -> None:
    import gzip

    from pipeline.prepare.readers import Slice, _iter_jsonl, _jsonl_batch_texts, resolve_inputs

    rng = random.Random(seed)
    # Batches without an odd line take the pyarrow path (checked once here).
    assert _jsonl_batch_texts(b'{"text": "a"}\n{"x": 1}\n', 2, "text") == ["a", None]
    for case in range(cases):
        lines = [
            rng.choice(JSONL_LINES[: 7 if case % 3 else None]) for _ in range(rng.randint(0, 30))
        ]
        ends = [rng.choice([b"\n", b"\n", b"\r\n"]) for _ in lines]
        data = b"".join(line + end for line, end in zip(lines, ends, strict=True))
        if case % 5 == 0 and data:
            data = data[: -len(ends[-1])]  # no newline after the last line
        if case % 7 == 0:
            data = b"\xef\xbb\xbf" + data
        name = "c.jsonl.gz" if case % 4 == 0 else "c.jsonl"
        path = tmp_path / name
        packed = gzip.compress(data) if name.endswith(".gz") else data
        if name.endswith(".gz") and case % 8 == 0:
            packed = packed[: len(packed) * 2 // 3]  # a truncated gzip
        path.write_bytes(packed)
        [source] = resolve_inputs([str(path)])
        max_doc_bytes = rng.choice([50, 1 << 20])
        parts = [None]
        if name == "c.jsonl" and len(data) > 20:  # a slice from a line start on
            cut = data.find(b"\n", len(data) // 3) + 1
            if 0 < cut < len(data):
                parts = [Slice(0, 0, cut, size=cut), Slice(0, cut, None, size=len(data) - cut)]
        for part in parts:
            want = list(reference_iter_jsonl(source, max_doc_bytes, part))
            for batch_bytes in (1, 40, 1 << 20):
                got = list(_iter_jsonl(source, max_doc_bytes, part, batch_bytes=batch_bytes))
                assert got == want, (data, max_doc_bytes, part, batch_bytes)


@pytest.mark.slow  # over 5 s: out of the fast tier
def test_pyarrow_jsonl_batches_equal_the_line_by_line_reader(tmp_path):
    check_jsonl_reader(tmp_path, 800, seed=4)


# -- pieces in bulk: PieceBatch and ShardWriter.add_many ----------------------------------


def _random_pieces(rng: np.random.Generator, n_docs: int, with_spans: bool) -> list[list]:
    """Each document's pieces (0-3 of 0-40 tokens; sentence ends and word starts as the
    segmenter gives them: the last sentence end is the piece end, the first word 0)."""
    out = []
    for _ in range(n_docs):
        doc = []
        for _ in range(int(rng.integers(0, 4)) if rng.random() < 0.3 else 1):
            n = int(rng.integers(1, 41))
            sents = np.append(np.sort(rng.choice(np.arange(1, n), min(n - 1, 3), replace=False)), n)
            words = np.insert(
                np.sort(rng.choice(np.arange(1, n), (n - 1) // 2, replace=False)), 0, 0
            )
            spans = None
            if with_spans:
                cuts = np.sort(rng.choice(np.arange(n + 1), 4 if n >= 3 else 2, replace=False))
                spans = cuts.reshape(-1, 2).astype(np.int32)
            doc.append(
                segment.Piece(
                    tokens=rng.integers(5, 60000, n).astype(np.int32),
                    sents=sents.astype(np.int32),
                    words=words.astype(np.int32),
                    spans=spans,
                )
            )
        out.append(doc)
    return out


def _same_pieces(a: list[list], b: list[list]) -> None:
    assert len(a) == len(b)
    for x_doc, y_doc in zip(a, b, strict=True):
        assert len(x_doc) == len(y_doc)
        for x, y in zip(x_doc, y_doc, strict=True):
            assert x.tokens.tolist() == y.tokens.tolist()
            assert x.sents.tolist() == y.sents.tolist()
            assert x.words.tolist() == y.words.tolist()
            assert (x.spans is None) == (y.spans is None)
            if x.spans is not None:
                assert x.spans.tolist() == y.spans.tolist()


@pytest.mark.parametrize("with_spans", [False, True])
def test_piece_batch_round_trips_selects_and_merges(with_spans):
    rng = np.random.default_rng(7)
    for _ in range(40):
        docs = _random_pieces(rng, int(rng.integers(0, 12)), with_spans)
        batch = segment.PieceBatch.from_pieces(docs)
        _same_pieces(batch.to_lists(len(docs)), docs)
        keep = rng.random(batch.n_pieces) < 0.5
        flat = [(d, p) for d, doc in enumerate(docs) for p in doc]
        kept = [[p for (d2, p), k in zip(flat, keep, strict=True) if k and d2 == d]
                for d in range(len(docs))]  # fmt: skip
        _same_pieces(batch.select(keep).to_lists(len(docs)), kept)
        # two halves of the documents, interleaved, merged back into document order
        odd = [d for d in range(len(docs)) if d % 2]
        even = [d for d in range(len(docs)) if not d % 2]
        parts = [
            segment.PieceBatch.from_pieces([docs[d] for d in odd], odd),
            segment.PieceBatch.from_pieces([docs[d] for d in even], even),
        ]
        _same_pieces(segment.PieceBatch.merge(parts).to_lists(len(docs)), docs)


def _write(tmp_path, name, docs, how, rng, block_tokens, stop_docs, stop_bytes, with_spans):
    """Shards of ``docs`` (pieces) written piece by piece (``how`` "each": what the
    workers did) or in random bulk batches; the parts' entries and bytes."""
    from pipeline.data.shards import ShardWriter, local_fs

    root = tmp_path / name
    (root / "train").mkdir(parents=True)
    fs, entries = local_fs(), []
    flat = [(d, p) for d, doc in enumerate(docs) for p in doc]
    sources = [f"src{d % 3}" if d % 17 else f"other{d}" for d, _ in flat]
    languages = ["zh" if d % 5 == 0 else "other" for d, _ in flat]

    def new():
        return ShardWriter(fs, str(root), f"train/part-{len(entries):03d}.tar", f"k{len(entries)}",
                           np.uint16, block_tokens, with_spans)  # fmt: skip

    writer = None
    if how == "each":
        for (_, p), source, language in zip(flat, sources, languages, strict=True):
            writer = writer or new()
            writer.add(p.tokens, p.sents, p.words, p.spans, source, language)
            if (stop_docs and writer.n_docs >= stop_docs) or (
                stop_bytes and writer.size_estimate() >= stop_bytes
            ):
                entries.append(writer.close())
                writer = None
    else:
        i = 0
        while i < len(flat):
            j = min(len(flat), i + int(rng.integers(1, 60)))
            batch = segment.PieceBatch.from_pieces([[p] for _, p in flat[i:j]])
            at = 0
            while at < batch.n_pieces:
                writer = writer or new()
                at, stopped = writer.add_many(batch, sources[i:j], languages[i:j],
                                              stop_docs, stop_bytes, first=at)  # fmt: skip
                if stopped:
                    entries.append(writer.close())
                    writer = None
            i = j
    if writer is not None:
        entries.append(writer.close())
    files = {f.name: f.read_bytes() for f in sorted((root / "train").iterdir())}
    return entries, files


@pytest.mark.parametrize("with_spans", [False, True])
def test_shard_writer_add_many_equals_adding_one_by_one(tmp_path, with_spans):
    rng = np.random.default_rng(11)
    for case in range(30):
        docs = _random_pieces(rng, int(rng.integers(0, 300)), with_spans)
        block_tokens = int(rng.choice([1, 7, 50, 400, 1 << 19]))
        stop_docs = int(rng.integers(1, 120)) if case % 3 == 0 else None
        stop_bytes = int(rng.integers(1, 30_000)) if case % 3 == 1 else None
        args = (block_tokens, stop_docs, stop_bytes, with_spans)
        want = _write(tmp_path, f"each{case}", docs, "each", rng, *args)
        got = _write(tmp_path, f"bulk{case}", docs, "bulk", rng, *args)
        assert got == want, (case, args)


def test_shard_writer_add_many_near_the_block_source_limit(tmp_path, monkeypatch):
    """A block that would reach MAX_BLOCK_SOURCES takes its documents one by one."""
    from pipeline.data import shards

    monkeypatch.setattr(shards, "MAX_BLOCK_SOURCES", 5)
    rng = np.random.default_rng(3)
    docs = _random_pieces(rng, 200, False)
    want = _write(tmp_path, "each", docs, "each", rng, 1 << 19, None, None, False)
    got = _write(tmp_path, "bulk", docs, "bulk", rng, 1 << 19, None, None, False)
    assert got == want and len(want[1]) == 2
