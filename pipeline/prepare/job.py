"""The Ray plan of `plm data prepare`: units of work, three waves of tasks, progress.

    plan (driver)      sources -> slices -> units of about ``split_bytes`` of input
    write  (1 / unit)  read, clean, filter, tokenize, write the unit's parts; the dedup
                       keys (and with near-dedup the MinHash band keys), hash-partitioned,
                       and a trace of the documents                   (worker.write_unit)
    dedup  (1 / part.) the duplicates of one key partition, in groups by unit
                                                                      (dedup.duplicates)
    near   (1 / band partition) candidate edges of one band-key partition
                       (near_dedup.candidates); then rounds of R large-star and R
                       small-star tasks over partitions of whole units join them into
                       clusters, until the edges stop changing     (near_dedup.large_star)
    fix    (1 / unit with a duplicate or near-duplicate)  drop them from the unit's parts
                       and counts (worker.fix_unit: its blocks are filtered, nothing is
                       re-tokenized)

Every task takes one CPU; Ray places them on any node, and each writes its parts to the
output filesystem itself. The driver holds object refs and per-unit counts only: its
work and memory grow with the number of units, never with the number of documents.
Output bytes depend on the units (the inputs and ``split_bytes``), never on how many
CPUs, workers or nodes ran them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.errors import ConfigError
from pipeline.prepare.readers import Slice, Source, plan_slices
from pipeline.prepare.unit import JobSpec, UnitResult


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


def _write_task(
    spec: JobSpec, index: int, unit: list[Slice], n_partitions: int, n_near_partitions: int
):
    from pipeline.prepare import records
    from pipeline.prepare.worker import write_unit

    saved = records.load(spec.fs, spec.output, index)  # done before: a retry or a rerun
    if saved is not None:
        return saved
    started = time.process_time()
    result, trace, parts = write_unit(
        spec, index, unit, n_partitions, n_near_partitions=n_near_partitions
    )
    result.cpu_seconds = time.process_time() - started
    import ray

    result.node = ray.get_runtime_context().get_node_id()
    result.host = socket.gethostname()
    out = (result, trace, *parts)
    records.save(spec.fs, spec.output, index, out)
    return out


def _dedup_task(units: list[int], n_groups: int, *parts):
    from pipeline.prepare.dedup import by_unit_group, duplicates

    started = time.process_time()
    dups = duplicates(units, list(parts))
    return (*by_unit_group(dups, n_groups), np.unique(dups[:, 0]), time.process_time() - started)


def _candidates_task(units: list[int], *parts):
    from pipeline.prepare.near_dedup import candidates

    started = time.process_time()
    edges = candidates(units, list(parts))
    return edges, edges.shape[0], time.process_time() - started


def _scatter_task(edges, n: int):
    from pipeline.prepare.near_dedup import scatter

    started = time.process_time()
    arcs = scatter(edges, n)
    return (time.process_time() - started, *arcs)


def _large_star_task(n: int, *pieces):
    from pipeline.prepare.near_dedup import large_star, units_of

    started = time.process_time()
    out, digest, removed = large_star(list(pieces), n)
    info = (digest, units_of(removed), time.process_time() - started)
    return (*out, info, removed)


def _small_star_task(n: int, *pieces):
    from pipeline.prepare.near_dedup import small_star

    started = time.process_time()
    arcs = small_star(list(pieces), n)
    return (time.process_time() - started, *arcs)


def _clusters(candidates: list, n_units: int, n: int | None) -> dict[str, Any]:
    """Drive the cluster rounds (near_dedup section 4) on Ray. ``candidates``: each band
    reducer's (edges, count) refs; ``n``: the partitions, else sized by the edges. The
    driver fetches a digest, units and CPU per partition and round, never an edge."""
    import ray

    from pipeline.prepare.near_dedup import cluster_partitions

    n = n or cluster_partitions(sum(_get([count for _, count in candidates])), n_units)
    scatter = ray.remote(num_cpus=1)(_scatter_task)
    large_star = ray.remote(num_cpus=1)(_large_star_task)
    small_star = ray.remote(num_cpus=1)(_small_star_task)
    cpu_refs, arcs = [], []  # arcs[k][p]: from producer k to partition p
    for edges, _ in candidates:
        refs = scatter.options(num_returns=n + 1).remote(edges, n)
        cpu_refs.append(refs[0])
        arcs.append(refs[1:])
    cpu, seen, rounds = 0.0, None, 0
    while True:
        rounds += 1
        large = [
            large_star.options(num_returns=n + 2).remote(n, *[a[p] for a in arcs]) for p in range(n)
        ]
        info = _get([refs[n] for refs in large])
        cpu += sum(c for _, _, c in info)
        digests = [digest for digest, _, _ in info]
        if digests == seen:
            break
        seen = digests
        small = [
            small_star.options(num_returns=n + 1).remote(n, *[refs[p] for refs in large])
            for p in range(n)
        ]
        cpu_refs += [refs[0] for refs in small]
        arcs = [refs[1:] for refs in small]
    return {
        "rows": [refs[n + 1] for refs in large],  # by partition: a unit's is unit % n
        "units": sorted({int(u) for _, units, _ in info for u in units}),
        "cpu_seconds": cpu + sum(_get(cpu_refs)),
        "partitions": n,
        "rounds": rounds,
    }


def _fix_task(
    spec: JobSpec,
    index: int,
    unit: list[Slice],
    result: UnitResult,
    trace,
    near_rows,
    all_units,
    traces,
    *reduced,
):
    """``near_rows``: the near-duplicates of the cluster partition that holds this unit
    (or None: near-dedup off); ``all_units``: every unit's slices, ``traces``: every
    unit's trace ref (both None without near-dedup), a trace fetched only for a unit
    whose document a near-duplicate example names as kept; ``reduced``: the group of
    this unit's from every exact-dedup reducer."""
    import ray

    from pipeline.prepare import near_dedup
    from pipeline.prepare.dedup import of_unit
    from pipeline.prepare.worker import fix_unit, trace_example

    started = time.process_time()
    near = near_dedup.of_unit(index, near_rows) if near_rows is not None else {}
    found: dict[int, tuple[list[Slice], Any]] = {index: (unit, trace)}

    def kept_example(kept_unit: int, position: int) -> dict[str, Any]:
        if kept_unit not in found:
            found[kept_unit] = (all_units[kept_unit], ray.get(traces[kept_unit]))
        slices, kept_trace = found[kept_unit]
        return trace_example(spec, slices, kept_trace, position)

    result = fix_unit(spec, unit, result, trace, of_unit(index, list(reduced)), near, kept_example)
    return result, time.process_time() - started


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


