"""GPT (Radford et al., 2018, "Improving Language Understanding by Generative Pre-Training"):
the first generative pretrained transformer. A decoder-only stack of *post-LN* blocks
(the original Transformer's layer order, as BERT's) with masked (causal) self-attention,
learned absolute positions and an LM head tied to the token embeddings. No final
LayerNorm: each block already ends with one. GPT-2 later moved the LayerNorm in front
of each sub-layer and added a final one (pipeline/models/gpt2.py).

Outputs: {"logits": [B,T,Vpad], "hidden_states": [B,T,H]}; the padded vocabulary rows
get PAD_LOGIT so they never win. Packed sequences: position_ids may restart at each
document and document_ids stop attention from crossing documents (as in gpt2.py).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from pipeline.models.blocks import (
    TransformerConfig,
    causal_mask,
    init_normal,
    make_blocks,
    non_embedding_params,
    run_blocks,
    vocab_pad_bias,
)


class GPTConfig(TransformerConfig):
    """The paper's defaults: 12 x 768, 12 heads, FFN 3072, 512 positions, the tanh GELU
    (HF's OpenAI GPT "gelu" is that approximation), LayerNorm eps 1e-5."""

    max_positions: int = Field(512, gt=0)
    layer_norm_eps: float = Field(1e-5, gt=0)
    activation: Literal["gelu", "gelu_tanh"] = "gelu_tanh"


class GPT(nn.Module):
    causal = True  # fine-tuning pools the last real token of causal models, [CLS] otherwise

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = make_blocks(cfg, pre_ln=False)  # post-LN: x = LN(x + sublayer(x))
        # not persistent: derived from the config, never saved in a checkpoint
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.checkpointing = False
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights (the paper's init), zero biases, LayerNorm = identity; the
        padded vocabulary rows are zeroed (never looked up nor predicted)."""
        init_normal(self, self.config.init_std)
        self.wte.weight[self.config.vocab_size :].zero_()

    def set_activation_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled

    # embed / head are split out so pipeline.generate can run the blocks with a KV cache
    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return self.dropout(self.wte(input_ids) + self.wpe(position_ids))

    def head(self, h: Tensor) -> dict[str, Tensor]:
        logits = F.linear(h, self.wte.weight, self.pad_bias.to(h.dtype))  # tied LM head
        return {"logits": logits, "hidden_states": h}

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,  # unused: no segment embeddings
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        T = input_ids.shape[1]
        if T > self.config.max_positions:
            raise ValueError(
                f"sequence length {T} > model.max_positions {self.config.max_positions}"
            )
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None]
        x = self.embed(input_ids, position_ids)
        attn_mask, is_causal = causal_mask(attention_mask, document_ids, T)
        return self.head(run_blocks(self.blocks, x, attn_mask, is_causal, self.checkpointing))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, as GPT-2's:

            6 * (N + H * Vpad) + 12 * L * H * T

        N = parameters outside the embedding tables, H * Vpad = the tied LM head matmul,
        12 * L * H * T = attention scores and weighted sums (not halved for the mask).
        """
        cfg = self.config
        n = non_embedding_params(self, [self.wte, self.wpe])
        n += cfg.hidden_size * cfg.padded_vocab_size
        return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
