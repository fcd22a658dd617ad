"""XLNet (Yang et al., 2019): permutation language modelling with two-stream attention on
a Transformer-XL backbone (relative positions, relative segments, segment memory).

Two streams run through every layer with the same weights:

- the **content stream** h: position i sees its own token and every position earlier in
  the factorization order (plus the memory). It is the ordinary representation used by
  fine-tuning (``hidden_states``) and the only stream when no ``target_mapping`` is given.
- the **query stream** g: one row per predicted token, started from a learned vector
  (``mask_emb``) instead of the token. Its row for position i reads the content stream of
  the positions strictly earlier in the order, never position i itself, so it can predict
  the token at i without seeing it. The model enforces this itself, whatever perm_mask says.

Inputs follow transformers' XLNet conventions (so ``plm export --to hf`` gives the same
logits): ``perm_mask[b, i, j]`` true/1 = i may not attend to j; ``target_mapping[b, m, i]``
one-hot = the m-th prediction is position i. The memory ``mems`` is [L, B, M, H], the input
of every layer at the first ``reuse_len`` positions of earlier segments (the part the next
segment continues), the last ``mem_len`` of them; every position may attend to all of it.

Outputs: {"logits": [B, P, Vpad] from the query stream (or [B, T, Vpad] from the content
stream without target_mapping), "hidden_states": [B, T, H], "mems": [L, B, M, H] or None};
no "logits" with ``pretrain_heads=False`` (nor the query stream's layers, which only feed them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.blocks import (
    TransformerConfig,
    init_normal,
    on_module,
    vocab_pad_bias,
    zero_rows,
)


class XLNetConfig(TransformerConfig):
    """XLNet-base's defaults (12 x 768, exact GELU, eps 1e-12). Positions are relative, so
    ``max_positions`` only bounds the inputs (and the exported tokenizer's model_max_length)."""

    mem_len: int = Field(384, ge=0)  # memory kept per layer; 0 = no memory
    # The first reuse_len positions of a segment are what the next segment continues
    # (the pretraining stream's stride); only they are cached. None: all positions.
    reuse_len: int | None = Field(256, gt=0)
    clamp_len: int = -1  # clamp relative distances to this (-1: never)

    @model_validator(mode="after")
    def _reuse_fits(self):
        if self.hidden_size % 2:
            # The relative-position sinusoids come in (sin, cos) pairs of hidden_size
            # dims; an odd size would only fail in the forward pass.
            raise ValueError(
                f"hidden_size {self.hidden_size} must be even (sin/cos pairs of the relative "
                "positions); pick an even hidden_size that num_heads divides"
            )
        if self.reuse_len is not None and self.reuse_len >= self.max_positions:
            raise ValueError(
                f"reuse_len {self.reuse_len} must be < max_positions {self.max_positions}"
            )
        return self


def relative_positions(qlen: int, klen: int, dim: int, clamp_len: int, device) -> Tensor:
    """[klen + qlen, dim] sinusoids of the relative distances klen, klen-1, ..., -qlen+1
    (row r encodes the distance klen - r between a query and a key)."""
    dist = torch.arange(klen, -qlen, -1, device=device, dtype=torch.float32)
    if clamp_len > 0:
        dist = dist.clamp(-clamp_len, clamp_len)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    angles = dist[:, None] * inv_freq[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TwoStreamAttention(nn.Module):
    """Relative multi-head attention (Transformer-XL) with XLNet's segment term, applied to
    the content stream and, with the same weights, to the query stream.

    score(i, j) = (q_i + u)·k_j  +  (q_i + v)·R_{i-j}  +  (q_i + s)·seg[same(i, j)]
    u, v, s are the learned biases r_w_bias, r_r_bias, r_s_bias; R the projected sinusoid of
    the distance; seg[0] / seg[1] for keys in the same / another segment. The first term
    goes through scaled_dot_product_attention, the other two are its additive mask.
    """

    def __init__(self, cfg: XLNetConfig):
        super().__init__()
        H, n = cfg.hidden_size, cfg.num_heads
        self.n, self.d = n, H // n
        self.scale = 1.0 / math.sqrt(self.d)
        self.attention_dropout = cfg.attention_dropout
        self.qkv = nn.Linear(H, 3 * H, bias=False)  # XLNet's projections have no biases
        self.r = nn.Linear(H, H, bias=False)  # relative position keys
        self.o = nn.Linear(H, H, bias=False)
        self.r_w_bias = nn.Parameter(torch.zeros(n, self.d))
        self.r_r_bias = nn.Parameter(torch.zeros(n, self.d))
        self.r_s_bias = nn.Parameter(torch.zeros(n, self.d))
        self.seg_embed = nn.Parameter(torch.zeros(2, n, self.d))
        self.ln = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def heads(self, x: Tensor) -> Tensor:  # [B, T, H] -> [B, n, T, d]
        return x.view(x.shape[0], x.shape[1], self.n, self.d).transpose(1, 2)

    def attend(
        self,
        q: Tensor,  # [B, n, Q, d]
        k: Tensor,  # [B, n, K, d]  (K = memory + current)
        v: Tensor,
        k_r: Tensor,  # [1, n, K + T, d] projected relative sinusoids
        query_pos: Tensor,  # [B, Q] position (in the current segment) of every query row
        seg_same: Tensor | None,  # [B, Q, K] bool: query and key in the same segment
        blocked: Tensor | None,  # [B, Q, K] bool: the query may not see the key
    ) -> Tensor:
        B, _, Q, _ = q.shape
        K, T = k.shape[2], k_r.shape[2] - k.shape[2]
        # Position term: row r of k_r is distance K - r, and query i (at absolute index
        # M + i, M = K - T memory slots) vs key j is distance M + i - j, i.e. row T - i + j.
        pos_scores = (q + self.r_r_bias[:, None]) @ k_r.transpose(-1, -2)  # [B, n, Q, K+T]
        index = T - query_pos[:, :, None] + torch.arange(K, device=q.device)  # [B, Q, K]
        bias = pos_scores.gather(-1, index[:, None].expand(B, self.n, Q, K))
        if seg_same is not None:
            seg = torch.einsum("bnqd,snd->bnqs", q + self.r_s_bias[:, None], self.seg_embed)
            bias = bias + torch.where(seg_same[:, None], seg[..., :1], seg[..., 1:])
        bias = bias * self.scale
        if blocked is not None:  # finite (not -inf): adding the content score cannot overflow
            bias = bias.masked_fill(blocked[:, None], torch.finfo(bias.dtype).min / 2)
        y = F.scaled_dot_product_attention(
            q + self.r_w_bias[:, None],
            k,
            v,
            attn_mask=bias.to(q.dtype),
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.scale,
        )
        return y.transpose(1, 2).reshape(B, Q, self.n * self.d)

    def post(self, x: Tensor, y: Tensor) -> Tensor:
        return self.ln(x + self.dropout(self.o(y)))


class FeedForward(nn.Module):
    def __init__(self, cfg: XLNetConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        y = self.dropout(F.gelu(self.fc(x), approximate=self.approximate))
        return self.ln(x + self.dropout(self.proj(y)))


class XLNetLayer(nn.Module):
    """Post-LN layer; both streams share every weight. Keys and values are always the
    content stream (memory + current segment)."""

    def __init__(self, cfg: XLNetConfig):
        super().__init__()
        self.attn = TwoStreamAttention(cfg)
        self.ff = FeedForward(cfg)

    def forward(
        self,
        h: Tensor,
        g: Tensor | None,
        mem: Tensor | None,
        k_r: Tensor,
        h_pos: Tensor,
        g_pos: Tensor | None,
        h_seg: Tensor | None,
        g_seg: Tensor | None,
        h_blocked: Tensor | None,
        g_blocked: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        a = self.attn
        q, k, v = a.qkv(h).chunk(3, dim=-1)
        if mem is not None:  # memory gives keys and values only
            H = h.shape[-1]
            k_mem, v_mem = (mem @ a.qkv.weight[H:].t()).chunk(2, dim=-1)
            k, v = torch.cat([k_mem, k], dim=1), torch.cat([v_mem, v], dim=1)
        k, v = a.heads(k), a.heads(v)
        y = a.attend(a.heads(q), k, v, k_r, h_pos, h_seg, h_blocked)
        h_out = self.ff(a.post(h, y))
        if g is None:
            return h_out, None
        q_g = g @ a.qkv.weight[: g.shape[-1]].t()  # only the query projection
        y = a.attend(a.heads(q_g), k, v, k_r, g_pos, g_seg, g_blocked)
        return h_out, self.ff(a.post(g, y))


class XLNet(PretrainModel):
    causal = False  # the content stream without perm_mask is bidirectional

    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.word = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.mask_emb = nn.Parameter(torch.zeros(cfg.hidden_size))  # query stream start
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(XLNetLayer(cfg) for _ in range(cfg.num_layers))
        self.lm_bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size))  # head tied to `word`
        # not persistent: derived from the config, never saved in a checkpoint
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) for every weight, the attention biases, the segment embeddings and
        mask_emb; zero Linear biases and LM bias; LayerNorm = identity; padded rows zero."""
        std = self.config.init_std
        init_normal(self, std)

        def attention_biases(a: nn.Module) -> None:
            for p in (a.r_w_bias, a.r_r_bias, a.r_s_bias, a.seg_embed):
                nn.init.normal_(p, mean=0.0, std=std)

        for layer in self.layers:
            on_module(layer.attn, attention_biases)
        on_module(self, lambda m: nn.init.normal_(m.mask_emb, mean=0.0, std=std))
        zero_rows(self.word, self.config.vocab_size)

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        perm_mask: Tensor | None = None,
        target_mapping: Tensor | None = None,
        mems: Tensor | None = None,
        pretrain_heads: bool = True,  # False: no LM head (base.PretrainModel)
    ) -> dict[str, Tensor | None]:
        cfg = self.config
        B, T = input_ids.shape
        if T > cfg.max_positions:
            raise ValueError(f"sequence length {T} > model.max_positions {cfg.max_positions}")
        if mems is not None and tuple(mems.shape[:2]) != (cfg.num_layers, B):
            raise ValueError(
                f"mems of shape {tuple(mems.shape)} do not fit {cfg.num_layers} layers x batch "
                f"{B}: pass the mems this model returned for the previous segment of these rows"
            )
        dev = input_ids.device
        M = 0 if mems is None else mems.shape[2]
        K = M + T
        h_pos = torch.arange(T, device=dev).expand(B, T)

        # What each content-stream query may not see: later factorization steps and
        # padding, minus the diagonal: a position always sees itself, a padded one too
        # (as in transformers, so the memory cached from padded rows is the same there).
        # Memory is visible.
        blocked = None
        if perm_mask is not None:
            blocked = perm_mask.bool()
        if attention_mask is not None and not bool(attention_mask.all()):
            pad = ~attention_mask.bool()[:, None, :].expand(B, T, T)
            blocked = pad if blocked is None else blocked | pad
        if blocked is not None:
            blocked = blocked & ~torch.eye(T, dtype=torch.bool, device=dev)
        h_blocked = None if blocked is None else F.pad(blocked, (M, 0))  # [B, T, K]

        seg_same = None
        if token_type_ids is not None:  # memory counts as segment 0 (as XLNet does)
            keys = F.pad(token_type_ids, (M, 0))
            seg_same = token_type_ids[:, :, None] == keys[:, None, :]  # [B, T, K]

        # Query stream: one row per prediction, at position g_pos; it may not see what
        # the position's own content stream row may not see, nor the position itself.
        g = g_pos = g_seg = g_blocked = None
        if target_mapping is not None and pretrain_heads:
            g_pos = target_mapping.float().argmax(-1)  # [B, P]
            P = g_pos.shape[1]
            rows = g_pos[:, :, None].expand(B, P, K)
            if perm_mask is not None:
                g_blocked = F.pad(perm_mask.bool(), (M, 0)).gather(1, rows)
            else:
                g_blocked = torch.zeros(B, P, K, dtype=torch.bool, device=dev)
            if h_blocked is not None:
                g_blocked = g_blocked | h_blocked.gather(1, rows)
            own = torch.arange(K, device=dev) == (M + g_pos)[:, :, None]
            g_blocked = g_blocked | own
            g_seg = None if seg_same is None else seg_same.gather(1, rows)
            g = self.dropout(self.mask_emb.expand(B, P, -1))

        h = self.dropout(self.word(input_ids))
        if mems is not None:  # e.g. restored from a checkpoint on the CPU, or fp32 under bf16
            mems = mems.to(device=dev, dtype=h.dtype)
        pos = relative_positions(T, K, cfg.hidden_size, cfg.clamp_len, dev).to(h.dtype)
        pos = self.dropout(pos)[None]
        new_mems = []
        for i, layer in enumerate(self.layers):
            mem = None if mems is None else mems[i]
            if cfg.mem_len > 0:
                new_mems.append(self._cache(h, mem))
            # project the sinusoids per layer (each layer has its own r)
            k_r = layer.attn.heads(layer.attn.r(pos))
            args = (h, g, mem, k_r, h_pos, g_pos, seg_same, g_seg, h_blocked, g_blocked)
            h, g = self.run_layer(layer, *args)

        outputs = {}
        if pretrain_heads:
            out = self.dropout(h if g is None else g)
            bias = (self.lm_bias + self.pad_bias).to(out.dtype)
            outputs["logits"] = F.linear(out, self.word.weight, bias)
        outputs["hidden_states"] = h
        outputs["mems"] = torch.stack(new_mems) if new_mems else None
        return outputs

    def _cache(self, h: Tensor, mem: Tensor | None) -> Tensor:
        """This layer's input at the reused positions, appended to its memory; the last
        mem_len positions, detached (no gradient flows into earlier segments)."""
        reuse = self.config.reuse_len
        cur = h if reuse is None else h[:, :reuse]
        cat = cur if mem is None else torch.cat([mem.to(cur.dtype), cur], dim=1)
        return cat[:, -self.config.mem_len :].detach()

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward) per input token, the content stream as a
        dense encoder plus the query stream's share:

            6 * (N + H*Vpad*f) + 6 * N_q * f + 12 * L * H * (T + M) * (1 + f) + 6 * L * H^2 * (2T + M) / T

        N = per-token layer weights (qkv, o, FFN); f = 1/6, the predicted share (query rows
        per token with K = 6); N_q = N minus the key/value projections (the query stream
        only needs queries); the LM head runs on the predicted rows only; M = mem_len keys
        from memory; the last term projects the T + M + T relative sinusoids with each
        layer's r. Embedding lookups are free. An estimate for MFU, as for the others.
        """
        cfg = self.config
        L, H, T, M = cfg.num_layers, cfg.hidden_size, seq_len, cfg.mem_len
        f = 1.0 / 6.0
        per_layer = 4 * H * H + 2 * H * cfg.intermediate_size  # qkv + o + FFN
        n = L * per_layer
        n_q = L * (per_layer - 2 * H * H)
        attn = 12.0 * L * H * (T + M) * (1 + f)
        rel = 6.0 * L * H * H * (2 * T + M) / T
        return 6.0 * (n + H * cfg.padded_vocab_size * f) + 6.0 * n_q * f + attn + rel
