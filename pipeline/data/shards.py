"""The shard contract: WebDataset tar shards of plain documents, a per-shard index, a manifest.

A data directory (see DESIGN.md, "Shards") holds::

    manifest.json                     written last, atomically
    tokenizer/tokenizer.json          the tokenizer the ids come from (+ tokenizer_meta.json)
    train/shard-000000.tar            one sample per document, deterministic bytes
    train/shard-000000.idx.npy        int64 rows (byte offset, byte size, n_tokens) per sample
    valid/shard-000000.tar ...

Writing goes through ``webdataset.TarWriter`` with a fixed mtime, owner and mode and
members sorted by name, so the same documents give the same bytes. Reading goes
through webdataset's tar iterators, either from the start of a shard or from any
sample, found by seeking to the byte offset the index records.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

FORMAT_VERSION = 1
SPLITS = ("train", "valid")
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
INDEX_SUFFIX = ".idx.npy"
# Index columns.
OFFSET, SIZE, N_TOKENS = 0, 1, 2


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


def encode_document(doc: Document, dtype: np.dtype) -> dict[str, Any]:
    if "." in doc.key:
        raise ValueError(f"sample key {doc.key!r} must not contain dots")
    sample: dict[str, Any] = {
        "__key__": doc.key,
        "tokens.npy": _npy_bytes(np.ascontiguousarray(doc.tokens, dtype=dtype)),
        "sents.npy": _npy_bytes(np.ascontiguousarray(doc.sents, dtype=np.int32)),
        "words.npy": _npy_bytes(np.ascontiguousarray(doc.words, dtype=np.int32)),
        "meta.json": json.dumps(doc.meta, sort_keys=True, ensure_ascii=False).encode("utf-8"),
    }
    if doc.spans is not None:
        sample["spans.npy"] = _npy_bytes(np.ascontiguousarray(doc.spans, dtype=np.int32))
    return sample


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
        self._tar = wds.TarWriter(self._file, user="", group="", mode=0o644, mtime=0.0)
        self._rows: list[tuple[int, int, int]] = []
        self.n_tokens = 0

    def write(self, doc: Document) -> None:
        start = self._tar.tarstream.offset
        self._tar.write(encode_document(doc, self.dtype))
        self._rows.append((start, self._tar.tarstream.offset - start, doc.n_tokens))
        self.n_tokens += doc.n_tokens

    def close(self) -> dict[str, Any]:
        """Finish the tar, rename it into place, write the index; return the manifest entry."""
        self._tar.close()  # writes the end-of-archive blocks
        if not self._file.closed:
            self._file.close()
        os.replace(self._tmp, self.path)
        index = np.asarray(self._rows, dtype=np.int64).reshape(-1, 3)
        atomic_write_bytes(self.root / index_name(self.name), _npy_bytes(index))
        return {
            "name": self.name,
            "index": index_name(self.name),
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
    return group_by_keys(tar_file_expander([{"url": url, "stream": fileobj}]))


class DataDir:
    """Read access to a prepared data directory: manifest, indexes, documents."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = load_manifest(self.root)
        self._indexes: dict[str, np.ndarray] = {}

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
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise ShardError(f"index {path} has shape {rows.shape}, expected (n_docs, 3)")
        return rows

    def read(self, shard: str, i: int) -> Document:
        """Random access: the i-th document of a shard, found through the index."""
        offset, size, _ = self.index(shard)[i]
        with open(self.root / shard, "rb") as f:
            f.seek(int(offset))
            raw = f.read(int(size))
        samples = list(_iter_samples(io.BytesIO(raw), f"{shard}#{i}"))
        if len(samples) != 1:
            raise ShardError(f"{self.root / shard}: sample {i} at byte {offset} is corrupt")
        return decode_document(samples[0])

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
                if n != len(rows):
                    problems.append(
                        f"{shard['name']}: {n} samples in the tar, index has {len(rows)}"
                    )
        return problems
