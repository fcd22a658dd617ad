"""Export adapter: our ``bert`` bundle -> transformers ``BertForPreTraining``, or
``BertForMaskedLM`` for a model without the pooler and NSP head (``pair_head: false``,
an MLM-only objective). ERNIE's adapter, hf_ernie.py, reuses its state mapping under the
``ernie.`` prefix."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_common import embeddings_state, encoder_config_fields, encoder_layer_state


def bert_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """Our state dict -> BertForPreTraining's names (padded vocabulary rows dropped);
    without the pair head, BertForMaskedLM's (the same names less pooler and NSP)."""
    V = cfg.vocab_size
    out = {
        **embeddings_state(sd, "bert.", V),
        "cls.predictions.transform.dense.weight": sd["mlm_head.dense.weight"],
        "cls.predictions.transform.dense.bias": sd["mlm_head.dense.bias"],
        "cls.predictions.transform.LayerNorm.weight": sd["mlm_head.ln.weight"],
        "cls.predictions.transform.LayerNorm.bias": sd["mlm_head.ln.bias"],
        "cls.predictions.bias": sd["mlm_head.bias"][:V],
    }
    if cfg.pair_head:
        out["bert.pooler.dense.weight"] = sd["pooler.weight"]
        out["bert.pooler.dense.bias"] = sd["pooler.bias"]
        out["cls.seq_relationship.weight"] = sd["nsp_head.weight"]
        out["cls.seq_relationship.bias"] = sd["nsp_head.bias"]
    for i in range(cfg.num_layers):
        out.update(encoder_layer_state(sd, f"blocks.{i}.", f"bert.encoder.layer.{i}."))
    return out


def hf_bert_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised `BertForPreTraining` (`BertForMaskedLM` without the pair
    head) with the shape of our BertConfig."""
    import transformers

    hf_cfg = transformers.BertConfig(**encoder_config_fields(cfg, roles))
    if not cfg.pair_head:
        return transformers.BertForMaskedLM(hf_cfg)
    return transformers.BertForPreTraining(hf_cfg)
