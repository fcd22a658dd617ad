"""The shard contract: WebDataset tar shards of plain documents, a per-shard index, a manifest.

A data directory (see DESIGN.md, "Shards") holds::

    manifest.json                     written last, atomically
    tokenizer/tokenizer.json          the tokenizer the ids come from (+ tokenizer_meta.json)
    train/shard-000000.tar            one sample per document, deterministic bytes
    train/shard-000000.idx.npy        int64 rows (byte offset, byte size, n_tokens) per sample
    valid/shard-000000.tar ...

Writing gives the bytes webdataset's ``TarWriter`` writes (a fixed mtime, owner and mode,
members sorted by name: the same documents give the same bytes; tests compare the files):
each sample is serialized once (``sample_record``) and appended, and tarfile ends the
archive. Sequential reading
(``iter_shard``, ``iter_split``, ``verify``) goes through webdataset's tar iterators.
Random access (``DataDir.read``, what the training stream uses) slices the sample's
bytes out of a read-only memory map of the shard at the offset the index records and
parses them with the standard library's tar header parser and numpy's .npy header
parser, the arrays being views of those bytes: about 10x cheaper than starting a tar
stream per sample, and the same Documents (tests/unit/test_shards.py checks both paths).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import mmap
import os
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
SPLITS = ("train", "valid")
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
INDEX_SUFFIX = ".idx.npy"
# Index columns. The first three locate a sample; the rest (written since session 2,
# absent from older 3-column indexes) locate each member's data inside the sample's
# bytes, so a random read is a slice and a few np.frombuffer calls, no tar or .npy
# header parsing. *_AT: byte offset of the member's array data (or JSON) from the
# sample's start; SPANS_AT is -1 when the sample has no spans.npy.
OFFSET, SIZE, N_TOKENS = 0, 1, 2
(META_AT, META_SIZE, TOKENS_AT, TOKEN_BYTES) = (3, 4, 5, 6)
(SENTS_AT, N_SENTS, WORDS_AT, N_WORDS, SPANS_AT, N_SPANS) = (7, 8, 9, 10, 11, 12)
INDEX_COLUMNS = 13
_TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
# Memory maps a DataDir keeps open per process (each holds a file descriptor).
MAX_OPEN_SHARDS = 64


@functools.cache
def _tariterators():
    """webdataset's tar iterators, imported on first use.

    ``import webdataset`` imports torch (about 1 s): the processes that only serialize
    samples (the prepare actors, via ``sample_bytes``) never pay for it.
    """
    from webdataset import tariterators

    return tariterators


class ShardError(RuntimeError):
    """A data directory, shard or index that does not match its manifest."""


@dataclass
class Document:
    """One sample of a shard: a document (or a piece of a long one), tokenized."""

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


# .npy headers written by numpy's own header writer, by (dtype, shape): a corpus has
# few distinct ones, and np.save (header dict, repr, padding) costs ~10x the copy.
_NPY_WRITE_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}
_NPY_WRITE_HEADERS_MAX = 1 << 14


def _npy_bytes_fast(array: np.ndarray) -> bytes:
    """``_npy_bytes`` of a C-contiguous array (the same bytes), the header cached."""
    if not array.flags.c_contiguous or array.dtype.hasobject:
        return _npy_bytes(array)
    key = (array.dtype.str, array.shape)
    header = _NPY_WRITE_HEADERS.get(key)
    if header is None:
        buf = io.BytesIO()
        try:  # np.save writes format 1.0 whenever the header fits it, as here
            np.lib.format.write_array_header_1_0(
                buf, np.lib.format.header_data_from_array_1_0(array)
            )
        except ValueError:  # a header too long for 1.0: np.save picks the version
            return _npy_bytes(array)
        if len(_NPY_WRITE_HEADERS) >= _NPY_WRITE_HEADERS_MAX:
            _NPY_WRITE_HEADERS.clear()
        header = _NPY_WRITE_HEADERS[key] = buf.getvalue()
    return header + array.tobytes()


def _member_arrays(doc: Document, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The .npy members of a sample, in their on-disk dtypes (spans.npy only when the
    document has spans): the one place that says which arrays a sample holds."""
    if "." in doc.key:
        raise ValueError(f"sample key {doc.key!r} must not contain dots")
    arrays = {
        "tokens.npy": np.ascontiguousarray(doc.tokens, dtype=dtype),
        "sents.npy": np.ascontiguousarray(doc.sents, dtype=np.int32),
        "words.npy": np.ascontiguousarray(doc.words, dtype=np.int32),
    }
    if doc.spans is not None:
        arrays["spans.npy"] = np.ascontiguousarray(doc.spans, dtype=np.int32)
    return arrays


