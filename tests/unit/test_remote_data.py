"""Data dirs on an object store (``data.path=s3://...``) against a real S3 server (moto's
server mode, tests/s3_server.py): the same documents and batches as the local dir, range
reads of whole blocks only, the node cache (warm, bounded, shared), corrupt blocks, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, free_port, plm

from pipeline.config import ObjectiveSection, load_config
from pipeline.data.remote import CacheConfig, default_cache_dir
from pipeline.data.shards import (
    N_DOCS,
    OFFSET,
    SIZE,
    DataDir,
    Document,
    ShardError,
    ShardWriter,
    index_name,
    shard_name,
    write_manifest,
)
from pipeline.errors import ConfigError
from pipeline.loader.stream import PretrainStream
from pipeline.objectives import build_objective

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}
VOCAB = 1000
BERT = str(REPO / "configs/test/bert-tiny.yaml")


def make_blocky_dir(root, n_docs=240, n_shards=3, block_tokens=512, seed=0):
    """Random documents in many small blocks (a few documents each), a tokenizer dir."""
    rng = np.random.default_rng(seed)

    def doc(key):
        n = int(rng.integers(5, 120))
        ends = np.unique(np.append(rng.integers(1, n, max(1, n // 10)), n)).astype(np.int32)
        return Document(key, rng.integers(6, VOCAB, n), ends, np.arange(0, n, 2, dtype=np.int32),
                        {"source": f"src{key[-1]}", "language": "en"})  # fmt: skip

    splits = {}
    for split, count, shards in (("train", n_docs, n_shards), ("valid", 40, 1)):
        entries, per = [], -(-count // shards)
        for s in range(shards):
            w = ShardWriter.local(root, shard_name(split, s), np.uint16, block_tokens=block_tokens)
            for i in range(s * per, min(count, (s + 1) * per)):
                w.write(doc(f"{split}-{i:05d}"))
            entries.append(w.close())
        splits[split] = {"shards": entries}
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    (root / "tokenizer" / "tokenizer_meta.json").write_text(json.dumps({"vocab_size": VOCAB}))
    write_manifest(
        root, {"format_version": 3, "tokenizer": {"path": "tokenizer"}, "splits": splits}
    )
    return root


@pytest.fixture(scope="module")
def blocky(tmp_path_factory):
    return make_blocky_dir(tmp_path_factory.mktemp("blocky"))


def cache(tmp_path, max_bytes=1 << 30, prefetch=4, name="cache"):
    return CacheConfig(str(tmp_path / name), max_bytes, prefetch)


def all_docs(d: DataDir):
    return [(e["name"], i) for split in ("train", "valid") for e in d.shards(split)
            for i in range(e["n_docs"])]  # fmt: skip


def same_doc(a: Document, b: Document) -> bool:
    return (
        a.key == b.key
        and a.meta == b.meta
        and a.tokens.dtype == b.tokens.dtype
        and np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.sents, b.sents)
        and np.array_equal(a.words, b.words)
        and (a.spans is None) == (b.spans is None)
    )


def block_bytes(d: DataDir) -> int:
    return sum(int(d.index(e["name"])[:, SIZE].sum()) for s in ("train", "valid")
               for e in d.shards(s))  # fmt: skip


def test_every_document_equals_the_local_one_and_only_blocks_are_fetched(tiny_data, s3, tmp_path):
    uri = s3.upload(tiny_data)
    local, remote = DataDir(tiny_data), DataDir(uri, cache(tmp_path))
    assert remote.manifest == local.manifest and remote.root is None
    assert remote.name == "data" and remote.where("train") == f"{uri}/train"
    for split in ("train", "valid"):
        for e in local.shards(split):
            assert np.array_equal(remote.doc_lengths(e["name"]), local.doc_lengths(e["name"]))
            assert np.array_equal(remote.doc_lengths(e["name"], 3, 9),
                                  local.doc_lengths(e["name"], 3, 9))  # fmt: skip
    meta_only = remote.stats()
    assert meta_only["blocks_fetched"] == 0 and meta_only["meta_bytes"] > 0
    for name, i in all_docs(local):
        assert same_doc(remote.read(name, i), local.read(name, i)), (name, i)
    stats = remote.stats()
    assert stats["blocks_read"] == sum(len(local.index(e["name"])) for s in ("train", "valid")
                                       for e in local.shards(s))  # fmt: skip
    assert stats["read_bytes"] == block_bytes(local)
    # cold: every byte fetched for blocks belongs to a block read (whole-block range reads)
    assert stats["fetched_bytes"] <= 1.1 * stats["read_bytes"]
    # metadata counted apart: manifest, indexes, token counts (small next to the blocks here)
    assert stats["meta_bytes"] == meta_only["meta_bytes"] < stats["read_bytes"]
    tok = remote.tokenizer_path
    assert tok.is_file() and tok.read_bytes() == local.tokenizer_path.read_bytes()
    meta = tok.parent / "tokenizer_meta.json"
    assert json.loads(meta.read_text()) == json.loads(
        (local.tokenizer_path.parent / "tokenizer_meta.json").read_text()
    )
    assert [d.key for d in remote.iter_split("train")] == [d.key for d in local.iter_split("train")]
    assert remote.verify() == []


def test_a_warm_cache_fetches_no_block_again(blocky, s3, tmp_path):
    uri = s3.upload(blocky)
    first = DataDir(uri, cache(tmp_path))
    for name, i in all_docs(first):
        first.read(name, i)
    assert first.stats()["blocks_fetched"] == first.stats()["blocks_read"] > 20
    second = DataDir(uri, cache(tmp_path))
    for name, i in all_docs(second):
        second.read(name, i)
    stats = second.stats()
    assert stats["blocks_fetched"] == 0 and stats["fetched_bytes"] == 0
    assert stats["cache_hits"] == stats["blocks_read"] == first.stats()["blocks_read"]
    # the indexes and token counts too come from the cache: only the manifest is fetched
    assert stats["meta_fetches"] == 1


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(blocky, s3, tmp_path):
    uri = s3.upload(blocky)
    probe = DataDir(uri, cache(tmp_path, name="probe"))
    sizes = probe.index("train/shard-000000.tar")[:, SIZE]
    bound = int(4 * sizes.max())
    d = DataDir(uri, cache(tmp_path, max_bytes=bound, prefetch=0))
    for name, i in all_docs(d):
        d.read(name, i)
    blocks = tmp_path / "cache" / "blocks"
    held = sum(p.stat().st_size for p in blocks.iterdir())
    assert 0 < held <= bound
    assert len(list(blocks.iterdir())) < d.stats()["blocks_read"]  # evicted
    assert not list(blocks.glob("*.part"))
    # the most recently read blocks are the ones kept: the last shard's last block is
    last = d.shards("valid")[-1]["name"]
    rows = d.index(last)
    key = d._store.key(last, len(rows) - 1, rows[-1].tolist(), d._shard_sha(last))
    assert (blocks / key).is_file()


def test_a_corrupt_block_is_named_and_not_cached(blocky, s3, tmp_path):
    uri = s3.upload(blocky)
    name = "train/shard-000001.tar"
    rows = np.load(blocky / index_name(name))
    data = bytearray((blocky / name).read_bytes())
    data[int(rows[2, OFFSET] + rows[2, SIZE] // 2)] ^= 0x40
    s3.put(f"{uri}/{name}", bytes(data))
    d = DataDir(uri, cache(tmp_path, prefetch=0))
    firsts = np.concatenate([[0], np.cumsum(rows[:, N_DOCS])])
    d.read(name, int(firsts[1]))  # block 1 is fine
    with pytest.raises(ShardError, match=r"block 2 at byte \d+ is corrupt") as err:
        d.read(name, int(firsts[2]))
    assert f"{uri}/{name}" in str(err.value) and "\n" not in str(err.value)
    key = d._store.key(name, 2, rows[2].tolist(), d._shard_sha(name))
    assert not (tmp_path / "cache" / "blocks" / key).exists()
    assert not list((tmp_path / "cache" / "blocks").glob("*.part"))
    # a cached copy that went bad on the node's disk is fetched again, not used
    key1 = d._store.key(name, 1, rows[1].tolist(), d._shard_sha(name))
    cached = tmp_path / "cache" / "blocks" / key1
    cached.write_bytes(b"\0" * cached.stat().st_size)
    again = DataDir(uri, cache(tmp_path, prefetch=0))
    assert same_doc(again.read(name, int(firsts[1])), DataDir(blocky).read(name, int(firsts[1])))
    assert again.stats()["blocks_fetched"] == 1


def objective(kind):
    return build_objective(ObjectiveSection(kind=kind), ROLES, VOCAB, 32)


def batches(data, kind, n, workers=0):
    s = PretrainStream(data, "train", objective(kind), micro_batch_size=4, seed=7,
                       num_workers=workers)  # fmt: skip
    it = iter(s)
    out = [next(it) for _ in range(n)]
    s.close()
    return out


def same_batches(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", ["mlm+nsp", "clm"])
def test_the_stream_on_s3_gives_the_local_batches(blocky, s3, tmp_path, kind):
    uri = s3.upload(blocky)
    remote = DataDir(uri, cache(tmp_path))
    assert same_batches(batches(remote, kind, 12), batches(DataDir(blocky), kind, 12))
    stats = remote.stats()
    assert stats["prefetched"] > 0  # the stream named its groups' blocks ahead
    assert stats["fetched_bytes"] <= 1.1 * block_bytes(remote)


def test_loader_workers_read_s3_through_the_shared_cache(blocky, s3, tmp_path):
    uri = s3.upload(blocky)
    remote = DataDir(uri, cache(tmp_path))
    assert same_batches(batches(remote, "mlm+nsp", 8, workers=2),
                        batches(DataDir(blocky), "mlm+nsp", 8))  # fmt: skip
    assert list((tmp_path / "cache" / "blocks").iterdir())


def test_a_sequential_reader_gets_the_next_blocks_prefetched(blocky, s3, tmp_path):
    uri = s3.upload(blocky)
    d = DataDir(uri, cache(tmp_path, prefetch=3))
    keys = [doc.key for doc in d.iter_shard("train/shard-000000.tar")]
    assert keys == [doc.key for doc in DataDir(blocky).iter_shard("train/shard-000000.tar")]
    stats = d.stats()
    assert stats["prefetched"] > 0 and stats["blocks_fetched"] == stats["blocks_read"]
    off = DataDir(uri, cache(tmp_path, prefetch=0, name="off"))
    list(off.iter_shard("train/shard-000000.tar"))
    assert off.stats()["prefetched"] == 0


def test_a_file_uri_reads_through_the_block_store(blocky, tmp_path):
    d = DataDir(f"file://{blocky}", cache(tmp_path))
    name = "train/shard-000002.tar"
    assert same_doc(d.read(name, 5), DataDir(blocky).read(name, 5))
    assert d.stats()["blocks_fetched"] == 1


def test_processes_of_a_node_share_one_cache(blocky, s3, tmp_path):
    """Two processes reading the same blocks at once fetch each block about once."""
    uri = s3.upload(blocky)
    code = (
        "import json, sys; from pipeline.data.shards import DataDir; "
        "from pipeline.data.remote import CacheConfig; "
        "d = DataDir(sys.argv[1], CacheConfig(sys.argv[2], 1 << 30, 0)); "
        "[d.read(e['name'], i) for e in d.shards('train') for i in range(e['n_docs'])]; "
        "print(json.dumps(d.stats()))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, uri, str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]  # fmt: skip
    stats = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    n = stats[0]["blocks_read"]
    assert stats[1]["blocks_read"] == n
    assert sum(s["blocks_fetched"] for s in stats) <= n + 2  # (a claim can go stale in a race)


# --- errors -------------------------------------------------------------------------------


def test_a_missing_manifest_or_bucket_is_one_clear_line(s3, tmp_path):
    for uri in (s3.prefix("nothing-here"), "s3://no-such-bucket-plm/data"):
        with pytest.raises(ShardError) as err:
            DataDir(uri, cache(tmp_path))
        text = str(err.value)
        assert f"{uri}/manifest.json does not exist" in text and "\n" not in text


@pytest.mark.slow  # the S3 client retries a refused connection for a few seconds
def test_an_unreachable_endpoint_is_one_clear_line(tiny_data, s3, tmp_path, monkeypatch):
    uri = s3.upload(tiny_data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ShardError, match="AWS_ENDPOINT_URL") as err:
        DataDir(uri, cache(tmp_path))
    assert uri in str(err.value) and "\n" not in str(err.value)
    proc = plm("train", BERT, f"data.path={uri}", f"data.cache_dir={tmp_path / 'c'}",
               "--dry-run", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"plm: data.path: cannot read {uri}")


def test_cache_keys_are_validated(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nmodel: {arch: bert}\ndata: {path: s3://b/d}\n")
    cfg = load_config(path, ["data.cache_bytes=512MiB"]).data
    assert cfg.cache_bytes == 512 << 20 and cfg.prefetch_blocks == 4 and cfg.cache_dir is None
    assert load_config(path).data.cache_bytes == 2 << 30
    for bad, key in (("data.cache_bytes=lots", "data.cache_bytes"),
                     ("data.cache_bytes=-5", "data.cache_bytes"),
                     ("data.prefetch_blocks=-1", "data.prefetch_blocks"),
                     ("data.cache_dir=s3://b/cache", "data.cache_dir")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"key '{key}'|^{key}="):
            load_config(path, [bad])


def test_the_default_cache_dir_is_node_local(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert default_cache_dir() == tmp_path / f"plm-cache-{os.getuid()}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "plm" / "blocks"


# --- plm train ------------------------------------------------------------------------------


def step_losses(run_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_loss"] for r in rows if "step_loss" in r}


@pytest.mark.slow
def test_plm_train_on_s3_gives_the_local_losses(tiny_data, s3, tmp_path):
    uri = s3.upload(tiny_data)
    common = ["train.max_steps=6", "train.eval_every=3", "train.save_every=0",
              "train.log_every=1", "mlflow.register=false", "data.workers=2"]  # fmt: skip
    losses = {}
    for where, path in (("local", str(tiny_data)), ("s3", uri)):
        run_dir = tmp_path / where
        plm("train", BERT, f"data.path={path}", f"train.out_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}", *common, cwd=tmp_path)  # fmt: skip
        losses[where] = step_losses(run_dir)
    assert sorted(losses["s3"]) == list(range(1, 7))
    assert losses["s3"] == losses["local"]
    dry = plm("train", BERT, f"data.path={uri}", f"data.cache_dir={tmp_path / 'cache'}",
              "--dry-run", cwd=tmp_path)  # fmt: skip
    assert uri in dry.stdout
    out = plm("data", "inspect", uri, cwd=tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "x")})
    assert f"data dir     {uri}" in out.stdout
