"""`plm demo`, the README's first command, run as a user runs it."""

from __future__ import annotations

import json

import pytest
from conftest import plm

# Pretrained must beat random init by at least this much mean test accuracy (measured: see
# README section 6, "The demo's fine-tuning step").
DEMO_MARGIN = 0.10


# About 4.5 min on an idle 2-core machine; under load (a second training run on the same
# 2 cores) it passed 600 s at step 3,580 of 6,000. The limit is 5x the idle time, so a slow
# or shared machine is not a failure.
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_plm_demo_pretrained_beats_random_init_on_the_topic_task(tmp_path):
    """The README's first command, end to end: `plm demo` trains the tokenizer, writes the
    shards with a Ray job, pretrains the tiny BERT under DeepSpeed, registers it in MLflow,
    then fine-tunes it on the topic task next to the same architecture from random
    initialisation, over three fine-tuning seeds (fixed seeds throughout). Pretraining has
    to pay off: a clear margin in mean test accuracy, and ahead on every seed."""
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "OMP_NUM_THREADS": "2"}
    proc = plm("demo", "--workdir", str(tmp_path / "demo"), cwd=tmp_path, env=env, timeout=1450)
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    start, end = summary["pretraining"]["mlm_loss"]
    assert end < start - 2.0, summary  # MLM learned far past the unigram plateau
    acc = summary["topic_test_accuracy"]
    mean = {init: sum(a) / len(a) for init, a in acc.items()}
    assert mean["pretrained"] >= mean["random"] + DEMO_MARGIN, (acc, proc.stdout[-2000:])
    assert all(p > r for p, r in zip(acc["pretrained"], acc["random"], strict=True)), acc
    assert "models:/bert-tiny-demo-topic@current" in proc.stdout
