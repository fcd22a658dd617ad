"""What every architecture shares outside its math: the switches the trainer sets
(activation checkpointing, unpadded encoders), the list of repeated layers they and
``torch.compile`` apply to (``pipeline.train.parallelize``), and the position check.

Model files hold the math only; a model subclasses ``PretrainModel``, names its repeated
layers in ``repeated_layers()`` and calls each of them through ``run_layer``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class PretrainModel(nn.Module):
    causal = False  # fine-tuning pools the last real token of causal models, [CLS] otherwise
    checkpointing = False  # set by the trainer (train.activation_checkpointing)
    unpad = False  # set by the trainer (train.unpad): compute on real tokens only

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    def set_unpad(self, enabled: bool) -> None:
        self.unpad = enabled

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
