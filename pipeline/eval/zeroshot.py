"""Zero-shot tasks of the causal models, scored by lm-evaluation-harness (PyPI ``lm-eval``)
through the model's `transformers` export, from local files:

- ``perplexity``: held-out text, one document a row (``loglikelihood_rolling``): word
  perplexity (the ranking metric), byte perplexity, bits per byte;
- ``last_word``: LAMBADA's task, the last word of each text after the rest
  (``loglikelihood``): accuracy (the greedy continuation is the word), perplexity;
- ``choice``: multiple choice by log-likelihood of each choice after the context
  (``multiple_choice``): accuracy, length-normalised accuracy.

For ``gpt`` and ``gpt2`` (their exports are left-to-right LMs in `transformers`). Not for
Transformer-XL (not in `transformers` 5) nor XLNet (its `transformers` model attends both
ways without a permutation mask, so a left-to-right score would be wrong).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ZERO_SHOT_ARCHS = ("gpt", "gpt2")
# kind -> (lm-eval's output type, our metric names in order: the first ranks)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "perplexity": ("loglikelihood_rolling", ("word_perplexity", "byte_perplexity", "bits_per_byte")),
    "last_word": ("loglikelihood", ("acc", "perplexity")),
    "choice": ("multiple_choice", ("acc", "acc_norm")),
}  # fmt: skip
LOWER_IS_BETTER = {"word_perplexity", "byte_perplexity", "bits_per_byte", "perplexity"}


def task_config(kind: str, name: str, data_file: str) -> dict[str, Any]:
    """lm-eval's task config for ``data_file`` (jsonl: ``text``; choice: ``context``,
    ``choices``, ``label``), read by the `datasets` json loader, nothing fetched."""
    output_type, metrics = KINDS[kind]
    cfg: dict[str, Any] = {
        "task": f"plm_{name}",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data_file}},
        "test_split": "test",
        "output_type": output_type,
    }
    if kind == "perplexity":
        cfg |= {"doc_to_text": "", "doc_to_target": "{{text}}",
                "metric_list": [{"metric": m} for m in metrics]}  # fmt: skip
    elif kind == "last_word":
        cfg |= {
            "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
            "doc_to_target": "{{' '+text.split(' ')[-1]}}",
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            ],
        }
    else:
        cfg |= {"doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{label}}", "target_delimiter": " ",
                "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}  # fmt: skip
    return cfg


def _hf_folder(bundle: str, init: str, seed: int, scratch: Path) -> Path:
    """The bundle's `transformers` export (random init: of fresh weights of its shape)."""
    from pipeline.export.hf import export_to_hf

    source = Path(bundle)
    if init == "random":
        import torch

        from pipeline.models.bundle import load_bundle, save_bundle
        from pipeline.models.registry import build_model

        model, config = load_bundle(source)
        torch.manual_seed(seed)
        fresh = build_model(config["arch"], model.config)
        source = save_bundle(scratch / "random", config["arch"], model.config,
                             fresh.state_dict(), source)  # fmt: skip
    # Scored text is plain text, as training read it: "[MASK]" in a document is 6 characters.
    return Path(export_to_hf(source, scratch / "hf", split_special_tokens=True))


def score(kind: str, name: str, data_file: str, bundle: str, init: str, seed: int,
          scratch: Path, max_length: int, batch_size: int = 8) -> dict[str, float]:  # fmt: skip
    """The task's metrics for one model, as lm-eval computes them."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    hf = _hf_folder(bundle, init, seed, scratch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = HFLM(pretrained=str(hf), tokenizer=str(hf), device=device, batch_size=batch_size,
              max_length=max_length)  # fmt: skip
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[task_config(kind, name, data_file)], log_samples=False,
        bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
    )  # fmt: skip
    results = out["results"][f"plm_{name}"]
    return {m: float(results[f"{m},none"]) for m in KINDS[kind][1]}
