"""The model's whole fp32 weights out of a DeepSpeed engine, one tensor at a time: what
bundles (pretraining's, fine-tuning's best weights) and the benches read."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist


def _replicated_masters(engine) -> dict[int, torch.Tensor]:
    """{id(16-bit param): its fp32 master} of DeepSpeed's ZeRO-0 mixed-precision optimizers
    (FP16_UnfusedOptimizer: ``fp32_groups`` lists; FP16_Optimizer: ``fp32_groups_flat``);
    empty for ZeRO 1-3 (their partitions are read with safe_get_full_fp32_param)."""
    opt = engine.optimizer
    lp_groups = getattr(opt, "fp16_groups", None)
    if engine.zero_optimization() or not lp_groups:
        return {}
    out: dict[int, torch.Tensor] = {}
    if getattr(opt, "fp32_groups", None):
        for lp_group, hp_group in zip(lp_groups, opt.fp32_groups, strict=True):
            out.update((id(lp), hp) for lp, hp in zip(lp_group, hp_group, strict=True))
    elif getattr(opt, "fp32_groups_flat", None):
        from torch._utils import _unflatten_dense_tensors

        for lp_group, flat in zip(lp_groups, opt.fp32_groups_flat, strict=True):
            hps = _unflatten_dense_tensors(flat, lp_group)
            out.update((id(lp), hp) for lp, hp in zip(lp_group, hps, strict=True))
    return out


def full_tensors(engine) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, whole tensor on rank 0 / None elsewhere) for every state-dict entry, in the
    module's state-dict order, one at a time. Collective under ZeRO 1-3 and bf16: every
    rank must consume it to the end.

    The fp32 *master* weights, never the 16-bit copies the forward pass uses: a bf16 run's
    bundle holds what the optimizer holds (DeepSpeed's 16-bit consolidation would round
    every weight to 8 bits of mantissa). Each parameter is assembled from the optimizer's
    partitions (``safe_get_full_fp32_param``, an all-gather per parameter), so a rank holds
    one whole parameter at a time, never the model; without a ZeRO or bf16 optimizer
    (ZeRO-0 fp32) the module's weights are the master. Buffers are whole on every rank.
    """
    from deepspeed.utils import safe_get_full_fp32_param

    rank0 = dist.get_rank() == 0
    replicated = _replicated_masters(engine)  # ZeRO-0 with bf16/fp16: every rank has it
    for name, t in engine.module.state_dict(keep_vars=True).items():  # same order everywhere
        value = t
        if isinstance(t, torch.nn.Parameter):
            hp = replicated.get(id(t))
            if hp is None:
                hp = safe_get_full_fp32_param(t)
            if hp is None and hasattr(t, "ds_id"):  # a ZeRO-3 parameter the optimizer lacks
                import deepspeed

                with deepspeed.zero.GatheredParameters([t]):
                    hp = t.detach().clone() if rank0 else None
            value = hp if hp is not None else t
        yield name, value.detach().to("cpu", torch.float32) if rank0 else None


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights on rank 0 (None elsewhere), as one dict: for models small enough
    to hold whole (fine-tuning's best weights); bundles stream ``full_tensors`` instead.
    Collective under ZeRO 1-3 and bf16."""
    sd = {name: t for name, t in full_tensors(engine) if t is not None}
    return sd if dist.get_rank() == 0 else None
