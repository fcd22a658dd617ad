import gzip
import hashlib
import json
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipeline.prepare.readers import (
    Digest,
    InputError,
    hash_docs,
    iter_raw_documents,
    plan_slices,
    python_docs,
    resolve_inputs,
)

DOCS = ["First document.\nIt has two lines.", "Second one, 第二个文档。", "Third!"]


def read_all(inputs, **kw):
    return [
        d for s in resolve_inputs([str(i) for i in inputs], **kw) for d in iter_raw_documents(s)
    ]


def digest_of(source, part=None) -> Digest:
    """Read the source (or slice) to its end with a digest; the digest."""
    digest = Digest()
    for _ in iter_raw_documents(source, part=part, digest=digest):
        pass
    return digest


def texts(inputs, **kw):
    return [d.text for d in read_all(inputs, **kw)]


def write_jsonl(path: Path, docs, field="text") -> bytes:
    data = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)
    return data


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    # BOM, CRLF, several blank lines and a whitespace-only line between documents.
    path.write_bytes(
        b"\xef\xbb\xbfFirst document.\r\nIt has two lines.\r\n\r\n\r\n"
        + "Second one, 第二个文档。\n   \nThird!\n".encode()
    )
    docs = read_all([path])
    assert [d.text.replace("\r\n", "\n") for d in docs] == DOCS
    assert [d.ordinal for d in docs] == [0, 1, 2]
    assert [d.line for d in docs] == [1, 5, 7]
    assert all(d.reject is None and d.source == str(path) for d in docs)


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst"])
def test_jsonl_plain_gzip_zstd_with_a_configurable_field(tmp_path, name):
    write_jsonl(tmp_path / name, DOCS, field="content")
    [source] = resolve_inputs([str(tmp_path / name)], text_field="content")
    assert source.format == name[2:]
    assert [d.text for d in iter_raw_documents(source)] == DOCS


def test_txt_gz_and_zst(tmp_path):
    body = "\n\n".join(DOCS).encode()
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(body))
    (tmp_path / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    assert texts([tmp_path / "a.txt.gz", tmp_path / "b.txt.zst"]) == DOCS + DOCS


def test_parquet_reads_all_row_groups_in_order(tmp_path):
    rows = [f"document number {i}" for i in range(2500)]
    table = pa.table({"id": list(range(2500)), "body": rows})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=700)
    docs = read_all([tmp_path / "t.parquet"], text_field="body")
    assert [d.text for d in docs] == rows
    assert [d.ordinal for d in docs] == list(range(2500))


def test_parquet_without_text_column_names_the_columns(tmp_path):
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(InputError, match=r"no column 'text'.*\['id', 'body'\]"):
        resolve_inputs([str(tmp_path / "t.parquet")])


def test_parquet_null_and_invalid_utf8_values_are_counted(tmp_path):
    table = pa.table({"text": pa.array([b"ok", None, b"\xff\xfe"], type=pa.binary())})
    pq.write_table(table, tmp_path / "t.parquet")
    docs = read_all([tmp_path / "t.parquet"])
    assert [(d.text, d.reject) for d in docs] == [
        ("ok", None),
        (None, "no_text"),
        (None, "invalid_utf8"),
    ]


def test_folder_is_recursive_and_sorted_and_skips_other_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("in b/z")
    (tmp_path / "a.txt").write_text("in a")
    write_jsonl(tmp_path / "b" / "c.jsonl.gz", ["in b/c"])
    (tmp_path / "README.md").write_text("not a corpus file")
    (tmp_path / ".hidden.txt").write_text("hidden")
    assert texts([tmp_path]) == ["in a", "in b/c", "in b/z"]


def test_glob(tmp_path):
    for name in ["x2.txt", "x1.txt", "y.txt"]:
        (tmp_path / name).write_text(name)
    assert texts([tmp_path / "x*.txt"]) == ["x1.txt", "x2.txt"]
    with pytest.raises(InputError, match="matches no"):
        resolve_inputs([str(tmp_path / "nothing*.txt")])


