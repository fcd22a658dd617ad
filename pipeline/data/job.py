"""The Ray plan of `plm data prepare`: units of work, three waves of tasks, progress.

    plan (driver)      sources -> slices -> units of about ``split_bytes`` of input
    keys   (1 / unit)  read, clean, filter; dedup keys, hash-partitioned  (worker.unit_keys)
    dedup  (1 / part.) the duplicates of one key partition              (dedup.duplicates)
    write  (1 / unit)  tokenize, segment, write the unit's parts        (worker.write_unit)

Every task takes one CPU; Ray places them on any node, and each writes its parts to the
output filesystem itself. The driver holds object refs and per-unit counts only: its
work and memory grow with the number of units, never with the number of documents.
Output bytes depend on the units (the inputs and ``split_bytes``), never on how many
CPUs, workers or nodes ran them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from pipeline.config import ConfigError
from pipeline.data.readers import Slice, Source, plan_slices
from pipeline.data.worker import JobSpec, UnitResult


def plan_units(sources: list[Source], split_bytes: int) -> list[list[Slice]]:
    """Slices packed into units: consecutive slices until a unit holds ``split_bytes``."""
    units: list[list[Slice]] = []
    current: list[Slice] = []
    size = 0
    for part in plan_slices(sources, split_bytes):
        current.append(part)
        size += part.size
        if size >= split_bytes:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return units


# Module-level task bodies, so Ray pickles them by reference.


def _keys_task(spec: JobSpec, unit: list[Slice], n_partitions: int):
    from pipeline.data.worker import unit_keys

    started = time.process_time()
    parts = unit_keys(spec, unit, n_partitions)
    return (*parts, time.process_time() - started)


def _dedup_task(units: list[int], *parts):
    from pipeline.data.dedup import duplicates

    started = time.process_time()
    dups = duplicates(units, list(parts))
    return dups, time.process_time() - started


def _write_task(spec: JobSpec, index: int, unit: list[Slice], *reduced) -> UnitResult:
    from pipeline.data.dedup import of_unit
    from pipeline.data.worker import write_unit

    started = time.process_time()
    dups = of_unit(index, list(reduced))
    result = write_unit(spec, index, unit, dups)
    result.cpu_seconds = time.process_time() - started
    import ray

    result.node = ray.get_runtime_context().get_node_id()
    return result


class _Progress:
    """A tqdm bar on a terminal; otherwise a line every ``every`` seconds (and at the end)."""

    def __init__(self, total_bytes: int, n_units: int, every: float = 30.0):
        self.total, self.n_units, self.every = total_bytes, n_units, every
        self.started = self.last = time.perf_counter()
        self.bytes = self.docs = self.units = 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare")

    def update(self, result: UnitResult) -> None:
        self.units += 1
        self.bytes += result.input_bytes
        self.docs += sum(result.read.values())
        if self.bar is not None:
            self.bar.update(result.input_bytes)
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            rate = self.bytes / max(now - self.started, 1e-9) / 1e6
            print(
                f"prepare: {self.units}/{self.n_units} units, {self.docs:,} documents, "
                f"{self.bytes / 1e6:,.0f} of {self.total / 1e6:,.0f} MB, {rate:.1f} MB/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _unwrap(err: Exception) -> Exception:
    """A user-fixable error raised in a task (e.g. an unreadable input) as itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, ConfigError) else err


def run_job(spec: JobSpec, units: list[list[Slice]], n_partitions: int) -> dict[str, Any]:
    """Run the three waves on the connected Ray cluster; results in unit order + CPU."""
    import ray

    spec_ref = ray.put(spec)
    # Reading and writing are the work: spread over the nodes. Without it Ray's locality
    # preference puts the write tasks where the (small) dedup results sit, which can be
    # one node of the cluster (seen on a 2-node test cluster).
    keys = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_keys_task)
    dedup = ray.remote(num_cpus=1)(_dedup_task)
    write = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_write_task)
    index = list(range(len(units)))
    key_refs = [
        keys.options(num_returns=n_partitions + 1).remote(spec_ref, unit, n_partitions)
        for unit in units
    ]
    reducers = [
        dedup.options(num_returns=2).remote(index, *[refs[p] for refs in key_refs])
        for p in range(n_partitions)
    ]
    reduced = [dups for dups, _ in reducers]
    pending = [write.remote(spec_ref, i, unit, *reduced) for i, unit in enumerate(units)]
    progress = _Progress(sum(p.size for unit in units for p in unit), len(units))
    results: list[UnitResult | None] = [None] * len(units)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=5.0)
            for ref in ready:
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    raise _unwrap(err) from None
                results[result.unit] = result
                progress.update(result)
    finally:
        progress.close()
        for ref in pending:
            ray.cancel(ref, force=True)
    cpu = sum(ray.get([refs[-1] for refs in key_refs])) + sum(ray.get([c for _, c in reducers]))
    return {
        "results": results,
        "keys_and_dedup_cpu_seconds": cpu,
        "write_cpu_seconds": sum(r.cpu_seconds for r in results if r is not None),
        "nodes": len({r.node for r in results if r is not None}),
    }


def init_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to / start Ray; True when this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        from pipeline.output import quiet_ray_auth_notice

        quiet_ray_auth_notice()
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
    return True
