"""Loader batches per second: one data dir vs the same documents as a mixture of 4.

    python bench/bench_mixture.py [--docs 8000 --batch-size 32 --batches 150 --rounds 3]

Builds the documents of bench_loader.py (the real ShardWriter) twice: once as one data
dir, once cut into 4 data dirs, and reads them with PretrainStream (mlm+nsp, seq 128):
the single dir, and ``data.sources`` with the 4 dirs at equal weights. Alternating
rounds in one process (torch on one thread, as in a loader worker), each from a fresh
stream (its start included) for ``--batches`` batches; prints the median batches per
CPU second of each and their ratio (goal: the mixture >= 0.9x one source).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_loader import ROLES, VOCAB, build_data

from pipeline.config import ObjectiveSection
from pipeline.data.shards import DataDir
from pipeline.data.stream import MixSource, PretrainStream
from pipeline.objectives import build_objective


def rate(make, n: int) -> float:
    """Batches per CPU second of this process, from a fresh stream."""
    cpu = time.process_time()
    it = iter(make())
    for _ in range(n):
        next(it)
    return n / (time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_data(root / "one", args.docs)
        parts = []
        for k in range(4):  # the same generator, a quarter of the documents each
            build_data(root / f"part{k}", args.docs // 4, seed=10 + k)
            parts.append(MixSource(DataDir(root / f"part{k}"), 1.0, f"part{k}"))
        objective = build_objective(ObjectiveSection(kind="mlm+nsp"), ROLES, VOCAB, 128)

        def one():
            return PretrainStream(root / "one", "train", objective, args.batch_size, seed=1)

        def mix():
            return PretrainStream(parts, "train", objective, args.batch_size, seed=1)

        rates: dict[str, list[float]] = {"one": [], "mix": []}
        for _ in range(args.rounds):
            rates["one"].append(rate(one, args.batches))
            rates["mix"].append(rate(mix, args.batches))
        a, b = statistics.median(rates["one"]), statistics.median(rates["mix"])
        print(f"one data dir:        {a:7.1f} batches / CPU s  (rounds {rates['one']})")
        print(f"mixture of 4 dirs:   {b:7.1f} batches / CPU s  (rounds {rates['mix']})")
        print(f"mixture / one:       {b / a:7.2f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
