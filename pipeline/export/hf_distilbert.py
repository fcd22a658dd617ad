"""DistilBERT -> transformers ``DistilBertForMaskedLM`` (logits = our mlm_logits[..., :V]).

transformers' DistilBERT hard-codes LayerNorm eps 1e-12 and has no segment embeddings,
like ours; a bundle with another eps is refused rather than exported subtly different.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_common import ACTIVATIONS, ExportError


def distilbert_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    V = cfg.vocab_size
    out = {
        "distilbert.embeddings.word_embeddings.weight": sd["embeddings.word.weight"][:V],
        "distilbert.embeddings.position_embeddings.weight": sd["embeddings.position.weight"],
        "distilbert.embeddings.LayerNorm.weight": sd["embeddings.ln.weight"],
        "distilbert.embeddings.LayerNorm.bias": sd["embeddings.ln.bias"],
        "vocab_transform.weight": sd["mlm_head.dense.weight"],
        "vocab_transform.bias": sd["mlm_head.dense.bias"],
        "vocab_layer_norm.weight": sd["mlm_head.ln.weight"],
        "vocab_layer_norm.bias": sd["mlm_head.ln.bias"],
        "vocab_projector.bias": sd["mlm_head.bias"][:V],
    }
    for i in range(cfg.num_layers):
        ours, hf = f"blocks.{i}.", f"distilbert.transformer.layer.{i}."
        weights = sd[f"{ours}attn.qkv.weight"].chunk(3, dim=0)  # rows [query; key; value]
        biases = sd[f"{ours}attn.qkv.bias"].chunk(3, dim=0)
        for j, part in enumerate(("q_lin", "k_lin", "v_lin")):
            out[f"{hf}attention.{part}.weight"] = weights[j].contiguous()
            out[f"{hf}attention.{part}.bias"] = biases[j].contiguous()
        pairs = {
            "attention.out_lin": "attn.proj",
            "sa_layer_norm": "ln_1",
            "ffn.lin1": "mlp.fc",
            "ffn.lin2": "mlp.proj",
            "output_layer_norm": "ln_2",
        }
        for hf_name, our_name in pairs.items():
            for p in ("weight", "bias"):
                out[f"{hf}{hf_name}.{p}"] = sd[f"{ours}{our_name}.{p}"]
    return out


def hf_distilbert_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``DistilBertForMaskedLM`` with the shape of our student."""
    import transformers

    if cfg.layer_norm_eps != 1e-12:
        raise ExportError(
            f"model.layer_norm_eps is {cfg.layer_norm_eps}; transformers' DistilBERT fixes it "
            "at 1e-12, so this bundle cannot be exported exactly"
        )
    hf_cfg = transformers.DistilBertConfig(
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_positions,
        n_layers=cfg.num_layers,
        n_heads=cfg.num_heads,
        dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation=ACTIVATIONS[cfg.activation],
        initializer_range=cfg.init_std,
        pad_token_id=roles.get("pad", 0),
    )
    return transformers.DistilBertForMaskedLM(hf_cfg)
