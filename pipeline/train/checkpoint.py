"""Checkpoints under RUN_DIR/checkpoints/<tag>/ that are never read half-written.

Layout of one checkpoint::

    checkpoints/step00000200/            DeepSpeed engine state (model, optimizer, lr scheduler)
    checkpoints/step00000200/trainer_rank0.pt   loader state + RNG states of rank 0 (one per rank)
    checkpoints/step00000200/config.yaml        resolved experiment config
    checkpoints/step00000200/ds_config.json     the DeepSpeed config it ran with
    checkpoints/step00000200/COMPLETE           written by rank 0 after every rank finished
    checkpoints/latest                          our pointer: the tag of the last COMPLETE one

DeepSpeed's own ``latest`` is written without waiting for the other ranks, and its
``load_checkpoint`` silently starts from scratch when it finds nothing, so we save with
``save_latest=False``, load with an explicit tag, and fail loudly if that tag won't load.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from pipeline.data.shards import atomic_write_bytes

LATEST = "latest"
COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint we chose to resume from that cannot be used."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last: int, rank: int, world_size: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size

    # --- reading -------------------------------------------------------------------------
    def is_complete(self, tag: str) -> bool:
        return (self.root / tag / COMPLETE).is_file()

    def latest(self) -> str | None:
        """The tag our pointer names; None when no checkpoint was ever completed."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        tag = pointer.read_text(encoding="utf-8").strip()
        if not self.is_complete(tag):
            raise CheckpointError(
                f"{pointer} names {tag!r} but {self.root / tag / COMPLETE} is missing; "
                "the checkpoint directory was altered by hand"
            )
        return tag

    def complete_tags(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and self.is_complete(p.name)
        )

    def load(self, engine, tag: str) -> dict[str, Any]:
        """Restore engine + this rank's trainer state from ``tag``; returns the trainer state."""
        if not self.is_complete(tag):
            raise CheckpointError(f"checkpoint {self.root / tag} is incomplete (no {COMPLETE})")
        meta = json.loads((self.root / tag / COMPLETE).read_text(encoding="utf-8"))
        if meta["world_size"] != self.world_size:
            raise CheckpointError(
                f"checkpoint {self.root / tag} was written by {meta['world_size']} ranks, this run "
                f"has {self.world_size}; exact resume needs the same world size"
            )
        try:
            load_path, _ = engine.load_checkpoint(
                str(self.root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        except (AssertionError, OSError, RuntimeError, KeyError) as err:
            raise CheckpointError(
                f"DeepSpeed could not load checkpoint {self.root / tag}: {type(err).__name__} {err}"
            ) from err
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {self.root / tag}")
        path = self.root / tag / f"trainer_rank{self.rank}.pt"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        state = torch.load(path, weights_only=False)
        set_rng_state(state["rng"])
        return state

    # --- writing -------------------------------------------------------------------------
    def save(
        self,
        engine,
        step: int,
        trainer_state: dict[str, Any],
        config: dict[str, Any],
        ds_config: dict[str, Any],
    ) -> str:
        """Collective: every rank calls it. ``latest`` moves only after all ranks wrote."""
        tag = tag_for(step)
        folder = self.root / tag
        if self.rank == 0 and folder.exists():
            shutil.rmtree(folder)  # a leftover from an interrupted save of the same step
        dist.barrier()
        engine.save_checkpoint(
            str(self.root), tag=tag, client_state={"step": step}, save_latest=False
        )
        folder.mkdir(parents=True, exist_ok=True)
        state = {**trainer_state, "rng": rng_state(), "step": step}
        atomic_write_bytes(folder / f"trainer_rank{self.rank}.pt", _torch_bytes(state))
        if self.rank == 0:
            text = yaml.safe_dump(config, sort_keys=False)
            atomic_write_bytes(folder / "config.yaml", text.encode("utf-8"))
            atomic_write_bytes(folder / "ds_config.json", json.dumps(ds_config, indent=2).encode())
        dist.barrier()  # every rank's files are on disk
        if self.rank == 0:
            meta = {"step": step, "world_size": self.world_size}
            atomic_write_bytes(folder / COMPLETE, json.dumps(meta).encode("utf-8"))
            atomic_write_bytes(self.root / LATEST, tag.encode("utf-8"))
            self._prune(keep=tag)
        dist.barrier()
        return tag

    def _prune(self, keep: str) -> None:
        """Keep the last K complete checkpoints; drop incomplete leftovers older than ``keep``."""
        complete = self.complete_tags()
        for tag in complete[: max(0, len(complete) - self.keep_last)]:
            if tag != keep:
                shutil.rmtree(self.root / tag, ignore_errors=True)
        for p in self.root.iterdir():
            if p.is_dir() and not self.is_complete(p.name) and p.name < keep:
                shutil.rmtree(p, ignore_errors=True)
