"""Loader batches per second: one data dir vs the same documents as a mixture of 4.

    python bench/bench_mixture.py [--docs 8000 --batch-size 32 --epochs 2 --rounds 3]

Builds the documents of bench_loader.py (the real ShardWriter) twice: once as one data
dir, once cut into 4 data dirs, and reads them with PretrainStream (mlm+nsp, seq 128):
the single dir, and ``data.sources`` with the 4 dirs at equal weights. Alternating
rounds in one process (torch on one thread, as in a loader worker), each from a fresh
stream; per round, in CPU seconds of this process:

* ``start``: building the stream and its first batch;
* ``first 150``: batches per CPU s over the first 150 batches, the start included (a
  mixture reads all its sources' first groups at once, so it front-loads document reads
  that one source spreads over its epoch);
* ``steady``: batches per CPU s over the next ``--epochs`` epochs (of the one-dir
  stream's size), the figure a training run lives with (goal: the mixture >= 0.9x one
  source).

Prints the median of each over the rounds, and the mixture / one ratios.
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
from pipeline.loader.stream import MixSource, PretrainStream
from pipeline.objectives import build_objective


def measure(make, first: int, steady: int) -> dict[str, float]:
    """CPU seconds to start and make the first batch, then batches per CPU second."""
    cpu = time.process_time()
    it = iter(make())
    next(it)
    start = time.process_time() - cpu
    for _ in range(first - 1):
        next(it)
    head = time.process_time() - cpu
    for _ in range(steady):
        next(it)
    tail = time.process_time() - cpu - head
    return {"start": start, "first 150": first / head, "steady": steady / tail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=2.0)
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

        steady = int(args.epochs * one().batches_per_epoch)
        rounds: dict[str, list[dict[str, float]]] = {"one": [], "mix": []}
        for _ in range(args.rounds):
            rounds["one"].append(measure(one, 150, steady))
            rounds["mix"].append(measure(mix, 150, steady))
        print(
            f"{steady} steady batches ({args.epochs} epochs of the one-dir stream), "
            f"median of {args.rounds} rounds"
        )
        print(f"{'':22}{'one dir':>10}{'mix of 4':>10}{'mix / one':>11}")
        for what, unit in (("start", "CPU s"), ("first 150", "b/CPU s"), ("steady", "b/CPU s")):
            a = statistics.median(r[what] for r in rounds["one"])
            b = statistics.median(r[what] for r in rounds["mix"])
            print(f"{what + ' (' + unit + ')':22}{a:10.3f}{b:10.3f}{b / a:11.2f}")


if __name__ == "__main__":
    main()
