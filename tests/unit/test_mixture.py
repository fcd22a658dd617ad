"""Data mixtures (``data.sources``): shares by weight in every window, up/down-sampling,
exact resume, one tokenizer. Real shards (ShardWriter) and the real stream."""

import json
from collections import Counter

import numpy as np
import pytest
import torch
from test_stream import ROLES, VOCAB, make_data_dir, objective, same, take

from pipeline.config import DataSection
from pipeline.data.shards import DataDir
from pipeline.errors import ConfigError
from pipeline.loader.mixture import open_sources, shares
from pipeline.loader.stream import MixSource, PretrainStream, _Interleave
from pipeline.models import build_model, resolve_model_config
from pipeline.objectives import OBJECTIVES


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Three data dirs of different sizes, one tokenizer fingerprint."""
    out = {}
    for name, n_docs, seed in (("big", 300, 1), ("small", 60, 2), ("mid", 150, 3)):
        root = make_data_dir(tmp_path_factory.mktemp(name), n_docs=n_docs, seed=seed)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["tokenizer"]["fingerprint"] = "same-tokenizer"
        (root / "manifest.json").write_text(json.dumps(manifest))
        out[name] = root
    return out


def ready(kind):
    """The objective as the trainer hands it to the loader (ERNIE knows the run's length,
    word2vec its model and unigram counts)."""
    obj = objective(kind)
    if kind == "ernie":
        obj.total_batches = 100
    if kind == "word2vec":
        cfg = resolve_model_config({"arch": "word2vec", "preset": "word2vec-tiny"}, VOCAB)
        obj.attach(build_model("word2vec", cfg))
        obj.set_counts(np.ones(VOCAB, dtype=np.int64))
    return obj


def mixed(dirs, weights, kind="mlm", B=4, **kw):
    sources = [MixSource(dirs[name], w, name) for name, w in weights.items()]
    return PretrainStream(sources, "train", ready(kind), micro_batch_size=B, seed=3, **kw)


def test_interleave_seeks_to_any_position():
    mix = _Interleave([0.5, 0.3, 0.2])
    # the definition: every source's units merged by (time, source)
    walk = [
        (k, j) for _, k, j in sorted((mix.time(k, j), k, j) for k in range(3) for j in range(5000))
    ]
    walk = walk[:5000]
    for start in (0, 1, 7, 999, 2500, 4990):
        ks, js = mix.take(start, 10)
        assert list(zip(ks.tolist(), js.tolist(), strict=True)) == walk[start : start + 10]
        before = Counter(k for k, _ in walk[:start])
        assert mix.counts(start) == [before[k] for k in range(3)]
    # each source's units come in order 0, 1, 2, ... (its own stream)
    for k in range(3):
        assert [j for kk, j in walk if kk == k] == list(range(sum(kk == k for kk, _ in walk)))


def test_shares_follow_the_weights_in_every_window(dirs):
    weights = {"big": 0.6, "small": 0.25, "mid": 0.15}
    s = mixed(dirs, weights, B=8)
    sources = [
        k
        for b in range(1250)
        for k in s.sources_at(b // s.batches_per_epoch, b % s.batches_per_epoch)
    ]
    n = len(sources)
    assert n == 10_000
    counts = Counter(sources)
    for k, w in enumerate(weights.values()):
        se = (w * (1 - w) / n) ** 0.5
        assert abs(counts[k] / n - w) < 3 * se, (k, counts[k] / n, w)
    # not "all of A, then B": every window of 100 consecutive examples holds the shares
    # give or take one example (within one nominal epoch: batches are consecutive positions)
    first_epoch = sources[: s.batches_per_epoch * 8]
    for start in range(0, len(first_epoch) - 100, 37):
        window = Counter(first_epoch[start : start + 100])
        for k, w in enumerate(weights.values()):
            assert abs(window[k] - 100 * w) <= 1.5, (start, k, window)


def test_upsampled_source_repeats_with_reshuffles_downsampled_one_does_not(dirs):
    s = mixed(dirs, {"big": 1.0, "small": 1.0}, B=1)
    n_big, n_small = s.source_units()
    assert n_small < n_big / 2  # at equal weights the small source is read > twice as often
    seen: dict[int, list] = {0: [], 1: []}
    position = 0
    while len(seen[1]) < 2 * n_small:
        epoch, index = divmod(position, s.batches_per_epoch)
        (k,), (unit,) = s.sources_at(epoch, index), s.units_at(epoch, index)
        seen[k].append(unit.key)
        position += 1
    first, second = seen[1][:n_small], seen[1][n_small:]
    assert sorted(first) == sorted(second) and len(set(first)) == n_small  # every unit once
    assert first != second  # in a new order: the source's next epoch is reshuffled
    assert len(set(seen[0])) == len(seen[0]) < n_big  # the big one: a part, no repeats
    # what the dry run reports for the same run
    plan = shares([MixSource(DataDir(dirs["big"]), 1.0, "big"),
                   MixSource(DataDir(dirs["small"]), 1.0, "small")],
                  objective("mlm"), position)  # fmt: skip
    assert plan[1].units == n_small and plan[1].epochs == pytest.approx(2.0, abs=0.01)
    assert plan[0].epochs == pytest.approx(len(seen[0]) / n_big, abs=0.01) and plan[0].epochs < 1


# every objective but distill, whose loader is mlm's (its teacher acts in the loss)
@pytest.mark.parametrize("kind", sorted(set(OBJECTIVES) - {"distill"}))
def test_exact_resume_and_worker_count_with_two_sources(dirs, kind):
    weights = {"big": 0.7, "small": 0.3}
    s = mixed(dirs, weights, kind)
    full = take(iter(s), 12)
    assert all(set(b["source_ids"].tolist()) <= {0, 1} for b in full)
    first = mixed(dirs, weights, kind)
    take(iter(first), 5)
    state = first.state_dict()
    resumed = mixed(dirs, weights, kind)
    resumed.load_state_dict(state)
    assert same(take(iter(resumed), 7), full[5:])
    workers = mixed(dirs, weights, kind, num_workers=2)
    assert same(take(iter(workers), 12), full)
    with pytest.raises(ValueError, match="sources"):  # another mixture: refused
        mixed(dirs, {"big": 0.5, "small": 0.5}, kind).load_state_dict(state)


def test_ranks_split_the_same_positions_whatever_the_world_size(dirs):
    weights = {"big": 0.5, "mid": 0.5}
    one = mixed(dirs, weights, B=4)
    two = [mixed(dirs, weights, B=2, rank=r, world_size=2) for r in (0, 1)]
    for b in range(6):
        keys = [(k, u.key) for k, u in zip(one.sources_at(0, b), one.units_at(0, b), strict=True)]
        split = [
            (k, u.key)
            for t in two
            for k, u in zip(t.sources_at(0, b), t.units_at(0, b), strict=True)
        ]
        assert keys == split


def test_recurrent_rows_stay_in_one_source(dirs):
    s = mixed(dirs, {"big": 0.75, "small": 0.25}, "clm-recurrent", B=4)
    rows = [s.sources_at(0, b) for b in range(5)]
    assert all(r == rows[0] for r in rows) and sorted(Counter(rows[0]).values()) == [1, 3]
    # each row reads its source's stream segment after segment
    for row in range(4):
        keys = [s.units_at(0, b)[row].key[0] for b in range(5)]
        assert keys == list(range(keys[0], keys[0] + 5))


def test_a_source_with_another_tokenizer_is_named(dirs, tmp_path):
    odd = make_data_dir(tmp_path / "odd", n_docs=40)
    manifest = json.loads((odd / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = "another-tokenizer"
    (odd / "manifest.json").write_text(json.dumps(manifest))
    cfg = DataSection(
        sources=[{"path": str(dirs["big"]), "weight": 2}, {"path": str(odd), "name": "oddone"}]
    )
    with pytest.raises(ConfigError, match=r"source 'oddone' .* another tokenizer"):
        open_sources(cfg)
    one = open_sources(DataSection(path=str(dirs["big"])))
    assert [(s.name, s.weight) for s in one] == [(dirs["big"].name, 1.0)]


def test_config_takes_path_or_sources():
    with pytest.raises(ValueError, match="not both"):
        DataSection(path="a", sources=[{"path": "b"}])
    with pytest.raises(ValueError, match="not both"):
        DataSection()
    with pytest.raises(ValueError, match="distinct `name`"):
        DataSection(sources=[{"path": "x/en"}, {"path": "y/en"}])
    with pytest.raises(ValueError, match="greater than 0"):
        DataSection(sources=[{"path": "x", "weight": 0}])


def test_batches_carry_their_source_and_same_rows_as_the_source_alone(dirs):
    """A row of a mixed batch is the example its source's own stream makes of that unit."""
    s = mixed(dirs, {"big": 0.5, "small": 0.5}, "clm", B=4)
    batch = s.batch_at(0, 0)
    assert batch["source_ids"].shape == (4,)
    assert torch.equal(batch["source_ids"], torch.tensor(s.sources_at(0, 0)))
    for row, (k, unit) in enumerate(zip(s.sources_at(0, 0), s.units_at(0, 0), strict=True)):
        doc = s.document
        expect = np.concatenate(
            [
                np.append(doc(p.doc, k).tokens[p.start : p.stop], [ROLES["eod"]] * p.eod)
                for p in unit.pieces
            ]
        )
        assert np.array_equal(batch["input_ids"][row].numpy(), expect[:-1])


def test_too_small_a_source_or_an_old_loader_state_is_a_config_error(dirs, tmp_path):
    tiny = make_data_dir(tmp_path / "tiny", n_docs=3, n_shards=1)
    sources = [MixSource(DataDir(dirs["big"]), 0.5, "big"), MixSource(DataDir(tiny), 0.5, "tiny")]
    with pytest.raises(ConfigError, match=r"tiny.* yields \d+ clm-recurrent examples, too few"):
        PretrainStream(sources, "train", objective("clm-recurrent"), micro_batch_size=64, seed=3)
    s = mixed(dirs, {"big": 0.5, "small": 0.5})
    with pytest.raises(ConfigError, match="version 1.*start a new train.out_dir"):
        s.load_state_dict({**s.state_dict(), "version": 1})
