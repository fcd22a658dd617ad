"""`plm demo`, the README's first command, run as a user runs it."""

from __future__ import annotations

import json

import pytest
from conftest import plm

# Pretrained must beat random init by at least this much mean test accuracy (measured: see
# README section 6, "The demo's fine-tuning step").
DEMO_MARGIN = 0.10
# The demo takes about 3 min on an idle 2-core machine; a busy machine may take many times
# that, so the limit is 10x (the suite's default per-test limit, 600 s, is too tight).
DEMO_LIMIT_S = 1800


@pytest.mark.slow
@pytest.mark.timeout(DEMO_LIMIT_S + 60)
def test_plm_demo_pretrained_beats_random_init_on_the_topic_task(tmp_path, monkeypatch):
    """The README's first command, end to end: `plm demo` trains the tokenizer, writes the
    shards with a Ray job, pretrains the tiny BERT under DeepSpeed, registers it in MLflow,
    then fine-tunes it on the topic task next to the same architecture from random
    initialisation, over three fine-tuning seeds (fixed seeds throughout). Pretraining has
    to pay off: a clear margin in mean test accuracy, and ahead on every seed. Every MLflow
    run of the demo is in one experiment, tagged for the UI's model-training view."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # as a user runs it: the demo picks
    env = {"MLFLOW_TRACKING_URI": uri}
    proc = plm(
        "demo", "--workdir", str(tmp_path / "demo"), cwd=tmp_path, env=env, timeout=DEMO_LIMIT_S
    )
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    start, end = summary["pretraining"]["mlm_loss"]
    assert end < start - 2.0, summary  # MLM learned far past the unigram plateau
    acc = summary["topic_test_accuracy"]
    mean = {init: sum(a) / len(a) for init, a in acc.items()}
    assert mean["pretrained"] >= mean["random"] + DEMO_MARGIN, (acc, proc.stdout[-2000:])
    assert all(p > r for p, r in zip(acc["pretrained"], acc["random"], strict=True)), acc
    assert summary["verdict"].startswith("pretraining helped"), summary
    assert "models:/bert-tiny-demo-topic@current" in proc.stdout
    assert "[demo] pretraining helped" in proc.stdout
    assert "step 1000:" in proc.stdout  # progress while it pretrains
    assert "fine-tuning 6/6" in proc.stdout

    client = MlflowClient(uri)
    experiments = client.search_experiments()
    assert [e.name for e in experiments if e.name != "Default"] == ["bert-tiny-demo"]
    experiment = experiments[[e.name for e in experiments].index("bert-tiny-demo")]
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(
        ["pretrain-mlm-seed1234"]
        + [f"finetune-topic-{i}-seed{s}" for i in ("pretrained", "random") for s in (0, 1, 2)]
    )
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {m.name for m in client.search_registered_models()} == {
        "bert-tiny-demo",
        "bert-tiny-demo-topic",
    }
    assert f"#/experiments/{experiment.experiment_id}?workflowType=machine_learning" in proc.stdout
