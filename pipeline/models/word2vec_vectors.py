"""word2vec's vectors in other models: a downstream embedding table initialised from a
word2vec bundle (the model itself: pipeline/models/word2vec.py).

Above the bundle layer (it loads a bundle), so the architecture file imports no bundle
and no command.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from pipeline.models.bundle import fetch_bundle, load_bundle, special_ids

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

    folder = fetch_bundle(bundle)
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
