"""The steps of a write task (worker.write_unit), one generator each, chained in order:

    read -> clean -> identify_language -> quality_filters -> dedup      (documents)
    -> batched -> minhash -> tokenize -> assign_splits -> write         (batches of them)

(language ID and the quality filters only with ``language_id``, MinHash only with
near-dedup). A document step takes ``Doc``s and yields those it keeps; one that drops a
document counts it in the unit's ``Rejects`` under its reason. From ``batched`` on the
steps take and yield batches of ``batch_docs`` documents, so that tokenizing, segmenting,
MinHash and writing cost a few library calls per batch, not per document. The chain is
lazy: a step asks the one before it for the next document (or batch) only once it is
done with the last, so each reason's examples come in source order and no more than a
clean group and a batch of documents are held at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.data.shards import SPLITS, ShardWriter, split_of
from pipeline.prepare import near_dedup
from pipeline.prepare.clean import CleanConfig, clean_many, dedup_key, language_of, reject_reason
from pipeline.prepare.langid import identify
from pipeline.prepare.quality import run_filters
from pipeline.prepare.readers import Digest, RawDocument, Slice, hash_docs, iter_raw_documents
from pipeline.prepare.unit import (
    EXAMPLE_CHARS,
    MAX_REJECT_EXAMPLES,
    NO_TOKENS,
    T_LANGUAGE,
    T_LINE,
    T_ORDINAL,
    T_PIECES,
    T_POSITION,
    T_SLICE,
    T_SPLIT,
    T_TOKENS,
    TRACE_COLUMNS,
    JobSpec,
    UnitResult,
    part_name,
    reject_example,
)


@dataclass(slots=True)
class Doc:
    """One document on its way through the steps."""

    position: int  # among everything the unit read, rejects included
    slice: Slice  # the one it was read from
    slice_index: int  # of that slice in the unit
    raw: RawDocument
    text: str | None = None  # once cleaned: the text the next steps judge
    language: str | None = None  # the code the shards hold (set by language ID)


class Rejects:
    """The unit's rejected documents: a count per reason, the first few of each reason as
    examples, and the positions of the duplicates among those examples."""

    def __init__(self, result: UnitResult):
        self.result = result

    def add(
        self,
        reason: str,
        doc: Doc,
        detail: str | None = None,
        text: str | None = None,
        kept: dict[str, Any] | None = None,
    ) -> None:
        result = self.result
        result.rejected[reason] += 1
        examples = result.examples.setdefault(reason, [])
        if len(examples) < MAX_REJECT_EXAMPLES:
            raw = doc.raw
            example = reject_example(
                doc.slice, raw.source, raw.ordinal, raw.line, detail or raw.detail
            )
            if text is not None:  # a filter's reject: the start of the text it judged
                example["text"] = text[:EXAMPLE_CHARS]
            if kept is not None:
                example["kept"] = kept
            examples.append(example)
            if reason == "duplicate":
                result.duplicate_positions.append(doc.position)


# ---------------------------------------------------------------------------
# Document steps


def read(spec: JobSpec, unit: list[Slice], result: UnitResult) -> Iterator[Doc]:
    """Every document of the unit's slices, rejects included, counted in ``result.read``;
    each slice's digest goes to ``result.digests`` once its documents are out."""
    position = 0
    for k, part in enumerate(unit):
        source = spec.sources[part.source]
        digest = Digest()
        # The driver's copy of a builtin corpus: its docstrings can differ in a Ray
        # worker (see readers).
        builtin = spec.builtin_docs if source.format == "builtin" else None
        if builtin is not None:
            raws = (RawDocument(source.uri, n, t) for n, t in enumerate(builtin))
        else:
            raws = iter_raw_documents(source, spec.max_doc_bytes, part, digest)
        for raw in raws:
            result.read[part.source] += 1
            yield Doc(position, part, k, raw)
            position += 1
        if builtin is not None:
            hash_docs(builtin, digest)
            result.digests.append((part.source, 0, source.size, digest.hexdigest()))
        else:
            end = part.start + digest.n_bytes
            result.digests.append((part.source, part.start, end, digest.hexdigest()))


_CLEAN_GROUP = 256  # documents cleaned together (clean_many)


