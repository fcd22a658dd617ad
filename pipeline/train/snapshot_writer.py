"""The asynchronous save's writer (``train.async_save``): DeepSpeed's checkpoint engine
replaced by one that writes each state dict in a background thread, in host memory
bounded by one reused buffer, never by the rank's state.

Nothing is copied when DeepSpeed calls ``save``: the state dict's containers are rebuilt,
small objects deep-copied (a loss scaler changes as training goes on), and every tensor
is *held* as it is. The engine's next optimizer update (``_take_model_step``, the only
code that writes those tensors) first waits until the queued writes are done, so the
forward and backward passes of the next step overlap the write.

Each file is then written in two passes, in torch's own format:

1. **The skeleton.** ``torch.save`` under ``torch.serialization.skip_data()`` writes the
   pickle and reserves each tensor record's place without writing its bytes (a sparse
   file: nothing is copied or written). A tensor whole in host memory stands for itself;
   any other (on a device, or a view into a larger buffer such as ZeRO's flat groups)
   by an untouched host placeholder of its shape, so its record holds only its own
   elements, compact, as DeepSpeed's ``clone_tensors_for_torch_save`` would make them.
2. **The fill.** The skeleton is read back with ``map_location="meta"`` (no data), which
   gives each record's offset in the file, and each tensor's bytes are written there. A
   tensor contiguous in host memory is written from its own memory; any other is copied
   chunk by chunk through one host buffer of ``buffer_bytes`` (pinned where CUDA is),
   reused for every chunk of every file. Then the file is fsynced.

The records carry no CRC-32, as with ``torch.save`` under
``torch.serialization.set_crc32_options(False)``: ``torch.load`` reads them (and so does
DeepSpeed), a zip tool's integrity check would not. A state that hides a tensor inside an
object the walk does not open cannot be paired with its records; such a file is written
by a plain ``torch.save`` of compact host copies instead (correct, not bounded).
"""

from __future__ import annotations

import copy
import os
import queue
import re
import threading
import time
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from pipeline.output import rank_line

_RECORD = re.compile(r"/data/\d+$")  # a tensor's bytes in torch's zip layout


def whole_host_storage(t: torch.Tensor) -> bool:
    """``t`` is in host memory and is its whole storage: saving it writes only its bytes."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A host tensor of ``t``'s shape and dtype whose memory is never touched (a fresh
    storage, not ``torch.empty``, which deterministic mode fills)."""
    storage = torch.UntypedStorage(t.numel() * t.element_size())
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, t.shape)


def rebuilt(obj: Any, on_tensor, on_other) -> Any:
    """``obj`` with its dicts, lists and tuples rebuilt (their types kept where they can
    be), each tensor replaced by ``on_tensor(t)`` and any other object by ``on_other(o)``."""

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return on_tensor(o)
        if isinstance(o, dict):
            items = {k: walk(v) for k, v in o.items()}
            if type(o) is dict:
                return items
            try:
                return type(o)(items)
            except TypeError:
                return items
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            items = [walk(v) for v in o]
            return type(o)(*items) if hasattr(o, "_fields") else tuple(items)
        return on_other(o)

    return walk(obj)


def _copied(o: Any) -> Any:
    """A deep copy of a plain object where it can be made (a loss scaler changes as
    training goes on); one that cannot be copied (a config holding a lock) as it is."""
    if o is None or isinstance(o, (bool, int, float, str, bytes)):
        return o
    try:
        return copy.deepcopy(o)
    except Exception:
        return o


def hold(obj: Any) -> tuple[Any, dict[int, torch.Tensor]]:
    """(skeleton, sources): ``obj`` with its containers rebuilt and other objects
    deep-copied where they can be; a tensor whole in host memory stays as it is, any other
    is replaced by a placeholder, with ``sources[id(placeholder)]`` the tensor to copy
    from. No tensor's memory is copied."""
    sources: dict[int, torch.Tensor] = {}

    def held(o: torch.Tensor) -> torch.Tensor:
        t = o.detach()
        if whole_host_storage(t):
            return t
        stand_in = _placeholder(t)
        sources[id(stand_in)] = t
        return stand_in

    return rebuilt(obj, held, _copied), sources


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of dicts, lists and tuples, depth first, in their order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def record_offsets(path: str, skeleton: Any, safe_globals: list[Any]):
    """[(file offset, tensor)] for every tensor record of the skeleton file at ``path``, or
    None when the skeleton's tensors cannot be paired one to one with its records."""
    try:
        with torch.serialization.safe_globals(safe_globals):
            layout = torch.load(path, map_location="meta", weights_only=True)
    except Exception:  # noqa: BLE001  (an object weights_only refuses: the plain save)
        return None
    with zipfile.ZipFile(path) as archive:
        records = sum(1 for name in archive.namelist() if _RECORD.search(name))
    ours, theirs = list(tensors_in(skeleton)), list(tensors_in(layout))
    if len(ours) != len(theirs):
        return None
    at: dict[int, torch.Tensor] = {}
    for mine, read in zip(ours, theirs, strict=True):
        storage = read.untyped_storage()
        nbytes = mine.numel() * mine.element_size()
        if mine.shape != read.shape or mine.dtype != read.dtype or storage.nbytes() != nbytes:
            return None
        at[storage._checkpoint_offset] = mine  # tensors sharing a storage: one record
    return sorted(at.items(), key=lambda item: item[0]) if len(at) == records else None


