"""`plm train` end to end on a tiny prepared data dir: real DeepSpeed (CPU, gloo), real MLflow."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")
GPT2 = str(REPO / "configs/test/gpt2-tiny.yaml")


def step_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step_loss" in row:
            out[row["step"]] = row["step_loss"]
    return out


def train_in_process(cwd: Path, config: str, stop_after: int | None, *overrides: str):
    """`train(cfg, stop_after)` in a fresh interpreter: an interruption at a known step."""
    code = (
        "import sys; from pipeline.config import load_config; "
        "from pipeline.train.trainer import train; "
        "r = train(load_config(sys.argv[1], sys.argv[3:]), "
        "stop_after=None if sys.argv[2] == 'none' else int(sys.argv[2])); print('STEPS', r.steps)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, config, str(stop_after).lower(), *overrides],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_bert_tiny_trains_logs_and_registers(tiny_data, tmp_path):
    from mlflow import MlflowClient

    from pipeline.models.bundle import load_bundle

    run_dir = tmp_path / "run"
    proc = plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        "train.max_steps=30", "train.save_every=15", "train.eval_every=15", "train.log_every=1",
        cwd=tmp_path,
        # sample system metrics every 0.1 s: this tiny run lasts about a second
        env={"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.1",
             "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING": "1"},
    )  # fmt: skip
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, 31))
    assert all(v == v and abs(v) < 1e4 for v in losses.values())  # finite
    first = sum(losses[s] for s in (1, 2, 3)) / 3
    last = sum(losses[s] for s in (28, 29, 30)) / 3
    assert last < first - 0.2, (first, last)
    assert "registered model bert-tiny version 1 alias @current" in proc.stdout

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"  # train.out_dir's name (mlflow.run_name unset)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "bert-tiny"  # the config's name (mlflow.experiment unset)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.params["train.lr"] == "0.001"
    assert run.data.params["model.arch"] == "bert"
    assert run.data.tags["arch"] == "bert" and run.data.tags["objective"] == "mlm+nsp"
    assert run.data.tags["data_fingerprint"]
    assert run.data.tags["code_version"]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "eval_mlm_acc",
                "eval_nsp_acc", "eval_ppl", "skipped_steps"):  # fmt: skip
        assert key in run.data.metrics, key
    assert len(client.get_metric_history(run_id, "loss")) == 30
    assert any(k.startswith("system/") for k in run.data.metrics)  # system metrics
    names = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/model.safetensors", "model/config.yaml", "model/tokenizer.json"} <= names
    assert {a.path for a in client.list_artifacts(run_id, "config")} >= {"config/deepspeed.json"}
    assert client.list_artifacts(run_id, "tokenizer")
    # the bundle beside the step-15 checkpoint stays local: MLflow gets the kept ones only
    # (train.keep_bundle_every, 0 by default) and the final one
    assert not client.list_artifacts(run_id, "bundles")
    assert (run_dir / "bundles" / "step00000015" / "model.safetensors").is_file()
    mv = client.get_model_version_by_alias("bert-tiny", "current")
    assert mv.run_id == run_id
    assert mv.tags["arch"] == "bert" and mv.tags["objective"] == "mlm+nsp"
    assert mv.tags["data_fingerprint"] == run.data.tags["data_fingerprint"]
    assert int(mv.tags["tokens_seen"]) > 0
    local = client.download_artifacts(run_id, "model", str(tmp_path / "dl"))
    model, bundle_cfg = load_bundle(local)
    assert bundle_cfg["arch"] == "bert"
    assert sum(p.numel() for p in model.parameters()) > 0


def test_bundles_bounded_on_disk_and_in_mlflow(tiny_data, tmp_path):
    """Issue 34: a checkpoint every 2 steps over 40 steps wrote and logged 19 bundles. Now
    only the final one, every 5th checkpoint's (train.keep_bundle_every) and the ones beside
    the checkpoints keep_last keeps are on disk, and MLflow holds the kept and final ones."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        "train.max_steps=40", "train.save_every=2", "train.eval_every=0", "train.log_every=10",
        "train.keep_last=2", "train.bundle_every=1", "train.keep_bundle_every=5",
        f"mlflow.tracking_uri={uri}", "mlflow.register=false", cwd=tmp_path,
    )  # fmt: skip
    # checkpoints at steps 2, 4, ..., 38 (each with a bundle) and 40 (the end: bundle final)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == [
        "step00000038", "step00000040"]  # fmt: skip
    kept = ["step00000010", "step00000020", "step00000030"]  # checkpoints 5, 10, 15
    on_disk = sorted(p.name for p in (run_dir / "bundles").iterdir())
    assert on_disk == ["final", *kept, "step00000038"], on_disk
    assert len(on_disk) <= 1 + 40 // 2 // 5 + 2  # final + kept + keep_last: the bound
    for name in on_disk:
        assert (run_dir / "bundles" / name / "model.safetensors").is_file()

    client = MlflowClient(tracking_uri=uri)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    logged = sorted(a.path for a in client.list_artifacts(run_id, "bundles"))
    assert logged == [f"bundles/{k}" for k in kept], logged
    names = {a.path for a in client.list_artifacts(run_id, "model")}
    assert "model/model.safetensors" in names  # the final bundle, as before


