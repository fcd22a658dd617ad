"""The MLflow experiment a run goes to: `mlflow.experiment` / `mlflow.run_name` config keys,
and the experiment kind tag that MLflow 3's UI reads (model training, not GenAI)."""

from __future__ import annotations

import pytest
from conftest import REPO

from pipeline.config import ConfigError, load_config
from pipeline.train.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker

BERT = REPO / "configs/test/bert-tiny.yaml"


def test_experiment_and_run_name_are_config_keys():
    cfg = load_config(BERT, [])
    assert cfg.mlflow.experiment is None and cfg.mlflow.run_name is None  # name, out_dir
    cfg = load_config(BERT, ["mlflow.experiment=demo", "mlflow.run_name=pretrain"])
    assert (cfg.mlflow.experiment, cfg.mlflow.run_name) == ("demo", "pretrain")
    with pytest.raises(ConfigError, match="mlflow.experiment_name"):
        load_config(BERT, ["mlflow.experiment_name=demo"])


def test_a_run_tags_its_experiment_as_model_training_but_keeps_a_chosen_kind(tmp_path):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    try:
        for i, experiment in enumerate(["fresh", "fresh", "chosen"]):
            tracker = Tracker(tmp_path / f"run{i}", enabled=True)
            tracker.start(tracking_uri=uri, experiment=experiment, run_name=f"r{i}", params={},
                          tags={}, resume=False)  # fmt: skip
            assert tracker.mlflow_ok, tracker.warnings
            tracker.end("FINISHED")
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
    fresh = client.get_experiment_by_name("fresh")
    assert fresh.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    runs = client.search_runs([fresh.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["r0", "r1"]  # both runs, one experiment
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"
