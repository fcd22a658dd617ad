"""`plm train` ends its process itself once everything is written (`pipeline.cli.exit_now`,
skipping the interpreter's teardown): nothing of the run is lost, the exit codes stay;
and MLflow's run context does not import IPython (`tracking.ipython_absent`). Real
DeepSpeed (CPU, gloo) and MLflow; stdout and stderr are pipes without PYTHONUNBUFFERED,
so a missing flush would lose their last lines."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")
BUFFERED = {"PYTHONUNBUFFERED": ""}  # plm() sets it; an empty value leaves it unset


def test_one_step_run_leaves_everything_in_a_new_store_and_exits_0(tiny_data, tmp_path):
    from mlflow import MlflowClient

    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'new' / 'store.db'}"
    proc = plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        "train.max_steps=1", "train.eval_every=0", "train.save_every=0",
        f"mlflow.tracking_uri={uri}", cwd=tmp_path, check=False,
        env={**BUFFERED, "PYTHONPROFILEIMPORTTIME": "1"},  # each import, on stderr
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # MLflow's run context (start_run, the LoggedModel) asks for IPython: never loaded (a
    # refused `import IPython` is listed too, but loads none of its modules)
    imported = [x.rsplit("|", 1)[-1].strip() for x in proc.stderr.splitlines()]
    assert "torch" in imported and "mlflow" in imported
    assert not [x for x in imported if x.startswith("IPython.")]
    lines = proc.stdout.splitlines()
    assert any(x.startswith("[plm train] step 1: loss") for x in lines), proc.stdout
    assert lines[-2] == "registered model bert-tiny version 1 alias @current", lines[-3:]
    assert lines[-1] == f"[plm train] final bundle: {run_dir / 'bundles' / 'final'}", lines[-3:]

    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "1"
    assert run.data.params["model.arch"] == "bert"
    assert run.data.tags["arch"] == "bert" and run.data.tags["code_version"]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, pytest.approx(row["loss"]))]
    assert "system/rank0_peak_resident_gib" in run.data.metrics  # logged after the checkpoint
    names = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/model.safetensors", "model/config.yaml", "model/tokenizer.json"} <= names
    mv = client.get_model_version_by_alias("bert-tiny", "current")
    assert int(mv.version) == 1 and mv.run_id == run_id and mv.status == "READY"
    assert mv.source.startswith("models:/")  # the LoggedModel (pyfunc flavour)
    assert int(mv.tags["tokens_seen"]) > 0
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000001"
    assert (run_dir / "checkpoints" / "step00000001" / "COMPLETE").is_file()


def test_failing_runs_keep_their_exit_codes_and_last_lines(tiny_data, tmp_path):
    """A diverging run: exit 1, its `plm:` line the last of stderr, the MLflow run FAILED
    with its reason. A misspelled key: exit 2 and one `plm:` line, before any work."""
    from mlflow import MlflowClient

    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'store.db'}"
    proc = plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}", "train.lr=1e30",
        "train.warmup_steps=0", "train.max_nonfinite_in_row=2", "train.max_steps=5",
        "train.eval_every=0", "train.save_every=0", "mlflow.register=false",
        f"mlflow.tracking_uri={uri}", cwd=tmp_path, env=BUFFERED, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("plm: 2 non-finite losses in a row"), proc.stderr[-3000:]
    assert "update skipped (2 in a row)" in proc.stdout
    run = MlflowClient(tracking_uri=uri).get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == "diverged"
    assert run.data.metrics["skipped_steps"] == 2

    proc = plm("train", BERT, f"data.path={tiny_data}", "train.max_stepz=1", cwd=tmp_path,
               env=BUFFERED, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("plm: ") and proc.stderr.count("plm:") == 1, proc.stderr
    assert "train.max_stepz" in proc.stderr
