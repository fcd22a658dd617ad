"""word2vec's objective: negative sampling over windows of the shards' token stream.

Each example is one window of at most seq_len tokens of a document (``WindowLayout``).
Per example, from its own seeded rng, as in the word2vec tool:

* subsampling (``objective.word2vec.subsample`` = t > 0): a token of relative frequency
  f is kept with probability min(1, sqrt(t/f) + t/f) and the discarded ones are removed
  before windows are taken (so the window reaches further); special tokens ([UNK], ...)
  are always removed;
* a dynamic window: center t uses contexts at distance 1..b_t, b_t ~ U{1..window};
* negatives: ``negatives`` noise ids per true pair (skipgram) or per center (cbow) from
  P(w) ~ count(w) ** noise_power (0.75), counts of the train split (specials: 0).

Batch: input_ids [L] (the kept tokens, then padding), attention_mask, context_ids
[L, 2W] (slot j = offset -W..-1, 1..W; -100 where empty), negative_ids [L, 2W, K]
(skipgram) or [L, K] (cbow). Loss: -log σ(pos) - Σ_k log σ(-neg_k), averaged over the
true pairs (skipgram) or the centers with at least one context (cbow).

The unigram counts come from the data: ``bind_data`` (the trainer calls it with the
data dir) counts the train split's tokens (at most ``count_max_tokens``, in manifest
order: the same counts on every rank) and also stores them in the model's ``counts``.
``mode``, ``window`` and ``negatives`` are the model's config, read in ``attach``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives.base import (
    IGNORE_INDEX,
    Layout,
    Objective,
    Unit,
    WindowLayout,
    special_table,
)


def count_unigrams(data, vocab_size: int, max_tokens: int) -> np.ndarray:
    """Token counts of the train split, shards and documents in manifest order, stopping
    after the document that reaches ``max_tokens``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    seen = 0
    for entry in data.shards("train"):
        name = entry["name"]
        for i, n in enumerate(data.doc_lengths(name).tolist()):
            if n == 0:
                continue
            counts += np.bincount(data.read(name, i).tokens, minlength=vocab_size)[:vocab_size]
            seen += n
            if seen >= max_tokens:
                return counts
    return counts


def context_slots(n: int, window: int, reach: np.ndarray, L: int) -> np.ndarray:
    """[L, 2W] positions of each center's contexts, -1 where empty. ``reach`` [n]: the
    dynamic window b_t of each of the n real positions."""
    offsets = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)])
    pos = np.arange(n)[:, None] + offsets[None, :]
    ok = (np.abs(offsets)[None, :] <= reach[:, None]) & (pos >= 0) & (pos < n)
    slots = np.full((L, 2 * window), -1, dtype=np.int64)
    slots[:n] = np.where(ok, pos, -1)
    return slots


class Word2vecObjective(Objective):
    kind = "word2vec"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self.w2v = cfg.word2vec
        self.pad_id = int(roles["pad"])
        self.is_special = special_table(vocab_size, special_ids)
        self.mode, self.window, self.negatives = "skipgram", 5, 5
        self.attached = False
        self.noise_cdf: np.ndarray | None = None
        self.keep_prob = np.where(self.is_special, 0.0, 1.0)

    def attach(self, model: torch.nn.Module) -> None:
        cfg = getattr(model, "config", None)
        if not all(hasattr(cfg, k) for k in ("mode", "window", "negatives")):
            raise ConfigError(
                "objective.kind=word2vec trains word2vec: set model.arch=word2vec "
                f"(got a {type(model).__name__})"
            )
        self.mode, self.window, self.negatives = cfg.mode, cfg.window, cfg.negatives
        self.attached = True

    def bind_data(self, data, model: torch.nn.Module) -> None:
        counts = count_unigrams(data, self.vocab_size, self.w2v.count_max_tokens)
        self.set_counts(counts)
        model.set_counts(torch.from_numpy(counts).float())

    def set_counts(self, counts: np.ndarray) -> None:
        """The noise distribution and the subsampling keep-probabilities from counts."""
        counts = np.where(self.is_special, 0, counts[: self.vocab_size]).astype(np.float64)
        total = counts.sum()
        if total <= 0:
            raise ConfigError("word2vec: the train split has no ordinary tokens to count")
        noise = counts**self.w2v.noise_power
        self.noise_cdf = np.cumsum(noise / noise.sum())
        keep = np.ones_like(counts)
        t = self.w2v.subsample
        if t > 0:
            f = np.maximum(counts / total, 1e-30)
            keep = np.minimum(1.0, np.sqrt(t / f) + t / f)
        self.keep_prob = np.where(self.is_special, 0.0, keep)

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        return WindowLayout(order, n, self.seq_len, offset, total)

    def _draw_noise(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.noise_cdf is None:
            raise RuntimeError(
                "word2vec objective has no unigram counts: call bind_data(data, model) "
                "or set_counts(counts) first (the trainer does)"
            )
        ids = np.searchsorted(self.noise_cdf, rng.random(shape), side="right")
        return np.minimum(ids, self.vocab_size - 1).astype(np.int64)

    def make_example(self, unit: Unit, docs: list[Document], rng) -> dict[str, np.ndarray]:
        if not self.attached:
            raise RuntimeError("word2vec objective: call attach(model) first (the trainer does)")
        (piece,), (doc,) = unit.pieces, docs
        L, W, K = self.seq_len, self.window, self.negatives
        tokens = np.asarray(doc.tokens[piece.start : piece.stop], dtype=np.int64)
        kept = tokens[rng.random(tokens.shape[0]) < self.keep_prob[tokens]]
        n = kept.shape[0]
        ids = np.full(L, self.pad_id, dtype=np.int64)
        ids[:n] = kept
        mask = np.zeros(L, dtype=np.int64)
        mask[:n] = 1
        slots = context_slots(n, W, rng.integers(1, W + 1, size=n), L)
        contexts = np.where(slots >= 0, ids[np.maximum(slots, 0)], IGNORE_INDEX)
        shape = (L, 2 * W, K) if self.mode == "skipgram" else (L, K)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "context_ids": contexts,
            "negative_ids": self._draw_noise(rng, shape),
        }

    def loss(self, outputs, batch):
        pos, neg = outputs["pos_scores"].float(), outputs["neg_scores"].float()
        valid = batch["context_ids"] >= 0
        if self.mode == "cbow":
            valid = valid.any(-1) & batch["attention_mask"].bool()
        pos_loss = -F.logsigmoid(pos)[valid]
        neg_loss = -F.logsigmoid(-neg).sum(-1)[valid]
        if pos_loss.numel() == 0:
            zero = pos.sum() * 0.0 + neg.sum() * 0.0
            return zero, {"pos_loss": zero.detach(), "neg_loss": zero.detach()}
        loss = pos_loss.mean() + neg_loss.mean()
        return loss, {"pos_loss": pos_loss.mean().detach(), "neg_loss": neg_loss.mean().detach()}
