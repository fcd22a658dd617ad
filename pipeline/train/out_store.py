"""``train.out_dir``: where a run's checkpoints, bundles and metrics live for good: a
local folder, or any pyarrow filesystem URI (``s3://bucket/prefix``, ``gs://``...).

``OutStore.open`` gives one of two stores with the same methods, so the checkpoint
manager and the trainer never ask which one they have:

* ``LocalOut`` (a local path): the folder *is* the store; every rank writes into it (a
  filesystem every host sees), nothing is uploaded or fetched: what plm always did.
* ``RemoteOut`` (a URI): each node writes into a *staging* folder on its own disk
  (``train.local_dir``, default ``$XDG_CACHE_HOME/plm/out/<digest of the URI>`` or
  ``$TMPDIR/plm-out-<uid>/<digest>``), and the files go to the store in the background:
  one thread takes upload jobs in order (a job waits for its local writes first), the
  files of a job go side by side (pyarrow's S3 output stream uploads a big file in parts),
  each is checked by its size on the store once written, and a failed one is retried
  with a growing pause (0.5 s doubling to 30 s) for ``train.upload_retry_s``; after that
  the run stops with one line. Small files (``latest``, ``COMPLETE``) are written on the
  store directly, with the same retries. Reads (``latest``, ``COMPLETE``, listings) go to
  the store; a resume fetches only the files asked for into the staging folder, skipping
  those already there at the store's size.

What the stores do not know: which files make a checkpoint, when one is complete, what
to prune. That is ``CheckpointManager``'s (pipeline/train/checkpoint.py), through these
methods. The rank that owns a checkpoint file is in its name (``owner``).

Credentials, region and endpoint come from the standard variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_DEFAULT_REGION) or the
node's role, never from the URI (the config refuses a URI that carries them), so no
log line, config file, metrics row or MLflow param holds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.output import rank_line
from pipeline.storage import (
    Counters,
    atomic_write,
    is_plain_name,
    is_uri,
    redact_uri,
    store_fault,
    temp_name,
)

UPLOAD_RETRY_S = 900.0  # train.upload_retry_s's default
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.5, 30.0
_PARALLEL = 4  # files of one job uploaded side by side
_CHUNK = 8 << 20

# A checkpoint file that belongs to one rank: its ZeRO partition, its trainer state.
_OWNER = re.compile(r"(?:zero_pp_rank_|trainer_rank)(\d+)(?:_|\.)")


def owner(name: str) -> int | None:
    """The rank a checkpoint file belongs to (``zero_pp_rank_1_mp_rank_00_optim_states.pt``,
    ``trainer_rank1.pt``: 1), or None for a file every rank reads (the model states of
    ZeRO 0-2, ``config.yaml``, ``COMPLETE``) or that rank 0 writes alone."""
    m = _OWNER.search(name)
    return int(m.group(1)) if m else None


class UploadError(RuntimeError):
    """The store did not take a file for ``train.upload_retry_s``."""


def _lasting(err: OSError) -> bool:
    """A fault that waiting does not mend: access denied, no such bucket."""
    line = store_fault("s3://x", "", err) or ""
    return "access denied" in line or "not found" in line


def default_staging_root() -> Path:
    """Where a node stages the files of URI out_dirs: its own disk, as the block cache."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "plm" / "out"
    return Path(tempfile.gettempdir()) / f"plm-out-{os.getuid()}"


