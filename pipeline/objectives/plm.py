"""Permutation language modelling (XLNet), built the way XLNet's own data pipeline builds it.

The epoch's documents, in the epoch's order, form one stream with the end-of-document token
after each. Unit u is stream tokens ``[u*R, u*R + T - 3)`` (R = reuse_len, T = seq_len), so
units overlap and the first R tokens of unit u+1 continue the first R of unit u: with
``recurrent_rows`` the model's memory of a row (its first R positions, cached) is exactly
the text before the segment it reads now. Per example:

1. layout ``[reuse R][A] [SEP] [B] [SEP] [CLS]``: the unit's text cut once at a random
   point after the reuse part; token_type_ids 0 up to the first [SEP], 1 up to the second,
   2 for [CLS] (XLNet's convention; the model only asks "same segment or not"). B is always
   the true continuation: XLNet trains without next-sentence prediction.
2. targets: ``P = round((T - 3) / K)`` text tokens (partial prediction, K = ``objective.plm.k``)
   in spans of n = 1..max_span consecutive tokens, P(n) ~ 1/n, each inside a context of
   K*n tokens (as XLNet's span sampling), the remainder topped up with single tokens.
3. factorization order: every non-target first (they see each other but no target), then
   the target spans in a random order, each span's tokens together and in a random order
   inside it. So only the last 1/K of the order is predicted, and spans are predicted as
   units, each token given the context and the spans before it.
4. model inputs (transformers' XLNet conventions): ``perm_mask`` [T, T] bool, true = i may
   not attend to j (j is a target not earlier than i in the order, itself included; the
   model lets the content stream see itself); ``target_mapping`` [P, T] one-hot rows in
   factorization order; labels ``target_labels`` [P], the tokens at those positions.

[SEP]/[CLS] are never targets. Randomness comes only from the example's ``rng``.
"""

from __future__ import annotations

import inspect

import numpy as np

from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives.base import JoinedLayout, Layout, Objective, Unit
from pipeline.objectives.clm import pack_block
from pipeline.objectives.mlm import masked_lm_loss

N_SPECIAL = 3  # [SEP] [SEP] [CLS]


