"""Masked language modelling (BERT, RoBERTa): masking, the MLM-only objective, the loss.

Masking is per token and Bernoulli, as in RoBERTa's dynamic masking: each maskable
token is selected with ``probability``; a selected token becomes [MASK] with
``mask_fraction``, a random ordinary token with ``random_fraction``, else stays; the
label is the original id at selected positions and -100 elsewhere. Special tokens
(every role id, [UNK] included, and padding) are never selected. With ``whole_word``
the selection is drawn per word (``words.npy`` start offsets) and applies to all of
the word's tokens; the 80/10/10 choice stays per token, as in BERT's whole-word masking.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config import MlmConfig
from pipeline.data.shards import Document
from pipeline.objectives.base import (
    IGNORE_INDEX,
    Layout,
    Objective,
    Unit,
    WindowLayout,
    special_table,
)


def masking_draws(
    rng: np.random.Generator, length: int, word_start: np.ndarray | None = None
) -> np.ndarray:
    """The uniform draws masking one sequence uses, [3, length]: selection (one per
    word with ``word_start``, True where a word starts: all its tokens share it),
    action (mask / random / keep) and which replacement token, per position."""
    if word_start is None:
        return rng.random((3, length))
    word = np.cumsum(word_start) - 1  # word number of every position
    select = rng.random(int(word[-1]) + 1)[word]
    return np.concatenate([select[None], rng.random((2, length))])


def apply_masking(
    ids: np.ndarray,
    maskable: np.ndarray,
    draws: np.ndarray,
    cfg: MlmConfig,
    mask_id: int,
    replacements: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(masked ids, labels) from ``masking_draws``: ids [..., T], draws [..., 3, T]."""
    select, action, pick = draws[..., 0, :], draws[..., 1, :], draws[..., 2, :]
    selected = maskable & (select < cfg.probability)
    labels = np.where(selected, ids, IGNORE_INDEX)
    inputs = np.where(selected & (action < cfg.mask_fraction), mask_id, ids)
    random = selected & (action >= cfg.mask_fraction)
    random &= action < cfg.mask_fraction + cfg.random_fraction
    n = replacements.shape[0]
    index = np.minimum((pick * n).astype(np.int64), n - 1)
    inputs = np.where(random, replacements[index], inputs)
    return inputs, labels


