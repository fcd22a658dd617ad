"""ERNIE -> transformers ``ErnieForPreTraining`` (``ErnieForMaskedLM`` without the pair
head: ``objective.ernie.nsp: false``): BERT's weights under the ``ernie.`` prefix
(ERNIE 1.0 has no task-type embedding, so ``use_task_id`` stays False)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.export.hf_bert import bert_to_hf_state
from pipeline.export.hf_common import encoder_config_fields


def ernie_to_hf_state(sd: dict[str, Tensor], cfg: Any) -> dict[str, Tensor]:
    return {
        (f"ernie.{k[len('bert.') :]}" if k.startswith("bert.") else k): v
        for k, v in bert_to_hf_state(sd, cfg).items()
    }


def hf_ernie_model(cfg: Any, roles: dict[str, int]):
    """A freshly initialised ``ErnieForPreTraining`` with the shape of our ErnieConfig."""
    import transformers

    hf_cfg = transformers.ErnieConfig(**encoder_config_fields(cfg, roles), use_task_id=False)
    if not cfg.pair_head:
        return transformers.ErnieForMaskedLM(hf_cfg)
    return transformers.ErnieForPreTraining(hf_cfg)
