"""The worker stage of `plm data prepare`: what one Ray task does with one unit of work.

A unit is a run of consecutive ``Slice``s of the corpus (byte ranges of big files, or
several small files), numbered in source order. One pass over it, then a fix-up:

1. ``write_unit``: read, clean, filter, tokenize and segment (one Segmenter batch per
   ``batch_docs`` documents), and write the unit's own shards
   (``train/part-UUUUUU-KKK.tar``, ``valid/...``) straight to the output filesystem;
   the dedup key of every document that survived cleaning, hash-partitioned
   (``dedup.partition``) for the reducers, with near-dedup on their MinHash band keys
   too (``near_dedup``), and a trace of those documents (where each went). Returns
   counts and the part entries, never documents.
2. ``fix_unit`` (only for a unit the reducers found a duplicate or near-duplicate in):
   drop them from its parts (blocks read back and filtered) and from its counts.

Documents are numbered inside a unit by their position among everything read (rejects
included), so (unit, position) is the document's place in source order.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.data.shards import SPLITS, ShardWriter, split_of
from pipeline.prepare.clean import (
    CleanConfig,
    clean_many,
    dedup_key,
    language_of,
    reject_reason,
)
from pipeline.prepare.langid import identify
from pipeline.prepare.near_dedup import NearDedupSpec
from pipeline.prepare.quality import run_filters
from pipeline.prepare.readers import (
    Digest,
    RawDocument,
    Slice,
    Source,
    hash_docs,
    iter_raw_documents,
)

MAX_REJECT_EXAMPLES = 5  # per reason and unit; the driver keeps the first 5 overall
EXAMPLE_CHARS = 120  # of a filtered document's text, in its reject example


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
    # Language ID and quality filters (pipeline/prepare/langid.py, quality.py): with
    # ``language_id`` each document's ISO code is what the shards hold; ``languages``
    # (codes) keeps only those; ``filters`` are quality.FilterConfig objects, in order.
    language_id: bool = False
    languages: tuple[str, ...] | None = None
    filters: tuple[Any, ...] = ()
    near_dedup: NearDedupSpec | None = None  # None: no near-dedup (no signatures)


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
    # The trace's T_LANGUAGE indexes this list (codes in the order the unit met them).
    language_names: list[str] = field(default_factory=lambda: list(LANGUAGES))
    # Quality filters: "filter.rule" -> documents it rejected / lines it removed from
    # documents (quality.run_filters).
    filter_rules: Counter = field(default_factory=Counter)
    lines_removed: Counter = field(default_factory=Counter)
    # "filter/language" -> documents that filter did not judge: their language is not in
    # its ``languages`` (quality.FilterResult.skipped).
    filter_language_skips: Counter = field(default_factory=Counter)
    n_tokens: int = 0
    input_bytes: int = 0
    cpu_seconds: float = 0.0  # the task's, set by job._write_task
    near_dedup_cpu_seconds: float = 0.0  # of it, the MinHash signatures and band keys
    node: str = ""  # the Ray node that wrote the parts
    host: str = ""  # that node's hostname
    # Positions of examples["duplicate"] found by write_unit (repeats inside the unit),
    # for fix_unit to merge them with those the reducers find.
    duplicate_positions: list[int] = field(default_factory=list)
    # Per slice: (source index, first byte, end byte, sha256 of the stored bytes between).
    digests: list[tuple[int, int, int, str]] = field(default_factory=list)
    reused: bool = False  # loaded from the unit's record (data/records.py), not written now


def part_name(split: str, unit: int, k: int) -> str:
    return f"{split}/part-{unit:06d}-{k:03d}.tar"


def fix_part_name(split: str, unit: int, k: int) -> str:
    """The name ``fix_unit`` writes part k under: never one a write task wrote, so a
    retried fix reads the same parts and writes the same files."""
    return f"{split}/fix-{unit:06d}-{k:03d}.tar"


def _documents(
    spec: JobSpec, unit: list[Slice], digests: list[tuple[int, int, int, str]]
) -> Iterator[tuple[int, Slice, RawDocument]]:
    """(position in the unit, slice, raw document) for everything the unit reads; each
    slice's digest is appended to ``digests`` once its documents are out."""
    position = 0
    for part in unit:
        source = spec.sources[part.source]
        digest = Digest()
        # The driver's copy of a builtin corpus: its docstrings can differ in a Ray
        # worker (see readers).
        builtin = spec.builtin_docs if source.format == "builtin" else None
        if builtin is not None:
            docs = (RawDocument(source.uri, k, t) for k, t in enumerate(builtin))
        else:
            docs = iter_raw_documents(source, spec.max_doc_bytes, part, digest)
        for doc in docs:
            yield position, part, doc
            position += 1
        if builtin is not None:
            hash_docs(builtin, digest)
            digests.append((part.source, 0, source.size, digest.hexdigest()))
        else:
            end = part.start + digest.n_bytes
            digests.append((part.source, part.start, end, digest.hexdigest()))


