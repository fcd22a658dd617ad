"""A silent host under launch/elastic_train.py, at the default settings (issue 53): 3
hosts x 1 rank, bert-tiny, nothing set but the run's length. node2 goes silent twice,
first its link cut (`ip link set down`: nothing dies), then, once back, frozen (SIGSTOP
of every process of it, as a frozen VM). Each time the survivors' heartbeat watch finds
it (`train.heartbeat_timeout_s`, 10 s), each survivor says so in one `plm:` line naming
node2 and its address, and the run goes on on 2 hosts, long before the collective timeout
(300 s) would have fired; the next round tags the MLflow run with the line.

The figures (detection, rendezvous, start-up) are bench/bench_elastic_cluster.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_util import REPO, pids_of, small_rig
from conftest import build_data_dir

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
COLLECTIVE_TIMEOUT_S = 300  # the default: what a silent host cost before the heartbeat


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.is_file() else []


def training_pids(rig, host: str) -> list[int]:
    return pids_of(rig, host, b"torch.distributed.run", b"pipeline.cli", b"elastic_train.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    name = f"s{os.getpid() % 100000}"
    rig = small_rig(name, 3, ssh=False, s3=False, shared=True)
    try:
        yield rig
    finally:
        for h in rig.hosts:
            for pid in training_pids(rig, h.name):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        rigmod.down(name)


def test_a_cut_link_and_a_frozen_host_are_named_and_the_run_goes_on(cluster):
    rig = cluster
    base = rig.shared / "silent"
    base.mkdir()
    data = build_data_dir(base)
    run = base / "run"
    cmd = [sys.executable, str(REPO / "launch" / "elastic_train.py"), "--nnodes", "2:3",
           "--nproc-per-node", "1", "--rdzv-endpoint", "node0:29400", "--skip-dry-run",
           str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={data}",
           f"train.out_dir={run}", "train.max_steps=100000", "train.save_every=5",
           "train.eval_every=0", "train.log_every=1", "train.global_batch=48",
           "train.bundle_every=0", "mlflow.register=false",
           f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}"]  # fmt: skip
    logs: dict[str, Path] = {}
    agents: dict[str, subprocess.Popen] = {}

    def start(host: str, k: int) -> None:
        logs[host] = base / f"{host}-{k}.log"
        agents[host] = rig.popen(host, cmd, env={**os.environ, **ENV}, cwd=str(base),
                                 stdout=open(logs[host], "wb"), stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip

    def wait(pred, what: str, limit: float = 600):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            for h, a in agents.items():
                if h != "node2" and a.poll() is not None:
                    raise AssertionError(f"{h}'s agent ended: {logs[h].read_text()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(
            f"no {what} within {limit:.0f} s:\n{logs['node0'].read_text()[-4000:]}"
        )

    def world_after(n_changes: int) -> dict | None:
        return next((r for r in metrics(run) if r.get("elastic/changes") == n_changes), None)

    def steps_at(world: int) -> int:
        return sum(1 for r in metrics(run) if "step_loss" in r and r.get("world_size") == world)

    def survivors_lines(since: dict[str, int]) -> list[str]:
        return [x for h in ("node0", "node1")
                for x in logs[h].read_text().splitlines()[since[h]:] if x.startswith("plm:")]  # fmt: skip

    node2 = rig.host("node2")
    for h in ("node0", "node1", "node2"):
        start(h, 0)
    wait(lambda: steps_at(3) >= 10, "10 steps on 3 hosts")
    changes = max((r.get("elastic/changes", 0) for r in metrics(run)), default=0)
    for event in ("link cut", "frozen"):
        since = {h: len(logs[h].read_text().splitlines()) for h in ("node0", "node1")}
        at = time.monotonic()
        if event == "link cut":
            subprocess.run(["ip", "link", "set", node2.veth, "down"], check=True)
        else:
            for pid in training_pids(rig, "node2"):
                os.kill(pid, signal.SIGSTOP)
        changes += 1
        row = wait(lambda n=changes: world_after(n), f"the round after the {event}")
        took = time.monotonic() - at
        assert row["elastic/world_size"] == 2 and row["elastic/old_world_size"] == 3, row
        assert took < COLLECTIVE_TIMEOUT_S, took
        lines = survivors_lines(since)
        named = [x for x in lines if "has been silent" in x]
        assert len(named) == 2, lines  # one per survivor (one rank each)
        assert all(f"on node2 ({node2.address})" in x for x in named), named
        print(f"{event}: the next step on 2 hosts {took:.1f} s later; {named[0]}")
        if event == "link cut":  # node2's agent, alive all along, comes back by itself
            subprocess.run(["ip", "link", "set", node2.veth, "up"], check=True)
            changes += 1
            wait(lambda n=changes: (r := world_after(n)) and r["elastic/world_size"] == 3,
                 "node2 back after the link came up")  # fmt: skip
            wait(lambda: steps_at(3) >= 20, "steps on 3 hosts again")
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{base / 'mlflow.db'}")
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    silent = {k: v for k, v in found.data.tags.items() if k.startswith("elastic/silent_")}
    assert len(silent) == 2 and all("node2" in v for v in silent.values()), found.data.tags
    assert "elastic/silent_detect_s" in found.data.metrics
