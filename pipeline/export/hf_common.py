"""What the BERT-family exports share: the activation names, the fields of every BERT-style
transformers config, and our embeddings and post-LN layers (fused qkv) under transformers'
parameter names. Each architecture's adapter (hf.py, hf_roberta.py, ...) adds its heads."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from pipeline.models.bundle import ShardedWriter

ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


class ExportError(ValueError):
    """A bundle that the transformers class cannot represent exactly (or no bundle at all);
    the message names the model key and why. ``plm export`` prints it as one line, exit 2."""


class Deferred:
    """A bundle tensor not read yet, with the view/copy steps the adapters apply to it
    (slice, ``t``, ``chunk``, ``view``, ``reshape``, ``contiguous``) recorded to run when it
    is ``materialize``d: the adapters map names over the whole model without reading it,
    and the export reads each tensor when its turn to be written comes."""

    __slots__ = ("_read", "_steps")

    def __init__(self, read: Callable[[], Tensor], steps: tuple = ()):
        self._read, self._steps = read, steps

    def _then(self, step: Callable[[Tensor], Tensor]) -> Deferred:
        return Deferred(self._read, (*self._steps, step))

    def __getitem__(self, index) -> Deferred:
        return self._then(lambda t: t[index])

    def t(self) -> Deferred:
        return self._then(lambda t: t.t())

    def contiguous(self) -> Deferred:
        return self._then(lambda t: t.contiguous())

    def view(self, *shape) -> Deferred:
        return self._then(lambda t: t.view(*shape))

    def reshape(self, *shape) -> Deferred:
        return self._then(lambda t: t.reshape(*shape))

    def chunk(self, n: int, dim: int = 0) -> tuple[Deferred, ...]:
        return tuple(self._then(lambda t, i=i: t.chunk(n, dim)[i]) for i in range(n))

    def materialize(self) -> Tensor:
        t = self._read()
        for step in self._steps:
            t = step(t)
        return t


def materialize(value: Tensor | Deferred) -> Tensor:
    return value.materialize() if isinstance(value, Deferred) else value


class LazyState(Mapping):
    """A bundle's state dict whose values are ``Deferred``: what the adapters are given
    (they index it like a dict of tensors)."""

    def __init__(self, tensors: Any):  # a pipeline.models.bundle.BundleTensors
        self._tensors = tensors

    def __getitem__(self, name: str) -> Deferred:
        if name not in self._tensors:
            raise KeyError(name)
        return Deferred(lambda: self._tensors.get(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors.names())

    def __len__(self) -> int:
        return len(self._tensors.names())


def encoder_config_fields(cfg: Any, roles: dict[str, int]) -> dict[str, Any]:
    """The keyword arguments BertConfig, RobertaConfig, ElectraConfig, ErnieConfig and
    AlbertConfig all take, from our TransformerConfig."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": ACTIVATIONS[cfg.activation],
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_positions,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": roles.get("pad", 0),
    }


def embeddings_state(sd: dict[str, Tensor], hf: str, vocab_size: int) -> dict[str, Tensor]:
    """Our ``embeddings.*`` (word, position, segment, LayerNorm) under ``{hf}embeddings.``;
    the padded vocabulary rows are dropped."""
    return {
        f"{hf}embeddings.word_embeddings.weight": sd["embeddings.word.weight"][:vocab_size],
        f"{hf}embeddings.position_embeddings.weight": sd["embeddings.position.weight"],
        f"{hf}embeddings.token_type_embeddings.weight": sd["embeddings.token_type.weight"],
        f"{hf}embeddings.LayerNorm.weight": sd["embeddings.ln.weight"],
        f"{hf}embeddings.LayerNorm.bias": sd["embeddings.ln.bias"],
    }


def split_qkv(sd: dict[str, Tensor], attn: str) -> list[tuple[str, Tensor, Tensor]]:
    """(name, weight, bias) of query, key and value from our fused ``{attn}qkv``, whose
    rows are [query; key; value]."""
    weights = sd[f"{attn}qkv.weight"].chunk(3, dim=0)
    biases = sd[f"{attn}qkv.bias"].chunk(3, dim=0)
    return [
        (name, w.contiguous(), b.contiguous())
        for name, w, b in zip(("query", "key", "value"), weights, biases, strict=True)
    ]