def encode_document(doc: Document, dtype: np.dtype, npy=_npy_bytes) -> dict[str, Any]:
    sample: dict[str, Any] = {"__key__": doc.key, "meta.json": meta_json(doc.meta)}
    sample.update((name, npy(array)) for name, array in _member_arrays(doc, dtype).items())
    return sample


def sample_bytes(doc: Document, dtype: np.dtype) -> bytes:
    """The tar members of one sample, exactly the bytes ``ShardWriter.write`` appends."""
    return sample_record(doc, dtype)[0]


def meta_json(meta: dict[str, Any]) -> bytes:
    """A sample's meta.json bytes (what ``encode_document`` writes)."""
    return json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")


def sample_record(
    doc: Document, dtype: np.dtype, meta: bytes | None = None
) -> tuple[bytes, tuple[int, ...]]:
    """(the sample's bytes, its index columns after OFFSET and SIZE): see ``sample_bytes``.

    Lets workers (e.g. Ray actors) serialize samples in parallel, so the process that
    writes the shard only appends bytes (``ShardWriter.write_bytes``). The hot path of
    `plm data prepare`: the members of ``encode_document`` in the order TarWriter writes
    them (sorted by name), .npy headers cached (``_npy_bytes_fast``), tar headers from a
    template (``_tar_header``); tests/integration/test_prepare.py checks the bytes against
    webdataset's TarWriter. ``meta``: ``meta_json(doc.meta)`` when the caller has it
    cheaper (json.dumps is a third of the cost here).
    """
    arrays = _member_arrays(doc, dtype)
    if meta is None:
        meta = meta_json(doc.meta)
    members = sorted([("meta.json", meta), *arrays.items()], key=lambda m: m[0])
    parts, at, pos = [], {}, 0
    for name, value in members:
        data = value if name == "meta.json" else _npy_bytes_fast(value)
        size = len(data)
        parts.append(_tar_header(f"{doc.key}.{name}", size))
        parts.append(data)
        pad = -size % tarfile.BLOCKSIZE
        if pad:
            parts.append(_ZERO_BLOCK[:pad])
        pos += tarfile.BLOCKSIZE
        # where the member's bytes start (meta.json) or its array's data (.npy: it ends them)
        at[name] = pos if name == "meta.json" else pos + size - value.nbytes
        pos += size + pad
    tokens, spans = arrays["tokens.npy"], arrays.get("spans.npy")
    columns = (
        int(tokens.shape[0]),
        at["meta.json"],
        len(meta),
        at["tokens.npy"],
        tokens.itemsize,
        at["sents.npy"],
        arrays["sents.npy"].size,
        at["words.npy"],
        arrays["words.npy"].size,
        at["spans.npy"] if spans is not None else -1,
        spans.size // 2 if spans is not None else 0,  # N_SPANS counts (start, end) pairs
    )
    return b"".join(parts), columns


_ZERO_BLOCK = tarfile.NUL * tarfile.BLOCKSIZE
_USTAR_MAX_SIZE = 8**11  # 11 octal digits; larger sizes need a pax header


def _tar_header(name: str, size: int) -> bytes:
    """tarfile's header for a regular member, with the fields webdataset's TarWriter sets.

    tarfile's default (pax) format writes a plain ustar header, and no pax header, for
    an ASCII name of at most 100 bytes and a size under 8 GiB: that header is built here
    from a template (``_ustar_header``); anything else goes through tarfile itself.
    """
    if name.isascii() and len(name) <= tarfile.LENGTH_NAME and 0 <= size < _USTAR_MAX_SIZE:
        return _ustar_header(name.encode("ascii"), size)
    return _tarfile_header(name, size)