def test_file_uri_for_a_file_and_a_folder(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", DOCS)
    pq.write_table(pa.table({"text": ["from parquet"]}), tmp_path / "d" / "b.parquet")
    uri = f"file://{tmp_path}/d"
    sources = resolve_inputs([uri])
    assert [s.uri for s in sources] == [f"{uri}/a.jsonl", f"{uri}/b.parquet"]
    assert [d.text for s in sources for d in iter_raw_documents(s)] == DOCS + ["from parquet"]
    assert texts([f"{uri}/a.jsonl"]) == DOCS
    local = resolve_inputs([str(tmp_path / "d" / "a.jsonl")])[0]
    assert digest_of(sources[0]).hexdigest() == digest_of(local).hexdigest()
    assert (sources[0].size, sources[0].mtime_ns) == (local.size, local.mtime_ns)
    assert local.mtime_ns == (tmp_path / "d" / "a.jsonl").stat().st_mtime_ns
    with pytest.raises(InputError, match="does not exist"):
        resolve_inputs([f"file://{tmp_path}/missing.jsonl"])


def test_reading_with_a_digest_hashes_exactly_the_stored_bytes(tmp_path):
    """The digest the write tasks report is the file's sha256 (`sha256sum` of it), for
    every format, also for a compressed file that breaks off (its unread rest counts)."""
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    files = {
        "a.txt": "\n\n".join(DOCS).encode(),
        "b.jsonl": lines,
        "c.jsonl.gz": gzip.compress(lines),
        "d.txt.zst": zstandard.ZstdCompressor().compress("\n\n".join(DOCS).encode()),
        "e.jsonl.gz": gzip.compress(lines * 50)[:-30],  # cut: the last documents are lost
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "f.parquet")
    for source in resolve_inputs([str(tmp_path)]):
        stored = Path(source.uri).read_bytes()
        digest = digest_of(source)
        assert digest.hexdigest() == hashlib.sha256(stored).hexdigest(), source.uri
        assert digest.n_bytes == len(stored) == source.size
    assert digest_of(resolve_inputs([str(tmp_path / "e.jsonl.gz")])[0]).n_bytes > 0
    [zh] = resolve_inputs(["builtin:zh-sample"])
    assert digest_of(zh).hexdigest() == hashlib.sha256(Path(
        "pipeline/prepare/corpora/zh_sample.txt").read_bytes()).hexdigest()  # fmt: skip


def test_the_slices_of_a_file_tile_it_and_their_digests_hash_their_ranges(tmp_path):
    """Byte ranges of txt/jsonl and runs of parquet row groups: together they cover the
    file once, and each slice's digest is the sha256 of its range."""
    docs = [f"document {i}" + " word" * (i % 17) for i in range(400)]
    (tmp_path / "a.txt").write_text("\n\n".join(docs))
    write_jsonl(tmp_path / "b.jsonl", docs)
    pq.write_table(pa.table({"text": docs, "id": list(range(400))}), tmp_path / "c.parquet",
                   row_group_size=40)  # fmt: skip
    sources = resolve_inputs([str(tmp_path)])
    slices = plan_slices(sources, 2000)
    for i, source in enumerate(sources):
        stored = Path(source.uri).read_bytes()
        mine = [part for part in slices if part.source == i]
        assert len(mine) > 2, source.format
        at = 0
        for part in mine:
            digest = digest_of(source, part)
            end = part.end if part.end is not None else len(stored)
            assert part.start == at and digest.n_bytes == end - at
            assert digest.hexdigest() == hashlib.sha256(stored[at:end]).hexdigest()
            at = end
        assert at == len(stored)
        texts = [d.text for part in mine for d in iter_raw_documents(source, part=part)]
        assert texts == docs


def test_invalid_utf8_is_a_counted_reject_and_reading_goes_on(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"good one\n\nbad \xff\xfe here\n\nlast")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xc3"}\n{"text": "ok2"}\n')
    docs = read_all([tmp_path / "a.txt", tmp_path / "b.jsonl"])
    assert [(d.text, d.reject) for d in docs] == [
        ("good one", None),
        (None, "invalid_utf8"),
        ("last", None),
        ("ok", None),
        (None, "invalid_utf8"),
        ("ok2", None),
    ]
    assert [d.ordinal for d in docs] == [0, 1, 2, 0, 1, 2]


def test_nul_bytes_are_rejected_raw_or_escaped(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"fine\n\nbin\x00ary\n\nfine too")
    (tmp_path / "b.jsonl").write_text('{"text": "nul \\u0000 escaped"}\n{"text": "ok"}\n')
    docs = read_all([tmp_path / "a.txt", tmp_path / "b.jsonl"])
    assert [d.reject for d in docs] == [None, "nul_bytes", None, "nul_bytes", None]


def test_bad_json_and_missing_field_carry_the_line_number(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n\n{"text": broken\n{"other": 1}\n[1, 2]\n')
    docs = read_all([tmp_path / "a.jsonl"])
    assert [d.reject for d in docs] == [None, "bad_json", "no_text", "no_text"]
    assert docs[1].line == 3 and "line 3" in docs[1].detail
    assert "line 4" in docs[2].detail and "'text'" in docs[2].detail


def test_empty_files_give_no_documents(tmp_path):
    (tmp_path / "e.txt").write_bytes(b"")
    (tmp_path / "e.jsonl").write_bytes(b"\n\n")
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(b""))
    assert read_all([tmp_path]) == []


def test_missing_path_fails_before_anything_starts(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    missing = tmp_path / "nope" / "missing.jsonl"
    with pytest.raises(InputError, match=str(missing)):
        resolve_inputs([str(tmp_path / "ok.txt"), str(missing)])
    with pytest.raises(InputError, match="unknown format"):
        (tmp_path / "x.csv").write_text("a,b")
        resolve_inputs([str(tmp_path / "x.csv")])
    with pytest.raises(InputError, match="unknown builtin"):
        resolve_inputs(["builtin:nope"])


@pytest.mark.parametrize("name", ["t.jsonl.gz", "t.jsonl.zst", "t.txt.gz", "t.txt.zst"])
def test_a_truncated_compressed_file_keeps_the_documents_before_the_break(tmp_path, name):
    """The complete documents before the break are read, the cut one and the rest become
    one ``truncated`` reject naming the file; nothing is raised."""
    docs = [f"Document number {i} of the file, long enough to count." for i in range(2000)]
    if ".jsonl" in name:
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    else:
        data = "\n\n".join(docs).encode() + b"\n"
    packed = gzip.compress(data) if name.endswith(".gz") else zstd_frames(data)
    path = tmp_path / name
    path.write_bytes(packed[: len(packed) * 2 // 3])
    read = read_all([path])
    good, bad = read[:-1], read[-1]
    assert bad.reject == "truncated" and bad.text is None and bad.source == str(path)
    assert "breaks off" in bad.detail
    assert all(d.reject is None for d in good)
    assert [d.text for d in good] == docs[: len(good)]  # the documents before, uncut
    assert len(docs) // 3 < len(good) < len(docs)
    assert bad.ordinal == len(good)


def zstd_frames(data: bytes) -> bytes:
    """zstd in frames of 8 KB, as streaming writers produce (a cut inside the last one)."""
    c = zstandard.ZstdCompressor()
    return b"".join(c.compress(data[i : i + 8192]) for i in range(0, len(data), 8192))


def test_an_intact_compressed_file_has_no_truncated_reject(tmp_path):
    path = tmp_path / "ok.jsonl.gz"
    write_jsonl(path, DOCS)
    assert [d.reject for d in read_all([path])] == [None, None, None]


@pytest.mark.parametrize("name", ["big.txt", "big.jsonl"])
def test_huge_single_line_document_is_rejected_with_bounded_memory(tmp_path, name):
    path = tmp_path / name
    size = 50 << 20
    with open(path, "wb") as f:
        f.write(b'{"text": "' if name.endswith("jsonl") else b"")
        for _ in range(size >> 20):
            f.write(b"x" * (1 << 20))
        f.write(b'"}\n' if name.endswith("jsonl") else b"\n\n")
        f.write(b'{"text": "after"}\n' if name.endswith("jsonl") else b"after\n")
    [source] = resolve_inputs([str(path)])
    tracemalloc.start()
    try:
        docs = list(iter_raw_documents(source, max_doc_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(d.reject, d.text) for d in docs] == [("too_long", None), (None, "after")]
    assert peak < 8 << 20, f"peak {peak} bytes while reading a {size}-byte line"


def test_multi_line_txt_document_over_the_cap_is_too_long(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("short\n\n" + "a line of text\n" * 1000 + "\nnext")
    [source] = resolve_inputs([str(path)])
    docs = list(iter_raw_documents(source, max_doc_bytes=1000))
    assert [(d.ordinal, d.reject, d.text) for d in docs] == [
        (0, None, "short"),
        (1, "too_long", None),
        (2, None, "next"),
    ]
    assert docs[1].line == 3


def test_builtin_zh_sample():
    [source] = resolve_inputs(["builtin:zh-sample"])
    docs = list(iter_raw_documents(source))
    assert len(docs) >= 30 and all(d.reject is None for d in docs)
    assert all(d.source == "builtin:zh-sample" for d in docs)
    assert sum(d.text.count("。") >= 2 for d in docs) >= 20  # multi-sentence paragraphs
    assert source.size == sum(len(d.text.encode()) for d in docs) + 2 * (len(docs) - 1) + 1


@pytest.mark.slow
def test_builtin_python_docs_is_real_english_and_deterministic():
    [source] = resolve_inputs(["builtin:python-docs"])
    docs = list(iter_raw_documents(source))
    assert source.size > 1_500_000 and len(docs) > 2000
    assert [d.ordinal for d in docs[:3]] == [0, 1, 2]
    joined = "\n".join(d.text for d in docs)
    for phrase in ["Return the", "The ", " is a ", "argparse", "asynchronous"]:
        assert phrase in joined
    python_docs.cache_clear()
    assert [d.text for d in iter_raw_documents(source)] == [d.text for d in docs]
    want = Digest()
    hash_docs(python_docs(), want)
    assert digest_of(source).hexdigest() == want.hexdigest()


@pytest.mark.slow  # over 5 s: out of the fast tier
def test_builtin_corpus_does_not_depend_on_patched_hooks(monkeypatch):
    """Ray replaces sys.excepthook; the corpus (and so the shards) must not change."""
    import sys

    from pipeline.prepare.readers import python_docs

    python_docs.cache_clear()
    before = python_docs()

    def patched_hook(*args):
        """A library's replacement hook whose docstring must not enter the corpus."""

    monkeypatch.setattr(sys, "excepthook", patched_hook)
    python_docs.cache_clear()
    after = python_docs()
    python_docs.cache_clear()
    assert after == before
    assert not any("must not enter the corpus" in d for d in after)


def test_unparsable_python_source_gives_no_docstrings():
    from pipeline.prepare.readers import _docs_of_source

    # The standard library ships files like these in its tests (test/bad_coding.py).
    assert _docs_of_source(b"# -*- coding: uft-8 -*-\n'''doc'''\n") == []
    assert _docs_of_source(b"'''doc'''\ndef f(:\n") == []
    assert _docs_of_source(b"'''doc'''\x00\n") == []
    assert _docs_of_source(b"'''A module.'''\ndef f():\n    '''A function.'''\n") == [
        "A module.",
        "A function.",
    ]
