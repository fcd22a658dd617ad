"""ALBERT (Lan et al., 2019): BERT with far fewer parameters, same compute per layer.

1. Factorized embedding: tokens are embedded in E dimensions (``embedding_size``, 128)
   and projected to the hidden size H: V*E + E*H parameters instead of V*H. The MLM
   head goes back down to E and decodes with the (tied) E-dimensional word table.
2. Cross-layer parameter sharing (``share``): ``all`` layers use one set of weights
   (ALBERT's default), or only the ``attention`` sublayers, or only the ``ffn``
   sublayers, or ``none``. A shared layer still runs ``num_layers`` times: compute is
   unchanged, parameters shrink by ~L.
3. Sentence-order prediction instead of NSP (``objective.kind: mlm+sop``), on a
   pooled [CLS] (dense + tanh) like BERT's; the pooler and SOP head are built only with
   ``pair_head`` (the objective decides: pipeline/models/base.py).

A layer is post-LN like BERT's: x = LN(x + attn(x)); x = LN(x + ffn(x)). Each sublayer
owns its LayerNorm (as in transformers' AlbertAttention / AlbertLayer), so sharing a
sublayer shares its LayerNorm too.

Outputs: {"mlm_logits": [B,T,Vpad], "sop_logits": [B,2], "hidden_states": [B,T,H]}
("sop_logits" only with the pair head); sop_logits index 0 = segments in order, 1 = swapped (transformers' convention). Given
``mlm_labels``, "mlm_logits" is [N,Vpad]: the labelled positions only, as for BERT.
``pretrain_heads=False``: {"hidden_states"} alone, neither head run.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.bert import BertEmbeddings, BertMLMHead
from pipeline.models.blocks import (
    MLP,
    Attention,
    SelfAttention,
    TransformerConfig,
    encoder_attention,
    init_normal,
    numel,
    vocab_pad_bias,
    zero_rows,
)


class AlbertConfig(TransformerConfig):
    """ALBERT-base (v2) defaults: E 128, all layers shared, tanh GELU, no dropout (the
    paper found removing dropout helps MLM accuracy, section 4.9)."""

    embedding_size: int = Field(128, gt=0)
    share: Literal["all", "attention", "ffn", "none"] = "all"
    type_vocab_size: int = Field(2, gt=0)
    activation: Literal["gelu", "gelu_tanh"] = "gelu_tanh"
    dropout: float = Field(0.0, ge=0, lt=1)
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    # The pooler + SOP head (mlm+sop); false: MLM only (AlbertForMaskedLM), as for BERT.
    pair_head: bool = True


class AttentionSublayer(nn.Module):
    """x -> LN(x + dropout(attn(x)))"""

    def __init__(self, cfg: AlbertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.attention_dropout)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, attn: Attention) -> Tensor:
        return self.ln(x + self.dropout(self.attn(x, attn)))


class FfnSublayer(nn.Module):
    """x -> LN(x + dropout(mlp(x)))"""

    def __init__(self, cfg: AlbertConfig):
        super().__init__()
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln(x + self.dropout(self.mlp(x)))


class Albert(PretrainModel):
    layout_kind = "encoder"
    pair_modules = ("pooler", "sop_head")

    def __init__(self, config: AlbertConfig):
        super().__init__()
        self.config = config
        cfg = config
        L = cfg.num_layers
        self.embeddings = BertEmbeddings(cfg, width=cfg.embedding_size)
        self.project = nn.Linear(cfg.embedding_size, cfg.hidden_size)  # E -> H
        # Shared sublayers are stored once (no parameter appears under two names, so
        # checkpoints, ZeRO partitioning and the bundle see each weight exactly once).
        n_attn = 1 if cfg.share in ("all", "attention") else L
        n_ffn = 1 if cfg.share in ("all", "ffn") else L
        self.attention = nn.ModuleList(AttentionSublayer(cfg) for _ in range(n_attn))
        self.ffn = nn.ModuleList(FfnSublayer(cfg) for _ in range(n_ffn))
        self.mlm_head = BertMLMHead(cfg, width=cfg.embedding_size)  # H -> E, tied to E-dim words
        if cfg.pair_head:
            self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.sop_head = nn.Linear(cfg.hidden_size, 2)
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        init_normal(self, self.config.init_std)
        zero_rows(self.embeddings.word, self.config.vocab_size)

    def repeated_layers(self) -> list[nn.Module]:
        """The sublayers (a shared one once): each is called through run_layer."""
        return [*self.attention, *self.ffn]

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,  # unused: an encoder sees its whole input
        mlm_labels: Tensor | None = None,  # given: logits for the labelled positions only
        layout: Attention | None = None,  # attention_layout(batch), built by the caller
        pretrain_heads: bool = True,  # False: hidden_states only (base.PretrainModel)
    ) -> dict[str, Tensor]:
        self.check_length(input_ids.shape[1], self.config.max_positions)
        # Dense [B,T,...], or with unpadding the real tokens packed into [1,N,...]
        attn = layout if layout is not None else encoder_attention(attention_mask, self.unpad)
        positions = attn.positions(input_ids, position_ids)
        x = self.embeddings(attn.pack(input_ids), attn.pack(token_type_ids), positions)
        x = self.project(x)
        for i in range(self.config.num_layers):  # layer i: its sublayers (shared: index 0)
            x = self.run_layer(self.attention[i % len(self.attention)], x, attn)
            x = self.run_layer(self.ffn[i % len(self.ffn)], x)
        if not pretrain_heads:
            return {"hidden_states": attn.unpack(x)}
        word = self.embeddings.word.weight
        mlm_logits = self.mlm_head.in_layout(attn, x, word, self.pad_bias, mlm_labels)
        out = {"mlm_logits": mlm_logits, "hidden_states": attn.unpack(x)}
        if self.config.pair_head:
            pooled = torch.tanh(self.pooler(attn.firsts(x)))
            out["sop_logits"] = self.sop_head(pooled)
        return out

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """6 * (N_used + f * E * Vpad) + 12 * L * H * T (f, T: see Bert.flops_per_token).

        N_used counts the weights each token passes through: a shared layer's weights
        once per layer that runs them (compute does not shrink with sharing, only the
        parameter count), plus the E->H projection, the MLM head's dense H->E and the
        pooler/SOP head when built; E * Vpad is the tied decoder matmul. Attention as for BERT.
        """
        cfg = self.config
        L = cfg.num_layers

        def count(module: nn.Module) -> int:
            return sum(numel(p) for p in module.parameters())

        per_layer = count(self.attention[0]) + count(self.ffn[0])
        n = L * per_layer + count(self.project) + count(self.mlm_head)
        if cfg.pair_head:
            n += count(self.pooler) + count(self.sop_head)
        n += decoder_fraction * cfg.embedding_size * cfg.padded_vocab_size
        return 6.0 * n + 12.0 * L * cfg.hidden_size * seq_len
