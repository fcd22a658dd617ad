"""Throughput and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch

# Dense peak FLOP/s per device by dtype (vendor datasheets, no sparsity). Only devices we
# can name reliably; elsewhere we report achieved FLOP/s instead of MFU.
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}


def device_peak_flops(precision: str) -> float | None:
    """Peak FLOP/s of the current CUDA device for ``precision``, None if unknown (e.g. CPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, table in PEAK_FLOPS.items():
        if key in name:
            return table.get(precision)
    return None


def throughput(
    *,
    tokens: int,
    samples: int,
    seconds: float,
    flops_per_token: float,
    world_size: int,
    peak_flops: float | None,
) -> dict[str, float]:
    """tokens/s, samples/s, achieved FLOP/s per device and MFU (when the peak is known)."""
    seconds = max(seconds, 1e-9)
    out = {
        "tokens_per_s": tokens / seconds,
        "samples_per_s": samples / seconds,
        "flops_per_s_per_device": tokens * flops_per_token / seconds / world_size,
    }
    if peak_flops:
        out["mfu"] = out["flops_per_s_per_device"] / peak_flops
    return out