def clean(docs: Iterator[Doc], cfg: CleanConfig, rejects: Rejects) -> Iterator[Doc]:
    """The documents with their cleaned text; a reader's reject (invalid UTF-8, bad JSON,
    ...) and a cleaned text ``reject_reason`` refuses (too short, ...) are rejected."""
    group: list[Doc] = []

    def done() -> Iterator[Doc]:
        texts = iter(clean_many([doc.raw.text or "" for doc in group if not doc.raw.reject], cfg))
        for doc in group:
            if doc.raw.reject:
                rejects.add(doc.raw.reject, doc)
                continue
            text = next(texts)
            reason = reject_reason(text, cfg)
            if reason:
                rejects.add(reason, doc)
                continue
            doc.text = text
            yield doc
        group.clear()

    for doc in docs:
        group.append(doc)
        if len(group) >= _CLEAN_GROUP:
            yield from done()
    yield from done()


def identify_language(
    docs: Iterator[Doc], languages: tuple[str, ...] | None, rejects: Rejects
) -> Iterator[Doc]:
    """Each document's ISO code (language ID); with ``languages``, only those are kept."""
    for doc in docs:
        doc.language = code = identify(doc.text)
        if languages is not None and code not in languages:
            rejects.add("language", doc, detail=code, text=doc.text)
            continue
        yield doc


def quality_filters(
    docs: Iterator[Doc], filters: list, result: UnitResult, rejects: Rejects
) -> Iterator[Doc]:
    """The quality filters, in order, on each document (of its language): a document one
    rejects is counted under the filter and its rule; the lines a filter removes are gone
    from the text the next steps see (the dedup key is the final text's)."""
    for doc in docs:
        judged = run_filters(doc.text, doc.language, filters)
        result.lines_removed.update(judged.lines_removed)
        result.filter_language_skips.update(f"{n}/{doc.language}" for n in judged.skipped)
        if judged.text is None:
            result.filter_rules[f"{judged.reason}.{judged.rule}"] += 1
            rejects.add(judged.reason, doc, detail=judged.rule, text=doc.text)
            continue
        doc.text = judged.text
        yield doc


def dedup(
    docs: Iterator[Doc],
    known_duplicates: frozenset[int],
    known_near_duplicates: dict[int, dict[str, Any]],
    keys: list[bytes],
    rejects: Rejects,
) -> Iterator[Doc]:
    """First occurrences only: a repeat of a document earlier in the unit, or one the
    reducers found (``known_duplicates``: positions), is a duplicate; a known
    near-duplicate (position -> the kept document's reject example) is rejected next.
    The dedup key of each document kept goes to ``keys``, in order."""
    seen: set[bytes] = set()  # the unit's keys: a repeat inside the unit is never written
    for doc in docs:
        key = dedup_key(doc.text)
        if key in seen or doc.position in known_duplicates:
            seen.add(key)
            rejects.add("duplicate", doc)
            continue
        seen.add(key)
        if doc.position in known_near_duplicates:
            rejects.add("near_duplicate", doc, kept=known_near_duplicates[doc.position])
            continue
        keys.append(key)
        yield doc


# ---------------------------------------------------------------------------
# Batch steps


def batched(docs: Iterator[Doc], n: int) -> Iterator[list[Doc]]:
    """The documents ``n`` at a time (the last batch shorter)."""
    batch: list[Doc] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class BandKeys:
    """What ``minhash`` collects for the near-dedup reducers: per batch, the band keys of
    its documents that have words, (documents, bands) uint64, and their positions."""

    keys: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)

    def partitions(self, bands: int, n: int) -> list[np.ndarray]:
        """All of them, hash-partitioned for ``n`` reducers (``near_dedup.partition``)."""
        keys = np.concatenate(self.keys) if self.keys else np.zeros((0, bands), np.uint64)
        at = np.concatenate(self.positions) if self.positions else np.zeros(0, np.int64)
        return near_dedup.partition(keys, at, n)


def minhash(
    batches: Iterator[list[Doc]],
    spec: near_dedup.NearDedupSpec,
    found: BandKeys,
    result: UnitResult,
) -> Iterator[list[Doc]]:
    """Near-dedup's MinHash signatures and band keys of each batch, on the text the exact
    dedup key is taken from; their CPU time goes to ``result.near_dedup_cpu_seconds``."""
    for batch in batches:
        started = time.process_time()
        sigs, has_words = near_dedup.signatures([doc.text for doc in batch], spec)
        found.keys.append(near_dedup.band_keys(sigs[has_words], spec))
        positions = np.fromiter((doc.position for doc in batch), np.int64, len(batch))
        found.positions.append(positions[has_words])
        result.near_dedup_cpu_seconds += time.process_time() - started
        yield batch


