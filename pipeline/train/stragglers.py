"""Stragglers: a rank whose steps are consistently slower than the others', named.

Every step has one synchronising all-reduce before its last backward pass (the trainer's
stop / non-finite flags): a rank that reaches it early waits there for the last one. Over
a window of ``train.straggler_every`` steps each rank adds up the time of its steps and
of that wait. At the window's end one all-gather brings every rank's two sums to rank 0:
the rank that waits least, while the others wait a fifth of their steps or more than it
does (it is ``SLOWDOWN`` times slower), is named once for the window: one `plm:` line on
stderr, MLflow metrics. Shares, not its own work, decide: a slowed rank is slowed inside
the all-reduce too, which makes its own wait read longer than it is.

On a CPU the collective returns when it is done, so a clock around it measures the wait,
and DeepSpeed's comm logger times its own collectives the same way (ZeRO-2's reductions
after each micro-batch's backward, ZeRO-3's all-gathers), where a rank also waits. On a
GPU a collective only queues the kernel: the all-reduce's wait is read from CUDA events
around it, and DeepSpeed's collectives are not timed (its logger would synchronise the
device after each), so under gradient accumulation or ZeRO-3 a straggler reads smaller.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist

SLOWDOWN = 1.25  # the others wait a fifth of every step or more for it


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    address: str
    slowdown: float  # its busy share of the steps over the others' (median)
    waited: float  # the others' share of their steps spent waiting at the sync (median)
    first_step: int
    last_step: int

    def line(self) -> str:
        return (
            f"plm: rank {self.rank} on {self.host} ({self.address}) is a straggler: "
            f"over steps {self.first_step}-{self.last_step} the others waited "
            f"{self.waited:.0%} of each step for it, {self.slowdown:.2f}x slower than them "
            "(a busy or slower host, a slow disk under its data)"
        )


def find_straggler(wait_s: list[float], step_s: list[float]) -> tuple[int, float, float] | None:
    """From each rank's wait at the sync and its step time over a window: (rank,
    slowdown, the others' share of waiting) of the rank that waits least, if the others
    wait for it a share ``1 - 1/SLOWDOWN`` of their steps more than it does; None
    otherwise. Its slowdown is its busy share over theirs: the ranks keep step together,
    so the others could go that much faster without it."""
    if len(wait_s) < 2 or min(step_s) <= 0:
        return None
    share = [w / s for w, s in zip(wait_s, step_s, strict=True)]
    slow = min(range(len(share)), key=lambda r: share[r])
    others = median(x for r, x in enumerate(share) if r != slow)
    if others - share[slow] < 1 - 1 / SLOWDOWN:
        return None
    return slow, (1 - share[slow]) / (1 - others), others


def _comm_timers():
    """On a CPU, DeepSpeed's own comm logger timing every collective it makes (ZeRO's
    reductions in the backward pass, its all-gathers): where else a rank waits. Off on a
    GPU, where it would synchronise the device after every collective. The timers, or
    False."""
    if torch.cuda.is_available():
        return False
    import deepspeed.comm as ds_comm
    from deepspeed.comm import comm as ds_comm_impl

    ds_comm.configure(enabled=True, prof_all=True, verbose=False)
    return ds_comm_impl


def _read_comm_s(comm) -> float:
    """Seconds in DeepSpeed's collectives since the last read, the timers reset (the
    logger's own records, cumulative per name, are dropped: they only grow)."""
    total_ms = sum(t.elapsed(reset=True) for t in comm.timers.timers.values())
    comm.comms_logger.comms_dict.clear()
    return total_ms / 1000


class StragglerWatch:
    """One rank's sums over the window; ``check(step)`` at every step's end (a collective
    every ``every`` steps, on every rank at the same step)."""

    def __init__(self, every: int, rank: int, world: int, address: str = ""):
        self.every, self.rank, self.world = every, rank, world
        self.address = address or socket.gethostname()
        self.step_s = self.wait_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._began = 0.0
        self._first_step = 0
        self._names: list[tuple[str, str]] | None = None
        self._comm = None  # DeepSpeed's comm timers (on a CPU), once the engine is up
        self._warm = True  # the round's first step is not counted
        self._steps = 0
        self._step_wait = 0.0  # this step's wait at the trainer's all-reduce (on a CPU)

    @property
    def on(self) -> bool:
        return self.every > 0 and self.world > 1

    def begin_step(self, step: int) -> None:
        if not self._first_step and not self._warm:
            self._first_step = step
        if self.on and self._comm is None:
            self._comm = _comm_timers()
        self._began = time.perf_counter()

    def end_step(self) -> None:
        waited = self._step_wait + (_read_comm_s(self._comm) if self._comm else 0.0)
        self._step_wait = 0.0
        if self._warm:  # a round's first step: imports, warm-up, uneven by nature
            self._warm, self._first_step = False, 0
            self._events.clear()
            return
        self.step_s += time.perf_counter() - self._began
        self.wait_s += waited
        self._steps += 1

    @contextmanager
    def sync(self, tensor: torch.Tensor):
        """Around the step's synchronising all-reduce of ``tensor``."""
        if tensor.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self._step_wait += time.perf_counter() - t0

    def check(self, step: int) -> Straggler | None:
        """At the window's end: every rank's sums to rank 0, which names the straggler."""
        if not self.on or step % self.every:
            return None
        if self._events:
            torch.cuda.synchronize()
            self.wait_s += sum(a.elapsed_time(b) for a, b in self._events) / 1000
            self._events.clear()
        if self._names is None:  # once: who each rank is
            self._names = [None] * self.world  # type: ignore[list-item]
            dist.all_gather_object(self._names, (socket.gethostname(), self.address))
        mine = torch.tensor([self.wait_s, self.step_s], dtype=torch.float64)
        first, steps, self._first_step, self._steps = self._first_step, self._steps, 0, 0
        self.step_s = self.wait_s = 0.0
        if steps < max(2, self.every // 2):  # a round that began mid-window: too few
            return None  # (every rank the same: they resumed at the same step)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine)
        if self.rank != 0:
            return None
        found = find_straggler([float(r[0]) for r in rows], [float(r[1]) for r in rows])
        if found is None:
            return None
        slow, slowdown, waited = found
        host, address = self._names[slow]
        return Straggler(slow, host, address, slowdown, waited, first, step)
