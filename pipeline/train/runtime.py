"""What a training process sets up for itself: its device, its seeds, its memory peak.
Shared by pretraining (trainer.py), fine-tuning and the benches."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def device() -> torch.device:
    """This rank's device: the GPU of its LOCAL_RANK, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators from one seed (the same weights on every
    rank when each builds the model after it)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_resident_gib() -> float:
    """This process's resident high-water mark, GiB (the page cache not counted)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
