import os
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds

from pipeline.data.shards import (
    INDEX_COLUMNS,
    TOKENS_AT,
    DataDir,
    Document,
    ShardError,
    ShardWriter,
    _decode_sample_bytes,
    brace_pattern,
    shard_name,
    split_of,
    token_dtype,
    write_manifest,
)


def make_doc(i: int) -> Document:
    n = 5 + i
    return Document(
        key=f"src-{i:06d}",
        tokens=np.arange(n) + 70000 * (i % 2),
        sents=np.array([2, n]),
        words=np.arange(0, n, 2),
        meta={"source": "x", "n_tokens": n},
    )


def write_dir(root, n_docs=10, vocab=100_000):
    w = ShardWriter(root, shard_name("train", 0), token_dtype(vocab))
    for i in range(n_docs):
        w.write(make_doc(i))
    info = w.close()
    write_manifest(
        root,
        {
            "format_version": 1,
            "tokenizer": {"path": "tokenizer"},
            "splits": {"train": {"shards": [info]}},
        },
    )
    return info


def test_same_documents_give_identical_bytes(tmp_path):
    a = write_dir(tmp_path / "a")
    b = write_dir(tmp_path / "b")
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "a/train/shard-000000.tar").read_bytes() == (
        tmp_path / "b/train/shard-000000.tar"
    ).read_bytes()


def test_random_access_and_seeked_stream_match_sequential(tmp_path):
    write_dir(tmp_path)
    data = DataDir(tmp_path)
    docs = list(data.iter_split("train"))
    assert [d.key for d in docs] == [f"src-{i:06d}" for i in range(10)]
    seventh = data.read("train/shard-000000.tar", 7)
    assert np.array_equal(seventh.tokens, docs[7].tokens)
    assert seventh.tokens.dtype == np.uint32  # vocabulary above 65536
    assert [d.key for d in data.iter_shard("train/shard-000000.tar", start=8)] == [
        "src-000008",
        "src-000009",
    ]
    # plain webdataset reads the same shards
    assert sum(1 for _ in wds.WebDataset(data.urls("train"), shardshuffle=False)) == 10


def test_verify_names_a_corrupted_shard(tmp_path):
    write_dir(tmp_path)
    assert DataDir(tmp_path).verify() == []
    path = tmp_path / "train/shard-000000.tar"
    raw = bytearray(path.read_bytes())
    raw[600] ^= 0xFF
    path.write_bytes(bytes(raw))
    problems = DataDir(tmp_path).verify()
    assert problems and "train/shard-000000.tar" in problems[0]


def test_missing_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(ShardError, match="plm data prepare"):
        DataDir(tmp_path)


def test_split_is_a_stable_function_of_the_text():
    texts = [f"document number {i}" for i in range(4000)]
    splits = [split_of(t, 0.1) for t in texts]
    assert splits == [split_of(t, 0.1) for t in texts]
    assert 0.08 < splits.count("valid") / len(texts) < 0.12
    assert brace_pattern("train", 4) == "train/shard-{000000..000003}.tar"


def varied_docs() -> list[Document]:
    """Documents that exercise every member kind: uint32 ids, spans or not, empty arrays,
    non-ASCII meta, and keys that need pax headers (long, non-ASCII)."""
    docs = []
    for i in range(12):
        n = 3 * i
        docs.append(
            Document(
                key=f"src-{i:06d}",
                tokens=(np.arange(n) * 7919 + 65_000 * i) % 100_000,
                sents=np.array([n] if n else [], dtype=np.int64),
                words=np.arange(0, n, 3),
                meta={"source": "维基", "n_tokens": n, "i": i},
                spans=np.array([[0, 1], [1, n]]) if i % 3 == 0 and n else None,
            )
        )
    docs[5].key = "k" * 150  # name over 100 bytes: tarfile writes a pax header
    docs[7].key = "文档-7"  # non-ASCII name: pax header too
    docs[9].spans = np.zeros((0, 2), dtype=np.int32)  # spans present but empty
    return docs


def write_docs(root, docs, vocab=100_000):
    w = ShardWriter(root, shard_name("train", 0), token_dtype(vocab))
    for doc in docs:
        w.write(doc)
    info = w.close()
    splits = {"train": {"shards": [info]}}
    write_manifest(root, {"format_version": 1, "tokenizer": {"path": "tok"}, "splits": splits})
    return "train/shard-000000.tar"


