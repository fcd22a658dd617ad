"""ELECTRA -> transformers: the discriminator as ``ElectraForPreTraining`` in OUT (what
fine-tuning loads), the generator as ``ElectraForMaskedLM`` in OUT/generator/.

Both get a copy of the shared embeddings (transformers' models do not share them across
folders); each gets ``embeddings_project`` when the embedding width differs from its
hidden size, as transformers builds it from ``embedding_size != hidden_size``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from pipeline.export.hf_common import embeddings_state, encoder_config_fields, encoder_layer_state

GENERATOR_DIR = "generator"


def _encoder_state(sd: dict[str, Tensor], cfg: Any, net: str, n_layers: int) -> dict[str, Tensor]:
    """Shared embeddings + one network (``discriminator`` or ``generator``) under electra."""
    V = cfg.vocab_size
    out = embeddings_state(sd, "electra.", V)
    if f"{net}.project.weight" in sd:
        out["electra.embeddings_project.weight"] = sd[f"{net}.project.weight"]
        out["electra.embeddings_project.bias"] = sd[f"{net}.project.bias"]
    for i in range(n_layers):
        out.update(encoder_layer_state(sd, f"{net}.blocks.{i}.", f"electra.encoder.layer.{i}."))
    return out


def electra_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """The discriminator's weights as ElectraForPreTraining names."""
    out = _encoder_state(sd, cfg, "discriminator", cfg.num_layers)
    out["discriminator_predictions.dense.weight"] = sd["discriminator_head.dense.weight"]
    out["discriminator_predictions.dense.bias"] = sd["discriminator_head.dense.bias"]
    out["discriminator_predictions.dense_prediction.weight"] = sd["discriminator_head.out.weight"]
    out["discriminator_predictions.dense_prediction.bias"] = sd["discriminator_head.out.bias"]
    return out


def electra_generator_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    """The generator's weights as ElectraForMaskedLM names (the decoder weight is tied)."""
    gen = cfg.generator_config()
    out = _encoder_state(sd, cfg, "generator", gen.num_layers)
    out["generator_predictions.dense.weight"] = sd["generator_head.dense.weight"]
    out["generator_predictions.dense.bias"] = sd["generator_head.dense.bias"]
    out["generator_predictions.LayerNorm.weight"] = sd["generator_head.ln.weight"]
    out["generator_predictions.LayerNorm.bias"] = sd["generator_head.ln.bias"]
    out["generator_lm_head.bias"] = sd["generator_head.bias"][: cfg.vocab_size]
    return out


def _hf_config(cfg: Any, net: Any, roles: dict[str, int]):
    import transformers

    fields = encoder_config_fields(cfg, roles)
    fields.update(  # the network's own sizes (the generator is narrower)
        hidden_size=net.hidden_size,
        num_hidden_layers=net.num_layers,
        num_attention_heads=net.num_heads,
        intermediate_size=net.intermediate_size,
    )
    return transformers.ElectraConfig(**fields, embedding_size=cfg.embedding_size)


def hf_electra_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``ElectraForPreTraining`` shaped like our discriminator."""
    import transformers

    return transformers.ElectraForPreTraining(_hf_config(cfg, cfg, roles))


def hf_electra_generator_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``ElectraForMaskedLM`` shaped like our generator."""
    import transformers

    return transformers.ElectraForMaskedLM(_hf_config(cfg, cfg.generator_config(), roles))


def write_generator(sd: dict[str, Tensor], cfg: Any, roles: dict[str, int], out: Path, tokenizer):
    """OUT/generator/: the generator as ElectraForMaskedLM, with the same tokenizer files."""
    model = hf_electra_generator_model(cfg, roles)
    result = model.load_state_dict(electra_generator_to_hf_state(sd, cfg), strict=False)
    if result.missing_keys != ["generator_lm_head.weight"] or result.unexpected_keys:
        raise RuntimeError(
            f"export electra generator: missing {result.missing_keys}, unexpected "
            f"{result.unexpected_keys}; pipeline/export/hf_electra.py is out of date"
        )
    lm, emb = model.generator_lm_head.weight, model.electra.embeddings.word_embeddings.weight
    if lm.data_ptr() != emb.data_ptr():
        raise RuntimeError("exported ELECTRA generator's decoder is not tied to its embeddings")
    folder = out / GENERATOR_DIR
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    folder.chmod(0o755)
