"""The MLflow experiment a run goes to: `mlflow.experiment` / `mlflow.run_name` config keys,
and the experiment kind tag that MLflow 3's UI reads (model training, not GenAI)."""

from __future__ import annotations

import pytest
from conftest import REPO

from pipeline.config import load_config
from pipeline.errors import ConfigError
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


def test_a_final_wait_that_runs_out_is_told_and_the_same_command_syncs_it(tmp_path, monkeypatch):
    """The server answers at the start, then not within mlflow.final_wait_s: the job says
    what MLflow lacks (the run stays RUNNING, rows unsent) and how to sync it (`plm train`
    prints it as its `plm:` line and exits 3). A second job on the same run dir (the same
    command, re-run) sends the rows and ends the run."""
    import threading

    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    first = Tracker(run_dir, enabled=True, retry_every_s=0.05, final_wait_s=0.2)
    said: list[str | None] = []

    def job_one():  # its own thread: its fluent active run is left behind, as at an exit
        first.start(tracking_uri=uri, experiment="wait", run_name="r", params={}, tags={},
                    resume=False)  # fmt: skip
        assert first.mlflow_ok, first.warnings
        first.log_metrics({"loss": 1.0}, 1)

        def down(*args, **kwargs):
            raise ConnectionError("server gone")

        with monkeypatch.context() as m:
            m.setattr(mlflow, "log_metrics", down)
            m.setattr(MlflowClient, "get_run", down)
            for step in (2, 3):
                first.log_metrics({"loss": 1.0 / step}, step)
            first.end("FINISHED")
        said.append(first.left_behind())

    thread = threading.Thread(target=job_one)
    thread.start()
    thread.join()
    (message,) = said
    assert message is not None
    assert "mlflow.final_wait_s=0.2" in message and "RUNNING" in message
    assert "2 metric rows" in message and "Re-run the same command" in message
    client = MlflowClient(uri)
    run_id = first.run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    assert len(client.get_metric_history(run_id, "loss")) == 1

    again = Tracker(run_dir, enabled=True, final_wait_s=0.2)
    try:
        again.start(tracking_uri=uri, experiment="wait", run_name="r", params={}, tags={},
                    resume=True)  # fmt: skip
        again.end("FINISHED")
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
    assert again.left_behind() is None and again.run_id == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3]


@pytest.mark.parametrize("users", [None, "false", "true"])
def test_mlflow_telemetry_is_off_in_what_plm_starts_unless_the_user_chose(
    tmp_path, monkeypatch, users
):
    """MLflow 3 sends usage telemetry by default: every `plm` command turns it off for
    itself and what inherits its environment (ranks, Ray workers, an MLflow server); a
    user's own MLFLOW_DISABLE_TELEMETRY wins."""
    from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY

    from pipeline.cli import main

    if users is None:
        monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", users)
    main(["data", "inspect", str(tmp_path / "nothing-here")])  # any command, even a failing one
    assert MLFLOW_DISABLE_TELEMETRY.get() is (users != "false")


def test_a_run_says_how_to_see_it(tmp_path, capsys):
    """`plm train` printed the run id only; now the `mlflow ui` command for a local store
    (then the experiment's page), or the server's page of the experiment."""
    import mlflow

    from pipeline.train.tracking import how_to_view

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(tmp_path / "run", enabled=True)
    try:
        tracker.start(tracking_uri=uri, experiment="see", run_name="r", params={}, tags={},
                      resume=False)  # fmt: skip
        tracker.end("FINISHED")
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
    experiment = mlflow.MlflowClient(uri).get_run(tracker.run_id).info.experiment_id
    out = capsys.readouterr().out
    assert (f"see it: mlflow ui --backend-store-uri {uri}, then http://127.0.0.1:5000/#/"
            f"experiments/{experiment}?workflowType=machine_learning") in out  # fmt: skip
    assert how_to_view("http://plm-mlflow:5000", "7") == (
        "http://plm-mlflow:5000/#/experiments/7?workflowType=machine_learning"
    )
