"""`plm neighbors MODEL WORD`: the nearest words of a word by cosine similarity.

MODEL is a bundle folder or an MLflow URI (``runs:/RUN_ID/model``,
``models:/NAME@ALIAS``, ``models:/NAME/VERSION``; the tracking URI is
MLFLOW_TRACKING_URI or the local store ``sqlite:///mlflow.db`` in the working directory,
as for training). Vectors:

* word2vec: the word vectors (``input_embeddings``); tokens training never saw
  (count 0) are left out of the candidates;
* ELMo: layer 0, the context-independent char-CNN token vectors (ELMo's contextual
  layers have no per-word vector: run the model on a sentence for those).

A WORD the tokenizer splits into several tokens gets the mean of their vectors (and its
own tokens are left out of the answer). Special tokens are never candidates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def resolve_bundle(model: str | Path) -> Path:
    """A local bundle folder for a folder or an MLflow URI (downloaded to a temp dir);
    FileNotFoundError (``BundleNotFound``) naming it otherwise."""
    from pipeline.models.bundle import fetch_bundle

    return fetch_bundle(model)


@torch.no_grad()
def static_vectors(model: nn.Module, arch: str) -> tuple[Tensor, Tensor]:
    """([vocab_size, D] one vector per token, [vocab_size] bool: usable as a candidate)."""
    V = model.config.vocab_size
    if arch == "word2vec":
        counts = model.counts[:V]
        seen = counts > 0 if bool(counts.sum() > 0) else torch.ones(V, dtype=torch.bool)
        return model.vectors.detach().float(), seen
    if arch == "elmo":
        ids = torch.arange(V)
        vecs = torch.cat([model.encoder(model.char_ids[c]) for c in ids.split(4096)])
        return vecs.float(), torch.ones(V, dtype=torch.bool)
    raise ValueError(f"plm neighbors works on word2vec and elmo bundles, not {arch!r}")


def word_ids(tokenizer, word: str) -> list[int]:
    """The token ids of WORD: the vocabulary entry itself if there is one, else its pieces."""
    direct = tokenizer.token_to_id(word)
    if direct is not None:
        return [direct]
    return tokenizer.encode(word, add_special_tokens=False).ids


def nearest(
    vectors: Tensor, candidates: Tensor, query: Tensor, k: int, exclude: set[int]
) -> list[tuple[int, float]]:
    """The k candidate ids most cosine-similar to ``query``, best first."""
    sims = F.cosine_similarity(vectors, query[None, :], dim=-1)
    allowed = candidates.clone()
    allowed[sorted(i for i in exclude if 0 <= i < allowed.shape[0])] = False
    sims = torch.where(allowed, sims, torch.full_like(sims, -float("inf")))
    k = min(k, int(allowed.sum()))
    top = sims.topk(k)
    return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


def neighbors(model_ref: str | Path, word: str, k: int = 10) -> list[tuple[str, float]]:
    """[(token, cosine)] of the k nearest tokens of ``word``."""
    from tokenizers import Tokenizer

    from pipeline.models.bundle import load_bundle, own_file, special_ids

    bundle = resolve_bundle(model_ref)
    model, config = load_bundle(bundle)
    tokenizer = Tokenizer.from_file(str(own_file(bundle, "tokenizer.json")))
    vectors, candidates = static_vectors(model, config["arch"])
    specials = special_ids(bundle)
    ids = [i for i in word_ids(tokenizer, word) if i not in specials]
    if not ids:
        raise ValueError(f"{word!r} has no ordinary token in the vocabulary of {bundle}")
    query = vectors[ids].mean(0)
    found = nearest(vectors, candidates, query, k, specials | set(ids))
    return [(tokenizer.id_to_token(i), score) for i, score in found]


def neighbors_from_cli(args: argparse.Namespace) -> int:
    if args.k < 1:
        print(f"plm neighbors: --k must be >= 1, got {args.k}", file=sys.stderr)
        return 2
    try:
        found = neighbors(args.model, args.word, args.k)
    except (FileNotFoundError, ValueError) as err:
        print(f"plm neighbors: {err}", file=sys.stderr)
        return 2
    for rank, (token, score) in enumerate(found, 1):
        print(f"{rank:3d}  {score:+.4f}  {token}")
    return 0
