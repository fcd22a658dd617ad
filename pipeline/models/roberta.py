"""RoBERTa (Liu et al., 2019): BERT's post-LN encoder, trained differently.

The architecture is BERT's; what changes is the recipe: no NSP (so no pooler or NSP
head here: MLM only), dynamic masking (the ``mlm`` objective's default), FULL-SENTENCES
packing (``objective.mlm.packing``), a byte-level BPE vocabulary (``plm data tokenizer
--kind bpe``), bigger batches and longer training (configs/experiments/roberta-base.yaml).

Two details follow fairseq/transformers so exported models match:
- positions start at ``pad_token_id + 1``: a real token at index t (counting real tokens
  only) gets position ``pad_token_id + 1 + t``, padding gets ``pad_token_id``. Hence
  ``max_positions`` 514 for 512 tokens; ``pad_token_id`` must be the tokenizer's
  (1 with our BPE tokenizer, as in RoBERTa; the objective checks it);
- one segment type (``type_vocab_size`` 1) and LayerNorm eps 1e-5.

Outputs: {"mlm_logits": [B,T,Vpad], "hidden_states": [B,T,H]}; [N,Vpad] (the labelled positions)
when given ``mlm_labels``, as for BERT; {"hidden_states"} alone with ``pretrain_heads=False``.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.bert import BertEmbeddings, BertMLMHead
from pipeline.models.blocks import (
    Attention,
    TransformerConfig,
    encoder_attention,
    init_normal,
    make_blocks,
    non_embedding_params,
    on_module,
    vocab_pad_bias,
    zero_rows,
)


class RobertaConfig(TransformerConfig):
    max_positions: int = Field(514, gt=0)  # 512 tokens + the pad_token_id + 1 offset
    layer_norm_eps: float = Field(1e-5, gt=0)
    type_vocab_size: int = Field(1, gt=0)
    pad_token_id: int = Field(1, ge=0)  # <pad> of the tokenizer; positions start after it

    @model_validator(mode="after")
    def _room_for_positions(self):
        if self.max_positions <= self.pad_token_id + 1:
            raise ValueError(
                f"max_positions {self.max_positions} leaves no position for a token "
                f"(positions start at pad_token_id + 1 = {self.pad_token_id + 1})"
            )
        return self


def roberta_position_ids(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """fairseq's make_positions: pad_token_id + 1 + (index among the real tokens) for real
    tokens, pad_token_id for padding (whose position row is never trained)."""
    real = input_ids.ne(pad_token_id).long()
    return torch.cumsum(real, dim=1) * real + pad_token_id


class Roberta(PretrainModel):
    layout_kind = "encoder"

    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.embeddings = BertEmbeddings(cfg)
        self.blocks = make_blocks(cfg, pre_ln=False)
        self.mlm_head = BertMLMHead(cfg)
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's init; the padded vocabulary rows and the padding's position row are zero
        (``nn.Embedding(padding_idx=...)`` in fairseq/transformers)."""
        init_normal(self, self.config.init_std)
        zero_rows(self.embeddings.word, self.config.vocab_size)
        pad = self.config.pad_token_id
        on_module(self.embeddings.position, lambda m: m.weight[pad].zero_())

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.blocks)

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
        cfg = self.config
        T = input_ids.shape[1]
        if T + cfg.pad_token_id >= cfg.max_positions:
            raise ValueError(
                f"sequence length {T} needs positions up to {T + cfg.pad_token_id}, "
                f"but model.max_positions is {cfg.max_positions} (positions start at "
                f"pad_token_id + 1); raise model.max_positions to {T + cfg.pad_token_id + 1}"
            )
        if position_ids is None:
            position_ids = roberta_position_ids(input_ids, cfg.pad_token_id)
        # Dense [B,T,...], or with unpadding the real tokens packed into [1,N,...]
        attn = layout if layout is not None else encoder_attention(attention_mask, self.unpad)
        positions = attn.positions(input_ids, position_ids)
        x = self.embeddings(attn.pack(input_ids), attn.pack(token_type_ids), positions)
        for block in self.blocks:
            x = self.run_layer(block, x, attn)
        if not pretrain_heads:
            return {"hidden_states": attn.unpack(x)}
        word = self.embeddings.word.weight
        mlm_logits = self.mlm_head.in_layout(attn, x, word, self.pad_bias, mlm_labels)
        return {"mlm_logits": mlm_logits, "hidden_states": attn.unpack(x)}

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """6 * (N + f * H * Vpad) + 12 * L * H * T, as for BERT (``Bert.flops_per_token``)."""
        cfg = self.config
        e = self.embeddings
        n = non_embedding_params(self, [e.word, e.position, e.token_type])
        n += decoder_fraction * cfg.hidden_size * cfg.padded_vocab_size
        return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
