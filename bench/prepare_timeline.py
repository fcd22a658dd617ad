"""Where `plm data prepare`'s CPU goes over time: CPU seconds per process per time bucket.

    python bench/prepare_timeline.py [--bucket 2] -- plm data prepare --input ... --num-cpus 2

Runs the command, samples its process tree (the driver, Ray's own processes, the workers)
every 0.25 s with psutil, and prints one row per process that used at least 0.2 CPU s:
its total, then its CPU seconds in each bucket of wall-clock time from the command's
start. Ray names its workers after what they run (``ray::_write_task``, ``ray::_dedup_task``,
``ray::_fix_task``, ``ray::IDLE`` for a worker between tasks), so the rows say which
stage or which part of Ray the time went to. docs/benchmarks.md's figures for Ray's own
processes ("Left and not changed") were read off this table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import psutil


def process_label(process: psutil.Process) -> str:
    name = process.name()
    if name.startswith("ray::"):
        return name
    return " ".join(process.cmdline())[-60:] or name


def telling_label(old: str | None, new: str) -> str:
    """A Ray worker is renamed when it takes an actor or a task (and ``ray::IDLE`` between
    tasks): keep the first name that says what it ran."""
    if old is None:
        return new
    old_says = old.startswith("ray::") and old != "ray::IDLE"
    new_says = new.startswith("ray::") and new != "ray::IDLE"
    return new if new_says and not old_says else old


def sample_tree(command: list[str], every: float) -> tuple[dict, dict, float]:
    """Run ``command``; return {pid: [(seconds since start, CPU seconds)]}, labels, wall."""
    start = time.perf_counter()
    root = psutil.Popen(command)
    series: dict[int, list[tuple[float, float]]] = defaultdict(list)
    labels: dict[int, str] = {}
    while root.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        now = time.perf_counter() - start
        for process in tree:
            try:
                times = process.cpu_times()
                label = process_label(process)
            except psutil.Error:
                continue
            labels[process.pid] = telling_label(labels.get(process.pid), label)
            series[process.pid].append((now, times.user + times.system))
        time.sleep(every)
    return series, labels, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", type=float, default=2.0, help="seconds per column")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- plm data prepare ...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    series, labels, wall = sample_tree(command, 0.25)
    n_buckets = int(wall // args.bucket) + 1
    print(f"wall {wall:.1f} s; CPU seconds per {args.bucket:g} s bucket, from the start:")
    print(
        f"{'total':>7} {'process':44s}",
        " ".join(f"{i * args.bucket:5.0f}" for i in range(n_buckets)),
    )
    rows = sorted(series.items(), key=lambda item: -item[1][-1][1])
    for pid, points in rows:
        if points[-1][1] < 0.2:
            continue
        buckets = [0.0] * n_buckets
        previous = 0.0
        for seconds, cpu in points:
            buckets[int(seconds // args.bucket)] += cpu - previous
            previous = cpu
        print(
            f"{points[-1][1]:7.2f} {labels[pid][:44]:44s}", " ".join(f"{b:5.2f}" for b in buckets)
        )
    print(f"{sum(p[-1][1] for p in series.values()):7.2f} all processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
