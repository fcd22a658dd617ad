"""A unit of work of `plm data prepare`: what its tasks are given and what they give back.

``JobSpec`` is what every task needs; ``UnitResult`` and the trace are what a write task
returns (worker.write_unit) and a fix task corrects (worker.fix_unit); a reject example
says where a rejected document is, for the manifest's ``reject_examples``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pipeline.prepare.near_dedup import NearDedupSpec
from pipeline.prepare.readers import Slice, Source

MAX_REJECT_EXAMPLES = 5  # per reason and unit; the driver keeps the first 5 overall
EXAMPLE_CHARS = 120  # of a filtered document's text, in its reject example

# The trace of a unit: one row per document that survived cleaning, in source order.
(T_POSITION, T_SLICE, T_ORDINAL, T_LINE, T_SPLIT, T_LANGUAGE, T_PIECES, T_TOKENS) = range(8)
TRACE_COLUMNS = 8
NO_TOKENS = -1  # T_SPLIT of a document that gave no token
LANGUAGES = ("other", "zh")  # the first T_LANGUAGE codes (UnitResult.language_names)


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
    reused: bool = False  # loaded from the unit's record (records.py), not written now


def part_name(split: str, unit: int, k: int) -> str:
    return f"{split}/part-{unit:06d}-{k:03d}.tar"


def fix_part_name(split: str, unit: int, k: int) -> str:
    """The name ``fix_unit`` writes part k under: never one a write task wrote, so a
    retried fix reads the same parts and writes the same files."""
    return f"{split}/fix-{unit:06d}-{k:03d}.tar"


def reject_example(part: Slice, source: str, ordinal: int, line: int | None, detail=None):
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
