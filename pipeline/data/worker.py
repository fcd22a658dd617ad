"""The worker stage of `plm data prepare`: what one Ray task does with one unit of work.

A unit is a run of consecutive ``Slice``s of the corpus (byte ranges of big files, or
several small files), numbered in source order. Two passes over it:

1. ``unit_keys``: read, clean, filter; the dedup key of every document that survives,
   hash-partitioned (``dedup.partition``) for the reducers.
2. ``write_unit``: read, clean, filter again, drop the duplicates the reducers found,
   tokenize and segment (one ``encode_batch`` per ``batch_docs`` documents), and write
   the unit's own shards (``train/part-UUUUUU-KKK.tar``, ``valid/...``) straight to the
   output filesystem. Returns counts and the part entries, never documents.

Documents are numbered inside a unit by their position among everything read (rejects
included), so (unit, position) is the document's place in source order.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.data.clean import (
    CleanConfig,
    clean_many,
    dedup_key,
    language_of,
    reject_reason,
)
from pipeline.data.readers import RawDocument, Slice, Source, iter_raw_documents
from pipeline.data.shards import SPLITS, ShardWriter, split_of

MAX_REJECT_EXAMPLES = 5  # per reason and unit; the driver keeps the first 5 overall


@dataclass(frozen=True)
class JobSpec:
    """What every task needs, put in Ray's object store once."""

    sources: list[Source]
    output: str  # the data dir, as a path of ``fs`` (pyarrow filesystem)
    fs: Any
    tokenizer_json: str
    vocab_size: int
    clean: dict[str, Any]
    valid_fraction: float
    max_doc_tokens: int
    max_doc_bytes: int
    shard_docs: int | None
    shard_bytes: int | None
    block_tokens: int
    batch_docs: int
    entities: list[str] | None
    builtin_docs: tuple[str, ...] | None = None


@dataclass
class UnitResult:
    """What ``write_unit`` returns: parts per split and the unit's counts."""

    unit: int
    parts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    read: Counter = field(default_factory=Counter)  # source index -> documents read
    kept: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    languages: Counter = field(default_factory=Counter)
    n_tokens: int = 0
    input_bytes: int = 0
    cpu_seconds: float = 0.0  # the task's, set by job._write_task
    node: str = ""  # the Ray node that wrote the parts


def part_name(split: str, unit: int, k: int) -> str:
    return f"{split}/part-{unit:06d}-{k:03d}.tar"


def _documents(spec: JobSpec, unit: list[Slice]) -> Iterator[tuple[int, Slice, RawDocument]]:
    """(position in the unit, slice, raw document) for everything the unit reads."""
    position = 0
    for part in unit:
        source = spec.sources[part.source]
        if source.format == "builtin" and spec.builtin_docs is not None:
            # The driver's copy: its docstrings can differ in a Ray worker (see readers).
            docs = (RawDocument(source.uri, k, t) for k, t in enumerate(spec.builtin_docs))
        else:
            docs = iter_raw_documents(source, spec.max_doc_bytes, part)
        for doc in docs:
            yield position, part, doc
            position += 1


_CLEAN_GROUP = 256  # documents cleaned together (clean_many)


def _cleaned_documents(
    spec: JobSpec, unit: list[Slice], cfg: CleanConfig
) -> Iterator[tuple[int, Slice, RawDocument, str | None, str | None]]:
    """(position, slice, raw document, cleaned text or None, reject reason or None) of
    everything the unit reads, in order: ``_cleaned`` of each, cleaned a group at a time."""
    group: list[tuple[int, Slice, RawDocument]] = []

    def done() -> Iterator[tuple[int, Slice, RawDocument, str | None, str | None]]:
        texts = iter(clean_many([doc.text or "" for _, _, doc in group if not doc.reject], cfg))
        for position, part, doc in group:
            if doc.reject:
                yield position, part, doc, None, doc.reject
                continue
            text = next(texts)
            reason = reject_reason(text, cfg)
            yield position, part, doc, (None if reason else text), reason
        group.clear()

    for item in _documents(spec, unit):
        group.append(item)
        if len(group) >= _CLEAN_GROUP:
            yield from done()
    yield from done()


def unit_keys(spec: JobSpec, unit: list[Slice], n_partitions: int):
    """Pass 1: the dedup keys of the unit's surviving documents, partitioned."""
    from pipeline.data.dedup import partition

    cfg = CleanConfig(**spec.clean)
    keys, positions = [], []
    for position, _, _, text, _ in _cleaned_documents(spec, unit, cfg):
        if text is not None:
            keys.append(dedup_key(text))
            positions.append(position)
    return partition(b"".join(keys), np.asarray(positions, dtype=np.int64), n_partitions)


