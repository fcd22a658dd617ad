"""Export adapter: our ``gpt`` bundle -> transformers ``OpenAIGPTLMHeadModel``.

The layer maths agree: post-LN blocks (``n = ln_1(x + attn(x)); h = ln_2(n + mlp(n))``),
no final LayerNorm, LM head tied to ``tokens_embed``. HF's OpenAI GPT hard-wires two
things our config leaves free, so those must have the paper's values to export:
the FFN width is 4 * hidden_size, and its "gelu" is the tanh approximation.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def gpt_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """Our state dict -> OpenAIGPTLMHeadModel's names (padded vocabulary rows dropped)."""
    out = {
        "transformer.tokens_embed.weight": sd["wte.weight"][: cfg.vocab_size],
        "transformer.positions_embed.weight": sd["wpe.weight"],
    }
    # HF uses Conv1D: weight stored [in, out], the transpose of nn.Linear's.
    pairs = {
        "attn.c_attn": "attn.qkv",
        "attn.c_proj": "attn.proj",
        "mlp.c_fc": "mlp.fc",
        "mlp.c_proj": "mlp.proj",
    }
    for i in range(cfg.num_layers):
        ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
        for p in ("weight", "bias"):
            out[f"{hf}ln_1.{p}"] = sd[f"{ours}ln_1.{p}"]
            out[f"{hf}ln_2.{p}"] = sd[f"{ours}ln_2.{p}"]
        for hf_name, our_name in pairs.items():
            out[f"{hf}{hf_name}.weight"] = sd[f"{ours}{our_name}.weight"].t().contiguous()
            out[f"{hf}{hf_name}.bias"] = sd[f"{ours}{our_name}.bias"]
    return out


def hf_gpt_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised `OpenAIGPTLMHeadModel` with the shape of our GPTConfig."""
    import transformers

    if cfg.intermediate_size != 4 * cfg.hidden_size:
        raise ValueError(
            f"model.intermediate_size={cfg.intermediate_size}: transformers' OpenAI GPT fixes "
            f"it at 4 * hidden_size = {4 * cfg.hidden_size}; this bundle cannot be exported"
        )
    if cfg.activation != "gelu_tanh":
        raise ValueError(
            f"model.activation={cfg.activation!r}: transformers' OpenAI GPT 'gelu' is the tanh "
            "approximation (gelu_tanh); this bundle cannot be exported"
        )
    hf_cfg = transformers.OpenAIGPTConfig(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_positions,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        afn="gelu",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout,
        layer_norm_epsilon=cfg.layer_norm_eps,
        initializer_range=cfg.init_std,
        bos_token_id=roles.get("bos"),
        eos_token_id=roles.get("eos"),
        pad_token_id=roles.get("pad"),
    )
    return transformers.OpenAIGPTLMHeadModel(hf_cfg)
