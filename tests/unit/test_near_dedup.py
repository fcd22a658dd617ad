"""MinHash LSH near-dedup (pipeline/prepare/near_dedup.py): words, shingles, signatures, the
band reducers and the components, on real text with planted near-duplicates
(bench/planted_corpus.py), measured against exact Jaccard over the same shingles.

No Ray here: the tasks' bodies in one process (the Ray job: tests/integration)."""

import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.prepare import near_dedup as nd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planted_corpus  # noqa: E402

SPEC = nd.NearDedupSpec()


def shingle_sets(texts: list[str], ngram: int = 5) -> list[set[int]]:
    values, first = nd.shingles(texts, ngram)
    return [set(values[first[i] : first[i + 1]].tolist()) for i in range(len(texts))]


def test_words_are_lowercased_word_runs_and_the_fast_ascii_path_agrees():
    hashes, first = nd.words(["Hello, World! x_1 42", "hello world X_1 42", "", "...!"])
    assert first.tolist() == [0, 4, 8, 8, 8]
    assert hashes[:4].tolist() == hashes[4:8].tolist()
    # The same words with a non-ASCII character elsewhere take the regex path.
    other, first = nd.words(["hello — world x_1 42 é"])
    assert other[:4].tolist() == hashes[:4].tolist() and first.tolist() == [0, 5]
    # A CJK ideograph is a word of its own; other letters make runs.
    _, first = nd.words(["模型读文本 naïve café"])
    assert first.tolist() == [0, 7]


def test_shingles_of_short_and_empty_texts():
    values, first = nd.shingles(["a b c d e f g", "one two three", "", "!!"], 5)
    assert np.diff(first).tolist() == [3, 1, 0, 0]  # 7 words: 3 five-grams; fewer: one
    sigs, has_words = nd.signatures(["one two three", "", "One, two... THREE"], SPEC)
    assert has_words.tolist() == [True, False, True]
    assert (sigs[0] == sigs[2]).all()  # the same words: the same signature
    assert (sigs[1] == np.iinfo(np.uint64).max).all()