def _tarfile_header(name: str, size: int, fmt: int = tarfile.DEFAULT_FORMAT) -> bytes:
    """The header tarfile writes (the reference ``_ustar_header`` is tested against)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o644, "", ""
    return info.tobuf(fmt, tarfile.ENCODING, "surrogateescape")


# The fixed fields of the ustar header tarfile writes for ShardWriter's members (mode
# 0o644, uid/gid 0, mtime 0, empty owner names, a regular file, no link, no prefix), cut
# from a header tarfile itself made (its device fields differ between Python versions).
# Layout (tarfile.TarInfo._create_header): name 0:100, mode/uid/gid 100:124, size
# 124:136, mtime 136:148, checksum 148:156, the rest 156:512.
_PROBE = _tarfile_header("probe", 0, tarfile.USTAR_FORMAT)
_UIDS_MODE, _MTIME, _TAIL = _PROBE[100:124], _PROBE[136:148], _PROBE[156:]
# tarfile's checksum: the sum of the header's bytes with the checksum field as 8 spaces.
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


def decode_document(sample: dict[str, Any]) -> Document:
    def load(name: str) -> np.ndarray:
        return np.load(io.BytesIO(sample[name]), allow_pickle=False)

    return Document(
        key=sample["__key__"],
        tokens=load("tokens.npy"),
        sents=load("sents.npy"),
        words=load("words.npy"),
        meta=json.loads(sample["meta.json"]),
        spans=load("spans.npy") if "spans.npy" in sample else None,
    )


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file, fsync, rename: a reader never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Writes one shard and its index; both appear under their final names only on close()."""

    def __init__(self, root: str | Path, name: str, dtype: np.dtype):
        self.root = Path(root)
        self.name = name
        self.dtype = np.dtype(dtype)
        self.path = self.root / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        # The stream tarfile that webdataset's TarWriter opens, used here only to end the
        # archive (close: two zero blocks, then zeros to a whole 10 KiB record). Samples
        # go straight to the file, past tarfile's 10 KiB write buffer, and ``offset`` is
        # kept for the record padding. (Not webdataset itself: importing it imports torch,
        # 1.5 CPU s and ~0.3 GB in the `plm data prepare` driver.)
        self._tar = tarfile.open(fileobj=self._file, mode="w|")
        self._rows: list[tuple[int, ...]] = []
        self.n_tokens = 0

    def write(self, doc: Document) -> None:
        """Append one document (the same bytes webdataset's ``TarWriter.write`` gives for
        ``encode_document(doc)``: tests/unit/test_shards.py checks it)."""
        self.write_bytes(*sample_record(doc, self.dtype))

    def write_bytes(self, data: bytes, columns: tuple[int, ...]) -> None:
        """Append one sample serialized by ``sample_record`` (bytes + its index columns)."""
        if len(columns) != INDEX_COLUMNS - 2:
            raise ValueError(f"{len(columns)} index columns, expected {INDEX_COLUMNS - 2}")
        start = self._tar.offset
        self._file.write(data)
        self._tar.offset += len(data)
        self._rows.append((start, len(data), *columns))
        self.n_tokens += columns[0]

    def close(self) -> dict[str, Any]:
        """Finish the tar, rename it into place, write the index; return the manifest entry."""
        self._tar.close()  # writes the end-of-archive blocks
        if not self._file.closed:
            self._file.close()
        os.replace(self._tmp, self.path)
        index = np.asarray(self._rows, dtype=np.int64).reshape(-1, INDEX_COLUMNS)
        index_bytes = _npy_bytes(index)
        atomic_write_bytes(self.root / index_name(self.name), index_bytes)
        return {
            "name": self.name,
            "index": index_name(self.name),
            "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
            "n_docs": len(self._rows),
            "n_tokens": self.n_tokens,
            "bytes": self.path.stat().st_size,
            "sha256": sha256_file(self.path),
        }


def write_manifest(root: str | Path, manifest: dict[str, Any]) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(Path(root) / MANIFEST, text.encode("utf-8"))


def load_manifest(root: str | Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{path} does not exist: {root} is not a finished data directory "
            "(run `plm data prepare` to create or complete it)"
        )
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ShardError(
            f"{path}: format_version {manifest.get('format_version')!r}, this code reads "
            f"{FORMAT_VERSION}; re-run `plm data prepare --force`"
        )
    return manifest


def _iter_samples(fileobj, url: str) -> Iterator[dict[str, Any]]:
    """webdataset's own tar expansion and key grouping, on an open (possibly seeked) file."""
    tar = _tariterators()
    return tar.group_by_keys(tar.tar_file_expander([{"url": url, "stream": fileobj}]))


