"""DistilBERT (Sanh et al., 2019): BERT with half the layers, trained by distillation.

The student keeps BERT's post-LN layers and MLM head but drops the token-type (segment)
embeddings and the pooler, as the paper does; the distillation itself (teacher, losses,
initialisation from every other teacher layer) is the ``distill`` objective
(pipeline/objectives/distill.py).

Outputs: {"mlm_logits": [B,T,Vpad], "hidden_states": [B,T,H]}; {"hidden_states"} alone
with ``pretrain_heads=False``.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.bert import BertMLMHead
from pipeline.models.blocks import (
    Attention,
    TransformerConfig,
    encoder_attention,
    init_normal,
    make_blocks,
    non_embedding_params,
    vocab_pad_bias,
    zero_rows,
)


class DistilBertConfig(TransformerConfig):
    """DistilBERT-base: BERT-base with 6 layers."""

    num_layers: int = Field(6, gt=0)


class DistilBertEmbeddings(nn.Module):
    """token + position embeddings (no segments), LayerNorm, dropout."""

    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return self.dropout(self.ln(self.word(input_ids) + self.position(position_ids)))


class DistilBert(PretrainModel):
    layout_kind = "encoder"

    def __init__(self, config: DistilBertConfig):
        super().__init__()
        self.config = config
        self.embeddings = DistilBertEmbeddings(config)
        self.blocks = make_blocks(config, pre_ln=False)
        self.mlm_head = BertMLMHead(config)
        self.register_buffer(
            "pad_bias",
            vocab_pad_bias(config.vocab_size, config.padded_vocab_size),
            persistent=False,
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        init_normal(self, self.config.init_std)
        zero_rows(self.embeddings.word, self.config.vocab_size)

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,  # unused: an encoder sees its whole input
        layout: Attention | None = None,  # attention_layout(batch), built by the caller
        pretrain_heads: bool = True,  # False: hidden_states only (base.PretrainModel)
    ) -> dict[str, Tensor]:
        self.check_length(input_ids.shape[1], self.config.max_positions)
        # Dense [B,T,...], or with unpadding the real tokens packed into [1,N,...]
        attn = layout if layout is not None else encoder_attention(attention_mask, self.unpad)
        x = self.embeddings(attn.pack(input_ids), attn.positions(input_ids, position_ids))
        for block in self.blocks:
            x = self.run_layer(block, x, attn)
        if not pretrain_heads:
            return {"hidden_states": attn.unpack(x)}
        # every position's logits (the distill objective compares them with the teacher's)
        word = self.embeddings.word.weight
        mlm_logits = self.mlm_head.in_layout(attn, x, word, self.pad_bias, None)
        return {"mlm_logits": mlm_logits, "hidden_states": attn.unpack(x)}

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """6 * (N + H * Vpad) + 12 * L * H * T, as Bert.flops_per_token (the teacher's
        forward pass, run by the objective, is not counted)."""
        cfg, e = self.config, self.embeddings
        n = (
            non_embedding_params(self, [e.word, e.position])
            + cfg.hidden_size * cfg.padded_vocab_size
        )
        return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
