"""Inference shared by evaluation and `plm predict`: examples -> per-row predictions -> metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeline.finetune import metrics as M
from pipeline.finetune.config import TaskSection
from pipeline.finetune.data import Example, answers_of, collate, row_labels


def _to(batch: dict[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(dev) for k, v in batch.items()}


@torch.no_grad()
def run_model(
    forward: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    examples: list[Example],
    task: TaskSection,
    pad_id: int,
    batch_size: int,
    dev: torch.device,
    decode_tags: Callable | None = None,
) -> list[Any]:
    """One raw output per example: class probabilities, a score, choice scores, tag ids,
    or (start_logits, end_logits) for span QA. Labels are not passed to the model."""
    out: list[Any] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        batch = collate(chunk, pad_id, task.type)
        batch = {
            k: v
            for k, v in batch.items()
            if k not in ("labels", "start_positions", "end_positions")
        }
        res = forward(_to(batch, dev))
        if task.type == "tagging":
            out.extend(decode_tags(res, batch["word_mask"].to(dev)))
        elif task.type == "span_qa":
            s, e = res["start_logits"].float().cpu(), res["end_logits"].float().cpu()
            out.extend((s[b], e[b]) for b in range(len(chunk)))
        elif task.type == "regression":
            out.extend(res["logits"].float().cpu().tolist())
        else:
            out.extend(torch.softmax(res["logits"].float(), -1).cpu().tolist())
    return out


def best_span(example: Example, start: torch.Tensor, end: torch.Tensor, max_tokens: int):
    """(score, char_start, char_end) of the best context span of one window, or None."""
    ctx = [i for i, (a, _) in enumerate(example.offsets) if a >= 0]
    if not ctx:
        return None
    lo, hi = ctx[0], ctx[-1] + 1
    s, e = start[lo:hi], end[lo:hi]
    n = hi - lo
    scores = s[:, None] + e[None, :]  # [start, end]
    allowed = torch.ones(n, n, dtype=torch.bool).triu() & ~torch.ones(n, n, dtype=torch.bool).triu(
        max_tokens
    )
    scores = scores.masked_fill(~allowed, float("-inf"))
    flat = int(scores.argmax())
    i, j = divmod(flat, n)
    return float(scores[i, j]), example.offsets[lo + i][0], example.offsets[lo + j][1]


def row_predictions(
    raw: list[Any],
    examples: list[Example],
    rows: list[dict[str, Any]],
    task: TaskSection,
    labels: list[str],
) -> list[dict[str, Any]]:
    """One prediction dict per input row (span QA: the best span over the row's windows)."""
    preds: list[dict[str, Any] | None] = [None] * len(rows)
    if task.type == "span_qa":
        best: dict[int, tuple[float, int, int]] = {}
        for r, e in zip(raw, examples, strict=True):
            cand = best_span(e, r[0], r[1], task.max_answer_tokens)
            if cand and (e.row not in best or cand[0] > best[e.row][0]):
                best[e.row] = cand
        for i, row in enumerate(rows):
            _, a, b = best.get(i, (0.0, 0, 0))
            preds[i] = {"prediction": str(row[task.context_column])[a:b], "start_char": a}
        return preds  # type: ignore[return-value]
    for r, e in zip(raw, examples, strict=True):
        if task.type == "regression":
            preds[e.row] = {"prediction": float(r)}
        elif task.type == "multiple_choice":
            preds[e.row] = {"prediction": int(max(range(len(r)), key=r.__getitem__)), "scores": r}
        elif task.type == "tagging":
            n_words = len(row_words(rows[e.row], task))
            filler = "O" if "O" in labels else labels[0]  # words cut off by max_length
            tags = [labels[t] for t in r] + [filler] * (n_words - len(r))
            preds[e.row] = {"prediction": tags}
        else:
            k = int(max(range(len(r)), key=r.__getitem__))
            preds[e.row] = {"prediction": labels[k], "probability": r[k]}
    return preds  # type: ignore[return-value]


def row_words(row: dict[str, Any], task: TaskSection) -> list[str]:
    from pipeline.finetune.data import _as_list

    return [str(w) for w in _as_list(row[task.text_column], task.text_column, "row")]


def score(
    preds: list[dict[str, Any]], rows: list[dict[str, Any]], task: TaskSection, labels: list[str]
) -> dict[str, float]:
    """The task's metrics (config.TASK_METRICS) of row predictions against the rows' labels."""
    p = [x["prediction"] for x in preds]
    if task.type == "span_qa":
        gold = [[str(a["text"]) for a in answers_of(r[task.answers_column], "row")] for r in rows]
        return M.qa_scores(p, gold)
    if task.type == "tagging":
        gold = [row_labels(r, task, "row") for r in rows]
        return M.entity_scores(p, gold)
    if task.type == "regression":
        return M.regression_scores(p, [float(r[task.label_column]) for r in rows])
    if task.type == "multiple_choice":
        return M.classification_scores(p, [int(r[task.label_column]) for r in rows])
    index = {lab: i for i, lab in enumerate(labels)}
    pred, gold = [index[x] for x in p], [index[str(r[task.label_column])] for r in rows]
    out = M.classification_scores(pred, gold) | {"mcc": M.matthews_corrcoef(pred, gold)}
    if task.positive_label is not None:
        out["f1"] = M.binary_f1(pred, gold, index.get(task.positive_label, -1))
    return out
