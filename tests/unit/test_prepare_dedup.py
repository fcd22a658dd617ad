"""Exact dedup after the write: ``worker.fix_unit`` gives the parts, counts and reject
examples a write that never saw the duplicates gives (``write_unit`` with them known).

No Ray here: the tasks' bodies on real files, a real tokenizer and the real reducer
(``dedup.duplicates``), units cut from real inputs by the driver's plan.
"""

import copy
import dataclasses
import json
import random

import pyarrow.fs as pafs
import pytest

from pipeline.data.shards import SPLITS
from pipeline.prepare import dedup
from pipeline.prepare.clean import CleanConfig
from pipeline.prepare.job import plan_units
from pipeline.prepare.quality import C4, run_filters
from pipeline.prepare.readers import resolve_inputs
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer
from pipeline.prepare.worker import JobSpec, fix_unit, write_unit

WORDS = "alpha beta gamma delta model reads text learns word shard block part unit Paris".split()


def _doc(rng: random.Random, i: int) -> str:
    n_sent = rng.choice([1, 2, 3, 12])
    return " ".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + f" n{i}."
        for _ in range(n_sent)
    )


def _corpus(seed: int) -> list[str]:
    """Documents with repeats: near and far, of long ones, of one with no token, of
    very short ones (rejected before dedup, never keyed)."""
    rng = random.Random(seed)
    docs = []
    for i in range(150):
        r = rng.random()
        if docs and r < 0.25:
            docs.append(rng.choice(docs[-5:] if r < 0.1 else docs))
        elif r < 0.27:
            docs.append("\ufffd" * 20)  # no token at all (BertNormalizer drops U+FFFD)
        elif r < 0.29:
            docs.append("tiny")  # too_short
        else:
            docs.append(_doc(rng, i))
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "c.txt").write_text("\n\n".join(_corpus(0)), encoding="utf-8")
    spec = TokenizerSpec(kind="wordpiece", vocab_size=200)
    return train_tokenizer([str(root / "c.txt")], spec, root / "wp")


def _spec(sources, out, tokenizer, **kw) -> JobSpec:
    out.mkdir()
    for split in SPLITS:
        (out / split).mkdir()
    return JobSpec(
        sources=sources,
        output=str(out),
        fs=pafs.LocalFileSystem(),
        tokenizer_json=(tokenizer / "tokenizer.json").read_text(),
        vocab_size=200,
        clean=CleanConfig().model_dump(),
        valid_fraction=kw.get("valid_fraction", 0.3),
        max_doc_tokens=kw.get("max_doc_tokens", 24),
        max_doc_bytes=1 << 20,
        shard_docs=kw.get("shard_docs"),
        shard_bytes=kw.get("shard_bytes"),
        block_tokens=kw.get("block_tokens", 40),
        batch_docs=kw.get("batch_docs", 16),
        entities=kw.get("entities"),
        language_id=kw.get("language_id", False),
        languages=kw.get("languages"),
        filters=kw.get("filters", ()),
    )


def _files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def _as_written(parts: dict) -> dict:
    """Part entries with ``fix-`` names as a write task would have named them."""
    return {split: [{**e, "name": e["name"].replace("/fix-", "/part-"),
                     "index": e["index"].replace("/fix-", "/part-")} for e in entries]
            for split, entries in parts.items()}  # fmt: skip


