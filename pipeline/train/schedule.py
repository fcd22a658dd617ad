"""Learning-rate schedules: a pure function of the step, wrapped in torch's LambdaLR.

DeepSpeed steps the scheduler once per optimizer step and saves/loads its state with
the engine checkpoint, so a resumed run continues the same curve.
"""

from __future__ import annotations

import math
from functools import partial

import torch


def lr_multiplier(
    step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float = 0.0
) -> float:
    """Factor applied to the peak lr after ``step`` optimizer steps.

    Linear warmup from 0 to 1 over ``warmup_steps``, then ``linear`` or ``cosine`` decay
    to ``min_lr_ratio`` at ``max_steps`` (``constant`` stays at 1).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r} (linear, cosine, constant)")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def scheduler_factory(train_cfg):
    """A callable optimizer -> LambdaLR, the form ``deepspeed.initialize`` accepts."""
    fn = partial(
        lr_multiplier,
        warmup_steps=train_cfg.warmup_steps,
        max_steps=train_cfg.max_steps,
        schedule=train_cfg.schedule,
        min_lr_ratio=train_cfg.min_lr_ratio,
    )

    def make(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

    return make