@dataclass
class Batch:
    """A batch of documents once tokenized: their pieces (``segment.PieceBatch``) and,
    from ``assign_splits`` on, their trace rows."""

    docs: list[Doc]
    pieces: Any
    rows: np.ndarray | None = None


def _segment_language(text: str) -> str:
    """zh or other, how the Segmenter splits words (``language_of``), skipping its letter
    count for ASCII text (a flag lookup)."""
    return "other" if text.isascii() else language_of(text)


def tokenize(
    batches: Iterator[list[Doc]], segment: Callable[[list[str], list[str]], Any]
) -> Iterator[Batch]:
    """Each batch tokenized and cut into pieces by one ``segment`` call (Segmenter.batch);
    without language ID a document's language is the Segmenter's (zh or other)."""
    for docs in batches:
        texts = [doc.text for doc in docs]
        languages = [_segment_language(text) for text in texts]
        for doc, language in zip(docs, languages, strict=True):
            doc.language = doc.language or language
        yield Batch(docs, segment(texts, languages))


def assign_splits(
    batches: Iterator[Batch], valid_fraction: float, result: UnitResult, rejects: Rejects
) -> Iterator[Batch]:
    """Each batch's trace rows: where its documents are, their language, pieces and
    tokens, and their split (by their text, ``split_of``); a document that gave no token
    is rejected (``NO_TOKENS``), the others are counted as kept."""
    names = result.language_names
    for batch in batches:
        docs, pieces = batch.docs, batch.pieces
        counts = np.bincount(pieces.docs, minlength=len(docs))
        tokens = np.bincount(pieces.docs, weights=pieces.ends - pieces.starts, minlength=len(docs))
        rows = np.zeros((len(docs), TRACE_COLUMNS), dtype=np.int64)
        for d, doc in enumerate(docs):
            row, language = rows[d], doc.language
            row[T_POSITION], row[T_SLICE] = doc.position, doc.slice_index
            row[T_ORDINAL], row[T_LINE] = doc.raw.ordinal, doc.raw.line or 0
            if language not in names:
                names.append(language)
            row[T_LANGUAGE] = names.index(language)
            if not counts[d]:
                rejects.add("no_tokens", doc)
                row[T_SPLIT] = NO_TOKENS
                continue
            result.kept[doc.slice.source] += 1
            result.languages[language] += 1
            row[T_SPLIT] = SPLITS.index(split_of(doc.text, valid_fraction))
        rows[:, T_PIECES], rows[:, T_TOKENS] = counts, tokens
        batch.rows = rows
        yield batch


def write(
    batches: Iterator[Batch], parts: dict[str, SplitParts], result: UnitResult
) -> Iterator[Batch]:
    """Each batch's pieces appended to its split's parts, counted in ``result.n_tokens``."""
    for batch in batches:
        docs, pieces = batch.docs, batch.pieces
        result.n_tokens += int(pieces.tokens.shape[0])
        piece_split = batch.rows[pieces.docs, T_SPLIT]
        for k, split in enumerate(SPLITS):
            mine = pieces.select(piece_split == k)
            if mine.n_pieces:
                at = mine.docs.tolist()
                sources = [docs[d].raw.source for d in at]
                parts[split].add_many(mine, sources, [docs[d].language for d in at])
        yield batch


class SplitParts:
    """Rolls the unit's parts of one split: a new part after shard_docs / shard_bytes."""

    def __init__(self, spec: JobSpec, unit: int, split: str, dtype: np.dtype, naming=part_name):
        self.spec, self.unit, self.split, self.dtype = spec, unit, split, dtype
        self.naming = naming
        self.entries: list[dict[str, Any]] = []
        self.writer: ShardWriter | None = None

    def _open(self) -> None:
        spec = self.spec
        k = len(self.entries)
        self.writer = ShardWriter(
            spec.fs,
            spec.output,
            self.naming(self.split, self.unit, k),
            f"u{self.unit:06d}{self.split[0]}{k:03d}",
            self.dtype,
            spec.block_tokens,
            spec.entities is not None,
        )

    def add_many(self, pieces, sources: list[str], languages: list[str]) -> None:
        """A batch of pieces (``segment.PieceBatch``; ``sources``/``languages`` one name per
        piece), a few numpy calls per block."""
        spec = self.spec
        ends, i = pieces.ends, 0
        while i < len(ends):
            if self.writer is None:
                self._open()
            i, stopped = self.writer.add_many(
                pieces, sources, languages, spec.shard_docs, spec.shard_bytes, first=i
            )
            if stopped:
                self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.entries.append(self.writer.close())
            self.writer = None
