"""`plm generate`: continue a prompt with a trained causal LM (gpt, gpt2, transformer-xl).

    plm generate runs/gpt2-tiny/bundles/final --prompt "The cat" --max-new-tokens 40
    plm generate models:/gpt2-tiny@current --prompt "The cat" --temperature 0.8 --top-k 20
    plm generate runs:/<RUN_ID>/model --prompt "The cat" --temperature 0   # greedy

The model comes from a bundle folder or an MLflow URI (downloaded with
``mlflow.artifacts.download_artifacts``; the tracking URI is ``--tracking-uri``, else
``MLFLOW_TRACKING_URI``, else the local store the training wrote, ./mlflow.db).

Decoding never recomputes the past:
* gpt / gpt2 keep a **KV cache**: each layer's keys and values of every position seen
  so far. A step feeds only the new token(s); their queries attend over the cache.
  ``kv_forward`` runs the model's own blocks (same weights, same maths) that way.
* transformer-xl already works like that: its memory (``mems``) holds each layer's
  input states, so a step feeds the new token with the memory of everything before it
  (up to ``eval_mem_len`` positions, the model's own context limit).

The context starts with the end-of-document token (what precedes every document in
training), then the prompt. Sampling: ``temperature`` 0 is greedy; otherwise the logits
are divided by it and cut to the ``top_k`` most likely tokens and/or the smallest set
whose probability reaches ``top_p`` (nucleus) before drawing, from a torch.Generator
seeded with ``seed``: the same seed gives the same text. Generation stops after
``max_new_tokens`` or at the end-of-document token.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.errors import ConfigError

GENERATIVE = ("gpt", "gpt2", "transformer-xl")  # the archs decoding works for

# ----------------------------------------------------------------------------- loading


def resolve_bundle(model: str, tracking_uri: str | None = None, dst: str | Path | None = None):
    """A local bundle folder for ``model`` (a folder, or an MLflow URI downloaded to dst)."""
    from pipeline.models.bundle import BundleNotFound, fetch_bundle

    try:
        return fetch_bundle(model, tracking_uri, dst)
    except BundleNotFound as err:
        raise ConfigError(f"MODEL: {err}; --tracking-uri sets the MLflow store") from None


# ----------------------------------------------------------------------------- decoders


@dataclass
class KVCache:
    """Per layer, the keys and values [B, heads, P, head_dim] of the P positions so far."""

    keys: list[Tensor | None]
    values: list[Tensor | None]
    length: int = 0

    @classmethod
    def empty(cls, n_layers: int) -> KVCache:
        return cls([None] * n_layers, [None] * n_layers)


def _cached_attention(attn: nn.Module, x: Tensor, cache: KVCache, i: int) -> Tensor:
    """blocks.SelfAttention for T new positions after cache.length cached ones."""
    B, T, C = x.shape
    n = attn.num_heads
    q, k, v = attn.qkv(x).view(B, T, 3, n, C // n).permute(2, 0, 3, 1, 4)
    if cache.keys[i] is not None:
        k = torch.cat([cache.keys[i], k], dim=2)
        v = torch.cat([cache.values[i], v], dim=2)
    cache.keys[i], cache.values[i] = k, v
    P = cache.length
    # new query t sits at position P + t and sees every key up to it
    visible = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(diagonal=P)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    return attn.proj(y.transpose(1, 2).reshape(B, T, C))


def _cached_block(block: nn.Module, x: Tensor, cache: KVCache, i: int) -> Tensor:
    """blocks.Block (pre-LN or post-LN) in eval mode, attention through the cache."""
    if block.pre_ln:
        x = x + _cached_attention(block.attn, block.ln_1(x), cache, i)
        return x + block.mlp(block.ln_2(x))
    x = block.ln_1(x + _cached_attention(block.attn, x, cache, i))
    return block.ln_2(x + block.mlp(x))


@torch.no_grad()
def kv_forward(model: nn.Module, input_ids: Tensor, cache: KVCache) -> Tensor:
    """Logits [B,T,Vpad] of T new tokens placed after the cached ones (gpt, gpt2)."""
    T = input_ids.shape[1]
    positions = torch.arange(cache.length, cache.length + T, device=input_ids.device)[None]
    x = model.embed(input_ids, positions)
    for i, block in enumerate(model.blocks):
        x = _cached_block(block, x, cache, i)
    cache.length += T
    return model.head(x)["logits"]


class Decoder:
    """Feed tokens, get the next-token logits [B,Vpad]; three ways of keeping the past."""

    def __init__(self, model: nn.Module, use_cache: bool = True):
        self.model = model
        self.recurrent = "mems" in inspect.signature(model.forward).parameters
        self.use_cache = use_cache
        self.seen: Tensor | None = None  # every token so far (the uncached path re-reads it)
        self.cache = KVCache.empty(len(getattr(model, "blocks", []))) if use_cache else None
        self.mems = None

    @property
    def max_positions(self) -> int | None:
        return None if self.recurrent else self.model.config.max_positions

    @torch.no_grad()
    def feed(self, tokens: Tensor) -> Tensor:
        self.seen = tokens if self.seen is None else torch.cat([self.seen, tokens], dim=1)
        if not self.use_cache:
            return self.model(self.seen)["logits"][:, -1]  # recompute everything
        if self.recurrent:
            out = self.model(tokens, mems=self.mems)
            self.mems = out["mems"]
            return out["logits"][:, -1]
        return kv_forward(self.model, tokens, self.cache)[:, -1]


# ----------------------------------------------------------------------------- sampling


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set to -inf every logit outside the top_k largest (0: no cut) and outside the
    smallest set of tokens whose probability sums to top_p (1.0: no cut)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> Tensor:
    """[B,V] logits -> [B] token ids."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (without the end-of-document token)
    stopped_at_eod: bool


