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
``plm neighbors`` and ``load_word2vec_embeddings`` (pipeline.neighbors) average the
pieces' vectors for a word that is not one token.

The model takes the batch keys it needs by name (``context_ids``, ``negative_ids``);
without them (fine-tuning, feature extraction) it returns only ``hidden_states`` =
the static vectors of the input ids, the same vector for a word in every context.
``counts`` (a buffer, saved in the bundle) holds the unigram counts training saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.blocks import padded_vocab_size


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
        nn.init.uniform_(self.input_embeddings.weight, -0.5 / D, 0.5 / D)
        nn.init.zeros_(self.output_embeddings.weight)
        self.input_embeddings.weight[self.config.vocab_size :].zero_()

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
    ) -> dict[str, Tensor]:
        """input_ids [B,T]; context_ids [B,T,2W] (-100: no context in that slot);
        negative_ids [B,T,2W,K] (skipgram: K per pair) or [B,T,K] (cbow: K per center).
        Returns hidden_states [B,T,D] and, given contexts, pos_scores / neg_scores."""
        v = self.input_embeddings(input_ids)
        out = {"hidden_states": v}
        if context_ids is None or negative_ids is None:
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


# --------------------------------------------------------------------------- downstream use

_PIECE_MARKERS = ("##", "▁", "Ġ")  # WordPiece continuation, Unigram / byte-level word start


def _target_tokens(target_vocab) -> list[str | None]:
    """target_vocab as a list: index = the downstream id, value = the token text."""
    from tokenizers import Tokenizer

    if isinstance(target_vocab, (str, Path)):
        path = Path(target_vocab)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"target vocabulary {target_vocab}: no tokenizer.json there")
        target_vocab = Tokenizer.from_file(str(path))
    if isinstance(target_vocab, Tokenizer):
        target_vocab = target_vocab.get_vocab(with_added_tokens=True)
    if isinstance(target_vocab, dict):
        tokens: list[str | None] = [None] * (max(target_vocab.values(), default=-1) + 1)
        for text, i in target_vocab.items():
            tokens[i] = text
        return tokens
    return list(target_vocab)


@torch.no_grad()
def load_word2vec_embeddings(bundle, target_vocab) -> tuple[Tensor, Tensor]:
    """Word vectors of a word2vec bundle for another model's vocabulary.

    ``bundle``: a bundle folder or MLflow URI; ``target_vocab``: a tokenizer folder or
    tokenizer.json path, a ``tokenizers.Tokenizer``, a dict token -> id, or a list of
    tokens in id order. Returns (vectors [N, D], found [N] bool): row i is the vector of
    target token i if the word2vec vocabulary has that token; otherwise, when the word2vec
    tokenizer splits the token's text (markers like ``##`` removed) into known ordinary
    pieces, their mean; otherwise zeros with found False (the caller initialises those).
    Special tokens are never matched.
    """
    from tokenizers import Tokenizer

    from pipeline.models.bundle import load_bundle
    from pipeline.neighbors import resolve_bundle, special_ids

    folder = resolve_bundle(bundle)
    model, config = load_bundle(folder)
    if config["arch"] != "word2vec":
        raise ValueError(f"{bundle}: a {config['arch']!r} bundle, not a word2vec one")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    specials = special_ids(folder)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    source = model.vectors.detach().float()
    tokens = _target_tokens(target_vocab)
    out = torch.zeros(len(tokens), source.shape[1])
    found = torch.zeros(len(tokens), dtype=torch.bool)
    for i, text in enumerate(tokens):
        if not text:
            continue
        j = vocab.get(text)
        if j is not None:
            if j not in specials:
                out[i], found[i] = source[j], True
            continue
        surface = text
        for marker in _PIECE_MARKERS:
            surface = surface.removeprefix(marker)
        pieces = tokenizer.encode(surface, add_special_tokens=False).ids if surface else []
        if pieces and not any(p in specials for p in pieces):
            out[i], found[i] = source[pieces].mean(0), True
    return out, found


@torch.no_grad()
def init_embedding_from_word2vec(
    embedding: nn.Embedding, bundle, target_vocab, freeze: bool = False
) -> int:
    """Copy word2vec vectors into a downstream model's embedding table (rows of tokens
    word2vec knows; the others keep their initialisation). ``freeze``: the table is not
    trained (requires_grad False); else it is fine-tuned. Returns the rows copied."""
    vectors, found = load_word2vec_embeddings(bundle, target_vocab)
    n, dim = embedding.weight.shape
    if vectors.shape[1] != dim:
        raise ValueError(
            f"word2vec vectors have {vectors.shape[1]} dimensions, the embedding {dim}: "
            "pick a word2vec preset with embedding_dim equal to the model's hidden size"
        )
    rows = found[:n].nonzero().squeeze(1)
    embedding.weight[rows] = vectors[rows].to(embedding.weight)
    embedding.weight.requires_grad_(not freeze)
    return int(rows.numel())