def run_job(
    spec: JobSpec,
    units: list[list[Slice]],
    n_partitions: int,
    n_near_partitions: int = 0,
    n_cluster_partitions: int | None = None,
) -> dict[str, Any]:
    """Run the waves on the connected Ray cluster; results in unit order + CPU. With
    ``spec.near_dedup``, ``n_near_partitions`` band-key partitions (at least one), and
    ``n_cluster_partitions`` for the clusters (None: sized by the candidate edges)."""
    import ray

    near_on = spec.near_dedup is not None
    n_near = max(1, n_near_partitions) if near_on else 0
    spec_ref = ray.put(spec)
    written = _write_wave(spec_ref, units, n_partitions, n_near)
    groups = max(1, min(n_partitions, len(units)))  # a fix task reads 1/groups of them
    reducers = _dedup_wave(written, len(units), n_partitions, groups)
    candidates = _candidates_wave(written, len(units), n_partitions, n_near) if near_on else []
    units_ref = ray.put(units) if near_on else None
    traces_ref = ray.put([refs[1] for refs in written]) if near_on else None
    progress = _Progress(sum(p.size for unit in units for p in unit), len(units))
    results: list[UnitResult | None] = [None] * len(units)

    def on_written(result: UnitResult) -> None:
        results[result.unit] = result
        progress.update(result)

    def on_fixed(result: UnitResult) -> None:
        results[result.unit] = result

    try:
        _each_result([refs[0] for refs in written], on_written)
        # Units with a duplicate (per-unit lists, not the duplicates) get their parts fixed.
        with_dups = _get([refs[groups] for refs in reducers])
        clusters = None
        if near_on:
            clusters = _clusters(
                [(edges, count) for edges, count, _ in candidates],
                len(units),
                n_cluster_partitions,
            )
            with_dups.append(clusters["units"])
        affected = sorted({int(u) for units_of in with_dups for u in units_of})
        fixes = _fix_wave(
            spec_ref, units, affected, written, reducers, groups, clusters, units_ref, traces_ref
        )
        del written  # the traces and key partitions can go once nothing needs them
        _each_result([result for result, _ in fixes], on_fixed)
        fix_cpu = sum(_get([cpu for _, cpu in fixes]))
    finally:
        progress.close()
    dedup_cpu = sum(_get([refs[groups + 1] for refs in reducers])) + fix_cpu
    near_reducer_cpu = (
        sum(_get([cpu for _, _, cpu in candidates])) + clusters["cpu_seconds"] if clusters else 0.0
    )
    return _summary(results, dedup_cpu, near_reducer_cpu, clusters, len(affected))


