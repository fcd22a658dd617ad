"""The evaluation suite on the rig's Ray cluster (issue 48): `plm eval` submitted with
launch/ray_submit.py from the laptop, its driver on node0 (the head, no CPUs), its cells on
the one-CPU workers node1 and node2, hosts that share nothing but the bucket.

The pretraining run is trained on the laptop from the bucket straight onto the bucket
(bert-tiny, checkpoints at steps 5, 10, 15), tracked by an MLflow server on node0; the task files and
the suite are on node0 only, and the driver's bundles are made there: the workers get
them through Ray (pipeline/eval/ship.py).

- The suite on the two workers gives the table of one process (the laptop, `--no-ray`):
  every cell's metrics equal, and both workers scored cells.
- node2 dies (SIGKILL to every Ray process of it) with cells left: its cells run again
  on node1 and the table is the same; nothing is lost.
"""

from __future__ import annotations

import csv
import io
import os
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import yaml
from cluster_util import (
    REPO,
    kill_ray,
    on,
    ray_cluster_on,
    ray_pids,
    s3_fs,
    start_mlflow,
    stop_mlflow,
)

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

BUCKET = rigmod.S3_BUCKET
RUN = f"s3://{BUCKET}/evalc/run"
MLFLOW = 5001  # not the other modules' server's port (5000)
SEEDS = [0, 1, 2, 3, 4]
CELLS = 4 * len(SEEDS)  # random and 3 checkpoints, one task
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def mlflow(rig):
    """The server with auth; every stage signs in as its job's user (the job's password
    file on every host and the laptop)."""
    server = start_mlflow(rig, "/mnt/local/evalc-mlflow.db", f"s3://{BUCKET}/evalc/mlflow",
                          f"{rig.root}/hosts/node0/local/evalc-mlflow.log", port=MLFLOW,
                          experiments=("evalc", "evalc-watched"),
                          auth_dir="/mnt/local/evalc-mlflow-auth")  # fmt: skip
    yield server
    stop_mlflow(rig, MLFLOW)


@pytest.fixture(scope="module")
def mlflow_url(mlflow):
    return mlflow.address  # by address: the laptop reaches it too


@pytest.fixture(scope="module")
def ray_cluster(rig, tmp_path_factory):
    with ray_cluster_on(rig, tmp_path_factory.mktemp("evalc-ray")) as cluster:
        yield cluster


