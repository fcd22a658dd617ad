"""Transformer pieces shared by the architectures: attention masks, self-attention, MLP,
the post-LN (BERT) and pre-LN (GPT-2) blocks, weight init and the padded, tied vocabulary.

Attention always goes through ``F.scaled_dot_product_attention`` so PyTorch picks the
fastest kernel it has for the device (flash / memory-efficient / fused CPU kernel).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Logit given to the padded vocabulary rows. Finite (not -inf) so entropy/KL-style losses
# never see inf * 0 = nan, yet so low that exp() underflows to exactly 0 in fp32/bf16/fp16:
# padded rows never win an argmax and get zero probability and zero gradient.
PAD_LOGIT = -1.0e4


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round the tokenizer's vocabulary up so the embedding / logits matmul is well aligned."""
    return math.ceil(vocab_size / multiple) * multiple


class TransformerConfig(BaseModel):
    """The fields every transformer here shares. Each architecture subclasses it, setting its
    paper's defaults and adding its own fields; unknown keys are errors (extra=forbid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)  # the tokenizer's; the model pads it (padded_vocab_size)
    hidden_size: int = Field(768, gt=0)
    num_layers: int = Field(12, gt=0)
    num_heads: int = Field(12, gt=0)
    intermediate_size: int = Field(3072, gt=0)
    max_positions: int = Field(512, gt=0)
    dropout: float = Field(0.1, ge=0, lt=1)  # embeddings and residual branches
    attention_dropout: float = Field(0.1, ge=0, lt=1)
    layer_norm_eps: float = Field(1e-12, gt=0)
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    init_std: float = Field(0.02, gt=0)
    vocab_multiple: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        return self

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)


def vocab_pad_bias(vocab_size: int, padded: int) -> Tensor:
    """[padded] additive logit bias: 0 for real tokens, PAD_LOGIT for the padding rows."""
    bias = torch.zeros(padded)
    bias[vocab_size:] = PAD_LOGIT
    return bias


# ----------------------------------------------------------------------------- masks


def padding_mask(attention_mask: Tensor | None) -> Tensor | None:
    """[B,T] 1 real / 0 pad -> [B,1,1,T] bool "may attend" mask for bidirectional attention.

    A row that is all padding would give softmax over nothing (nan); such rows attend to
    everything instead. Their outputs are garbage either way, but finite.
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None  # no padding (one host sync): mask-free SDPA may use its fastest kernel
    keep = attention_mask.bool()
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def causal_mask(
    attention_mask: Tensor | None, document_ids: Tensor | None, seq_len: int
) -> tuple[Tensor | None, bool]:
    """Returns (attn_mask, is_causal) for scaled_dot_product_attention.

    Without padding or documents the kernel's own causal path is used (no mask tensor).
    Otherwise a [B,1,T,T] bool mask: key j is visible from query i when j <= i, both are in
    the same document (document_ids) and j is a real token (attention_mask). Every query
    also sees itself, so no row is empty (a left-padded query would otherwise give nan).
    """
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: keep the kernel's own causal path if we can
    if attention_mask is None and document_ids is None:
        return None, True
    device = (document_ids if document_ids is not None else attention_mask).device
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None]
    if document_ids is not None:
        allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)[None]
    return allowed[:, None, :, :], False


# ----------------------------------------------------------------------------- layers


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection (one GEMM instead of three)."""

    def __init__(self, hidden_size: int, num_heads: int, attention_dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
        B, T, C = x.shape
        # [B,T,3C] -> 3 x [B,nh,T,hd]
        q, k, v = (
            self.qkv(x).view(B, T, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=is_causal,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.fc = nn.Linear(hidden_size, intermediate_size)
        self.proj = nn.Linear(intermediate_size, hidden_size)
        # "gelu": exact erf GELU (BERT); "gelu_tanh": the tanh approximation (GPT-2).
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    """One transformer layer.

    post-LN (BERT):  x = LN(x + drop(attn(x)));       x = LN(x + drop(mlp(x)))
    pre-LN (GPT-2):  x = x + drop(attn(LN(x)));       x = x + drop(mlp(LN(x)))
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        dropout: float,
        attention_dropout: float,
        layer_norm_eps: float,
        activation: str,
        pre_ln: bool,
    ):
        super().__init__()
        self.pre_ln = pre_ln
        self.attn = SelfAttention(hidden_size, num_heads, attention_dropout)
        self.ln_1 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size, activation)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
        if self.pre_ln:
            x = x + self.dropout(self.attn(self.ln_1(x), attn_mask, is_causal))
            return x + self.dropout(self.mlp(self.ln_2(x)))
        x = self.ln_1(x + self.dropout(self.attn(x, attn_mask, is_causal)))
        return self.ln_2(x + self.dropout(self.mlp(x)))


def make_blocks(cfg: TransformerConfig, pre_ln: bool) -> nn.ModuleList:
    """cfg.num_layers transformer layers, post-LN (BERT) or pre-LN (GPT-2)."""
    return nn.ModuleList(
        Block(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.intermediate_size,
            cfg.dropout,
            cfg.attention_dropout,
            cfg.layer_norm_eps,
            cfg.activation,
            pre_ln=pre_ln,
        )
        for _ in range(cfg.num_layers)
    )


def run_blocks(
    blocks: nn.ModuleList,
    x: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    checkpointing: bool,
) -> Tensor:
    """Apply the layers; with checkpointing, keep only each layer's input and recompute its
    activations in backward (RNG state is restored, so dropout masks are identical)."""
    for block in blocks:
        if checkpointing and torch.is_grad_enabled():
            x = checkpoint(block, x, attn_mask, is_causal, use_reentrant=False)
        else:
            x = block(x, attn_mask, is_causal)
    return x


# ----------------------------------------------------------------------------- init


@torch.no_grad()
def init_normal(module: nn.Module, std: float) -> None:
    """BERT / GPT-2 initialisation: N(0, std) weights, zero biases, identity LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def non_embedding_params(model: nn.Module, embeddings: list[nn.Embedding]) -> int:
    skip = {id(e.weight) for e in embeddings}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)
