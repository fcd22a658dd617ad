"""Causal language modelling (GPT): documents packed into fixed-length blocks.

The epoch's documents, in the epoch's order, form one stream with the end-of-document
token (``roles["eod"]``) after each document. Block ``b`` is stream tokens
``[b*L, b*L + L + 1)`` with L = seq_len: inputs are the first L, ``labels`` the last L,
i.e. **labels are already shifted** (labels[t] is the token after input_ids[t]) and
the loss does not shift again. Every stream token is a target exactly once; the
blocks overlap by the one token that is the last target of a block and the first
input of the next. Nothing is padded.

Options: ``reset_position_ids`` restarts positions at 0 after every end-of-document
token (and at the block start); ``block_cross_document_attention`` emits
``document_ids`` (0, 1, ... per document within the block; the eod token belongs to
the document it ends) so the model attends only within a document.

``clm-recurrent`` (Transformer-XL): the same blocks, but batch row j reads consecutive
blocks from batch to batch, so a model's memory holds the text just before its input.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives.base import IGNORE_INDEX, JoinedLayout, Layout, Objective, Piece, Unit
from pipeline.objectives.chunked_ce import chunked_cross_entropy


class BlockLayout(JoinedLayout):
    """Blocks of ``block`` (+1) tokens of the eod-joined stream; from token counts only."""

    def __init__(self, order, n, block: int, offset: int = 0, total: int | None = None):
        self.block = block
        super().__init__(order, n, offset, total)

    def count(self, total: int) -> int:
        return max(0, (total - 1) // self.block)

    def first_unit(self, offsets: np.ndarray) -> np.ndarray:
        return offsets // self.block

    def span(self, u):  # u: an int or an array
        return u * self.block, (u + 1) * self.block + 1

    def unit(self, u: int) -> Unit:
        return Unit(key=(u,), pieces=self.pieces(*self.span(u), eod=True))


def pack_block(
    pieces: tuple[Piece, ...], docs: list[Document], eod_id: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """(token stream of ``length`` ids, document number 0, 1, ... of every position)."""
    tokens = np.empty(length, dtype=np.int64)
    segment = np.empty(length, dtype=np.int64)
    t = 0
    for k, (piece, doc) in enumerate(zip(pieces, docs, strict=True)):
        n = piece.stop - piece.start
        tokens[t : t + n] = doc.tokens[piece.start : piece.stop]
        if piece.eod:
            tokens[t + n] = eod_id
            n += 1
        segment[t : t + n] = k
        t += n
    if t != length:
        raise AssertionError(f"block of {t} tokens, expected {length}")
    return tokens, segment


def reset_positions(segment: np.ndarray) -> np.ndarray:
    """Positions that restart at 0 wherever the document number changes."""
    idx = np.arange(segment.shape[0])
    starts = np.concatenate([[True], segment[1:] != segment[:-1]])
    return idx - np.maximum.accumulate(np.where(starts, idx, 0))


class ClmObjective(Objective):
    kind = "clm"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self.clm = cfg.clm
        self.eod_id = int(roles["eod"])

    def attach(self, model: torch.nn.Module) -> None:
        if takes_memory(model) and not self.recurrent_rows:
            raise ConfigError(
                f"objective.kind={self.kind}: model {type(model).__name__} carries a memory "
                "from one segment to the next, but clm gives each batch row unrelated "
                "blocks; use objective.kind=clm-recurrent"
            )

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        return BlockLayout(order, n, self.seq_len, offset, total)

    def make_example(self, unit: Unit, docs: list[Document], rng) -> dict[str, np.ndarray]:
        L = self.seq_len
        tokens, segment = pack_block(unit.pieces, docs, self.eod_id, L + 1)
        segment = segment[:L]
        example = {
            "input_ids": tokens[:L],
            "labels": tokens[1:],
            # No attention_mask: packed blocks have no padding, and an all-ones mask would
            # cost the model a host sync per forward to find that out (blocks.causal_mask).
            "position_ids": reset_positions(segment)
            if self.clm.reset_position_ids
            else np.arange(L),
        }
        if self.clm.block_cross_document_attention:
            example["document_ids"] = segment
        return example

    def loss(self, outputs, batch):
        loss = chunked_cross_entropy(outputs["logits"], batch["labels"], IGNORE_INDEX)
        return loss, {"lm_loss": loss.detach()}


def takes_memory(model: torch.nn.Module) -> bool:
    """Does this model's forward take ``mems`` (segment-level recurrence)?"""
    return "mems" in inspect.signature(model.forward).parameters


class RecurrentClmObjective(ClmObjective):
    """``clm-recurrent``: the clm blocks, read in order per batch row (Transformer-XL).

    Row j of batch g+1 is the block right after row j of batch g in the eod-joined stream
    (``recurrent_rows``), so the memory a model carries over from the previous batch is
    the text just before the current block. Each row reads its own contiguous stretch of
    the epoch's documents. Positions and attention run across documents on purpose (the
    eod token marks the boundary), so the clm knobs that cut at documents are refused.
    """

    kind = "clm-recurrent"
    recurrent_rows = True

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(cfg, roles, vocab_size, seq_len, special_ids)
        for knob in ("reset_position_ids", "block_cross_document_attention"):
            if getattr(self.clm, knob):
                raise ConfigError(
                    f"objective.clm.{knob}: not available with objective.kind=clm-recurrent "
                    "(a recurrent model reads the stream as one text); set it to false"
                )
