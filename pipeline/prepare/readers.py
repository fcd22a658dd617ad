"""Corpus readers: files, folders, globs, pyarrow filesystem URIs and builtin corpora.

Every reader streams. Text files are read line by line with a cap on the line length,
so a 2 GB jsonl or a 200 MB one-line document never sits in memory whole: a document
over ``max_doc_bytes`` is skipped to its end and reported as a ``too_long`` reject.
Nothing is dropped silently: every document the source holds comes out as a
``RawDocument`` with an ordinal, either with its text or with the reason it was rejected.

Formats (by file name suffix):
    .txt .txt.gz .txt.zst          documents separated by blank lines
    .jsonl .jsonl.gz .jsonl.zst    one JSON object per line, text under ``text_field``
    .parquet                       text column ``text_field``, read batch by batch
Inputs: a file, a folder (recursive, sorted, only the suffixes above), a glob, a URI
that ``pyarrow.fs.FileSystem.from_uri`` understands (``file:///data``, ``s3://b/k``),
or ``builtin:python-docs`` / ``builtin:zh-sample``.

Policy for NUL bytes: a document holding a NUL byte is rejected as ``nul_bytes``. Text
corpora have no NULs; one means binary data or a wrong encoding (UTF-16 read as UTF-8),
so the rest of the document cannot be trusted either.
"""

from __future__ import annotations

import ast
import glob as globlib
import gzip
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.errors import ConfigError

DEFAULT_MAX_DOC_BYTES = 16 << 20  # a document larger than this is a "too_long" reject
_CHUNK = 1 << 20  # bytes per read (txt chunks, the rest of an oversized line) and buffer size
_PARQUET_BATCH_ROWS = 1024
_ZSTD_IN = 64 << 10  # compressed bytes per zstd decompression call
CORPORA_DIR = Path(__file__).resolve().parent / "corpora"
BUILTINS = ("builtin:python-docs", "builtin:zh-sample")

_FORMATS = (  # longest suffix first
    (".jsonl.gz", "jsonl.gz"),
    (".jsonl.zst", "jsonl.zst"),
    (".txt.gz", "txt.gz"),
    (".txt.zst", "txt.zst"),
    (".jsonl", "jsonl"),
    (".txt", "txt"),
    (".parquet", "parquet"),
)
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


class InputError(ConfigError):
    """An input that cannot be read: the message names the path and what to do."""


@dataclass(frozen=True)
class Source:
    """One readable unit of the corpus, in the order ``resolve_inputs`` gave it."""

    uri: str  # absolute local path, a filesystem URI, or builtin:NAME
    format: str  # txt, txt.gz, txt.zst, jsonl, jsonl.gz, jsonl.zst, parquet, builtin
    size: int  # bytes on disk (builtin: bytes of UTF-8 text)
    text_field: str = "text"
    # Last modification in ns (None for builtin:python-docs): with ``size`` what the
    # idempotence check compares, so the driver never reads a source's bytes to plan.
    mtime_ns: int | None = None


@dataclass(frozen=True)
class Slice:
    """A part of a source one task reads: a byte range of an uncompressed txt/jsonl file
    (cut on a document boundary, see ``find_cut``), some row groups of a parquet file,
    or the whole source. The slices of a source tile its bytes: ``[start, end)`` is what
    the task reads (txt/jsonl) or hashes (parquet: its row groups' bytes, the first slice
    from byte 0 and the last to the end of the file, so header and footer are covered)."""

    source: int  # index into the resolved sources
    start: int = 0  # first byte
    end: int | None = None  # one past the last byte; None: the end of the file
    row_groups: tuple[int, ...] | None = None  # parquet: only these row groups
    size: int = 0  # bytes it covers (parquet: its row groups' share of the file)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end is None and self.row_groups is None


@dataclass(frozen=True)
class RawDocument:
    source: str  # Source.uri
    ordinal: int  # position of the document in its source, rejects included
    text: str | None  # None when rejected
    reject: str | None = None  # invalid_utf8, nul_bytes, too_long, bad_json, no_text, truncated
    line: int | None = None  # 1-based line where the document starts (txt, jsonl)
    detail: str | None = None  # why, for the message (e.g. the JSON error)


# ---------------------------------------------------------------------------
# Resolving inputs


def format_of(name: str) -> str | None:
    lower = name.lower()
    for suffix, fmt in _FORMATS:
        if lower.endswith(suffix):
            return fmt
    return None


def _is_uri(item: str) -> bool:
    return "://" in item


def _has_glob(item: str) -> bool:
    return any(c in item for c in "*?[")


def _split_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as err:
        raise InputError(f"input {uri!r}: cannot open this filesystem URI ({err})") from err


def _uri_for(uri: str, path: str) -> str:
    """The URI of ``path`` on the filesystem of ``uri`` (same scheme, same query)."""
    scheme = uri.split("://", 1)[0]
    query = uri.split("?", 1)[1] if "?" in uri else ""
    return f"{scheme}://{path}" + (f"?{query}" if query else "")


