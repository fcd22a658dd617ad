"""One cell of the suite's table: a (model, task, seed) evaluated in this process.

A cell is a plain, picklable ``CellSpec`` (paths and a fine-tuning config as a dict), so
the same function runs in the driver (``--workers 0``) or in a Ray task on any host that
sees the paths. A fine-tuning cell is ``plm finetune`` itself without its MLflow run (the
suite's run holds the scores); a zero-shot cell is lm-evaluation-harness on the model's
`transformers` export (pipeline/eval/zeroshot.py); an intrinsic cell scores the static
word vectors (pipeline/eval/intrinsic.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.eval.suite import INTRINSIC


@dataclass(frozen=True)
class CellSpec:
    candidate: int  # index into the resolved candidates
    task: str
    seed: int
    kind: str  # "finetune", a zero-shot kind (suite.ZERO_SHOT) or suite.INTRINSIC
    bundle: str
    init: str  # "pretrained" | "random"
    scratch: str  # this cell's own folder (removed when it is done)
    finetune: dict[str, Any] | None = None  # plm finetune's config, raw
    extra_evals: dict[str, str] = field(default_factory=dict)  # name -> file: more test sets
    text_file: str | None = None  # zero-shot, intrinsic: the rows scored (jsonl)
    max_length: int = 128
    threads: int = 1


def run_cell(spec: CellSpec) -> dict[str, float]:
    """The cell's scores, {metric: value}."""
    from pipeline.train.ds_ops import configure_environment

    configure_environment()  # a Ray worker on another node has not had the CLI's
    torch.set_num_threads(spec.threads)
    try:
        if spec.kind == "finetune":
            return finetune_cell(spec)
        if spec.kind in INTRINSIC:
            from pipeline.eval import intrinsic

            return intrinsic.score(spec.kind, spec.text_file or "", spec.bundle, spec.init,
                                   spec.seed)  # fmt: skip
        from pipeline.eval import zeroshot

        Path(spec.scratch).mkdir(parents=True, exist_ok=True)
        return zeroshot.score(spec.kind, spec.task, spec.text_file or "", spec.bundle,
                              spec.init, spec.seed, Path(spec.scratch), spec.max_length)  # fmt: skip
    finally:
        shutil.rmtree(spec.scratch, ignore_errors=True)


def finetune_cell(spec: CellSpec) -> dict[str, float]:
    from pipeline.finetune.config import validate_finetune
    from pipeline.finetune.loop import finetune

    cfg = validate_finetune(spec.finetune or {}, f"task {spec.task}")
    result = finetune(cfg, track=False)
    scores = dict(result.test or {})
    if len(spec.extra_evals) > 1 and result.model_dir is not None:
        # The first set is the fine-tune's test split; the others are scored by the same
        # saved model (as `plm predict` runs it), each under its own name.
        from pipeline.finetune.data import read_rows
        from pipeline.finetune.infer import score
        from pipeline.finetune.predict import Predictor

        names = list(spec.extra_evals)
        scores = {f"{names[0]}_{k}": v for k, v in scores.items()}
        predictor = Predictor(result.model_dir)
        for name in names[1:]:
            path = spec.extra_evals[name]
            rows = read_rows(path, cfg.data.format)
            preds = predictor.predict(rows, path, cfg.train.eval_batch_size)
            got = score(preds, rows, cfg.task, predictor.meta["labels"])
            scores |= {f"{name}_{k}": v for k, v in got.items()}
    return scores
