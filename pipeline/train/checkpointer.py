"""When a run checkpoints: every train.save_every steps and at its end (or a stop, or a
divergence), which of those checkpoints get a bundle (train.bundle_every,
train.keep_bundle_every), and when an asynchronous save is completed. The training loop
tells it each step that is done (``Checkpointer.step_done``) and it says what it did.

How a checkpoint is written, completed (COMPLETE, ``latest``) and pruned to
train.keep_last is ``CheckpointManager``'s (checkpoint.py); what goes into it and into a
bundle is the trainer's (the ``state`` and ``bundle`` it is given).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.train.checkpoint import CheckpointManager, tag_for


@dataclass(frozen=True)
class Saved:
    """What ``Checkpointer.step_done`` did after one step."""

    completed: str | None = None  # an asynchronous save completed (COMPLETE, latest, pruning)
    tag: str | None = None  # the checkpoint saved at this step
    bundle: Path | None = None  # its bundle, on rank 0
    kept: bool = False  # the bundle stays when its checkpoint is pruned


class Checkpointer:
    def __init__(
        self,
        manager: CheckpointManager,
        train,
        engine,
        state: Callable[[int], dict[str, Any]],
        bundle: Callable[[str, bool], Path | None],
        files: tuple[dict[str, Any], dict[str, Any], dict[str, Any]],
        log: Callable[[str], None],
        long_phase: Callable[[], None] = lambda: None,
    ):
        """``train``: the run's train section; ``state(n)``: the trainer's state for its
        n-th checkpoint; ``bundle(tag, kept)``: write the bundle of checkpoint ``tag``
        (collective); ``files``: (the experiment config, the DeepSpeed config, the batch
        meta) every checkpoint records; ``long_phase``: said before a save (the heartbeat
        waits longer)."""
        self.manager, self.train, self.engine = manager, train, engine
        self.state, self.bundle, self.log, self.long_phase = state, bundle, log, long_phase
        self.config, self.ds_config, self.batch_meta = files
        self.count = 0  # checkpoints of this run, those before a resume included
        self.save_call_s = 0.0  # this process's time in the save calls
        self.writing: Path | None = None  # the checkpoint being written (a full disk's path)

    def step_done(self, step: int, writes_done: bool = False) -> Saved:
        """After trained step ``step`` (a skipped one saves nothing): the pending save
        completed when every rank has written its part (``writes_done``: the step's
        all-reduce said so), then the checkpoint due at this step and its bundle. The
        run's last step is ``save_complete``'s."""
        completed = self.manager.finish(agreed=True) if writes_done else None
        t = self.train
        if not (t.save_every and step % t.save_every == 0 and step < t.max_steps):
            return Saved(completed=completed)
        self.long_phase()
        tag = self.save(step)
        kept, bundled = self.bundle_due(self.count)
        path = self.bundle(tag, kept) if bundled else None
        return Saved(completed, tag, path, kept)

    def bundle_due(self, n: int) -> tuple[bool, bool]:
        """(kept, bundled) for the run's ``n``-th checkpoint: a kept bundle stays when
        its checkpoint is pruned (train.keep_bundle_every); bundled: it gets one at all."""
        t = self.train
        kept = bool(t.keep_bundle_every) and n % t.keep_bundle_every == 0
        return kept, kept or bool(t.bundle_every and n % t.bundle_every == 0)

    def save(self, step: int) -> str:
        """Collective: checkpoint ``step`` now (asynchronous: left pending)."""
        state = self.state(self.count + 1)
        t0 = time.perf_counter()
        self.writing = self.manager.root / tag_for(step)
        tag = self.manager.save(self.engine, step, state, self.config, self.ds_config,
                                self.batch_meta)  # fmt: skip
        self.writing = None
        took = time.perf_counter() - t0
        self.save_call_s += took
        self.count += 1
        writing = ", its files written in the background" if self.manager.pending else ""
        self.log(f"checkpoint {self.manager.where(tag)} (the save took {took:.2f} s{writing})")
        return tag

    def save_complete(self, step: int) -> str:
        """Collective: a complete checkpoint of ``step`` (what the end of a run, a stop
        and a divergence leave), a pending save's writes waited for first."""
        self.manager.finish()
        tag = self.manager.latest()
        if tag != tag_for(step):
            tag = self.save(step)
            self.manager.finish()
        return tag

    def cost_line(self) -> str:
        """What this run's saves held training up: the save calls, and the optimizer
        updates that waited for an asynchronous save's writes."""
        writes = self.manager.writer.blocked_s if self.manager.writer else 0.0
        return (
            f"checkpoints held training {self.save_call_s + writes:.2f} s in all (save calls "
            f"{self.save_call_s:.2f} s, updates waiting for writes {writes:.2f} s)"
        )