def run_ok(argv: list[str], **kwargs) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def verb_rows(n: int, seed: int) -> str:
    """Which verb a sentence has: real text, learnable from a few rows."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        verb = ("reads", "writes")[i % 2]
        text = f"{rng.choice(['the cat', 'a dog', 'our model'])} {verb} {rng.choice(['a book', 'the file'])}"
        rows.append(f'{{"text": "{text}", "label": "{verb}"}}\n')
    return "".join(rows)


@pytest.fixture(scope="module")
def suite(rig, tiny_data, mlflow, mlflow_url, tmp_path_factory) -> Path:
    """The run on the bucket; the suite and its task files on the laptop and on node0,
    at the same paths."""
    base = tmp_path_factory.mktemp("evalc")
    # The data dir on the bucket too: the driver makes bundles with its tokenizer.
    pafs.copy_files(str(tiny_data), f"{BUCKET}/evalc/data", destination_filesystem=s3_fs(rig))
    env = {**os.environ, **rig.env(), **RANK_ENV, "PYTHONUNBUFFERED": "1",
           **mlflow.as_job(on_laptop=True)}  # fmt: skip
    run_ok([sys.executable, "-m", "pipeline.cli", "train",
                    str(REPO / "configs/test/bert-tiny.yaml"), f"data.path=s3://{BUCKET}/evalc/data",
                    f"train.out_dir={RUN}", "train.max_steps=15", "train.save_every=5",
                    "train.keep_last=3", "train.bundle_every=2", "train.eval_every=5",
                    "train.log_every=5", f"mlflow.tracking_uri={mlflow_url}", "name=evalc"],
                   env=env, cwd=base, timeout=600)  # fmt: skip
    files = {"train": base / "tasks" / "train.jsonl", "test": base / "tasks" / "test.jsonl"}
    files["train"].parent.mkdir()
    files["train"].write_text(verb_rows(48, 1))
    files["test"].write_text(verb_rows(16, 2))
    spec = {
        "name": "evalc", "seeds": SEEDS,
        "budget": {"epochs": 4, "micro_batch_size": 8, "lr": 1.0e-3},
        "tasks": {"verb": {"kind": "finetune",
                           "task": {"type": "classification", "max_length": 32},
                           "data": {k: str(v) for k, v in files.items()}}},
        "workers": {"cpus": 1},
        "mlflow": {"tracking_uri": mlflow_url},
    }  # fmt: skip
    path = base / "suite.yaml"
    path.write_text(yaml.safe_dump(spec))
    for f in (path, *files.values()):
        rig.put("node0", f, str(f))
    return path


def cells_of(text: str) -> dict[tuple, tuple]:
    """cells.csv as {(model, step, task, seed, metric): (value, error)}."""
    rows = list(csv.DictReader(io.StringIO(text)))
    return {(r["model"], r["step"], r["task"], r["seed"], r["metric"]): (r["value"], r["error"])
            for r in rows}  # fmt: skip


def hosts_of(text: str) -> dict[str, int]:
    """How many cells each host scored."""
    cells = {(r["model"], r["seed"]): r["host"] for r in csv.DictReader(io.StringIO(text))}
    return {h: list(cells.values()).count(h) for h in set(cells.values())}


@pytest.fixture(scope="module")
def alone(suite, rig, mlflow, tmp_path_factory) -> str:
    """The suite in one process on the laptop: cells.csv."""
    work = tmp_path_factory.mktemp("evalc-alone")
    env = {**os.environ, **rig.env(), "PYTHONUNBUFFERED": "1", **mlflow.as_job(on_laptop=True)}
    run_ok([sys.executable, "-m", "pipeline.cli", "eval", str(suite), f"work_dir={work}",
                    "--models", "random", RUN, "--no-ray"],
                   env=env, cwd=work, timeout=900)  # fmt: skip
    return (work / "report" / "cells.csv").read_text()


def submit(cluster, suite: Path, work: str, home: Path, mlflow) -> subprocess.Popen:
    """The driver and the cells sign in as the job's user: its name and the path of its
    password file (on every host) in the job's runtime_env, never the password."""
    sign_in = [f"--env={k}={v}" for k, v in mlflow.as_job().items() if k != "MLFLOW_TRACKING_URI"]
    argv = [sys.executable, str(REPO / "launch" / "ray_submit.py"), "--address",
            cluster.address, "--stage", "eval", "--job-id", f"plm-evalc-{secrets.token_hex(3)}",
            *sign_in, "--", str(suite), f"work_dir={work}", "--models", "random", RUN]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env = {**clean, "HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(cluster.token),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    return subprocess.Popen(argv, env=env, cwd=home, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def finish(proc: subprocess.Popen, lines: list[str], timeout: float = 900) -> str:
    """Follow ``proc`` to its end; its whole output."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        assert time.monotonic() < deadline, "".join(lines[-80:])
    proc.wait(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 0 and "SUCCEEDED" in out, out[-8000:]
    return out


def test_the_suite_on_two_hosts_gives_the_table_of_one_process(rig, ray_cluster, suite, alone,
                                                               mlflow, tmp_path):  # fmt: skip
    work = "/tmp/evalc-two"
    out = finish(submit(ray_cluster, suite, work, tmp_path, mlflow), [])
    there = rig.get("node0", f"{work}/report/cells.csv").decode()
    ours = cells_of(alone)
    assert len({k[:4] for k in ours}) == CELLS and all(v[1] == "" for v in ours.values())
    accuracy = [v[0] for k, v in ours.items() if k[4] == "accuracy"]
    assert len(set(accuracy)) > 2, accuracy  # models that differ: equal tables say something
    assert cells_of(there) == cells_of(alone), out[-6000:]
    assert set(hosts_of(there)) == {"node1", "node2"}
    # The workers had none of the driver's files: each got its copies through Ray, once
    # (a folder per stamp): the task's two files, and the bundles of the cells it ran.
    for host in ("node1", "node2"):
        names = rig.run(host, ["sh", "-c", "ls /tmp/plm-eval-files/*/"], capture_output=True,
                        text=True).stdout.split()  # fmt: skip
        assert names.count("train.jsonl") == names.count("test.jsonl") == 1, (host, names)
        assert any("step000000" in n for n in names), (host, names)


def test_a_worker_host_killed_mid_suite_loses_nothing(rig, ray_cluster, suite, alone, mlflow,
                                                      tmp_path):  # fmt: skip
    """node2 is killed once it has scored a cell and runs another: the cells it had, and
    those not yet started, run on node1; the table is that of one process."""
    if not ray_pids(rig, "node2"):
        ray_cluster.start_worker("node2")
    work = "/tmp/evalc-killed"
    proc = submit(ray_cluster, suite, work, tmp_path, mlflow)
    lines: list[str] = []
    deadline = time.monotonic() + 600
    while not any("(node2): " in x for x in lines):
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(lines[-80:])
        lines.append(line)
    while not cell_running(rig, "node2"):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-80:])
        time.sleep(0.05)
    killed = kill_ray(rig, "node2")
    out = finish(proc, lines)
    assert killed and ray_pids(rig, "node2") == []
    there = rig.get("node0", f"{work}/report/cells.csv").decode()
    assert cells_of(there) == cells_of(alone), out[-6000:]
    hosts = hosts_of(there)
    assert set(hosts) == {"node1", "node2"} and sum(hosts.values()) == CELLS, hosts
    assert hosts["node2"] < hosts["node1"], hosts  # node2 stopped early
    assert "FAILED" not in out
    print(
        f"node2 killed ({len(killed)} Ray processes) after {hosts['node2']} of {CELLS} "
        f"cells; node1 scored the other {hosts['node1']}"
    )


def cell_running(rig, host: str) -> bool:
    """A Ray worker of ``host`` is running a cell (its title names the task)."""
    for pid in ray_pids(rig, host):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::_timed_on_ray"):
            return True
    return False


def test_watch_on_a_host_of_its_own_scores_every_checkpoint(rig, suite, mlflow, mlflow_url):
    """Training on node1 onto the bucket, `plm eval --watch` of its run on node2 with a
    local Ray of its own (no cluster): each checkpoint is scored once complete on the
    store, and the watcher ends once training's final bundle is there and every
    checkpoint then present is scored. (Training's time per step beside the watcher, on
    CPUs of its own: bench/bench_eval_watch.py.)"""
    run = f"s3://{BUCKET}/evalc/watched"
    files = [suite, *(Path(p) for p in yaml.safe_load(suite.read_text())["tasks"]["verb"]
                      ["data"].values())]  # fmt: skip
    for f in files:
        rig.put("node2", f, str(f))
    work = "/tmp/evalc-watch"
    watcher = rig.popen("node2", [sys.executable, "-m", "pipeline.cli", "eval", str(suite),
                                  "seeds=[0]", f"work_dir={work}", "--watch", run, "--poll-s", "1"],
                        env={**os.environ, "PYTHONUNBUFFERED": "1", **mlflow.as_job()}, cwd="/",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        on(rig, "node1", [sys.executable, "-m", "pipeline.cli", "train",
                          str(REPO / "configs/test/bert-tiny.yaml"),
                          f"data.path=s3://{BUCKET}/evalc/data", f"train.out_dir={run}",
                          "train.max_steps=15", "train.save_every=5", "train.keep_last=3",
                          "train.eval_every=5", "train.log_every=5",
                          f"mlflow.tracking_uri={mlflow_url}", "name=evalc-watched"],
           env={**RANK_ENV, **mlflow.as_job()})  # fmt: skip
        out, _ = watcher.communicate(timeout=900)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, out[-6000:]
    rows = list(csv.DictReader(io.StringIO(rig.get("node2", f"{work}/report/cells.csv").decode())))
    assert sorted({int(r["step"]) for r in rows if r["value"]}) == [5, 10, 15], out[-6000:]
    assert {r["host"] for r in rows} == {"node2"}
