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
import pickle
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
    """The RNG states in types ``torch.load(weights_only=True)`` reads: tensors, ints,
    floats, strings, tuples, lists and dicts (numpy's state tuple holds an ndarray)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # uint32 values
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    npst = state["numpy"]
    if isinstance(npst, dict):
        keys = npst["keys"].numpy().astype(np.uint32)
        npst = (npst["kind"], keys, npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    np.random.set_state(npst)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# What trainer_rank*.pt files written before the weights-only format hold besides tensors:
# numpy's RNG state array. Allowed for those files only, never arbitrary classes.
_LEGACY_NUMPY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
try:
    _LEGACY_NUMPY_GLOBALS.append(np._core.multiarray._reconstruct)
except AttributeError:  # numpy < 2
    _LEGACY_NUMPY_GLOBALS.append(np.core.multiarray._reconstruct)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """A rank's trainer state, read with ``weights_only=True``: loading a checkpoint never
    runs code from it. Files of older versions (numpy RNG arrays) load the same way with
    numpy's array reconstruction allowed."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        with torch.serialization.safe_globals(_LEGACY_NUMPY_GLOBALS):
            return torch.load(path, weights_only=True)


def plain(obj: Any) -> Any:
    """numpy scalars and arrays (a loader counter, say) as ints/floats/tensors, so the
    saved state holds only what ``weights_only=True`` loads."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


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
        try:
            state = load_trainer_state(path)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointError(f"{path} cannot be read safely: {err}") from err
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
        state = plain({**trainer_state, "rng": rng_state(), "step": step})
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