def _member_header(header: bytes) -> tuple[bytes, str, int]:
    """(type flag, name, size) of one tar member header.

    The fields are decoded by tarfile's own ``nts``/``nti`` and the checksum checked by its
    ``calc_chksums``, as ``TarInfo.frombuf`` does; frombuf also decodes a dozen fields we
    never use and costs ~10x more, and it was most of the time of a random read.
    """
    if len(header) != tarfile.BLOCKSIZE:
        raise ValueError("truncated tar header")
    if tarfile.nti(header[148:156]) not in tarfile.calc_chksums(header):
        raise ValueError("tar header checksum mismatch")
    name = tarfile.nts(header[0:100], tarfile.ENCODING, "surrogateescape")
    if header[257:265] == tarfile.POSIX_MAGIC and header[345] != 0:  # ustar name prefix
        prefix = tarfile.nts(header[345:500], tarfile.ENCODING, "surrogateescape")
        name = f"{prefix}/{name}"
    return header[156:157], name, tarfile.nti(header[124:136])


def _sample_members(raw: bytes) -> tuple[str, dict[str, tuple[int, int]]] | None:
    """The key and each member's (data offset, size) of one sample's bytes.

    Headers are read by ``_member_header`` (tarfile's own field decoders, checksum
    included) and names split into key and extension by webdataset's own rule, as its
    iterators do. Returns None when a member is anything but a plain regular file (e.g. a
    pax header, which tarfile writes for names over 100 bytes): the caller then takes
    webdataset's path.
    """
    key, members, pos = None, {}, 0
    while pos < len(raw):
        member_type, name, size = _member_header(raw[pos : pos + tarfile.BLOCKSIZE])
        if member_type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            return None
        start = pos + tarfile.BLOCKSIZE
        if start + size > len(raw):
            raise ValueError(f"member {name!r} runs past the end of the sample")
        prefix, ext = _tariterators().base_plus_ext(name)
        if prefix is None:
            raise ValueError(f"member {name!r} has no extension")
        if key is None:
            key = prefix
        elif prefix != key:
            raise ValueError(f"member {name!r} does not belong to sample {key!r}")
        ext = ext.lower()
        if ext in members:
            raise ValueError(f"member {name!r} appears twice")
        members[ext] = (start, size)
        pos = start + size + (-size % tarfile.BLOCKSIZE)
    if key is None:
        raise ValueError("no tar member")
    return key, members


# Parsed .npy headers by their bytes (magic to end of header). A corpus has few distinct
# headers (one per dtype and shape), and numpy's parser (ast.literal_eval) would
# otherwise be the largest cost of a read. Only headers numpy accepted get in.
_NPY_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}
_NPY_HEADERS_MAX = 1 << 14
_NPY_MAGIC = len(np.lib.format.MAGIC_PREFIX) + 2  # prefix, major, minor


def _npy_view(raw: bytes, start: int, size: int) -> np.ndarray:
    """The .npy member at raw[start : start + size], as a read-only view of raw.

    Headers are parsed by numpy's own parsers (the ones np.load uses), each distinct
    header once; the data is not copied.
    """
    major = raw[start + _NPY_MAGIC - 2] if size >= _NPY_MAGIC else 0
    width = {1: 2, 2: 4}.get(major, 0)  # bytes of the header-length field (format 1.0/2.0)
    at = start + _NPY_MAGIC + width
    end = at + int.from_bytes(raw[at - width : at], "little")
    parsed = _NPY_HEADERS.get(raw[start:end]) if width and end <= start + size else None
    if parsed is None:
        fp = io.BytesIO(raw)  # shares raw's buffer
        fp.seek(start)
        version = np.lib.format.read_magic(fp)  # ValueError unless a .npy member
        if version == (1, 0):
            parsed = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            parsed = np.lib.format.read_array_header_2_0(fp)
        else:  # format 3.0 (utf-8 field names): np.save never writes it for our arrays
            return np.load(io.BytesIO(raw[start : start + size]), allow_pickle=False)
        end = fp.tell()
        if len(_NPY_HEADERS) >= _NPY_HEADERS_MAX:
            _NPY_HEADERS.clear()
        _NPY_HEADERS[raw[start:end]] = parsed
    shape, fortran, dtype = parsed
    if dtype.hasobject:
        raise ValueError("object arrays are not allowed")
    count = math.prod(shape)
    if end + count * dtype.itemsize > start + size:
        raise ValueError(f"array of shape {shape} runs past the end of its member")
    array = np.frombuffer(raw, dtype, count, offset=end)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def _decode_with_webdataset(raw: bytes, url: str) -> Document:
    """One sample's bytes -> Document through a webdataset tar stream (the general path)."""
    samples = list(_iter_samples(io.BytesIO(raw), url))
    if len(samples) != 1:
        raise ValueError(f"{len(samples)} samples in its bytes")
    return decode_document(samples[0])


