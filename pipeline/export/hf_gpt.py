"""Export adapter: our ``gpt`` bundle -> transformers ``OpenAIGPTLMHeadModel``.

The layer maths agree: post-LN blocks (``n = ln_1(x + attn(x)); h = ln_2(n + mlp(n))``),
no final LayerNorm, LM head tied to ``tokens_embed``. HF's OpenAI GPT hard-wires two
things our config leaves free, so those must have the paper's values to export:
the FFN width is 4 * hidden_size, and its "gelu" is the tanh approximation.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_common import ExportError, decoder_config_fields, decoder_layer_state


def gpt_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """Our state dict -> OpenAIGPTLMHeadModel's names (padded vocabulary rows dropped)."""
    out = {
        "transformer.tokens_embed.weight": sd["wte.weight"][: cfg.vocab_size],
        "transformer.positions_embed.weight": sd["wpe.weight"],
    }
    for i in range(cfg.num_layers):
        out.update(decoder_layer_state(sd, f"blocks.{i}.", f"transformer.h.{i}."))
    return out


def hf_gpt_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised `OpenAIGPTLMHeadModel` with the shape of our GPTConfig."""
    import transformers

    if cfg.intermediate_size != 4 * cfg.hidden_size:
        raise ExportError(
            f"model.intermediate_size={cfg.intermediate_size}: transformers' OpenAI GPT fixes "
            f"it at 4 * hidden_size = {4 * cfg.hidden_size}; this bundle cannot be exported"
        )
    if cfg.activation != "gelu_tanh":
        raise ExportError(
            f"model.activation={cfg.activation!r}: transformers' OpenAI GPT 'gelu' is the tanh "
            "approximation (gelu_tanh); this bundle cannot be exported"
        )
    hf_cfg = transformers.OpenAIGPTConfig(**decoder_config_fields(cfg, roles), afn="gelu")
    return transformers.OpenAIGPTLMHeadModel(hf_cfg)
