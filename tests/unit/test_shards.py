"""Format v3 block shards: bytes, random access == webdataset's stream, integrity checks."""

import json
import os
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds

from pipeline.data.shards import (
    INDEX_COLUMNS,
    N_DOCS,
    OFFSET,
    TOKENS_AT,
    DataDir,
    Document,
    ShardError,
    ShardWriter,
    brace_pattern,
    shard_name,
    split_of,
    token_dtype,
    write_manifest,
)


def varied_docs(n: int = 40, with_spans: bool = True) -> list[Document]:
    """Documents of every shape: empty, one token, uint32-range ids, spans or not,
    non-ASCII source names, two languages."""
    docs = []
    for i in range(n):
        k = (7 * i) % 23
        spans = np.array([[0, 1], [1, k]]) if with_spans and k > 1 else None
        if with_spans and spans is None:
            spans = np.zeros((0, 2), dtype=np.int32)
        docs.append(
            Document(
                key=f"d{i}",
                tokens=(np.arange(k) * 7919 + 65_000 * i) % 100_000,
                sents=np.array(sorted({k // 2, k} - {0}), dtype=np.int64) if k else np.zeros(0),
                words=np.arange(0, k, 3),
                meta={"source": f"维基-{i % 3}.txt", "language": "zh" if i % 4 else "other"},
                spans=spans,
            )
        )
    return docs


def write_docs(root, docs, vocab=100_000, block_tokens=40, name="train/shard-000000.tar"):
    w = ShardWriter.local(root, name, token_dtype(vocab), block_tokens=block_tokens)
    for doc in docs:
        w.write(doc)
    info = w.close()
    splits = {"train": {"shards": [info]}}
    write_manifest(root, {"format_version": 3, "tokenizer": {"path": "tok"}, "splits": splits})
    return name


def assert_same(a: Document, b: Document) -> None:
    assert a.meta["source"] == b.meta["source"] and a.meta["language"] == b.meta["language"]
    for name in ("tokens", "sents", "words", "spans"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert np.array_equal(np.asarray(x, np.int64), np.asarray(y, np.int64)), name


def test_same_documents_give_identical_bytes(tmp_path):
    write_docs(tmp_path / "a", varied_docs())
    write_docs(tmp_path / "b", varied_docs())
    for name in ("train/shard-000000.tar", "train/shard-000000.idx.npy"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("vocab", [300, 100_000])
def test_random_access_and_webdataset_stream_give_the_written_documents(tmp_path, vocab):
    docs = varied_docs()
    for d in docs:
        d.tokens = d.tokens % vocab
    shard = write_docs(tmp_path, docs, vocab=vocab)
    data = DataDir(tmp_path)
    assert len(data.index(shard)) > 5  # several blocks of <= 40 tokens
    assert data.n_docs(shard) == len(docs)
    assert data.doc_lengths(shard).tolist() == [d.n_tokens for d in docs]
    streamed = list(data.iter_shard(shard))
    assert len(streamed) == len(docs)
    for i, doc in enumerate(docs):
        got = data.read(shard, i)
        assert got.tokens.dtype == token_dtype(vocab) and got.meta["n_tokens"] == doc.n_tokens
        assert_same(got, doc)
        assert_same(streamed[i], doc)
        assert got.key == streamed[i].key
    # plain webdataset iterates the shard: one sample per block, the documented members
    samples = list(wds.WebDataset(data.urls("train"), shardshuffle=False))
    assert len(samples) == len(data.index(shard))
    assert set(samples[0]) - {"__key__", "__url__", "__local_path__"} == {
        "docs.npy", "langs.npy", "meta.json", "sents.npy", "spans.npy", "srcs.npy",
        "tokens.npy", "words.npy",
    }  # fmt: skip
    assert json.loads(samples[0]["meta.json"])["sources"][0] == "维基-0.txt"


def test_documents_without_spans_have_no_spans_member(tmp_path):
    shard = write_docs(tmp_path, varied_docs(with_spans=False))
    data = DataDir(tmp_path)
    assert data.read(shard, 3).spans is None
    assert all(d.spans is None for d in data.iter_shard(shard))


def test_bytes_on_disk_stay_within_1_3x_the_token_bytes_for_short_documents(tmp_path):
    """~84-token documents of ~4 sentences and ~65 words: the tar overhead per block and
    the offsets / bit-packed word starts together stay under 30% of the token ids."""
    rng = np.random.default_rng(0)
    w = ShardWriter.local(tmp_path, shard_name("train", 0), np.uint16)
    n_tokens = 0
    for _ in range(20_000):
        n = int(rng.integers(40, 130))
        ends = np.append(np.sort(rng.choice(np.arange(1, n), 3, replace=False)), n)
        words = np.flatnonzero(rng.random(n) < 0.75)
        w.write(Document("x", rng.integers(0, 30_000, n), ends, words, {"source": "a.txt"}))
        n_tokens += n
    entry = w.close()
    on_disk = entry["bytes"] + os.path.getsize(tmp_path / entry["index"])
    assert on_disk <= 1.3 * 2 * n_tokens, on_disk / (2 * n_tokens)


def test_verify_names_a_corrupted_shard_and_a_read_of_the_block_refuses_it(tmp_path):
    shard = write_docs(tmp_path, varied_docs())
    data = DataDir(tmp_path)
    assert data.verify() == []
    row = data.index(shard)[2]
    path = tmp_path / shard
    raw = bytearray(path.read_bytes())
    raw[int(row[OFFSET]) + int(row[TOKENS_AT])] ^= 0x01  # a byte of block 2's tokens.npy
    path.write_bytes(bytes(raw))
    problems = DataDir(tmp_path).verify()
    assert problems and "shard-000000.tar: sha256" in problems[0]
    fresh = DataDir(tmp_path)
    first_of_block_2 = int(fresh.index(shard)[:2, N_DOCS].sum())
    fresh.read(shard, 0)  # other blocks still read
    with pytest.raises(ShardError, match=r"train/shard-000000.tar: block 2 .*crc32"):
        fresh.read(shard, first_of_block_2)


def test_a_truncated_shard_is_named(tmp_path):
    shard = write_docs(tmp_path, varied_docs())
    path = tmp_path / shard
    path.write_bytes(path.read_bytes()[:3000])
    data = DataDir(tmp_path)
    with pytest.raises(ShardError, match=r"shard-000000.tar: block \d+ .*truncated"):
        for i in range(data.n_docs(shard)):
            data.read(shard, i)


def test_a_wrong_index_is_refused(tmp_path):
    shard = write_docs(tmp_path, varied_docs())
    np.save(tmp_path / "train/shard-000000.idx.npy", np.zeros((3, 5), dtype=np.int64))
    with pytest.raises(ShardError, match=f"expected \\(n_blocks, {INDEX_COLUMNS}\\)"):
        DataDir(tmp_path).read(shard, 0)
    assert "shard-000000.idx.npy: missing or sha256" in DataDir(tmp_path).verify()[0]


def test_missing_manifest_and_old_formats_are_clear_errors(tmp_path):
    with pytest.raises(ShardError, match="run `plm data prepare`"):
        DataDir(tmp_path)
    write_manifest(tmp_path, {"format_version": 1, "splits": {}})
    with pytest.raises(ShardError, match=r"format v1, this code reads v3.*--force"):
        DataDir(tmp_path)


@pytest.mark.parametrize("name", ["../elsewhere/shard-000000.tar", "/etc/passwd", "a/../../x"])
def test_a_manifest_naming_files_outside_the_data_dir_is_refused(tmp_path, name):
    write_docs(tmp_path, varied_docs())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["name"] = name
    write_manifest(tmp_path, manifest)
    with pytest.raises(ShardError, match="not a path inside the data dir"):
        DataDir(tmp_path)


def test_split_is_a_stable_function_of_the_text():
    texts = [f"document number {i}" for i in range(4000)]
    splits = [split_of(t, 0.1) for t in texts]
    assert splits == [split_of(t, 0.1) for t in texts]
    assert 0.08 < splits.count("valid") / len(texts) < 0.12
    assert brace_pattern("train", 4) == "train/shard-{000000..000003}.tar"


class _Reads(torch.utils.data.Dataset):
    def __init__(self, data, shard):
        self.data, self.shard = data, shard

    def __len__(self):
        return self.data.n_docs(self.shard)

    def __getitem__(self, i: int):
        doc = self.data.read(self.shard, i)
        return os.getpid(), int(doc.tokens.astype(np.int64).sum())


def test_random_access_is_safe_in_forked_loader_workers_and_after_close(tmp_path):
    docs = varied_docs()
    shard = write_docs(tmp_path, docs)
    data = DataDir(tmp_path)
    expected = [int(d.tokens.sum()) for d in docs]
    assert [_Reads(data, shard)[i][1] for i in range(len(docs))] == expected  # maps open
    loader = torch.utils.data.DataLoader(
        _Reads(data, shard), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    got = list(loader)
    assert [g[1] for g in got] == expected
    assert os.getpid() not in {g[0] for g in got}  # really read in the workers
    assert [_Reads(data, shard)[i][1] for i in range(len(docs))] == expected
    copy = pickle.loads(pickle.dumps(data))  # spawned workers / Ray get a map-less copy
    assert int(copy.read(shard, 2).tokens.sum()) == expected[2]
    data.close()
    data.close()  # closing twice is fine, and reading reopens
    assert int(data.read(shard, 11).tokens.sum()) == expected[11]
