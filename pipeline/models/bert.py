"""BERT (Devlin et al., 2018): a post-LN transformer encoder with the two pretraining heads,
masked-LM (tied to the input embeddings) and next-sentence prediction on the pooled [CLS].
The pooler and the NSP head are built only with ``pair_head`` (the trainer sets it from
the objective: mlm+nsp, mlm+sop, ernie with NSP; see pipeline/models/base.py).

Outputs: {"mlm_logits": [B,T,Vpad], "nsp_logits": [B,2], "hidden_states": [B,T,H]}
("nsp_logits" only with the pair head); given
``mlm_labels`` (the trainer passes them), "mlm_logits" is [N,Vpad]: the N labelled positions.
Vpad is vocab_size rounded up to a multiple of 64; the padded rows get a logit of
PAD_LOGIT so they never win. nsp_logits index 0 = "B follows A", 1 = "B is random"
(the original BERT / transformers convention). ``pretrain_heads=False``: {"hidden_states"}
alone, neither head run (pipeline/models/base.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
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


class BertConfig(TransformerConfig):
    """BERT's defaults are the base fields' (BERT-base, post-LN, exact GELU, eps 1e-12)."""

    # segments A / B; 1: one type for both (segment B gets type 0, as in RoBERTa)
    type_vocab_size: int = Field(2, gt=0)
    # The pooler + NSP head (sentence-pair objectives); false: MLM only, as transformers'
    # BertForMaskedLM. True by default: what every bundle saved before the key had.
    pair_head: bool = True


class BertEmbeddings(nn.Module):
    """token + position + segment embeddings, then LayerNorm and dropout. ``width``: the
    embedding width when it is not the hidden size (ALBERT's and ELECTRA's E)."""

    def __init__(self, cfg: BertConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.hidden_size
        self.word = nn.Embedding(cfg.padded_vocab_size, width)
        self.position = nn.Embedding(cfg.max_positions, width)
        self.token_type = nn.Embedding(cfg.type_vocab_size, width)
        self.ln = nn.LayerNorm(width, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor | None, position_ids: Tensor
    ) -> Tensor:
        x = self.word(input_ids) + self.position(position_ids)
        # One segment type (type_vocab_size 1, as RoBERTa): every token is segment A, and
        # a pair's segment B too (ids 1 from a two-type tokenizer would be out of range);
        # the segments are told apart by their separators.
        if token_type_ids is None or self.token_type.num_embeddings == 1:
            x = x + self.token_type.weight[0]  # all segment A
        else:
            x = x + self.token_type(token_type_ids)
        return self.dropout(self.ln(x))


class BertMLMHead(nn.Module):
    """dense -> GELU -> LayerNorm, then the decoder tied to the word embeddings (+ bias).
    ``width``: the word embeddings' width when it is not the hidden size (ALBERT's E)."""

    def __init__(self, cfg: BertConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.hidden_size
        self.dense = nn.Linear(cfg.hidden_size, width)
        self.ln = nn.LayerNorm(width, eps=cfg.layer_norm_eps)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size))

    def forward(
        self, h: Tensor, word_embeddings: Tensor, pad_bias: Tensor, labels: Tensor | None = None
    ) -> Tensor:
        """[B,T,Vpad] logits; with MLM ``labels`` (training), [N,Vpad] for the N labelled
        positions only (row-major): the vocabulary projection is most of a small model's
        compute, and ~85% of the positions carry no loss."""
        if labels is not None:
            h = h[labels >= 0]
        h = self.ln(F.gelu(self.dense(h), approximate=self.approximate))
        # pad_bias is a buffer; cast so bf16/fp16 engines (which may leave buffers in fp32) match.
        return F.linear(h, word_embeddings, (self.bias + pad_bias).to(word_embeddings.dtype))

    def in_layout(
        self, attn: Attention, h: Tensor, word_embeddings: Tensor, pad_bias: Tensor,
        labels: Tensor | None,
    ) -> Tensor:  # fmt: skip
        """``forward`` on hidden states in ``attn``'s layout: [N,Vpad] for the labelled
        positions of ``labels`` [B,T] (row-major; gathered at the layout's ``labelled``
        positions when it has them, so without a host read), else [B,T,Vpad] for every
        position."""
        if labels is not None:
            return self(attn.labelled_rows(h, labels), word_embeddings, pad_bias)
        return attn.unpack(self(h, word_embeddings, pad_bias))


class Bert(PretrainModel):
    layout_kind = "encoder"
    pair_modules = ("pooler", "nsp_head")

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        cfg = config
        self.embeddings = BertEmbeddings(cfg)
        self.blocks = make_blocks(cfg, pre_ln=False)
        self.mlm_head = BertMLMHead(cfg)
        if cfg.pair_head:
            self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.nsp_head = nn.Linear(cfg.hidden_size, 2)
        # not persistent: derived from the config, never saved in a checkpoint
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) everywhere, zero biases (incl. the MLM output bias), LayerNorm = identity.
        The padded vocabulary rows are zeroed: they are never looked up nor predicted."""
        init_normal(self, self.config.init_std)
        zero_rows(self.embeddings.word, self.config.vocab_size)

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
        self.check_length(input_ids.shape[1], self.config.max_positions)
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
        out = {"mlm_logits": mlm_logits, "hidden_states": attn.unpack(x)}
        if self.config.pair_head:
            pooled = torch.tanh(self.pooler(attn.firsts(x)))  # the [CLS] position
            out["nsp_logits"] = self.nsp_head(pooled)
        return out

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward) per token:

            6 * (N + f * H * Vpad) + 12 * L * H * T

        N = parameters outside the embedding tables; H * Vpad = the tied MLM decoder, a real
        matmul although its weights are the embedding table; a matmul with a weight of n
        entries costs 2n FLOPs per token forward and 4n backward. 12 * L * H * T is the
        attention itself (QK^T and AV: 2 * 2 * T * H per layer forward, x3 for training).
        The pooler/NSP head, when built (once per sequence), is counted per token: a slight
        over-count.
        f = ``decoder_fraction``, the share of tokens the decoder runs on: 1 scores every
        position (transformers' model, evaluation), the labelled share (~15%) in training.
        T = ``seq_len``: the keys a token attends to (the trainer passes the mean over real
        tokens of their sequence's real length, what unpadded attention computes).
        """
        cfg = self.config
        e = self.embeddings
        n = non_embedding_params(self, [e.word, e.position, e.token_type])
        n += decoder_fraction * cfg.hidden_size * cfg.padded_vocab_size
        return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