class OutStore:
    """The methods both stores have (see the module doc). ``rel`` paths are relative to
    the run's root (``checkpoints/latest``); ``local`` is the folder this node writes."""

    uri: str
    local: Path
    name: str  # the run's name: the out_dir's last part

    @staticmethod
    def open(
        out_dir: str,
        local_dir: str | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
        retry_s: float = UPLOAD_RETRY_S,
    ) -> OutStore:
        env_rank = int(os.environ.get("RANK", "0"))
        rank = env_rank if rank is None else rank
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        if is_uri(out_dir):
            return RemoteOut(out_dir, local_dir, rank, local_rank, retry_s)
        return LocalOut(out_dir, rank)

    # --- what a message names ---------------------------------------------------------------
    def where(self, rel: str = "") -> str:
        raise NotImplementedError

    def relative(self, path: str | Path) -> str:
        """``path`` (under ``local``, or already relative) relative to the run's root."""
        p = Path(path)
        if not p.is_absolute():
            return p.as_posix()
        return p.relative_to(self.local).as_posix()

    # the rest: see LocalOut / RemoteOut
    def check(self) -> None:  # noqa: B027  (a local folder needs no check)
        """Before any work: the store answers and takes writes; a ConfigError otherwise."""

    def mirror(self, names: Iterable[str]) -> None:  # noqa: B027
        """Files of the run's root kept on the store as they are locally (metrics.jsonl,
        the MLflow run id): sent with each checkpoint and at the end, fetched at start."""

    def restore_mirrored(self) -> None:  # noqa: B027
        """The mirrored files as the store has them (this node's copies replaced, unless
        one holds the store's rows and more: this node logged them after the upload)."""

    def sync_mirrored(self) -> None:  # noqa: B027
        """Queue the mirrored files' current contents for upload."""

    def upload_own(self, rel: str, rank: int, after: Callable[[], None] | None = None) -> None:  # noqa: B027
        """Queue the files of folder ``rel`` that ``rank`` owns (``owner``; rank 0 also those
        of no rank), listed once ``after`` (the local writes) returns."""

    def upload_tree(self, rel: str) -> None:  # noqa: B027
        """Queue every file under folder ``rel``."""

    def upload_files(self, rels: Iterable[str]) -> None:  # noqa: B027
        """Queue these files (paths relative to the root, written under ``local``)."""

    defers = False  # ``later`` runs its call after the queued uploads, off the caller

    def later(self, call: Callable[[], None]) -> None:
        """``call()`` once the uploads queued so far are done: on the upload thread of a
        store (``wait`` waits for it too; its error is raised as an upload's), here and now
        for a local folder."""
        call()

    def busy(self) -> bool:
        """Uploads are queued or running; raises the error of one that gave up."""
        return False

    def wait(self) -> None:  # noqa: B027
        """Until every queued upload is on the store (raises if one gave up)."""

    def fetch(self, rels: Iterable[str]) -> list[tuple[str, int]]:
        """These files into ``local`` (those there at the store's size are kept); (rel,
        bytes) of each one fetched."""
        return []

    def drop_staging(self, rel: str, keep: set[str]) -> None:  # noqa: B027
        """This node's staged copies of the folders in ``rel`` but ``keep``."""

    def close(self, timeout: float | None = None) -> None:  # noqa: B027
        """Mirrored files sent and every upload waited for (``timeout``: at most that)."""

    def stats(self) -> dict[str, int]:
        return {}

    # small files and folders, on the store
    def read_bytes(self, rel: str) -> bytes | None:
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def write_bytes(self, rel: str, data: bytes) -> None:
        raise NotImplementedError

    def list_dir(self, rel: str) -> list[tuple[str, bool]]:
        """(name, is a folder) of each entry of folder ``rel``; [] when there is none."""
        raise NotImplementedError

    def list_files(self, rel: str) -> list[tuple[str, int]]:
        """(path relative to the root, size) of every file under folder ``rel``."""
        raise NotImplementedError

    def delete_tree(self, rel: str) -> None:
        """Folder ``rel`` on the store (and this node's copy), with all it holds."""
        raise NotImplementedError

    def clear(self, rel: str) -> None:
        """A leftover folder ``rel`` before it is written again: on the store by rank 0,
        a node's staged copy by its local rank 0 (every rank calls it)."""
        raise NotImplementedError


