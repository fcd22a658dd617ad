"""What every architecture shares outside its math: the switches the trainer sets
(activation checkpointing, unpadded encoders), the list of repeated layers they and
``torch.compile`` apply to (``pipeline.train.parallelize``), and the position check.

Model files hold the math only; a model subclasses ``PretrainModel``, names its repeated
layers in ``repeated_layers()`` and calls each of them through ``run_layer``.

The sentence-pair head (BERT's and ERNIE's pooler + NSP head, ALBERT's pooler + SOP head)
is built only when the model config's ``pair_head`` is true: the trainer sets it from the
objective (``pipeline.train.plan.model_config_for``), so an MLM-only model carries no
parameter without a gradient. Fine-tuning never uses it (its heads pool the hidden
states themselves, pipeline/finetune/heads.py). A state dict saved with the head (every
bundle and checkpoint from before, or an NSP run's) still loads into a model without
it: ``PretrainModel`` drops those tensors on load (``pair_modules``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.blocks import Attention, decoder_attention, encoder_attention


class PretrainModel(nn.Module):
    """The forward contract every architecture keeps (outputs a dict of tensors):

    - ``hidden_states`` [B,T,H]: the final layer's features, always (what fine-tuning's
      heads read, pipeline/finetune/heads.py); ``layers`` where the model has them (ELMo);
      ``mems`` where it carries a memory (Transformer-XL, XLNet);
    - the pretraining heads' outputs (``logits``, ``mlm_logits``, ``nsp_logits``,
      ``sop_logits``, ``rtd_logits``, ``fwd_logits`` / ``bwd_logits``, word2vec's
      ``pos_scores`` / ``neg_scores``, ...), what the objectives read.

    ``pretrain_heads: bool = True``, a keyword of every forward: False runs no pretraining
    head at all (no vocabulary projection, no pooler, no NSP / SOP / RTD head, no
    generator) and returns the features alone; the features are the same tensors as with
    True. Fine-tuning, prediction and feature extraction pass False (a vocabulary
    projection of every position is most of a small model's forward); the objectives,
    ``plm generate`` and export leave the default.
    """

    causal = False  # fine-tuning pools the last real token of causal models, [CLS] otherwise
    checkpointing = False  # set by the trainer (train.activation_checkpointing)
    unpad = False  # set by the trainer (train.unpad): compute on real tokens only
    # The attention layout the forward takes as ``layout`` (pipeline/models/blocks.py):
    # a bidirectional encoder's, a causal decoder's, or none (the model attends its own way)
    layout_kind: Literal["encoder", "decoder"] | None = None
    # The submodules only sentence-pair objectives train, built when config.pair_head is
    # true; a state dict's tensors under them load into a model built without them as
    # nothing (dropped), everything else loads as strictly as ever.
    pair_modules: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.register_load_state_dict_pre_hook(_drop_unbuilt_pair_head)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    def set_unpad(self, enabled: bool) -> None:
        self.unpad = enabled

    def attention_layout(self, batch: Mapping[str, Tensor]) -> Attention | None:
        """The attention layout of ``batch`` that this model's forward would build, for
        its ``layout`` argument; None for a model without one. Built where ``batch`` is:
        the trainer builds it on the loader's CPU batch, where the sizes it reads cost no
        device sync, and moves it with ``.to(device)``, so the forward reads nothing from
        the device. An encoder's records the MLM-labelled positions too when its forward
        takes ``mlm_labels``."""
        if self.layout_kind == "encoder":
            takes_labels = "mlm_labels" in inspect.signature(self.forward).parameters
            labels = batch.get("mlm_labels") if takes_labels else None
            return encoder_attention(batch.get("attention_mask"), self.unpad, labels)
        if self.layout_kind == "decoder":
            return decoder_attention(
                batch.get("attention_mask"), batch.get("document_ids"), self.unpad
            )
        return None

    def repeated_layers(self) -> list[nn.Module]:
        """The repeated layers, each called through ``run_layer``: the units activation
        checkpointing recomputes and ``train.compile`` compiles. Default: none."""
        return []

    def run_layer(self, layer: nn.Module, *args):
        """``layer(*args)``; with activation checkpointing (and grad enabled), keep only its
        inputs and recompute its activations in backward (RNG state restored, so dropout
        masks are identical)."""
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs per token (forward + backward) when a token attends to
        ``seq_len`` keys and the vocabulary decoder runs on ``decoder_fraction`` of the
        tokens (models whose decoder runs on every position ignore it)."""
        raise NotImplementedError

    def check_length(self, seq_len: int, limit: int) -> None:
        if seq_len > limit:
            raise ValueError(f"sequence length {seq_len} > model.max_positions {limit}")


def _drop_unbuilt_pair_head(module, state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook: remove the tensors of the pair modules ``module`` was
    built without (an MLM-only model loading a bundle or checkpoint that has them)."""
    for name in module.pair_modules:
        if name in module._modules:
            continue
        head = f"{prefix}{name}."
        for key in [k for k in state_dict if k.startswith(head)]:
            del state_dict[key]
