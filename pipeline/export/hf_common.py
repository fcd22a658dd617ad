"""What the BERT-family exports share: the activation names, the fields of every BERT-style
transformers config, and our embeddings and post-LN layers (fused qkv) under transformers'
parameter names. Each architecture's adapter (hf.py, hf_roberta.py, ...) adds its heads."""

from __future__ import annotations

from typing import Any

from torch import Tensor

ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


class ExportError(ValueError):
    """A bundle that the transformers class cannot represent exactly (or no bundle at all);
    the message names the model key and why. ``plm export`` prints it as one line, exit 2."""


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
