"""Throughput and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import re

import torch


def _peak(tensor: float, fp32: float, bf16: bool = True) -> dict[str, float]:
    """FLOP/s by precision from datasheet TFLOPS: the dense 16-bit tensor-core figure
    (fp16, and bf16 where the GPU has it) and the plain FP32 one."""
    figures = {"fp16": tensor * 1e12, "fp32": fp32 * 1e12}
    if bf16:
        figures["bf16"] = tensor * 1e12
    return figures


# Dense peak FLOP/s (no 2:4 sparsity) per GPU, by the name torch.cuda.get_device_name()
# reports. Ordered rules: the first pattern found in the name (re.search, ignoring case)
# wins, so a more specific name comes before a more general one. Datasheets often give
# only the sparse tensor figure (marked *): dense is half of it. Names no rule matches
# get None: MFU is then not reported, only the achieved FLOP/s.
PEAK_FLOPS: tuple[tuple[re.Pattern, dict[str, float]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), figures)
    for pattern, figures in (
        # A MIG slice ("... MIG 3g.40gb") has part of the GPU's SMs: no whole-GPU figure.
        (r"\bMIG\b", {}),
        # NVIDIA H100 Tensor Core GPU datasheet, H100 NVL: FP32 60, BF16/FP16 1,671*.
        (r"\bH100\b.*\bNVL\b", _peak(1671 / 2, 60)),
        # Same datasheet, H100 PCIe: FP32 51, BF16/FP16 1,513*.
        (r"\bH100\b.*\bPCIe\b", _peak(1513 / 2, 51)),
        # Same datasheet, H100 SXM ("NVIDIA H100 80GB HBM3"): FP32 67, BF16/FP16 1,979*.
        (r"\bH100\b.*\b(HBM3|SXM\w*)\b", _peak(1979 / 2, 67)),
        # NVIDIA H200 Tensor Core GPU datasheet, H200 NVL: FP32 60, BF16/FP16 1,671*.
        (r"\bH200\b.*\bNVL\b", _peak(1671 / 2, 60)),
        # Same datasheet, H200 SXM ("NVIDIA H200"): FP32 67, BF16/FP16 1,979*.
        (r"\bH200\b", _peak(1979 / 2, 67)),
        # NVIDIA GH200 Grace Hopper Superchip datasheet, its GPU: FP32 67, BF16/FP16 1,979*.
        (r"\bGH200\b", _peak(1979 / 2, 67)),
        # NVIDIA A100 Tensor Core GPU datasheet, alike for SXM4 and PCIe, 40 and 80 GB:
        # FP32 19.5, BF16/FP16 312 (624*).
        (r"\bA100\b", _peak(312, 19.5)),
        # NVIDIA A10G datasheet (published by AWS for EC2 G5, 2022): FP32 35, BF16/FP16 70
        # (against the A10's 31.2 and 125: not the same chip configuration).
        (r"\bA10G\b", _peak(70, 35)),
        # NVIDIA A10 Tensor Core GPU datasheet: FP32 31.2, BF16/FP16 125 (250*).
        (r"\bA10\b", _peak(125, 31.2)),
        # NVIDIA L40S datasheet: FP32 91.6, BF16/FP16 362.05 (733*).
        (r"\bL40S\b", _peak(362.05, 91.6)),
        # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, BF16/FP16 242*.
        (r"\bL4\b", _peak(242 / 2, 30.3)),
        # NVIDIA RTX 6000 Ada Generation datasheet: FP32 91.1, tensor 1,457 (FP8*); Ada
        # architecture whitepaper: BF16/FP16 with FP32 accumulate 364.2 (728.5*).
        (r"\bRTX 6000 Ada\b", _peak(364.2, 91.1)),
        # NVIDIA Tesla V100 datasheet: SXM2 FP32 15.7, tensor 125; PCIe FP32 14, tensor
        # 112. Tensor cores take FP16 only: no bf16 figure.
        (r"\bV100-SXM2\b", _peak(125, 15.7, bf16=False)),
        (r"\bV100-PCIE\b", _peak(112, 14, bf16=False)),
        # NVIDIA V100S datasheet (PCIe): FP32 16.4, tensor 130.
        (r"\bV100S-PCIE\b", _peak(130, 16.4, bf16=False)),
    )
)


def device_peak_flops(precision: str, name: str | None = None) -> float | None:
    """Dense peak FLOP/s for ``precision`` ("bf16", "fp16", "fp32") of the GPU called
    ``name`` (by default the current CUDA device's, ``torch.cuda.get_device_name()``);
    None when the device or the precision is unknown (e.g. on the CPU).

    bf16/fp16 are the tensor-core figures with FP32 accumulation (what torch's matmuls
    use). fp32 is the plain FP32 peak, not TF32: torch leaves TF32 matmuls off
    (``torch.backends.cuda.matmul.allow_tf32`` is False by default) and this project does
    not turn them on; with them on, fp32 MFU against this figure could exceed 1.
    """
    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    for pattern, figures in PEAK_FLOPS:
        if pattern.search(name):
            return figures.get(precision)
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