class StreamLayout(JoinedLayout):
    """Units of ``width`` tokens every ``stride`` tokens of the eod-joined stream."""

    def __init__(
        self, order, n, stride: int, width: int, offset: int = 0, total: int | None = None
    ):
        self.stride, self.width = stride, width
        super().__init__(order, n, offset, total)

    def count(self, total: int) -> int:
        return (total - self.width) // self.stride + 1 if total >= self.width else 0

    def first_unit(self, offsets: np.ndarray) -> np.ndarray:
        return -(-offsets // self.stride)

    def span(self, u):  # u: an int or an array
        return u * self.stride, u * self.stride + self.width

    def unit(self, u: int) -> Unit:
        return Unit(key=(u,), pieces=self.pieces(*self.span(u), eod=True))


def n_predict(n_tokens: int, k: float) -> int:
    """Targets per example: 1/K of the text, at least one, never all of it."""
    return int(min(max(1, round(n_tokens / k)), n_tokens - 1))


def sample_spans(
    rng: np.random.Generator, n: int, goal: int, k: float, max_span: int
) -> list[tuple[int, int]]:
    """Non-overlapping [start, stop) spans of ``goal`` tokens in total among ``n``.

    Left to right: draw a length L (P(L) ~ 1/L), give the span a context of about K*L
    tokens (a random share before it, the rest after), until the goal or the end is
    reached; then top up with random single tokens (XLNet's _sample_mask, per token)."""
    lengths = np.arange(1, max_span + 1)
    p = 1.0 / lengths
    p /= p.sum()
    taken = np.zeros(n, dtype=bool)
    spans: list[tuple[int, int]] = []
    count = cur = 0
    while count < goal:
        length = min(int(rng.choice(lengths, p=p)), goal - count)
        context = max(int(round(k * length)) - length, 0)
        left = int(rng.integers(context + 1))
        start = cur + left
        if start + length > n:
            break
        spans.append((start, start + length))
        taken[start : start + length] = True
        count += length
        cur = start + length + context - left
    if count < goal:
        extra = rng.choice(np.flatnonzero(~taken), goal - count, replace=False)
        spans += [(int(i), int(i) + 1) for i in np.sort(extra)]
    return spans


def factorization_targets(rng: np.random.Generator, spans: list[tuple[int, int]]) -> np.ndarray:
    """The target tokens in factorization order: spans in a random order, each span's
    tokens consecutive in the order (a random order inside the span)."""
    parts = [
        spans[s][0] + rng.permutation(spans[s][1] - spans[s][0])
        for s in rng.permutation(len(spans))
    ]
    return np.concatenate(parts).astype(np.int64)


def permutation_mask(rank: np.ndarray) -> np.ndarray:
    """[T, T] bool, true = i may not attend to j. ``rank``: position in the factorization
    order of each target, -1 for the non-targets (which all come first)."""
    return (rank[None, :] >= 0) & (rank[None, :] >= rank[:, None])


class PlmObjective(Objective):
    kind = "plm"
    recurrent_rows = True  # row j's memory holds the text just before its current segment

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self.plm = cfg.plm
        self.cls_id, self.sep_id, self.eod_id = (int(roles[r]) for r in ("cls", "sep", "eod"))
        self.width = seq_len - N_SPECIAL  # text tokens per example
        self.reuse_len = self._check_reuse(self.plm.reuse_len or seq_len // 2, "objective.plm")
        self.n_predict = n_predict(self.width, self.plm.k)

    def _check_reuse(self, reuse: int, where: str) -> int:
        if not 1 <= reuse <= self.width - 2:  # A and B need a token each
            raise ConfigError(
                f"{where}.reuse_len={reuse} does not fit data.seq_len={self.seq_len}: it must "
                f"be in [1, seq_len - 5 = {self.width - 2}] (reuse part + A + B + 3 specials)"
            )
        return reuse

    def attach(self, model) -> None:
        """Take the stream stride from the model: its cached positions (reuse_len) must be
        exactly the part of a segment the next one continues."""
        params = inspect.signature(model.forward).parameters
        cfg = getattr(model, "config", None)
        if not {"perm_mask", "target_mapping"} <= set(params) or not hasattr(cfg, "reuse_len"):
            raise ConfigError(
                f"objective.kind=plm needs a two-stream model (model.arch: xlnet), not "
                f"{type(model).__name__}"
            )
        mem_len = getattr(cfg, "mem_len", 0)
        if cfg.reuse_len is None:
            if mem_len > 0:
                raise ConfigError(
                    "model.reuse_len: must be set when model.mem_len > 0 with objective plm "
                    "(the memory must hold only the part the next segment continues)"
                )
            return
        if self.plm.reuse_len is not None and self.plm.reuse_len != cfg.reuse_len:
            raise ConfigError(
                f"objective.plm.reuse_len={self.plm.reuse_len} differs from model.reuse_len="
                f"{cfg.reuse_len}; remove objective.plm.reuse_len (it defaults to the model's)"
            )
        self.reuse_len = self._check_reuse(cfg.reuse_len, "model")

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        return StreamLayout(order, n, self.reuse_len, self.width, offset, total)

    def make_example(self, unit: Unit, docs: list[Document], rng) -> dict[str, np.ndarray]:
        T, W, R = self.seq_len, self.width, self.reuse_len
        text, _ = pack_block(unit.pieces, docs, self.eod_id, W)
        cut = R + int(rng.integers(1, W - R))  # A = text[R:cut], B = text[cut:], both >= 1
        ids = np.concatenate(
            [text[:cut], [self.sep_id], text[cut:], [self.sep_id, self.cls_id]]
        ).astype(np.int64)
        segments = np.zeros(T, dtype=np.int64)
        segments[cut + 1 : T - 1] = 1
        segments[T - 1] = 2

        spans = sample_spans(rng, W, self.n_predict, self.plm.k, self.plm.max_span)
        order = factorization_targets(rng, spans)
        positions = np.where(order < cut, order, order + 1)  # text index -> input position
        rank = np.full(T, -1, dtype=np.int64)
        rank[positions] = np.arange(positions.shape[0])
        target_mapping = np.zeros((positions.shape[0], T), dtype=bool)
        target_mapping[np.arange(positions.shape[0]), positions] = True
        return {
            "input_ids": ids,
            "token_type_ids": segments,
            "perm_mask": permutation_mask(rank),
            "target_mapping": target_mapping,
            "target_labels": ids[positions],
        }

    def loss(self, outputs, batch):
        loss, acc = masked_lm_loss(outputs["logits"], batch["target_labels"])
        return loss, {"plm_loss": loss.detach(), "plm_acc": acc}
