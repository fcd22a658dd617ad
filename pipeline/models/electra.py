"""ELECTRA (Clark et al., 2020): a small generator trained with MLM proposes replacements
for the masked tokens; the discriminator, the model we keep, tells for every token whether
it was replaced (replaced token detection, RTD).

One module holds both networks. They share the token, position and segment embeddings
(and their LayerNorm), as the paper recommends: the generator's softmax over the whole
vocabulary updates every embedding row densely, which the discriminator alone never would.
The embeddings have their own width E (``embedding_size``, 128 for ELECTRA-small); each
network projects them to its hidden size when the two differ. The generator is the
discriminator scaled down by ``generator_size`` (hidden size, heads, FFN width; 1/4 by
default, the paper finds 1/4-1/2 best), with as many layers unless ``generator_layers`` says.

forward(input_ids, ..., mlm_labels):
  * without mlm_labels (fine-tuning, export): the discriminator on the input as it is,
    {"rtd_logits": [B,T], "hidden_states": [B,T,H]};
  * with mlm_labels (pretraining: input_ids are the masked ids, mlm_labels the original id
    at masked positions and -100 elsewhere): the generator predicts the masked positions,
    a replacement is sampled from its softmax (torch's RNG, so checkpoints restore it),
    the discriminator reads the corrupted sequence and the outputs add
    "mlm_logits" [N,Vpad] (the N masked positions only, in row-major order),
    "corrupted_ids" [B,T] and "rtd_labels" [B,T] = (corrupted != original). A sample that
    happens to equal the original token counts as original, as in the paper;
  * with pretrain_heads=False (fine-tuning's features): the discriminator's layers on the
    input as it is and no head, generator nor discriminator's: {"hidden_states": [B,T,H]}
    (mlm_labels unused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.bert import BertEmbeddings
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


class ElectraConfig(TransformerConfig):
    """The discriminator's shape (ELECTRA-base defaults) plus the generator's scale."""

    embedding_size: int = Field(768, gt=0)
    type_vocab_size: int = Field(2, gt=0)
    generator_size: float = Field(0.25, gt=0, le=1)  # generator width / discriminator width
    generator_layers: int | None = Field(None, gt=0)  # None: num_layers

    @model_validator(mode="after")
    def _generator_heads_divide(self):
        g = self._generator_shape()
        if g["hidden_size"] % g["num_heads"]:
            raise ValueError(
                f"the generator's hidden size {g['hidden_size']} (hidden_size x generator_size) "
                f"is not divisible by its {g['num_heads']} heads; pick another generator_size"
            )
        return self

    def _generator_shape(self) -> dict[str, int]:
        s = self.generator_size
        return {
            "hidden_size": max(1, round(self.hidden_size * s)),
            "num_heads": max(1, round(self.num_heads * s)),
            "intermediate_size": max(1, round(self.intermediate_size * s)),
            "num_layers": self.generator_layers or self.num_layers,
        }

    def generator_config(self) -> TransformerConfig:
        """The generator: hidden size, heads and FFN width scaled by generator_size."""
        base = self.model_dump(include=set(TransformerConfig.model_fields))
        return TransformerConfig(**{**base, **self._generator_shape()})


class ElectraEncoder(nn.Module):
    """Projection of the shared embeddings to this network's width (if needed) + layers."""

    def __init__(self, cfg: TransformerConfig, embedding_size: int):
        super().__init__()
        self.project = (
            nn.Linear(embedding_size, cfg.hidden_size)
            if embedding_size != cfg.hidden_size
            else None
        )
        self.blocks = make_blocks(cfg, pre_ln=False)


class GeneratorHead(nn.Module):
    """dense (Hg -> E) -> exact GELU -> LayerNorm, then the tied word embeddings + bias."""

    def __init__(self, hidden_size: int, embedding_size: int, padded_vocab: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(hidden_size, embedding_size)
        self.ln = nn.LayerNorm(embedding_size, eps=eps)
        self.bias = nn.Parameter(torch.zeros(padded_vocab))

    def forward(self, h: Tensor, word_embeddings: Tensor, pad_bias: Tensor) -> Tensor:
        h = self.ln(F.gelu(self.dense(h)))
        return F.linear(h, word_embeddings, (self.bias + pad_bias).to(word_embeddings.dtype))


class DiscriminatorHead(nn.Module):
    """dense (H -> H) -> activation -> one logit per token: "this token was replaced"."""

    def __init__(self, cfg: ElectraConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, 1)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, h: Tensor) -> Tensor:
        return self.out(F.gelu(self.dense(h), approximate=self.approximate)).squeeze(-1)


def gumbel_sample(logits: Tensor) -> Tensor:
    """One id per row drawn from softmax(logits) (Gumbel-max: argmax(logits - log E),
    E ~ Exp(1)), from torch's RNG. Padded vocabulary rows (PAD_LOGIT) are never drawn."""
    noise = torch.empty_like(logits).exponential_().log()
    return (logits - noise).argmax(-1)


