"""A local Ray that `plm` starts itself (`plm data prepare` or `plm eval` given no address:
pipeline/prepare/job.py `init_ray`) listens on 127.0.0.1 only: its GCS, raylet, agents and
workers, none on a wildcard or the machine's address. A real Ray, in a process of its own
(as `plm data prepare` is), its sockets read from /proc (tests/listeners.py)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # a Ray start-up: ~10 s

PROBE = """
import json, os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]  # this checkout's pipeline, listeners
import ray
from listeners import descendants, listeners_of
from ray._private import ray_constants
from pipeline.prepare.job import init_ray

assert init_ray(None, 1)
node = ray._private.worker.global_worker.node

@ray.remote
def pid():
    return os.getpid()

worker = ray.get(pid.remote())  # a worker started, and a task ran on it
time.sleep(1)  # the agents' late listeners too
pids = {os.getpid(), worker}
for infos in node.all_processes.values():
    for info in infos:
        pids.update(descendants(info.process.pid))
print(json.dumps({
    "node_ip": node.node_ip_address,
    "gcs": ray.get_runtime_context().gcs_address,
    "listeners": listeners_of(pids),
    "worker_listens": any(p == worker for _, _, p in listeners_of(pids)),
    "switch_back": ray_constants.ENABLE_RAY_CLUSTER,
}))
ray.shutdown()
"""


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a v6 socket bound to it
    return (mapped or ip).is_loopback


def test_a_local_ray_started_by_plm_listens_on_loopback_only(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(REPO)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["node_ip"] == "127.0.0.1" and got["gcs"].startswith("127.0.0.1:"), got
    assert len(got["listeners"]) >= 5 and got["worker_listens"], got  # GCS, raylet, ...
    assert [x for x in got["listeners"] if not _loopback(x[0])] == [], got["listeners"]
    # Ray's one-machine switch is back as it was: a later cluster connection is not 127.0.0.1
    assert got["switch_back"] is True
