"""One cell of the suite's table: a (model, task, seed) evaluated in this process.

A cell is a plain, picklable ``CellSpec`` (paths and a fine-tuning config as a dict), so
the same function runs in the driver (``--workers 0``) or in a Ray task on any host that
sees the paths. A fine-tuning cell is ``plm finetune`` itself without its MLflow run (the
suite's run holds the scores); a perplexity cell scores held-out text with the model.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# ELMo's and word2vec's ways are not perplexity by next-token prediction; Transformer-XL
# and XLNet score text their own ways (memory; permutations): not built yet.
CAUSAL_ARCHS = ("gpt", "gpt2")


@dataclass(frozen=True)
class CellSpec:
    candidate: int  # index into the resolved candidates
    task: str
    seed: int
    kind: str  # "finetune" | "perplexity"
    bundle: str
    init: str  # "pretrained" | "random"
    scratch: str  # this cell's own folder (removed when it is done)
    finetune: dict[str, Any] | None = None  # plm finetune's config, raw
    extra_evals: dict[str, str] = field(default_factory=dict)  # name -> file: more test sets
    text_file: str | None = None  # perplexity
    max_length: int = 128
    threads: int = 1


def run_cell(spec: CellSpec) -> dict[str, float]:
    """The cell's scores, {metric: value}."""
    from pipeline.train.ds_ops import configure_environment

    configure_environment()  # a Ray worker on another node has not had the CLI's
    torch.set_num_threads(spec.threads)
    try:
        if spec.kind == "perplexity":
            return perplexity(spec)
        return finetune_cell(spec)
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


def _model(spec: CellSpec):
    from pipeline.models.bundle import load_bundle

    model, config = load_bundle(spec.bundle)
    if spec.init == "random":
        from pipeline.models.registry import build_model

        torch.manual_seed(spec.seed)
        model = build_model(config["arch"], model.config)
    return model.eval(), config


def perplexity(spec: CellSpec) -> dict[str, float]:
    """exp(mean next-token loss) over the file's documents (one a line), each cut into
    windows of ``max_length`` tokens after a bos token; every token but the first of a
    document is predicted once."""
    from tokenizers import Tokenizer

    model, config = _model(spec)
    tokenizer = Tokenizer.from_file(str(Path(spec.bundle) / "tokenizer.json"))
    tokenizer.encode_special_tokens = False
    vocab = int(config["model"]["vocab_size"])
    bos = int(config["vocab"]["roles"]["bos"])
    lines = Path(spec.text_file or "").read_text(encoding="utf-8").splitlines()
    total, count = 0.0, 0
    with torch.no_grad():
        for line in lines:
            if not line.strip():
                continue
            ids = [bos, *tokenizer.encode(line, add_special_tokens=False).ids]
            for start in range(0, len(ids) - 1, spec.max_length - 1):
                window = torch.tensor([ids[start : start + spec.max_length]])
                if window.shape[1] < 2:
                    break
                logits = model(window)["logits"][0, :-1, :vocab].float()
                loss = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum")
                total += float(loss)
                count += window.shape[1] - 1
    mean = total / max(count, 1)
    return {"perplexity": math.exp(min(mean, 50.0)), "nll": mean, "tokens": float(count)}
