"""ALBERT -> transformers ``AlbertForPreTraining`` (prediction_logits, sop_logits), or
``AlbertForMaskedLM`` for a model without the pooler and SOP head (``pair_head: false``).

transformers' ALBERT shares *whole layers* in groups: ``share: all`` exports as one
group used by every layer, ``share: none`` as one group per layer. Sharing only the
attention or only the feed-forward sublayers has no transformers equivalent; exporting
such a model is a clear error.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_common import (
    ExportError,
    embeddings_state,
    encoder_config_fields,
    split_qkv,
)


def _groups(cfg: Any) -> int:
    if cfg.share == "all":
        return 1
    if cfg.share == "none":
        return cfg.num_layers
    raise ExportError(
        f"model.share={cfg.share!r}: transformers' ALBERT shares whole layers only; "
        "models with share 'all' or 'none' can be exported"
    )


def albert_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    V = cfg.vocab_size
    out = {
        **embeddings_state(sd, "albert.", V),
        "albert.encoder.embedding_hidden_mapping_in.weight": sd["project.weight"],
        "albert.encoder.embedding_hidden_mapping_in.bias": sd["project.bias"],
        "predictions.dense.weight": sd["mlm_head.dense.weight"],
        "predictions.dense.bias": sd["mlm_head.dense.bias"],
        "predictions.LayerNorm.weight": sd["mlm_head.ln.weight"],
        "predictions.LayerNorm.bias": sd["mlm_head.ln.bias"],
        "predictions.bias": sd["mlm_head.bias"][:V],
    }
    if cfg.pair_head:
        out["albert.pooler.weight"] = sd["pooler.weight"]
        out["albert.pooler.bias"] = sd["pooler.bias"]
        out["sop_classifier.classifier.weight"] = sd["sop_head.weight"]
        out["sop_classifier.classifier.bias"] = sd["sop_head.bias"]
    for g in range(_groups(cfg)):
        hf = f"albert.encoder.albert_layer_groups.{g}.albert_layers.0."
        attn, ffn = f"attention.{g}.", f"ffn.{g}."
        for name, w, b in split_qkv(sd, f"{attn}attn."):
            out[f"{hf}attention.{name}.weight"] = w
            out[f"{hf}attention.{name}.bias"] = b
        pairs = {
            "attention.dense": f"{attn}attn.proj",
            "attention.LayerNorm": f"{attn}ln",
            "ffn": f"{ffn}mlp.fc",
            "ffn_output": f"{ffn}mlp.proj",
            "full_layer_layer_norm": f"{ffn}ln",
        }
        for hf_name, our_name in pairs.items():
            for p in ("weight", "bias"):
                out[f"{hf}{hf_name}.{p}"] = sd[f"{our_name}.{p}"]
    return out


def hf_albert_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``AlbertForPreTraining`` (``AlbertForMaskedLM`` without the
    pair head) with the shape of our AlbertConfig."""
    import transformers

    hf_cfg = transformers.AlbertConfig(
        **encoder_config_fields(cfg, roles),
        embedding_size=cfg.embedding_size,
        num_hidden_groups=_groups(cfg),
        inner_group_num=1,
        bos_token_id=roles.get("cls"),
        eos_token_id=roles.get("sep"),
    )
    if not cfg.pair_head:
        return transformers.AlbertForMaskedLM(hf_cfg)
    return transformers.AlbertForPreTraining(hf_cfg)
