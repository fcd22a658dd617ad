"""The shard contract (format v3): WebDataset tar shards of *blocks* of documents.

A data directory (see docs/design.md, "Shards", and docs/shard-format.md) holds::

    manifest.json                     written last, atomically
    tokenizer/tokenizer.json          the tokenizer the ids come from (+ tokenizer_meta.json)
    train/shard-000000.tar            block samples, deterministic bytes
    train/shard-000000.idx.npy        int64 rows, one per block (see INDEX COLUMNS below)
    valid/shard-000000.tar ...

One tar sample is a block of consecutive documents of one split, so a tar header
(512 bytes) is paid per block member, not per document. Members, in name order:

    KEY.docs.npy     uint32 [n_docs]      end offset of each document in tokens.npy
    KEY.langs.npy    uint8  [n_docs]      language of each document (code into meta.json)
    KEY.meta.json    {"languages": [...], "sources": [...]}   the codes' values
    KEY.sents.npy    uint32 [n_sents]     end offsets of sentences (each document end is one)
    KEY.spans.npy    uint32 [n_spans, 2]  [start, end) entity spans (only with --entities)
    KEY.srcs.npy     uint16 [n_docs]      source of each document (code into meta.json)
    KEY.tokens.npy   uint16|uint32 [n_tokens]  the documents' token ids, concatenated
    KEY.words.npy    uint8  [ceil(n_tokens / 8)]  word-start flags, one bit per token
                                          (np.packbits, little bit order)

Offsets are into the block's tokens. Per-document facts are recovered by slicing
(``Document``), so the stream, objectives and inspect see documents as before.

Integrity: the manifest holds the sha256 of every shard and index (``verify`` re-hashes
everything); the index holds a crc32 of every block's sample bytes, checked the first
time a process reads from that block, so a corrupt byte never reaches a batch and
training start-up does not read the data, only the (small) indexes.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import mmap
import os
import tarfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.data.shard_index import (
    CRC,
    DOCS_AT,
    INDEX_COLUMNS,
    LANGS_AT,
    META_AT,
    META_SIZE,
    N_DOCS,
    N_SENTS,
    N_SPANS,
    N_TOKENS,
    OFFSET,
    SENTS_AT,
    SIZE,
    SPANS_AT,
    SRCS_AT,
    TOKEN_BYTES,
    TOKENS_AT,
    WORDS_AT,
    ShardError,
)
from pipeline.storage import atomic_write, is_plain_name, is_uri

if TYPE_CHECKING:
    from pipeline.data.remote import CacheConfig

FORMAT_VERSION = 3
SPLITS = ("train", "valid")
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
INDEX_SUFFIX = ".idx.npy"
_TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_U32 = np.dtype("<u4")
_U16 = np.dtype("<u2")
MAX_OPEN_SHARDS = 64  # memory maps a DataDir keeps open per process
MAX_OPEN_BLOCKS = 128  # a remote DataDir's blocks kept mapped (or in memory) per process
MAX_BLOCK_SOURCES = 1 << 16  # srcs.npy is uint16: a block ends before a 65537th source
_BLOCK_CACHE = 16  # decoded block tables kept per DataDir


@functools.cache
def _tariterators():
    """webdataset's tar iterators, imported on first use (``import webdataset`` imports
    torch: the prepare workers never pay for it)."""
    from webdataset import tariterators

    return tariterators


@dataclass
class Document:
    """One document (or a piece of a long one), tokenized: what objectives consume."""

    key: str
    tokens: np.ndarray  # token ids, no special tokens; uint16 or uint32
    sents: np.ndarray  # int32 end offsets (exclusive) of sentences into tokens
    words: np.ndarray  # int32 start offsets of words into tokens
    meta: dict[str, Any] = field(default_factory=dict)  # source, language, n_tokens
    spans: np.ndarray | None = None  # int32 (n, 2) [start, end) phrase/entity spans

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_name(split: str, number: int) -> str:
    return f"{split}/shard-{number:06d}.tar"


def index_name(shard: str) -> str:
    return shard[: -len(".tar")] + INDEX_SUFFIX


def brace_pattern(split: str, n_shards: int) -> str:
    """``train/shard-{000000..000003}.tar``: the form webdataset and brace expansion take."""
    if n_shards == 1:
        return shard_name(split, 0)
    return f"{split}/shard-{{000000..{n_shards - 1:06d}}}.tar"


def split_of(text: str, valid_fraction: float) -> str:
    """Train or valid, from a hash of the document text: stable across reruns and shard sizes."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "valid" if int.from_bytes(digest[:8], "big") / 2**64 < valid_fraction else "train"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


# ---------------------------------------------------------------------------
# Tar members, byte for byte what webdataset's TarWriter (tarfile, pax format) writes
# for a member with mtime 0, mode 0o644, uid/gid 0 and empty owner names.

_ZERO_BLOCK = tarfile.NUL * tarfile.BLOCKSIZE
_USTAR_MAX_SIZE = 8**11  # 11 octal digits; larger sizes need a pax header