def test_gpt2_tiny_trains(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    plm(
        "train", GPT2, f"data.path={tiny_data}", f"train.out_dir={run_dir}", "train.max_steps=20",
        "train.log_every=1", "mlflow.register=false", cwd=tmp_path,
    )  # fmt: skip
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, 21))
    assert sum(losses[s] for s in (18, 19, 20)) < sum(losses[s] for s in (1, 2, 3)) - 0.3
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()


def test_exact_resume_also_with_other_worker_count(tiny_data, tmp_path):
    common = [f"data.path={tiny_data}", "train.max_steps=20", "train.save_every=10",
              "train.eval_every=10", "train.log_every=1", "mlflow.register=false"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    train_in_process(tmp_path, BERT, None, *common, f"train.out_dir={a}", "data.workers=0")
    train_in_process(tmp_path, BERT, 10, *common, f"train.out_dir={b}", "data.workers=0")
    assert (b / "checkpoints" / "latest").read_text() == "step00000010"
    assert sorted(step_losses(b)) == list(range(1, 11))
    proc = train_in_process(tmp_path, BERT, None, *common, f"train.out_dir={b}", "data.workers=2")
    assert "resumed from" in proc.stdout and "step00000010" in proc.stdout
    la, lb = step_losses(a), step_losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, 21))
    for s in range(1, 21):
        assert lb[s] == pytest.approx(la[s], rel=0, abs=1e-6), (s, la[s], lb[s])


def test_sigkill_then_resume_auto_from_last_complete_checkpoint(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
            f"train.out_dir={run_dir}", "train.max_steps=400", "train.save_every=3",
            "train.eval_every=0", "train.keep_last=2", "mlflow.register=false"]  # fmt: skip
    proc = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline:
        if latest.is_file() and latest.read_text() >= "step00000006":
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.is_file(), "no checkpoint appeared before the deadline"
    tag = latest.read_text()
    done = int(tag.removeprefix("step"))
    # A save that died half-way (no COMPLETE marker) past the last good one: never used.
    half = run_dir / "checkpoints" / f"step{done + 100:08d}"
    half.mkdir(exist_ok=True)
    (half / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    out = plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
        f"train.max_steps={done + 3}", "train.save_every=3", "train.eval_every=0",
        "mlflow.register=false", cwd=tmp_path,
    )  # fmt: skip
    assert f"resumed from {run_dir / 'checkpoints' / tag} at step {done}" in out.stdout
    assert latest.read_text() == f"step{done + 3:08d}"
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()


def test_misspelled_key_fails_before_anything_starts(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    for bad, key in (("train.max_stepz=3", "train.max_stepz"), ("trian.lr=1", "trian")):
        out = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}", bad,
                  cwd=tmp_path, check=False)  # fmt: skip
        assert out.returncode == 2 and key in out.stderr, out.stderr
        assert "unknown key" in out.stderr
    out = plm("train", BERT, f"data.path={tiny_data}", "model.num_layerz=3", "--dry-run",
              cwd=tmp_path, check=False)  # fmt: skip
    assert out.returncode == 2 and "model.num_layerz" in out.stderr, out.stderr
    assert not run_dir.exists() and not (tmp_path / "mlflow.db").exists()


