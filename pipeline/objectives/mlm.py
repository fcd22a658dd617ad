"""Masked language modelling (BERT, RoBERTa): masking, the MLM-only objective, the loss.

Masking is per token and Bernoulli, as in RoBERTa's dynamic masking: each maskable
token is selected with ``probability``; a selected token becomes [MASK] with
``mask_fraction``, a random ordinary token with ``random_fraction``, else stays; the
label is the original id at selected positions and -100 elsewhere. Special tokens
(every role id, [UNK] included, and padding) are never selected.

Whole-word masking (``whole_word``, BERT-wwm; Cui et al., 2019): the selection is drawn
per word (``words.npy`` start offsets: WordPiece words for English, jieba words for
Chinese, whose BERT tokenizer gives one token per character) and applies to all of the
word's tokens; the 80/10/10 choice stays per token, as in BERT's whole-word masking.
``probability`` is then the share of words selected.

N-gram masking (``ngram: N`` > 1, ALBERT; Lan et al., 2019): a word starts an n-gram of
n = 1..N whole words with P(n) proportional to 1/n; the start rate is solved so that
the n-grams (overlaps merged) cover ``probability`` of the words.

Packing (``packing``, MLM only; RoBERTa's FULL-SENTENCES / DOC-SENTENCES): see
``pipeline.objectives.packing``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config import MlmConfig
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
from pipeline.objectives.packing import Segment, StreamLayout, sentence_segments


def ngram_probabilities(max_n: int) -> np.ndarray:
    """P(n) for n = 1..max_n, proportional to 1/n (ALBERT)."""
    weights = 1.0 / np.arange(1, max_n + 1)
    return weights / weights.sum()


@lru_cache(maxsize=64)
def ngram_start_rate(probability: float, max_n: int) -> float:
    """The rate q at which a word starts an n-gram so that a word is covered with
    ``probability``: a word is missed when no n-gram starting d = 0..max_n-1 words
    before it is longer than d, so 1 - prod_d (1 - q * P(n > d)) = probability."""
    longer = 1.0 - np.concatenate([[0.0], np.cumsum(ngram_probabilities(max_n))[:-1]])
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: coverage grows with q
        q = (lo + hi) / 2
        if 1.0 - np.prod(1.0 - q * longer) < probability:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


def draw_ngrams(rng: np.random.Generator, n_words: int, rate: float, max_n: int) -> np.ndarray:
    """Length of the n-gram starting at each word, 0 where none starts."""
    starts = rng.random(n_words) < rate
    cdf = np.cumsum(ngram_probabilities(max_n))
    lengths = np.minimum(np.searchsorted(cdf, rng.random(n_words), side="right") + 1, max_n)
    return np.where(starts, lengths, 0)


def ngram_cover(lengths: np.ndarray) -> np.ndarray:
    """Words covered by some n-gram (``lengths`` from ``draw_ngrams``)."""
    covered = lengths > 0
    for d in range(1, int(lengths.max(initial=0))):
        covered[d:] |= lengths[:-d] > d
    return covered


def masking_draws(
    rng: np.random.Generator,
    length: int,
    word_start: np.ndarray | None = None,
    ngram: tuple[int, float] | None = None,
) -> np.ndarray:
    """The uniform draws masking one sequence uses, [3, length]: selection (one per
    word with ``word_start``, True where a word starts: all its tokens share it),
    action (mask / random / keep) and which replacement token, per position.
    ``ngram`` = (max n, start rate): the selection row is 0 on the words n-grams cover
    and 1 elsewhere, so the same ``select < probability`` test picks exactly them."""
    if word_start is None:
        return rng.random((3, length))
    word = np.cumsum(word_start) - 1  # word number of every position
    n_words = int(word[-1]) + 1
    if ngram is None:
        select = rng.random(n_words)[word]
    else:
        max_n, rate = ngram
        select = np.where(ngram_cover(draw_ngrams(rng, n_words, rate, max_n)), 0.0, 1.0)[word]
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


def labelled_targets(labels: torch.Tensor, n: int) -> torch.Tensor:
    """[n] the labels of ``labels`` (any shape, read flat) that are not IGNORE_INDEX, in
    order: the targets of an MLM head's [n, Vpad] logits, ``n`` their row count. With n
    known, a stable sort that puts the labelled positions first finds them: a boolean
    gather (``labels[labels != -100]``) would read its size to the host, a GPU sync."""
    flat = labels.reshape(-1)
    order = torch.argsort((flat == IGNORE_INDEX).to(torch.uint8), stable=True)
    return flat.index_select(0, order[:n])


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, accuracy) over the labelled positions.

    ``logits`` are [B, T, Vpad], of which the labelled rows (~15%) are gathered, or already
    [N, Vpad] for the N labelled positions (models that take ``mlm_labels``; then no host
    read: ``labelled_targets``). The padded vocabulary columns stay in the softmax (labels
    are always < the real vocabulary, so training pushes them down, as in Megatron);
    slicing them off would copy all logits. A batch without any labelled position gives a
    zero loss that still has a graph.
    """
    if logits.dim() == 2:
        picked, target = logits.float(), labelled_targets(labels, logits.shape[0])
    else:
        selected = labels != IGNORE_INDEX
        picked, target = logits[selected].float(), labels[selected]
    if target.numel() == 0:
        zero = logits.sum() * 0.0
        return zero, zero.detach()
    loss = F.cross_entropy(picked, target)
    acc = (picked.detach().argmax(-1) == target).float().mean()
    return loss, acc