def _tarfile_header(name: str, size: int, fmt: int = tarfile.DEFAULT_FORMAT) -> bytes:
    """The header tarfile writes (the reference ``_ustar_header`` is tested against)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o644, "", ""
    return info.tobuf(fmt, tarfile.ENCODING, "surrogateescape")


# The fixed fields of that ustar header, cut from one tarfile made. Layout
# (tarfile.TarInfo._create_header): name 0:100, mode/uid/gid 100:124, size 124:136,
# mtime 136:148, checksum 148:156, the rest 156:512.
_PROBE = _tarfile_header("probe", 0, tarfile.USTAR_FORMAT)
_UIDS_MODE, _MTIME, _TAIL = _PROBE[100:124], _PROBE[136:148], _PROBE[156:]
_FIXED_SUM = sum(_UIDS_MODE) + sum(_MTIME) + sum(_TAIL) + 8 * ord(" ")


def _ustar_header(name: bytes, size: int) -> bytes:
    """The ustar header of a member named ``name`` (ASCII, <= 100 bytes) of ``size`` bytes."""
    size_field = b"%011o\0" % size
    checksum = _FIXED_SUM + sum(name) + sum(size_field)
    return b"".join(
        (
            name,
            tarfile.NUL * (tarfile.LENGTH_NAME - len(name)),
            _UIDS_MODE,
            size_field,
            _MTIME,
            b"%06o\0 " % checksum,
            _TAIL,
        )
    )


def _tar_header(name: str, size: int) -> bytes:
    if name.isascii() and len(name) <= tarfile.LENGTH_NAME and 0 <= size < _USTAR_MAX_SIZE:
        return _ustar_header(name.encode("ascii"), size)
    return _tarfile_header(name, size)


def _tar_end(offset: int) -> bytes:
    """What tarfile.close() appends to an archive of ``offset`` bytes: two zero blocks,
    then zeros to a whole record."""
    end = offset + 2 * tarfile.BLOCKSIZE
    return tarfile.NUL * (2 * tarfile.BLOCKSIZE + (-end % tarfile.RECORDSIZE))


def block_sample(key: str, members: dict[str, bytes]) -> tuple[bytes, dict[str, int]]:
    """The tar bytes of one sample (members sorted by name, as TarWriter writes them) and
    the byte offset of each member's data from the sample's start."""
    if "." in key:
        raise ValueError(f"block key {key!r} must not contain dots")
    parts, at, pos = [], {}, 0
    for name in sorted(members):
        data = members[name]
        parts.append(_tar_header(f"{key}.{name}", len(data)))
        parts.append(data)
        pad = -len(data) % tarfile.BLOCKSIZE
        parts.append(_ZERO_BLOCK[:pad])
        pos += tarfile.BLOCKSIZE
        at[name] = pos
        pos += len(data) + pad
    return b"".join(parts), at


def _npy(array: np.ndarray) -> tuple[bytes, int]:
    """(the .npy bytes, the offset of the array data in them)."""
    data = _npy_bytes(np.ascontiguousarray(array))
    return data, len(data) - array.nbytes


# ---------------------------------------------------------------------------
# Writing


class Block:
    """The documents of one block being assembled (see the module docstring). spans.npy
    is written when ``with_spans`` or when any document came with spans."""

    def __init__(self, dtype: np.dtype, with_spans: bool):
        self.dtype, self.with_spans = dtype, with_spans
        self.tokens: list[np.ndarray] = []
        self.sents: list[np.ndarray] = []
        self.words: list[np.ndarray] = []
        self.spans: list[np.ndarray] = []
        self.doc_ends: list[int] = []
        self.srcs: list[int] = []
        self.langs: list[int] = []
        self.sources: dict[str, int] = {}
        self.languages: dict[str, int] = {}
        self.n_tokens = 0

    def add(
        self,
        tokens: np.ndarray,
        sents: np.ndarray,
        words: np.ndarray,
        spans: np.ndarray | None,
        source: str,
        language: str,
    ) -> None:
        n = int(tokens.shape[0])
        flags = np.zeros(n, dtype=bool)
        flags[np.asarray(words, dtype=np.int64)] = True
        self.add_many(tokens, np.array([n]), sents, flags, spans, [source], [language])

    def add_many(
        self,
        tokens: np.ndarray,
        ends: np.ndarray,
        sents: np.ndarray,
        words: np.ndarray,
        spans: np.ndarray | None,
        sources: list[str],
        languages: list[str],
    ) -> None:
        """Several documents at once, the same block as ``add`` one by one: ``ends`` their
        end offsets into ``tokens``, ``sents`` sentence ends and ``spans`` in the same
        offsets, ``words`` a word-start flag per token; ``sources`` and ``languages`` one
        name per document (a batch of pieces, see ``segment.PieceBatch``)."""
        at = self.n_tokens
        self.tokens.append(np.asarray(tokens, dtype=self.dtype))
        self.sents.append(np.asarray(sents, dtype=np.int64) + at)
        self.words.append(np.asarray(words, dtype=bool))
        if spans is not None:
            self.with_spans = True
            self.spans.append(np.asarray(spans, dtype=np.int64).reshape(-1, 2) + at)
        self.n_tokens += int(tokens.shape[0])
        self.doc_ends.extend((np.asarray(ends, dtype=np.int64) + at).tolist())
        codes = self.sources
        self.srcs.extend([codes.setdefault(name, len(codes)) for name in sources])
        codes = self.languages
        self.langs.extend([codes.setdefault(name, len(codes)) for name in languages])

    @property
    def n_docs(self) -> int:
        return len(self.doc_ends)

    def full_of_sources(self) -> bool:
        return len(self.sources) >= MAX_BLOCK_SOURCES

    def encode(self, key: str) -> tuple[bytes, list[int]]:
        """(the sample's bytes, its index row)."""
        if self.n_tokens >= 1 << 32:
            raise ValueError("a block holds at most 2**32 - 1 tokens")
        cat = np.concatenate
        tokens = cat(self.tokens) if self.tokens else np.zeros(0, self.dtype)
        arrays = {
            "docs.npy": np.asarray(self.doc_ends, dtype=_U32),
            "langs.npy": np.asarray(self.langs, dtype=np.uint8),
            "sents.npy": (cat(self.sents) if self.sents else np.zeros(0)).astype(_U32),
            "srcs.npy": np.asarray(self.srcs, dtype=_U16),
            "tokens.npy": tokens.astype(tokens.dtype.newbyteorder("<"), copy=False),
            "words.npy": np.packbits(
                cat(self.words) if self.words else np.zeros(0, bool), bitorder="little"
            ),
        }
        if self.with_spans:
            spans = cat(self.spans) if self.spans else np.zeros((0, 2), dtype=np.int64)
            arrays["spans.npy"] = spans.astype(_U32)
        members, data_at = {}, {}
        for name, array in arrays.items():
            members[name], data_at[name] = _npy(array)
        meta = {"languages": list(self.languages), "sources": list(self.sources)}
        members["meta.json"] = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode()
        data, at = block_sample(key, members)
        row = [0] * INDEX_COLUMNS
        row[SIZE], row[CRC] = len(data), zlib.crc32(data)
        row[N_DOCS], row[N_TOKENS], row[TOKEN_BYTES] = self.n_docs, self.n_tokens, tokens.itemsize
        row[META_AT], row[META_SIZE] = at["meta.json"], len(members["meta.json"])
        for name, col in (
            ("docs.npy", DOCS_AT),
            ("langs.npy", LANGS_AT),
            ("sents.npy", SENTS_AT),
            ("srcs.npy", SRCS_AT),
            ("tokens.npy", TOKENS_AT),
            ("words.npy", WORDS_AT),
        ):
            row[col] = at[name] + data_at[name]
        row[N_SENTS] = int(arrays["sents.npy"].shape[0])
        if self.with_spans:
            row[SPANS_AT] = at["spans.npy"] + data_at["spans.npy"]
            row[N_SPANS] = int(arrays["spans.npy"].shape[0])
        else:
            row[SPANS_AT] = -1
        return data, row


class ShardWriter:
    """Writes one shard (blocks of at most ``block_tokens`` tokens) and its index, to any
    pyarrow filesystem. Both appear under their final names only on close()."""

    def __init__(
        self,
        fs,
        root: str,
        name: str,
        key_prefix: str,
        dtype: np.dtype,
        block_tokens: int,
        with_spans: bool,
    ):
        self.fs, self.root, self.name = fs, root.rstrip("/"), name
        self.key_prefix, self.dtype = key_prefix, np.dtype(dtype)
        self.block_tokens, self.with_spans = block_tokens, with_spans
        self.path = f"{self.root}/{name}"
        self._file = fs.open_output_stream(self.path + ".tmp")
        self._sha = hashlib.sha256()
        self._rows: list[list[int]] = []
        self._block = Block(self.dtype, with_spans)
        self.offset = self.n_docs = self.n_tokens = 0

    def add(self, tokens, sents, words, spans, source: str, language: str) -> None:
        self._block.add(tokens, sents, words, spans, source, language)
        self.n_docs += 1
        self.n_tokens += int(tokens.shape[0])
        if self._block.n_tokens >= self.block_tokens or self._block.full_of_sources():
            self._flush()

    def add_many(
        self,
        pieces,
        sources: list[str],
        languages: list[str],
        stop_docs: int | None = None,
        stop_bytes: int | None = None,
        first: int = 0,
    ) -> tuple[int, bool]:
        """Documents ``first``.. of ``pieces`` (a ``segment.PieceBatch``: ``tokens``,
        ``ends``, ``sents``, ``words``, ``spans``; ``sources``/``languages`` one name per
        document) in bulk, the same shard bytes as ``add`` one by one: blocks end after the
        document that fills them. Stops after the first document at which the shard holds
        ``stop_docs`` documents or ``size_estimate()`` reaches ``stop_bytes`` (where a
        caller that adds one by one closes the shard). Returns (the next document,
        whether it stopped there)."""
        ends = pieces.ends
        n = int(ends.shape[0])
        starts = np.zeros(n, dtype=np.int64)
        starts[1:] = ends[:-1]
        itemsize = self.dtype.itemsize
        i = first
        while i < n:
            block = self._block
            if len(block.sources) + len(set(sources[i:])) >= MAX_BLOCK_SOURCES:
                return self._add_each(pieces, starts, sources, languages, i, stop_docs, stop_bytes)
            filled = block.n_tokens + (ends[i:] - starts[i])  # the block's tokens after each
            full = int(np.searchsorted(filled, self.block_tokens, side="left"))
            stop = n - i  # the first document after which the shard is closed, unless flushed
            if stop_docs:
                stop = min(stop, stop_docs - self.n_docs - 1)
            if stop_bytes:
                stop = min(stop, int(np.searchsorted(self.offset + filled * itemsize, stop_bytes)))
            last = min(stop, full, n - i - 1)  # the last document added now
            j = i + last + 1
            a, b = int(starts[i]), int(ends[j - 1])
            sents, spans = _between(pieces, a, b)
            self._block.add_many(pieces.tokens[a:b], ends[i:j] - a, sents, pieces.words[a:b],
                                 spans, sources[i:j], languages[i:j])  # fmt: skip
            self.n_docs += j - i
            self.n_tokens += b - a
            if last == full:  # the block is full: flush, then the shard's checks
                self._flush()
                if (stop_docs and self.n_docs >= stop_docs) or (
                    stop_bytes and self.size_estimate() >= stop_bytes
                ):
                    return j, True
            elif last == stop:
                return j, True
            i = j
        return n, False

    def _add_each(self, pieces, starts, sources, languages, i, stop_docs, stop_bytes):
        """``add_many`` one document at a time (a block near MAX_BLOCK_SOURCES sources)."""
        n = int(pieces.ends.shape[0])
        while i < n:
            a, b = int(starts[i]), int(pieces.ends[i])
            sents, spans = _between(pieces, a, b)
            words = np.flatnonzero(pieces.words[a:b])
            self.add(pieces.tokens[a:b], sents, words, spans, sources[i], languages[i])
            i += 1
            if (stop_docs and self.n_docs >= stop_docs) or (
                stop_bytes and self.size_estimate() >= stop_bytes
            ):
                return i, True
        return n, False

    @classmethod
    def local(
        cls,
        root: str | Path,
        name: str,
        dtype,
        block_tokens: int = 1 << 19,
        with_spans: bool = False,
        key_prefix: str | None = None,
    ) -> ShardWriter:
        """A writer to a local data dir (tests, benchmarks, tools)."""
        path = Path(root) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = key_prefix or name.replace("/", "-").replace(".", "-")
        return cls(local_fs(), str(Path(root).resolve()), name, prefix, dtype,
                   block_tokens, with_spans)  # fmt: skip

    def write(self, doc: Document) -> None:
        """Add one Document (source and language from its meta)."""
        self.add(doc.tokens, doc.sents, doc.words, doc.spans,
                 str(doc.meta.get("source", "")), str(doc.meta.get("language", "other")))  # fmt: skip

    def size_estimate(self) -> int:
        """Bytes written plus the tokens of the block being assembled."""
        return self.offset + self._block.n_tokens * self.dtype.itemsize

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._sha.update(data)
        self.offset += len(data)

    def _flush(self) -> None:
        if not self._block.n_docs:
            return
        data, row = self._block.encode(f"{self.key_prefix}-{len(self._rows):05d}")
        row[OFFSET] = self.offset
        self._rows.append(row)
        self._write(data)
        self._block = Block(self.dtype, self.with_spans)

    def close(self) -> dict[str, Any]:
        """End the tar, move it into place, write the index; return the manifest entry."""
        self._flush()
        self._write(_tar_end(self.offset))
        self._file.close()
        self.fs.move(self.path + ".tmp", self.path)
        index = np.asarray(self._rows, dtype=np.int64).reshape(-1, INDEX_COLUMNS)
        index_bytes = _npy_bytes(index)
        index_path = f"{self.root}/{index_name(self.name)}"
        with self.fs.open_output_stream(index_path + ".tmp") as f:
            f.write(index_bytes)
        self.fs.move(index_path + ".tmp", index_path)
        return {
            "name": self.name,
            "index": index_name(self.name),
            "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
            "n_blocks": len(self._rows),
            "n_docs": self.n_docs,
            "n_tokens": self.n_tokens,
            "bytes": self.offset,
            "sha256": self._sha.hexdigest(),
        }


def _between(pieces, a: int, b: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The sentence ends in (a, b] and the spans starting in [a, b) of ``pieces``,
    relative to ``a``."""
    s0, s1 = np.searchsorted(pieces.sents, [a, b], side="right")
    spans = None
    if pieces.spans is not None:
        p0, p1 = np.searchsorted(pieces.spans[:, 0], [a, b], side="left")
        spans = pieces.spans[p0:p1] - a
    return pieces.sents[s0:s1] - a, spans


def local_fs():
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def write_manifest(root: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write(Path(root) / MANIFEST, manifest_bytes(manifest))


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _check_names(path: str | Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest names must stay inside the data dir: plain relative names
    (``is_plain_name``), never '..', an absolute path or another store's URI. Every reader
    (training, the mixture, inspect and verify, eval) opens a data dir through here."""
    splits = manifest.get("splits", {})
    tok = manifest.get("tokenizer", {})
    if not isinstance(splits, dict) or not isinstance(tok, dict):
        raise ShardError(f"{path}: splits or tokenizer is not a mapping; re-run `plm data prepare`")
    names = [tok.get("path", TOKENIZER_DIR)]
    for split, info in splits.items():
        if split not in SPLITS:
            raise ShardError(f"{path}: unknown split {split!r}; re-run `plm data prepare`")
        entries = info.get("shards", []) if isinstance(info, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ShardError(f"{path}: split {split!r} lists no shards; re-run `plm data prepare`")
        for entry in entries:
            names += [entry.get("name", ""), entry.get("index", "")]
    for name in names:
        if not is_plain_name(name):
            raise ShardError(
                f"{path}: names {name!r}, which is not a path inside the data dir; "
                "this manifest was not written by `plm data prepare`: re-run it"
            )


def load_manifest(root: str | Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{path} does not exist: {root} is not a finished data directory "
            "(run `plm data prepare` to create or complete it)"
        )
    return parse_manifest(path.read_bytes(), str(path))


def parse_manifest(data: bytes, path: str) -> dict[str, Any]:
    """The manifest from its bytes, checked (format version, names inside the data dir)."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError included
        raise ShardError(f"{path} is not valid JSON ({err}); re-run `plm data prepare`") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ShardError(
            f"{path}: shard format v{version}, this code reads v{FORMAT_VERSION} (block "
            "shards); re-run `plm data prepare --force` on the same inputs to convert it"
        )
    _check_names(path, manifest)
    return manifest


# ---------------------------------------------------------------------------
# Reading


@dataclass
class _BlockTable:
    """What a read needs of a block besides its tokens (small copies, cached)."""

    key: str
    doc_ends: np.ndarray  # int64, with a leading 0
    sents: np.ndarray  # int64 sentence ends
    words: np.ndarray  # bool, one per token
    srcs: np.ndarray
    langs: np.ndarray
    sources: list[str]
    languages: list[str]
    spans: np.ndarray | None  # int64 (n, 2)


@dataclass
class BlockArrays:
    """One block's contents as arrays (what ``Block.add_many`` takes back)."""

    tokens: np.ndarray
    ends: np.ndarray  # int64 document end offsets
    sents: np.ndarray  # int64
    words: np.ndarray  # bool, one per token
    spans: np.ndarray | None  # int64 (n, 2)
    sources: list[str]  # one name per document
    languages: list[str]


def _array_at(data: bytes, at: int, count: int, dtype) -> np.ndarray:
    return np.frombuffer(data, np.dtype(dtype), count, at)


def read_blocks(fs, path: str) -> Iterator[BlockArrays]:
    """The blocks of the shard at ``path`` of pyarrow filesystem ``fs``, in order, found
    through its index and checked against their crc32 (a part a write task just wrote,
    read back to drop documents from it: see worker.fix_unit)."""
    with fs.open_input_file(index_name(path)) as f:
        rows = np.load(io.BytesIO(f.read()), allow_pickle=False)
    with fs.open_input_file(path) as f:
        for b, row in enumerate(rows.tolist()):
            data = f.read_at(row[SIZE], row[OFFSET])
            if zlib.crc32(data) != row[CRC]:
                raise ShardError(f"{path}: block {b} is corrupt (crc32 mismatch)")
            n_tokens = row[N_TOKENS]
            array = functools.partial(_array_at, data)
            meta = json.loads(data[row[META_AT] : row[META_AT] + row[META_SIZE]])
            fields = _block_fields(array, row)
            yield BlockArrays(
                tokens=array(row[TOKENS_AT], n_tokens, _TOKEN_DTYPES[row[TOKEN_BYTES]]),
                ends=fields["ends"],
                sents=fields["sents"],
                words=fields["words"],
                spans=fields["spans"],
                sources=[meta["sources"][i] for i in fields["srcs"].tolist()],
                languages=[meta["languages"][i] for i in fields["langs"].tolist()],
            )


def _crc_ok(buf, offset: int, size: int, crc: int) -> bool:
    with memoryview(buf) as view, view[offset : offset + size] as sample:
        return zlib.crc32(sample) == crc


def _block_fields(array, row: list[int]) -> dict[str, Any]:
    """A block's arrays but its tokens, from ``array(at, count, dtype)`` (its bytes at an
    offset of the sample) and its index row."""
    n_docs, n_tokens = row[N_DOCS], row[N_TOKENS]
    spans = None
    if row[SPANS_AT] >= 0:
        spans = array(row[SPANS_AT], 2 * row[N_SPANS], _U32).reshape(-1, 2).astype(np.int64)
    return {
        "ends": array(row[DOCS_AT], n_docs, _U32).astype(np.int64),
        "sents": array(row[SENTS_AT], row[N_SENTS], _U32).astype(np.int64),
        "words": np.unpackbits(
            array(row[WORDS_AT], (n_tokens + 7) // 8, np.uint8), count=n_tokens, bitorder="little"
        ).astype(bool),
        "srcs": array(row[SRCS_AT], n_docs, _U16),
        "langs": array(row[LANGS_AT], n_docs, np.uint8),
        "spans": spans,
    }


_NOT_REGULAR = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.DIRTYPE: "a directory",
}


def check_member(info: tarfile.TarInfo, where: str) -> None:
    """A member the readers take: a regular file with a plain name (``is_plain_name``).
    webdataset would skip a link or a device silently and make ``../x`` a sample key;
    nothing here extracts, but a shard holding one was not written by prepare."""
    if not info.isreg():
        kind = _NOT_REGULAR.get(info.type, f"of tar type {info.type!r}")
        problem = f"is {kind}, not a regular file"
    elif not is_plain_name(info.name):
        problem = "is not a plain name inside the shard ('..', an absolute path or a URI)"
    else:
        return
    raise ShardError(
        f"{where}: tar member {info.name!r} {problem}; this shard was not written by "
        "`plm data prepare`: refused, nothing of it read; re-run `plm data prepare --force`"
    )


class _Slice(io.RawIOBase):
    """Bytes [start, start + size) of a buffer (a memory map, bytes) as a read-only file:
    what tarfile reads a sample's headers through without copying the sample."""

    def __init__(self, buf, start: int, size: int):
        self._buf, self._start, self._size, self._pos = buf, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        at = self._start + self._pos
        b[:n] = self._buf[at : at + n]
        self._pos += n
        return n


def checked_members(fileobj, where: str) -> Iterator[tarfile.TarInfo]:
    """The members of a tar (a shard, or one sample of it), headers only (tarfile seeks
    past the data), each checked with ``check_member``."""
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            while (info := tar.next()) is not None:
                check_member(info, where)
                tar.members = []  # a whole shard's headers are not kept
                yield info
    except tarfile.TarError as err:
        raise ShardError(
            f"{where}: not a readable tar ({err}); re-run `plm data prepare --force`"
        ) from None


def _iter_samples(fileobj, url: str) -> Iterator[dict[str, Any]]:
    """webdataset's own tar expansion and key grouping, on an open file, once every
    member's header is checked (webdataset skips links silently, keys on any name)."""
    for _ in checked_members(fileobj, url):
        pass
    fileobj.seek(0)
    tar = _tariterators()
    return tar.group_by_keys(tar.tar_file_expander([{"url": url, "stream": fileobj}]))


def _load_npy(sample: dict[str, Any], name: str) -> np.ndarray:
    return np.load(io.BytesIO(sample[name]), allow_pickle=False)


def documents_of_sample(sample: dict[str, Any]) -> Iterator[Document]:
    """The documents of one block sample as webdataset yields it (a dict of member bytes)."""
    key = sample["__key__"]
    meta = json.loads(sample["meta.json"])
    table = _BlockTable(
        key=key,
        doc_ends=np.concatenate([[0], _load_npy(sample, "docs.npy").astype(np.int64)]),
        sents=_load_npy(sample, "sents.npy").astype(np.int64),
        words=np.unpackbits(_load_npy(sample, "words.npy"), bitorder="little").astype(bool),
        srcs=_load_npy(sample, "srcs.npy"),
        langs=_load_npy(sample, "langs.npy"),
        sources=meta["sources"],
        languages=meta["languages"],
        spans=_load_npy(sample, "spans.npy").astype(np.int64) if "spans.npy" in sample else None,
    )
    tokens = _load_npy(sample, "tokens.npy")
    for j in range(len(table.doc_ends) - 1):
        yield _document(table, j, tokens[table.doc_ends[j] : table.doc_ends[j + 1]])


def _document(table: _BlockTable, j: int, tokens: np.ndarray) -> Document:
    a, b = int(table.doc_ends[j]), int(table.doc_ends[j + 1])
    s0, s1 = np.searchsorted(table.sents, [a, b], side="right")
    spans = None
    if table.spans is not None:
        p0, p1 = np.searchsorted(table.spans[:, 0], [a, b], side="left")
        spans = (table.spans[p0:p1] - a).astype(np.int32)
    return Document(
        key=f"{table.key}-{j}",
        tokens=tokens,
        sents=(table.sents[s0:s1] - a).astype(np.int32),
        words=np.flatnonzero(table.words[a:b]).astype(np.int32),
        meta={
            "source": table.sources[int(table.srcs[j])],
            "language": table.languages[int(table.langs[j])],
            "n_tokens": b - a,
        },
        spans=spans,
    )


class DataDir:
    """Read access to a prepared data directory: manifest, block indexes, documents.

    ``root``: a local folder (shards memory-mapped), or a URI of any pyarrow filesystem
    (``s3://bucket/prefix``, ``file://...``): then blocks are fetched by range reads into
    a node-local cache (``cache``: its folder, size bound and prefetch depth; see
    pipeline/data/remote.py) and ``root`` is None: ``where()`` names things for messages.
    """

    def __init__(self, root: str | Path, cache: CacheConfig | None = None):
        from pipeline.data import remote

        self._store: remote.RemoteStore | None = None
        self.root: Path | None
        if is_uri(root):
            self.root, self.uri = None, str(root).rstrip("/")
            self._store = remote.RemoteStore(self.uri, cache)
            data = self._store.manifest_bytes()
            self._manifest_sha = hashlib.sha256(data).hexdigest()
            self.manifest = parse_manifest(data, self.where(MANIFEST))
        else:
            self.root = Path(root)
            self.uri = str(self.root)
            self._real_root = self.root.resolve()
            self.manifest = load_manifest(self.root)
        self._entries = {
            e.get("name"): e for info in self.manifest["splits"].values() for e in info["shards"]
        }
        self._blocks: OrderedDict[tuple[str, int], Any] = OrderedDict()  # remote: mapped blocks
        self._lengths: dict[str, np.ndarray] = {}  # remote: token counts per shard
        self._tokenizer_dir: Path | None = None
        self._indexes: dict[str, np.ndarray] = {}
        self._firsts: dict[str, np.ndarray] = {}  # per shard: first document of each block
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._tables: OrderedDict[tuple[str, int], _BlockTable] = OrderedDict()
        # Blocks whose crc32 and tar members (check_member) this process checked.
        self._checked: set[tuple[str, int]] = set()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps do not pickle (spawned loader workers, Ray): the copy opens its own.
        state = dict(self.__dict__)
        state["_maps"], state["_tables"] = OrderedDict(), OrderedDict()
        state["_blocks"] = OrderedDict()
        return state

    def close(self) -> None:
        """Close the shard memory maps (read() reopens them when needed)."""
        maps, self._maps = self._maps, OrderedDict()
        for mm in maps.values():
            mm.close()
        self._blocks = OrderedDict()  # remote maps close when the last slice is dropped
        if self._store is not None:
            self._store.close()

    # --- where things are ------------------------------------------------------------------
    @property
    def is_remote(self) -> bool:
        return self._store is not None

    @property
    def name(self) -> str:
        """A short name (the folder's, or the URI's last part): a mixture source's default."""
        from pipeline.storage import uri_name

        return self.root.name if self.root is not None else uri_name(self.uri)

    def where(self, name: str = "") -> str:
        """The data dir, or one of its files, as a message names it (path or URI)."""
        if self.root is None:
            return f"{self.uri}/{name}" if name else self.uri
        return str(self.root / name) if name else str(self.root)

    def _local(self, name: str) -> Path:
        """A file of a local data dir, which must resolve inside it: a link out of the data
        dir is refused, not followed (the manifest's names are plain, see _check_names)."""
        path = self.root / name
        real = path.resolve()
        if real != self._real_root and self._real_root not in real.parents:
            raise ShardError(
                f"{path} leads outside the data dir {self.root} (to {real}); refused, nothing "
                "read there: copy the files into the data dir, or prepare it again"
            )
        return path

    def stats(self) -> dict[str, int]:
        """A remote data dir's counters in this process (see pipeline/data/remote.py)."""
        return self._store.stats() if self._store is not None else {}

    def size(self, name: str) -> int | None:
        """Bytes of a file of the data dir; None when it is missing."""
        if self._store is not None:
            return self._store.size(name)
        path = self._local(name)
        return path.stat().st_size if path.is_file() else None

    def sha256(self, name: str) -> str:
        if self._store is not None:
            if name.endswith(INDEX_SUFFIX):  # the bytes the reader uses (cached)
                shard = name[: -len(INDEX_SUFFIX)] + ".tar"
                sha = self._entries.get(shard, {}).get("index_sha256")
                return hashlib.sha256(self._store.index_bytes(name, sha)).hexdigest()
            return self._store.sha256(name)
        return sha256_file(self._local(name))

    @property
    def tokenizer_path(self) -> Path:
        """The tokenizer.json (a local file: a remote data dir's is downloaded to the cache)."""
        tok = self.manifest["tokenizer"]
        if self._store is None:
            return self._local(f"{tok['path']}/tokenizer.json")
        if self._tokenizer_dir is None:
            key = str(tok.get("fingerprint") or self._manifest_sha)
            self._tokenizer_dir = self._store.tokenizer_dir(tok["path"], key)
        return self._tokenizer_dir / "tokenizer.json"

    def shards(self, split: str) -> list[dict[str, Any]]:
        if split not in self.manifest["splits"]:
            raise ShardError(f"{self.where()}: no split {split!r} in the manifest")
        return self.manifest["splits"][split]["shards"]

    def urls(self, split: str) -> list[str]:
        return [self.where(s["name"]) for s in self.shards(split)]

    def index(self, shard: str) -> np.ndarray:
        """The shard's block index: int64 (n_blocks, INDEX_COLUMNS)."""
        if shard not in self._indexes:
            rows = self._load_index(shard)
            self._indexes[shard] = rows
            self._firsts[shard] = np.concatenate([[0], np.cumsum(rows[:, N_DOCS])])
        return self._indexes[shard]

    def n_docs(self, shard: str) -> int:
        self.index(shard)
        return int(self._firsts[shard][-1])

    def _load_index(self, shard: str) -> np.ndarray:
        path = self.where(index_name(shard))
        try:
            if self._store is None:
                rows = np.load(self._local(index_name(shard)), allow_pickle=False)
            else:
                sha = self._entries.get(shard, {}).get("index_sha256")
                data = self._store.index_bytes(index_name(shard), sha)
                rows = np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ShardError(
                f"index {path} is missing or unreadable ({err}); re-run `plm data prepare --force`"
            ) from None
        if rows.ndim != 2 or rows.shape[1] != INDEX_COLUMNS:
            raise ShardError(
                f"index {path} has shape {rows.shape}, expected (n_blocks, {INDEX_COLUMNS}); "
                "re-run `plm data prepare --force`"
            )
        if self._store is not None:
            self._store.indexes[shard] = rows
        return rows

    def _shard_map(self, shard: str) -> mmap.mmap:
        if self._pid != os.getpid():
            # A forked loader worker: drop the parent's maps (unmapping only here).
            self._maps, self._pid = OrderedDict(), os.getpid()
        mm = self._maps.get(shard)
        if mm is not None:
            self._maps.move_to_end(shard)
            return mm
        path = self._local(shard)
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as err:  # ValueError: an empty file
            raise ShardError(
                f"shard {path} is missing or unreadable ({err}); re-run `plm data prepare`"
            ) from None
        self._maps[shard] = mm
        if len(self._maps) > MAX_OPEN_SHARDS:
            self._maps.popitem(last=False)[1].close()
        return mm

    def _block_bytes(self, shard: str, b: int, start: int, size: int, check: bool = True) -> bytes:
        """Bytes [start, start + size) of block b's sample, its crc32 and members checked
        once per process (``check=False``: not checked, for the stream's start-up table)."""
        row = self._indexes[shard][b]
        total = int(row[SIZE])
        mm, offset = self._block_buffer(shard, b, row)
        if offset < 0 or total <= 0 or offset + total > len(mm):
            raise ShardError(
                f"{self.where(shard)}: block {b} at byte {offset} (+{total} bytes) lies outside "
                f"the shard ({len(mm)} bytes): the shard is truncated or its index is stale; "
                "re-run `plm data prepare --force`"
            )
        if check and (shard, b) not in self._checked:
            if not _crc_ok(mm, offset, total, int(row[CRC])):
                if self._store is None:
                    raise ShardError(
                        f"{self.where(shard)}: block {b} at byte {offset} is corrupt (crc32 "
                        "mismatch); `plm data inspect --verify` checks the whole directory, "
                        "`plm data prepare --force` rebuilds it"
                    )
                # A cached copy that went bad on this disk: dropped and fetched again (the
                # fetch checks the crc32 of what the store holds).
                self._store.drop(shard, b, row.tolist(), self._shard_sha(shard))
                self._blocks.pop((shard, b), None)
                mm, offset = self._block_buffer(shard, b, row)
            if (shard, b) not in self._checked:  # (a fetch checks them)
                self._check_members(shard, mm, offset, total)
                self._checked.add((shard, b))
        if start < 0 or start + size > total:
            raise ShardError(
                f"{self.where(shard)}: block {b}: its index points outside the block; "
                "re-run `plm data prepare --force`"
            )
        return mm[offset + start : offset + start + size]

    def _block_buffer(self, shard: str, b: int, row: np.ndarray) -> tuple[Any, int]:
        """(a buffer holding block b's sample, the sample's offset in it): the shard's
        memory map, or a remote block (a map of its cached file, or its bytes)."""
        if self._store is None:
            return self._shard_map(shard), int(row[OFFSET])
        if self._pid != os.getpid():
            self._maps, self._blocks, self._pid = OrderedDict(), OrderedDict(), os.getpid()
        buf = self._blocks.get((shard, b))
        if buf is not None:
            self._blocks.move_to_end((shard, b))
            return buf, 0
        buf, checked = self._store.block(shard, b, row.tolist(), self._shard_sha(shard))
        if checked:  # its crc32 checked by the fetch: its members here
            self._check_members(shard, buf, 0, int(row[SIZE]))
            self._checked.add((shard, b))
        self._blocks[(shard, b)] = buf
        if len(self._blocks) > MAX_OPEN_BLOCKS:
            self._blocks.popitem(last=False)
        return buf, 0

    def _shard_sha(self, shard: str) -> str | None:
        return self._entries.get(shard, {}).get("sha256")

    def will_need(self, ranges: list[tuple[str, int, int]]) -> None:
        """Documents [start, stop) of these shards will be read soon, in about this order:
        a remote data dir fetches their blocks in the background (a local one: nothing)."""
        if self._store is None or not self._store.prefetch_blocks:
            return
        items, seen = [], set()
        for shard, start, stop in ranges:
            rows = self.index(shard)
            firsts = self._firsts[shard]
            if stop <= start:
                continue
            first = int(np.searchsorted(firsts, start, side="right")) - 1
            last = int(np.searchsorted(firsts, stop - 1, side="right")) - 1
            for b in range(max(first, 0), min(last, len(rows) - 1) + 1):
                if (shard, b) not in seen and (shard, b) not in self._blocks:
                    seen.add((shard, b))
                    items.append((shard, b, rows[b].tolist(), self._shard_sha(shard)))
        self._store.prefetch(items)

    def _table(self, shard: str, b: int) -> _BlockTable:
        table = self._tables.get((shard, b))
        if table is not None:
            self._tables.move_to_end((shard, b))
            return table
        row = self.index(shard)[b].tolist()
        n_tokens = row[N_TOKENS]
        try:
            meta = json.loads(self._block_bytes(shard, b, row[META_AT], row[META_SIZE]))
            key = self._block_key(shard, b)

            def array(at: int, count: int, dtype) -> np.ndarray:
                dtype = np.dtype(dtype)
                return np.frombuffer(self._block_bytes(shard, b, at, count * dtype.itemsize), dtype)

            fields = _block_fields(array, row)
            table = _BlockTable(
                key=key,
                doc_ends=np.concatenate([[0], fields["ends"]]),
                sents=fields["sents"],
                words=fields["words"],
                srcs=fields["srcs"],
                langs=fields["langs"],
                sources=meta["sources"],
                languages=meta["languages"],
                spans=fields["spans"],
            )
        except (ValueError, KeyError, UnicodeDecodeError) as err:
            raise ShardError(
                f"{self.where(shard)}: block {b} is corrupt ({err}); re-run "
                "`plm data prepare --force`"
            ) from None
        if table.doc_ends[-1] != n_tokens:
            raise ShardError(
                f"{self.where(shard)}: block {b}: docs.npy ends at {table.doc_ends[-1]}, the "
                f"index says {n_tokens} tokens; re-run `plm data prepare --force`"
            )
        self._tables[(shard, b)] = table
        if len(self._tables) > _BLOCK_CACHE:
            self._tables.popitem(last=False)
        return table

    def _check_members(self, shard: str, buf, offset: int, size: int) -> None:
        """Every tar member of the sample at ``buf[offset:offset + size]`` (its headers
        only): a link, a device or a ``../x`` is refused before anything of it is read."""
        for _ in checked_members(_Slice(buf, offset, size), self.where(shard)):
            pass

    def _block_key(self, shard: str, b: int) -> str:
        """Block b's sample key: its first member's name up to the first dot (the members
        were checked with its crc32)."""
        self._block_bytes(shard, b, 0, 0)
        row = self._indexes[shard][b]
        buf, offset = self._block_buffer(shard, b, row)
        members = checked_members(_Slice(buf, offset, int(row[SIZE])), self.where(shard))
        first = next(members, None)
        members.close()
        if first is None:
            raise ValueError("no tar member")
        return first.name.split(".", 1)[0]

    def doc_lengths(self, shard: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Token count (int64) of documents [start, stop) of the shard (default: all), from
        the blocks' docs.npy: 4 bytes per document read, no token, no checksum (a corrupt
        docs.npy fails the block's crc32 when a document of it is read)."""
        rows = self.index(shard)
        firsts = self._firsts[shard]
        stop = int(firsts[-1]) if stop is None else stop
        if not 0 <= start <= stop <= firsts[-1]:
            raise IndexError(f"{shard}: documents [{start}, {stop}) of {int(firsts[-1])}")
        if start == stop:
            return np.zeros(0, dtype=np.int64)
        if self._store is not None:
            lengths = self._lengths.get(shard)
            if lengths is None:
                lengths = self._store.doc_lengths(shard, rows, self._shard_sha(shard))
                self._lengths[shard] = lengths
            return np.asarray(lengths[start:stop], dtype=np.int64)
        first = int(np.searchsorted(firsts, start, side="right")) - 1
        last = int(np.searchsorted(firsts, stop - 1, side="right")) - 1
        out = []
        for b in range(first, last + 1):
            row = rows[b]
            ends = np.frombuffer(
                self._block_bytes(shard, b, int(row[DOCS_AT]), 4 * int(row[N_DOCS]), check=False),
                _U32,
            ).astype(np.int64)
            out.append(np.diff(ends, prepend=0))
        lengths = np.concatenate(out)
        base = int(firsts[first])
        return lengths[start - base : stop - base]

    def read(self, shard: str, i: int) -> Document:
        """Random access: the i-th document of a shard (block found by the index)."""
        self.index(shard)
        firsts = self._firsts[shard]
        if not 0 <= i < firsts[-1]:
            raise IndexError(f"{shard}: document {i} of {int(firsts[-1])}")
        b = int(np.searchsorted(firsts, i, side="right")) - 1
        j = i - int(firsts[b])
        table = self._table(shard, b)
        row = self._indexes[shard][b]
        a, e = int(table.doc_ends[j]), int(table.doc_ends[j + 1])
        dtype = _TOKEN_DTYPES[int(row[TOKEN_BYTES])]
        raw = self._block_bytes(shard, b, int(row[TOKENS_AT]) + a * dtype.itemsize,
                                (e - a) * dtype.itemsize)  # fmt: skip
        return _document(table, j, np.frombuffer(raw, dtype))

    def iter_shard(self, shard: str) -> Iterator[Document]:
        """A shard's documents in order, through webdataset's tar iterator (a remote data
        dir: by ``read``, its blocks fetched ahead)."""
        if self._store is not None:
            for i in range(self.n_docs(shard)):
                yield self.read(shard, i)
            return
        with open(self._local(shard), "rb") as f:
            for sample in _iter_samples(f, self.where(shard)):
                yield from documents_of_sample(sample)

    def iter_split(self, split: str) -> Iterator[Document]:
        """Every document of a split, in the deterministic (source) order."""
        for shard in self.shards(split):
            yield from self.iter_shard(shard["name"])

    def verify(self) -> list[str]:
        """Re-hash every shard and index, check every block against the index; the problems."""
        problems = []
        for split in self.manifest["splits"]:
            for shard in self.shards(split):
                name = shard["name"]
                if self.size(name) is None:
                    problems.append(f"{name}: missing")
                    continue
                if self.sha256(name) != shard["sha256"]:
                    problems.append(f"{name}: sha256 does not match the manifest")
                    continue
                index = shard["index"]
                if self.size(index) is None or self.sha256(index) != shard["index_sha256"]:
                    problems.append(f"{shard['index']}: missing or sha256 does not match")
                    continue
                rows = self.index(name)
                if (
                    int(rows[:, N_DOCS].sum()) != shard["n_docs"]
                    or int(rows[:, N_TOKENS].sum()) != shard["n_tokens"]
                ):
                    problems.append(f"{name}: index disagrees with the manifest counts")
                    continue
                try:
                    n = sum(1 for _ in self.iter_shard(name))
                    for b in range(len(rows)):
                        self._table(name, b)
                except (ShardError, ValueError, KeyError) as err:
                    problems.append(f"{name}: {err}")
                    continue
                if n != shard["n_docs"]:
                    problems.append(
                        f"{name}: {n} documents in the tar, manifest has {shard['n_docs']}"
                    )
        return problems
