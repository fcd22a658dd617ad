"""Transformer-XL (Dai et al., 2019): a causal LM whose context reaches past its segment.

Two ideas, both here in plain PyTorch:

1. **Segment-level recurrence.** A long text is read segment by segment. Every layer keeps
   a *memory*: the hidden states that entered it for the last ``mem_len`` positions of the
   previous segments. Layer l attends over [memory_l ; current segment], so information
   flows across segments, and the longest dependency grows with depth (L * mem_len).
   The memory is detached: no gradient flows into earlier segments (training cost stays
   that of one segment). ``forward(input_ids, mems)`` takes the last call's
   ``outputs["mems"]`` and returns the next ones; the trainer carries them from batch to
   batch (the ``clm-recurrent`` objective makes row j of each batch continue row j of the
   previous one). Evaluation may keep a longer memory (``eval_mem_len``): the model
   switches on ``self.training``.

2. **Relative positional encoding.** Absolute positions would collide between memory and
   segment (both start at 0), so the attention score of query i and key j is built from
   their distance i - j only:

       score(i, j) = (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j}
                      content            position

   R is the sinusoid of the distance (not learned), W_r a per-layer projection and u, v
   two learned biases shared by all layers (the paper's global content and position
   biases). There is no absolute position embedding at all, so a segment may have any
   length (``max_positions`` is not used).

Layers are post-LN (as the paper's): x = LN(x + attn(x)); x = LN(x + FF(x)). The LM head
is tied to the token embeddings (the paper uses adaptive softmax; not needed here).
Outputs: {"logits": [B,T,Vpad], "hidden_states": [B,T,H], "mems": list of L [B,M,H]};
no "logits" with ``pretrain_heads=False`` (the memory is still returned).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.blocks import (
    TransformerConfig,
    init_normal,
    non_embedding_params,
    on_module,
    vocab_pad_bias,
    zero_rows,
)


class TransformerXLConfig(TransformerConfig):
    """Defaults: the paper's WikiText-103 base model (16 x 410, 10 heads, FFN 2100, ReLU,
    memory 150 while training; a longer one when evaluating)."""

    hidden_size: int = Field(410, gt=0)
    num_layers: int = Field(16, gt=0)
    num_heads: int = Field(10, gt=0)
    intermediate_size: int = Field(2100, gt=0)
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    layer_norm_eps: float = Field(1e-5, gt=0)
    activation: Literal["relu", "gelu", "gelu_tanh"] = "relu"
    mem_len: int = Field(150, ge=0)  # hidden states remembered per layer while training
    eval_mem_len: int | None = Field(None, ge=0)  # in eval mode (None: mem_len)

    @model_validator(mode="after")
    def _even_hidden(self):
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be even (sin/cos pairs)")
        return self

    def memory_length(self, training: bool) -> int:
        if training or self.eval_mem_len is None:
            return self.mem_len
        return self.eval_mem_len


def sinusoid(distances: Tensor, dim: int) -> Tensor:
    """[K] distances -> [K, dim] (sin | cos) at geometric frequencies, as the original
    Transformer's positional encoding, here of a *relative* distance."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=distances.device) / dim))
    angles = distances[:, None].float() * inv_freq[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def shift_to_distance(scores: Tensor, mem: int) -> Tensor:
    """[B,n,T,K] scores against the K distances K-1, ..., 0 -> scores against the K keys.

    Query i sits at absolute position mem + i, key j at j, so their distance is
    mem + i - j: column K-1-(mem+i-j) = j + T-1-i of the input. (The paper does this with
    a pad-and-reshape trick; a gather says what it means.) Keys after the query get a
    clamped, meaningless value: the causal mask removes them.
    """
    T, K = scores.shape[-2:]
    i = torch.arange(T, device=scores.device)[:, None]
    j = torch.arange(K, device=scores.device)[None, :]
    index = (j + T - 1 - i).clamp(max=K - 1)
    return scores.gather(-1, index.expand(*scores.shape[:-2], T, K))


class RelativeAttention(nn.Module):
    """Multi-head attention of a segment over [memory ; segment] with relative positions."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        H = cfg.hidden_size
        # Queries only for the segment, keys/values also for the memory (the paper's
        # projections have no bias: u and v play that role).
        self.q = nn.Linear(H, H, bias=False)
        self.kv = nn.Linear(H, 2 * H, bias=False)
        self.r = nn.Linear(H, H, bias=False)  # W_r: projects the distance encodings
        self.proj = nn.Linear(H, H, bias=False)

    def forward(
        self, x: Tensor, mem: Tensor | None, pos: Tensor, u: Tensor, v: Tensor, keep: Tensor
    ) -> Tensor:
        """x [B,T,H], mem [B,M,H] or None, pos [K,H] encodings of distances K-1..0,
        u/v [n,d], keep [B|1,1,T,K] bool (key visible from query)."""
        B, T, H = x.shape
        n, d = self.num_heads, self.head_dim
        context = x if mem is None else torch.cat([mem, x], dim=1)
        K = context.shape[1]
        q = self.q(x).view(B, T, n, d).transpose(1, 2)  # [B,n,T,d]
        k, val = self.kv(context).view(B, K, 2, n, d).permute(2, 0, 3, 1, 4)  # [B,n,K,d] x2
        r = self.r(pos).view(K, n, d).transpose(0, 1)  # [n,K,d]
        scale = 1.0 / math.sqrt(d)
        # position term (q + v) . W_r R_{i-j}, then the content term (q + u) . k_j inside
        # SDPA, which adds the position term as its float mask: one fused softmax.
        position = shift_to_distance(torch.matmul(q + v[:, None], r.transpose(1, 2)), K - T)
        bias = (position * scale).masked_fill(~keep, float("-inf"))
        y = F.scaled_dot_product_attention(
            q + u[:, None],
            k,
            val,
            attn_mask=bias.to(q.dtype),
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=scale,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, H))


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.activation = cfg.activation

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.activation == "relu":
            h = F.relu(h)
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.proj(h)


class XLLayer(nn.Module):
    """Post-LN: x = LN(x + drop(attn(x, mem))); x = LN(x + drop(FF(x)))."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.attn = RelativeAttention(cfg)
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ff = FeedForward(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mem, pos, u, v, keep) -> Tensor:
        x = self.ln_1(x + self.dropout(self.attn(x, mem, pos, u, v, keep)))
        return self.ln_2(x + self.dropout(self.ff(x)))


class TransformerXL(PretrainModel):
    causal = True  # fine-tuning pools the last real token of causal models, [CLS] otherwise

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(XLLayer(cfg) for _ in range(cfg.num_layers))
        d = cfg.hidden_size // cfg.num_heads
        self.u = nn.Parameter(torch.zeros(cfg.num_heads, d))  # global content bias
        self.v = nn.Parameter(torch.zeros(cfg.num_heads, d))  # global position bias
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights and u, v (the paper's init), zero biases, LayerNorm = identity."""
        std = self.config.init_std
        init_normal(self, std)

        def biases(m: TransformerXL) -> None:
            nn.init.normal_(m.u, mean=0.0, std=std)
            nn.init.normal_(m.v, mean=0.0, std=std)

        on_module(self, biases)
        zero_rows(self.wte, self.config.vocab_size)

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        mems: list[Tensor] | None = None,
        pretrain_heads: bool = True,  # False: no LM head (base.PretrainModel)
    ) -> dict[str, Tensor | list[Tensor]]:
        cfg = self.config
        B, T = input_ids.shape
        if mems is not None and (len(mems) != cfg.num_layers or mems[0].shape[0] != B):
            raise ValueError(
                f"mems: expected {cfg.num_layers} tensors of batch size {B}, got "
                f"{len(mems)} of batch size {mems[0].shape[0] if mems else '-'}; pass the "
                "outputs['mems'] of the previous segment of the same rows (or None)"
            )
        M = 0 if mems is None else mems[0].shape[1]
        K = M + T
        dev = input_ids.device
        # Embeddings scaled by sqrt(H), as the paper's (and the original Transformer's).
        x = self.dropout(self.wte(input_ids) * math.sqrt(cfg.hidden_size))
        distances = torch.arange(K - 1, -1, -1, device=dev)
        pos = self.dropout(sinusoid(distances, cfg.hidden_size).to(x.dtype))
        # Query i (absolute M + i) sees keys j <= M + i; padding keys of the segment are
        # hidden too (the memory is always real text). Every query sees itself.
        keep = torch.ones(T, K, dtype=torch.bool, device=dev).tril(diagonal=M)[None, None]
        if attention_mask is not None and not bool(attention_mask.all()):
            real = torch.cat([attention_mask.new_ones(B, M), attention_mask], dim=1).bool()
            diag = torch.zeros(T, K, dtype=torch.bool, device=dev)
            diag[:, M:] = torch.eye(T, dtype=torch.bool, device=dev)
            keep = (keep & real[:, None, None, :]) | diag[None, None]

        inputs = []  # what entered each layer: the next segment's memory
        for i, layer in enumerate(self.layers):
            inputs.append(x)
            mem = None if mems is None else mems[i].to(x.dtype)
            x = self.run_layer(layer, x, mem, pos, self.u, self.v, keep)
        out = {}
        if pretrain_heads:
            out["logits"] = F.linear(x, self.wte.weight, self.pad_bias.to(x.dtype))  # tied LM head
        out["hidden_states"] = x
        out["mems"] = self.next_mems(mems, inputs, cfg.memory_length(self.training))
        return out

    @torch.no_grad()
    def next_mems(
        self, mems: list[Tensor] | None, inputs: list[Tensor], mem_len: int
    ) -> list[Tensor] | None:
        """The last ``mem_len`` positions of [old memory ; this segment] per layer, detached
        (no gradient ever flows into a previous segment)."""
        if mem_len == 0:
            return None
        out = []
        for i, h in enumerate(inputs):
            full = h if mems is None else torch.cat([mems[i].to(h.dtype), h], dim=1)
            out.append(full[:, -mem_len:].detach())
        return out

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward) per token, T = seq_len, M = mem_len:

            6 * (N + H * Vpad) + 6 * L * 3 * H^2 * M / T + 18 * L * H * (T + M)

        N = parameters outside the embedding table (each weight: 2 FLOPs forward, 4
        backward, per token), H * Vpad = the tied LM head. The key/value (2 H^2) and W_r
        (H^2) projections also run over the M memory positions: the middle term. Attention
        per query runs over T + M keys, three products (content, position, weighted sum)
        of 2 * H each forward, x3 for training.
        """
        cfg = self.config
        H, L, M, T = cfg.hidden_size, cfg.num_layers, cfg.mem_len, seq_len
        n = non_embedding_params(self, [self.wte]) + H * cfg.padded_vocab_size
        return 6.0 * n + 6.0 * L * 3 * H * H * M / T + 18.0 * L * H * (T + M)
