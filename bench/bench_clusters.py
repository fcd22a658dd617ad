"""The near-dedup clusters (``near_dedup`` step 4) at R partitions: memory per task.

    python bench/bench_clusters.py [--edges 2000000] [--partitions 1,4,16] [--units 64]

An edge set shaped like the band reducers' output: documents of ``--units`` units in
clusters of geometric sizes (mean 4, some of hundreds), each member linked to a random
earlier member of its cluster (random trees: chains of a few links), and a tenth more
links inside clusters. The same edges go through ``near_dedup.components``'s calls
(``scatter``, rounds of ``large_star`` and ``small_star``) one partition at a time, in
this process; each call's peak of new memory is traced (``tracemalloc``: numpy reports
its arrays to it). Reported per R: the largest peak of any one call (what one Ray task
holds beyond its inputs' share) and per step, its ratio to R = 1, the rounds, and that
the result is the same as at R = 1. A ``scatter`` call holds one band reducer's edges
whatever R is (here 4 reducers: a quarter of them), which is bounded by the band
partitions instead.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

import numpy as np

from pipeline.prepare import near_dedup as nd


def edges(n_edges: int, n_units: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sizes = rng.geometric(0.25, size=n_edges)  # cluster sizes, mean 4
    sizes = sizes[np.cumsum(sizes - 1) <= n_edges]
    n_docs = int(sizes.sum())
    ids = np.sort(nd.pack(rng.integers(0, n_units, n_docs), rng.integers(0, 1 << 31, n_docs)))
    ids = ids[rng.permutation(n_docs)]  # a cluster's documents anywhere in the corpus
    start = np.repeat(np.cumsum(sizes) - sizes, sizes)  # each document's cluster start
    offset = np.arange(n_docs) - start
    member = offset > 0
    parent = start[member] + (offset[member] * rng.random(member.sum())).astype(np.int64)
    extra = rng.random(member.sum()) < 0.1
    both = np.concatenate([np.flatnonzero(member), np.flatnonzero(member)[extra]])
    other = np.concatenate([parent, start[member][extra]])
    pairs = np.stack([ids[both], ids[other]], axis=1)
    pairs = np.sort(pairs, axis=1)[:, ::-1]
    return np.ascontiguousarray(pairs[pairs[:, 0] != pairs[:, 1]])


def run(reduced: list[np.ndarray], n: int) -> dict:
    """``near_dedup.components`` at ``n`` partitions, each step's peak of new memory traced
    (tracemalloc must be started)."""
    peaks = {"scatter": 0, "large_star": 0, "small_star": 0}

    def traced(step, *args):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = step(*args)
        used = tracemalloc.get_traced_memory()[1] - before
        peaks[step.__name__] = max(peaks[step.__name__], used)
        return out

    started = time.process_time()
    rows, rounds = nd.components(reduced, n, call=traced)
    return {"peak": max(peaks.values()), "peaks": peaks, "rounds": rounds,
            "cpu": time.process_time() - started, "rows": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=2_000_000)
    parser.add_argument("--partitions", default="1,4,16")
    parser.add_argument("--units", type=int, default=64)
    args = parser.parse_args()
    found = edges(args.edges, args.units)
    reduced = np.array_split(found, 4)  # as 4 band reducers would give them
    tracemalloc.start()
    report, base = [], None
    for n in [int(x) for x in args.partitions.split(",")]:
        got = run(reduced, n)
        if base is None:
            base = got
        report.append({
            "partitions": n,
            "peak_mib_per_task": round(got["peak"] / 2**20, 1),
            "vs_first": round(got["peak"] / base["peak"], 3),
            "peak_mib_by_step": {k: round(v / 2**20, 1) for k, v in got["peaks"].items()},
            "rounds": got["rounds"],
            "cpu_s": round(got["cpu"], 1),
            "same_result": bool(np.array_equal(got["rows"], base["rows"])),
        })  # fmt: skip
    edges_mib = found.nbytes / 2**20
    print(json.dumps({"edges": int(found.shape[0]), "edges_mib": round(edges_mib, 1),
                      "near_duplicates": int(base["rows"].shape[0]), "runs": report}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
