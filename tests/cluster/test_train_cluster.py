"""Training across hosts: 2 hosts x 2 ranks, gloo over the rig's links, reading the data
dir from S3 (range reads into each node's own cache), checkpoints on the shared dir, every
host logging to one MLflow server on node0 (backend store on node0's disk, artifacts on S3).

- the `deepspeed` launcher with a hostfile, over ssh/pdsh, from node0;
- the per-node form (`--no-ssh --node-rank R`), one command per host, resuming the first
  run's step-3 checkpoint: its steps 4-6 are the first run's, bit for bit;
- the losses equal a one-host run with the same global batch (within 1e-4 relative);
- from the laptop, `mlflow.pyfunc.load_model("models:/...")`; `plm finetune` on node1
  starts from the registered model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pyarrow.fs as pafs
import pytest
from cluster_util import REPO, listeners, on, tool, wait_port
from conftest import build_data_dir

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

BERT = str(REPO / "configs/test/bert-tiny.yaml")
MLFLOW_PORT = 5000
STEPS = ["train.max_steps=6", "train.save_every=3", "train.eval_every=0", "train.log_every=1"]
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def s3_data(rig):
    """A tiny data dir prepared locally, uploaded to the rig's bucket: (local, s3 URI)."""
    (rig.shared / "tiny").mkdir()
    local = build_data_dir(rig.shared / "tiny")
    s3 = pafs.S3FileSystem(endpoint_override=rig.s3_endpoint, access_key=rig.aws_key,
                           secret_key=rig.aws_secret, region="us-east-1", scheme="http")  # fmt: skip
    pafs.copy_files(str(local), f"{rigmod.S3_BUCKET}/train/data", destination_filesystem=s3)
    return local, f"s3://{rigmod.S3_BUCKET}/train/data"


