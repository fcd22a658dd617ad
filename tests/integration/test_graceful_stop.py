"""SIGTERM / SIGINT during training: a checkpoint at the next step boundary, the MLflow run
ended KILLED, a clean exit (143 / 130) with one `plm:` line, and a rerun that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, deepspeed_launch, free_port, metrics_rows

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        path = run_dir / "metrics.jsonl"
        if path.is_file() and any(r.get("step", 0) >= step for r in metrics_rows(run_dir)):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step {step} within {timeout} s")


def mlflow_run(cwd: Path, run_dir: Path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    return client.get_run((run_dir / "mlflow_run_id").read_text().strip())


def stopped_step(output: str, name: str) -> int:
    lines = [x for x in output.splitlines() if x.startswith("plm: stopped by")]
    assert len(lines) == 1, output[-4000:]
    assert lines[0].startswith(f"plm: stopped by {name} at step "), lines[0]
    return int(lines[0].split(" at step ")[1].split()[0])


def check_stopped(cwd: Path, run_dir: Path, step: int, name: str) -> None:
    ckpt = run_dir / "checkpoints"
    tag = f"step{step:08d}"
    assert (ckpt / "latest").read_text() == tag and (ckpt / tag / "COMPLETE").is_file()
    assert max(r["step"] for r in metrics_rows(run_dir)) == step  # the last steps logged
    run = mlflow_run(cwd, run_dir)
    assert run.info.status == "KILLED"
    assert run.data.tags["failure_reason"] == name


@pytest.mark.distributed
def test_sigterm_on_a_two_rank_launch_checkpoints_and_the_rerun_resumes(tiny_data, tmp_path):
    """SIGTERM to every process of a `deepspeed` launch (what Slurm's scancel sends; the
    per-node launcher forwards one more to each rank)."""
    run_dir = tmp_path / "run"
    args = ["--module", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
            f"train.out_dir={run_dir}", "train.save_every=0", "train.eval_every=0",
            "train.log_every=1", "mlflow.register=false"]  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
         "--master_port", str(port), *args, "train.max_steps=100000"],
        cwd=tmp_path, env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_step(run_dir, proc, 3)
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]  # until every rank closed its output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in output, output[-4000:]
    step = stopped_step(output, "SIGTERM")
    assert step >= 3
    check_stopped(tmp_path, run_dir, step, "SIGTERM")
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))

    resumed = deepspeed_launch([*args, f"train.max_steps={step + 3}"], cwd=tmp_path)
    assert f"resumed from {run_dir / 'checkpoints' / f'step{step:08d}'} at step {step}" in (
        resumed.stdout + resumed.stderr
    )
    run = mlflow_run(tmp_path, run_dir)
    assert run.info.status == "FINISHED"  # the same MLflow run, ended now
    steps = [r["step"] for r in metrics_rows(run_dir) if "step_loss" in r]
    assert steps == list(range(1, step + 4))  # one curve, no step twice or missing


def test_ctrl_c_checkpoints_ends_the_run_killed_and_exits_130(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
         f"train.out_dir={run_dir}", "train.max_steps=100000", "train.save_every=0",
         "train.eval_every=0", "train.log_every=1", "mlflow.register=false"],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_step(run_dir, proc, 3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    check_stopped(tmp_path, run_dir, stopped_step(err, "SIGINT"), "SIGINT")


def test_past_the_grace_time_it_exits_without_waiting_for_a_step(tmp_path):
    """A step that never ends (a collective waiting on a lost rank): after
    train.stop_grace_s the process ends the MLflow run (here: a callback) and exits 143."""
    code = (
        "import os, signal, time\n"
        "from pipeline.train.stop import GracefulStop\n"
        "stop = GracefulStop(0.5, lambda s: print('expired', s, flush=True)).install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
        "print('not stopped')\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 143, proc.stderr
    assert proc.stdout.split() == ["expired", str(int(signal.SIGTERM))]
    assert "plm: no step boundary within train.stop_grace_s=0.5 s of SIGTERM" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_stop_grace_s_is_a_config_key(tmp_path):
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    cfg = load_config(BERT, ["train.stop_grace_s=7.5"])
    assert cfg.train.stop_grace_s == 7.5
    with pytest.raises(ConfigError, match="stop_grace_s"):
        load_config(BERT, ["train.stop_grace_s=0"])
    assert json.loads(json.dumps(cfg.model_dump(mode="json")))["train"]["stop_grace_s"] == 7.5