def encoder_layer_state(sd: dict[str, Tensor], ours: str, hf: str) -> dict[str, Tensor]:
    """One of our post-LN layers (``{ours}attn``, ``ln_1``, ``mlp``, ``ln_2``) as a
    BERT-style transformers layer under ``{hf}``."""
    out = {}
    for name, weight, bias in split_qkv(sd, f"{ours}attn."):
        out[f"{hf}attention.self.{name}.weight"] = weight
        out[f"{hf}attention.self.{name}.bias"] = bias
    pairs = {
        "attention.output.dense": "attn.proj",
        "attention.output.LayerNorm": "ln_1",
        "intermediate.dense": "mlp.fc",
        "output.dense": "mlp.proj",
        "output.LayerNorm": "ln_2",
    }
    for hf_name, our_name in pairs.items():
        for p in ("weight", "bias"):
            out[f"{hf}{hf_name}.{p}"] = sd[f"{ours}{our_name}.{p}"]
    return out


# --- the GPT family (transformers' Conv1D layers) -----------------------------------------


def decoder_config_fields(cfg: Any, roles: dict[str, int]) -> dict[str, Any]:
    """The keyword arguments GPT2Config and OpenAIGPTConfig both take."""
    return {
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_positions,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention_dropout,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "initializer_range": cfg.init_std,
        "bos_token_id": roles.get("bos"),
        "eos_token_id": roles.get("eos"),
        "pad_token_id": roles.get("pad"),
    }


def decoder_layer_state(sd: dict[str, Tensor], ours: str, hf: str) -> dict[str, Tensor]:
    """One of our decoder layers as transformers' GPT / GPT-2 layer ``{hf}``. Their
    Conv1D stores weights [in, out], the transpose of nn.Linear's."""
    out = {}
    for p in ("weight", "bias"):
        out[f"{hf}ln_1.{p}"] = sd[f"{ours}ln_1.{p}"]
        out[f"{hf}ln_2.{p}"] = sd[f"{ours}ln_2.{p}"]
    pairs = {
        "attn.c_attn": "attn.qkv",
        "attn.c_proj": "attn.proj",
        "mlp.c_fc": "mlp.fc",
        "mlp.c_proj": "mlp.proj",
    }
    for hf_name, our_name in pairs.items():
        out[f"{hf}{hf_name}.weight"] = sd[f"{ours}{our_name}.weight"].t().contiguous()
        out[f"{hf}{hf_name}.bias"] = sd[f"{ours}{our_name}.bias"]
    return out


# --- writing the transformers folder ------------------------------------------------------


def check_tied(model) -> None:
    """The output projection must be the input embedding matrix (the same parameter)."""
    if model.get_output_embeddings() is None:
        return  # no LM head (ElectraForPreTraining: a per-token classifier)
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if out is not inp:
        raise RuntimeError("exported model's output embeddings are not tied to the input ones")


def stored_tensors(model, hf_state: dict[str, Any], arch: str) -> dict[str, Tensor]:
    """The meta model's tensors as transformers stores them: each tensor once (a tied
    output weight is the input embedding's, saved under the embedding's name only, as
    ``save_pretrained`` does); checked against the adapter's names before anything is
    written."""
    check_tied(model)
    stored: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            stored[name] = t
    every = set(model.state_dict())
    missing = sorted(set(stored) - set(hf_state))
    unexpected = sorted(set(hf_state) - every)
    if missing or unexpected:
        raise RuntimeError(
            f"export {arch}: missing {missing}, unexpected {unexpected}; "
            "the adapter in pipeline/export/ is out of date with transformers"
        )
    return stored


def write_hf_folder(
    folder: Path, model, expected: dict[str, Tensor], hf_state: dict[str, Any], max_shard_bytes: int
) -> None:
    """config.json (+ generation_config.json for a model that generates) as
    ``save_pretrained`` writes them, and the weights, each tensor computed when it is
    written."""
    model.config.architectures = [type(model).__name__]
    model.config.dtype = "float32"
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    writer = ShardedWriter(folder, expected, max_shard_bytes)
    try:
        for name in writer.names:
            writer.add(name, materialize(hf_state[name]))
    finally:
        writer.close()
