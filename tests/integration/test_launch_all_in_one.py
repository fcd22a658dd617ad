"""launch/all_in_one.py on the CPU: a Ray head with token auth, `ray job submit` of the data
stages, 2 training "nodes" through the deepspeed launcher's --no_ssh form, an MLflow
server; checked from outside through the servers' own REST APIs, then stopped cleanly."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, load_launch_script, synthetic_corpus

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ALL_IN_ONE = REPO / "launch" / "all_in_one.py"
SHM = Path("/dev/shm")
aio = load_launch_script("all_in_one")


def get_json(url: str, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


SIGN_IN: dict[str, str] = {}  # the viewer's, once the all-in-one made it


def mlflow_get(base: str, endpoint: str, **params: str) -> dict:
    url = f"{base}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}"
    return get_json(url, SIGN_IN)


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listening(pids: set[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of ``pids``."""
    import psutil

    return {(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids}  # fmt: skip


def our_processes(proc: subprocess.Popen, work: Path, result: dict) -> set[int]:
    """The all-in-one, its children (MLflow server, launchers) and the Ray head's
    processes, the Ray client server included (daemons: found by their command lines)."""
    import psutil

    pids = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    pids |= set(aio.processes_with(result["ray_temp_dir"]))
    pids |= set(aio.processes_with(f"--address=127.0.0.1:{result['ray_gcs_port']} "))
    return pids | set(aio.processes_with(str(work)))


def test_all_in_one_data_training_tracking(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(synthetic_corpus(), encoding="utf-8")
    work = tmp_path / "aio"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, str(ALL_IN_ONE), "--workdir", str(work), "--input", str(corpus),
           "--vocab-size", "300", "--steps", "6", "--keep"]  # fmt: skip
    shm_before = set(SHM.iterdir())
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    result_file = work / "result.json"
    try:
        deadline = time.time() + 900
        while not result_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(1)
        assert result_file.exists(), (proc.poll(), _logs(work))
        time.sleep(0.5)  # written in one call; let it land
        result = json.loads(result_file.read_text())
        mlflow, ray = result["mlflow_url"], result["ray_address"]

        # MLflow refuses an anonymous client (basic-auth app) and answers its viewer.
        with pytest.raises(urllib.error.HTTPError) as refused:
            mlflow_get(mlflow, "runs/get", run_id=result["run_id"])
        assert refused.value.code == 401
        viewer = aio.read_secret(work / "mlflow-auth" / f"{aio.VIEWER_USER}.password")
        pair = base64.b64encode(f"{aio.VIEWER_USER}:{viewer}".encode()).decode()
        SIGN_IN["Authorization"] = f"Basic {pair}"
        # MLflow, through the server's REST API: the run, its loss curve, the registered model.
        run = mlflow_get(mlflow, "runs/get", run_id=result["run_id"])["run"]
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["world_size"] == "2" and tags["arch"] == "bert"
        hist = mlflow_get(
            mlflow, "metrics/get-history", run_id=result["run_id"], metric_key="loss"
        )["metrics"]
        losses = [m["value"] for m in sorted(hist, key=lambda m: m["step"])]
        assert len(losses) == 6 and all(v == v for v in losses)
        assert losses[-1] < losses[0], losses
        version = mlflow_get(mlflow, "registered-models/alias", name="bert-tiny", alias="current")
        mv = version["model_version"]
        assert mv["run_id"] == result["run_id"]
        listed = mlflow_get(mlflow, "artifacts/list", run_id=result["run_id"], path="model")
        names = {Path(f["path"]).name for f in listed["files"]}
        assert {"config.yaml", "tokenizer.json", "model.safetensors"} <= names

        # Ray: the dashboard refuses a request without the token, lists both jobs with it.
        with pytest.raises(urllib.error.HTTPError) as refused:
            get_json(f"{ray}/api/jobs/")
        assert refused.value.code in (401, 403)
        token = (Path(result["ray_temp_dir"]) / "auth_token").read_text().strip()
        jobs = get_json(f"{ray}/api/jobs/", {"Authorization": f"Bearer {token}"})
        ours = {j["submission_id"].split("-")[1]: j["status"] for j in jobs}
        assert ours == {"tokenizer": "SUCCEEDED", "prepare": "SUCCEEDED"}, jobs
        entrypoints = " | ".join(j["entrypoint"] for j in jobs)
        assert "plm data tokenizer" in entrypoints and "plm data prepare" in entrypoints

        # Everything it started listens on loopback only (GCS, raylet, agents, metrics,
        # the Ray client server, the dashboard, MLflow).
        pids = our_processes(proc, work, result)
        sockets = listening(pids)
        assert len({pid for *_, pid in sockets}) >= 5, sockets  # the head's and MLflow's
        assert {(ip, port) for ip, port, _ in sockets if ip not in LOOPBACK} == set()
        assert aio.processes_with(f"--address=127.0.0.1:{result['ray_gcs_port']} ")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-4000:]
    assert viewer not in out and aio.read_secret(work / "mlflow-auth" / "admin.password") not in out
    # Stopped cleanly: every process exited on SIGTERM (none needed SIGKILL), no process of
    # our head left, the MLflow port closed.
    assert "[all-in-one] stopped\n" in out, out[-2000:]
    # the UI link it prints opens the model-training view (MLflow's UI defaults to GenAI)
    link = f"{mlflow}/#/experiments/{result['experiment_id']}?workflowType=machine_learning"
    assert f"MLflow UI, model-training view: {link}" in out
    assert aio.processes_with(result["ray_temp_dir"]) == []
    # ... the Ray client server too (its command line names the GCS, not the temp dir),
    # and no socket of theirs still listens.
    assert aio.processes_with(f"--address=127.0.0.1:{result['ray_gcs_port']} ") == []
    assert listening(pids) == set()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{mlflow}/health", timeout=5)
    # No folder left in /dev/shm (MLflow's job runner makes one per server start, for its
    # queue, and never removes it).
    assert [p for p in set(SHM.iterdir()) - shm_before if p.is_dir()] == []


def _logs(work: Path) -> str:
    parts = []
    for f in sorted((work / "logs").glob("*.log")):
        parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)