def assert_same_document(a: Document, b: Document) -> None:
    assert a.key == b.key and a.meta == b.meta
    for name in ("tokens", "sents", "words", "spans"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert np.array_equal(x, y), name


def test_random_access_decodes_exactly_what_webdataset_streams(tmp_path):
    docs = varied_docs()
    shard = write_docs(tmp_path, docs)
    data = DataDir(tmp_path)
    streamed = list(data.iter_shard(shard))  # webdataset's tar iterator + np.load
    assert len(streamed) == len(docs)
    for i in reversed(range(len(docs))):  # random access order does not matter
        doc = data.read(shard, i)
        assert_same_document(doc, streamed[i])
        assert doc.key == docs[i].key and np.array_equal(doc.tokens, docs[i].tokens)
    assert data.read(shard, 3).tokens.dtype == np.uint32
    assert data.read(shard, 3).spans.shape == (2, 2)
    assert data.read(shard, 0).tokens.shape == (0,)
    # the arrays view the sample's bytes: read-only, so a cached Document cannot be edited
    assert not data.read(shard, 4).tokens.flags.writeable
    # samples 5 and 7 (pax headers) took webdataset's reader inside read(), the rest not
    raw = (tmp_path / shard).read_bytes()
    plain = [_decode_sample_bytes(raw[o : o + n]) is not None for o, n, *_ in data.index(shard)]
    assert [i for i, p in enumerate(plain) if not p] == [5, 7]


def flip(path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["tar header", "npy header", "json", "truncated"])
def test_a_corrupted_sample_is_a_shard_error_naming_it(tmp_path, where):
    docs = varied_docs()
    shard = write_docs(tmp_path, docs)
    data = DataDir(tmp_path)
    offset = int(data.index(shard)[4, 0])
    size = int(data.index(shard)[4, 1])
    path = tmp_path / shard
    sample = path.read_bytes()[offset : offset + size]
    if where == "tar header":
        flip(path, offset + 10)  # in the name of the first member: checksum mismatch
    elif where == "npy header":
        flip(path, offset + sample.index(b"NUMPY"))  # the magic of the first .npy member
        # Reads through a full index never parse .npy headers (the shard's sha256, checked
        # when a stream starts and by `plm data inspect --verify`, covers them): the
        # header parser is what an older 3-column index uses.
        assert any("sha256" in p for p in DataDir(tmp_path).verify())
        index = tmp_path / "train/shard-000000.idx.npy"
        np.save(index, np.load(index)[:, :3])
    elif where == "json":
        flip(path, offset + sample.index(b'"source"'))  # meta.json is no longer JSON
    else:
        path.write_bytes(path.read_bytes()[: offset + 100])
    with pytest.raises(ShardError, match=r"train/shard-000000\.tar: sample 4 at byte"):
        DataDir(tmp_path).read(shard, 4)
    if where != "truncated":  # the other samples still read
        assert DataDir(tmp_path).read(shard, 3).key == docs[3].key


class _Reads(torch.utils.data.Dataset):
    def __init__(self, data: DataDir, shard: str):
        self.data, self.shard = data, shard

    def __len__(self) -> int:
        return len(self.data.index(self.shard))

    def __getitem__(self, i: int):
        doc = self.data.read(self.shard, i)
        return os.getpid(), doc.key, int(doc.tokens.astype(np.int64).sum())


def test_random_access_is_safe_in_forked_loader_workers_and_after_close(tmp_path):
    docs = varied_docs()
    shard = write_docs(tmp_path, docs)
    data = DataDir(tmp_path)
    expected = [(d.key, int(d.tokens.sum())) for d in docs]
    assert [_Reads(data, shard)[i][1:] for i in range(len(docs))] == expected  # maps open
    loader = torch.utils.data.DataLoader(
        _Reads(data, shard), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    got = list(loader)
    assert [tuple(g[1:]) for g in got] == expected
    assert os.getpid() not in {g[0] for g in got}  # really read in the workers
    # the workers dropped their inherited copies of the maps; the parent's still work
    assert [_Reads(data, shard)[i][1:] for i in range(len(docs))] == expected
    copy = pickle.loads(pickle.dumps(data))  # spawned workers / Ray get a map-less copy
    assert copy.read(shard, 2).key == docs[2].key
    data.close()
    data.close()  # closing twice is fine, and reading reopens
    assert data.read(shard, 11).key == docs[11].key


def test_full_and_legacy_indexes_read_the_same_documents(tmp_path):
    docs = varied_docs()
    shard = write_docs(tmp_path, docs)
    index = tmp_path / "train/shard-000000.idx.npy"
    assert np.load(index).shape == (len(docs), INDEX_COLUMNS)
    full = [DataDir(tmp_path).read(shard, i) for i in range(len(docs))]
    np.save(index, np.load(index)[:, :3])  # an index written before the member columns
    legacy = DataDir(tmp_path)
    for i, doc in enumerate(full):
        assert_same_document(doc, legacy.read(shard, i))


def test_a_stale_index_is_caught_by_verify_and_the_stream(tmp_path):
    from pipeline.config import ObjectiveSection
    from pipeline.data.stream import PretrainStream
    from pipeline.objectives import build_objective

    write_docs(tmp_path, varied_docs())
    index = tmp_path / "train/shard-000000.idx.npy"
    rows = np.load(index)
    rows[4, TOKENS_AT] += 2  # still inside the sample: reads garbage, raises nothing
    np.save(index, rows)
    problems = DataDir(tmp_path).verify()
    assert any("sample 4 read through the index differs" in p for p in problems), problems
    roles = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}
    objective = build_objective(ObjectiveSection(kind="mlm"), roles, 100_000, 16)
    with pytest.raises(ShardError, match=r"shard-000000.idx.npy does not match"):
        PretrainStream(tmp_path, "train", objective, 2, seed=0)
