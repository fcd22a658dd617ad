"""The cells run: one Ray task per (model, task, seed), or all in this process.

Ray runs each cell with the CPUs and GPUs the suite's ``workers`` section asks for, on any
node (one that does not see the driver's files gets them through Ray: eval/ship.py); a
cell whose worker or node died is retried elsewhere (``workers.max_retries``). A
cell that raises is a failed cell of the table, with its error, and the others go on: it
is not retried, since the same inputs raise again. Without an address (``--address``,
RAY_ADDRESS) a local Ray of its own starts, as the data job's does.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.eval.cells import CellSpec, run_cell
from pipeline.eval.ship import Shipped, localize, ship
from pipeline.eval.suite import WorkersSection


@dataclass
class CellResult:
    cell: CellSpec
    scores: dict[str, float] | None  # None: failed
    error: str | None = None
    seconds: float = 0.0
    host: str = ""  # the host that scored it (its hostname)


def _timed(spec: CellSpec) -> tuple[dict[str, float], float, str]:
    t0 = time.perf_counter()
    scores = run_cell(spec)
    return scores, time.perf_counter() - t0, socket.gethostname()


# What a launcher sets for a rank; a Ray worker inherits the driver's (a driver that trained
# in-process has them), but each cell is a single process with a process group of its own.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK")  # fmt: skip


def own_process_group() -> None:
    """Before a process's first cell: forget launcher variables it inherited (a Ray worker
    has the driver's; a `plm eval` started from a process that trained has that one's),
    so the cell's process group is its own on a free port. A group already made here
    (an earlier cell's) is reused."""
    import os

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        for name in LAUNCHER_VARIABLES:
            os.environ.pop(name, None)


def _timed_on_ray(
    spec: CellSpec, shipped: dict[str, Shipped]
) -> tuple[dict[str, float], float, str]:
    own_process_group()
    return _timed(localize(spec, shipped))


def run_in_process(
    cells: list[CellSpec], report: Callable[[CellResult], None] | None = None
) -> list[CellResult]:
    own_process_group()
    out = []
    for spec in cells:
        try:
            scores, seconds, host = _timed(spec)
            result = CellResult(spec, scores, seconds=seconds, host=host)
        except Exception as err:  # a failed cell; the suite goes on
            result = CellResult(spec, None, f"{type(err).__name__}: {err}")
        out.append(result)
        if report:
            report(result)
    return out


def _error_text(err: BaseException) -> str:
    import ray

    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if err.cause is not None else err
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def run_on_ray(
    cells: list[CellSpec],
    workers: WorkersSection,
    address: str | None,
    report: Callable[[CellResult], None] | None = None,
) -> list[CellResult]:
    import ray

    from pipeline.prepare.job import init_ray

    started = init_ray(address, None)
    try:
        task = ray.remote(
            num_cpus=workers.cpus,
            num_gpus=workers.gpus,
            max_retries=workers.max_retries,  # a dead worker or node: run it elsewhere
            retry_exceptions=False,
        )(_timed_on_ray)
        # One node (a local Ray): every cell sees the driver's files.
        shipped = ship(cells) if len([n for n in ray.nodes() if n["Alive"]]) > 1 else {}
        refs = {task.remote(spec, shipped): i for i, spec in enumerate(cells)}
        results: list[CellResult | None] = [None] * len(cells)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            i = refs[done[0]]
            try:
                scores, seconds, host = ray.get(done[0])
                results[i] = CellResult(cells[i], scores, seconds=seconds, host=host)
            except Exception as err:  # the cell failed (after its retries, if a node died)
                results[i] = CellResult(cells[i], None, _error_text(err))
            if report:
                report(results[i])
        return [r for r in results if r is not None]
    finally:
        if started:
            ray.shutdown()
