"""What MLflow's UI shows of a run (issue 52, friction): a description on the experiment,
the run, the registered model and its version (architecture, objective, data, tokens), and
the FLOP/s in a unit its chart reads (TFLOP/s), while metrics.jsonl keeps what the code
reads. A real `plm train` on a real sqlite store; a user's own descriptions are kept."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, plm

from pipeline.train.tracking import NOTE_TAG, Tracker

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("described")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    run_dir = root / "run"
    plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        "train.max_steps=4", "train.log_every=2", "train.eval_every=0", "train.save_every=0",
        cwd=root, env={"MLFLOW_TRACKING_URI": uri})  # fmt: skip
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return uri, run_dir, rows


def test_the_experiment_run_model_and_version_say_what_the_run_is(trained, tiny_data):
    from mlflow import MlflowClient

    uri, run_dir, rows = trained
    client = MlflowClient(uri)
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    seen = [r["tokens_seen"] for r in rows if "tokens_seen" in r][-1]
    note = run.data.tags[NOTE_TAG]
    assert note == (
        f"Pretraining of bert (bert-tiny, layers 2, hidden 64) with mlm+nsp on {tiny_data}: "
        f"{seen:,} tokens seen in 4 steps; 1 rank, ZeRO 0. `plm train`, config bert-tiny."
    ), note
    experiment = client.get_experiment(run.info.experiment_id).tags[NOTE_TAG]
    assert "`plm train` (config bert-tiny)" in experiment and "the tokens" in experiment
    model = client.get_registered_model("bert-tiny")
    assert model.description.startswith("bert pretrained with mlm+nsp by `plm train`")
    version = client.get_model_version_by_alias("bert-tiny", "current")
    assert version.description == f"{note} Run {run.info.run_id}."


def test_mlflow_charts_tflop_per_s_and_metrics_jsonl_keeps_flop_per_s(trained):
    from mlflow import MlflowClient

    uri, run_dir, rows = trained
    client = MlflowClient(uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    metrics = client.get_run(run_id).data.metrics
    assert "flops_per_s_per_device" not in metrics  # an axis of 25000000000
    history = client.get_metric_history(run_id, "tflop_per_s_per_device")
    logged = {r["step"]: r["flops_per_s_per_device"] for r in rows if "flops_per_s_per_device" in r}
    assert sorted(m.step for m in history) == sorted(logged) == [2, 4]
    for m in history:
        assert m.value == pytest.approx(logged[m.step] / 1e12)


def test_a_users_descriptions_are_kept_and_an_outage_backfills_in_tflop_per_s(tmp_path):
    """Descriptions a user wrote (experiment, registered model) stay; the rows an outage
    held back reach MLflow in the same unit as the others."""
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("mine", tags={NOTE_TAG: "my experiment"})
    client.create_registered_model("m", description="my model")
    params = {"name": "m", "model": {"arch": "gpt"}, "objective": {"kind": "clm"},
              "data": {"path": "/d", "seq_len": 8}, "train": {"max_steps": 3}}  # fmt: skip
    tracker = Tracker(tmp_path / "run", enabled=True, retry_every_s=0.0)
    try:
        tracker.start(tracking_uri=uri, experiment="mine", run_name="r", params=params,
                      tags={"world_size": "1", "zero_stage": "0"}, resume=False)  # fmt: skip
        assert tracker.mlflow_ok, tracker.warnings
        tracker.mlflow_ok = False  # an outage: the next rows stay in metrics.jsonl
        tracker._next_try = float("inf")
        tracker.log_metrics({"flops_per_s_per_device": 3e12, "tokens_seen": 24}, 1)
        tracker._next_try = 0.0
        tracker.log_metrics({"flops_per_s_per_device": 5e12, "tokens_seen": 48}, 2)
        assert tracker.mlflow_ok and tracker.backfilled == 2, tracker.warnings
        assert tracker.register("model", "m", "current", {}) is not None
        tracker.end("FINISHED")
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
    run = client.get_run(tracker.run_id)
    history = client.get_metric_history(tracker.run_id, "tflop_per_s_per_device")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 5.0)]
    assert client.get_experiment_by_name("mine").tags[NOTE_TAG] == "my experiment"
    assert client.get_registered_model("m").description == "my model"
    assert run.data.tags[NOTE_TAG] == (
        "Pretraining of gpt with clm on /d: 48 tokens seen in 2 steps; 1 rank, ZeRO 0. "
        "`plm train`, config m."
    )


def test_a_finetuning_run_and_its_version_say_the_task_the_source_and_the_best_score(tmp_path):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = {"name": "topic", "model": {"source": "models:/bert-tiny@current", "init": "pretrained"},
              "task": {"type": "classification"}, "n_labels": 4,
              "data": {"train": "/t/train.jsonl", "valid": "/t/valid.jsonl", "format": "auto"},
              "train": {"epochs": 20, "mode": "full"}}  # fmt: skip
    tracker = Tracker(tmp_path / "run", enabled=True)
    try:
        tracker.start(tracking_uri=uri, experiment="topic", run_name="r", params=params,
                      tags={"stage": "finetune", "arch": "bert"}, resume=False)  # fmt: skip
        assert tracker.register("model", "topic", "current", {"valid_accuracy": "0.75"})
        tracker.end("FINISHED")
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
    client = MlflowClient(uri)
    note = client.get_run(tracker.run_id).data.tags[NOTE_TAG]
    assert note == (
        "Fine-tuning of bert for classification (full, from models:/bert-tiny@current): 4 "
        "labels, train /t/train.jsonl, valid /t/valid.jsonl, 20 epochs. `plm finetune`, "
        "config topic."
    )
    version = client.get_model_version_by_alias("topic", "current")
    assert version.description == f"{note} Best valid accuracy 0.75. Run {tracker.run_id}."
    assert client.get_registered_model("topic").description.startswith(
        "bert fine-tuned for classification by `plm finetune` (config topic)"
    )
    experiment = client.get_experiment_by_name("topic").tags[NOTE_TAG]
    assert experiment.startswith("plm runs, the first by `plm finetune` (config topic)")


def test_mlflow_has_no_chart_of_the_loss_twice_and_memory_is_a_system_metric(trained):
    """bert-tiny's objective has two terms (MLM + NSP): both chart; the window's last
    step_loss stays in metrics.jsonl; each rank's peak memory is in the system tab."""
    from mlflow import MlflowClient

    uri, run_dir, rows = trained
    metrics = (
        MlflowClient(uri).get_run((run_dir / "mlflow_run_id").read_text().strip()).data.metrics
    )
    assert {"loss", "mlm_loss", "nsp_loss"} <= set(metrics)
    assert "step_loss" not in metrics and any("step_loss" in r for r in rows)
    assert "system/rank0_peak_resident_gib" in metrics
    assert not any(k.startswith("host_peak") for k in metrics)
