"""GPT-2 (Radford et al., 2019): a pre-LN transformer decoder with learned positions, a
final LayerNorm and an LM head tied to the token embeddings.

For packed sequences (several documents in one row) it takes position_ids that restart
at each document and document_ids that stop attention from crossing documents.
Outputs: {"logits": [B,T,Vpad], "hidden_states": [B,T,H]}; the padded vocabulary rows get
PAD_LOGIT so they never win. ``pretrain_heads=False``: {"hidden_states"} alone (the final
LayerNorm runs, the LM head does not).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.blocks import (
    Attention,
    TransformerConfig,
    decoder_attention,
    init_normal,
    make_blocks,
    non_embedding_params,
    on_module,
    vocab_pad_bias,
    zero_rows,
)


class GPT2Config(TransformerConfig):
    """GPT-2 small's defaults: 1024 positions, tanh-approximated GELU, LayerNorm eps 1e-5."""

    max_positions: int = Field(1024, gt=0)
    layer_norm_eps: float = Field(1e-5, gt=0)
    activation: Literal["gelu", "gelu_tanh"] = "gelu_tanh"


class GPT2(PretrainModel):
    layout_kind = "decoder"
    causal = True  # fine-tuning pools the last real token of causal models, [CLS] otherwise
    pre_ln = True  # GPT (pipeline/models/gpt.py) is this model with post-LN blocks

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        cfg = config
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = make_blocks(cfg, pre_ln=self.pre_ln)
        # pre-LN blocks leave the residual stream unnormalised: one LayerNorm at the end
        self.ln_f = (
            nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if self.pre_ln else nn.Identity()
        )
        # not persistent: derived from the config, never saved in a checkpoint
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02), zero biases, LayerNorm = identity; the two projections that write into
        the residual stream get std 0.02 / sqrt(2 * n_layer), so the residual's variance does
        not grow with depth (GPT-2 paper, section 2.3). Padded vocabulary rows are zeroed."""
        std = self.config.init_std
        init_normal(self, std)
        scaled = std / math.sqrt(2 * self.config.num_layers)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                on_module(proj, lambda m: nn.init.normal_(m.weight, mean=0.0, std=scaled))
        zero_rows(self.wte, self.config.vocab_size)

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    # embed / head are split out so pipeline.generate can run the blocks with a KV cache
    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return self.dropout(self.wte(input_ids) + self.wpe(position_ids))

    def head(self, x: Tensor, pretrain_heads: bool = True) -> dict[str, Tensor]:
        h = self.ln_f(x)
        if not pretrain_heads:
            return {"hidden_states": h}
        logits = F.linear(h, self.wte.weight, self.pad_bias.to(h.dtype))  # tied LM head
        return {"logits": logits, "hidden_states": h}

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,  # unused: GPT-2 has no segments
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        layout: Attention | None = None,  # attention_layout(batch), built by the caller
        pretrain_heads: bool = True,  # False: hidden_states only (base.PretrainModel)
    ) -> dict[str, Tensor]:
        self.check_length(input_ids.shape[1], self.config.max_positions)
        # Dense [B,T,...] (causal kernel or mask), or with unpadding and documents each
        # document a causal sequence, all tokens in one row [1,B*T,...]: no [B,T,T] mask
        attn = (
            layout
            if layout is not None
            else decoder_attention(attention_mask, document_ids, self.unpad)
        )
        x = self.embed(attn.pack(input_ids), attn.positions(input_ids, position_ids))
        for block in self.blocks:
            x = self.run_layer(block, x, attn)
        return {k: attn.unpack(v) for k, v in self.head(x, pretrain_heads).items()}

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward) per token:

            6 * (N + H * Vpad) + 12 * L * H * T

        N = parameters outside the embedding tables; H * Vpad = the tied LM head, a real
        matmul although its weights are the embedding table; a matmul with a weight of n
        entries costs 2n FLOPs per token forward and 4n backward. 12 * L * H * T is the
        attention itself (QK^T and AV: 2 * 2 * T * H per layer forward, x3 for training),
        not halved for the causal mask (the PaLM / nanoGPT MFU convention).
        """
        cfg = self.config
        n = non_embedding_params(self, [self.wte, self.wpe])
        n += cfg.hidden_size * cfg.padded_vocab_size
        return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
