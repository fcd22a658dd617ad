"""A model bundle made from a training checkpoint, on the evaluation side.

Training writes a bundle beside every ``train.bundle_every``-th checkpoint only; the
others are turned into bundles here, so that judging a checkpoint costs the training ranks
nothing. The weights are streamed into ``BundleWriter`` one tensor at a time:

- ZeRO-0: the module's state dict in ``mp_rank_00_model_states.pt``, read through a memory
  map (a bf16 or fp16 run's 16-bit weights, the ones its forward pass used);
- ZeRO 1-3: the fp32 master weights from the optimizer's partitions, by DeepSpeed's
  ``zero_to_fp32`` in its lazy mode (the partition files memory-mapped, each parameter
  assembled only when it is written).

Every ``torch.load`` runs with ``weights_only=True`` (``checkpoint.weights_only_loads``):
a checkpoint's pickles run no code here either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from pipeline.config import validate_dict
from pipeline.eval.suite import EvalError

MODEL_STATES = "mp_rank_00_model_states.pt"


def checkpoint_meta(ckpt_dir: Path) -> dict[str, Any]:
    """COMPLETE's record (step, ZeRO stage, vocabulary size); EvalError when absent, or
    when the folder holds a link out of it (checked before anything of it is read)."""
    from pipeline.train.checkpoint import link_out_of

    found = link_out_of(ckpt_dir) if ckpt_dir.is_dir() else None
    if found is not None:
        raise EvalError(
            f"checkpoint {ckpt_dir}: {found[0]} is a link to {found[1]}, outside the "
            "checkpoint; refused, nothing read: evaluate checkpoints written by `plm train`"
        )
    path = ckpt_dir / "COMPLETE"
    if not path.is_file():
        raise EvalError(
            f"checkpoint {ckpt_dir} is incomplete or gone (no COMPLETE): give a complete one "
            "(its run's checkpoints/latest names the newest)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def _weights(ckpt_dir: Path, stage: int) -> dict[str, Any]:
    """name -> the checkpoint's weight, each read only when ``.contiguous()`` is called."""
    if stage == 0:
        path = ckpt_dir / MODEL_STATES
        states = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return states["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(
        str(ckpt_dir.parent), tag=ckpt_dir.name, lazy_mode=True
    )


def bundle_from_checkpoint(ckpt_dir: str | Path, out: str | Path, tokenizer_dir: Path) -> Path:
    """Write the bundle of checkpoint ``ckpt_dir`` to ``out`` (replaced if there)."""
    from pipeline.models.bundle import BundleWriter
    from pipeline.train.checkpoint import weights_only_loads
    from pipeline.train.plan import model_config_for

    ckpt_dir = Path(ckpt_dir)
    meta = checkpoint_meta(ckpt_dir)
    raw = yaml.safe_load((ckpt_dir / "config.yaml").read_text(encoding="utf-8"))
    cfg = validate_dict(raw, str(ckpt_dir / "config.yaml"))
    model_cfg = model_config_for(cfg, int(meta["vocab_size"]))
    extra = {"objective": cfg.objective.kind, "step": int(meta["step"]),
             "experiment": cfg.name, "from_checkpoint": str(ckpt_dir)}  # fmt: skip
    with (
        weights_only_loads(),
        BundleWriter(Path(out), cfg.model.arch, model_cfg, tokenizer_dir, extra) as writer,
    ):
        weights = _weights(ckpt_dir, int(meta.get("zero_stage", 0)))
        for name in writer.names:  # the bundle's order; tied weights stored once
            writer.add(name, weights[name].contiguous().to(torch.float32))
    return Path(out)
