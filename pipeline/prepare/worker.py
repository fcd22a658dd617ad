"""The worker stage of `plm data prepare`: what one Ray task does with one unit of work.

A unit is a run of consecutive ``Slice``s of the corpus (byte ranges of big files, or
several small files), numbered in source order. One pass over it, then a fix-up:

1. ``write_unit``: the unit's documents through the steps of steps.py (read, clean,
   language ID and quality filters, dedup; then a batch of ``batch_docs`` documents at a
   time: MinHash with near-dedup on, tokenize and segment in one Segmenter call, split
   assignment, write), which write the unit's own shards (``train/part-UUUUUU-KKK.tar``,
   ``valid/...``) straight to the output filesystem; the dedup key of every document
   kept, hash-partitioned (``dedup.partition``) for the reducers, with near-dedup on
   their MinHash band keys too (``near_dedup``), and a trace of those documents (where
   each went). Returns counts and the part entries, never documents.
2. ``fix_unit`` (only for a unit the reducers found a duplicate or near-duplicate in):
   drop them from its parts (blocks read back and filtered) and from its counts.

Documents are numbered inside a unit by their position among everything read (rejects
included), so (unit, position) is the document's place in source order. What a task is
given and returns (``JobSpec``, ``UnitResult``, the trace's columns): unit.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.data.shards import SPLITS, read_blocks, token_dtype
from pipeline.prepare import steps
from pipeline.prepare import unit as cols  # the trace's columns: cols.T_POSITION, ...
from pipeline.prepare.clean import CleanConfig
from pipeline.prepare.readers import Slice
from pipeline.prepare.unit import (
    MAX_REJECT_EXAMPLES,
    JobSpec,
    UnitResult,
    fix_part_name,
    reject_example,
)


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
    from pipeline.prepare.dedup import partition

    segment = _segmenter(spec)
    dtype = token_dtype(spec.vocab_size)
    cfg = CleanConfig(**spec.clean)
    result = UnitResult(index)
    result.input_bytes = sum(part.size for part in unit)
    rejects = steps.Rejects(result)
    keys: list[bytes] = []  # of the documents kept, in order
    band_keys = steps.BandKeys()
    parts = {split: steps.SplitParts(spec, index, split, dtype) for split in SPLITS}

    docs = steps.read(spec, unit, result)
    docs = steps.clean(docs, cfg, rejects)
    if spec.language_id:  # language ID, then the language and quality filters
        docs = steps.identify_language(docs, spec.languages, rejects)
        if spec.filters:
            docs = steps.quality_filters(docs, list(spec.filters), result, rejects)
    docs = steps.dedup(docs, known_duplicates, known_near_duplicates or {}, keys, rejects)
    batches = steps.batched(docs, spec.batch_docs)
    if spec.near_dedup is not None:
        batches = steps.minhash(batches, spec.near_dedup, band_keys, result)
    tokenized = steps.tokenize(batches, segment)
    tokenized = steps.assign_splits(tokenized, spec.valid_fraction, result, rejects)
    trace = [batch.rows for batch in steps.write(tokenized, parts, result)]

    for split, writer in parts.items():
        writer.close()
        result.parts[split] = writer.entries
    rows = np.concatenate(trace) if trace else np.zeros((0, cols.TRACE_COLUMNS), dtype=np.int64)
    partitions = partition(b"".join(keys), rows[:, cols.T_POSITION], n_partitions)
    if spec.near_dedup is not None:
        started = time.process_time()
        partitions += band_keys.partitions(spec.near_dedup.bands, n_near_partitions)
        result.near_dedup_cpu_seconds += time.process_time() - started
    return result, rows, partitions


def _segmenter(spec: JobSpec) -> Callable:
    """The unit's tokenize-and-segment call: ``Segmenter.batch`` (texts, languages)."""
    from tokenizers import Tokenizer

    from pipeline.prepare.segment import Segmenter, entity_pattern

    tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    entities = entity_pattern(spec.entities) if spec.entities else None
    return Segmenter(tokenizer, spec.max_doc_tokens, entities).batch