CASES = [
    {"shard_docs": 5},
    {"shard_bytes": 700, "block_tokens": 25},
    {"shard_docs": 1000, "block_tokens": 1 << 19, "max_doc_tokens": 1000},
    {"shard_docs": 3, "block_tokens": 7, "valid_fraction": 0.0, "batch_docs": 3},
    {"shard_bytes": 5000, "entities": ["Paris", "model reads"]},
    # Language ID and a filter that drops lines (C4's, for every language): the dedup
    # key is the filtered text's, the counts per rule survive the fix.
    {"shard_docs": 5, "language_id": True, "filters": (C4(languages=["*"], min_sentences=2),)},
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fix_unit_equals_a_write_that_never_saw_the_duplicates(tmp_path, tokenizer, case):
    kw = CASES[case]
    docs = _corpus(case + 1)
    (tmp_path / "in").mkdir()
    half = len(docs) // 2  # two inputs: a txt and a jsonl, repeats across them
    (tmp_path / "in/a.txt").write_text("\n\n".join(docs[:half]) + "\n", "utf-8")
    lines = [json.dumps({"text": d}) for d in docs[half:]]
    (tmp_path / "in/b.jsonl").write_text("\n".join(lines) + "\n", "utf-8")
    sources = resolve_inputs([str(tmp_path / "in")])
    units = plan_units(sources, 1200)
    assert len(units) >= 4
    fused = _spec(sources, tmp_path / "fused", tokenizer, **kw)
    never = _spec(sources, tmp_path / "never", tokenizer, **kw)
    n_partitions = 3
    written = [write_unit(fused, i, unit, n_partitions) for i, unit in enumerate(units)]
    index = list(range(len(units)))
    reduced = [dedup.duplicates(index, [w[2][p] for w in written]) for p in range(n_partitions)]
    n_fixed = n_rejected = n_inside = 0
    fixed_results = []
    for i, (unit, (result, trace, _)) in enumerate(zip(units, written, strict=True)):
        n_inside += result.rejected["duplicate"]  # repeats inside the unit, never written
        dups = dedup.of_unit(i, reduced)  # repeats of earlier units' documents
        # what the job's fix task gets: the unit's group of each reducer, the same set
        groups = [dedup.by_unit_group(r, 3) for r in reduced]
        assert dedup.of_unit(i, [g[i % 3] for g in groups]) == dups
        assert all((g[k][:, 0] % 3 == k).all() for g in groups for k in range(3))
        again = fix_unit(fused, unit, copy.deepcopy(result), trace, dups)  # a retried task
        fixed = fix_unit(fused, unit, result, trace, dups)
        assert again == fixed
        fixed_results.append(fixed)
        want, _, _ = write_unit(never, i, unit, n_partitions, known_duplicates=frozenset(dups))
        n_fixed += bool(dups)
        assert _as_written(fixed.parts) == want.parts, i  # fix- parts: same bytes
        for name in ("read", "kept", "rejected", "examples", "languages", "n_tokens",
                     "filter_rules", "lines_removed"):  # fmt: skip
            assert getattr(fixed, name) == getattr(want, name), (i, name)
        assert fixed.duplicate_positions == want.duplicate_positions
        n_rejected += fixed.rejected["duplicate"]
    assert n_fixed >= 3 and n_inside >= 3
    filters = list(kw.get("filters", ()))
    kept = [d for d in docs if d != "tiny" and run_filters(d, "any", filters).text is not None]
    assert n_rejected == sum(1 for k, d in enumerate(kept) if d in kept[:k])
    if filters:
        assert sum(r.rejected["c4"] for r in fixed_results) > 0
    # The same files once the parts the fixes replaced are gone (the driver's job).
    named = {e[key] for r in fixed_results for es in r.parts.values() for e in es
             for key in ("name", "index")}  # fmt: skip
    got = {k.replace("/fix-", "/part-"): v for k, v in _files(tmp_path / "fused").items()
           if k in named}  # fmt: skip
    assert got == _files(tmp_path / "never")
    assert any("/fix-" in name for name in named)


def test_fix_parts_are_own_files_of_prepare():
    """A run killed while it fixes parts leaves ``fix-`` parts: the next run cleans them."""
    from pipeline.prepare.store import _OWN_SHARD

    for name in ("fix-000001-002.tar", "fix-000001-002.idx.npy", "fix-000001-002.tar.tmp"):
        assert _OWN_SHARD.fullmatch(name)
    assert not _OWN_SHARD.fullmatch("fixed-000001-002.tar")


def _near_corpus(seed: int) -> list[str]:
    """``_corpus`` with near-duplicates: a document again with a word or two changed,
    near and far, and some twice (a cluster of three)."""
    rng = random.Random(seed)
    docs = _corpus(seed)
    for _ in range(80):
        k = rng.randrange(len(docs))
        words = docs[k].split()
        if len(words) < 20:
            continue
        for _ in range(rng.randint(1, 2)):
            words[rng.randrange(len(words))] = rng.choice(WORDS)
        docs.insert(rng.randint(k + 1, len(docs)), " ".join(words))
    return docs


@pytest.mark.parametrize("case", [0, 1, 3])
def test_fix_unit_drops_near_duplicates_as_a_write_that_never_saw_them(tmp_path, tokenizer, case):
    """Duplicates and near-duplicates in one fix: the parts, counts and examples (each
    near-duplicate's with the kept document's place) of a write that never saw them."""
    from pipeline.prepare import near_dedup
    from pipeline.prepare.worker import trace_example

    kw = CASES[case]
    docs = _near_corpus(case + 10)
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("\n\n".join(docs) + "\n", "utf-8")
    sources = resolve_inputs([str(tmp_path / "in")])
    units = plan_units(sources, 2500)
    assert len(units) >= 4
    near = near_dedup.NearDedupSpec()
    fused = dataclasses.replace(
        _spec(sources, tmp_path / "fused", tokenizer, **kw), near_dedup=near
    )
    never = _spec(sources, tmp_path / "never", tokenizer, **kw)
    n_exact, n_near = 2, 3
    written = [write_unit(fused, i, unit, n_exact, n_near_partitions=n_near)
               for i, unit in enumerate(units)]  # fmt: skip
    index = list(range(len(units)))
    reduced = [dedup.duplicates(index, [w[2][p] for w in written]) for p in range(n_exact)]
    edges = [near_dedup.candidates(index, [w[2][n_exact + q] for w in written])
             for q in range(n_near)]  # fmt: skip
    removed, _ = near_dedup.components(edges, 2)

    def kept_example(unit: int, position: int):
        return trace_example(fused, units[unit], written[unit][1], position)

    n_near_found = 0
    for i, (unit, (result, trace, _)) in enumerate(zip(units, written, strict=True)):
        dups = dedup.of_unit(i, reduced)
        nears = near_dedup.of_unit(i, removed)
        fixed = fix_unit(fused, unit, result, trace, dups, nears, kept_example)
        known = {p: kept_example(*kept) for p, kept in nears.items() if p not in dups}
        want, _, _ = write_unit(never, i, unit, 1, frozenset(dups), known_near_duplicates=known)
        assert _as_written(fixed.parts) == want.parts, i
        for name in ("read", "kept", "rejected", "examples", "languages", "n_tokens"):
            assert getattr(fixed, name) == getattr(want, name), (i, name)
        n_near_found += fixed.rejected["near_duplicate"]
        for example in fixed.examples.get("near_duplicate", []):
            kept = example["kept"]  # the kept one comes first in source order
            assert (kept.get("from_byte", 0), kept["ordinal"]) < (
                example.get("from_byte", 0), example["ordinal"]
            )  # fmt: skip
    assert n_near_found >= 12