class LocalOut(OutStore):
    """A local out_dir: the folder every rank writes, shared by every host."""

    def __init__(self, out_dir: str, rank: int = 0):
        self.uri = out_dir
        self.local = Path(out_dir)
        self.name = self.local.name
        self.rank = rank

    def where(self, rel: str = "") -> str:
        return str(self.local / rel) if rel else str(self.local)

    def read_bytes(self, rel: str) -> bytes | None:
        p = self.local / rel
        return p.read_bytes() if p.is_file() else None

    def exists(self, rel: str) -> bool:
        return (self.local / rel).is_file()

    def write_bytes(self, rel: str, data: bytes) -> None:
        atomic_write(self.local / rel, data)

    def list_dir(self, rel: str) -> list[tuple[str, bool]]:
        d = self.local / rel
        if not d.is_dir():
            return []
        return sorted((p.name, p.is_dir()) for p in d.iterdir())

    def list_files(self, rel: str) -> list[tuple[str, int]]:
        d = self.local / rel
        return sorted(
            (p.relative_to(self.local).as_posix(), p.stat().st_size)
            for p in d.rglob("*")
            if p.is_file()
        )

    def delete_tree(self, rel: str) -> None:
        shutil.rmtree(self.local / rel, ignore_errors=True)

    def clear(self, rel: str) -> None:
        if self.rank == 0 and (self.local / rel).exists():
            shutil.rmtree(self.local / rel)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RemoteOut(OutStore):
    """A URI out_dir: staged on this node's disk, uploaded in the background."""

    def __init__(self, uri: str, local_dir: str | None, rank: int, local_rank: int,
                 retry_s: float = UPLOAD_RETRY_S):  # fmt: skip
        import pyarrow.fs as pafs

        self.uri = uri.rstrip("/")
        self.shown = redact_uri(self.uri)
        self.name = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*://", "", self.uri).rsplit("/", 1)[-1]
        self.rank, self.local_rank, self.retry_s = rank, local_rank, retry_s
        try:
            self.fs, base = pafs.FileSystem.from_uri(self.uri)
        except (OSError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError
            raise ConfigError(
                store_fault(self.uri, "train.out_dir", err)
                or f"train.out_dir={self.shown}: not a usable filesystem URI "
                f"({' '.join(str(err).split())[:200]})",
                machine_wide=True,
            ) from None
        if isinstance(self.fs, pafs.S3FileSystem):
            # Each part uploaded by the thread writing the file (ours, _PARALLEL of them),
            # not handed to pyarrow's background pool, which costs several times the client
            # CPU per byte, CPU a training step shares (BENCHMARKS.md, object storage). The
            # options from_uri resolved are kept.
            rebuild, (options,) = self.fs.__reduce__()
            self.fs = rebuild({**options, "background_writes": False})
        self.base = base.rstrip("/")
        root = Path(local_dir).expanduser() if local_dir else default_staging_root()
        self.local = root if local_dir else root / f"{self.name}-{_digest(self.uri)}"
        try:
            self.local.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"train.local_dir: cannot create the staging folder {self.local} of "
                f"train.out_dir={self.shown} ({err}); set train.local_dir to a writable "
                "folder on the node's own disk",
                machine_wide=True,
            ) from None
        self._mirrored: list[str] = []
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._counts = Counters("uploaded_bytes", "uploaded_files", "fetched_bytes",
                                "fetched_files", "cached_files", "retries")  # fmt: skip
        self._warned = 0.0
        self._thread = threading.Thread(target=self._run, name="out-store-upload", daemon=True)
        self._thread.start()

    # --- names ----------------------------------------------------------------------------------
    def where(self, rel: str = "") -> str:
        return f"{self.shown}/{rel}" if rel else self.shown

    def _path(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def _inside(self, rel: str) -> str:
        """``rel``, a key of the store fetched into ``local``: plain parts only (S3 keys are
        any string: ``x/../../y`` or an absolute part would land outside ``local``)."""
        if not is_plain_name(rel):
            raise ConfigError(
                f"{self.where()} holds {rel!r}, which is not a plain path inside the run; "
                f"refused, nothing fetched into {self.local}: delete that object from the store",
                machine_wide=True,
            )
        return rel

    def stats(self) -> dict[str, int]:
        return self._counts.snapshot()

    # --- before any work -----------------------------------------------------------------------
    def check(self) -> None:
        """The bucket exists, the credentials may list and write under the prefix: one
        small object written and deleted (each rank: each host has its own credentials)."""
        import pyarrow.fs as pafs

        what = f"train.out_dir={self.shown}"
        try:
            if self.fs.type_name in ("s3", "gcs"):
                bucket = self.base.split("/", 1)[0]
                if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                    raise ConfigError(
                        f"{what}: the bucket {bucket!r} does not exist{self._at()}; create it "
                        "or point train.out_dir at an existing bucket; nothing was trained",
                        machine_wide=True,
                    )
            else:
                self.fs.create_dir(self.base, recursive=True)
            probe = self._path(f".plm-write-check-{os.uname().nodename}-{os.getpid()}")
            with self.fs.open_output_stream(probe) as f:
                f.write(b"plm")
            self.fs.delete_file(probe)
        except OSError as err:
            line = store_fault(self.uri, "train.out_dir", err)
            if line is None:
                line = f"{what}: cannot write there ({' '.join(str(err).split())[:200]})"
            raise ConfigError(
                f"{line}; credentials that may read and write it are needed before training "
                "starts; nothing was trained",
                machine_wide=True,
            ) from None

    @staticmethod
    def _at() -> str:
        url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return f" at {redact_uri(url)}" if url else ""

    # --- retries --------------------------------------------------------------------------------
    def _retrying(self, what: str, call: Callable[[], object]):
        """``call()`` until it works, pausing 0.5 s doubling to 30 s, for at most
        ``retry_s`` after the first failure; an UploadError then. Access denied or no
        such bucket is no outage: one ConfigError line at once."""
        deadline, pause = None, _FIRST_PAUSE_S
        while True:
            try:
                return call()
            except OSError as err:
                if isinstance(err, FileNotFoundError) or _lasting(err):
                    line = store_fault(self.uri, "train.out_dir", err)
                    if line is not None:  # denied, no bucket: waiting will not help
                        raise ConfigError(line, machine_wide=True) from None
                    raise
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.retry_s
                text = " ".join(str(err).split())[:300]
                if now >= deadline:
                    raise UploadError(
                        f"{what}: the store did not answer for train.upload_retry_s="
                        f"{self.retry_s:g} s ({text}); `latest` on {self.where('checkpoints')} "
                        "still names the last checkpoint every rank uploaded: the same "
                        "command resumes from it"
                    ) from None
                self._counts.add(retries=1)
                if now - self._warned > 60:  # once a minute at most, on this rank
                    self._warned = now
                    rank_line(
                        f"[plm train] rank {self.rank}: {what} failed ({text}); retrying for up "
                        f"to {self.retry_s:g} s, training goes on",
                        err=True,
                    )
                time.sleep(min(pause, max(0.0, deadline - now)))
                pause = min(pause * 2, _MAX_PAUSE_S)

    # --- uploads ------------------------------------------------------------------------------------
    def _put_file(self, src: Path, rel: str) -> None:
        size = src.stat().st_size  # a file missing here is our bug: raised, not retried

        def put() -> None:
            out = self.fs.open_output_stream(self._path(rel))
            try:
                with open(src, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
            except BaseException:
                with contextlib.suppress(Exception):
                    out.abort()  # no half-written object is committed
                raise
            out.close()  # the multipart upload completes here
            got = self.fs.get_file_info(self._path(rel)).size
            if got != size:
                raise OSError(f"{rel}: the store holds {got} bytes, {size} were sent")

        self._retrying(f"uploading {src.name} to {self.where(rel)}", put)
        self._counts.add(uploaded_bytes=size, uploaded_files=1)

    def _put_bytes(self, rel: str, data: bytes) -> None:
        def put() -> None:
            if self.fs.type_name == "local":  # a file:// store
                atomic_write(self._path(rel), data, self.fs)
            else:  # an object store's PUT is atomic
                with self.fs.open_output_stream(self._path(rel)) as f:
                    f.write(data)

        self._retrying(f"writing {self.where(rel)}", put)
        self._counts.add(uploaded_bytes=len(data), uploaded_files=1)

    def _run(self) -> None:
        with ThreadPoolExecutor(_PARALLEL, thread_name_prefix="out-store-put") as pool:
            while True:
                job = self._jobs.get()
                try:
                    if self._error is None:
                        job(pool)
                except BaseException as err:  # noqa: BLE001  (raised on the training thread)
                    self._error = err
                finally:
                    self._jobs.task_done()

    def _queue(self, job: Callable) -> None:
        if self._error is not None:
            raise self._error
        self._jobs.put(job)

    def upload_own(self, rel: str, rank: int, after: Callable[[], None] | None = None) -> None:
        def job(pool: ThreadPoolExecutor) -> None:
            if after is not None:
                after()  # this rank's local writes are done
            folder = self.local / rel
            names = sorted(
                p.name for p in folder.iterdir()
                if p.is_file() and not p.name.endswith(".tmp")
                and (owner(p.name) == rank or (owner(p.name) is None and rank == 0))
            )  # fmt: skip
            list(pool.map(lambda n: self._put_file(folder / n, f"{rel}/{n}"), names))
            if rank == 0:
                for name, data in mirrored:
                    self._put_bytes(name, data)

        mirrored = self._snapshot_mirrored() if rank == 0 else []
        self._queue(job)

    def upload_tree(self, rel: str) -> None:
        def job(pool: ThreadPoolExecutor) -> None:
            root = self.local / rel
            files = sorted(p for p in root.rglob("*") if p.is_file())
            put = lambda p: self._put_file(p, p.relative_to(self.local).as_posix())  # noqa: E731
            list(pool.map(put, files))

        self._queue(job)

    def upload_files(self, rels: Iterable[str]) -> None:
        rels = sorted(rels)
        self._queue(lambda pool: list(pool.map(lambda r: self._put_file(self.local / r, r), rels)))

    defers = True

    def later(self, call: Callable[[], None]) -> None:
        self._queue(lambda pool: call())

    def busy(self) -> bool:
        if self._error is not None:
            raise self._error
        return self._jobs.unfinished_tasks > 0

    def wait(self) -> None:
        self._jobs.join()
        if self._error is not None:
            raise self._error

    def close(self, timeout: float | None = None) -> None:
        self.sync_mirrored()
        if timeout is None:
            self.wait()
            return
        deadline = time.monotonic() + timeout
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._error is not None:
            raise self._error

    # --- mirrored run files -----------------------------------------------------------------------
    def mirror(self, names: Iterable[str]) -> None:
        self._mirrored = list(names)

    def _snapshot_mirrored(self) -> list[tuple[str, bytes]]:
        """Their bytes now, on the calling thread (metrics.jsonl grows on it: a copy taken
        meanwhile could end in half a row)."""
        out = []
        for name in self._mirrored:
            p = self.local / name
            if p.is_file():
                out.append((name, p.read_bytes()))
        return out

    def sync_mirrored(self) -> None:
        mirrored = self._snapshot_mirrored()
        if mirrored:
            self._queue(lambda pool: [self._put_bytes(n, d) for n, d in mirrored])

    def restore_mirrored(self) -> None:
        for name in self._mirrored:
            data = self.read_bytes(name)
            p = self.local / name
            if data is None:
                p.unlink(missing_ok=True)
            elif not (p.is_file() and p.read_bytes().startswith(data)):
                _write_local(p, data)  # a node's longer copy of the same rows is kept

    # --- reads ------------------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes | None:
        def get() -> bytes | None:
            try:
                with self.fs.open_input_stream(self._path(rel)) as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return self._retrying(f"reading {self.where(rel)}", get)

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        info = self._retrying(
            f"looking up {self.where(rel)}", lambda: self.fs.get_file_info(self._path(rel))
        )
        return info.type == pafs.FileType.File

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._put_bytes(rel, data)
        _write_local(self.local / rel, data)  # this node's copy says the same

    def _infos(self, rel: str, recursive: bool):
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self._path(rel), allow_not_found=True, recursive=recursive)
        return self._retrying(f"listing {self.where(rel)}", lambda: self.fs.get_file_info(sel))

    def list_dir(self, rel: str) -> list[tuple[str, bool]]:
        import pyarrow.fs as pafs

        return sorted(
            (i.base_name, i.type == pafs.FileType.Directory) for i in self._infos(rel, False)
        )

    def list_files(self, rel: str) -> list[tuple[str, int]]:
        import pyarrow.fs as pafs

        n = len(self.base) + 1 if self.base else 0
        return sorted(
            (self._inside(i.path[n:]), i.size)
            for i in self._infos(rel, True)
            if i.type == pafs.FileType.File
        )

    def fetch(self, rels: Iterable[str]) -> int:
        """Side by side; a file already staged at the store's size is not fetched again."""
        import pyarrow.fs as pafs

        rels = [self._inside(r) for r in rels]  # all checked before any is fetched
        if not rels:
            return []
        infos = self._retrying(
            f"looking up {len(rels)} files under {self.where()}",
            lambda: self.fs.get_file_info([self._path(r) for r in rels]),
        )

        def one(item) -> int:
            rel, info = item
            if info.type != pafs.FileType.File:
                raise FileNotFoundError(f"{self.where(rel)} is missing")
            dst = self.local / rel
            if dst.is_file() and dst.stat().st_size == info.size:
                self._counts.add(cached_files=1)
                return None

            def get() -> None:
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = dst.with_name(temp_name(dst.name))
                try:
                    with self.fs.open_input_stream(self._path(rel)) as src, open(tmp, "wb") as f:
                        while chunk := src.read(_CHUNK):
                            f.write(chunk)
                    os.replace(tmp, dst)
                finally:
                    tmp.unlink(missing_ok=True)

            self._retrying(f"fetching {self.where(rel)}", get)
            self._counts.add(fetched_bytes=info.size, fetched_files=1)
            return rel, info.size

        with ThreadPoolExecutor(_PARALLEL) as pool:
            return [x for x in pool.map(one, zip(rels, infos, strict=True)) if x is not None]

    # --- deletes ----------------------------------------------------------------------------------
    def _delete_remote(self, rel: str) -> None:
        import pyarrow.fs as pafs

        def delete() -> None:
            if self.fs.get_file_info(self._path(rel)).type != pafs.FileType.NotFound:
                self.fs.delete_dir(self._path(rel))

        self._retrying(f"deleting {self.where(rel)}", delete)

    def delete_tree(self, rel: str) -> None:
        self._delete_remote(rel)
        shutil.rmtree(self.local / rel, ignore_errors=True)

    def clear(self, rel: str) -> None:
        """The store's leftover is deleted by the upload thread, before the uploads queued
        after it: a save never waits for the store."""
        if self.rank == 0:
            self._queue(lambda pool: self._delete_remote(rel))
        if self.local_rank == 0:
            shutil.rmtree(self.local / rel, ignore_errors=True)

    def drop_staging(self, rel: str, keep: set[str]) -> None:
        if self.local_rank != 0:
            return
        folder = self.local / rel
        if folder.is_dir():
            for p in folder.iterdir():
                if p.is_dir() and p.name not in keep:
                    shutil.rmtree(p, ignore_errors=True)


def _write_local(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