_CLEAN_GROUP = 256  # documents cleaned together (clean_many)


def _cleaned_documents(
    spec: JobSpec, unit: list[Slice], cfg: CleanConfig, digests: list[tuple[int, int, int, str]]
) -> Iterator[tuple[int, Slice, RawDocument, str | None, str | None]]:
    """(position, slice, raw document, cleaned text or None, reject reason or None) of
    everything the unit reads, in order: ``_cleaned`` of each, cleaned a group at a time;
    the slices' digests go to ``digests`` (see ``_documents``)."""
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

    for item in _documents(spec, unit, digests):
        group.append(item)
        if len(group) >= _CLEAN_GROUP:
            yield from done()
    yield from done()


class _SplitParts:
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
                pieces, sources, languages, spec.shard_docs, spec.shard_bytes, first=i
            )
            if stopped:
                self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.entries.append(self.writer.close())
            self.writer = None


# The trace of a unit: one row per document that survived cleaning, in source order.
(T_POSITION, T_SLICE, T_ORDINAL, T_LINE, T_SPLIT, T_LANGUAGE, T_PIECES, T_TOKENS) = range(8)
NO_TOKENS = -1  # T_SPLIT of a document that gave no token
LANGUAGES = ("other", "zh")  # the first T_LANGUAGE codes (UnitResult.language_names)


def _example(part: Slice, source: str, ordinal: int, line: int | None, detail=None):
    """Where a reject is: what the manifest's reject_examples hold."""
    example: dict[str, Any] = {"source": source, "ordinal": ordinal}
    if part.start and part.row_groups is None:
        example["from_byte"] = part.start  # ordinal and line count from there
    if part.row_groups is not None:
        example["row_groups"] = list(part.row_groups)
    if line:
        example["line"] = line
    if detail:
        example["detail"] = detail
    return example


