"""Which keys of a loader batch a model's forward takes, and the batch cut down to them."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def forward_keys(model: torch.nn.Module) -> frozenset[str]:
    """The batch keys this model's forward takes: the standard inputs plus any other
    parameter it names (ELECTRA takes the MLM labels, XLNet its permutation masks)."""
    from pipeline.objectives import MODEL_INPUT_KEYS

    names = set(inspect.signature(model.forward).parameters)
    return frozenset(names) | frozenset(k for k in MODEL_INPUT_KEYS if k in names)


def model_inputs(batch: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    """The entries of ``batch`` the forward takes (``keys``: ``forward_keys``)."""
    return {k: v for k, v in batch.items() if k in keys}