def _check_parquet(source: Source) -> None:
    """Fail before anything starts when the text column is missing or not text."""
    with _open_random_access(source) as f:
        schema = pq.read_schema(f)
    if source.text_field not in schema.names:
        raise InputError(
            f"{source.uri}: parquet file has no column {source.text_field!r}; columns found: "
            f"{schema.names}. Pass the right one with --text-field."
        )
    kind = schema.field(source.text_field).type
    if kind not in _TEXT_TYPES:
        raise InputError(
            f"{source.uri}: column {source.text_field!r} has type {kind}, expected a string column"
        )


def _local_source(path: str, text_field: str) -> Source:
    fmt = format_of(path)
    if fmt is None:
        raise InputError(
            f"input {path!r}: unknown format; expected one of "
            f"{', '.join(s for s, _ in _FORMATS)} (or a folder of such files)"
        )
    try:
        with open(path, "rb"):
            pass
        stat = os.stat(path)
    except OSError as err:
        raise InputError(f"input {path!r} cannot be read: {err.strerror}") from err
    return Source(os.path.abspath(path), fmt, stat.st_size, text_field, stat.st_mtime_ns)


def _expand_local(item: str, text_field: str) -> list[Source]:
    if _has_glob(item):
        paths = sorted(p for p in globlib.glob(item, recursive=True) if os.path.isfile(p))
        sources = [_local_source(p, text_field) for p in paths if format_of(p)]
        if not sources:
            raise InputError(f"input glob {item!r} matches no readable corpus file")
        return sources
    if not os.path.exists(item):
        raise InputError(f"input {item!r} does not exist (checked {os.path.abspath(item)})")
    if os.path.isdir(item):
        paths = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(item)
            for name in names
            if format_of(name) and not name.startswith(".")
        )
        if not paths:
            raise InputError(f"input folder {item!r} holds no .txt/.jsonl(.gz/.zst)/.parquet files")
        return [_local_source(p, text_field) for p in paths]
    return [_local_source(item, text_field)]


def _expand_uri(item: str, text_field: str) -> list[Source]:
    base = item.split("?", 1)[0]
    if _has_glob(base):
        # Globs on remote filesystems: list the folder before the first wildcard, then
        # match the whole path (fnmatch: here a * may cross folder boundaries).
        from fnmatch import fnmatchcase

        fs, pattern = _split_uri(item)
        folder = pattern[: min(pattern.find(c) for c in "*?[" if c in pattern)].rsplit("/", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(folder or "/", recursive=True))
        infos = [i for i in infos if i.type == pafs.FileType.File and fnmatchcase(i.path, pattern)]
    else:
        fs, path = _split_uri(item)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"input {item!r} does not exist")
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            infos = [i for i in infos if i.type == pafs.FileType.File]
        else:
            if format_of(path) is None:
                raise InputError(f"input {item!r}: unknown format (see --help for the formats)")
            infos = [info]
    sources = []
    for info in sorted(infos, key=lambda i: i.path):  # one listing: size and mtime in it
        fmt = format_of(info.path)
        if fmt is None or info.base_name.startswith("."):
            continue
        uri = _uri_for(item, info.path)
        sources.append(Source(uri, fmt, info.size or 0, text_field, info.mtime_ns))
    if not sources:
        raise InputError(f"input {item!r} holds no .txt/.jsonl(.gz/.zst)/.parquet files")
    return sources


def _builtin_source(item: str, text_field: str) -> Source:
    if item == "builtin:python-docs":
        size = sum(len(d.encode("utf-8")) for d in python_docs())
        return Source(item, "builtin", size, text_field)
    if item == "builtin:zh-sample":
        stat = (CORPORA_DIR / "zh_sample.txt").stat()
        return Source(item, "txt", stat.st_size, text_field, stat.st_mtime_ns)
    raise InputError(f"unknown builtin corpus {item!r}; known: {', '.join(BUILTINS)}")


def resolve_inputs(inputs: list[str], text_field: str = "text") -> list[Source]:
    """Expand the inputs into sources, in order; every path is checked before returning.

    Raises ``InputError`` naming the first missing or unreadable input, so a job fails
    before any work starts. A file named twice is read once (first occurrence).
    """
    if not inputs:
        raise InputError("no inputs given: pass files, folders, globs, URIs or builtin:NAME")
    sources: list[Source] = []
    seen: set[str] = set()
    for item in inputs:
        item = str(item)
        if item.startswith("builtin:"):
            found = [_builtin_source(item, text_field)]
        elif _is_uri(item):
            found = _expand_uri(item, text_field)
        else:
            found = _expand_local(item, text_field)
        for source in found:
            if source.format == "parquet":
                _check_parquet(source)
            if source.uri not in seen:
                seen.add(source.uri)
                sources.append(source)
    return sources


# ---------------------------------------------------------------------------
# Opening


def _builtin_path(uri: str) -> str:
    if uri == "builtin:zh-sample":
        return str(CORPORA_DIR / "zh_sample.txt")
    raise InputError(f"{uri}: not a file-backed source")


