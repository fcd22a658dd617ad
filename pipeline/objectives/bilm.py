"""Bidirectional language modelling (ELMo): a forward and a backward LM trained jointly.

Each example is one window of at most seq_len - 2 tokens of a document (``WindowLayout``),
as ``[BOS] window [EOS] [PAD]...`` (roles ``bos``/``eos``: [CLS]/[SEP] for WordPiece,
<s>/</s> for BPE). Labels are already shifted:

    fwd_labels[t] = input_ids[t + 1]   (the forward LM at t predicts the next token)
    bwd_labels[t] = input_ids[t - 1]   (the backward LM at t predicts the previous one)

-100 where there is nothing to predict (past [EOS], before [BOS], padding). The loss is
the mean of the two directions' cross-entropies (the paper maximises the sum of both
log likelihoods); evaluation reports both perplexities (eval_fwd_ppl, eval_bwd_ppl)
and eval_ppl = exp(mean loss).

``bind_data`` (called by the trainer with the data dir before training) gives the
model its character table, built from the data's tokenizer (see pipeline.models.elmo).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives.base import IGNORE_INDEX, Layout, Objective, Unit, WindowLayout
from pipeline.objectives.chunked_ce import chunked_cross_entropy


def shifted_labels(ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(fwd_labels, bwd_labels) of one row whose first ``n`` positions are real."""
    fwd = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    bwd = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    fwd[: n - 1] = ids[1:n]
    bwd[1:n] = ids[: n - 1]
    return fwd, bwd


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one direction over its labelled positions (chunked: no
    fp32 copy of the logits; 0 if a batch has no labelled position)."""
    return chunked_cross_entropy(logits, labels, IGNORE_INDEX)


class BilmObjective(Objective):
    kind = "bilm"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self.pad_id, self.bos_id, self.eos_id = (int(roles[r]) for r in ("pad", "bos", "eos"))
        self.window = seq_len - 2

    def attach(self, model: torch.nn.Module) -> None:
        if not hasattr(model, "set_char_table"):
            raise ConfigError(
                f"objective.kind=bilm trains ELMo: set model.arch=elmo "
                f"(got a {type(model).__name__})"
            )

    def bind_data(self, data, model: torch.nn.Module) -> None:
        """The model's characters come from the tokenizer the shards were made with."""
        from pipeline.models.elmo import build_char_table

        model.set_char_table(build_char_table(data.tokenizer_path.parent, model.config))

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        return WindowLayout(order, n, self.window, offset, total)

    def make_example(self, unit: Unit, docs: list[Document], rng) -> dict[str, np.ndarray]:
        (piece,), (doc,) = unit.pieces, docs
        L = self.seq_len
        n = piece.stop - piece.start + 2
        ids = np.full(L, self.pad_id, dtype=np.int64)
        ids[0], ids[n - 1] = self.bos_id, self.eos_id
        ids[1 : n - 1] = doc.tokens[piece.start : piece.stop]
        mask = np.zeros(L, dtype=np.int64)
        mask[:n] = 1
        fwd, bwd = shifted_labels(ids, n)
        return {"input_ids": ids, "attention_mask": mask, "fwd_labels": fwd, "bwd_labels": bwd}

    def loss(self, outputs, batch):
        fwd = lm_loss(outputs["fwd_logits"], batch["fwd_labels"])
        bwd = lm_loss(outputs["bwd_logits"], batch["bwd_labels"])
        loss = (fwd + bwd) / 2
        return loss, {"fwd_loss": fwd.detach(), "bwd_loss": bwd.detach()}
