"""Counts of a loader batch, read on its CPU tensors (no device sync): real tokens,
positions, per-source tokens, and what a step's FLOPs depend on besides the token count.
Shared by the trainer's logged throughput and MFU and by the benches."""

from __future__ import annotations

from typing import Any

import torch


def n_tokens(batch: dict[str, Any]) -> int:
    """Real tokens of the batch (padding not counted)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def n_positions(batch: dict[str, Any]) -> int:
    """Positions of the batch, padding included (padding_fraction = 1 - tokens/positions)."""
    return int(batch["input_ids"].numel())


def work_stats(batch: dict[str, Any]) -> tuple[float, float]:
    """(sum over attention sequences of length^2, tokens the vocabulary decoder scores),
    from the loader's CPU batch: what the FLOPs of the step depend on besides the token
    count. A sequence is a row's real tokens, or one document with ``document_ids``."""
    if "document_ids" in batch:
        ids = batch["document_ids"]
        rows = torch.arange(ids.shape[0])[:, None].expand_as(ids)
        _, lengths = torch.unique_consecutive(
            torch.stack([rows.flatten(), ids.flatten()]), dim=1, return_counts=True
        )
    elif "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(1)
    else:
        lengths = torch.full((len(batch["input_ids"]),), batch["input_ids"].shape[1])
    squares = float((lengths.to(torch.float64) ** 2).sum())
    if "mlm_labels" in batch:  # encoders decode the labelled positions only
        return squares, float((batch["mlm_labels"] >= 0).sum())
    return squares, float(lengths.sum())


def tokens_by_source(batch: dict[str, Any], n_sources: int) -> list[float]:
    """Real tokens of the batch per mixture source (``source_ids``: each row's source)."""
    if n_sources == 1:
        return [float(n_tokens(batch))]
    rows = batch["source_ids"]
    if "attention_mask" in batch:
        per_row = batch["attention_mask"].sum(dim=1).to(torch.float64)
    else:
        per_row = torch.full(rows.shape, float(batch["input_ids"].shape[1]), dtype=torch.float64)
    return (
        torch.zeros(n_sources, dtype=torch.float64)
        .index_add_(0, rows.cpu(), per_row.cpu())
        .tolist()
    )


def flops_model(model, seq_len: int):
    """FLOPs per token as a function of (attended length, decoded share), read from the
    model's ``flops_per_token`` now, while its parameters are whole (ZeRO-3 partitions
    them). The formulas are affine in both around ``seq_len`` (Transformer-XL's memory
    term is not, but its rows are always full: it is evaluated at ``seq_len`` exactly)."""
    T = float(seq_len)
    full, none, half = (
        float(model.flops_per_token(T, 1.0)),
        float(model.flops_per_token(T, 0.0)),
        float(model.flops_per_token(T / 2, 1.0)),
    )
    per_key = (full - half) / (T / 2)

    def flops(attended: float, decoded: float) -> float:
        return none + decoded * (full - none) + (attended - T) * per_key

    return flops