def segment_b_type(model: torch.nn.Module) -> int:
    """The token type of a sentence pair's segment B for ``model``: 1, or 0 when the model
    has one segment type (``type_vocab_size: 1``; the exported tokenizer's pair template
    gives 0 too, pipeline/export/hf.py)."""
    types = getattr(getattr(model, "config", None), "type_vocab_size", 2)
    return 1 if types > 1 else 0


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

    # token_type_ids of a pair's segment B: 1, or 0 for a model with one segment type
    # (``type_vocab_size: 1``, RoBERTa's way; set by ``attach``)
    segment_b = 1

    def _init_masking(self, cfg: MlmConfig, roles: dict, vocab_size: int, special_ids: set[int]):
        if cfg.ngram > 1 and not cfg.whole_word:
            raise ConfigError(
                f"objective.mlm.ngram={cfg.ngram} masks n-grams of whole words: "
                "set objective.mlm.whole_word=true as well"
            )
        if cfg.packing != "window" and not isinstance(self, MlmObjective):
            raise ConfigError(
                f"objective.mlm.packing={cfg.packing} applies to objective.kind=mlm only "
                f"(kind {self.kind} builds sentence pairs); remove the key or use kind mlm"
            )
        if cfg.static and cfg.packing == "full_sentences":
            raise ConfigError(
                "objective.mlm.static=true with objective.mlm.packing=full_sentences: "
                "full_sentences packs a new stream of sentences every epoch, so an example "
                "(and its mask) cannot be the same in every epoch; set "
                "objective.mlm.packing=doc_sentences (or window) for static masking, or "
                "objective.mlm.static=false"
            )
        self.mlm = cfg
        self.ngram = (
            (cfg.ngram, ngram_start_rate(cfg.probability, cfg.ngram)) if cfg.ngram > 1 else None
        )
        self.static = cfg.static
        self.pad_id, self.cls_id = int(roles["pad"]), int(roles["cls"])
        self.sep_id, self.mask_id = int(roles["sep"]), int(roles["mask"])
        self.is_special = special_table(vocab_size, special_ids)
        self.replacements = np.flatnonzero(~self.is_special).astype(np.int64)

    def attach(self, model: torch.nn.Module) -> None:
        """A model that derives positions from the padding id (RoBERTa) must pad like us;
        a model with one segment type gets pairs whose segment B is type 0."""
        want = getattr(model.config, "pad_token_id", None)
        if want is not None and int(want) != self.pad_id:
            raise ConfigError(
                f"model.pad_token_id={want} but the tokenizer pads with id {self.pad_id}; "
                f"set model.pad_token_id={self.pad_id} (or use a `--kind bpe` tokenizer, "
                "whose <pad> is 1 as in RoBERTa)"
            )
        self.segment_b = segment_b_type(model)

    def new_rows(self, batch_size: int) -> Rows:
        return Rows(batch_size, self.seq_len, self.pad_id, self.mlm.whole_word)

    def fill(self, rows: Rows, i: int, unit: Unit, docs: list[Document], rng) -> None:
        raise NotImplementedError

    def _arrays(self, units, docs, rngs) -> dict[str, np.ndarray]:
        rows = self.new_rows(len(units))
        for i, (unit, unit_docs, rng) in enumerate(zip(units, docs, rngs, strict=True)):
            self.fill(rows, i, unit, unit_docs, rng)
        batch, maskable, word_start = rows.arrays, rows.maskable, rows.word_start
        if word_start is not None:
            word_start |= ~maskable  # [CLS], [SEP], padding: words of their own
        # [UNK] inside the text is never selected; inside a word it shares the word's
        # draw, so the word's other pieces are still masked together.
        maskable &= ~self.is_special[batch["input_ids"]]
        T = self.seq_len
        draws = np.stack(
            [
                masking_draws(rng, T, None if word_start is None else word_start[i], self.ngram)
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
    """MLM alone (RoBERTa-style), dynamically masked. Per example at most seq_len - 2
    tokens between [CLS] and [SEP] (``<s>``/``</s>`` with a BPE tokenizer):

    - ``packing: window``: one window of one document, ``[CLS] window [SEP] [PAD]...``;
    - ``packing: full_sentences``: whole sentences packed across documents,
      ``[CLS] doc1 sentences [SEP] doc2 sentences [SEP] [PAD]...``;
    - ``packing: doc_sentences``: whole sentences of one document.
    """

    kind = "mlm"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self._init_masking(cfg.mlm, roles, vocab_size, special_ids)
        self.window = seq_len - 2

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        if self.mlm.packing == "full_sentences":
            return StreamLayout(order, n, self.window, offset, total)
        return WindowLayout(order, n, self.window, offset, total)

    def segments(self, unit: Unit, docs: list[Document]) -> list[Segment]:
        if self.mlm.packing == "window":
            (piece,), (doc,) = unit.pieces, docs
            return [(doc, piece.start, piece.stop)]
        return sentence_segments(unit, docs, self.window)

    def fill(self, rows: Rows, i: int, unit: Unit, docs: list[Document], rng) -> None:
        ids = rows.arrays["input_ids"][i]
        ids[0], at = self.cls_id, 1
        for doc, start, stop in self.segments(unit, docs):
            if at > 1:  # a separator between two documents (full_sentences)
                ids[at], at = self.sep_id, at + 1
            rows.segment(i, at, doc, start, stop)
            at += stop - start
        ids[at] = self.sep_id
        rows.arrays["attention_mask"][i, : at + 1] = 1

    def loss(self, outputs, batch):
        loss, acc = masked_lm_loss(outputs["mlm_logits"], batch["mlm_labels"])
        return loss, {"mlm_loss": loss.detach(), "mlm_acc": acc}
