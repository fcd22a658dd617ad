"""The resumable stream over real webdataset shards: exact resume, ranks, epochs, bad shards."""

import numpy as np
import pytest
import torch

from pipeline.config import ObjectiveSection
from pipeline.data.shards import (
    DataDir,
    Document,
    ShardError,
    ShardWriter,
    shard_name,
    write_manifest,
)
from pipeline.errors import ConfigError
from pipeline.loader.stream import PretrainStream
from pipeline.objectives import build_objective

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}
VOCAB = 1000
SEQ = 32


def make_data_dir(root, n_docs=240, n_shards=3, n_valid=40, dtype=np.uint16, seed=0):
    """Random-token documents with sentence ends, written with the real ShardWriter."""
    rng = np.random.default_rng(seed)

    def doc(key):
        n = int(rng.integers(5, 120))
        ends = np.unique(np.append(rng.integers(1, n, max(1, n // 10)), n)).astype(np.int32)
        words = np.arange(0, n, 2, dtype=np.int32)
        tokens = rng.integers(6, VOCAB, n)
        return Document(key, tokens, ends, words, {"n_tokens": n})

    splits = {}
    for split, count, shards in (("train", n_docs, n_shards), ("valid", n_valid, 1)):
        entries, per = [], -(-count // shards)
        for s in range(shards):
            w = ShardWriter.local(root, shard_name(split, s), dtype)
            for i in range(s * per, min(count, (s + 1) * per)):
                w.write(doc(f"{split}-{i:05d}"))
            entries.append(w.close())
        splits[split] = {"shards": entries}
    write_manifest(
        root, {"format_version": 3, "tokenizer": {"path": "tokenizer"}, "splits": splits}
    )
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def objective(kind="mlm+nsp", **section):
    return build_objective(ObjectiveSection(kind=kind, **section), ROLES, VOCAB, SEQ)


def stream(path, kind="mlm+nsp", split="train", B=4, **kw):
    return PretrainStream(path, split, objective(kind), micro_batch_size=B, seed=7, **kw)


def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def unit_keys(s, epoch):
    return [u.key for b in range(s.batches_per_epoch) for u in s.units_at(epoch, b)]


@pytest.mark.parametrize("kind", ["mlm+nsp", "clm"])
def test_resume_gives_exactly_the_uninterrupted_batches(data_dir, kind):
    s = stream(data_dir, kind)
    n = s.batches_per_epoch + 5  # cross an epoch boundary too
    straight = take(iter(s), n)
    first = stream(data_dir, kind)
    part = take(iter(first), n - 10)
    state = first.state_dict()
    resumed = stream(data_dir, kind)
    resumed.load_state_dict(state)
    assert same(part + take(iter(resumed), 10), straight)
    assert straight[0]["input_ids"].dtype == torch.int64


def test_loader_workers_do_not_change_the_stream(data_dir):
    straight = take(iter(stream(data_dir)), 20)
    two = stream(data_dir, num_workers=2)
    part = take(iter(two), 10)
    state = two.state_dict()
    assert state["batch"] == 10
    two.close()
    one = stream(data_dir, num_workers=1)  # resume on another number of workers
    one.load_state_dict(state)
    assert same(part + take(iter(one), 10), straight)
    one.close()
    zero = stream(data_dir)
    zero.load_state_dict(state)
    assert same(take(iter(zero), 10), straight[10:])


def test_ranks_get_equal_disjoint_shares(data_dir):
    r0 = stream(data_dir, rank=0, world_size=2)
    r1 = stream(data_dir, rank=1, world_size=2)
    assert r0.batches_per_epoch == r1.batches_per_epoch == r0.units_per_epoch // 8
    for epoch in (0, 1):
        k0, k1 = set(unit_keys(r0, epoch)), set(unit_keys(r1, epoch))
        assert len(k0) == len(k1) == 4 * r0.batches_per_epoch
        assert not k0 & k1
    # one rank of batch 8 sees exactly what two ranks of batch 4 see together
    single = stream(data_dir, B=8)
    assert single.batches_per_epoch == r0.batches_per_epoch
    assert single.units_at(0, 3) == r0.units_at(0, 3) + r1.units_at(0, 3)


def test_resume_on_another_world_size_at_a_batch_boundary(data_dir):
    single = stream(data_dir, B=8)
    take(iter(single), 3)
    state = single.state_dict()
    assert state["samples"] == 24
    r1 = stream(data_dir, rank=1, world_size=2)
    r1.load_state_dict(state)
    assert same(take(iter(r1), 1), [r1.batch_at(0, 3)])
    odd = stream(data_dir, B=5)
    with pytest.raises(ValueError, match="not a multiple"):
        odd.load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        other = PretrainStream(
            data_dir, "train", build_objective(ObjectiveSection(), ROLES, VOCAB, 48), 8, 7
        )
        other.load_state_dict(state)


def test_epochs_differ_in_order_and_cover_every_window(data_dir):
    s = stream(data_dir, B=1)
    e0, e1 = unit_keys(s, 0), unit_keys(s, 1)
    assert e0 != e1
    assert sorted(e0) == sorted(e1)  # batch size 1 drops nothing: same units, new order
    assert len(set(e0)) == s.units_per_epoch


def test_dynamic_masks_change_across_epochs_static_ones_do_not(data_dir):
    for static in (False, True):
        obj = objective("mlm", mlm={"static": static})
        s = PretrainStream(data_dir, "train", obj, micro_batch_size=1, seed=7)
        rows = [{}, {}]
        for epoch in (0, 1):
            for b in range(s.batches_per_epoch):
                (unit,) = s.units_at(epoch, b)
                rows[epoch][unit.key] = s.batch_at(epoch, b)["mlm_labels"][0]
        common = sorted(rows[0])
        differ = sum(not torch.equal(rows[0][k], rows[1][k]) for k in common)
        if static:
            assert differ == 0
        else:
            assert differ > 0.8 * len(common)


def test_resuming_deep_in_an_epoch_reads_only_what_it_needs(data_dir):
    s = stream(data_dir, kind="mlm", B=4)
    s.load_state_dict({**s.state_dict(), "batch": 30, "samples": 120})
    batch = next(iter(s))
    needed = {u.pieces[0].doc for u in s.units_at(0, 30)}
    assert s.docs_read == len(needed)  # mlm reads no partner: exactly the batch's documents
    assert torch.equal(
        batch["input_ids"], stream(data_dir, kind="mlm").batch_at(0, 30)["input_ids"]
    )
    nsp = stream(data_dir, B=4)
    nsp.load_state_dict({**nsp.state_dict(), "batch": 30, "samples": 120})
    next(iter(nsp))
    assert nsp.docs_read <= 8  # its 4 documents and at most 4 random partners
    replay = stream(data_dir, kind="mlm", B=4)
    take(iter(replay), 31)
    assert replay.docs_read > 3 * s.docs_read


def test_valid_split_is_one_fixed_pass(data_dir):
    v = stream(data_dir, split="valid", B=2)
    first, second = list(v), list(v)
    assert len(first) == v.batches_per_epoch > 0
    assert same(first, second)
    again = list(stream(data_dir, split="valid", B=2))
    assert same(first, again)


def test_corrupted_shard_is_named_or_skipped_and_counted(tmp_path):
    root = make_data_dir(tmp_path)
    path = root / "train/shard-000001.tar"
    raw = bytearray(path.read_bytes())
    raw[2000] ^= 0xFF
    path.write_bytes(bytes(raw))
    # Start-up does not hash the data; the block's crc32 stops the first read of it.
    s = stream(root, B=8)
    with pytest.raises(ShardError, match="train/shard-000001.tar: block 0 .*corrupt.*crc32"):
        for b in range(s.batches_per_epoch):
            s.batch_at(0, b)
    with pytest.warns(UserWarning, match="shard-000001"):
        s = stream(root, on_bad_shard="skip")
    assert s.n_skipped_shards == 1 and s.skipped_shards == ["train/shard-000001.tar"]
    good = DataDir(root)
    keys = {
        d.key
        for name in ("train/shard-000000.tar", "train/shard-000002.tar")
        for d in good.iter_shard(name)
    }
    docs = [s.document(u.pieces[0].doc).key for b in range(5) for u in s.units_at(0, b)]
    assert set(docs) <= keys
    stream(root, verify_checksums=False, on_bad_shard="skip")  # opted out of hashing


def test_uint32_shards_give_the_same_int64_batches(tmp_path, data_dir):
    wide = make_data_dir(tmp_path, dtype=np.uint32)  # same documents, other token dtype
    assert DataDir(wide).read("train/shard-000000.tar", 0).tokens.dtype == np.uint32
    a, b = stream(data_dir).batch_at(0, 2), stream(wide).batch_at(0, 2)
    assert a["input_ids"].dtype == b["input_ids"].dtype == torch.int64
    assert same([a], [b])


def test_token_ids_out_of_the_vocabulary_are_named(tmp_path):
    root = make_data_dir(tmp_path, dtype=np.uint32)
    small = build_objective(ObjectiveSection(kind="mlm"), ROLES, 500, SEQ)
    s = PretrainStream(root, "train", small, micro_batch_size=4, seed=7)
    with pytest.raises(
        ShardError, match=r"train/shard-00000\d\.tar document \d+ .*vocabulary size 500"
    ):
        next(iter(s))


def test_too_little_data_for_one_batch_is_a_config_error(data_dir):
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        stream(data_dir, split="valid", B=10_000)


@pytest.fixture(scope="module")
def gappy_dir(tmp_path_factory):
    """Shards with empty documents here and there, and documents of every size."""
    root = tmp_path_factory.mktemp("gappy")
    rng = np.random.default_rng(3)
    entries = []
    for s in range(3):
        w = ShardWriter.local(root, shard_name("train", s), np.uint16, block_tokens=500)
        for i in range(90):
            n = 0 if rng.random() < 0.15 else int(rng.integers(1, 90))
            ends = np.array([n], dtype=np.int32) if n else np.zeros(0, np.int32)
            w.write(Document(f"d{s}-{i}", rng.integers(6, VOCAB, n), ends, np.zeros(0, np.int32)))
        entries.append(w.close())
    write_manifest(
        root,
        {"format_version": 3, "tokenizer": {"path": "t"}, "splits": {"train": {"shards": entries}}},
    )
    return root


@pytest.mark.parametrize(
    "kind,section",
    [("mlm", {}), ("mlm", {"mlm": {"packing": "full_sentences"}}), ("clm", {}), ("plm", {})],
)
def test_groups_laid_out_lazily_give_the_units_of_the_whole_epoch(gappy_dir, kind, section):
    """The loader lays out only the groups a batch touches; every unit must equal the one
    a layout of the whole epoch order gives (units straddling groups included), and the
    groups must hold every non-empty document exactly once."""
    obj = objective(kind, **section)
    s = PretrainStream(gappy_dir, "train", obj, 1, seed=5, chunk_docs=4, group_chunks=3)
    data = DataDir(gappy_dir)
    lengths = np.concatenate([data.doc_lengths(e["name"]) for e in data.shards("train")])
    for epoch in (0, 1):
        plan = s._core.sources[0].plan(epoch)
        groups = [plan.group(g) for g in range(plan.offsets.shape[0] - 1)]
        order = np.concatenate([g[0] for g in groups])
        assert sorted(order.tolist()) == np.flatnonzero(lengths > 0).tolist()
        assert np.array_equal(np.concatenate([g[1] for g in groups]), lengths[order])
        whole = obj.layout(order, lengths[order])
        assert whole.n_units == plan.n_units == s.units_per_epoch
        lazy = s._core.sources[0].plan(epoch)._units(np.arange(whole.n_units))
        assert lazy == whole.units(np.arange(whole.n_units))
    # the shuffle is per epoch: the second epoch puts the documents in another order
    assert not np.array_equal(
        s._core.sources[0].plan(0).group(0)[0], s._core.sources[0].plan(1).group(0)[0]
    )


def test_start_reads_only_document_counts(data_dir, monkeypatch):
    """Building the stream reads each shard's document counts once and no document."""
    calls = []
    real = DataDir.read
    monkeypatch.setattr(DataDir, "read", lambda self, *a: calls.append(a) or real(self, *a))
    s = stream(data_dir, kind="mlm")
    assert calls == [] and s.docs_read == 0
    assert len(s._core.sources[0].chunk_extent) < 240 / 8  # per-chunk sums, not per-document tables
