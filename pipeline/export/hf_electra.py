"""ELECTRA -> transformers: the discriminator as ``ElectraForPreTraining`` in OUT (what
fine-tuning loads), the generator as ``ElectraForMaskedLM`` in OUT/generator/.

Both get a copy of the shared embeddings (transformers' models do not share them across
folders); each gets ``embeddings_project`` when the embedding width differs from its
hidden size, as transformers builds it from ``embedding_size != hidden_size``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.export.hf_common import (
    embeddings_state,
    encoder_config_fields,
    encoder_layer_state,
    stored_tensors,
    write_hf_folder,
)

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


def write_generator(
    sd: Any, cfg: Any, roles: dict[str, int], out: Path, tokenizer, max_shard_bytes: int
) -> None:
    """OUT/generator/: the generator as ElectraForMaskedLM (its decoder tied to its
    embeddings), streamed like the main model, with the same tokenizer files."""
    with torch.device("meta"):
        model = hf_electra_generator_model(cfg, roles)
    hf_state = electra_generator_to_hf_state(sd, cfg)
    expected = stored_tensors(model, hf_state, "electra generator")
    folder = out / GENERATOR_DIR
    write_hf_folder(folder, model, expected, hf_state, max_shard_bytes)
    tokenizer.save_pretrained(folder)
    folder.chmod(0o755)