def trace_example(spec: JobSpec, unit: list[Slice], trace: np.ndarray, position: int):
    """The reject example of the document at ``position`` of a unit, from its trace."""
    row = trace[np.searchsorted(trace[:, cols.T_POSITION], position)].tolist()
    part = unit[row[cols.T_SLICE]]
    return reject_example(
        part, spec.sources[part.source].uri, row[cols.T_ORDINAL], row[cols.T_LINE]
    )


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
    near_duplicates = near_duplicates or {}
    if not duplicates and not near_duplicates:
        return result
    dup = np.isin(trace[:, cols.T_POSITION], np.fromiter(duplicates, dtype=np.int64))
    near = np.isin(trace[:, cols.T_POSITION], np.fromiter(near_duplicates, dtype=np.int64)) & ~dup
    drop = dup | near
    _uncount(unit, result, trace, dup, drop)
    _fix_examples(spec, unit, result, trace, dup, near, near_duplicates, kept_example)
    for s, split in enumerate(SPLITS):
        mine = trace[:, cols.T_SPLIT] == s
        if (drop & mine).any():
            pieces = np.repeat(drop[mine], trace[mine, cols.T_PIECES])
            result.parts[split] = _drop_pieces(spec, result, split, pieces)
    return result


def _uncount(unit: list[Slice], result: UnitResult, trace, dup, drop) -> None:
    """Move the dropped documents (``drop``, of them the duplicates ``dup``: trace row
    masks) from kept to rejected: a duplicate is never "no_tokens" (dedup comes first)."""
    for row, is_dup in zip(trace[drop].tolist(), dup[drop].tolist(), strict=True):
        part = unit[row[cols.T_SLICE]]
        if row[cols.T_SPLIT] == cols.NO_TOKENS:
            result.rejected["no_tokens"] -= 1
        else:
            result.kept[part.source] -= 1
            result.languages[result.language_names[row[cols.T_LANGUAGE]]] -= 1
            result.n_tokens -= row[cols.T_TOKENS]
        result.rejected["duplicate" if is_dup else "near_duplicate"] += 1
    for counter in (result.kept, result.languages, result.rejected):
        for key in [k for k, v in counter.items() if v == 0]:
            del counter[key]


def _examples(spec: JobSpec, unit: list[Slice], rows: np.ndarray) -> list[dict[str, Any]]:
    """The reject examples of the first trace ``rows``."""
    out = []
    for row in rows[:MAX_REJECT_EXAMPLES].tolist():
        part = unit[row[cols.T_SLICE]]
        source = spec.sources[part.source].uri
        out.append(reject_example(part, source, row[cols.T_ORDINAL], row[cols.T_LINE]))
    return out


def _fix_examples(spec, unit, result, trace, dup, near, near_duplicates, kept_example) -> None:
    """The reject examples a write that knew the duplicates (``dup``) and near-duplicates
    (``near``) gives: the first duplicates of the unit's and the reducers' merged in
    source order, the first near-duplicates with their kept document's example, and the
    "no_tokens" ones without the dropped documents."""
    dup_examples = _examples(spec, unit, trace[dup])  # the first of the reducers' duplicates
    found = [
        (int(row[cols.T_POSITION]), e) for row, e in zip(trace[dup], dup_examples, strict=False)
    ]
    written = zip(result.duplicate_positions, result.examples.get("duplicate", []), strict=True)
    merged = sorted([*written, *found], key=lambda item: item[0])[:MAX_REJECT_EXAMPLES]
    if merged:
        result.examples["duplicate"] = [e for _, e in merged]
    result.duplicate_positions = [position for position, _ in merged]
    if near.any():
        near_rows = trace[near][:MAX_REJECT_EXAMPLES]
        near_examples = _examples(spec, unit, near_rows)
        for row, example in zip(near_rows.tolist(), near_examples, strict=True):
            if kept_example is not None:
                example["kept"] = kept_example(*near_duplicates[row[cols.T_POSITION]])
        result.examples["near_duplicate"] = near_examples
    result.examples.pop("no_tokens", None)
    no_tokens = (trace[:, cols.T_SPLIT] == cols.NO_TOKENS) & ~(dup | near)
    if no_tokens_examples := _examples(spec, unit, trace[no_tokens]):
        result.examples["no_tokens"] = no_tokens_examples


def _drop_pieces(
    spec: JobSpec, result: UnitResult, split: str, drop: np.ndarray
) -> list[dict[str, Any]]:
    """The part entries of ``split`` without the pieces ``drop`` marks (one flag per piece,
    in order): from the first part that holds one on, blocks read back, filtered and
    written as ``fix-`` parts. The written parts stay as they are (the driver removes
    those no entry names)."""
    from pipeline.prepare.segment import PieceBatch

    entries = result.parts[split]
    firsts = np.cumsum([0] + [e["n_docs"] for e in entries])
    first = int(np.searchsorted(firsts, np.flatnonzero(drop)[0], side="right")) - 1
    dtype = token_dtype(spec.vocab_size)
    writer = steps.SplitParts(spec, result.unit, split, dtype, naming=fix_part_name)
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
    return writer.entries
