"""The baseline of bench_gpt.py: GPT-2 in one small module, the way nanoGPT-style training
scripts write it. Written for this bench from the architecture (Radford et al., 2019),
not taken from any project.

Dense [B, T] tensors only: no padding, no masks, no layouts. Learned positions, pre-LN
blocks (LayerNorm, fused q/k/v projection, ``F.scaled_dot_product_attention`` with
``is_causal=True``, output projection; LayerNorm, 4x MLP with tanh GELU), a final
LayerNorm, an LM head tied to the token embeddings, and the mean cross-entropy over all
logits. No dropout (GPT-2 reproductions train without it). Init: N(0, 0.02), zero biases,
the two projections that write into the residual stream N(0, 0.02 / sqrt(2 * layers)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int, inner: int, eps: float):
        super().__init__()
        self.heads = heads
        self.norm_attn = nn.LayerNorm(width, eps=eps)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.norm_mlp = nn.LayerNorm(width, eps=eps)
        self.mlp_in = nn.Linear(width, inner)
        self.mlp_out = nn.Linear(inner, width)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape

        def heads(t: Tensor) -> Tensor:  # [B, T, C] -> [B, heads, T, C / heads]
            return t.view(B, T, self.heads, C // self.heads).transpose(1, 2)

        q, k, v = map(heads, self.qkv(self.norm_attn(x)).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm_mlp(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, positions: int, layers: int, width: int, heads: int,
                 inner: int, eps: float = 1e-5, std: float = 0.02):  # fmt: skip
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(Block(width, heads, inner, eps) for _ in range(layers))
        self.norm = nn.LayerNorm(width, eps=eps)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight  # tied
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear | nn.Embedding):
                    nn.init.normal_(m.weight, 0.0, std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            for block in self.blocks:
                for proj in (block.attn_out, block.mlp_out):
                    nn.init.normal_(proj.weight, 0.0, std / math.sqrt(2 * layers))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token loss; ``targets`` are already shifted (targets[t] follows idx[t])."""
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on the matrices (and the tied embedding), none on biases and norms."""
        params = list(self.parameters())  # the tied weight once
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