@pytest.fixture(scope="module")
def mlflow_server(rig):
    """`mlflow server` on node0: sqlite on node0's own disk, artifacts proxied to S3."""
    node0 = rig.hosts[0]
    log = open(f"{rig.root}/hosts/node0/local/mlflow.log", "wb")  # noqa: SIM115
    rig.popen("node0", [
        tool("mlflow"), "server", "--host", node0.address, "--port", str(MLFLOW_PORT),
        "--allowed-hosts", f"{node0.address}:{MLFLOW_PORT},node0:{MLFLOW_PORT}",
        "--backend-store-uri", "sqlite:////mnt/local/mlflow.db",
        "--artifacts-destination", f"s3://{rigmod.S3_BUCKET}/mlflow", "--workers", "1",
    ], cwd="/", stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    wait_port(node0.address, MLFLOW_PORT)
    return f"http://node0:{MLFLOW_PORT}", f"http://{node0.address}:{MLFLOW_PORT}"


def losses(run_dir) -> dict[int, float]:
    """step -> loss, from rank 0's metrics.jsonl (a resumed run's rows after the old ones)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_loss"] for r in rows if "step_loss" in r}


class ListenerWatch(threading.Thread):
    """Every TCP listener of the training ranks on the given hosts while a launch runs."""

    def __init__(self, rig, hosts):
        super().__init__(daemon=True)
        self.rig, self.hosts, self.seen, self.done = rig, hosts, set(), threading.Event()

    def run(self):
        while not self.done.is_set():
            for host in self.hosts:
                for address, port, _name, pid in listeners(self.rig, host):
                    try:
                        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
                    except OSError:
                        continue
                    if b"pipeline.cli" in cmd and b" train " in cmd:
                        self.seen.add((host, address, port))
            time.sleep(0.2)


@pytest.fixture(scope="module")
def hostfile_run(rig, s3_data, mlflow_server):
    _, uri = s3_data
    hostfile = rig.shared / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    run_dir = rig.shared / "runs" / "hostfile"
    watch = ListenerWatch(rig, ["node0", "node1"])
    watch.start()
    try:
        proc = on(rig, "node0", [
            sys.executable, str(REPO / "launch" / "deepspeed_train.py"), "--hostfile",
            str(hostfile), "--master-addr", "node0", BERT, f"data.path={uri}",
            f"train.out_dir={run_dir}", "name=bert-rig", *STEPS,
        ], env={**RANK_ENV, "MLFLOW_TRACKING_URI": mlflow_server[0]}, cwd=str(rig.shared))  # fmt: skip
    finally:
        watch.done.set()
        watch.join()
    return run_dir, proc, watch.seen


def test_hostfile_launch_over_ssh_matches_one_host(rig, s3_data, hostfile_run, tmp_path):
    run_dir, proc, _ = hostfile_run
    assert "world size 4" in proc.stdout + proc.stderr
    # Ranks 2 and 3 ran on node1 (pdsh prefixes their lines with the host).
    assert "node1: " in proc.stdout
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for tag in ("step00000003", "step00000006"):  # on the shared dir, all four ranks' state
        ckpt = run_dir / "checkpoints" / tag
        assert all((ckpt / f"trainer_rank{r}.pt").is_file() for r in range(4)), tag
    # One host, one rank, the same global batch (8 x 4 = 8 x 4 ranks): the same losses.
    local, _ = s3_data
    ref_dir = tmp_path / "one-host"
    subprocess.run([sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={local}",
                    f"train.out_dir={ref_dir}", "train.grad_accum=4", "mlflow.register=false",
                    f"mlflow.tracking_uri=sqlite:///{tmp_path / 'ref.db'}", *STEPS],
                   env={**os.environ, **RANK_ENV}, check=True, capture_output=True,
                   cwd=tmp_path)  # fmt: skip
    ref = losses(ref_dir)
    for step, value in ref.items():
        assert got[step] == pytest.approx(value, rel=1e-4), (step, got, ref)


def test_each_node_reads_only_blocks_into_its_own_cache(rig, s3_data, hostfile_run):
    """The training hosts fetched blocks into their own /tmp (the default data.cache_dir);
    no host holds a shard file, and the host that did not train has no cache."""
    local, _ = s3_data
    shard_bytes = sum(p.stat().st_size for p in local.glob("*/*.tar"))
    cache = f"/tmp/plm-cache-{os.getuid()}"
    for host in ("node0", "node1"):
        listing = on(rig, host, ["find", cache, "-type", "f", "-printf", "%s %P\\n"]).stdout
        files = [
            (int(size), name) for size, name in (x.split(" ", 1) for x in listing.splitlines())
        ]
        blocks = [(size, name) for size, name in files if not name.startswith("meta/")]
        assert blocks, (host, listing)
        assert sum(size for size, _ in blocks) <= shard_bytes
        tars = on(rig, host, ["find", "/tmp", "/mnt/local", "-name", "*.tar"]).stdout
        assert tars == "", tars
    assert on(rig, "node2", ["test", "-e", cache], check=False).returncode == 1


def test_the_rendezvous_and_gloo_listen_on_the_hosts_own_addresses(rig, hostfile_run):
    _, _, seen = hostfile_run
    assert seen, "no listener of a training rank was seen during the run"
    master = [(h, a, p) for h, a, p in seen if p == 29500]
    assert master == [("node0", rig.host("node0").address, 29500)], seen
    for host, address, port in seen:
        assert address == rig.host(host).address, (host, address, port)


def test_per_node_launch_resumes_bit_for_bit(rig, s3_data, hostfile_run, mlflow_server):
    """The form for containers and Slurm steps: the same command on every node with its
    --node-rank; it resumes the hostfile run's step-3 checkpoint from the shared dir."""
    _, uri = s3_data
    first, _, _ = hostfile_run
    run_dir = rig.shared / "runs" / "per-node"
    shutil.copytree(first, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step00000006")
    (run_dir / "checkpoints" / "latest").write_text("step00000003")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **RANK_ENV,
           "MLFLOW_TRACKING_URI": mlflow_server[0]}  # fmt: skip
    procs = [
        rig.popen(
            f"node{r}",
            [
                sys.executable,
                str(REPO / "launch" / "deepspeed_train.py"),
                "--hostfile",
                str(rig.shared / "hostfile"),
                "--no-ssh",
                "--node-rank",
                str(r),
                "--master-addr",
                "node0",
                "--master-port",
                "29600",
                BERT,
                f"data.path={uri}",
                f"train.out_dir={run_dir}",
                "name=bert-rig",
                "mlflow.register=false",
                *STEPS,
            ],
            env=env,
            cwd=str(rig.shared),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "resumed from" in outs[0]
    want, got = losses(first), losses(run_dir)
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]  # bitwise


def test_laptop_loads_the_registered_model_and_node1_finetunes_it(
    rig, hostfile_run, mlflow_server, tmp_path
):
    _, address = mlflow_server
    # The laptop has no S3 keys: the artifacts come through the server (proxied).
    code = ("import mlflow, pandas as pd; m = mlflow.pyfunc.load_model('models:/bert-rig@current');"
            " out = m.predict(pd.DataFrame({'text': ['the cat reads the book']}));"
            " print('rows', len(out))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["MLFLOW_TRACKING_URI"] = address
    loaded = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert loaded.returncode == 0 and "rows 1" in loaded.stdout, loaded.stderr[-3000:]

    import yaml

    task = rig.shared / "task"
    task.mkdir(exist_ok=True)
    verbs = ["reads", "writes", "sees"]
    for split, n in (("train", 24), ("valid", 6), ("test", 6)):
        rows = [{"text": f"the cat {verbs[i % 3]} the book today", "label": verbs[i % 3]}
                for i in range(n)]  # fmt: skip
        (task / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = rig.shared / "ft.yaml"
    config.write_text(yaml.safe_dump({
        "name": "bert-rig-verb", "model": {"source": "models:/bert-rig@current"},
        "task": {"type": "classification", "max_length": 32},
        "data": {s: str(task / f"{s}.jsonl") for s in ("train", "valid", "test")},
        "train": {"epochs": 1, "micro_batch_size": 8, "lr": 1.0e-3, "out_dir": "/mnt/local/ft"},
    }))  # fmt: skip
    out = on(rig, "node1", [sys.executable, "-m", "pipeline.cli", "finetune", str(config)],
             env={**RANK_ENV, "MLFLOW_TRACKING_URI": mlflow_server[0]}, cwd=str(rig.shared))  # fmt: skip
    assert "registered model bert-rig-verb" in out.stdout, out.stdout[-3000:]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=address)
    mv = client.get_model_version_by_alias("bert-rig-verb", "current")
    run = client.get_run(mv.run_id)
    assert run.data.tags.get("source_uri") == "models:/bert-rig@current"


def test_mlflow_listens_on_node0s_address(rig, mlflow_server):
    node0 = rig.hosts[0].address
    mine = [(a, p) for a, p, _, _ in listeners(rig, "node0") if p == MLFLOW_PORT]
    assert mine == [(node0, MLFLOW_PORT)]
