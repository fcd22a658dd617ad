import numpy as np
import pytest
import webdataset as wds

from pipeline.data.shards import (
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
        {"format_version": 1, "tokenizer": {"path": "tokenizer"}, "splits": {"train": {"shards": [info]}}},
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
    assert [d.key for d in data.iter_shard("train/shard-000000.tar", start=8)] == ["src-000008", "src-000009"]
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
