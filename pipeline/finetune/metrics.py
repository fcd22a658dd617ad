"""Task metrics, pure functions of predictions and gold labels (no sklearn / seqeval)."""

from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np


def accuracy(pred: list[int], gold: list[int]) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(gold))) if gold else 0.0


def macro_f1(pred: list[int], gold: list[int]) -> float:
    """Mean F1 over the classes that occur in gold or predictions."""
    p, g = np.asarray(pred), np.asarray(gold)
    scores = []
    for c in sorted(set(p.tolist()) | set(g.tolist())):
        tp = int(((p == c) & (g == c)).sum())
        fp, fn = int(((p == c) & (g != c)).sum()), int(((p != c) & (g == c)).sum())
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(scores)) if scores else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank (as Spearman's rho needs)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    sx = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def pearson(pred: list[float], gold: list[float]) -> float:
    p, g = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if len(p) < 2 or p.std() == 0 or g.std() == 0:
        return 0.0
    return float(np.corrcoef(p, g)[0, 1])


def spearman(pred: list[float], gold: list[float]) -> float:
    return pearson(
        _ranks(np.asarray(pred, float)).tolist(), _ranks(np.asarray(gold, float)).tolist()
    )


def entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, start, end) chunks of a tag sequence: IOB2 / IOB1 (B-X, I-X, O); plain tags
    without a prefix are chunks of equal neighbouring tags ("O" is outside)."""
    chunks: set[tuple[str, int, int]] = set()
    start, kind = 0, None
    for i, tag in enumerate([*tags, "O"]):
        if tag == "O":
            prefix, typ = "O", None
        elif tag[:2] in ("B-", "I-"):
            prefix, typ = tag[0], tag[2:]
        else:
            prefix, typ = "", tag
        begins = typ is not None and (kind is None or typ != kind or prefix == "B")
        if kind is not None and (typ is None or begins):
            chunks.add((kind, start, i))
            kind = None
        if begins:
            start, kind = i, typ
    return chunks


def entity_scores(pred: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    tp = n_pred = n_gold = 0
    right = total = 0
    for p, g in zip(pred, gold, strict=True):
        pe, ge = entities(p), entities(g)
        tp += len(pe & ge)
        n_pred += len(pe)
        n_gold += len(ge)
        right += sum(a == b for a, b in zip(p, g, strict=False))
        total += len(g)
    prec = tp / n_pred if n_pred else 0.0
    rec = tp / n_gold if n_gold else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    return {
        "entity_f1": f1,
        "entity_precision": prec,
        "entity_recall": rec,
        "token_accuracy": right / total if total else 0.0,
    }


def normalize_answer(s: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


def qa_scores(pred: list[str], gold: list[list[str]]) -> dict[str, float]:
    """EM and F1, each the best over the gold answers of a question, averaged (in [0,1])."""
    em = [
        max(float(normalize_answer(p) == normalize_answer(g)) for g in gs)
        for p, gs in zip(pred, gold, strict=True)
    ]
    f1 = [max(qa_f1(p, g) for g in gs) for p, gs in zip(pred, gold, strict=True)]
    return {
        "exact_match": float(np.mean(em)) if em else 0.0,
        "f1": float(np.mean(f1)) if f1 else 0.0,
    }


def regression_scores(pred: list[float], gold: list[float]) -> dict[str, float]:
    p, g = np.asarray(pred, float), np.asarray(gold, float)
    return {
        "pearson": pearson(pred, gold),
        "spearman": spearman(pred, gold),
        "mse": float(np.mean((p - g) ** 2)) if len(g) else 0.0,
    }


def classification_scores(pred: list[int], gold: list[int]) -> dict[str, float]:
    return {"accuracy": accuracy(pred, gold), "macro_f1": macro_f1(pred, gold)}


def matthews_corrcoef(pred: list[int], gold: list[int]) -> float:
    """Matthews correlation in its K-class form (Gorodkin 2004, as sklearn computes it): with
    t_k / p_k the times class k is gold / predicted, c the correct predictions and s the
    samples, ``(c*s - t.p) / sqrt((s^2 - p.p) * (s^2 - t.t))``; 0.0 when the denominator is 0
    (one class only in gold or in the predictions). Two classes: the usual
    ``(tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn))``."""
    p, g = np.asarray(pred), np.asarray(gold)
    if len(p) != len(g):
        raise ValueError(f"{len(p)} predictions for {len(g)} gold labels")
    if not len(g):
        return 0.0
    _, idx = np.unique(np.concatenate([p, g]), return_inverse=True)
    pi, gi = idx[: len(p)], idx[len(p) :]
    k = int(idx.max()) + 1
    t = np.bincount(gi, minlength=k).astype(np.float64)
    pk = np.bincount(pi, minlength=k).astype(np.float64)
    c, s = float((pi == gi).sum()), float(len(g))
    den = (s * s - pk @ pk) * (s * s - t @ t)
    return float((c * s - t @ pk) / np.sqrt(den)) if den > 0 else 0.0


def binary_f1(pred: list[int], gold: list[int], positive: int) -> float:
    """F1 of the class ``positive`` (GLUE's MRPC / QQP F1): 2tp / (2tp + fp + fn); 0.0 when
    undefined (the class never predicted nor gold) or when no positive is found."""
    p, g = np.asarray(pred), np.asarray(gold)
    tp = int(((p == positive) & (g == positive)).sum())
    fp, fn = (
        int(((p == positive) & (g != positive)).sum()),
        int(((p != positive) & (g == positive)).sum()),
    )
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