@pytest.mark.slow
def test_a_signature_value_agrees_with_probability_the_jaccard():
    rng = random.Random(0)
    pool = planted_corpus.sentences()
    errors = []
    for _ in range(150):
        a = " ".join(rng.sample(pool, 20))
        words = a.split()
        for _ in range(rng.randint(1, len(words) // 4)):
            words[rng.randrange(len(words))] = f"w{rng.randrange(10**6)}"
        b = " ".join(words)
        x, y = shingle_sets([a, b])
        sigs, _ = nd.signatures([a, b], SPEC)
        errors.append(float((sigs[0] == sigs[1]).mean()) - len(x & y) / len(x | y))
    errors = np.array(errors)
    # 112 values: the estimate's standard deviation is at most 0.047.
    assert abs(errors.mean()) < 0.01 and errors.std() < 0.06


def test_signatures_do_not_depend_on_the_batch():
    texts = planted_corpus.sentences()[:300]
    whole, _ = nd.signatures(texts, SPEC)
    parts = np.concatenate([nd.signatures(texts[i : i + 7], SPEC)[0] for i in range(0, 300, 7)])
    assert (whole == parts).all()


def _brute_components(edges: list[tuple[int, int]]) -> dict[int, int]:
    parent: dict[int, int] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent if find(x) != x}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_components_keep_the_first_document_in_source_order(seed, n):
    rng = np.random.default_rng(seed)
    ids = nd.pack(rng.integers(0, 6, 400), rng.integers(0, 1 << 31, 400))
    ids = np.unique(ids)
    # Edges as the reducers give them (later -> earlier), over several "partitions",
    # including chains: a component joined only through transitive edges.
    edges = []
    for _ in range(3):
        i = rng.integers(1, ids.shape[0], 150)
        j = (i * rng.random(150)).astype(np.int64)
        edges.append(np.stack([ids[i], ids[j]], axis=1))
    removed, _ = nd.components(edges, n)
    want = _brute_components([tuple(e) for part in edges for e in part.tolist()])
    assert {a: b for a, b in removed.tolist()} == want
    assert removed[:, 0].tolist() == sorted(want)
    assert nd.components([], n)[0].shape == (0, 2)
    assert nd.components([np.zeros((0, 2), np.int64)], n)[0].shape == (0, 2)


@pytest.mark.parametrize("length", [1_000, 30_000])
def test_a_long_chain_in_random_order_takes_logarithmic_rounds(length):
    """The worst shape for label propagation: one path through the documents in random
    order (diameter = length). Large-star / small-star shrink it in O(log^2 n) rounds."""
    ids = nd.pack(np.arange(length) % 7, np.arange(length))
    path = ids[np.random.default_rng(1).permutation(length)]
    edges = np.sort(np.stack([path[1:], path[:-1]], axis=1), axis=1)[:, ::-1].copy()
    removed, rounds = nd.components([edges[: length // 2], edges[length // 2 :]], 3)
    assert removed[:, 0].tolist() == sorted(ids[1:].tolist())
    assert (removed[:, 1] == ids.min()).all()
    assert rounds <= 2 * int(np.log2(length)), rounds


def test_each_cluster_partition_holds_whole_units_and_no_more_edges_than_it_began_with():
    """What bounds a cluster task's memory: a partition holds only the arcs of its own
    units' documents, and no round holds more arcs in all than the reducers' edges make."""
    rng = np.random.default_rng(3)
    ids = np.unique(nd.pack(rng.integers(0, 9, 3000), rng.integers(0, 1 << 20, 3000)))
    i = rng.integers(1, ids.shape[0], 2500)
    edges = np.stack([ids[i], ids[(i * rng.random(2500)).astype(np.int64)]], axis=1)
    edges = edges[edges[:, 0] != edges[:, 1]]
    n = 4
    arcs = [nd.scatter(edges, n)]
    start = sum(a.shape[0] for a in arcs[0])
    for _ in range(6):
        large = [nd.large_star([a[p] for a in arcs], n) for p in range(n)]
        for p, (out, _, removed) in enumerate(large):
            for q, rows in enumerate(out):
                assert ((rows[:, 0] >> 32) % n == q).all()
            assert ((removed[:, 0] >> 32) % n == p).all()
        arcs = [nd.small_star([out[p] for out, _, _ in large], n) for p in range(n)]
        held = sum(a.shape[0] for produced in arcs for a in produced)
        assert held <= start


def test_candidates_link_each_bucket_member_to_its_first():
    # unit 0 holds positions 5 and 9, unit 1 position 2; key 7 is shared by all three.
    parts = [np.array([[7, 9], [7, 5], [3, 1]]), np.array([[7, 2], [4, 0]])]
    edges = nd.candidates([0, 1], parts)
    first = nd.pack(np.array([0]), np.array([5]))[0]
    assert edges.tolist() == sorted(
        [[int(nd.pack(np.array([0]), np.array([9]))[0]), int(first)],
         [int(nd.pack(np.array([1]), np.array([2]))[0]), int(first)]]
    )  # fmt: skip
    assert nd.candidates([0], [np.zeros((0, 2), np.int64)]).shape == (0, 2)


def near_duplicates(docs: list[str], unit_docs: int, n_partitions: int) -> set[int]:
    """The whole near-dedup path in one process: units of ``unit_docs`` documents, their
    band keys in ``n_partitions`` partitions, the reducers, the components."""
    units = []
    for lo in range(0, len(docs), unit_docs):
        texts = docs[lo : lo + unit_docs]
        keys, positions = [], []
        for b in range(0, len(texts), 64):  # batches, as write_unit flushes them
            sigs, ok = nd.signatures(texts[b : b + 64], SPEC)
            keys.append(nd.band_keys(sigs[ok], SPEC))
            positions.append(np.arange(b, b + len(texts[b : b + 64]))[ok])
        units.append(nd.partition(np.concatenate(keys), np.concatenate(positions), n_partitions))
    index = list(range(len(units)))
    edges = [nd.candidates(index, [u[p] for u in units]) for p in range(n_partitions)]
    removed, _ = nd.components(edges, 2)
    unit, position = nd.unpack(removed[:, 0])
    return set((unit * unit_docs + position).tolist())


@pytest.mark.slow
def test_planted_near_duplicates_recall_and_false_removals():
    """Real paragraphs edited to known Jaccard: >= 95% of the copies at J >= 0.8 are
    removed, <= 1% of those at J <= 0.5; the same whatever the units and partitions."""
    shares = {"high": 0.12, "mid": 0.04, "low": 0.3, "exact": 0.02}
    docs, pairs = planted_corpus.generate(4_000_000, seed=1, shares=shares)
    for p in pairs[:200]:  # the recorded J is the exact Jaccard of the same shingles
        x, y = shingle_sets([docs[p.original], docs[p.copy]])
        assert p.jaccard == round(len(x & y) / len(x | y), 4)
    removed = near_duplicates(docs, 400, 3)
    assert near_duplicates(docs, 10_000, 1) == removed  # one unit, one partition
    assert near_duplicates(docs, 97, 5) == removed
    high = [p for p in pairs if p.jaccard >= 0.8]
    low = [p for p in pairs if p.jaccard <= 0.5]
    assert len(high) >= 300 and len(low) >= 400
    recall = sum(p.copy in removed for p in high) / len(high)
    false = sum(p.copy in removed for p in low) / len(low)
    by_bin = Counter(round(p.jaccard - 0.05, 1) for p in low if p.copy in removed)
    assert recall >= 0.95, recall
    assert false <= 0.01, (false, by_bin)
    # Never an original: the first in source order of each cluster is kept.
    originals = {p.original for p in pairs} - {p.copy for p in pairs}
    assert not originals & removed


def test_the_near_dedup_config_section_and_flag(tmp_path):
    from pipeline.cli import build_parser, prepare_config_from_args
    from pipeline.errors import ConfigError
    from pipeline.prepare.config import load_prepare_config

    yaml = tmp_path / "data.yaml"
    yaml.write_text("inputs: [x]\ntokenizer: t\noutput: o\nnear_dedup:\n  bands: 20\n")
    args = build_parser().parse_args(
        ["data", "prepare", "--config", str(yaml), "--near-dedup", "on"]
    )
    cfg = prepare_config_from_args(args)
    assert cfg.near_dedup.enabled and cfg.near_dedup.bands == 20 and cfg.near_dedup.rows == 8
    assert cfg.output_settings()["near_dedup"]["bands"] == 20
    off = load_prepare_config(yaml, {"near_dedup": {"enabled": False}})
    assert "near_dedup" not in off.output_settings()  # off: the config hash of before
    yaml.write_text("inputs: [x]\ntokenizer: t\noutput: o\nnear_dedup:\n  rows: 0\n")
    with pytest.raises(ConfigError, match="near_dedup.rows"):
        load_prepare_config(yaml, {})


def test_a_cluster_task_holds_about_a_partitions_share_of_the_memory():
    """bench/bench_clusters.py's measure, small: each call's traced peak at R = 4 is about
    a quarter of R = 1's (the arcs spread over the units), and the result is the same."""
    import tracemalloc

    import bench_clusters

    reduced = np.array_split(bench_clusters.edges(60_000, n_units=32), 3)
    tracemalloc.start()
    try:
        one, four = bench_clusters.run(reduced, 1), bench_clusters.run(reduced, 4)
    finally:
        tracemalloc.stop()
    assert np.array_equal(one["rows"], four["rows"]) and one["rows"].shape[0] > 50_000
    assert four["peak"] < 0.4 * one["peak"], (four["peak"], one["peak"])
