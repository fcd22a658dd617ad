"""Task data: csv / jsonl / parquet rows -> checked examples -> token features -> batches.

Input formats follow the papers:
- encoders (BERT family): ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]`` with segment ids
  0 / 1; the head reads the [CLS] vector. RoBERTa's pairs: ``<s> A </s></s> B </s>``.
- causal models (GPT family), GPT's input transformations: ``<start> A <delim> B <extract>``
  with start = the tokenizer's bos, delim = sep, extract = eod (the token a causal model
  saw at the end of every pretraining document); the head reads the extract token.
  Similarity (``symmetric_pair``) feeds both orders and sums the two representations;
  multiple choice feeds ``context <delim> choice`` once per choice.
- tagging: one label per word; the word's first sub-token carries it.
- span QA: ``[CLS] question [SEP] context-window [SEP]``, windows every ``doc_stride``
  context tokens; a window without the answer points start and end at position 0.

Every example is a list of *views* (token sequences): 1 normally, 2 for a symmetric pair,
one per choice for multiple choice. The head pools each view and combines them.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from pipeline.finetune.config import FinetuneError, TaskSection

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# Architectures whose pair input puts two separators between the segments (RoBERTa).
DOUBLE_SEP_ARCHS = {"roberta"}


# ----------------------------------------------------------------------------- reading


def read_rows(path: str | Path, fmt: str = "auto") -> list[dict[str, Any]]:
    """All rows of a csv / jsonl / parquet file as dicts; clear errors for bad files."""
    path = Path(path)
    if not path.is_file():
        raise FinetuneError(f"data file {path} does not exist")
    if fmt == "auto":
        fmt = FORMATS.get(path.suffix.lower(), "")
        if not fmt:
            raise FinetuneError(
                f"data file {path}: unknown extension {path.suffix!r}; use .csv, .jsonl or "
                ".parquet, or set data.format"
            )
    if path.stat().st_size == 0:
        raise FinetuneError(f"data file {path} is empty")
    if fmt == "csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    elif fmt == "jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise FinetuneError(f"{path}:{i}: not valid JSON ({err})") from None
                if not isinstance(row, dict):
                    raise FinetuneError(f"{path}:{i}: a JSON object per line expected")
                rows.append(row)
    else:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a bad file
            raise FinetuneError(f"data file {path} is not a readable parquet file: {err}") from None
    if not rows:
        raise FinetuneError(f"data file {path} has no rows")
    return rows


def needed_columns(task: TaskSection) -> list[str]:
    if task.type == "span_qa":
        return [task.question_column, task.context_column, task.answers_column]
    if task.type == "multiple_choice":
        return [task.text_column, task.choices_column, task.label_column]
    cols = [task.text_column]
    if task.text_pair_column:
        cols.append(task.text_pair_column)
    return [*cols, task.label_column]


def check_columns(rows: list[dict[str, Any]], task: TaskSection, path: str, labelled: bool) -> None:
    found = list(rows[0])
    wanted = needed_columns(task)
    if not labelled:  # prediction input: no labels needed
        wanted = [c for c in wanted if c not in (task.label_column, task.answers_column)]
    missing = [c for c in wanted if c not in found]
    if missing:
        raise FinetuneError(
            f"{path}: missing column(s) {', '.join(missing)}; the file has columns "
            f"{', '.join(found)} (set task.*_column to the names you use)"
        )


# ----------------------------------------------------------------------------- labels


def _as_list(value: Any, what: str, where: str) -> list:
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):  # a JSON list inside a csv cell
            try:
                return list(json.loads(value))
            except json.JSONDecodeError:
                pass
        return value.split()
    if isinstance(value, list | tuple | np.ndarray):
        return list(value)
    raise FinetuneError(f"{where}: {what} must be a list or a space-separated string")


def row_labels(row: dict[str, Any], task: TaskSection, where: str) -> list[str]:
    """The string labels of one row (one per word for tagging)."""
    value = row[task.label_column]
    if task.type == "tagging":
        return [str(v) for v in _as_list(value, task.label_column, where)]
    return [str(value)]


def build_label_map(rows: list[dict[str, Any]], task: TaskSection, path: str) -> list[str]:
    """Sorted label strings of the training split (index = class id)."""
    if task.type in ("regression", "span_qa", "multiple_choice"):
        return []
    labels = {lab for i, r in enumerate(rows) for lab in row_labels(r, task, f"{path} row {i + 1}")}
    if len(labels) < 2 and task.type == "classification":
        raise FinetuneError(f"{path}: only one label ({', '.join(labels)}) in the training data")
    return sorted(labels)


# ----------------------------------------------------------------------------- encoding


@dataclass
class Specials:
    start: int  # [CLS] / GPT's start token
    delim: int  # [SEP] / GPT's delimiter
    end: int  # [SEP] / GPT's extract token
    pad: int


def specials_for(roles: dict[str, int], causal: bool) -> Specials:
    if causal:
        return Specials(roles["bos"], roles["sep"], roles["eod"], roles["pad"])
    return Specials(roles["cls"], roles["sep"], roles["sep"], roles["pad"])


@dataclass
class Example:
    views: list[tuple[list[int], list[int]]]  # (input_ids, token_type_ids) per view
    label: Any = None  # class id / float / choice index / (start, end) / per-word ids
    word_starts: list[int] = field(default_factory=list)  # tagging: token index of each word
    row: int = 0  # index of the source row
    # span QA: token -> (char start, char end) in the context, -1 outside the context
    offsets: list[tuple[int, int]] = field(default_factory=list)


class Encoder:
    """Turns rows into Examples for one task, tokenizer and model family."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        roles: dict[str, int],
        causal: bool,
        task: TaskSection,
        arch: str | None = None,
    ):
        self.tok = tokenizer
        self.sp = specials_for(roles, causal)
        self.causal = causal
        self.task = task
        self.double_sep = arch in DOUBLE_SEP_ARCHS

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(str(text), add_special_tokens=False).ids

    def single(self, a: list[int]) -> tuple[list[int], list[int]]:
        a = a[: self.task.max_length - 2]
        return [self.sp.start, *a, self.sp.end], [0] * (len(a) + 2)

    def pair(self, a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
        delim = [self.sp.delim] * (2 if self.double_sep else 1)
        budget = self.task.max_length - 2 - len(delim)
        a, b = list(a), list(b)
        while len(a) + len(b) > budget:  # longest first, from the end (BERT's truncate_seq_pair)
            (a if len(a) >= len(b) else b).pop()
        ids = [self.sp.start, *a, *delim, *b, self.sp.end]
        return ids, [0] * (len(a) + 1 + len(delim)) + [1] * (len(b) + 1)

    def encode(self, rows: list[dict[str, Any]], labels: list[str], path: str, labelled: bool):
        t = self.task
        index = {lab: i for i, lab in enumerate(labels)}
        out: list[Example] = []
        for r, row in enumerate(rows):
            where = f"{path} row {r + 1}"
            if t.type == "span_qa":
                out.extend(self._qa(row, r, where, labelled))
                continue
            if t.type == "tagging":
                out.append(self._tagging(row, r, where, index, labelled))
                continue
            if t.type == "multiple_choice":
                choices = _as_list(row[t.choices_column], t.choices_column, where)
                ctx = self.ids(row[t.text_column])
                views = [self.pair(ctx, self.ids(c)) for c in choices]
                label = None
                if labelled:
                    label = _int_label(row[t.label_column], len(choices), where, t.label_column)
                out.append(Example(views, label, row=r))
                continue
            a = self.ids(row[t.text_column])
            if t.text_pair_column:
                b = self.ids(row[t.text_pair_column])
                views = [self.pair(a, b)] + ([self.pair(b, a)] if t.symmetric_pair else [])
            else:
                views = [self.single(a)]
            label = None
            if labelled:
                label = _label_value(row[t.label_column], t, index, labels, where)
            out.append(Example(views, label, row=r))
        return out

    def _tagging(self, row, r, where, index, labelled) -> Example:
        t = self.task
        words = [str(w) for w in _as_list(row[t.text_column], t.text_column, where)]
        enc = self.tok.encode(words, is_pretokenized=True, add_special_tokens=False)
        ids, starts, seen = [self.sp.start], [], set()
        for tok_id, w in zip(enc.ids, enc.word_ids, strict=True):
            if len(ids) >= t.max_length - 1:
                break  # the words that do not fit are cut (predicted as the first label)
            if w is not None and w not in seen:
                seen.add(w)
                starts.append(len(ids))
            ids.append(tok_id)
        # a word whose sub-tokens were all cut off must not keep a start
        ids.append(self.sp.end)
        label = None
        if labelled:
            tags = row_labels(row, t, where)
            if len(tags) != len(words):
                raise FinetuneError(
                    f"{where}: {len(words)} words but {len(tags)} labels in "
                    f"{t.label_column!r} (one label per word)"
                )
            label = [_lookup(tag, index, where) for tag in tags[: len(starts)]]
        return Example([(ids, [0] * len(ids))], label, word_starts=starts, row=r)

    def _qa(self, row, r, where, labelled) -> list[Example]:
        t = self.task
        q = self.ids(row[t.question_column])[: t.max_length // 2]
        context = str(row[t.context_column])
        enc = self.tok.encode(context, add_special_tokens=False)
        c_ids, c_off = enc.ids, enc.offsets
        span = None
        if labelled:
            span = _answer_chars(row[t.answers_column], context, where)[0]
        window = t.max_length - len(q) - 3
        if window < 1:
            raise FinetuneError(f"{where}: the question leaves no room for the context")
        out = []
        starts = range(0, max(1, len(c_ids) - window + t.doc_stride), t.doc_stride)
        for lo in starts:
            hi = min(lo + window, len(c_ids))
            ids = [self.sp.start, *q, self.sp.delim, *c_ids[lo:hi], self.sp.end]
            types = [0] * (len(q) + 2) + [1] * (hi - lo + 1)
            first = len(q) + 2  # index of the first context token
            offsets = [(-1, -1)] * first + list(c_off[lo:hi]) + [(-1, -1)]
            label = None
            if span is not None:
                label = (0, 0)
                s_tok = [i for i in range(lo, hi) if c_off[i][0] <= span[0] < c_off[i][1]]
                e_tok = [i for i in range(lo, hi) if c_off[i][0] < span[1] <= c_off[i][1]]
                if s_tok and e_tok:
                    label = (first + s_tok[0] - lo, first + e_tok[0] - lo)
            out.append(Example([(ids, types)], label, row=r, offsets=offsets))
            if hi == len(c_ids):
                break
        return out


def _lookup(label: str, index: dict[str, int], where: str) -> int:
    if label not in index:
        raise FinetuneError(
            f"{where}: label {label!r} does not occur in the training data "
            f"(known labels: {', '.join(index)}); fix the row or add examples of it to train"
        )
    return index[label]


def _label_value(value, task: TaskSection, index, labels, where):
    if task.type == "regression":
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise FinetuneError(f"{where}: regression label {value!r} is not a number") from None
        if not math.isfinite(v):
            raise FinetuneError(f"{where}: regression label {value!r} is not finite")
        return v
    return _lookup(str(value), index, where)


def _int_label(value, n_choices: int, where: str, column: str) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise FinetuneError(f"{where}: {column} {value!r} is not a choice index") from None
    if not 0 <= v < n_choices:
        raise FinetuneError(f"{where}: {column} {v} is not in [0, {n_choices})")
    return v


def answers_of(value: Any, where: str) -> list[dict[str, Any]]:
    """{"text", "answer_start"} | a list of them | SQuAD's {"text": [...], "answer_start": [...]}."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise FinetuneError(f"{where}: answers must be JSON with text/answer_start") from None
    if isinstance(value, dict) and isinstance(value.get("text"), list | tuple):
        value = [
            {"text": t, "answer_start": s}
            for t, s in zip(value["text"], value["answer_start"], strict=True)
        ]
    if isinstance(value, dict):
        value = [value]
    if not value or not all(isinstance(a, dict) and "text" in a for a in value):
        raise FinetuneError(f"{where}: answers need at least one {{'text', 'answer_start'}}")
    return list(value)


def _answer_chars(value: Any, context: str, where: str) -> list[tuple[int, int]]:
    spans = []
    for a in answers_of(value, where):
        text = str(a["text"])
        start = int(a.get("answer_start", context.find(text)))
        if start < 0 or context[start : start + len(text)] != text:
            raise FinetuneError(
                f"{where}: answer {text!r} is not at answer_start {start} of the context"
            )
        spans.append((start, start + len(text)))
    return spans


# ----------------------------------------------------------------------------- batches


def collate(examples: list[Example], pad_id: int, task_type: str) -> dict[str, torch.Tensor]:
    """Pad every view of every example to one [B, V, T] block (V = most views in the batch)."""
    B = len(examples)
    V = max(len(e.views) for e in examples)
    T = max(len(ids) for e in examples for ids, _ in e.views)
    input_ids = torch.full((B, V, T), pad_id, dtype=torch.long)
    types = torch.zeros((B, V, T), dtype=torch.long)
    mask = torch.zeros((B, V, T), dtype=torch.long)
    view_mask = torch.zeros((B, V), dtype=torch.bool)
    for b, e in enumerate(examples):
        for v, (ids, tt) in enumerate(e.views):
            input_ids[b, v, : len(ids)] = torch.tensor(ids)
            types[b, v, : len(tt)] = torch.tensor(tt)
            mask[b, v, : len(ids)] = 1
            view_mask[b, v] = True
    batch = {
        "input_ids": input_ids,
        "token_type_ids": types,
        "attention_mask": mask,
        "view_mask": view_mask,
    }
    if task_type == "tagging":
        W = max(1, max(len(e.word_starts) for e in examples))
        starts = torch.zeros((B, W), dtype=torch.long)
        word_mask = torch.zeros((B, W), dtype=torch.bool)
        for b, e in enumerate(examples):
            starts[b, : len(e.word_starts)] = torch.tensor(e.word_starts, dtype=torch.long)
            word_mask[b, : len(e.word_starts)] = True
        batch["word_starts"], batch["word_mask"] = starts, word_mask
    labels = [e.label for e in examples]
    if all(lab is not None for lab in labels):
        if task_type == "regression":
            batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        elif task_type == "tagging":
            W = batch["word_starts"].shape[1]
            tags = torch.full((B, W), -100, dtype=torch.long)
            for b, lab in enumerate(labels):
                tags[b, : len(lab)] = torch.tensor(lab, dtype=torch.long)
            batch["labels"] = tags
        elif task_type == "span_qa":
            batch["start_positions"] = torch.tensor([s for s, _ in labels], dtype=torch.long)
            batch["end_positions"] = torch.tensor([e for _, e in labels], dtype=torch.long)
        else:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
    return batch


def shard_indices(n: int, batch: int, world: int, rank: int, seed: int, epoch: int) -> list[int]:
    """This rank's example order for one epoch: a seeded shuffle, padded by wrapping so
    every rank gets the same number of full batches (no rank waits at the end)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    per_step = batch * world
    total = max(per_step, math.ceil(n / per_step) * per_step)
    order = np.resize(order, total)  # wraps around: a few examples twice in the last step
    return order[rank::world].tolist()
