"""What a run pays before its first step: neither MLflow's import nor a new sqlite
store's set-up (the run starts at the first metrics row: pipeline/train/tracking.py;
DeepSpeed is imported without MLflow: ``ds_ops.import_deepspeed``), and the MLflow run
holds what it held when it started first. A new sqlite store is made in one step at the
schema MLflow's migrations leave (pipeline/train/mlflow_store.py), not by replaying them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def test_deepspeed_is_imported_without_mlflow_and_mlflow_stays_importable():
    code = (
        "import sys; from pipeline.train import ds_ops; ds = ds_ops.import_deepspeed(); "
        "print('RESULT', 'mlflow' in sys.modules, ds.__name__); import mlflow; "
        "print('RESULT', mlflow.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.splitlines()  # fmt: skip
    assert [x for x in out if x.startswith("RESULT")] == ["RESULT False deepspeed", "RESULT mlflow"]


def test_the_first_step_comes_before_mlflow_and_the_run_has_every_row(tiny_data, tmp_path):
    db = tmp_path / "mlflow.db"  # a new store: its migrations come after the first step
    run_dir = tmp_path / "run"
    proc = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
               "train.max_steps=4", "train.eval_every=2", "train.save_every=2",
               "train.log_every=1", f"mlflow.tracking_uri=sqlite:///{db}", cwd=tmp_path,
               env={"MLFLOW_LOGGING_LEVEL": "INFO"})  # MLflow says when it makes a store  # fmt: skip
    lines = proc.stdout.splitlines()
    first_step = next(i for i, x in enumerate(lines) if "step 1:" in x)
    started = next(i for i, x in enumerate(lines) if x.startswith("MLflow run "))
    assert first_step < started, proc.stdout
    assert "registered model bert-tiny version 1" in proc.stdout
    # made in one step, not by MLflow's migrations (which log that they create the tables)
    assert "Creating initial MLflow database tables" not in proc.stderr, proc.stderr[-3000:]

    import sqlalchemy
    from mlflow import MlflowClient
    from mlflow.store.db.utils import _get_latest_schema_revision, _get_schema_version

    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    assert _get_schema_version(engine) == _get_latest_schema_revision()
    engine.dispose()

    client = MlflowClient(f"sqlite:///{db}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "4" and run.data.tags["arch"] == "bert"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = [(r["step"], r["loss"]) for r in rows if "step_loss" in r]
    got = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    assert sorted(got) == want and len(want) == 4
    assert (run_dir / "mlflow_synced").read_text() == str(len(rows))
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"config", "tokenizer", "model"} <= names