def test_dry_run_prints_the_plan(tiny_data, tmp_path):
    out = plm("train", BERT, f"data.path={tiny_data}", "deepspeed=configs/deepspeed/zero3.json",
              "--dry-run", cwd=tmp_path, env={"WORLD_SIZE": "4"})  # fmt: skip
    for text in ("world size      4", "global batch    32", "ZeRO-3", "memory / rank",
                 "parameters", "tokens", "dry run: config valid"):  # fmt: skip
        assert text in out.stdout, out.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
    out = plm("train", BERT, "data.path=/nonexistent/data", "--dry-run", cwd=tmp_path, check=False)
    assert out.returncode == 2 and "/nonexistent/data" in out.stderr


def test_bad_shard_fails_naming_it_or_is_skipped(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = data / "train" / "shard-000001.tar"
    raw = bytearray(shard.read_bytes())
    raw[600] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(raw))
    common = [f"data.path={data}", "train.max_steps=3", "train.eval_every=0",
              "mlflow.register=false"]  # fmt: skip
    out = plm("train", BERT, *common, f"train.out_dir={tmp_path / 'r1'}", cwd=tmp_path, check=False)
    assert out.returncode != 0
    # Found when the corrupt block is first read (its crc32), not by hashing at start.
    assert "train/shard-000001.tar: block" in out.stderr and "crc32" in out.stderr
    assert "Traceback" not in out.stderr
    out = plm("train", BERT, *common, f"train.out_dir={tmp_path / 'r2'}", "data.on_bad_shard=skip",
              cwd=tmp_path)  # fmt: skip
    assert "skipped 1 bad shards" in out.stdout
    rows = [json.loads(x) for x in (tmp_path / "r2" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("skipped_shards") == 1 for r in rows)


def test_unreachable_tracking_server_does_not_stop_training(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    out = plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}", "train.max_steps=4",
        "train.eval_every=0", "train.log_every=1", "mlflow.tracking_uri=http://127.0.0.1:9",
        cwd=tmp_path,
        env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"},
        check=False,
    )  # fmt: skip
    assert "MLflow" in out.stdout + out.stderr and "training goes on" in out.stdout + out.stderr
    # Trained, but MLflow never had the run: exit 3 and one line saying how to sync it.
    assert out.returncode == 3, out.stderr[-3000:]
    assert [x for x in out.stderr.splitlines() if x.startswith("plm:")][0].count("Re-run") == 1
    assert sorted(step_losses(run_dir)) == [1, 2, 3, 4]
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()


def test_nonfinite_losses_in_a_row_stop_with_a_checkpoint(tiny_data, tmp_path):
    """An absurd learning rate overflows the weights after the first update; every later
    loss is NaN, so the run stops after K skips and saves the last good state."""
    run_dir = tmp_path / "run"
    proc = plm(
        "train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}", "train.lr=1e30",
        "train.warmup_steps=0", "train.max_nonfinite_in_row=3", "train.max_steps=20",
        "train.eval_every=0", "train.save_every=0", "mlflow.register=false",
        cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "3 non-finite losses in a row" in proc.stderr
    assert "Traceback" not in proc.stderr
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest).is_dir()
    assert "update skipped (3 in a row)" in proc.stdout + proc.stderr
    # Every skip of the diverging tail is logged, in metrics.jsonl and in MLflow, and the
    # failed MLflow run says why it failed.
    out = proc.stdout + proc.stderr
    skipped = out.count("non-finite loss, update skipped")
    assert skipped >= 3
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["skipped_steps"] for r in rows if "skipped_steps" in r]
    assert logged and logged[-1] == skipped, (logged, skipped)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FAILED"
    assert run.data.metrics["skipped_steps"] == skipped
    assert run.data.tags["failure_reason"] == "diverged"
    assert "3 non-finite losses in a row" in run.data.tags["failure_message"]


def test_missing_data_dir_is_a_clear_error(tmp_path):
    """No manifest: exit 2 naming the folder and the command that makes it, no traceback."""
    missing = tmp_path / "no-such-data"
    for extra in ([], ["--dry-run"]):
        proc = plm("train", BERT, f"data.path={missing}", *extra, cwd=tmp_path, check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert str(missing) in proc.stderr and "plm data prepare" in proc.stderr
        assert "Traceback" not in proc.stderr
