"""A prepared data dir on an object store (``data.path=s3://bucket/prefix``), read in blocks.

``DataDir`` reads a local data dir through memory maps; for a URI (any pyarrow filesystem:
``s3://``, ``gs://``, ``file://``...) it reads through a ``RemoteStore``:

* the filesystem comes from ``pyarrow.fs.FileSystem.from_uri``: credentials, region and
  endpoint from the standard variables (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...);
* the manifest is fetched whole at every open (one small GET); each shard's block index
  (``.idx.npy``, small) whole on first use; the tokenizer dir once. These *metadata*
  files live under ``CACHE/meta/``, named by what they hold (the manifest's sha256 of an
  index, the tokenizer's fingerprint), and are not counted in ``cache_bytes``;
* a block is fetched by one range read of its whole sample (index row OFFSET/SIZE), its
  crc32 (row CRC) checked before it is used or cached: a corrupt block raises the same
  ``ShardError`` as a local one and leaves nothing in the cache;
* blocks are cached as files ``CACHE/blocks/<uri+shard digest>-<block>-<crc32>-<size>``,
  written ``.part`` then renamed, so the ranks and loader workers of a node share them:
  the ``.part`` file is also the claim that one process is fetching that block (the
  others wait for it instead of fetching it again). The least recently used blocks
  (file mtime, touched on every use) are deleted after each write while the blocks hold
  more than ``cache_bytes``. A cached block is crc-checked again the first time a
  process maps it (as a local shard's block is), and a cached file
  that fails is deleted and fetched again;
* the start of the training stream needs every document's token count: those come from
  range reads of the blocks' ``docs.npy`` only (4 bytes a document), kept per shard in
  ``CACHE/meta/`` (named by the shard's sha256), so a warm node reads them locally;
* prefetch: ``prefetch(shard, blocks)`` queues blocks a reader will need (the stream
  names the blocks of the shuffle group it lays out, and those of the next group once
  half of this one is read); a reader that walks a shard in order (``iter_shard``,
  counting unigrams) gets the next K blocks queued without asking. At most K (``prefetch_blocks``) fetches run in the background at once.

Counters (``stats()``): ``fetched_bytes``/``blocks_fetched`` (block GETs, prefetched or
not), ``meta_bytes``/``meta_fetches`` (manifest, indexes, tokenizer, token counts),
``cache_hits`` (blocks found in the node cache), ``read_bytes``/``blocks_read`` (distinct
blocks this process used). Per process: loader workers count their own.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.shard_index import CRC, DOCS_AT, N_DOCS, OFFSET, SIZE, ShardError
from pipeline.errors import ConfigError
from pipeline.storage import (
    Counters,
    atomic_write,
    endpoint_named,
    is_plain_name,
    redact_uri,
    store_fault,
)

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
GiB = 1 << 30
DEFAULT_CACHE_BYTES = 2 * GiB
DEFAULT_PREFETCH_BLOCKS = 4
_STALE_PART_S = 60.0  # a .part file not written to for this long: its fetcher died
_WAIT_S = 0.005  # poll interval while another process fetches a block


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/plm/blocks`` when XDG_CACHE_HOME is set, else
    ``$TMPDIR/plm-cache-<uid>`` (``/tmp/plm-cache-<uid>``): a node's own disk."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "plm" / "blocks"
    return Path(tempfile.gettempdir()) / f"plm-cache-{os.getuid()}"


@dataclass(frozen=True)
class CacheConfig:
    """``data.cache_dir``, ``data.cache_bytes``, ``data.prefetch_blocks``."""

    dir: str | None = None  # None: default_cache_dir()
    max_bytes: int = DEFAULT_CACHE_BYTES  # of cached blocks (0: none cached)
    prefetch_blocks: int = DEFAULT_PREFETCH_BLOCKS  # background fetches at once (0: none)

    @classmethod
    def of(cls, data: Any) -> CacheConfig:
        """From a ``DataSection``."""
        return cls(data.cache_dir, data.cache_bytes, data.prefetch_blocks)

    def path(self) -> Path:
        return Path(self.dir).expanduser() if self.dir else default_cache_dir()


def _digest(*parts: str, n: int = 20) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _write_atomic(path: Path, data: bytes) -> None:
    atomic_write(path, data, durable=False)  # a cache: a file lost to a crash is fetched again


class BlockCache:
    """Block files under ``root``, at most ``max_bytes`` in all (least recently used
    deleted first), shared by the processes of a node (see the module docstring)."""

    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes

    def path(self, key: str) -> Path:
        return self.root / key

    def fits(self, size: int) -> bool:
        return 0 < size <= self.max_bytes

    def open(self, key: str, size: int) -> mmap.mmap | None:
        """A map of the cached block, or None (not cached, or cut short)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != size:
                    return None
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        _touch(path)
        return mm

    def claim(self, key: str) -> int | None:
        """An fd of ``key.part`` when this process is to fetch the block; None when another
        process is fetching it (its ``.part`` exists and is fresh)."""
        part = self.path(key + ".part")
        for _ in range(2):
            try:
                return os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    if time.time() - part.stat().st_mtime < _STALE_PART_S:
                        return None
                    part.unlink()  # its fetcher died: take over
                except FileNotFoundError:
                    pass
        return None

    def wait(self, key: str, size: int, timeout: float = 4 * _STALE_PART_S) -> mmap.mmap | None:
        """The block once another process has cached it; None when its claim went away
        without a file (failed or evicted at once: fetch it yourself)."""
        part = self.path(key + ".part")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mm = self.open(key, size)
            if mm is not None:
                return mm
            if not part.exists():
                return self.open(key, size)
            time.sleep(_WAIT_S)
        return None

    def commit(self, fd: int, key: str, data: bytes) -> None:
        part = self.path(key + ".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(part, self.path(key))
        except OSError:
            self.abandon(None, key)
            return
        self.evict()

    def abandon(self, fd: int | None, key: str) -> None:
        if fd is not None:
            os.close(fd)
        try:
            self.path(key + ".part").unlink()
        except FileNotFoundError:
            pass

    def entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every cached block."""
        out = []
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.endswith((".part", ".tmp")):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def size(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self) -> int:
        """Delete the least recently used blocks while the total exceeds max_bytes; the
        number deleted."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        deleted = 0
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
                deleted += 1
            except FileNotFoundError:
                pass
            total -= size
        return deleted


class RemoteStore:
    """The files of one data dir on a pyarrow filesystem, through the node cache."""

    def __init__(self, uri: str, cache: CacheConfig | None = None):
        import pyarrow.fs as pafs

        self.uri = uri.rstrip("/")
        self.cache_config = cache = cache or CacheConfig()
        try:
            self.fs, self.base = pafs.FileSystem.from_uri(self.uri)
        except (OSError, ValueError) as err:
            raise self._unreachable(err) from None
        self.base = self.base.rstrip("/")
        root = cache.path()
        self.meta_dir = root / "meta" / _digest(self.uri)
        try:
            (root / "blocks").mkdir(parents=True, exist_ok=True)
            self.meta_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"data.cache_dir: cannot create the block cache {root} ({err}); set "
                "data.cache_dir to a writable folder on the node's local disk"
            ) from None
        self.blocks = BlockCache(root / "blocks", cache.max_bytes)
        self.prefetch_blocks = cache.prefetch_blocks
        self.indexes: dict[str, np.ndarray] = {}  # per shard, for readahead (``set_rows``)
        self._counts = Counters("fetched_bytes", "blocks_fetched", "meta_bytes", "meta_fetches",
                                "cache_hits", "read_bytes", "blocks_read", "prefetched")  # fmt: skip
        self._fresh()

    # --- process-local state: rebuilt after a fork or an unpickle ------------------------
    def _fresh(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()  # RLock: a done callback may run in the submitter
        self._files: dict[str, Any] = {}  # open input files, per shard
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}  # key -> a fetch running in this process
        self._queue: deque[tuple[str, int, list[int]]] = deque()  # blocks to prefetch
        self._queued: set[str] = set()
        self._running = 0
        self._last: dict[str, int] = {}  # per shard: the last block read (readahead)
        self._hinted = False  # a reader said what it needs: no guessing ahead
        self._seen: set[tuple[str, int]] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k == "_counts"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked loader worker: the parent's threads are gone
            self._fresh()
            self._counts = self._counts.zeroed()

    def stats(self) -> dict[str, int]:
        return self._counts.snapshot()

    def where(self, name: str = "") -> str:
        return f"{self.uri}/{name}" if name else self.uri

    def _path(self, name: str) -> str:
        return f"{self.base}/{name}" if self.base else name

    # --- errors ---------------------------------------------------------------------------
    def _unreachable(self, err: Exception) -> Exception:
        text = " ".join(str(err).split())
        fault = store_fault(self.uri, "", err)
        if fault is not None:  # access denied, cannot connect, no bucket: said first
            return ShardError(f"cannot read {fault}")
        return ShardError(
            f"cannot read {redact_uri(self.uri)} ({text}); check the URI, the endpoint "
            "(AWS_ENDPOINT_URL) and the credentials (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY or the node's role)"
        )

    def _missing(self, name: str, what: str) -> Exception:
        import pyarrow.fs as pafs

        if self.fs.type_name in ("s3", "gcs") and self.base:  # a missing bucket: say so
            bucket = self.base.split("/", 1)[0]
            try:
                gone = self.fs.get_file_info(bucket).type == pafs.FileType.NotFound
            except OSError as err:
                return self._unreachable(err)
            if gone:
                what = f"bucket {bucket} not found at {endpoint_named()}; create it or fix the URI"
        return ShardError(f"{redact_uri(self.where(name))} does not exist: {what}")

    # --- whole small files ----------------------------------------------------------------
    def read_file(self, name: str, missing: str = "re-run `plm data prepare`") -> bytes:
        """A whole (small) file of the data dir, fetched."""
        try:
            with self.fs.open_input_file(self._path(name)) as f:
                data = f.read()
        except FileNotFoundError:
            raise self._missing(name, missing) from None
        except OSError as err:
            raise self._unreachable(err) from None
        self._counts.add(meta_bytes=len(data), meta_fetches=1)
        return data

    def manifest_bytes(self) -> bytes:
        data = self.read_file(
            "manifest.json",
            f"{self.uri} is not a finished data directory (check the bucket and prefix; "
            "`plm data prepare` creates it)",
        )
        _write_atomic(self.meta_dir / "manifest.json", data)
        return data

    def index_bytes(self, name: str, sha256: str | None) -> bytes:
        """A shard's block index, from the cache when its manifest sha256 matches."""
        cached = self.meta_dir / f"idx-{sha256}.npy" if sha256 else None
        if cached is not None and cached.is_file():
            data = cached.read_bytes()
            if hashlib.sha256(data).hexdigest() == sha256:
                return data
        data = self.read_file(name, "re-run `plm data prepare --force`")
        if cached is not None and hashlib.sha256(data).hexdigest() == sha256:
            _write_atomic(cached, data)
        return data

    def size(self, name: str) -> int | None:
        """Bytes of a file of the data dir, None when it does not exist."""
        import pyarrow.fs as pafs

        try:
            info = self.fs.get_file_info(self._path(name))
        except OSError as err:
            raise self._unreachable(err) from None
        return info.size if info.type == pafs.FileType.File else None

    def sha256(self, name: str) -> str:
        """Hash of a whole file, streamed (``verify``, ``on_bad_shard=skip``)."""
        h = hashlib.sha256()
        try:
            with self.fs.open_input_stream(self._path(name)) as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                    self._counts.add(meta_bytes=len(chunk))
        except FileNotFoundError:
            raise self._missing(name, "re-run `plm data prepare`") from None
        except OSError as err:
            raise self._unreachable(err) from None
        return h.hexdigest()

    def open_stream(self, name: str):
        return self.fs.open_input_stream(self._path(name))

    def tokenizer_dir(self, name: str, key: str) -> Path:
        """The data dir's tokenizer folder, downloaded once into the cache (``key``: the
        tokenizer's fingerprint, or the manifest's hash)."""
        import pyarrow.fs as pafs

        local = self.meta_dir / f"tok-{_digest(key)}" / Path(name).name
        if local.is_dir():
            return local
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self._path(name), recursive=True))
        except FileNotFoundError:
            raise self._missing(
                name, "the tokenizer dir is missing; re-run `plm data prepare`"
            ) from None
        except OSError as err:
            raise self._unreachable(err) from None
        files = [i for i in infos if i.type == pafs.FileType.File]
        if not files:
            raise self._missing(name, "the tokenizer dir is empty; re-run `plm data prepare`")
        tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=self.meta_dir))
        prefix = self._path(name) + "/"
        for info in files:
            rel = info.path[len(prefix) :]
            if not is_plain_name(rel):  # an object key with '..' would land outside tmp
                shutil.rmtree(tmp, ignore_errors=True)
                raise ShardError(
                    f"{redact_uri(self.where(name))} holds {rel!r}, which is not a plain name "
                    "inside the tokenizer dir; refused, nothing written: re-run `plm data prepare`"
                )
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.read_file(f"{name}/{rel}"))
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, local)
        except OSError:  # another process put it there first
            shutil.rmtree(tmp, ignore_errors=True)
        return local

    # --- token counts ----------------------------------------------------------------------
    def doc_lengths(self, shard: str, rows: np.ndarray, sha256: str | None) -> np.ndarray:
        """Every document's token count (uint32) of a shard: the blocks' docs.npy by range
        reads (in parallel), kept in the cache by the shard's sha256."""
        cached = self.meta_dir / f"len-{sha256}.npy" if sha256 else None
        n_docs = int(rows[:, N_DOCS].sum())
        if cached is not None:
            try:
                lengths = np.load(cached, mmap_mode="r", allow_pickle=False)
                if lengths.shape == (n_docs,):
                    return lengths
            except (OSError, ValueError):
                pass
        f = self._file(shard)

        def ends(row) -> np.ndarray:
            start, size = int(row[OFFSET] + row[DOCS_AT]), 4 * int(row[N_DOCS])
            data = f.read_at(size, start) if size else b""
            self._counts.add(meta_bytes=len(data), meta_fetches=1)
            return np.frombuffer(data, "<u4")

        try:
            parts = list(self._executor().map(ends, rows))
        except OSError as err:
            raise self._unreachable(err) from None
        lengths = np.concatenate([np.diff(p, prepend=np.uint32(0)) for p in parts] or [[]])
        lengths = lengths.astype(np.uint32)
        if cached is not None:
            buf = io.BytesIO()
            np.save(buf, lengths, allow_pickle=False)
            _write_atomic(cached, buf.getvalue())
        return lengths

    # --- blocks ---------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        self._check_fork()
        with self._lock:
            if self._pool is None:
                workers = max(self.prefetch_blocks, 4)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="plm-fetch")
            return self._pool

    def _file(self, shard: str):
        self._check_fork()
        with self._lock:
            f = self._files.get(shard)
        if f is None:
            try:
                f = self.fs.open_input_file(self._path(shard))
            except FileNotFoundError:
                raise self._missing(shard, "re-run `plm data prepare`") from None
            except OSError as err:
                raise self._unreachable(err) from None
            with self._lock:
                f = self._files.setdefault(shard, f)
        return f

    def key(self, shard: str, b: int, row: list[int], shard_sha256: str | None) -> str:
        return f"{_digest(self.uri, shard, shard_sha256 or '')}-{b:06d}-{row[CRC]:08x}-{row[SIZE]}"

    def block(self, shard: str, b: int, row: list[int], shard_sha256: str | None):
        """Block b's sample bytes (a map of the cached file, or bytes when it is not
        cached) and whether its crc32 was checked in this process (a fresh fetch)."""
        self._check_fork()
        key = self.key(shard, b, row, shard_sha256)
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            pending.result()  # a prefetch of it running here: wait (its errors: below)
        mm = self.blocks.open(key, row[SIZE]) if self.blocks.fits(row[SIZE]) else None
        if mm is not None:
            self._counts.add(cache_hits=1)
            out: tuple[Any, bool] = (mm, False)
        else:
            out = self._fetch(shard, b, row, key)
        with self._lock:
            if (shard, b) not in self._seen:
                self._seen.add((shard, b))
                self._counts.add(read_bytes=row[SIZE], blocks_read=1)
            last, self._last[shard] = self._last.get(shard), b
        if not self._hinted and last == b - 1 and self.prefetch_blocks:
            self._readahead(shard, b, shard_sha256)
        return out

    def drop(self, shard: str, b: int, row: list[int], shard_sha256: str | None) -> None:
        """Forget a cached copy that failed its crc32 (fetched again next time)."""
        try:
            self.blocks.path(self.key(shard, b, row, shard_sha256)).unlink()
        except FileNotFoundError:
            pass

    def _get(self, shard: str, b: int, row: list[int]) -> bytes:
        try:
            data = self._file(shard).read_at(row[SIZE], row[OFFSET])
        except OSError as err:
            raise self._unreachable(err) from None
        self._counts.add(fetched_bytes=len(data), blocks_fetched=1)
        if len(data) != row[SIZE]:
            raise ShardError(
                f"{self.where(shard)}: block {b} at byte {row[OFFSET]} (+{row[SIZE]} bytes) "
                f"lies outside the shard ({len(data)} bytes read): the shard is truncated or "
                "its index is stale; re-run `plm data prepare --force`"
            )
        if zlib.crc32(data) != row[CRC]:
            raise ShardError(
                f"{self.where(shard)}: block {b} at byte {row[OFFSET]} is corrupt (crc32 "
                "mismatch); `plm data inspect --verify` checks the whole directory, "
                "`plm data prepare --force` rebuilds it"
            )
        return data

    def _fetch(self, shard: str, b: int, row: list[int], key: str) -> tuple[Any, bool]:
        """Fetch a block (crc32 checked) into the cache; or wait for the process that is."""
        size = row[SIZE]
        if not self.blocks.fits(size):
            return self._get(shard, b, row), True
        for _ in range(3):
            fd = self.blocks.claim(key)
            if fd is None:  # another process fetches it
                mm = self.blocks.wait(key, size)
                if mm is not None:
                    self._counts.add(cache_hits=1)
                    return mm, False
                continue
            try:
                data = self._get(shard, b, row)
            except BaseException:
                self.blocks.abandon(fd, key)
                raise
            self.blocks.commit(fd, key, data)
            return data, True
        return self._get(shard, b, row), True

    # --- prefetch -------------------------------------------------------------------------
    def prefetch(self, items: Iterable[tuple[str, int, list[int], str | None]]) -> None:
        """Queue blocks (shard, b, index row, shard sha256) a reader will need soon."""
        self._check_fork()
        self._hinted = True
        self._enqueue(items)

    def _readahead(self, shard: str, b: int, shard_sha256: str | None) -> None:
        rows = self.indexes.get(shard)
        if rows is None:
            return
        stop = min(b + 1 + self.prefetch_blocks, len(rows))
        self._enqueue((shard, c, rows[c].tolist(), shard_sha256) for c in range(b + 1, stop))

    def _enqueue(self, items) -> None:
        if not self.prefetch_blocks:
            return
        budget = self.blocks.max_bytes // 2  # queued blocks must not evict each other
        with self._lock:
            queued = sum(r[SIZE] for _, _, r, _ in self._queue)
            for shard, b, row, sha in items:
                key = self.key(shard, b, row, sha)
                if key in self._queued or key in self._pending or not self.blocks.fits(row[SIZE]):
                    continue
                if queued + row[SIZE] > budget:
                    break
                self._queue.append((shard, b, row, sha))
                self._queued.add(key)
                queued += row[SIZE]
        self._pump()

    def _pump(self) -> None:
        pool = self._executor()
        with self._lock:
            while self._queue and self._running < self.prefetch_blocks:
                shard, b, row, sha = self._queue.popleft()
                key = self.key(shard, b, row, sha)
                self._queued.discard(key)
                if key in self._pending or self.blocks.path(key).exists():
                    continue
                self._running += 1
                future = pool.submit(self._prefetch_one, shard, b, row, key)
                self._pending[key] = future
                future.add_done_callback(lambda _f, key=key: self._done(key))

    def _prefetch_one(self, shard: str, b: int, row: list[int], key: str) -> None:
        try:
            out, fresh = self._fetch(shard, b, row, key)
        except Exception:  # noqa: BLE001 - the reader meets the error when it needs the block
            return
        if fresh:
            self._counts.add(prefetched=1)
        if isinstance(out, mmap.mmap):
            out.close()

    def _done(self, key: str) -> None:
        with self._lock:
            self._pending.pop(key, None)
            self._running -= 1
        self._pump()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._queue.clear()
            self._queued.clear()
            files, self._files = self._files, {}
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)
        for f in files.values():
            try:
                f.close()
            except OSError:
                pass
