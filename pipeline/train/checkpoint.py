"""Checkpoints under RUN_DIR/checkpoints/<tag>/ that are never read half-written.

Layout of one checkpoint::

    checkpoints/step00000200/            DeepSpeed engine state (model, optimizer, lr scheduler)
    checkpoints/step00000200/trainer_rank0.pt   loader state + RNG states of rank 0 (one per rank)
    checkpoints/step00000200/config.yaml        resolved experiment config
    checkpoints/step00000200/ds_config.json     the DeepSpeed config it ran with
    checkpoints/step00000200/COMPLETE           written by rank 0 after every rank finished
    checkpoints/latest                          our pointer: the tag of the last COMPLETE one

A checkpoint resumes on another number of ranks (``resume_plan`` / ``to_universal``):
ZeRO-0 state is not partitioned and loads as it is; ZeRO 1-3 partitions are converted
once into ``<tag>/universal/`` (fp32 weights and Adam moments per parameter; ZeRO-3 by
every rank, pipeline/train/universal.py; ZeRO 1-2 by DeepSpeed's ``ds_to_universal`` on
rank 0) and loaded with ``checkpoint.load_universal``.

Loading a checkpoint runs no code from it: our trainer state is read with
``torch.load(weights_only=True)``, and so is every DeepSpeed file (model states, ZeRO
shards, the universal conversion's input and output; ``weights_only_loads``), with only
the few DeepSpeed classes their pickles name allowed (``DEEPSPEED_SAFE_GLOBALS``). A file
that names anything else is refused with one ``CheckpointError``.

DeepSpeed's own ``latest`` is written without waiting for the other ranks, and its
``load_checkpoint`` silently starts from scratch when it finds nothing, so we save with
``save_latest=False``, load with an explicit tag, and fail loudly if that tag won't load.

Asynchronous saves (``train.async_save``): DeepSpeed's engine hands each state dict to
``SnapshotWriter`` (pipeline/train/snapshot_writer.py), which holds its tensors without
copying them and writes them in a background thread, through one bounded host buffer
for tensors not in host memory; the next optimizer update waits until they are written.
``save`` then returns with the checkpoint pending: no ``COMPLETE``, ``latest``
unchanged. It is finished (``finish``: rank 0 writes ``COMPLETE``, moves ``latest``,
prunes) once every rank's writes are done: at the first step boundary where the
trainer's per-step all-reduce says so, or, waiting, before the next save and when
training ends or stops. A process killed meanwhile leaves
``latest`` on the previous checkpoint, as a killed synchronous save does.

Where the files live is ``OutStore``'s (pipeline/train/out_store.py): ``train.out_dir`` a
local folder (the checkpoints are written in place, as above) or a URI (each rank writes
into its node's staging folder, ``root``, and uploads the files it owns in the
background; a save is pending until every rank's uploads are confirmed, and only then
does rank 0 write ``COMPLETE`` and ``latest`` on the store, last). A resume fetches what
this rank loads (``load``: its own files and the ones every rank reads; a universal
conversion: what each rank's share needs) into the staging folder first.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from pipeline.errors import ConfigError
from pipeline.storage import atomic_write
from pipeline.train import universal
from pipeline.train.out_store import OutStore, UploadError, owner
from pipeline.train.snapshot_writer import SnapshotWriter

LATEST = "latest"
COMPLETE = "COMPLETE"
UNIVERSAL = universal.UNIVERSAL  # <tag>/universal: the tag converted (to_universal)


class CheckpointError(RuntimeError):
    """A checkpoint we chose to resume from that cannot be used."""


class CheckpointNameError(CheckpointError, ConfigError):
    """A ``latest`` that names no checkpoint tag of this run (``../x``, a path): refused
    before anything it points at is read. Also a ConfigError, so the commands that print
    only those as one line (``plm train --dry-run``) print it so too."""

    def __init__(self, message: str):
        CheckpointError.__init__(self, message)
        self.machine_wide = False  # what ConfigError's callers read


@contextlib.contextmanager
def uploads_as_checkpoint_errors():
    """An upload the store refused for train.upload_retry_s: the run stops with one line
    (`plm train` prints a CheckpointError as `plm: ...`, exit 2)."""
    try:
        yield
    except UploadError as err:
        raise CheckpointError(str(err)) from None


def link_out_of(folder: Path) -> tuple[Path, Path] | None:
    """(an entry of ``folder``, or of its subfolders, that is a link to elsewhere, where it
    leads), or None: what a checkpoint must not hold before any of it is read."""
    root = Path(folder).resolve()
    for top, dirs, files in os.walk(folder):  # links to folders are not followed
        for name in [*dirs, *files]:
            path = Path(top) / name
            real = path.resolve()
            if real != root and root not in real.parents:
                return path, real
    return None


def check_inside(folder: Path) -> None:
    """CheckpointError naming a link out of checkpoint ``folder`` (DeepSpeed would read it)."""
    found = link_out_of(folder)
    if found is not None:
        raise CheckpointError(
            f"{found[0]} is a link to {found[1]}, outside the checkpoint {folder}; refused, "
            "nothing read: resume only from checkpoints written by `plm train`"
        )


def tag_for(step: int) -> str:
    return f"step{step:08d}"


_TAG = re.compile(r"step\d{8,}")


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


def _deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed 0.19's checkpoint files pickle besides tensors and plain
    data (dicts, lists, OrderedDict, torch.Size): its ZeRO optimizer state's loss scaler
    and stage enum and its parameter-fragment addresses. Data holders: building them runs
    no code of the file's choosing."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpointFile(pickle.UnpicklingError):
    """A checkpoint file whose pickle names something ``weights_only`` loading refuses."""

    def __init__(self, path: Any, reason: str):
        self.path = str(path)
        named = re.search(r"GLOBAL (\S+)", reason)
        what = f"it names {named.group(1)}" if named else " ".join(reason.split())[:200]
        super().__init__(
            f"{self.path} cannot be loaded safely: its pickle would run code or build "
            f"objects a checkpoint does not hold ({what}); refused, nothing from it ran. "
            "Resume only from checkpoints written by `plm train`"
        )


_torch_load = torch.load


@contextlib.contextmanager
def weights_only_loads():
    """Within it, every ``torch.load`` (DeepSpeed's checkpoint engine, its ZeRO and
    universal-checkpoint loaders, ``ds_to_universal``: they pass ``weights_only=False``)
    reads with ``weights_only=True`` and DeepSpeed's few safe classes allowed; a file
    that needs more raises ``UnsafeCheckpointFile`` naming it."""
    allowed = _deepspeed_safe_globals()

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(allowed):
                return _torch_load(f, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointFile(f, str(err)) from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = _torch_load


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


CHECKPOINTS = "checkpoints"


class CheckpointManager:
    def __init__(
        self,
        run_dir: str | Path | OutStore,
        keep_last: int,
        rank: int,
        world_size: int,
        asynchronous: bool = False,
        bundles: str | Path | None = None,
        save_buffer_mb: int = 64,
    ):
        """``run_dir``: train.out_dir (a folder or a URI) or its ``OutStore``;
        ``save_buffer_mb``: the asynchronous writer's host buffer (train.save_buffer_mb)."""
        if isinstance(run_dir, OutStore):
            self.store = run_dir
        else:
            self.store = OutStore.open(str(run_dir), rank=rank)
        self.root = self.store.local / CHECKPOINTS  # where this rank writes and loads
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.asynchronous = asynchronous
        self.save_buffer_bytes = save_buffer_mb << 20
        self.bundles = bundles  # bundles beside the checkpoints: pruned with them
        self.writer: SnapshotWriter | None = None
        self.pending: tuple[str, dict[str, Any]] | None = None  # (tag, COMPLETE's meta)
        # A completion (COMPLETE, latest, pruning) left to the store's upload thread by an
        # agreed finish; the next collective finish waits for it (every rank knows).
        self.deferred = False

    # --- reading -------------------------------------------------------------------------
    def where(self, tag: str = "") -> str:
        """A checkpoint as a message names it: its folder, or its URI on the store."""
        return self.store.where(f"{CHECKPOINTS}/{tag}" if tag else CHECKPOINTS)

    def is_complete(self, tag: str) -> bool:
        return self.store.exists(f"{CHECKPOINTS}/{tag}/{COMPLETE}")

    def latest(self) -> str | None:
        """The tag our pointer names; None when no checkpoint was ever completed."""
        data = self.store.read_bytes(f"{CHECKPOINTS}/{LATEST}")
        if data is None:
            return None
        tag = data.decode("utf-8", "replace").strip()
        if not _TAG.fullmatch(tag):  # a tag is one folder name: never a path elsewhere
            raise CheckpointNameError(
                f"{self.where(LATEST)} names {tag!r}, which is not a checkpoint of this run "
                f"(a folder stepNNNNNNNN of {self.where()}); refused, nothing read there: "
                "write the tag of a complete checkpoint into it, or pass a new "
                "train.out_dir to start a new run"
            )
        if not self.is_complete(tag):
            raise CheckpointError(
                f"{self.where(LATEST)} names {tag!r} but {self.where(tag)}/{COMPLETE} is "
                "missing; the checkpoint directory was altered by hand"
            )
        return tag

    def complete_tags(self) -> list[str]:
        return sorted(
            name
            for name, is_dir in self.store.list_dir(CHECKPOINTS)
            if is_dir and self.is_complete(name)
        )

    def meta(self, tag: str) -> dict[str, Any]:
        """What rank 0 wrote into COMPLETE: step, world size, batch sizes, ZeRO stage."""
        data = self.store.read_bytes(f"{CHECKPOINTS}/{tag}/{COMPLETE}")
        if data is None:
            raise CheckpointError(f"checkpoint {self.where(tag)} is incomplete (no {COMPLETE})")
        return json.loads(data.decode("utf-8"))

    def fetch_for_load(self, tag: str, universal: bool, rank_file: int) -> tuple[list[str], int]:
        """This rank's files of ``tag`` into ``root`` (a local out_dir has them): with
        ``universal`` the whole conversion, else the files of ``rank_file`` and those of no
        rank but the recovery scripts; the trainer state of ``rank_file`` and COMPLETE in
        both. Returns (names, bytes) of the files fetched."""
        rel = f"{CHECKPOINTS}/{tag}"
        want = [f"{rel}/{COMPLETE}", f"{rel}/trainer_rank{rank_file}.pt"]
        if universal:
            want += [p for p, _ in self.store.list_files(f"{rel}/{UNIVERSAL}")]
        else:
            for name, is_dir in self.store.list_dir(rel):
                who = owner(name)
                if not is_dir and (who == rank_file or (who is None and not name.endswith(".py"))):
                    want.append(f"{rel}/{name}")
        got = self.store.fetch(sorted(set(want)))
        return [p.rsplit("/", 1)[-1] for p, _ in got], sum(n for _, n in got)

    def load(self, engine, tag: str, universal: bool = False) -> dict[str, Any]:
        """Restore engine + this rank's trainer state from ``tag``; returns the trainer state.

        ``universal``: load ``tag``'s universal conversion (the engine was built with
        ``checkpoint.load_universal``). A checkpoint of another world size loads only so,
        or directly under ZeRO-0 (nothing partitioned); the trainer state then comes from
        rank 0's file (the loader cursor is global) and recurrent memory starts empty.
        """
        if not self.is_complete(tag):
            raise CheckpointError(f"checkpoint {self.where(tag)} is incomplete (no {COMPLETE})")
        meta = self.meta(tag)
        saved_world = int(meta["world_size"])
        elastic = saved_world != self.world_size
        rank_file = self.rank if not elastic else min(self.rank, saved_world - 1)
        self.fetched = self.fetch_for_load(tag, universal, rank_file)
        check_inside(self.root / tag)
        stage = meta.get("zero_stage")
        if stage is None:  # checkpoints of older versions: ZeRO 1-3 write optimizer shards
            stage = 1 if any((self.root / tag).glob("*optim_states.pt")) else 0
        if elastic and not universal and stage != 0:
            raise CheckpointError(
                f"checkpoint {self.root / tag} was written by {saved_world} ranks, this run "
                f"has {self.world_size}: its ZeRO state is partitioned and must be converted "
                "to a universal checkpoint first (train.resume: auto does it)"
            )
        ds_tag = f"{tag}/{UNIVERSAL}" if universal else tag
        # DeepSpeed's ZeRO-3 universal loader copies the first parameter group's
        # hyperparameters into every group: keep our per-group weight decay.
        decays = [g.get("weight_decay") for g in engine.optimizer.param_groups]
        try:
            with weights_only_loads():
                load_path, _ = engine.load_checkpoint(
                    str(self.root), tag=ds_tag, load_optimizer_states=True,
                    load_lr_scheduler_states=True,
                )  # fmt: skip
        except UnsafeCheckpointFile as err:
            raise CheckpointError(str(err)) from None
        except (AssertionError, OSError, RuntimeError, KeyError, ValueError) as err:
            if "size mismatch" in str(err):
                first = next(x.strip() for x in str(err).splitlines() if "size mismatch" in x)
                raise CheckpointError(
                    f"checkpoint {self.root / tag} holds tensors of other shapes than this "
                    f"model ({first}): the model config or the data's tokenizer changed since "
                    "it was written; resume with the same model and data, or pass a new "
                    "train.out_dir to start a new run"
                ) from None
            raise CheckpointError(
                f"DeepSpeed could not load checkpoint {self.root / ds_tag}: "
                f"{type(err).__name__} {' '.join(str(err).split())[:600]}"
            ) from err
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {self.root / ds_tag}")
        for group, decay in zip(engine.optimizer.param_groups, decays, strict=True):
            if decay is not None:
                group["weight_decay"] = decay
        if universal:
            # ... and gives every sub-group the *same* ``step`` tensor, which torch's Adam
            # increments in place: once per group per update, so later groups would use
            # the bias correction of a later step. One tensor per group, as saved.
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
            for st in getattr(inner, "state", {}).values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()
        path = self.root / tag / f"trainer_rank{rank_file}.pt"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        try:
            state = load_trainer_state(path)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            raise CheckpointError(f"{path} cannot be read safely: {err}") from err
        set_rng_state(state["rng"])
        if elastic:
            state["memory"] = None  # each rank's rows are its own streams: they changed
            state["resumed_world_size"] = saved_world
        return state

    def to_universal(self, tag: str) -> float:
        """Collective: convert ``tag`` into ``<tag>/universal`` (once: a finished conversion
        has its COMPLETE); returns the seconds it took (0 if done before).

        ZeRO-3 (the model may fit no host): every rank of this world takes a share
        (pipeline/train/universal.py). ZeRO 1-2 (the weights are whole on every rank):
        DeepSpeed's ``ds_to_universal`` on rank 0, over the whole checkpoint fetched into
        its node, the others waiting. Either way a conversion killed before its COMPLETE
        is redone, not used."""
        rel = f"{CHECKPOINTS}/{tag}"
        todo = [not self.store.exists(f"{rel}/{UNIVERSAL}/{COMPLETE}")]
        dist.broadcast_object_list(todo, src=0)  # rank 0's answer is everyone's
        if not todo[0]:
            return 0.0
        t0 = time.perf_counter()
        meta = self.meta(tag)
        stage = meta.get("zero_stage")
        try:
            with weights_only_loads():
                if stage == 3:
                    universal.convert_zero3(
                        self.store, rel, self.rank, self.world_size, int(meta["world_size"])
                    )
                else:  # rank 0 converts; every rank learns whether it failed
                    universal.together(
                        "conversion", self._ds_to_universal, tag, int(meta["world_size"])
                    )
        except UnsafeCheckpointFile as err:
            raise CheckpointError(str(err)) from None
        except Exception as err:
            raise CheckpointError(
                f"converting {self.where(tag)} to a universal checkpoint failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        if self.rank == 0:  # on a store: after the conversion's files, last
            self.store.write_bytes(f"{rel}/{UNIVERSAL}/{COMPLETE}", json.dumps(meta).encode())
        dist.barrier()
        return time.perf_counter() - t0

    def _ds_to_universal(self, tag: str, saved_world: int) -> None:
        """DeepSpeed's whole conversion on rank 0 (ZeRO 1-2) of ``tag``, saved by
        ``saved_world`` ranks, uploaded when done."""
        if self.rank != 0:
            return
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        rel = f"{CHECKPOINTS}/{tag}"
        out = self.root / tag / UNIVERSAL
        # The whole checkpoint (every rank's partitions) into this node's folder: only the
        # ranks COMPLETE counts. A lost host's upload of an older save of this step may
        # land after a new round rewrote it (a link that comes back), and DeepSpeed
        # converts every rank file it finds in the folder.
        ours = lambda name: (owner(name) or 0) < saved_world  # noqa: E731
        self.store.fetch(p for p, _ in self.store.list_files(rel)
                         if f"/{UNIVERSAL}/" not in p and ours(p.rsplit("/", 1)[-1]))  # fmt: skip
        for stray in (self.root / tag).iterdir():
            if stray.is_file() and not ours(stray.name):
                stray.unlink()
        universal.check_checkpoint_names(self.root / tag)  # DeepSpeed makes folders of them
        tmp = self.root / tag / f".{UNIVERSAL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.store.clear(f"{rel}/{UNIVERSAL}")
        args = argparse.Namespace(
            input_folder=str(self.root / tag), output_folder=str(tmp),
            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
            strict=True, inject_missing_state=True,
        )  # fmt: skip
        log = io.StringIO()  # its progress bars and prints: kept for errors only
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                ds_to_universal(args)
        except UnsafeCheckpointFile:
            raise
        except Exception as err:
            raise RuntimeError(f"{err}\n{log.getvalue()[-2000:]}") from err
        os.replace(tmp, out)
        self.store.upload_tree(f"{rel}/{UNIVERSAL}")
        self.store.wait()

    # --- writing -------------------------------------------------------------------------
    def save(
        self,
        engine,
        step: int,
        trainer_state: dict[str, Any],
        config: dict[str, Any],
        ds_config: dict[str, Any],
        batch_meta: dict[str, Any] | None = None,
    ) -> str:
        """Collective: every rank calls it. ``latest`` moves only after all ranks wrote;
        asynchronous: the checkpoint is left pending (see the module doc, ``finish``)."""
        self.finish()  # one save in flight at most
        tag = tag_for(step)
        folder = self.root / tag
        self.store.clear(f"{CHECKPOINTS}/{tag}")  # a leftover of an interrupted save
        dist.barrier()
        if self.asynchronous:
            self.install_writer(engine)
        engine.save_checkpoint(
            str(self.root), tag=tag, client_state={"step": step}, save_latest=False
        )
        folder.mkdir(parents=True, exist_ok=True)
        state = plain({**trainer_state, "rng": rng_state(), "step": step})
        atomic_write(folder / f"trainer_rank{self.rank}.pt", _torch_bytes(state))
        if self.rank == 0:
            text = yaml.safe_dump(config, sort_keys=False)
            atomic_write(folder / "config.yaml", text.encode("utf-8"))
            atomic_write(folder / "ds_config.json", json.dumps(ds_config, indent=2).encode())
        meta = {"step": step, "world_size": self.world_size, **(batch_meta or {})}
        # On a store: this rank's files go up once written (nothing for a local out_dir).
        self.store.upload_own(
            f"{CHECKPOINTS}/{tag}", self.rank, self.writer.wait if self.writer else None
        )
        if self.writer is not None or self.store.busy():  # files still being written
            self.pending = (tag, meta)
            return tag
        dist.barrier()  # every rank's files are on disk
        if self.rank == 0:
            self._complete(tag, meta)
        dist.barrier()
        return tag

    def install_writer(self, engine) -> SnapshotWriter:
        """The asynchronous writer in place of the engine's checkpoint engine (once)."""
        if self.writer is None:
            self.writer = SnapshotWriter.install(
                engine, self.save_buffer_bytes, _deepspeed_safe_globals()
            )
        return self.writer

    def writes_busy(self) -> bool:
        """This rank still writes (or uploads) the pending checkpoint's files (a write
        that failed, an upload that gave up, raises here)."""
        if self.pending is None:
            return False
        with uploads_as_checkpoint_errors():
            return (self.writer is not None and self.writer.busy()) or self.store.busy()

    def finish(self, agreed: bool = False) -> str | None:
        """Complete the pending checkpoint; returns its tag (None: nothing pending).
        ``agreed``: every rank's writes are known to be done (the trainer's all-reduce),
        so no rank waits; otherwise a collective: each rank waits for its writes."""
        if self.pending is None:
            if self.deferred and not agreed:  # what reads the store next sees it complete
                with uploads_as_checkpoint_errors():
                    self.store.wait()
                dist.barrier()
                self.deferred = False
            return None
        tag, meta = self.pending
        if self.writer is not None:
            self.writer.wait()  # raises if a write failed: the checkpoint stays incomplete
        with uploads_as_checkpoint_errors():
            self.store.wait()  # every upload of this rank confirmed (raises if one gave up)
        if not agreed:
            dist.barrier()
        # At a step boundary (agreed) on a store, rank 0's requests to it (COMPLETE,
        # latest, the listings and deletes of pruning) go to its upload thread, and so
        # does unlinking the staged copy of the checkpoint before: a step does not wait
        # for them (bench/bench_out_store.py).
        self.deferred = agreed and self.store.defers
        if self.rank == 0:
            if self.deferred:
                self.store.later(lambda: self._complete(tag, meta))
            else:
                self._complete(tag, meta)
        if not agreed:
            dist.barrier()
        self.pending = None
        # A node keeps the last one staged; the others' files are unlinked off the step too.
        drop = lambda: self.store.drop_staging(CHECKPOINTS, keep={tag})  # noqa: E731
        if self.deferred:
            self.store.later(drop)
        else:
            drop()
        return tag

    def _complete(self, tag: str, meta: dict[str, Any]) -> None:
        """Rank 0, every rank's files written: COMPLETE, then ``latest``, then pruning."""
        self.store.write_bytes(f"{CHECKPOINTS}/{tag}/{COMPLETE}", json.dumps(meta).encode("utf-8"))
        self.store.write_bytes(f"{CHECKPOINTS}/{LATEST}", tag.encode("utf-8"))
        self._prune(keep=tag)
        if self.bundles is not None:
            self.prune_bundles(self.bundles)

    def prune_bundles(self, bundles: str | Path) -> list[str]:
        """Rank 0: delete the bundles under ``bundles`` whose checkpoint was pruned, unless
        their meta says ``kept`` (``train.keep_bundle_every``); ``final``, bundles beside a
        kept checkpoint and folders that are not our bundles stay. Returns what it deleted."""
        rel = self.store.relative(bundles)
        entries = self.store.list_dir(rel)
        if not entries:
            return []
        keep = set(self.complete_tags())
        gone = []
        for name, is_dir in entries:
            if not (is_dir and _TAG.fullmatch(name)) or name in keep:
                continue
            try:  # bundles are renamed into place whole: an unreadable one is not ours
                meta = yaml.safe_load(self.store.read_bytes(f"{rel}/{name}/config.yaml"))["meta"]
            except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
                continue
            if not (isinstance(meta, dict) and meta.get("kept")):
                self.store.delete_tree(f"{rel}/{name}")
                gone.append(name)
        return gone

    def _prune(self, keep: str) -> None:
        """Keep the last K complete checkpoints; drop incomplete leftovers older than ``keep``."""
        complete = self.complete_tags()
        for tag in complete[: max(0, len(complete) - self.keep_last)]:
            if tag != keep:
                self.store.delete_tree(f"{CHECKPOINTS}/{tag}")
        for name, is_dir in self.store.list_dir(CHECKPOINTS):
            if is_dir and name < keep and name not in complete:
                self.store.delete_tree(f"{CHECKPOINTS}/{name}")