class Electra(PretrainModel):
    layout_kind = "encoder"

    def __init__(self, config: ElectraConfig):
        super().__init__()
        self.config = config
        cfg, gen = config, config.generator_config()
        self.embeddings = BertEmbeddings(cfg, width=cfg.embedding_size)  # shared by both nets
        self.discriminator = ElectraEncoder(cfg, cfg.embedding_size)
        self.discriminator_head = DiscriminatorHead(cfg)
        self.generator = ElectraEncoder(gen, cfg.embedding_size)
        self.generator_head = GeneratorHead(
            gen.hidden_size, cfg.embedding_size, cfg.padded_vocab_size, cfg.layer_norm_eps
        )
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        init_normal(self, self.config.init_std)
        zero_rows(self.embeddings.word, self.config.vocab_size)

    def repeated_layers(self) -> list[nn.Module]:
        return [*self.discriminator.blocks, *self.generator.blocks]

    def encode(
        self, net: ElectraEncoder, attn: Attention, input_ids, token_type_ids, position_ids
    ) -> Tensor:
        """The shared embeddings, then ``net`` (discriminator or generator), in ``attn``'s
        layout: [B,T,H] dense, or [1,N,H] for the real tokens packed."""
        self.check_length(input_ids.shape[1], self.config.max_positions)
        positions = attn.positions(input_ids, position_ids)
        x = self.embeddings(attn.pack(input_ids), attn.pack(token_type_ids), positions)
        if net.project is not None:
            x = net.project(x)
        for block in net.blocks:
            x = self.run_layer(block, x, attn)
        return x

    def discriminate(
        self, input_ids, token_type_ids=None, attention_mask=None, position_ids=None,
        attn: Attention | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """(rtd_logits [B,T], hidden_states [B,T,H]) of the discriminator; ``attn``: the
        batch's layout when the caller has it (else built from ``attention_mask``)."""
        attn = attn or encoder_attention(attention_mask, self.unpad)
        h = self.encode(self.discriminator, attn, input_ids, token_type_ids, position_ids)
        return attn.unpack(self.discriminator_head(h)), attn.unpack(h)

    def generator_logits(
        self, input_ids, token_type_ids=None, attention_mask=None, position_ids=None,
        mlm_labels=None, attn: Attention | None = None,
    ) -> Tensor:  # fmt: skip
        """The generator's MLM logits, [B,T,Vpad], or [N,Vpad] at the N labelled positions
        of ``mlm_labels`` (>= 0, row-major; ``attn`` as for ``discriminate``)."""
        attn = attn or encoder_attention(attention_mask, self.unpad)
        g = self.encode(self.generator, attn, input_ids, token_type_ids, position_ids)
        if mlm_labels is None:
            return attn.unpack(self.generator_head(g, self.embeddings.word.weight, self.pad_bias))
        g = attn.labelled_rows(g, mlm_labels)  # only those rows meet the vocabulary
        return self.generator_head(g, self.embeddings.word.weight, self.pad_bias)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,  # unused: an encoder sees its whole input
        mlm_labels: Tensor | None = None,
        layout: Attention | None = None,  # attention_layout(batch), built by the caller
        pretrain_heads: bool = True,  # False: hidden_states only (base.PretrainModel)
    ) -> dict[str, Tensor]:
        # one layout for both networks: the corrupted input pads exactly as the masked one
        attn = layout if layout is not None else encoder_attention(attention_mask, self.unpad)
        if not pretrain_heads:
            h = self.encode(self.discriminator, attn, input_ids, token_type_ids, position_ids)
            return {"hidden_states": attn.unpack(h)}
        if mlm_labels is None:
            logits, h = self.discriminate(
                input_ids, token_type_ids, position_ids=position_ids, attn=attn
            )
            return {"rtd_logits": logits, "hidden_states": h}
        masked = mlm_labels >= 0
        mlm_logits = self.generator_logits(
            input_ids, token_type_ids, position_ids=position_ids, mlm_labels=mlm_labels,
            attn=attn,
        )  # fmt: skip
        with torch.no_grad():  # no gradient flows from the discriminator into the generator
            sampled = gumbel_sample(mlm_logits.detach().float())
            corrupted = input_ids.masked_scatter(masked, sampled.to(input_ids.dtype))
            original = torch.where(masked, mlm_labels, input_ids)
            rtd_labels = (corrupted != original).long()
        logits, h = self.discriminate(
            corrupted, token_type_ids, position_ids=position_ids, attn=attn
        )
        return {
            "mlm_logits": mlm_logits,
            "rtd_logits": logits,
            "rtd_labels": rtd_labels,
            "corrupted_ids": corrupted,
            "hidden_states": h,
        }

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs per token, both networks (see Bert.flops_per_token):

            6 * (N + f * E * Vpad) + 12 * T * (L * H + Lg * Hg)

        N = parameters outside the embedding tables, E * Vpad the tied generator decoder,
        which runs on the masked share f of the tokens in training.
        """
        cfg, gen = self.config, self.config.generator_config()
        e = self.embeddings
        n = non_embedding_params(self, [e.word, e.position, e.token_type])
        n += decoder_fraction * cfg.embedding_size * cfg.padded_vocab_size
        attn = cfg.num_layers * cfg.hidden_size + gen.num_layers * gen.hidden_size
        return 6.0 * n + 12.0 * attn * seq_len