class HostBuffer:
    """One host buffer, reused for every chunk a tensor not contiguous in host memory is
    copied through (pinned when CUDA is there, so a device copy is one DMA)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.nbytes:  # one row larger than the buffer: a buffer of its own
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._buffer is None:
            pin = torch.cuda.is_available()
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._buffer[:nbytes]


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor contiguous in host memory, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def fill(fd: int, offset: int, src: torch.Tensor, buffer: HostBuffer) -> None:
    """Write ``src``'s elements, compact and in order, at ``offset``."""
    if src.numel() == 0:
        return
    if src.device.type == "cpu" and src.is_contiguous():
        _write_all(fd, _host_bytes(src), offset)
        return
    rows = src.reshape(-1) if src.is_contiguous() else src  # (a 0-d tensor is contiguous)
    row_bytes = rows[0].numel() * rows.element_size()
    per_chunk = max(1, buffer.nbytes // row_bytes)
    for first in range(0, rows.shape[0], per_chunk):
        part = rows[first : first + per_chunk]
        nbytes = part.numel() * part.element_size()
        staged = buffer.take(nbytes).view(part.dtype).view(part.shape)
        staged.copy_(part, non_blocking=part.device.type == "cuda")
        if part.device.type == "cuda":
            torch.cuda.current_stream(part.device).synchronize()
        _write_all(fd, _host_bytes(staged), offset)
        offset += nbytes


def materialized(skeleton: Any, sources: dict[int, torch.Tensor]) -> Any:
    """The skeleton with each placeholder replaced by a compact host copy of its source."""

    def copied(t: torch.Tensor) -> torch.Tensor:
        src = sources.get(id(t))
        return t if src is None else src.to("cpu", copy=True).contiguous()

    return rebuilt(skeleton, copied, lambda o: o)


class SnapshotWriter:
    """DeepSpeed's checkpoint engine for asynchronous saves: ``save`` holds the state dict
    (``hold``) and queues it; a background thread writes the queue in order (skeleton,
    then fill, module doc) and fsyncs each file. ``blocked_s`` adds up the time optimizer
    updates waited for the writes; ``fallbacks`` counts files written the plain way."""

    def __init__(self, base, buffer_bytes: int, safe_globals: list[Any]):
        self.base = base  # DeepSpeed's TorchCheckpointEngine: loading, dirs, commit
        self.buffer = HostBuffer(buffer_bytes)
        self.safe_globals = safe_globals
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.blocked_s = 0.0
        self.fallbacks = 0
        self.thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    @classmethod
    def install(cls, engine, buffer_bytes: int, safe_globals: list[Any]) -> SnapshotWriter:
        writer = cls(engine.checkpoint_engine, buffer_bytes, safe_globals)
        engine.checkpoint_engine = writer
        take_model_step = engine._take_model_step

        def written_then_step(*args, **kwargs):
            writer.wait_before_update()
            return take_model_step(*args, **kwargs)

        engine._take_model_step = written_then_step
        return writer

    def wait_before_update(self) -> None:
        """The held tensors are about to change: wait until the queued writes are done."""
        if self.queue.unfinished_tasks:
            t0 = time.perf_counter()
            self.wait()
            self.blocked_s += time.perf_counter() - t0

    def __getattr__(self, name: str):  # create, commit, makedirs, load, ...: DeepSpeed's
        return getattr(self.base, name)

    def preserves_storage_sharing(self) -> bool:
        return False  # views are written compact (placeholders): DeepSpeed need not clone

    def is_decoupled(self) -> bool:
        return False

    def save(self, state_dict, path: str) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((*hold(state_dict), path))

    def _run(self) -> None:
        while True:
            skeleton, sources, path = self.queue.get()
            try:
                if self.error is None:
                    self._write(skeleton, sources, path)
            except BaseException as err:  # noqa: BLE001  (raised on the training thread)
                self.error = err
            finally:
                del skeleton, sources
                self.queue.task_done()

    def _write(self, skeleton: Any, sources: dict[int, torch.Tensor], path: str) -> None:
        with torch.serialization.skip_data():
            torch.save(skeleton, path)
        pairs = record_offsets(path, skeleton, self.safe_globals)
        if pairs is None:
            if not self.fallbacks:
                rank_line(f"[plm train] {path}: its tensors could not be paired with the "
                          "file's records (one inside an object?); written with a plain "
                          "torch.save of host copies", err=True)  # fmt: skip
            self.fallbacks += 1
            torch.save(materialized(skeleton, sources), path)
            pairs = []
        fd = os.open(path, os.O_WRONLY)
        try:
            for offset, tensor in pairs:
                fill(fd, offset, sources.get(id(tensor), tensor), self.buffer)
            os.fsync(fd)  # on the disk before COMPLETE names it
        finally:
            os.close(fd)

    def busy(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.queue.unfinished_tasks > 0

    def wait(self) -> None:
        self.queue.join()
        if self.error is not None:
            raise self.error
