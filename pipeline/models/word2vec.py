"""word2vec (Mikolov et al., 2013): static word vectors by negative sampling, the
pre-ELMo baseline. Two architectures (``mode``):

    skipgram   the center word's vector predicts each context word:
               score(c, o) = v_c . u_o          for every (center, context) pair
    cbow       the mean of the context words' vectors predicts the center word:
               score(ctx, c) = mean(v_ctx) . u_c

``v`` = ``input_embeddings`` (the word vectors that are kept), ``u`` =
``output_embeddings`` (the context side, used only for training). Every true pair is
contrasted with ``negatives`` noise words drawn from the unigram distribution ** 0.75
(objective: pipeline.objectives.word2vec, which also draws the dynamic window and
the optional subsampling of frequent words).

Words are the tokens of our tokenizer: the shards hold its ids, and a subword
tokenizer keeps frequent words whole, so most vectors are whole-word vectors while
rare words are split into pieces that get vectors of their own (fastText-like).
``plm neighbors`` (pipeline.neighbors) and ``load_word2vec_embeddings``
(pipeline.models.word2vec_vectors) average the pieces' vectors for a word that is not
one token.

The model takes the batch keys it needs by name (``context_ids``, ``negative_ids``);
without them, or with ``pretrain_heads=False`` (fine-tuning, feature extraction), it
returns only ``hidden_states`` = the static vectors of the input ids, the same vector for
a word in every context.
``counts`` (a buffer, saved in the bundle) holds the unigram counts training saw.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.blocks import on_module, padded_vocab_size, zero_rows


class Word2VecConfig(BaseModel):
    """Defaults: the word2vec tool's (skip-gram, 300 dimensions, window 5, 5 negatives)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)
    embedding_dim: int = Field(300, gt=0)
    mode: Literal["skipgram", "cbow"] = "skipgram"
    window: int = Field(5, gt=0)  # largest context distance; each center draws 1..window
    negatives: int = Field(5, gt=0)  # noise words per true pair
    vocab_multiple: int = Field(64, gt=0)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)


class Word2Vec(PretrainModel):
    def __init__(self, config: Word2VecConfig):
        super().__init__()
        self.config = cfg = config
        self.input_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.embedding_dim)
        self.output_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.embedding_dim)
        self.register_buffer("counts", torch.zeros(cfg.padded_vocab_size), persistent=True)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """As the word2vec tool: word vectors U(-0.5/D, 0.5/D), context vectors zero."""
        D = self.config.embedding_dim
        on_module(self.input_embeddings, lambda m: nn.init.uniform_(m.weight, -0.5 / D, 0.5 / D))
        on_module(self.output_embeddings, lambda m: nn.init.zeros_(m.weight))
        zero_rows(self.input_embeddings, self.config.vocab_size)

    @torch.no_grad()
    def set_counts(self, counts: Tensor) -> None:
        self.counts.zero_()
        self.counts[: counts.shape[0]] = counts.to(self.counts)

    @property
    def vectors(self) -> Tensor:
        """[vocab_size, D] the word vectors (padded rows left out)."""
        return self.input_embeddings.weight[: self.config.vocab_size]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        context_ids: Tensor | None = None,
        negative_ids: Tensor | None = None,
        pretrain_heads: bool = True,  # False: no scores (base.PretrainModel)
    ) -> dict[str, Tensor]:
        """input_ids [B,T]; context_ids [B,T,2W] (-100: no context in that slot);
        negative_ids [B,T,2W,K] (skipgram: K per pair) or [B,T,K] (cbow: K per center).
        Returns hidden_states [B,T,D] and, given contexts, pos_scores / neg_scores."""
        v = self.input_embeddings(input_ids)
        out = {"hidden_states": v}
        if not pretrain_heads or context_ids is None or negative_ids is None:
            return out
        valid = context_ids >= 0
        contexts = context_ids.clamp(min=0)
        if self.config.mode == "skipgram":
            out["pos_scores"] = torch.einsum("btd,btcd->btc", v, self.output_embeddings(contexts))
            noise = self.output_embeddings(negative_ids)
            out["neg_scores"] = torch.einsum("btd,btckd->btck", v, noise)
        else:
            ctx = self.input_embeddings(contexts) * valid[..., None].to(v.dtype)
            h = ctx.sum(2) / valid.sum(2, keepdim=True).clamp(min=1).to(v.dtype)
            out["pos_scores"] = (h * self.output_embeddings(input_ids)).sum(-1)
            noise = self.output_embeddings(negative_ids)
            out["neg_scores"] = torch.einsum("btd,btkd->btk", h, noise)
        return out

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs per center token (3x forward), for the expected dynamic window
        (each side 1..W words, (W + 1) / 2 on average: W + 1 context words in all):
          skipgram  forward 2 * D * (1 + K) per pair, W + 1 pairs
          cbow      forward 2 * D * (W + 1) (context mean) + 2 * D * (1 + K)
        """
        cfg = self.config
        D, K, n_ctx = cfg.embedding_dim, cfg.negatives, cfg.window + 1
        if cfg.mode == "skipgram":
            return 3.0 * 2 * D * (1 + K) * n_ctx
        return 3.0 * (2 * D * n_ctx + 2 * D * (1 + K))