def _open_random_access(source: Source):
    if _is_uri(source.uri):
        fs, path = _split_uri(source.uri)
        return fs.open_input_file(path)
    return pa.OSFile(source.uri, "rb")


class _Window(io.RawIOBase):
    """Bytes [start, end) of a seekable file, as a stream that ends at ``end``."""

    def __init__(self, f, start: int, end: int | None):
        self._f = f
        f.seek(start)
        self._left = None if end is None else end - start

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        want = len(b) if self._left is None else min(len(b), self._left)
        if want <= 0:
            return 0
        data = self._f.read(want)
        b[: len(data)] = data
        if self._left is not None:
            self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


class _Decompressed(io.RawIOBase):
    """A gzip/zstd stream that ends where the compressed data stops being readable (a
    truncated or corrupt file) instead of raising: every byte decompressed before the
    break is delivered, and ``error`` says what broke. The readers turn the break into
    one ``truncated`` reject, so the complete documents before it are kept."""

    def __init__(self, inner):
        self._inner = inner
        self.error: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.error is not None:
            return 0
        try:
            data = self._inner.read1(len(b))
        except (EOFError, OSError, zlib.error) as err:  # BadGzipFile is an OSError
            self.error = f"{type(err).__name__}: {err}"
            return 0
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._inner.close()
        super().close()


class _ZstdFrames:
    """The zstd frames of a raw stream, one after another, decompressed ``_ZSTD_IN`` bytes
    of input at a time (bounded memory); EOFError when the input ends inside a frame
    (zstandard's own stream reader ends silently there, so a cut file would look whole)."""

    def __init__(self, raw: BinaryIO):
        import zstandard

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._error = zstandard.ZstdError
        self._frame = None  # the frame being decompressed
        self._out = b""

    def read1(self, n: int) -> bytes:
        while not self._out:
            data = self._raw.read(_ZSTD_IN)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the zstd input ends inside a frame")
                return b""
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._new()
                try:
                    self._out += self._frame.decompress(data)
                except self._error as err:  # a corrupt frame
                    raise OSError(f"zstd: {err}") from None
                data = self._frame.unused_data if self._frame.eof else b""
        out, self._out = self._out[:n], self._out[n:]
        return out

    def close(self) -> None:
        self._raw.close()


def _read_error(stream) -> str | None:
    """Why a compressed stream ended early (None: it did not, or is not compressed)."""
    return getattr(getattr(stream, "raw", None), "error", None)


def _truncated(source: Source, ordinal: int, line: int | None, error: str) -> RawDocument:
    return RawDocument(
        source.uri, ordinal, None, "truncated", line, f"the compressed data breaks off: {error}"
    )


SPLITTABLE = ("txt", "jsonl")  # formats a task can read from a byte offset


