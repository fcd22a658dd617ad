"""RoBERTa -> transformers ``RobertaForMaskedLM`` (logits equal ours[..., :vocab_size]).

Both number positions from ``pad_token_id + 1`` (our ``roberta_position_ids`` is
fairseq's make_positions, as in transformers), so the position table is copied as is
and the exported config carries our ``pad_token_id``. The tokenizer template is
RoBERTa's: ``<s> A </s>`` and ``<s> A </s></s> B </s>``, all segment ids 0.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_common import (
    ExportError,
    embeddings_state,
    encoder_config_fields,
    encoder_layer_state,
)


def roberta_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    V = cfg.vocab_size
    out = {
        **embeddings_state(sd, "roberta.", V),
        "lm_head.dense.weight": sd["mlm_head.dense.weight"],
        "lm_head.dense.bias": sd["mlm_head.dense.bias"],
        "lm_head.layer_norm.weight": sd["mlm_head.ln.weight"],
        "lm_head.layer_norm.bias": sd["mlm_head.ln.bias"],
        "lm_head.bias": sd["mlm_head.bias"][:V],
    }
    for i in range(cfg.num_layers):
        out.update(encoder_layer_state(sd, f"blocks.{i}.", f"roberta.encoder.layer.{i}."))
    return out


def hf_roberta_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``RobertaForMaskedLM`` with the shape of our RobertaConfig."""
    import transformers

    if cfg.activation != "gelu":
        raise ExportError(
            f"model.activation={cfg.activation!r}: transformers' RoBERTa LM head always uses "
            "exact GELU, so only activation 'gelu' exports faithfully"
        )
    hf_cfg = transformers.RobertaConfig(
        **encoder_config_fields(cfg, roles),
        bos_token_id=roles.get("cls"),
        eos_token_id=roles.get("sep"),
    )
    hf_cfg.pad_token_id = cfg.pad_token_id  # RoBERTa's positions count from it
    return transformers.RobertaForMaskedLM(hf_cfg)


def roberta_template(roles: dict[str, int], names: dict[str, str]):
    """``<s> A </s>`` / ``<s> A </s></s> B </s>`` (transformers' RobertaTokenizer)."""
    from tokenizers.processors import TemplateProcessing

    cls, sep = names["cls"], names["sep"]
    return TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} {sep} $B {sep}",
        special_tokens=[(cls, roles["cls"]), (sep, roles["sep"])],
    )
