"""`plm data prepare`: a Ray Data job turning a corpus into WebDataset shards + manifest.

    read (tasks, one per source)  ->  clean, filter, segment, tokenize, serialize
    (a pool of actors, each holding the tokenizer, one encode_batch per batch)
    ->  the driver, in source order: exact dedup, train/valid split, shard writing

Determinism: every row carries its ordering key (source index, document ordinal, piece)
and Ray Data runs with ``preserve_order``; the driver checks that the keys arrive
strictly increasing, so documents land in shards by source order, never by Ray's block
order (a violation is an error, not a silent reshuffle). The split is a hash of the
cleaned text (``split_of``), dedup keeps the first occurrence in source order.

The driver stays light: actors already serialize each sample to its tar bytes
(``shards.sample_record``) and pack a whole batch into one Arrow row (``_Rows``: the
samples end to end, an int64 table of keys and index columns, dedup keys, strings), the
driver appends slices of those bytes to the current shard. It holds one 16-byte hash per
kept document (for dedup), never the corpus.

Idempotence: the manifest records a fingerprint of (sources' sha256, tokenizer sha256,
output-relevant config, code version); the same fingerprint means "up to date". The
manifest is removed before a rebuild starts and written last, so a run killed half-way
leaves a folder without manifest that the next run cleans and completes.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.config import ConfigError
from pipeline.data.clean import CleanConfig, clean, dedup_key, language_of, reject_reason
from pipeline.data.readers import (
    DEFAULT_MAX_DOC_BYTES,
    InputError,
    RawDocument,
    Source,
    iter_raw_documents,
    python_docs,
    resolve_inputs,
    source_sha256,
)
from pipeline.data.shards import (
    FORMAT_VERSION,
    INDEX_COLUMNS,
    MANIFEST,
    SPLITS,
    TOKENIZER_DIR,
    Document,
    ShardWriter,
    atomic_write_bytes,
    brace_pattern,
    load_manifest,
    meta_json,
    sample_record,
    shard_name,
    split_of,
    token_dtype,
    write_manifest,
)
from pipeline.data.tokenizer import META_FILE, TOKENIZER_FILE, load_tokenizer

# Bump when the code changes what lands in the shards: old outputs stop being "up to date".
PREPARE_VERSION = 1
DEFAULT_SHARD_BYTES = 128 << 20
MAX_REJECT_EXAMPLES = 5  # per reason, kept in the manifest so a reject can be found

_ANY_CJK = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef]")


class PrepareError(ConfigError):
    """The output folder or the inputs cannot be used as they are; the message says why."""


class PrepareConfig(BaseModel):
    """Everything `plm data prepare` needs (configs/data/*.yaml; command-line flags override)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] = Field(min_length=1)  # files, folders, globs, URIs, builtin:NAME
    tokenizer: str  # folder with tokenizer.json + tokenizer_meta.json
    output: str  # the data dir
    valid_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    shard_docs: int | None = Field(None, gt=0)  # samples per shard, or ...
    shard_bytes: int | None = Field(None, gt=0)  # ... bytes per shard (default 128 MiB)
    max_doc_tokens: int = Field(1024, gt=0)  # longer documents are split into pieces
    max_doc_bytes: int = Field(DEFAULT_MAX_DOC_BYTES, gt=0)  # larger ones: "too_long"
    text_field: str = "text"  # jsonl field / parquet column
    # ERNIE's entity-level masking: a UTF-8 file, one entity per line; every mention
    # becomes a token span in spans.npy (see pipeline.data.segment.entity_pattern).
    entities: str | None = None
    clean: CleanConfig = CleanConfig()
    # Execution only (never changes the output bytes):
    ray_address: str | None = None  # a running cluster; else RAY_ADDRESS; else a local Ray
    num_cpus: int | None = Field(None, gt=0)  # CPUs of the local Ray instance
    workers: int | None = Field(None, gt=0)  # tokenizer actors; default: the cluster's CPUs
    batch_docs: int = Field(256, gt=0)  # documents per encode_batch call
    force: bool = False  # rebuild even if up to date / over another data dir

    @model_validator(mode="after")
    def _one_shard_size(self) -> PrepareConfig:
        if self.shard_docs is not None and self.shard_bytes is not None:
            raise ValueError("set shard_docs or shard_bytes, not both")
        return self

    def output_settings(self) -> dict[str, Any]:
        """The settings that decide the output bytes (hashed into data_config_hash)."""
        return {
            "valid_fraction": self.valid_fraction,
            "shard_docs": self.shard_docs,
            "shard_bytes": self.shard_bytes if self.shard_docs else self.effective_shard_bytes,
            "max_doc_tokens": self.max_doc_tokens,
            "max_doc_bytes": self.max_doc_bytes,
            "text_field": self.text_field,
            "clean": self.clean.model_dump(),
            # The list's content decides the bytes, not where the file lives.
            "entities_sha256": None
            if self.entities is None
            else _sha256_json(load_entities(self.entities, self.clean)),
        }

    @property
    def effective_shard_bytes(self) -> int | None:
        if self.shard_docs is not None:
            return None
        return self.shard_bytes or DEFAULT_SHARD_BYTES


# ---------------------------------------------------------------------------
# Config: YAML + flags


def _errors_text(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        lines.append(f"{origin}: key `{key}`: {e['msg']}")
    return "\n".join(lines)


def load_prepare_config(path: str | Path | None, overrides: dict[str, Any]) -> PrepareConfig:
    """YAML file (optional) with the given keys overriding it; errors name the key."""
    data: dict[str, Any] = {}
    origin = "command line"
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"data config {p} does not exist (see configs/data/)")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"data config {p} is not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"data config {p} must be a mapping of keys, got {type(loaded)}")
        data = loaded
        origin = f"data config {p} (+ flags)"
    if "shard_docs" in overrides:  # the flags are exclusive; a flag replaces the file's choice
        data.pop("shard_bytes", None)
    if "shard_bytes" in overrides:
        data.pop("shard_docs", None)
    data.update(overrides)
    try:
        return PrepareConfig(**data)
    except ValidationError as err:
        hint = ""
        missing = {str(e["loc"][0]) for e in err.errors() if e["type"] == "missing"}
        if missing:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in sorted(missing))
            hint = f"\n(pass {flags} or set the key in a --config file)"
        raise ConfigError(_errors_text(err, origin) + hint) from None


_FLAG_KEYS = {
    "input": "inputs",
    "tokenizer": "tokenizer",
    "output": "output",
    "valid_fraction": "valid_fraction",
    "shard_docs": "shard_docs",
    "shard_bytes": "shard_bytes",
    "max_doc_tokens": "max_doc_tokens",
    "text_field": "text_field",
    "entities": "entities",
    "ray_address": "ray_address",
    "num_cpus": "num_cpus",
}


def config_from_cli(args: argparse.Namespace) -> PrepareConfig:
    overrides = {
        key: getattr(args, flag)
        for flag, key in _FLAG_KEYS.items()
        if getattr(args, flag, None) is not None
    }
    if getattr(args, "force", False):
        overrides["force"] = True
    return load_prepare_config(args.config, overrides)


def prepare_from_cli(args: argparse.Namespace) -> int:
    run_prepare(config_from_cli(args))
    return 0


# ---------------------------------------------------------------------------
# Validation, fingerprint, the output folder


def load_entities(path: str | Path, clean_cfg: CleanConfig) -> list[str]:
    """The entity list, cleaned like the documents (so "Ｐａｒｉｓ" matches NFKC'd text);
    blank lines and lines starting with # are skipped. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"entity list {path} does not exist (one entity per line, UTF-8)")
    entities = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(
                    f"entity list {path} line {number} is not valid UTF-8 ({err.reason}); "
                    "save the file as UTF-8"
                ) from None
            entity = clean(line, clean_cfg).strip()
            if entity and not entity.startswith("#"):
                entities.append(entity)
    if not entities:
        raise InputError(f"entity list {path} holds no entity (one per line, # for comments)")
    return sorted(set(entities))


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


_OWN_TOP = {MANIFEST, MANIFEST + ".tmp", *SPLITS, TOKENIZER_DIR}
_OWN_SHARD = re.compile(r"shard-\d{6}(\.tar|\.idx\.npy)(\.tmp)?")
_OWN_TOKENIZER = {TOKENIZER_FILE, META_FILE, TOKENIZER_FILE + ".tmp", META_FILE + ".tmp"}


def foreign_files(out: Path) -> list[str]:
    """Paths in ``out`` that `plm data prepare` did not write (relative, sorted)."""
    if not out.exists():
        return []
    found = []
    for entry in sorted(out.iterdir()):
        name = entry.name
        if name not in _OWN_TOP:
            found.append(name)
        elif name in SPLITS or name == TOKENIZER_DIR:
            if not entry.is_dir():
                found.append(name)
                continue
            allowed = _OWN_TOKENIZER if name == TOKENIZER_DIR else None
            for sub in sorted(entry.iterdir()):
                ok = sub.name in allowed if allowed else bool(_OWN_SHARD.fullmatch(sub.name))
                if not ok or not sub.is_file():
                    found.append(f"{name}/{sub.name}")
    return found


def _clear_own_files(out: Path) -> None:
    """Remove the manifest first (the folder stops being 'finished'), then our shards."""
    for name in (MANIFEST, MANIFEST + ".tmp"):
        (out / name).unlink(missing_ok=True)
    for sub in (*SPLITS, TOKENIZER_DIR):
        folder = out / sub
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            if f.is_file() and (_OWN_SHARD.fullmatch(f.name) or f.name in _OWN_TOKENIZER):
                f.unlink()


def _source_entries(sources: list[Source]) -> list[dict[str, Any]]:
    return [
        {"uri": s.uri, "format": s.format, "size": s.size, "sha256": source_sha256(s)}
        for s in sources
    ]


def fingerprint(config_hash: str, sources: list[dict[str, Any]], tokenizer_sha: str) -> str:
    return _sha256_json(
        {
            "format_version": FORMAT_VERSION,
            "prepare_version": PREPARE_VERSION,
            "data_config_hash": config_hash,
            "sources": [(s["uri"], s["sha256"]) for s in sources],
            "tokenizer": tokenizer_sha,
        }
    )


def _existing_manifest(out: Path) -> dict[str, Any] | None:
    if not (out / MANIFEST).is_file():
        return None
    try:
        return load_manifest(out)
    except Exception:  # unreadable or an older format: treat it as another data dir
        return {}


# ---------------------------------------------------------------------------
# The Ray stages (module level so Ray pickles them by reference)


def read_sources(
    batch: dict[str, np.ndarray],
    sources: list[Source],
    max_doc_bytes: int,
    block_docs: int,
    builtin_docs: tuple[str, ...] | None = None,
):
    """Map stage: source indexes -> blocks of raw documents, streamed, in file order.

    ``builtin_docs``: the documents of builtin:python-docs as the driver built them for
    the source's size and sha256. Extracting them again here took seconds, and could
    differ: part of them are live docstrings of builtin modules, and importing Ray
    replaces ``sys.excepthook`` (its docstring went missing in a Ray worker).
    """
    import pyarrow as pa

    def block(cols: dict[str, list]) -> pa.Table:
        return pa.table(
            {
                "source": pa.array(cols["source"], pa.int32()),
                "ordinal": pa.array(cols["ordinal"], pa.int64()),
                "text": pa.array(cols["text"], pa.large_string()),
                "reject": pa.array(cols["reject"], pa.string()),
                "line": pa.array(cols["line"], pa.int64()),
                "detail": pa.array(cols["detail"], pa.string()),
            }
        )

    names = ("source", "ordinal", "text", "reject", "line", "detail")
    for index in batch["source"]:
        index = int(index)
        cols: dict[str, list] = {k: [] for k in names}
        source = sources[index]
        if source.format == "builtin" and builtin_docs is not None:
            # What readers' builtin reader yields, from the driver's copy.
            docs = (RawDocument(source.uri, k, t) for k, t in enumerate(builtin_docs))
        else:
            docs = iter_raw_documents(source, max_doc_bytes)
        for doc in docs:
            cols["source"].append(index)
            cols["ordinal"].append(doc.ordinal)
            cols["text"].append(doc.text or "")
            cols["reject"].append(doc.reject or "")
            cols["line"].append(doc.line or 0)
            cols["detail"].append(doc.detail or "")
            if len(cols["source"]) >= block_docs:
                yield block(cols)
                cols = {k: [] for k in names}
        if cols["source"]:
            yield block(cols)


class Encoder:
    """Actor stage: clean, filter, tokenize (one encode_batch per batch), segment, serialize.

    Covers every input document, in input order: one row per piece of a kept document,
    one per rejected document. Returns them packed as ONE Arrow row per batch (see
    ``_Rows``): Ray then moves four binary cells per batch instead of a dozen columns of
    per-sample Python objects, which cost it more than the serialization itself.
    """

    def __init__(
        self,
        tokenizer_dir: str,
        source_ids: list[str],
        source_uris: list[str],
        clean_cfg: dict[str, Any],
        valid_fraction: float,
        max_doc_tokens: int,
        entities: list[str] | None = None,
    ):
        # One tokenizer thread per actor: the actors (one per CPU) are the parallelism.
        # Set before the first encode, which is when the Rust thread pool is built.
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from pipeline.data.segment import Segmenter, entity_pattern

        tokenizer, meta = load_tokenizer(tokenizer_dir)
        self.segment = Segmenter(
            tokenizer, max_doc_tokens, entity_pattern(entities) if entities else None
        )
        self.dtype = token_dtype(meta["vocab_size"])
        self.source_ids = source_ids
        self.source_uris = source_uris
        self.clean_cfg = CleanConfig(**clean_cfg)
        self.valid_fraction = valid_fraction
        self._meta_parts = _meta_template

    def __call__(self, batch: dict[str, np.ndarray]):
        sources, ordinals = batch["source"].tolist(), batch["ordinal"].tolist()
        lines, raw_texts = batch["line"].tolist(), batch["text"]
        read_rejects, details = batch["reject"], batch["detail"]
        n = len(sources)
        reasons: list[str | None] = [None] * n
        kept, texts, langs = [], [], []
        for i in range(n):
            reason = read_rejects[i] or None
            if reason is None:
                text = clean(raw_texts[i], self.clean_cfg)
                reason = reject_reason(text, self.clean_cfg)
                if reason is None:
                    kept.append(i)
                    texts.append(text)
                    langs.append(_language(text))
            reasons[i] = reason
        pieces = self.segment(texts, langs)
        done = dict(zip(kept, zip(texts, langs, pieces, strict=True), strict=True))
        rows = _Rows()
        for i in range(n):
            source, ordinal = sources[i], ordinals[i]
            if reasons[i] is not None:
                rows.reject(source, ordinal, reasons[i], lines[i], details[i])
                continue
            text, lang, doc_pieces = done[i]
            if not doc_pieces:
                rows.reject(source, ordinal, "no_tokens", lines[i], "")
                continue
            key = dedup_key(text)
            split = split_of(text, self.valid_fraction)
            prefix = f"{self.source_ids[source]}-{ordinal:010d}-"
            uri = self.source_uris[source]
            meta_head, meta_tail = self._meta_parts(uri, lang)
            for k, piece in enumerate(doc_pieces):
                meta = {"source": uri, "language": lang, "n_tokens": piece.n_tokens}
                doc = Document(
                    key=f"{prefix}{k:04d}",
                    tokens=piece.tokens,
                    sents=piece.sents,
                    words=piece.words,
                    spans=piece.spans,
                    meta=meta,
                )
                meta_bytes = b"%s%d%s" % (meta_head, piece.n_tokens, meta_tail)
                data, columns = sample_record(doc, self.dtype, meta_bytes)
                rows.sample(source, ordinal, k, split, data, columns, key, lang)
        return rows.table()


@functools.cache
def _meta_template(uri: str, language: str) -> tuple[bytes, bytes]:
    """meta_json({"source": uri, "language": language, "n_tokens": N}) cut around N, so a
    sample's meta.json is one %-format, not a json.dumps (tests check the bytes equal).

    The first '"n_tokens": 0' is the key's: inside a JSON string a quote is escaped."""
    full = meta_json({"source": uri, "language": language, "n_tokens": 0})
    head, key, tail = full.partition(b'"n_tokens": 0')
    return head + key[:-1], tail


def _language(text: str) -> str:
    """``language_of``, skipping its letter count when the answer is sure: ASCII text
    (``isascii`` is a flag lookup) or no CJK ideograph at all means share 0, "other"."""
    if text.isascii() or not _ANY_CJK.search(text):
        return "other"
    return language_of(text)


# One int64 row per output row of a batch: its ordering key, its split (-1: rejected), the
# reader's line (rejects), the sample's byte size, then its index columns (shards').
_KEY_COLUMNS = ("source", "ordinal", "piece", "split", "line", "size")
_N_INTS = len(_KEY_COLUMNS) + INDEX_COLUMNS - 2
_SPLIT_CODES = {split: code for code, split in enumerate(SPLITS)}
_NO_INDEX = (0,) * (INDEX_COLUMNS - 2)  # the index columns of a rejected document's row
_NO_DEDUP = bytes(16)  # dedup_key's size
_PACKED = ("ints", "samples", "dedup", "strings")  # the cells of a packed batch, in order


class _Rows:
    """The output rows of one batch, packed into one Arrow row of four cells:

    ``ints``: int64 (rows, _N_INTS) bytes; ``samples``: the samples' bytes end to end (the
    ``size`` column cuts them); ``dedup``: 16 bytes per row (the dedup key of a piece, zeros
    for a reject); ``strings``: JSON [reject, language, detail] per row.
    """

    def __init__(self):
        self.ints: list[int] = []
        self.samples: list[bytes] = []
        self.dedup: list[bytes] = []
        self.strings: list[tuple[str, str, str]] = []

    def reject(self, source: int, ordinal: int, reason: str, line: int, detail: str) -> None:
        self.ints += (source, ordinal, 0, -1, line, 0, *_NO_INDEX)
        self.dedup.append(_NO_DEDUP)
        self.strings.append((reason, "", detail))

    def sample(
        self,
        source: int,
        ordinal: int,
        piece: int,
        split: str,
        data: bytes,
        columns: tuple[int, ...],
        dedup: bytes,
        language: str,
    ) -> None:
        self.ints += (source, ordinal, piece, _SPLIT_CODES[split], 0, len(data), *columns)
        self.samples.append(data)
        self.dedup.append(dedup)
        self.strings.append(("", language, ""))

    def table(self):
        import pyarrow as pa

        cells = (
            np.array(self.ints, dtype=np.int64).tobytes(),
            b"".join(self.samples),
            b"".join(self.dedup),
            json.dumps(self.strings, ensure_ascii=False).encode("utf-8"),
        )

        def cell(data: bytes):  # a one-value binary column over data's buffer (no copy)
            offsets = pa.py_buffer(np.array([0, len(data)], dtype=np.int64))
            return pa.LargeBinaryArray.from_buffers(
                pa.large_binary(), 1, [None, offsets, pa.py_buffer(data)]
            )

        return pa.table({k: cell(v) for k, v in zip(_PACKED, cells, strict=True)})


def unpack_rows(ints, samples, dedup: bytes, strings: bytes):
    """The rows ``_Rows`` packed: (source, ordinal, piece, split or "", line, sample bytes,
    index columns, dedup key, reject, language, detail) each, in order. ``ints`` and
    ``samples``: bytes or any buffer (the samples come back as memoryview slices)."""
    table = np.frombuffer(ints, dtype=np.int64).reshape(-1, _N_INTS).tolist()
    texts = json.loads(strings)
    if len(texts) != len(table) or len(dedup) != 16 * len(table):
        raise RuntimeError("a packed batch of the prepare actors is inconsistent")
    view = memoryview(samples)
    at = 0
    for i, (row, (reject, language, detail)) in enumerate(zip(table, texts, strict=True)):
        source, ordinal, piece, split, line, size = row[:6]
        yield (
            source,
            ordinal,
            piece,
            SPLITS[split] if split >= 0 else "",
            line,
            view[at : at + size],
            tuple(row[6:]),
            dedup[16 * i : 16 * i + 16],
            reject,
            language,
            detail,
        )
        at += size
    if at != len(view):
        raise RuntimeError("a packed batch of the prepare actors is inconsistent")


# ---------------------------------------------------------------------------
# The driver: ordered consumption, dedup, shard writing


class _SplitWriter:
    """Rolls shards of one split: a new shard after ``shard_docs`` samples / ``shard_bytes``."""

    def __init__(
        self, root: Path, split: str, dtype, shard_docs: int | None, shard_bytes: int | None
    ):
        self.root, self.split, self.dtype = root, split, dtype
        self.shard_docs, self.shard_bytes = shard_docs, shard_bytes
        self.entries: list[dict[str, Any]] = []
        self.writer: ShardWriter | None = None
        self.docs = self.bytes = 0

    def add(self, data: bytes, columns: tuple[int, ...]) -> None:
        if self.writer is None:
            self.writer = ShardWriter(
                self.root, shard_name(self.split, len(self.entries)), self.dtype
            )
            self.docs = self.bytes = 0
        self.writer.write_bytes(data, columns)
        self.docs += 1
        self.bytes += len(data)
        if (self.shard_docs and self.docs >= self.shard_docs) or (
            self.shard_bytes and self.bytes >= self.shard_bytes
        ):
            self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.entries.append(self.writer.close())
            self.writer = None

    def finish(self) -> dict[str, Any]:
        self._close()
        n = len(self.entries)
        return {
            "shards": self.entries,
            "n_docs": sum(e["n_docs"] for e in self.entries),
            "n_tokens": sum(e["n_tokens"] for e in self.entries),
            "pattern": brace_pattern(self.split, n) if n else "",
        }


class _Tally:
    """What the driver counts while writing: kept, rejected (with examples), languages."""

    def __init__(self, n_sources: int):
        self.rejected: Counter[str] = Counter()
        self.examples: dict[str, list[dict[str, Any]]] = {}
        self.read = [0] * n_sources
        self.kept = [0] * n_sources
        self.languages: Counter[str] = Counter()

    def reject(self, reason: str, source_uri: str, ordinal: int, line: int, detail: str) -> None:
        self.rejected[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < MAX_REJECT_EXAMPLES:
            example = {"source": source_uri, "ordinal": ordinal}
            if line:
                example["line"] = line
            if detail:
                example["detail"] = detail
            examples.append(example)


def _write_ordered(tables, out: Path, dtype, cfg: PrepareConfig, uris: list[str]):
    """Consume the ordered stream: check order, dedup, split, write. Returns splits + tally.

    ``tables``: pyarrow batches of the Encoder's packed rows (``_Rows``)."""
    writers = {
        split: _SplitWriter(out, split, dtype, cfg.shard_docs, cfg.effective_shard_bytes)
        for split in SPLITS
    }
    tally = _Tally(len(uris))
    seen: set[bytes] = set()
    last = (-1, -1, -1)
    skip_doc = (-1, -1)  # (source, ordinal) of a duplicate whose pieces are skipped
    for table in tables:
        packed = [table.column(k) for k in _PACKED]
        for j in range(table.num_rows):
            # The cells' own buffers (no copy of the samples); dedup keys as bytes for `seen`.
            ints, samples, dedup, strings = (column[j].as_buffer() for column in packed)
            rows = unpack_rows(ints, samples, dedup.to_pybytes(), strings.to_pybytes())
            for s, o, p, split, line, data, columns, key, reject, lang, detail in rows:
                if (s, o, p) <= last:
                    raise RuntimeError(
                        f"document order broken: {(s, o, p)} after {last}; refusing to write "
                        "shards in a non-deterministic order"
                    )
                last = (s, o, p)
                if p == 0:
                    tally.read[s] += 1
                if reject:
                    tally.reject(reject, uris[s], o, line, detail)
                    continue
                if p == 0:
                    if key in seen:
                        skip_doc = (s, o)
                        tally.reject("duplicate", uris[s], o, 0, "")
                        continue
                    seen.add(key)
                    tally.kept[s] += 1
                    tally.languages[lang] += 1
                elif (s, o) == skip_doc:
                    continue
                writers[split].add(data, columns)
    return {split: w.finish() for split, w in writers.items()}, tally


# ---------------------------------------------------------------------------
# Ray


def _init_ray(cfg: PrepareConfig) -> bool:
    """Connect to / start Ray; True when this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        ray.init(
            num_cpus=cfg.num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
    return True


def _import_in_background(*modules: str) -> None:
    """Import modules the driver needs later in a thread, while it waits for Ray to start.

    ``ray.data`` (~0.5 s) would otherwise be imported on the pipeline's critical path. Python's
    per-module import locks make a concurrent import of the same module wait for this one.
    """

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # the main thread's own import reports it
                pass

    threading.Thread(target=run, name="plm-prepare-imports", daemon=True).start()


def _ordered_batches(cfg: PrepareConfig, sources: list[Source], source_ids: list[str]):
    """The Ray Data pipeline; yields pyarrow batches of packed rows (``_Rows``) in order."""
    import ray
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = sys.stderr.isatty()
    ctx.enable_auto_log_stats = False
    cpus = int(ray.cluster_resources().get("CPU", 1))
    workers = cfg.workers or max(1, cpus)
    # Ray Data merges what a task yields into blocks of up to target_max_block_size, and
    # the actor pool spreads blocks, not rows. At least 8 blocks per actor, of at most
    # 4 MiB (1-2 s of an actor's work), with 2 in flight per actor (one running, one
    # queued): the actors take blocks as they free up, so they finish within about one
    # block of each other. With 4 in flight and 4 per actor the pool dealt all blocks out
    # at the start, and one actor could end 1-2 s after the other.
    total = sum(s.size for s in sources)
    ctx.target_max_block_size = min(4 << 20, max(64 << 10, total // (workers * 8)))
    ds = ray.data.from_items(
        [{"source": i} for i in range(len(sources))], override_num_blocks=len(sources)
    )
    # Reading is light next to tokenizing: read tasks take no CPU slot, so the actors
    # (one per CPU) keep every core busy and a 1-CPU cluster cannot deadlock.
    ds = ds.map_batches(
        read_sources,
        batch_size=1,
        fn_kwargs={
            "sources": sources,
            "max_doc_bytes": cfg.max_doc_bytes,
            "block_docs": cfg.batch_docs,
            # The driver extracted them already (resolve_inputs, source_sha256: cached).
            "builtin_docs": python_docs() if any(s.format == "builtin" for s in sources) else None,
        },
        compute=ray.data.TaskPoolStrategy(size=max(1, min(len(sources), workers))),
        num_cpus=0,
    )
    ds = ds.map_batches(
        Encoder,
        batch_size=cfg.batch_docs,
        batch_format="numpy",  # in: numpy columns; out: one packed Arrow row (see _Rows)
        fn_constructor_kwargs={
            "tokenizer_dir": str(Path(cfg.output) / TOKENIZER_DIR),
            "source_ids": source_ids,
            "source_uris": [s.uri for s in sources],
            "clean_cfg": cfg.clean.model_dump(),
            "valid_fraction": cfg.valid_fraction,
            "max_doc_tokens": cfg.max_doc_tokens,
            "entities": load_entities(cfg.entities, cfg.clean) if cfg.entities else None,
        },
        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=2),
        num_cpus=1,
    )
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=4)
    if os.environ.get("PLM_RAY_STATS"):  # per-stage wall/CPU time, for tuning
        print(ds.stats(), file=sys.stderr)


# ---------------------------------------------------------------------------
# The job


def run_prepare(cfg: PrepareConfig) -> Path:
    """Validate, then (unless up to date) run the Ray job and write the data dir."""
    out = Path(cfg.output).resolve()
    # 1. Validate everything before Ray starts.
    sources = resolve_inputs(cfg.inputs, text_field=cfg.text_field)
    tok_dir = Path(cfg.tokenizer)
    if not tok_dir.is_dir():
        raise InputError(
            f"tokenizer folder {tok_dir} does not exist: train one with `plm data tokenizer`"
        )
    _, meta = load_tokenizer(tok_dir)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"output {out} exists and is not a folder")
    config_hash = _sha256_json(cfg.output_settings())
    entries = _source_entries(sources)
    fp = fingerprint(config_hash, entries, meta["sha256"])
    existing = _existing_manifest(out)
    if existing and existing.get("fingerprint") == fp and not cfg.force:
        print(f"{out}: up to date (same inputs, tokenizer and config); --force rebuilds it")
        return out
    foreign = foreign_files(out)
    if foreign and not cfg.force:
        shown = ", ".join(foreign[:10]) + (
            f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        )
        raise PrepareError(
            f"output {out} holds files `plm data prepare` did not write: {shown}. "
            "Choose an empty or new --output, or pass --force (they are left in place)."
        )
    if existing is not None and not cfg.force:
        raise PrepareError(
            f"output {out} holds a data dir prepared from other inputs, tokenizer or config; "
            "pass --force to replace it or choose another --output"
        )

    # 2. Start clean: no manifest until the end, no stale shards or temp files.
    out.mkdir(parents=True, exist_ok=True)
    _clear_own_files(out)
    (out / TOKENIZER_DIR).mkdir(exist_ok=True)
    for name in (TOKENIZER_FILE, META_FILE):
        atomic_write_bytes(out / TOKENIZER_DIR / name, (tok_dir / name).read_bytes())
    dtype = token_dtype(meta["vocab_size"])

    # 3. The Ray job, consumed in order on the driver.
    started = time.perf_counter()
    _import_in_background("ray.data")  # while the main thread starts Ray
    own_ray = _init_ray(cfg)
    ray_ready = time.perf_counter()
    try:
        source_ids = [e["sha256"][:16] for e in entries]
        batches = _ordered_batches(cfg, sources, source_ids)
        splits, tally = _write_ordered(batches, out, dtype, cfg, [s.uri for s in sources])
    finally:
        ray_stop = time.perf_counter()
        if own_ray:
            import ray

            ray.shutdown()
        ray_stop = time.perf_counter() - ray_stop

    # 4. The manifest, last and atomically.
    for entry, n_read, n_kept in zip(entries, tally.read, tally.kept, strict=True):
        entry["n_docs_read"], entry["n_docs_kept"] = n_read, n_kept
    all_shards = [s for info in splits.values() for s in info["shards"]]
    manifest = {
        "format_version": FORMAT_VERSION,
        "prepare_version": PREPARE_VERSION,
        "fingerprint": fp,
        "data_config_hash": config_hash,
        "data_config": cfg.output_settings(),
        "tokenizer": {
            "path": TOKENIZER_DIR,
            "fingerprint": meta["sha256"],
            "kind": meta["kind"],
            "vocab_size": meta["vocab_size"],
        },
        "token_dtype": dtype.name,
        "sources": entries,
        "splits": splits,
        "totals": {
            "n_docs": sum(info["n_docs"] for info in splits.values()),
            "n_tokens": sum(info["n_tokens"] for info in splits.values()),
            "n_shards": len(all_shards),
            "bytes": sum(s["bytes"] for s in all_shards),
            "documents_read": sum(tally.read),
            "documents_kept": sum(tally.kept),
            "languages": dict(sorted(tally.languages.items())),
        },
        "rejected": dict(sorted(tally.rejected.items())),
        "reject_examples": dict(sorted(tally.examples.items())),
    }
    write_manifest(out, manifest)
    seconds = time.perf_counter() - started
    totals = manifest["totals"]
    per_split = ", ".join(f"{k} {v['n_docs']:,}" for k, v in splits.items())
    rejects = ", ".join(f"{k} {v:,}" for k, v in sorted(tally.rejected.items()))
    print(
        f"{out}: {totals['n_docs']:,} samples, {totals['n_tokens']:,} tokens in "
        f"{totals['n_shards']} shards ({per_split}); "
        f"rejected {sum(tally.rejected.values()):,} ({rejects or 'none'}); {seconds:.1f}s "
        f"(ray start {ray_ready - started:.1f}s, "
        f"pipeline {seconds - (ray_ready - started) - ray_stop:.1f}s, ray stop {ray_stop:.1f}s)"
    )
    if splits["valid"]["n_docs"] == 0 and cfg.valid_fraction > 0:
        print(
            f"warning: no document fell into the valid split (valid_fraction={cfg.valid_fraction})"
        )
    return out