class _SplitParts:
    """Rolls the unit's parts of one split: a new part after shard_docs / shard_bytes."""

    def __init__(self, spec: JobSpec, unit: int, split: str, dtype: np.dtype):
        self.spec, self.unit, self.split, self.dtype = spec, unit, split, dtype
        self.entries: list[dict[str, Any]] = []
        self.writer: ShardWriter | None = None

    def _open(self) -> None:
        spec = self.spec
        k = len(self.entries)
        self.writer = ShardWriter(
            spec.fs,
            spec.output,
            part_name(self.split, self.unit, k),
            f"u{self.unit:06d}{self.split[0]}{k:03d}",
            self.dtype,
            spec.block_tokens,
            spec.entities is not None,
        )

    def add(self, piece, source: str, language: str) -> None:
        spec = self.spec
        if self.writer is None:
            self._open()
        w = self.writer
        w.add(piece.tokens, piece.sents, piece.words, piece.spans, source, language)
        if (spec.shard_docs and w.n_docs >= spec.shard_docs) or (
            spec.shard_bytes and w.size_estimate() >= spec.shard_bytes
        ):
            self.close()

    def add_many(self, pieces, sources: list[str], languages: list[str]) -> None:
        """A batch of pieces (``segment.PieceBatch``; ``sources``/``languages`` one name per
        piece): the same parts as ``add`` piece by piece, with a few numpy calls per block."""
        spec = self.spec
        ends, i = pieces.ends, 0
        while i < len(ends):
            if self.writer is None:
                self._open()
            i, stopped = self.writer.add_many(
                pieces.tokens,
                ends,
                pieces.sents,
                pieces.words,
                pieces.spans,
                sources,
                languages,
                stop_docs=spec.shard_docs,
                stop_bytes=spec.shard_bytes,
                first=i,
            )
            if stopped:
                self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.entries.append(self.writer.close())
            self.writer = None


def write_unit(spec: JobSpec, index: int, unit: list[Slice], duplicates: set[int]) -> UnitResult:
    """Pass 2: tokenize the unit's kept documents and write its parts; see the module doc."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # one task per CPU is the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    from pipeline.data.segment import Segmenter, entity_pattern
    from pipeline.data.shards import token_dtype

    tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    segment = Segmenter(
        tokenizer,
        spec.max_doc_tokens,
        entity_pattern(spec.entities) if spec.entities else None,
    ).batch
    dtype = token_dtype(spec.vocab_size)
    cfg = CleanConfig(**spec.clean)
    result = UnitResult(index)
    result.input_bytes = sum(part.size for part in unit)
    parts = {split: _SplitParts(spec, index, split, dtype) for split in SPLITS}

    def reject(reason: str, part: Slice, doc: RawDocument) -> None:
        result.rejected[reason] += 1
        examples = result.examples.setdefault(reason, [])
        if len(examples) < MAX_REJECT_EXAMPLES:
            example: dict[str, Any] = {"source": doc.source, "ordinal": doc.ordinal}
            if part.start:
                example["from_byte"] = part.start  # ordinal and line count from there
            if part.row_groups is not None:
                example["row_groups"] = list(part.row_groups)
            if doc.line:
                example["line"] = doc.line
            if doc.detail:
                example["detail"] = doc.detail
            examples.append(example)

    batch: list[tuple[Slice, RawDocument, str, str]] = []

    def flush() -> None:
        pieces = segment([t for _, _, t, _ in batch], [lang for *_, lang in batch])
        counts = np.bincount(pieces.docs, minlength=len(batch)).tolist()
        doc_split = np.zeros(len(batch), dtype=np.int64)
        for d, ((part, doc, text, lang), n) in enumerate(zip(batch, counts, strict=True)):
            if not n:
                reject("no_tokens", part, doc)
                continue
            result.kept[part.source] += 1
            result.languages[lang] += 1
            doc_split[d] = SPLITS.index(split_of(text, spec.valid_fraction))
        result.n_tokens += int(pieces.tokens.shape[0])
        piece_split = doc_split[pieces.docs]
        for k, split in enumerate(SPLITS):
            mine = pieces.select(piece_split == k)
            if mine.n_pieces:
                docs = mine.docs.tolist()
                parts[split].add_many(
                    mine, [batch[d][1].source for d in docs], [batch[d][3] for d in docs]
                )
        batch.clear()

    for position, part, doc, text, reason in _cleaned_documents(spec, unit, cfg):
        result.read[part.source] += 1
        if text is None:
            reject(reason, part, doc)
            continue
        if position in duplicates:
            reject("duplicate", part, doc)
            continue
        batch.append((part, doc, text, _language(text)))
        if len(batch) >= spec.batch_docs:
            flush()
    if batch:
        flush()
    for split, writer in parts.items():
        writer.close()
        result.parts[split] = writer.entries
    return result


def _language(text: str) -> str:
    """``language_of``, skipping its letter count for ASCII text (a flag lookup)."""
    return "other" if text.isascii() else language_of(text)
