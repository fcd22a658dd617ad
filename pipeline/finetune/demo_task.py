"""The demo's labelled task, built from the same real text as the demo corpus.

"Which standard-library package does this documentation paragraph come from?"
(asyncio / email / logging / unittest). The paragraphs are those of the docstrings
``builtin:python-docs`` reads from these packages' sources (blank-line separated, at least
8 words, cut to 60 words), with the package's own name blanked out so the label is not a
word of the text. The split is a hash of the paragraph, so it never changes; each class
gets ``train_per_class`` training paragraphs (10 by default: a few labels, the setting
where pretraining on unlabelled text pays off; with 100 per class a tiny BERT from random
initialisation learns the package words from the labels alone and catches up) and up to
``eval_per_class`` valid and test paragraphs (75: enough that one test accuracy is not
mostly noise).

Pretraining read these paragraphs as unlabelled text; the labels are never seen there.
"""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from pathlib import Path

TOPICS = ("asyncio", "email", "logging", "unittest")


def topic_paragraphs(topic: str) -> list[str]:
    from pipeline.prepare.readers import _docs_of_source, _module_files

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, seen = [], set()
    for path in _module_files(stdlib, topic):
        for doc in _docs_of_source(path.read_bytes()):
            for para in re.split(r"\n\s*\n", doc):
                words = para.split()
                if len(words) < 8:
                    continue
                text = " ".join(words[:60])
                text = re.sub(rf"\b{topic}\b", "___", text, flags=re.IGNORECASE)
                if text not in seen:
                    seen.add(text)
                    out.append(text)
    return out


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big") % 100


def build_topic_task(
    out_dir: str | Path, train_per_class: int = 10, eval_per_class: int = 75
) -> dict[str, str]:
    """Write train/valid/test jsonl ({"text", "label"}) into out_dir; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict[str, str]]] = {"train": [], "valid": [], "test": []}
    for topic in TOPICS:
        paras = sorted(topic_paragraphs(topic), key=lambda t: (_bucket(t), t))
        parts = {
            "train": [p for p in paras if _bucket(p) < 50][:train_per_class],
            "valid": [p for p in paras if 50 <= _bucket(p) < 70][:eval_per_class],
            "test": [p for p in paras if _bucket(p) >= 70][:eval_per_class],
        }
        for split, texts in parts.items():
            splits[split].extend({"text": t, "label": topic} for t in texts)
    paths = {}
    for split, rows in splits.items():
        rows.sort(key=lambda r: hashlib.sha256(r["text"].encode()).hexdigest())  # mix classes
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths[split] = str(path)
    return paths


def topic_finetune_config(
    source: str,
    init: str,
    paths: dict[str, str],
    out_dir: str | Path,
    name: str,
    tracking_uri: str | None = None,
    register: bool = True,
    epochs: int = 20,
    seed: int = 0,
    experiment: str | None = None,
    run_name: str | None = None,
) -> dict:
    """The demo's fine-tuning recipe: mean pooling over the tokens (a tiny encoder's [CLS]
    vector is a poor summary after MLM-only pretraining), lr 1e-3 with 10% warmup then
    linear decay, ``epochs`` epochs without early stopping (40 training paragraphs make a
    noisy valid curve), the model of the best valid accuracy kept. The same for pretrained
    and random weights, so the two test accuracies compare the initialisations.
    ``experiment`` / ``run_name``: the MLflow experiment and run name (None: ``name`` and
    the run folder's name)."""
    return {
        "name": name,
        "model": {"source": source, "init": init},
        "task": {"type": "classification", "max_length": 64, "pooling": "mean"},
        "data": dict(paths),
        "train": {
            "epochs": epochs,
            "micro_batch_size": 16,
            "lr": 1.0e-3,
            "warmup_ratio": 0.1,
            "patience": 0,
            "seed": seed,
            "out_dir": str(out_dir),
        },
        "mlflow": {
            "tracking_uri": tracking_uri,
            "register": register,
            "experiment": experiment,
            "run_name": run_name,
        },
    }
