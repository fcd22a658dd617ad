"""`plm predict MODEL --input FILE --output OUT`: batch inference with a fine-tuned model.

MODEL: a fine-tuned folder, ``models:/NAME@ALIAS`` / ``models:/NAME/VERSION`` or
``runs:/RUN_ID/model``. The output (jsonl or csv, by its extension) holds every input
row plus ``prediction`` (a label, a number, a choice index, a list of tags, or the answer
text) and, where there is one, its probability / scores.
"""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipeline.finetune.config import FinetuneError, TaskSection
from pipeline.finetune.data import Encoder, check_columns, read_rows
from pipeline.finetune.infer import row_predictions, run_model
from pipeline.finetune.source import load_finetuned, resolve_source
from pipeline.tracking_uri import check_access


class Predictor:
    """A fine-tuned model loaded once, predicting rows of its task's columns (`plm predict`,
    and the pyfunc model a fine-tuning run logs: pipeline/models/pyfunc.py)."""

    def __init__(self, model_dir: Path):
        from pipeline.prepare.tokenizer import load_tokenizer

        self.model, self.meta, backbone_dir = load_finetuned(model_dir)
        self.task = TaskSection.model_validate(self.meta["task"])
        tokenizer, tok_meta = load_tokenizer(backbone_dir)
        causal = bool(getattr(self.model.backbone, "causal", False))
        self.encoder = Encoder(
            tokenizer, tok_meta["roles"], causal, self.task, self.meta.get("arch")
        )

    def predict(self, rows: list[dict[str, Any]], where: str, batch_size: int = 64):
        check_columns(rows, self.task, where, labelled=False)
        examples = self.encoder.encode(rows, self.meta["labels"], where, labelled=False)
        raw = run_model(
            lambda b: self.model(b),
            examples,
            self.task,
            int(self.meta["pad_id"]),
            batch_size,
            torch.device("cpu"),
            decode_tags=self.model.decode_tags,
        )
        return row_predictions(raw, examples, rows, self.task, self.meta["labels"])


def predict_rows(model_dir: Path, rows: list[dict[str, Any]], where: str, batch_size: int = 64):
    return Predictor(model_dir).predict(rows, where, batch_size)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix.lower() == ".csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in rows:
                w.writerow(
                    {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in r.items()}
                )
    elif path.suffix.lower() in (".jsonl", ".json"):
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
    else:
        raise FinetuneError(f"--output {path}: use a .jsonl or .csv file name")
    tmp.replace(path)


def predict(
    model: str,
    input_path: str,
    output: str | None,
    batch_size: int = 64,
    tracking_uri: str | None = None,
) -> Path:
    out = Path(output) if output else Path(input_path).with_suffix(".predictions.jsonl")
    if out.suffix.lower() not in (".jsonl", ".json", ".csv"):
        raise FinetuneError(f"--output {out}: use a .jsonl or .csv file name")
    rows = read_rows(input_path)
    if model.startswith(("models:/", "runs:/")):  # a wrong password: one plm: line
        check_access(tracking_uri, stage="plm predict", write=False)
    with tempfile.TemporaryDirectory(prefix="plm-predict-") as tmp:
        source = resolve_source(model, tracking_uri, Path(tmp) / "model")
        preds = predict_rows(source.path, rows, input_path, batch_size)
    write_rows(out, [{**row, **p} for row, p in zip(rows, preds, strict=True)])
    return out
