"""A stop under a pipe whose reader dies of the same signal (issue 52, defect 1):
`plm train ... 2>err | tee out`, then Ctrl-C (SIGINT to the terminal's process group, `tee`
included), or SIGTERM to the group with stdout and stderr in one pipe. The closed output
stops neither training nor the save: the checkpoint is written, the MLflow run ends
KILLED and the exit is 130 / 143 as in a plain terminal. Real `plm train` (DeepSpeed on
the CPU, MLflow) and a real `tee`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, metrics_rows

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def as_a_terminal_job() -> None:
    """A terminal's job starts with SIGINT and SIGTERM at their defaults; a test process
    started in the background (`cmd &` in a script) has SIGINT ignored, and `tee` would
    inherit that, outlive Ctrl-C and exit 0 at EOF."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def train_into_tee(tiny_data: Path, tmp_path: Path, stderr_too: bool):
    """`plm train` with its stdout (and with ``stderr_too`` its stderr) piped into `tee`,
    both in one new process group (a terminal's job). Returns (train, tee, out, err)."""
    run_dir, out, err = tmp_path / "run", tmp_path / "out", tmp_path / "err"
    with open(err, "w") as err_file:
        train = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
             f"train.out_dir={run_dir}", "train.max_steps=100000", "train.save_every=0",
             "train.eval_every=0", "train.log_every=1", "mlflow.register=false"],
            cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_too else err_file,
            process_group=0,  # a group of its own (a terminal's job), in this session
            preexec_fn=as_a_terminal_job,
        )  # fmt: skip
    tee = subprocess.Popen(
        ["tee", str(out)], stdin=train.stdout, stdout=subprocess.DEVNULL,
        process_group=train.pid, preexec_fn=as_a_terminal_job,
    )  # fmt: skip
    train.stdout.close()  # tee holds the only read end: once it dies, a write is EPIPE
    return train, tee, out, err


def wait_for_step_line(train, tee, out: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert train.poll() is None and tee.poll() is None, out.read_text()[-4000:]
        if out.is_file() and "[plm train] step 1: loss" in out.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"no step line within {timeout} s")


def check_stopped_whole(tmp_path: Path, name: str) -> int:
    """A complete checkpoint that `latest` names, at the last step logged; the MLflow run
    KILLED by ``name``. Returns the checkpoint's step."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").is_file(), sorted(p.name for p in run_dir.iterdir())
    tag = (ckpt / "latest").read_text()
    assert (ckpt / tag / "COMPLETE").is_file()
    step = int(tag.removeprefix("step"))
    assert step >= 1 and max(r["step"] for r in metrics_rows(run_dir)) == step
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "KILLED", run.data.tags
    assert run.data.tags["failure_reason"] == name
    return step


def stop(train, tee, signum: int) -> None:
    try:
        os.killpg(train.pid, signum)  # what a terminal's Ctrl-C does: the whole job
        train.wait(timeout=180)
        tee.wait(timeout=30)
    finally:
        for proc in (train, tee):
            if proc.poll() is None:
                proc.kill()


def test_ctrl_c_with_stdout_piped_into_tee_that_dies_of_it_too(tiny_data, tmp_path):
    train, tee, out, err = train_into_tee(tiny_data, tmp_path, stderr_too=False)
    wait_for_step_line(train, tee, out)
    stop(train, tee, signal.SIGINT)
    stderr = err.read_text()
    assert tee.returncode == -signal.SIGINT  # the reader is gone: the run wrote into nothing
    assert train.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr[-4000:]
    step = check_stopped_whole(tmp_path, "SIGINT")
    lines = [x for x in stderr.splitlines() if x.startswith("plm:")]
    assert lines == [
        f"plm: stopped by SIGINT at step {step} of 100000; checkpoint "
        f"{tmp_path / 'run' / 'checkpoints' / f'step{step:08d}'}; the same command resumes "
        "from it"
    ], stderr[-4000:]


def test_sigterm_with_stdout_and_stderr_in_one_pipe_whose_reader_dies(tiny_data, tmp_path):
    """`plm train ... 2>&1 | tee out` and SIGTERM to the job: the stop notice, the save's
    lines and the last `plm:` line all go into a closed pipe; none of them raises."""
    train, tee, out, _ = train_into_tee(tiny_data, tmp_path, stderr_too=True)
    wait_for_step_line(train, tee, out)
    stop(train, tee, signal.SIGTERM)
    assert tee.returncode == -signal.SIGTERM
    assert train.returncode == 143, out.read_text()[-4000:]
    check_stopped_whole(tmp_path, "SIGTERM")