def _decode_sample_bytes(raw: bytes) -> Document | None:
    """One sample's bytes -> Document, or None when only webdataset's path can read it."""
    parsed = _sample_members(raw)
    if parsed is None:
        return None
    key, members = parsed

    def member(name: str) -> tuple[int, int]:
        if name not in members:
            raise ValueError(f"sample {key!r} has no {name} member")
        return members[name]

    start, size = member("meta.json")
    return Document(
        key=key,
        tokens=_npy_view(raw, *member("tokens.npy")),
        sents=_npy_view(raw, *member("sents.npy")),
        words=_npy_view(raw, *member("words.npy")),
        meta=json.loads(raw[start : start + size]),
        spans=_npy_view(raw, *members["spans.npy"]) if "spans.npy" in members else None,
    )


def _decode_indexed(raw: bytes, row: list[int]) -> Document | None:
    """One sample's bytes -> Document through its index row: no header parsing at all.

    The key is the first member's name (a plain ustar name field: "KEY.meta.json"); a
    sample whose first header is not that (a pax header for a long key) returns None
    and goes the header-parsing way. np.frombuffer raises ValueError when an index row
    points outside the sample, so a stale index cannot read past it.
    """
    name = raw[:100].split(b"\0", 1)[0]
    dot = name.find(b".")
    if name[dot:] != b".meta.json":
        return None
    meta_at, meta_size = row[META_AT], row[META_SIZE]
    if meta_at + meta_size > len(raw):
        raise ValueError("meta.json lies outside the sample")
    spans = None
    if row[SPANS_AT] >= 0:
        spans = np.frombuffer(raw, np.int32, 2 * row[N_SPANS], row[SPANS_AT]).reshape(-1, 2)
    return Document(
        key=name[:dot].decode("ascii"),
        tokens=np.frombuffer(raw, _TOKEN_DTYPES[row[TOKEN_BYTES]], row[N_TOKENS], row[TOKENS_AT]),
        sents=np.frombuffer(raw, np.int32, row[N_SENTS], row[SENTS_AT]),
        words=np.frombuffer(raw, np.int32, row[N_WORDS], row[WORDS_AT]),
        meta=json.loads(raw[meta_at : meta_at + meta_size]),
        spans=spans,
    )


