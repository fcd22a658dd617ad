"""ELECTRA's replaced token detection (kind ``rtd``).

The examples are MLM's (one window per example, ``[CLS] window [SEP]``, dynamically
masked with ``objective.mlm``; ELECTRA's own recipe is mask_fraction 0.85 and
random_fraction 0: see configs/experiments/electra-small.yaml). The model does the rest
in its forward (pipeline/models/electra.py): the generator fills the masked positions
with samples and the discriminator labels every token. The loss is

    L = L_mlm(generator) + disc_weight * L_disc,

L_disc the mean binary cross-entropy over the real (non-padding) tokens, [CLS] and [SEP]
included, as in the paper's code. disc_weight (lambda) is 50 by default, the paper's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.objectives.mlm import MlmObjective, labelled_targets


def rtd_loss(
    logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean binary cross-entropy, accuracy) of the per-token "replaced" logits [B,T]
    over the real tokens (attention_mask 1): sums over the real tokens divided by their
    count, a tensor, so no host read (a boolean gather would read its size)."""
    target = labels.float()
    losses = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none")
    right = ((logits.detach() > 0).float() == target).float()
    if attention_mask is None:
        return losses.mean(), right.mean()
    real = attention_mask > 0
    count = real.sum().clamp(min=1)
    zero = losses.new_zeros(())
    loss = torch.where(real, losses, zero).sum() / count
    return loss, torch.where(real, right, zero).sum() / count


def generator_loss(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, accuracy) of the generator's [N, Vpad] logits at the masked positions;
    a batch without any masked position gives a zero loss that still has a graph."""
    if target.numel() == 0:
        zero = logits.sum() * 0.0
        return zero, zero.detach()
    loss = F.cross_entropy(logits.float(), target)
    return loss, (logits.detach().argmax(-1) == target).float().mean()


class RtdObjective(MlmObjective):
    kind = "rtd"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(cfg, roles, vocab_size, seq_len, special_ids)
        self.disc_weight = cfg.rtd.disc_weight

    def loss(self, outputs, batch):
        if "rtd_labels" not in outputs:
            raise ValueError(
                "objective.kind=rtd needs a model that takes mlm_labels and returns rtd_labels "
                "(model.arch: electra)"
            )
        # the row order of the model's [N, Vpad] mlm_logits, found without a host read
        target = labelled_targets(batch["mlm_labels"], outputs["mlm_logits"].shape[0])
        mlm_loss, mlm_acc = generator_loss(outputs["mlm_logits"], target)
        disc_loss, disc_acc = rtd_loss(
            outputs["rtd_logits"], outputs["rtd_labels"], batch.get("attention_mask")
        )
        metrics = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_acc": mlm_acc,
            "rtd_loss": disc_loss.detach(),
            "rtd_acc": disc_acc,
            # share of the masked tokens the generator replaced by a different token
            "replaced": outputs["rtd_labels"].sum().float() / max(target.numel(), 1),
        }
        return mlm_loss + self.disc_weight * disc_loss, metrics
