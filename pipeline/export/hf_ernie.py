"""ERNIE -> transformers ``ErnieForPreTraining``: BERT's weights under the ``ernie.`` prefix
(ERNIE 1.0 has no task-type embedding, so ``use_task_id`` stays False)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def ernie_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    from pipeline.export.hf import _bert_state  # here, not at the top: hf.py imports us

    return {
        (f"ernie.{k[len('bert.') :]}" if k.startswith("bert.") else k): v
        for k, v in _bert_state(sd, cfg).items()
    }


def hf_ernie_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``ErnieForPreTraining`` with the shape of our ErnieConfig."""
    import transformers

    hf_cfg = transformers.ErnieConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        hidden_act=_ACTIVATIONS[cfg.activation],
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_positions,
        type_vocab_size=cfg.type_vocab_size,
        initializer_range=cfg.init_std,
        layer_norm_eps=cfg.layer_norm_eps,
        use_task_id=False,
        pad_token_id=roles.get("pad", 0),
    )
    return transformers.ErnieForPreTraining(hf_cfg)
