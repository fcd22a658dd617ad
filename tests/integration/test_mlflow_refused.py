"""An MLflow server that refuses plm's requests (MLflow 3.17's Host-header check: 403
"Invalid Host header ...") is one `plm:` line at the start naming the URL, the status,
the server's words and the fix, exit 2, before any step: no retrying can change that
answer. The server's store is made in one step (pipeline/train/mlflow_store.py), so this
is also `mlflow server` opening such a store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
from conftest import REPO, free_port, plm

from pipeline.train.mlflow_store import create_new_store

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def start_server(tmp_path, port: int, allowed: str) -> subprocess.Popen:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert create_new_store(store)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (lives with the server)
    proc = subprocess.Popen(
        ["mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", store, "--allowed-hosts", allowed],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:  # /health answers whatever the Host header
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    raise AssertionError("mlflow server not healthy")


def test_a_server_that_refuses_the_host_is_one_plm_line_before_any_step(tiny_data, tmp_path):
    port = free_port()
    server = start_server(tmp_path, port, allowed=f"mlflow.example:{port}")
    try:
        # The server serves the one-step store to a Host it accepts.
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=10",
            headers={"Host": f"mlflow.example:{port}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            names = [e["name"] for e in json.loads(r.read())["experiments"]]
        assert names == ["Default"]

        url = f"http://127.0.0.1:{port}"
        run_dir = tmp_path / "run"
        proc = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
                   "train.max_steps=3", "train.log_every=1", f"mlflow.tracking_uri={url}",
                   "mlflow.retry_every_s=1",
                   "mlflow.final_wait_s=5", cwd=tmp_path, check=False, timeout=300)  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=60)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    plm_lines = [x for x in lines if x.startswith("plm:")]
    assert len(plm_lines) == 1, proc.stderr[-3000:]
    line = plm_lines[0]
    for part in (url, "403", "Invalid Host header", f"--allowed-hosts 127.0.0.1:{port}"):
        assert part in line, line
    assert "Traceback" not in proc.stderr
    assert "step 1:" not in proc.stdout  # before any step
    assert not (run_dir / "metrics.jsonl").exists()