class DataDir:
    """Read access to a prepared data directory: manifest, indexes, documents."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = load_manifest(self.root)
        self._indexes: dict[str, np.ndarray] = {}
        # Read-only memory maps of shards for read(), opened lazily by the process that
        # uses them (see _shard_map), least recently used closed beyond MAX_OPEN_SHARDS.
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps do not pickle (spawned loader workers, Ray): the copy opens its own.
        state = dict(self.__dict__)
        state["_maps"] = OrderedDict()
        return state

    def close(self) -> None:
        """Close the shard memory maps (read() reopens them when needed)."""
        maps, self._maps = self._maps, OrderedDict()
        for mm in maps.values():
            mm.close()

    @property
    def tokenizer_path(self) -> Path:
        return self.root / self.manifest["tokenizer"]["path"] / "tokenizer.json"

    def shards(self, split: str) -> list[dict[str, Any]]:
        if split not in self.manifest["splits"]:
            raise ShardError(f"{self.root}: no split {split!r} in the manifest")
        return self.manifest["splits"][split]["shards"]

    def urls(self, split: str) -> list[str]:
        return [str(self.root / s["name"]) for s in self.shards(split)]

    def index(self, shard: str) -> np.ndarray:
        if shard not in self._indexes:
            self._indexes[shard] = self._load_index(shard)
        return self._indexes[shard]

    def _load_index(self, shard: str) -> np.ndarray:
        path = self.root / index_name(shard)
        try:
            rows = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ShardError(
                f"index {path} is missing or unreadable ({err}); re-run `plm data prepare --force`"
            ) from None
        if rows.ndim != 2 or rows.shape[1] not in (3, INDEX_COLUMNS):
            raise ShardError(
                f"index {path} has shape {rows.shape}, expected (n_docs, {INDEX_COLUMNS}); "
                "re-run `plm data prepare --force`"
            )
        return rows

    def _shard_map(self, shard: str) -> mmap.mmap:
        if self._pid != os.getpid():
            # A forked loader worker: the maps it inherited are the parent's objects;
            # drop them (unmapping only in this process) and open its own.
            self._maps, self._pid = OrderedDict(), os.getpid()
        mm = self._maps.get(shard)
        if mm is not None:
            self._maps.move_to_end(shard)
            return mm
        path = self.root / shard
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

    def read(self, shard: str, i: int) -> Document:
        """Random access: the i-th document of a shard, found through the index.

        The sample's bytes are copied out of the shard's memory map (so closing the map
        never invalidates a Document); the Document's arrays are read-only views of them.
        """
        row = self.index(shard)[i].tolist()
        offset, size = row[OFFSET], row[SIZE]
        mm = self._shard_map(shard)
        # The error messages are formatted only on error: read() is on the hot path.
        if offset < 0 or size <= 0 or offset + size > len(mm):
            raise ShardError(
                f"{self.root / shard}: sample {i} at byte {offset} (+{size} bytes) lies "
                f"outside the shard ({len(mm)} bytes): the shard is truncated or its index "
                "is stale; re-run `plm data prepare --force`"
            )
        raw = mm[offset : offset + size]
        try:
            doc = _decode_indexed(raw, row) if len(row) == INDEX_COLUMNS else None
            if doc is None:
                doc = _decode_sample_bytes(raw)
            if doc is None:  # not plain tar headers: webdataset's general reader
                doc = _decode_with_webdataset(raw, f"{shard}#{i}")
        except (tarfile.TarError, ValueError, KeyError) as err:
            # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ShardError(
                f"{self.root / shard}: sample {i} at byte {offset} is corrupt ({err}); "
                "`plm data inspect --verify` checks the whole directory, "
                "`plm data prepare --force` rebuilds it"
            ) from None
        return doc

    def iter_shard(self, shard: str, start: int = 0) -> Iterator[Document]:
        """Stream a shard's documents in order from sample ``start`` (seeking, not skipping)."""
        rows = self.index(shard)
        if start >= len(rows):
            return
        with open(self.root / shard, "rb") as f:
            f.seek(int(rows[start, OFFSET]))
            for sample in _iter_samples(f, shard):
                yield decode_document(sample)

    def iter_split(self, split: str) -> Iterator[Document]:
        """Every document of a split, in the deterministic (source) order."""
        for shard in self.shards(split):
            yield from self.iter_shard(shard["name"])

    def verify(self) -> list[str]:
        """Re-hash every shard and check every index against it; return the problems found."""
        problems = []
        for split in self.manifest["splits"]:
            for shard in self.shards(split):
                path = self.root / shard["name"]
                if not path.is_file():
                    problems.append(f"{shard['name']}: missing")
                    continue
                if sha256_file(path) != shard["sha256"]:
                    problems.append(f"{shard['name']}: sha256 does not match the manifest")
                    continue
                try:
                    rows = self.index(shard["name"])
                except ShardError as err:
                    problems.append(str(err))
                    continue
                if (
                    len(rows) != shard["n_docs"]
                    or int(rows[:, N_TOKENS].sum()) != shard["n_tokens"]
                ):
                    problems.append(f"{shard['name']}: index disagrees with the manifest counts")
                    continue
                n = 0
                for n, doc in enumerate(self.iter_shard(shard["name"]), 1):
                    if doc.n_tokens != rows[n - 1, N_TOKENS]:
                        problems.append(f"{shard['name']}: sample {n - 1} token count != index")
                        break
                    if rows.shape[1] == INDEX_COLUMNS and not _same_document(
                        doc, self, shard["name"], n - 1
                    ):
                        problems.append(
                            f"{shard['name']}: sample {n - 1} read through the index differs "
                            "from the tar (stale index)"
                        )
                        break
                if n != len(rows):
                    problems.append(
                        f"{shard['name']}: {n} samples in the tar, index has {len(rows)}"
                    )
        return problems


def _same_document(doc: Document, data: DataDir, shard: str, i: int) -> bool:
    """Does random access through the index give the document the tar stream gives?"""
    try:
        other = data.read(shard, i)
    except ShardError:
        return False
    arrays = ("tokens", "sents", "words")
    same = all(np.array_equal(getattr(doc, a), getattr(other, a)) for a in arrays)
    spans_same = (doc.spans is None) == (other.spans is None) and (
        doc.spans is None or np.array_equal(doc.spans, other.spans)
    )
    return same and spans_same and doc.key == other.key and doc.meta == other.meta