def write_unit(
    spec: JobSpec,
    index: int,
    unit: list[Slice],
    n_partitions: int,
    known_duplicates: frozenset[int] = frozenset(),
    n_near_partitions: int = 0,
    known_near_duplicates: dict[int, dict[str, Any]] | None = None,
):
    """Read, clean, filter, tokenize and write the unit's parts; see the module doc. A
    repeat of a document earlier in the unit is rejected at once; a repeat of one in an
    earlier unit is not known yet: written, and dropped by ``fix_unit``; so are all
    near-duplicates. Returns (UnitResult, trace, the dedup keys of the unit's first
    occurrences partitioned for the reducers: ``n_partitions`` arrays, then with
    ``spec.near_dedup`` their MinHash band keys in ``n_near_partitions`` arrays).
    ``known_duplicates`` (positions) and ``known_near_duplicates`` (position -> the kept
    document's reject example) are rejected before anything is written: what
    ``fix_unit`` must equal (tests/unit/test_prepare_dedup.py, test_near_dedup.py)."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # one task per CPU is the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    from pipeline.data.shards import token_dtype
    from pipeline.prepare import near_dedup
    from pipeline.prepare.dedup import partition
    from pipeline.prepare.segment import Segmenter, entity_pattern

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
    slice_of = {id(part): k for k, part in enumerate(unit)}
    keys: list[bytes] = []
    trace: list[np.ndarray] = []
    near = spec.near_dedup
    known_near = known_near_duplicates or {}
    band_keys: list[np.ndarray] = []  # per batch: (documents with words, bands) uint64
    band_positions: list[np.ndarray] = []

    def reject(
        reason: str,
        part: Slice,
        doc: RawDocument,
        position: int = -1,
        detail=None,
        text=None,
        kept: dict | None = None,
    ) -> None:
        result.rejected[reason] += 1
        examples = result.examples.setdefault(reason, [])
        if len(examples) < MAX_REJECT_EXAMPLES:
            example = _example(part, doc.source, doc.ordinal, doc.line, detail or doc.detail)
            if text is not None:  # a filter's reject: the start of the text it judged
                example["text"] = text[:EXAMPLE_CHARS]
            if kept is not None:
                example["kept"] = kept
            examples.append(example)
            if reason == "duplicate":
                result.duplicate_positions.append(position)

    # (position, slice, document, text, language for segment (zh/other), language stored)
    batch: list[tuple[int, Slice, RawDocument, str, str, str]] = []
    seen: set[bytes] = set()  # the unit's keys: a repeat inside the unit is never written

    def flush() -> None:
        pieces = segment([b[3] for b in batch], [b[4] for b in batch])
        counts = np.bincount(pieces.docs, minlength=len(batch))
        tokens = np.bincount(pieces.docs, weights=pieces.ends - pieces.starts, minlength=len(batch))
        rows = np.zeros((len(batch), 8), dtype=np.int64)
        for d, (position, part, doc, text, _, lang) in enumerate(batch):
            row = rows[d]
            row[T_POSITION], row[T_SLICE] = position, slice_of[id(part)]
            row[T_ORDINAL], row[T_LINE] = doc.ordinal, doc.line or 0
            if lang not in result.language_names:
                result.language_names.append(lang)
            row[T_LANGUAGE] = result.language_names.index(lang)
            if not counts[d]:
                reject("no_tokens", part, doc)
                row[T_SPLIT] = NO_TOKENS
                continue
            result.kept[part.source] += 1
            result.languages[lang] += 1
            row[T_SPLIT] = SPLITS.index(split_of(text, spec.valid_fraction))
        rows[:, T_PIECES], rows[:, T_TOKENS] = counts, tokens
        trace.append(rows)
        if near is not None:  # on the text the exact dedup key is taken from
            started = time.process_time()
            sigs, has_words = near_dedup.signatures([b[3] for b in batch], near)
            band_keys.append(near_dedup.band_keys(sigs[has_words], near))
            band_positions.append(rows[has_words, T_POSITION])
            result.near_dedup_cpu_seconds += time.process_time() - started
        result.n_tokens += int(pieces.tokens.shape[0])
        piece_split = rows[pieces.docs, T_SPLIT]
        for k, split in enumerate(SPLITS):
            mine = pieces.select(piece_split == k)
            if mine.n_pieces:
                docs = mine.docs.tolist()
                parts[split].add_many(
                    mine, [batch[d][2].source for d in docs], [batch[d][5] for d in docs]
                )
        batch.clear()

    read = _cleaned_documents(spec, unit, cfg, result.digests)
    for position, part, doc, text, reason in read:
        result.read[part.source] += 1
        if text is None:
            reject(reason, part, doc)
            continue
        stored = None
        if spec.language_id:  # language ID, then the language and quality filters
            stored = identify(text)
            if spec.languages is not None and stored not in spec.languages:
                reject("language", part, doc, detail=stored, text=text)
                continue
            if spec.filters:
                judged = run_filters(text, stored, list(spec.filters))
                result.lines_removed.update(judged.lines_removed)
                result.filter_language_skips.update(f"{n}/{stored}" for n in judged.skipped)
                if judged.text is None:
                    result.filter_rules[f"{judged.reason}.{judged.rule}"] += 1
                    reject(judged.reason, part, doc, detail=judged.rule, text=text)
                    continue
                text = judged.text  # lines dropped: the dedup key is the final text's
        key = dedup_key(text)
        if key in seen or position in known_duplicates:
            seen.add(key)
            reject("duplicate", part, doc, position)
            continue
        seen.add(key)
        if position in known_near:
            reject("near_duplicate", part, doc, kept=known_near[position])
            continue
        keys.append(key)
        lang = _language(text)
        batch.append((position, part, doc, text, lang, stored or lang))
        if len(batch) >= spec.batch_docs:
            flush()
    if batch:
        flush()
    for split, writer in parts.items():
        writer.close()
        result.parts[split] = writer.entries
    rows = np.concatenate(trace) if trace else np.zeros((0, 8), dtype=np.int64)
    partitions = partition(b"".join(keys), rows[:, T_POSITION], n_partitions)
    if near is not None:
        started = time.process_time()
        found = np.concatenate(band_keys) if band_keys else np.zeros((0, near.bands), np.uint64)
        at = np.concatenate(band_positions) if band_positions else np.zeros(0, np.int64)
        partitions += near_dedup.partition(found, at, n_near_partitions)
        result.near_dedup_cpu_seconds += time.process_time() - started
    return result, rows, partitions


def trace_example(spec: JobSpec, unit: list[Slice], trace: np.ndarray, position: int):
    """The reject example of the document at ``position`` of a unit, from its trace."""
    row = trace[np.searchsorted(trace[:, T_POSITION], position)].tolist()
    part = unit[row[T_SLICE]]
    return _example(part, spec.sources[part.source].uri, row[T_ORDINAL], row[T_LINE])


def fix_unit(
    spec: JobSpec,
    unit: list[Slice],
    result: UnitResult,
    trace: np.ndarray,
    duplicates: set[int],
    near_duplicates: dict[int, tuple[int, int]] | None = None,
    kept_example: Callable[[int, int], dict[str, Any]] | None = None,
) -> UnitResult:
    """Drop the unit's duplicates (``duplicates``: their positions) and near-duplicates
    (``near_duplicates``: position -> (unit, position) of the document kept in their
    cluster, whose reject example ``kept_example`` gives) from what ``write_unit`` wrote
    and counted: the parts of a split from the first that holds one on are read back
    block by block, filtered (no document is read or tokenized again) and written as
    ``fix-`` parts, the bytes a write that never saw them gives (the written ones are
    left for the driver to remove: a retried fix reads them again); the counts and
    reject examples are corrected from the trace. A document that is both is counted a
    duplicate."""
    from pipeline.data.shards import read_blocks, token_dtype
    from pipeline.prepare.segment import PieceBatch

    near_duplicates = near_duplicates or {}
    if not duplicates and not near_duplicates:
        return result
    dup = np.isin(trace[:, T_POSITION], np.fromiter(duplicates, dtype=np.int64))
    near = np.isin(trace[:, T_POSITION], np.fromiter(near_duplicates, dtype=np.int64)) & ~dup
    drop_doc = dup | near
    split_col = trace[:, T_SPLIT]
    # Counts: a duplicate is never kept, never "no_tokens" (dedup comes first).
    for row, is_dup in zip(trace[drop_doc].tolist(), dup[drop_doc].tolist(), strict=True):
        part = unit[row[T_SLICE]]
        if row[T_SPLIT] == NO_TOKENS:
            result.rejected["no_tokens"] -= 1
        else:
            result.kept[part.source] -= 1
            result.languages[result.language_names[row[T_LANGUAGE]]] -= 1
            result.n_tokens -= row[T_TOKENS]
        result.rejected["duplicate" if is_dup else "near_duplicate"] += 1
    for counter in (result.kept, result.languages, result.rejected):
        for key in [k for k, v in counter.items() if v == 0]:
            del counter[key]

    def examples(rows: np.ndarray) -> list[dict[str, Any]]:
        out = []
        for row in rows[:MAX_REJECT_EXAMPLES].tolist():
            part = unit[row[T_SLICE]]
            source = spec.sources[part.source].uri
            out.append(_example(part, source, row[T_ORDINAL], row[T_LINE]))
        return out

    found = [
        (int(row[T_POSITION]), e) for row, e in zip(trace[dup], examples(trace[dup]), strict=False)
    ]
    written = zip(result.duplicate_positions, result.examples.get("duplicate", []), strict=True)
    merged = sorted([*written, *found], key=lambda item: item[0])[:MAX_REJECT_EXAMPLES]
    if merged:
        result.examples["duplicate"] = [e for _, e in merged]
    result.duplicate_positions = [position for position, _ in merged]
    if near.any():
        near_rows = trace[near][:MAX_REJECT_EXAMPLES]
        near_examples = examples(near_rows)
        for row, example in zip(near_rows.tolist(), near_examples, strict=True):
            if kept_example is not None:
                example["kept"] = kept_example(*near_duplicates[row[T_POSITION]])
        result.examples["near_duplicate"] = near_examples
    result.examples.pop("no_tokens", None)
    if no_tokens := examples(trace[(split_col == NO_TOKENS) & ~drop_doc]):
        result.examples["no_tokens"] = no_tokens
    # Parts: each split's pieces in order, those of a duplicate dropped.
    dtype = token_dtype(spec.vocab_size)
    for s, split in enumerate(SPLITS):
        mine = split_col == s
        if not (drop_doc & mine).any():
            continue
        drop = np.repeat(drop_doc[mine], trace[mine, T_PIECES])
        entries = result.parts[split]
        firsts = np.cumsum([0] + [e["n_docs"] for e in entries])
        first = int(np.searchsorted(firsts, np.flatnonzero(drop)[0], side="right")) - 1
        # The written parts stay as they are (the driver removes those no entry names).
        writer = _SplitParts(spec, result.unit, split, dtype, naming=fix_part_name)
        writer.entries = list(entries[:first])
        at = int(firsts[first])
        for entry in entries[first:]:
            for block in read_blocks(spec.fs, f"{spec.output}/{entry['name']}"):
                n = len(block.ends)
                keep = ~drop[at : at + n]
                at += n
                pieces = PieceBatch(block.tokens, block.ends, block.sents, block.words,
                                    block.spans, np.arange(n)).select(keep)  # fmt: skip
                if pieces.n_pieces:
                    kept = np.flatnonzero(keep).tolist()
                    writer.add_many(pieces, [block.sources[j] for j in kept],
                                    [block.languages[j] for j in kept])  # fmt: skip
        writer.close()
        result.parts[split] = writer.entries
    return result


def _language(text: str) -> str:
    """``language_of``, skipping its letter count for ASCII text (a flag lookup)."""
    return "other" if text.isascii() else language_of(text)