@torch.no_grad()
def generate(
    model: nn.Module,
    context: list[int],
    max_new_tokens: int,
    eod_id: int | None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    use_cache: bool = True,
) -> Generation:
    """Continue ``context`` (token ids) by at most ``max_new_tokens`` tokens."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 0:
        raise ValueError(
            "need temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 0 "
            f"(got {temperature}, {top_p}, {top_k}, {max_new_tokens})"
        )
    if not context:
        raise ValueError("empty context: give at least one token")
    model.eval()
    decoder = Decoder(model, use_cache)
    limit = decoder.max_positions
    if limit is not None and len(context) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({len(context)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_positions {limit}; shorten the prompt or lower --max-new-tokens"
        )
    V = model.config.vocab_size  # the padded rows can never be drawn
    generator = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    logits = decoder.feed(torch.tensor([context], device=dev))
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(next_token(logits[:, :V].cpu(), temperature, top_k, top_p, generator)[0])
        if token == eod_id:
            return Generation(out, True)
        out.append(token)
        logits = decoder.feed(torch.tensor([[token]], device=dev))
    return Generation(out, False)


# ----------------------------------------------------------------------------- CLI


def generate_text(
    model_uri: str,
    prompt: str,
    max_new_tokens: int = 50,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    tracking_uri: str | None = None,
    use_cache: bool = True,
) -> dict[str, Any]:
    """Load the model, continue the prompt; returns {"text", "prompt", "completion", ...}."""
    from tokenizers import Tokenizer

    from pipeline.models.bundle import load_bundle, own_file

    with tempfile.TemporaryDirectory(prefix="plm-generate-") as tmp:
        bundle = resolve_bundle(model_uri, tracking_uri, tmp)
        model, config = load_bundle(bundle)
        tokenizer = Tokenizer.from_file(str(own_file(bundle, "tokenizer.json")))
    if config["arch"] not in GENERATIVE:
        raise ConfigError(
            f"MODEL {model_uri!r} is a {config['arch']}, not a left-to-right language model; "
            f"plm generate needs one of {', '.join(GENERATIVE)}"
        )
    eod = config["vocab"].get("roles", {}).get("eod")
    prompt_ids = tokenizer.encode(prompt).ids
    context = ([eod] if eod is not None else []) + prompt_ids
    result = generate(
        model, context, max_new_tokens, eod, temperature, top_k, top_p, seed, use_cache
    )
    completion = tokenizer.decode(result.tokens)
    return {
        "arch": config["arch"],
        "pieces": [tokenizer.id_to_token(i) for i in result.tokens],
        "prompt_ids": prompt_ids,
        "tokens": result.tokens,
        "stopped_at_eod": result.stopped_at_eod,
        "completion": completion,
        "text": tokenizer.decode(prompt_ids + result.tokens),
    }


def generate_from_cli(args) -> int:
    try:
        out = generate_text(
            args.model,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            tracking_uri=args.tracking_uri,
            use_cache=not args.no_cache,
        )
    except ValueError as err:  # bad sampling settings / too long: say which flag
        if isinstance(err, ConfigError):
            raise
        print(f"plm generate: {err}", file=sys.stderr)
        return 2
    print(out["text"])
    note = nothing_visible(out)
    if note:  # the prompt alone (and blank lines) would leave a person guessing
        print(f"plm generate: {note}", file=sys.stderr)
    return 0


def nothing_visible(out: dict[str, Any]) -> str | None:
    """What was generated when it shows as nothing: no token (end-of-text at once), or
    tokens that decode to whitespace only (a tiny or undertrained model's favourite)."""
    if out["completion"].strip():
        return None
    eod = " then the end-of-text token" if out["stopped_at_eod"] else ""
    if not out["tokens"]:
        return "nothing generated: the first token drawn was the end-of-text token"
    pairs = list(zip(out["pieces"], out["tokens"], strict=True))[:8]
    shown = ", ".join(f"{p!r} (id {i})" for p, i in pairs)
    more = f" and {len(out['tokens']) - 8} more" if len(out["tokens"]) > 8 else ""
    return (
        f"generated {len(out['tokens'])} tokens that decode to whitespace only{eod}: "
        f"{shown}{more}; an undertrained model repeats its most frequent token (train it "
        "longer, or sample: --temperature 1)"
    )
