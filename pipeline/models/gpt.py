"""GPT (Radford et al., 2018, "Improving Language Understanding by Generative Pre-Training"):
the first generative pretrained transformer. A decoder-only stack of *post-LN* blocks
(the original Transformer's layer order, as BERT's) with masked (causal) self-attention,
learned absolute positions and an LM head tied to the token embeddings. No final
LayerNorm: each block already ends with one. GPT-2 later moved the LayerNorm in front
of each sub-layer and added a final one (pipeline/models/gpt2.py).

Outputs: {"logits": [B,T,Vpad], "hidden_states": [B,T,H]}; the padded vocabulary rows
get PAD_LOGIT so they never win; {"hidden_states"} alone with ``pretrain_heads=False``.
Packed sequences: position_ids may restart at each document and document_ids stop
attention from crossing documents (as in gpt2.py).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pipeline.models.blocks import TransformerConfig, init_normal, zero_rows
from pipeline.models.gpt2 import GPT2


class GPTConfig(TransformerConfig):
    """The paper's defaults: 12 x 768, 12 heads, FFN 3072, 512 positions, the tanh GELU
    (HF's OpenAI GPT "gelu" is that approximation), LayerNorm eps 1e-5."""

    max_positions: int = Field(512, gt=0)
    layer_norm_eps: float = Field(1e-5, gt=0)
    activation: Literal["gelu", "gelu_tanh"] = "gelu_tanh"


class GPT(GPT2):
    """GPT-2's module (embeddings, tied head, causal masking, KV-cache hooks ``embed`` /
    ``head``, FLOPs) with post-LN blocks, x = LN(x + sublayer(x)), and no final LayerNorm."""

    pre_ln = False

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights (the paper's init, without GPT-2's scaled residual
        projections), zero biases, LayerNorm = identity; padded vocabulary rows zeroed."""
        init_normal(self, self.config.init_std)
        zero_rows(self.wte, self.config.vocab_size)