class Digest:
    """sha256 of the stored bytes a reader went through, and their count: what the
    manifest records per slice (the driver never reads a source's bytes)."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.n_bytes = 0

    def update(self, data: bytes) -> None:
        self._sha.update(data)
        self.n_bytes += len(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class _Hashed(io.RawIOBase):
    """A raw stream that feeds every byte read through it to a ``Digest``, in file order;
    ``drain`` reads (and hashes) what the reader left, so the digest covers the stream."""

    def __init__(self, inner, digest: Digest):
        self._inner, self._digest = inner, digest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._inner.read(len(b))
        b[: len(data)] = data
        self._digest.update(data)
        return len(data)

    def drain(self) -> None:
        buf = bytearray(_CHUNK)
        while self.readinto(buf):
            pass

    def close(self) -> None:
        self._inner.close()
        super().close()


@contextmanager
def _open_text_stream(
    source: Source, start: int = 0, end: int | None = None, digest: Digest | None = None
) -> Iterator[BinaryIO]:
    """The decompressed byte stream of a txt/jsonl source (bytes [start, end) of an
    uncompressed one); supports readline(limit). With ``digest``: every stored byte of
    [start, end) goes through it once the block ends without an error (a compressed
    file's bytes as stored, also those after a break in the data)."""
    if start or end is not None:
        if source.format not in SPLITTABLE:
            raise ValueError(f"{source.uri}: a {source.format} source is read whole")
        f = _open_random_access(source) if _is_uri(source.uri) else open(source.uri, "rb")
        raw = _Window(f, start, end)
    elif _is_uri(source.uri):
        fs, path = _split_uri(source.uri)
        # compression=None: we decompress ourselves, the same way for every filesystem.
        raw = fs.open_input_stream(path, compression=None)
    else:
        local = _builtin_path(source.uri) if source.uri.startswith("builtin:") else source.uri
        raw = open(local, "rb", buffering=0)
    hashed = None
    if digest is not None:
        raw = hashed = _Hashed(raw, digest)
    stream = io.BufferedReader(raw, _CHUNK)  # type: ignore[arg-type]
    if source.format.endswith(".gz"):
        stream = io.BufferedReader(_Decompressed(gzip.GzipFile(fileobj=stream, mode="rb")), _CHUNK)
    elif source.format.endswith(".zst"):
        stream = io.BufferedReader(_Decompressed(_ZstdFrames(stream)), _CHUNK)
    with stream:
        yield stream
        if hashed is not None:
            hashed.drain()


def hash_range(source: Source, start: int, end: int | None, digest: Digest) -> None:
    """Feed bytes [start, end) of a stored source (end None: to its end) to ``digest``."""
    with _Hashed(_Window(_open_random_access(source), start, end), digest) as raw:
        raw.drain()


# ---------------------------------------------------------------------------
# Reading


def _bounded_lines(stream: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """Lines (with their newline) of at most ``limit`` bytes; None for a longer line.

    A longer line is consumed in chunks and never held whole.
    """
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := stream.readline(_CHUNK)) and not rest.endswith(b"\n"):
                pass
            yield None
        elif len(line) > limit:  # exactly limit+1 bytes ending in a newline: still too long
            yield None
        else:
            yield line


# What `plm data inspect` adds under an invalid_utf8 count: text in another encoding is
# rejected, never guessed at (a wrong guess would write wrong text into the shards).
ENCODING_HINT = (
    "text that is not UTF-8 is rejected, never guessed at: convert a Latin-1 file with "
    "`iconv -f latin1 -t utf-8 IN > OUT` (Windows-1252: -f cp1252), then prepare again"
)


def _decode(data: bytes) -> tuple[str | None, str | None, str | None]:
    """(text, reject, detail); an invalid_utf8 detail names the byte and what it is in
    Latin-1 (``ENCODING_HINT``)."""
    if b"\x00" in data:
        return None, "nul_bytes", f"NUL byte at offset {data.index(0)}"
    try:
        return data.decode("utf-8"), None, None
    except UnicodeDecodeError as err:
        byte = data[err.start]
        latin = chr(byte)  # what the byte is in Latin-1 (every byte is a character there)
        seen = f", {latin!r} in Latin-1" if latin.isprintable() else ""
        return None, "invalid_utf8", f"{err.reason} at byte {err.start} (0x{byte:02x}{seen})"


_BOM = b"\xef\xbb\xbf"


def _strip_bom(line: bytes, first: bool) -> bytes:
    return line[3:] if first and line.startswith(_BOM) else line


@lru_cache(maxsize=8)
def _blank_line_patterns(max_doc_bytes: int, at_end: bool) -> tuple[re.Pattern, re.Pattern]:
    """A blank line holds ASCII whitespace only (``bytes.strip``'s set) and, like every
    line, at most ``max_doc_bytes`` bytes with its newline (a longer one makes its
    document too long, whatever it holds). ``at_end``: the file's last line may lack the
    newline. Two patterns: one for a blank line at a given start, one that finds the
    newline before each blank line (a literal first: re jumps between newlines instead
    of trying a match at every byte, 6x faster than ``^`` in MULTILINE mode)."""
    blank = b"[ \\t\\r\\x0b\\x0c]{0,%d}\\n" % (max_doc_bytes - 1)
    if at_end:
        blank = b"(?:%s|[ \\t\\r\\x0b\\x0c]{0,%d}\\Z)" % (blank, max_doc_bytes)
    return re.compile(blank), re.compile(b"\\n(?=(%s))" % blank)


def _blank_lines(
    buf: bytes, start: int, end: int, max_doc_bytes: int, at_end: bool
) -> Iterator[tuple[int, int]]:
    """(start, end) of the blank lines of buf[start:end] (``start``: a line start)."""
    at_line_start, after_newline = _blank_line_patterns(max_doc_bytes, at_end)
    if start == 0 and (m := at_line_start.match(buf, 0, end)):
        yield m.span()
    for m in after_newline.finditer(buf, max(start - 1, 0), end):
        yield m.span(1)


def _iter_txt(
    source: Source,
    max_doc_bytes: int,
    part: Slice | None = None,
    digest: Digest | None = None,
    chunk_size: int = _CHUNK,
) -> Iterator[RawDocument]:
    """Documents of a txt source: runs of non-blank lines.

    Reads chunks and finds the blank lines of each with one regex, so the Python work is
    per document, not per line (2.8x less CPU than a loop over lines on 170 MB of
    python-docs). The unfinished document at a chunk's end is carried into the next;
    memory stays bounded: once it is over ``max_doc_bytes`` (or its last line alone is)
    it is reported ``too_long`` and the rest of its lines are only counted. A UTF-8 BOM
    at the start of the file is dropped before anything is measured.
    """
    ordinal = 0
    # buf: unprocessed bytes, from the start of a line (or a placeholder, below)
    scanned = 0  # buf[:scanned]: complete lines already searched, none of them blank
    line = 1  # the number of buf's first line
    skipping = False  # inside a too-long document already reported: drop to a blank line
    start, end = (part.start, part.end) if part else (0, None)
    with _open_text_stream(source, start, end, digest) as stream:
        chunk = stream.read(max(chunk_size, 3))
        buf = _strip_bom(chunk, start == 0)
        while True:
            at_end = not chunk
            # Complete lines only, except at the end of the file.
            end = len(buf) if at_end else buf.rfind(b"\n") + 1
            cursor = 0  # where the current document starts in buf
            for blank_start, blank_end in _blank_lines(buf, scanned, end, max_doc_bytes, at_end):
                if skipping:
                    skipping = False
                elif blank_start > cursor:
                    data = buf[cursor:blank_start]
                    yield _txt_document(source, ordinal, data, line, max_doc_bytes)
                    ordinal += 1
                line += buf.count(b"\n", cursor, blank_end)
                cursor = blank_end
            if at_end:
                if error := _read_error(stream):  # the rest, if any, is a cut document
                    yield _truncated(source, ordinal, line, error)
                elif cursor < len(buf) and not skipping:  # a last line without a newline
                    yield _txt_document(source, ordinal, buf[cursor:], line, max_doc_bytes)
                return
            # The unfinished document: complete lines buf[cursor:end], then a partial line.
            if not skipping and (end - cursor > max_doc_bytes or len(buf) - end > max_doc_bytes):
                yield _too_long(source, ordinal, line, max_doc_bytes)
                ordinal += 1
                skipping = True
            if skipping:  # drop the complete lines, counting them
                line += buf.count(b"\n", cursor, end)
                # An unfinished line over the limit cannot be blank: one byte stands for it.
                buf, cursor, end = (buf[end:] if len(buf) - end <= max_doc_bytes else b"x"), 0, 0
            buf, scanned = buf[cursor:], end - cursor
            chunk = stream.read(chunk_size)
            buf += chunk


def _too_long(source: Source, ordinal: int, line: int, max_doc_bytes: int) -> RawDocument:
    return RawDocument(source.uri, ordinal, None, "too_long", line, f"over {max_doc_bytes} bytes")


def _txt_document(
    source: Source, ordinal: int, data: bytes, line: int, max_doc_bytes: int
) -> RawDocument:
    if len(data) > max_doc_bytes:
        return _too_long(source, ordinal, line, max_doc_bytes)
    text, reject, detail = _decode(data)
    return RawDocument(source.uri, ordinal, text and text.strip(), reject, line, detail)


def _jsonl_line(source: Source, ordinal: int, number: int, line: bytes, field: str) -> RawDocument:
    """One jsonl line (not blank, at most max_doc_bytes) as a document or a reject."""
    text, reject, detail = _decode(line)
    if text is not None:
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            text, reject, detail = None, "bad_json", f"line {number}: {err.msg}"
        else:
            value = record.get(field) if isinstance(record, dict) else None
            if isinstance(value, str):
                text = value
                if "\x00" in text:  # an escaped \u0000 inside the JSON string
                    text, reject, detail = None, "nul_bytes", f"line {number}"
            else:
                text, reject = None, "no_text"
                detail = f"line {number}: no string field {field!r}"
    return RawDocument(source.uri, ordinal, text, reject, number, detail)


_JSONL_BATCH_BYTES = 1 << 20  # lines parsed by one pyarrow call (at least one line)
_JSONL_BATCH_LINES = 8192


def _jsonl_batch_texts(data: bytes, n_lines: int, field: str) -> list[str | None] | None:
    """The ``field`` of each of ``n_lines`` JSON lines (``data``: the lines, each ending in
    a newline but maybe the last, none blank), parsed by pyarrow in one call: a string, or
    None where the line's object lacks it or holds null. None when the batch must be
    parsed line by line: pyarrow refused a line (bad JSON, a field of another type, a
    top-level non-object, a key twice, a lone surrogate) or a line does not give exactly
    one row, or the bytes hold what json.loads and pyarrow could read differently
    (invalid UTF-8 anywhere in a line, a NUL byte, a BOM first). What json.loads accepts, pyarrow
    accepts the same way or refuses (tests/unit/test_prepare_speed_parts.py)."""
    import pyarrow.json as pajson

    if b"\x00" in data or not (data.isascii() or _valid_utf8(data)):
        return None
    if data.startswith(_BOM):  # pyarrow skips one there, json.loads refuses it
        return None
    try:
        table = pajson.read_json(
            io.BytesIO(data),
            read_options=pajson.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=pajson.ParseOptions(
                explicit_schema=pa.schema([(field, pa.string())]),
                unexpected_field_behavior="ignore",
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != n_lines:
        return None
    return table.column(0).to_pylist()


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _iter_jsonl(
    source: Source,
    max_doc_bytes: int,
    part: Slice | None = None,
    digest: Digest | None = None,
    batch_bytes: int = 0,
) -> Iterator[RawDocument]:
    """Documents of a jsonl source: lines are read one by one (bounded, see
    ``_bounded_lines``), the ordinary ones (not blank, not too long) parsed by pyarrow a
    batch of about ``batch_bytes`` at a time (``_jsonl_batch_texts``: 2-3x less CPU than
    json.loads per line), or line by line where a batch holds something pyarrow might
    read differently. The same documents and rejects either way."""
    batch_bytes = batch_bytes or _JSONL_BATCH_BYTES
    ordinal = 0
    field = source.text_field
    start, end = (part.start, part.end) if part else (0, None)
    number = 0
    lines: list[bytes] = []  # ordinary lines waiting for their batch
    numbers: list[int] = []
    size = 0

    def flush() -> Iterator[RawDocument]:
        nonlocal ordinal, size
        if not lines:
            return
        texts = _jsonl_batch_texts(b"".join(lines), len(lines), field)
        if texts is None:
            for line_number, line in zip(numbers, lines, strict=True):
                yield _jsonl_line(source, ordinal, line_number, line, field)
                ordinal += 1
        else:
            uri = source.uri
            for line_number, text in zip(numbers, texts, strict=True):
                if text is None:
                    detail = f"line {line_number}: no string field {field!r}"
                    yield RawDocument(uri, ordinal, None, "no_text", line_number, detail)
                elif "\x00" in text:  # an escaped \u0000 inside the JSON string
                    yield RawDocument(
                        uri, ordinal, None, "nul_bytes", line_number, f"line {line_number}"
                    )
                else:
                    yield RawDocument(uri, ordinal, text, None, line_number)
                ordinal += 1
        lines.clear()
        numbers.clear()
        size = 0

    with _open_text_stream(source, start, end, digest) as stream:
        for number, line in enumerate(_bounded_lines(stream, max_doc_bytes), start=1):
            if line is not None and not line.endswith(b"\n") and _read_error(stream):
                break  # the last line was cut by the break: the truncated reject below
            if line is None:
                yield from flush()
                yield RawDocument(
                    source.uri, ordinal, None, "too_long", number, f"over {max_doc_bytes} bytes"
                )
                ordinal += 1
                continue
            if number == 1 and start == 0:
                line = _strip_bom(line, True)
            if not line.strip():
                continue
            lines.append(line)
            numbers.append(number)
            size += len(line)
            if size >= batch_bytes or len(lines) >= _JSONL_BATCH_LINES:
                yield from flush()
        if lines:
            yield from flush()
        if error := _read_error(stream):
            yield _truncated(source, ordinal, number, error)


def _iter_parquet(
    source: Source, max_doc_bytes: int, part: Slice | None = None, digest: Digest | None = None
) -> Iterator[RawDocument]:
    # Memory is bounded by one batch of the text column (plus the row group the
    # parquet reader decodes it from), never by the file.
    ordinal = 0
    with _open_random_access(source) as f:
        reader = pq.ParquetFile(f)
        groups = list(part.row_groups) if part and part.row_groups is not None else None
        for batch in reader.iter_batches(
            batch_size=_PARQUET_BATCH_ROWS,
            row_groups=groups,
            columns=[source.text_field],
            use_threads=False,
        ):
            # As binary, so one undecodable value is one reject instead of an exception.
            column = batch.column(0).cast(pa.large_binary())
            for value in column.to_pylist():
                if value is None:
                    doc = RawDocument(source.uri, ordinal, None, "no_text", None, "null value")
                elif len(value) > max_doc_bytes:
                    doc = RawDocument(
                        source.uri, ordinal, None, "too_long", None, f"over {max_doc_bytes} bytes"
                    )
                else:
                    text, reject, detail = _decode(value)
                    doc = RawDocument(source.uri, ordinal, text, reject, None, detail)
                yield doc
                ordinal += 1
    if digest is not None:  # a second read of the slice's bytes: parquet reads by column
        hash_range(source, part.start if part else 0, part.end if part else None, digest)


def _iter_builtin(
    source: Source, max_doc_bytes: int, part: Slice | None = None, digest: Digest | None = None
) -> Iterator[RawDocument]:
    docs = python_docs()
    yield from (RawDocument(source.uri, ordinal, text) for ordinal, text in enumerate(docs))
    if digest is not None:
        hash_docs(docs, digest)


def hash_docs(docs: tuple[str, ...], digest: Digest) -> None:
    """A builtin corpus's digest: its documents in UTF-8, each followed by a NUL."""
    for text in docs:
        digest.update(text.encode("utf-8") + b"\x00")


_READERS = {
    "txt": _iter_txt,
    "txt.gz": _iter_txt,
    "txt.zst": _iter_txt,
    "jsonl": _iter_jsonl,
    "jsonl.gz": _iter_jsonl,
    "jsonl.zst": _iter_jsonl,
    "parquet": _iter_parquet,
    "builtin": _iter_builtin,
}


def iter_raw_documents(
    source: Source,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    part: Slice | None = None,
    digest: Digest | None = None,
) -> Iterator[RawDocument]:
    """The documents of one source (or of a ``Slice`` of it), in file order, rejects
    included (with a reason). Ordinals and line numbers count from the slice's start.
    With ``digest``: once the documents are exhausted, it holds the sha256 of the stored
    bytes [start, end) of the slice (of the whole source without one)."""
    if max_doc_bytes <= 0:
        raise ValueError(f"max_doc_bytes must be positive, got {max_doc_bytes}")
    try:
        yield from _READERS[source.format](source, max_doc_bytes, part, digest)
    except (OSError, EOFError, pa.ArrowException) as err:
        # A truncated gzip, a corrupt zstd frame or parquet footer: name the file.
        raise InputError(f"{source.uri}: cannot read ({type(err).__name__}: {err})") from err


def texts_at(
    uri: str,
    ordinals: list[int],
    *,
    start: int = 0,
    row_groups: list[int] | None = None,
    text_field: str = "text",
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    size: int | None = None,
    mtime_ns: int | None = None,
    max_ordinal: int = 100_000,
) -> dict[int, str]:
    """{ordinal: raw text} of the documents at ``ordinals`` of a local file or builtin
    corpus, counted as a reject example counts them (from byte ``start``, or in the
    parquet ``row_groups``): what `plm data inspect` shows of a reject whose text the
    manifest does not hold. Nothing for a remote source, one that is gone, or a file that
    is no longer the one prepared (another ``size`` or ``mtime_ns``), nor for documents
    without text (read rejects) or past ``max_ordinal`` (the read stays short)."""
    wanted = {o for o in ordinals if 0 <= o <= max_ordinal}
    if not wanted or _is_uri(uri):
        return {}
    try:
        source = resolve_inputs([uri], text_field)[0]
    except InputError:
        return {}
    if (size is not None and source.size != size) or (
        mtime_ns is not None and source.mtime_ns is not None and source.mtime_ns != mtime_ns
    ):
        return {}
    part = None
    if row_groups is not None:
        part = Slice(0, row_groups=tuple(row_groups))
    elif start:
        if source.format not in SPLITTABLE:
            return {}
        part = Slice(0, start=start)
    out: dict[int, str] = {}
    last = max(wanted)
    docs = iter_raw_documents(source, max_doc_bytes, part)
    try:
        for doc in docs:
            if doc.ordinal in wanted and doc.text is not None:
                out[doc.ordinal] = doc.text
            if doc.ordinal >= last:
                break
    except (InputError, ValueError):
        pass
    finally:
        docs.close()  # the file, now
    return out


# ---------------------------------------------------------------------------
# builtin:python-docs — real English text every CPython 3.11 ships

# Pure-Python stdlib modules and packages present in every CPython 3.11 install (no
# optional C extension, nothing distributions split off such as tkinter, idlelib,
# lib2to3, distutils or the test suite). Their docstrings are read with `ast`, so
# nothing is imported and nothing depends on the platform.
_DOC_MODULES = (
    "abc argparse ast asyncio base64 bdb bisect calendar cmd code codecs codeop collections "
    "colorsys compileall concurrent configparser contextlib copy copyreg csv dataclasses "
    "datetime difflib dis doctest email enum filecmp fileinput fnmatch fractions ftplib "
    "functools genericpath getopt gettext glob graphlib gzip hashlib heapq hmac html http "
    "imaplib importlib inspect io ipaddress json keyword linecache locale logging mailbox "
    "mimetypes modulefinder multiprocessing netrc numbers opcode operator optparse os "
    "pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath pprint "
    "profile pstats py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter "
    "runpy sched secrets selectors shelve shlex shutil site smtplib socket socketserver "
    "statistics string stringprep subprocess symtable sysconfig tabnanny tarfile tempfile "
    "textwrap threading timeit token tokenize tomllib trace traceback tracemalloc types "
    "typing unittest urllib uuid warnings wave weakref wsgiref xml xmlrpc zipapp zipfile "
    "zipimport zoneinfo"
).split()
# Built into every interpreter; their docstrings come from the objects.
_BUILTIN_MODULES = ("builtins", "gc", "itertools", "marshal", "math", "sys", "time")
_SKIP_DIRS = {"test", "tests", "__pycache__", "idle_test"}


def _module_files(stdlib: Path, name: str) -> list[Path]:
    single = stdlib / f"{name}.py"
    if single.is_file():
        return [single]
    package = stdlib / name
    files = [
        p
        for p in package.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(package).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _docs_of_source(data: bytes) -> list[str]:
    """Module docstring, each top-level function's, each class's with its methods'.

    A file Python cannot parse gives none: the standard library's own tests hold such
    files on purpose (test/bad_coding.py declares the encoding "uft-8")."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):  # ValueError: NUL bytes in the source
        return []
    docs = [ast.get_docstring(tree) or ""]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            docs.append(ast.get_docstring(node) or "")
        elif isinstance(node, ast.ClassDef):
            parts = [ast.get_docstring(node) or ""]
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    parts.append(ast.get_docstring(member) or "")
            docs.append("\n\n".join(p for p in parts if p))
    return docs


def _docs_of_builtin(name: str) -> list[str]:
    module = importlib.import_module(name)
    docs = [inspect.getdoc(module) or ""]
    for attr, value in sorted(vars(module).items()):
        if attr.startswith("_") or not callable(value):
            continue
        # Libraries replace some of these at run time (Ray sets sys.excepthook); sys keeps the
        # originals as __excepthook__ etc. Anything else not defined by the module is skipped,
        # so the corpus never depends on what the process has imported.
        value = getattr(module, f"__{attr}__", value)
        if getattr(value, "__module__", name) not in (name, None):
            continue
        parts = [inspect.cleandoc(value.__doc__) if isinstance(value.__doc__, str) else ""]
        if inspect.isclass(value):
            for member_name, member in sorted(vars(value).items()):
                doc = getattr(member, "__doc__", None)
                if not member_name.startswith("_") and callable(member) and isinstance(doc, str):
                    parts.append(inspect.cleandoc(doc))
        docs.append("\n\n".join(p for p in parts if p))
    return docs


@lru_cache(maxsize=1)
def python_docs() -> tuple[str, ...]:
    """The documents of ``builtin:python-docs``, in a fixed order (about 2 MB of English).

    pydoc_data.topics (the language reference topics) first, then docstrings of the
    builtin modules, then those of the pure-Python modules, modules sorted by name.
    """
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    for name in _BUILTIN_MODULES:
        docs.extend(_docs_of_builtin(name))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in sorted(_DOC_MODULES):
        for path in _module_files(stdlib, name):
            docs.extend(_docs_of_source(path.read_bytes()))
    return tuple(d.strip() for d in docs if d and d.strip())


# ---------------------------------------------------------------------------
# Cutting sources into slices (the driver's plan; a few small reads per cut)

_JSONL_CUT = re.compile(rb"\n")
_TXT_CUT = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")  # a blank line: its end starts a document
_CUT_WINDOW = 1 << 16


def find_cut(source: Source, at: int, limit: int) -> int | None:
    """The first document boundary in bytes [at, at + limit) of an uncompressed txt/jsonl
    source; None when there is none there.

    jsonl: the start of a line. txt: the end of a blank line (documents are runs of
    non-blank lines, so the next non-blank line starts a document).
    """
    pattern = _JSONL_CUT if source.format == "jsonl" else _TXT_CUT
    pos = max(at - 1, 0)  # a newline at at-1 makes ``at`` itself a line start
    carry = b""
    f = _open_random_access(source) if _is_uri(source.uri) else open(source.uri, "rb")
    with f:
        f.seek(pos)
        while pos < at + limit:
            data = f.read(_CUT_WINDOW)
            if not data:
                return None
            buf = carry + data
            base = pos - len(carry)
            for m in pattern.finditer(buf):
                cut = base + m.end()
                if cut >= at:
                    return cut if cut < min(source.size, at + limit) else None
            pos += len(data)
            last = buf.rfind(b"\n")
            carry = buf[last:] if last >= 0 and len(buf) - last < _CUT_WINDOW else b""
    return None


def plan_slices(sources: list[Source], split_bytes: int) -> list[Slice]:
    """Every source cut into slices of about ``split_bytes``: byte ranges of uncompressed
    txt/jsonl (cut on document boundaries), runs of parquet row groups; compressed and
    builtin sources whole. Depends on the sources and ``split_bytes`` only."""
    out: list[Slice] = []
    for i, source in enumerate(sources):
        if source.format in SPLITTABLE and source.size > split_bytes:
            start, at = 0, split_bytes
            while at < source.size:
                cut = find_cut(source, at, split_bytes)
                if cut is None:  # one document longer than split_bytes: look further
                    at += split_bytes
                    continue
                out.append(Slice(i, start, cut, size=cut - start))
                start, at = cut, cut + split_bytes
            out.append(Slice(i, start, None, size=source.size - start))
        elif source.format == "parquet" and source.size > split_bytes:
            out.extend(_parquet_slices(i, source, split_bytes))
        else:
            out.append(Slice(i, size=source.size))
    return out


def _row_group_start(meta, g: int) -> int:
    """The first byte of row group ``g``: its lowest page offset."""
    group = meta.row_group(g)
    offsets = []
    for c in range(group.num_columns):
        column = group.column(c)
        offsets.append(column.data_page_offset)
        if column.has_dictionary_page and column.dictionary_page_offset:
            offsets.append(column.dictionary_page_offset)
    return min(offsets)


def _parquet_slices(i: int, source: Source, split_bytes: int) -> list[Slice]:
    """Runs of row groups of about ``split_bytes``; their byte ranges tile the file (the
    first from byte 0, the last to the end), for the digests."""
    with _open_random_access(source) as f:
        meta = pq.ParquetFile(f).metadata
    sizes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
    if not sizes:
        return [Slice(i, size=source.size)]
    share = source.size / max(sum(sizes), 1)
    runs: list[tuple[list[int], int]] = []
    group: list[int] = []
    size = 0
    for g, n in enumerate(sizes):
        group.append(g)
        size += n
        if size >= split_bytes or g == len(sizes) - 1:
            runs.append((group, round(size * share)))
            group, size = [], 0
    starts = [0]
    for run, _ in runs[1:]:  # increasing, whatever order a writer put the groups in
        starts.append(max(starts[-1], _row_group_start(meta, run[0])))
    ends: list[int | None] = [*starts[1:], None]
    return [
        Slice(i, start, end, row_groups=tuple(run), size=size)
        for (run, size), start, end in zip(runs, starts, ends, strict=True)
    ]