def mask_tokens(
    ids: np.ndarray,
    maskable: np.ndarray,
    rng: np.random.Generator,
    cfg: MlmConfig,
    mask_id: int,
    replacements: np.ndarray,
    word_start: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(masked input ids, labels) for one sequence. ``maskable``: positions that may be
    selected; ``replacements``: the ids a random replacement is drawn from;
    ``word_start``: True where a word starts (whole-word masking) or None."""
    draws = masking_draws(rng, ids.shape[0], word_start)
    return apply_masking(ids, maskable, draws, cfg, mask_id, replacements)


def word_starts_in(doc: Document, start: int, stop: int) -> np.ndarray:
    """Positions (relative to ``start``) where a word starts in tokens [start, stop);
    the first token always starts one (a cut never glues two half words together)."""
    words = doc.words[(doc.words > start) & (doc.words < stop)] - start
    return np.concatenate([[0], words]).astype(np.int64)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) over the labelled positions.

    Only the labelled rows (~15%) of ``logits`` [B, T, Vpad] are gathered. The padded
    vocabulary columns stay in the softmax (labels are always < the real vocabulary, so
    training pushes them down, as in Megatron); slicing them off would copy all logits.
    A batch without any labelled position gives a zero loss that still has a graph.
    """
    selected = labels != IGNORE_INDEX
    picked = logits[selected].float()
    target = labels[selected]
    if target.numel() == 0:
        zero = logits.sum() * 0.0
        return zero, zero.detach()
    loss = F.cross_entropy(picked, target)
    acc = (picked.detach().argmax(-1) == target).float().mean()
    return loss, acc


class Rows:
    """The batch under construction: preallocated [B, T] arrays an objective fills row by
    row (no per-example arrays to stack), plus the positions that may be masked and,
    for whole-word masking, where words start."""

    def __init__(self, batch_size: int, seq_len: int, pad_id: int, whole_word: bool):
        shape = (batch_size, seq_len)
        self.arrays = {
            "input_ids": np.full(shape, pad_id, dtype=np.int64),
            "token_type_ids": np.zeros(shape, dtype=np.int64),
            "attention_mask": np.zeros(shape, dtype=np.int64),
        }
        self.maskable = np.zeros(shape, dtype=bool)
        self.word_start = np.zeros(shape, dtype=bool) if whole_word else None

    def segment(self, i: int, at: int, doc: Document, start: int, stop: int) -> None:
        """Tokens [start, stop) of ``doc`` into row i from position ``at``, maskable."""
        n = stop - start
        self.arrays["input_ids"][i, at : at + n] = doc.tokens[start:stop]
        self.maskable[i, at : at + n] = True
        if self.word_start is not None and n:
            self.word_start[i, at + word_starts_in(doc, start, stop)] = True


class MaskingMixin:
    """Masking shared by the MLM and MLM+NSP objectives. A subclass fills one row of a
    ``Rows`` per unit (``fill``); masking then runs on the whole batch at once, from
    each example's own draws, so row i of a batch equals ``make_example`` of unit i."""

    def _init_masking(self, cfg: MlmConfig, roles: dict, vocab_size: int, special_ids: set[int]):
        self.mlm = cfg
        self.static = cfg.static
        self.pad_id, self.cls_id = int(roles["pad"]), int(roles["cls"])
        self.sep_id, self.mask_id = int(roles["sep"]), int(roles["mask"])
        self.is_special = special_table(vocab_size, special_ids)
        self.replacements = np.flatnonzero(~self.is_special).astype(np.int64)

    def new_rows(self, batch_size: int) -> Rows:
        return Rows(batch_size, self.seq_len, self.pad_id, self.mlm.whole_word)

    def fill(self, rows: Rows, i: int, unit: Unit, docs: list[Document], rng) -> None:
        raise NotImplementedError

    def _arrays(self, units, docs, rngs) -> dict[str, np.ndarray]:
        rows = self.new_rows(len(units))
        for i, (unit, unit_docs, rng) in enumerate(zip(units, docs, rngs, strict=True)):
            self.fill(rows, i, unit, unit_docs, rng)
        batch, maskable, word_start = rows.arrays, rows.maskable, rows.word_start
        maskable &= ~self.is_special[batch["input_ids"]]  # e.g. [UNK] inside the text
        if word_start is not None:
            word_start |= ~maskable  # specials and padding are words of their own
        T = self.seq_len
        draws = np.stack(
            [
                masking_draws(rng, T, None if word_start is None else word_start[i])
                for i, rng in enumerate(rngs)
            ]
        )
        batch["input_ids"], batch["mlm_labels"] = apply_masking(
            batch["input_ids"], maskable, draws, self.mlm, self.mask_id, self.replacements
        )
        return batch

    def make_batch(self, units, docs, rngs) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self._arrays(units, docs, rngs).items()}

    def make_example(self, unit: Unit, docs: list[Document], rng) -> dict[str, np.ndarray]:
        return {k: v[0] for k, v in self._arrays([unit], [docs], [rng]).items()}


class MlmObjective(MaskingMixin, Objective):
    """MLM alone (RoBERTa-style): one window of at most seq_len - 2 tokens of a document
    per example, as ``[CLS] window [SEP] [PAD]...``, dynamically masked."""

    kind = "mlm"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self._init_masking(cfg.mlm, roles, vocab_size, special_ids)
        self.window = seq_len - 2

    def layout(self, order: np.ndarray, lengths: np.ndarray) -> Layout:
        return WindowLayout(order, lengths, self.window)

    def fill(self, rows: Rows, i: int, unit: Unit, docs: list[Document], rng) -> None:
        (piece,), (doc,) = unit.pieces, docs
        n = piece.stop - piece.start
        ids = rows.arrays["input_ids"][i]
        ids[0], ids[n + 1] = self.cls_id, self.sep_id
        rows.segment(i, 1, doc, piece.start, piece.stop)
        rows.arrays["attention_mask"][i, : n + 2] = 1

    def loss(self, outputs, batch):
        loss, acc = masked_lm_loss(outputs["mlm_logits"], batch["mlm_labels"])
        return loss, {"mlm_loss": loss.detach(), "mlm_acc": acc}
