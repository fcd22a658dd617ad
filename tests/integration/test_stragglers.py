"""A straggler named (train/stragglers.py): 2 ranks of `plm train`, rank 1 slowed from
outside (stopped 60 ms of every 100 ms, as a host whose CPU another process takes): rank 0
names rank 1 in one `plm:` line per window and in MLflow's straggler/* metrics, and
nothing restarts (its heartbeat still beats)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def throttle(pid: int, stop: threading.Event, off_s: float = 0.06, on_s: float = 0.04):
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(off_s)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(on_s)


def test_a_rank_slowed_from_outside_is_named_as_a_straggler(tiny_data, tmp_path):
    from conftest import REPO, rank_env
    from mlflow import MlflowClient

    port, db = str(free_port()), tmp_path / "mlflow.db"
    procs = []
    for rank in (0, 1):
        env = rank_env(rank, 2, port)
        cmd = [sys.executable, "-m", "pipeline.cli", "train",
               str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={tiny_data}",
               f"train.out_dir={tmp_path / 'run'}", "train.max_steps=60",
               "train.save_every=0", "train.eval_every=0", "train.log_every=20",
               "train.straggler_every=20", f"mlflow.tracking_uri=sqlite:///{db}"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    stop = threading.Event()
    slow = threading.Thread(target=throttle, args=(procs[1].pid, stop), daemon=True)
    slow.start()
    try:
        out0, err0 = procs[0].communicate(timeout=600)
        stop.set()
        slow.join()
        procs[1].communicate(timeout=60)
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err0[-4000:]
    named = [x for x in err0.splitlines() if "is a straggler" in x]
    assert named and all(x.startswith("plm: rank 1 on ") for x in named), err0[-4000:]
    assert len(named) <= 3  # at most one per window of 20 steps
    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    ranks = client.get_metric_history(run.info.run_id, "straggler/rank")
    assert ranks and {m.value for m in ranks} == {1.0}, ranks
    assert all(m.value >= 1.25 for m in client.get_metric_history(run.info.run_id,
                                                                   "straggler/slowdown"))  # fmt: skip
    assert "rank 1 on " in run.data.tags["straggler/last"]
    print(named[0])