def _summary(results: list, dedup_cpu: float, near_reducer_cpu: float, clusters, n_fixed: int):
    """What ``run_job`` returns: the results in unit order, CPU seconds and placement."""
    near_cpu = near_reducer_cpu + sum(r.near_dedup_cpu_seconds for r in results if r)
    return {
        "results": results,
        "dedup_cpu_seconds": dedup_cpu,
        # Near-dedup's own: signatures (in the write tasks), candidates, clusters.
        "near_dedup_cpu_seconds": near_cpu,
        "near_dedup_reducer_cpu_seconds": near_reducer_cpu,
        "near_dedup_cluster_partitions": clusters["partitions"] if clusters else 0,
        "near_dedup_cluster_rounds": clusters["rounds"] if clusters else 0,
        "write_cpu_seconds": sum(r.cpu_seconds for r in results if r and not r.reused),
        "units_fixed": n_fixed,
        "units_reused": sum(1 for r in results if r is not None and r.reused),
        "nodes": len({r.node for r in results if r is not None}),
        "hosts": sorted({r.host for r in results if r is not None}),
    }


def _write_wave(spec_ref, units: list[list[Slice]], n_partitions: int, n_near: int) -> list:
    """One write task per unit: each one's refs (result, trace, the ``n_partitions`` key
    partitions, then the ``n_near`` band-key partitions)."""
    import ray

    # Reading and writing are the work: spread over the nodes. Without it Ray's locality
    # preference puts tasks where their (small) inputs sit, which can be one node of the
    # cluster (seen on a 2-node test cluster).
    write = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_write_task)
    return [
        write.options(num_returns=n_partitions + n_near + 2).remote(
            spec_ref, i, unit, n_partitions, n_near
        )
        for i, unit in enumerate(units)
    ]


def _dedup_wave(written: list, n_units: int, n_partitions: int, groups: int) -> list:
    """One exact-dedup reducer per key partition: each one's refs (its duplicates in
    ``groups`` groups by unit, the units that have one, its CPU seconds)."""
    import ray

    dedup = ray.remote(num_cpus=1)(_dedup_task)
    index = list(range(n_units))
    return [
        dedup.options(num_returns=groups + 2).remote(
            index, groups, *[refs[2 + p] for refs in written]
        )
        for p in range(n_partitions)
    ]


def _candidates_wave(written: list, n_units: int, n_partitions: int, n_near: int) -> list:
    """One near-dedup candidates reducer per band-key partition: (edges, count, CPU) refs."""
    import ray

    near = ray.remote(num_cpus=1)(_candidates_task)
    index = list(range(n_units))
    return [
        near.options(num_returns=3).remote(index, *[refs[2 + n_partitions + q] for refs in written])
        for q in range(n_near)
    ]


def _fix_wave(
    spec_ref,
    units,
    affected: list[int],
    written,
    reducers,
    groups: int,
    clusters,
    units_ref,
    traces_ref,
) -> list:
    """One fix task per unit in ``affected``: each one's (result, CPU seconds) refs. It
    gets its unit's group from every exact-dedup reducer and, with near-dedup, its cluster
    partition's rows (``_fix_task``)."""
    import ray

    fix = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_fix_task)
    return [
        fix.options(num_returns=2).remote(
            spec_ref,
            i,
            units[i],
            written[i][0],
            written[i][1],
            clusters["rows"][i % clusters["partitions"]] if clusters else None,
            units_ref,
            traces_ref,
            *[refs[i % groups] for refs in reducers],
        )  # fmt: skip
        for i in affected
    ]


def _each_result(refs: list, take: Callable[[Any], None]) -> None:
    """``take`` the result of each task as it finishes; on an error (or an interrupt) the
    tasks still running are cancelled."""
    import ray

    pending = refs
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=5.0)
            for ref in ready:
                take(_get(ref))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def _get(refs):
    """ray.get, with a user-fixable error raised in a task as itself."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        raise _unwrap(err) from None


@contextlib.contextmanager
def _loopback_node():
    """While it lasts, a Ray started in this process takes 127.0.0.1 as its node's address,
    so its GCS, raylet, agents and workers listen on loopback only (on a wildcard address
    otherwise). Ray turns a ``_node_ip_address`` of 127.0.0.1 back into the machine's
    address unless its one-machine switch is off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    which Ray reads once, when imported, into ``ray_constants.ENABLE_RAY_CLUSTER``): that
    value is turned off for the call and put back, so a later connection of this process
    to a cluster finds the machine's address again."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def init_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to / start Ray; True when this call started it (and must shut it down).
    Without an address (``--ray-address``, RAY_ADDRESS) a local Ray of its own starts, with
    ``num_cpus``, listening on 127.0.0.1 only: never the cluster a bare ``ray.init()``
    would join because ``ray start`` left its address in the machine's Ray temp dir."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        from pipeline.output import quiet_ray_auth_notice

        quiet_ray_auth_notice()
        with _loopback_node():
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
                _node_ip_address="127.0.0.1",
            )
    return True
