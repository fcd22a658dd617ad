"""docs/cluster.md's tutorial on a rig whose hosts share nothing but the bucket (the rig's
default: the machine's files read-only on every host, files copied onto a host with
`Rig.put`, what `plm rig cp` and scp are). One rig and one Ray cluster for the module:

- Ray: the head with no CPUs on node0, workers on node1 and node2, token authentication
  (each host's own copy of the token); the tokenizer trained from the laptop straight to
  `s3://`, then `ray job submit` of `plm data prepare --near-dedup on` from s3:// to s3://
  (a corpus with planted near-duplicates): the shards, counts and rejects are those of a
  local one-CPU run and the manifest names the hosts that wrote them;
- one MLflow server on node0 with MLflow's users (`--app-name basic-auth`; its store,
  secrets and users on node0's disk, the artifacts on S3): training and the fine-tune
  sign in as the job's user, the laptop reads as the viewer;
- training across 2 hosts x 2 ranks with `train.out_dir=s3://...`, the `deepspeed`
  launcher over ssh/pdsh from node0: the losses equal a one-host run with the same global
  batch (within 1e-4 relative); every rank's checkpoint files, `latest`, the bundle and
  metrics.jsonl on the store;
- the per-node form (`--no-ssh --node-rank R`) resuming the first run's step-3 checkpoint
  from the store alone (a copy of the run under another prefix, nothing staged on the
  hosts): its steps 4-6 are the first run's, bit for bit;
- from the laptop, `mlflow.pyfunc.load_model("models:/...")`; `plm finetune` on node1
  starts from the registered model (its password in the tracking URI's user part);
  `plm export --to hf` on node1;
- what listens where;
- issue 49: anonymous 401 and viewer 403 on every write the issue names, the viewer
  reads; a wrong password stops `plm train` on node1 before step 1 (exit 2); the S3 keys
  in a URI are refused, shown as `***@`; last, no secret of the run (S3 keys, Ray token,
  MLflow passwords, Flask key) in any file it wrote, on any host, in the bucket or in
  any output.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from cluster_util import (
    JOB,
    MLFLOW_PORT,
    REPO,
    VIEWER,
    assert_same_shards,
    find_secrets,
    listeners,
    on,
    pids_of,
    s3_fs,
    small_rig,
    start_mlflow,
    tool,
)
from conftest import synthetic_corpus
from mlflow_auth_util import assert_refused_everywhere, call, refused_before_any_step, signed_in

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

BERT = str(REPO / "configs/test/bert-tiny.yaml")
GCS_PORT, DASHBOARD_PORT = 6379, 8265
STEPS = ["train.max_steps=6", "train.save_every=3", "train.eval_every=0", "train.log_every=1"]
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
BUCKET = rigmod.S3_BUCKET
TOKEN = "~/.ray/auth_token"  # each host's own copy (the host's private ~/.ray)
# Ray 2.60's C++ gRPC servers (GCS, raylet, object manager), the dashboard agent and the
# autoscaler monitor take no bind address: they listen on the wildcard, which inside a
# host is its own address and its loopback (the only two it has: test_rig checks that).
RAY_WILDCARD = ("gcs_server", "raylet", "ray::DashboardA", "python3.11", "python3", "python")
PREPARE = ["--shard-docs", "40", "--valid-fraction", "0.1", "--split-bytes", "20000"]
MODEL, FT_MODEL = "bert-rig", "bert-rig-verb"  # the job's experiments and registered models
OUTPUTS: list[str] = []  # what the module's commands printed: searched for secrets at the end


def kept(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    OUTPUTS.append(f"{proc.stdout or ''}{proc.stderr or ''}")  # not argv: a test's own
    return proc


@pytest.fixture(scope="module")
def rig():
    """3 hosts that share nothing but the bucket; this module's own, so that the tutorial's
    Ray cluster and MLflow server use the default ports on hosts nothing else touched."""
    name = f"u{os.getpid()}"
    made = small_rig(name, 3)
    try:
        assert not made.shared_dir
        yield made
    finally:
        rigmod.down(name)


def laptop(rig, argv: list[str], cwd, **env) -> subprocess.CompletedProcess:
    """A command on the laptop (the root namespace) with `plm rig env`'s variables."""
    full = {**os.environ, **rig.env(), "PYTHONUNBUFFERED": "1", **env}
    done = subprocess.run(argv, env=full, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return kept(done)


@pytest.fixture(scope="module")
def ray_cluster(rig, tmp_path_factory):
    """The token made on the laptop and copied onto each host; the head, then the workers."""
    token = tmp_path_factory.mktemp("ray") / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    for h in rig.hosts:
        rig.put(h.name, token, TOKEN, mode=0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path.home() / ".ray/auth_token")}
    head = rig.hosts[0].address
    on(rig, "node0", [tool("ray"), "start", "--head", "--node-ip-address", head,
                      "--port", str(GCS_PORT), "--num-cpus", "0", "--dashboard-host", head,
                      "--dashboard-port", str(DASHBOARD_PORT), "--include-dashboard", "true",
                      "--disable-usage-stats"], env=auth, timeout=180)  # fmt: skip
    for h in rig.hosts[1:]:
        on(rig, h.name, [tool("ray"), "start", "--address", f"{head}:{GCS_PORT}",
                         "--node-ip-address", h.address, "--num-cpus", "1",
                         "--disable-usage-stats"], env=auth, timeout=180)  # fmt: skip
    # No `ray stop` at the end: it stops every Ray process of the machine. The rig's
    # `down` stops these, by the PIDs of its namespaces.
    return {"address": f"http://{head}:{DASHBOARD_PORT}", "token": token}


def submit(cluster, args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    return kept(subprocess.run([sys.executable, str(REPO / "launch" / "ray_submit.py"),
                                "--address", cluster["address"], *args],
                               env={**clean, **env}, capture_output=True, text=True,
                               timeout=600, cwd=REPO))  # fmt: skip


@pytest.fixture(scope="module")
def prepared(rig, ray_cluster, tmp_path_factory):
    """Steps 1b-2: a corpus on S3 (two text files and, for `--near-dedup on`, jsonl files
    with planted near-duplicates), the tokenizer from the laptop to S3, the data job from
    s3:// to s3:// on the cluster, and the same `plm data prepare` on the laptop on one CPU."""
    sys.path.insert(0, str(REPO / "bench"))
    import planted_corpus

    work = tmp_path_factory.mktemp("tutorial")
    s3 = s3_fs(rig)
    texts = {"a.txt": synthetic_corpus(300, seed=1), "b.txt": synthetic_corpus(200, seed=2)}
    docs, pairs = planted_corpus.generate(300_000, seed=5)
    planted = planted_corpus.write(work / "planted", docs, pairs, n_files=2)
    texts.update((path.name, path.read_text()) for path in planted)
    for name, text in texts.items():
        with s3.open_output_stream(f"{BUCKET}/corpus/{name}") as f:
            f.write(text.encode())
    laptop(rig, [sys.executable, "-m", "pipeline.cli", "data", "tokenizer", "--input",
                 f"s3://{BUCKET}/corpus/", "--kind", "wordpiece", "--vocab-size", "300",
                 "--output", f"s3://{BUCKET}/tok"], work)  # fmt: skip
    prepare = ["--input", f"s3://{BUCKET}/corpus/", "--tokenizer", f"s3://{BUCKET}/tok", *PREPARE,
               "--near-dedup", "on"]  # fmt: skip
    # Without the token the cluster refuses the laptop.
    refused = submit(ray_cluster, ["--", *prepare, "--output", f"s3://{BUCKET}/refused"],
                     HOME=str(work))  # fmt: skip
    assert refused.returncode == 2 and "token" in refused.stderr, refused.stderr
    done = submit(ray_cluster, ["--job-id", f"plm-rig-{secrets.token_hex(3)}", "--", *prepare,
                                "--output", f"s3://{BUCKET}/data"],
                  HOME=str(work), RAY_AUTH_TOKEN_PATH=str(ray_cluster["token"]))  # fmt: skip
    assert done.returncode == 0 and "SUCCEEDED" in done.stderr, done.stdout + done.stderr
    local = work / "local"
    laptop(rig, [sys.executable, "-m", "pipeline.cli", "data", "prepare", *prepare, "--output",
                 str(local), "--num-cpus", "1"], work)  # fmt: skip
    return {"uri": f"s3://{BUCKET}/data", "local": local, "work": work}


def test_prepare_with_near_dedup_from_s3_to_s3_on_the_cluster(rig, prepared):
    """The shards, counts and reject examples of the cluster's job are those of a local
    one-CPU run, `--near-dedup on` included: the signatures are computed where the units
    are written, the band reducers and the components run anywhere."""
    from pipeline.data.shards import manifest_bytes

    ours, theirs = assert_same_shards(s3_fs(rig), f"{BUCKET}/data", prepared["local"])
    assert theirs["stats"]["units"] >= 4
    # The head ran no task; both workers wrote parts; the manifest names them.
    assert theirs["stats"]["writer_hosts"] == ["node1", "node2"]
    assert ours["stats"]["writer_hosts"] == [os.uname().nodename]
    assert manifest_bytes(theirs["tokenizer"]) == manifest_bytes(ours["tokenizer"])
    assert ours["rejected"]["near_duplicate"] >= 10
    for key in ("rejected", "reject_examples", "totals", "data_config"):
        assert theirs[key] == ours[key], key


@pytest.fixture(scope="module")
def mlflow_server(rig):
    """Step 3: `mlflow server --app-name basic-auth` on node0: sqlite on node0's own disk,
    artifacts proxied to S3, its secrets in /mnt/local/mlflow-auth; the job's user (EDIT
    on the pretraining's and the fine-tune's experiment and model) and the viewer."""
    return start_mlflow(rig, "/mnt/local/mlflow.db", f"s3://{BUCKET}/mlflow",
                        f"{rig.root}/hosts/node0/local/mlflow.log",
                        experiments=(MODEL, FT_MODEL))  # fmt: skip


def store_rows(rig, prefix: str) -> list[dict]:
    with s3_fs(rig).open_input_stream(f"{BUCKET}/{prefix}/metrics.jsonl") as f:
        return [json.loads(x) for x in f.read().decode().splitlines() if x.strip()]


def losses(rows: list[dict]) -> dict[int, float]:
    """step -> loss (a resumed run's rows after the old ones: the last row of a step)."""
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
def hostfile_run(rig, prepared, mlflow_server):
    """Step 4: from node0 over ssh, checkpoints and bundles on the bucket."""
    rig.put("node0", "node0 slots=2\nnode1 slots=2\n", "/mnt/local/hostfile")
    watch = ListenerWatch(rig, ["node0", "node1"])
    watch.start()
    try:
        proc = kept(on(rig, "node0", [
            sys.executable, str(REPO / "launch" / "deepspeed_train.py"), "--hostfile",
            "/mnt/local/hostfile", "--master-addr", "node0", BERT, f"data.path={prepared['uri']}",
            f"train.out_dir=s3://{BUCKET}/runs/bert", f"name={MODEL}", *STEPS,
        ], env={**RANK_ENV, **mlflow_server.as_job()}))  # fmt: skip
    finally:
        watch.done.set()
        watch.join()
    return "runs/bert", proc, watch.seen


def test_hostfile_launch_over_ssh_matches_one_host(rig, prepared, hostfile_run, tmp_path):
    prefix, proc, _ = hostfile_run
    assert "world size 4" in proc.stdout + proc.stderr
    # Ranks 2 and 3 ran on node1 (pdsh prefixes their lines with the host).
    assert "node1: " in proc.stdout
    got = losses(store_rows(rig, prefix))
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    # On the store: every rank's state of both checkpoints, `latest` naming the last, the
    # bundle. Nothing of the run on the laptop or in a shared place.
    s3 = s3_fs(rig)
    names = {i.path.split(f"{prefix}/", 1)[1] for i in s3.get_file_info(
        pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True)) if i.is_file}  # fmt: skip
    for tag in ("step00000003", "step00000006"):
        assert {f"checkpoints/{tag}/trainer_rank{r}.pt" for r in range(4)} <= names, tag
        assert f"checkpoints/{tag}/COMPLETE" in names
    with s3.open_input_stream(f"{BUCKET}/{prefix}/checkpoints/latest") as f:
        assert f.read().decode().strip() == "step00000006"
    assert any(n.startswith("bundles/final/") for n in names), sorted(names)
    # One host, one rank, the same global batch (8 x 4 = 8 x 4 ranks): the same losses.
    ref_dir = tmp_path / "one-host"
    subprocess.run([sys.executable, "-m", "pipeline.cli", "train", BERT,
                    f"data.path={prepared['local']}", f"train.out_dir={ref_dir}",
                    "train.grad_accum=4", "mlflow.register=false",
                    f"mlflow.tracking_uri=sqlite:///{tmp_path / 'ref.db'}", *STEPS],
                   env={**os.environ, **RANK_ENV}, check=True, capture_output=True,
                   cwd=tmp_path)  # fmt: skip
    ref = losses([json.loads(x) for x in (ref_dir / "metrics.jsonl").read_text().splitlines()])
    for step, value in ref.items():
        assert got[step] == pytest.approx(value, rel=1e-4), (step, got, ref)


def test_each_node_reads_only_blocks_into_its_own_cache(rig, prepared, hostfile_run):
    """The training hosts fetched blocks into their own /tmp (the default data.cache_dir);
    no host holds a shard file, and the host that did not train has no cache."""
    shard_bytes = sum(p.stat().st_size for p in prepared["local"].glob("*/*.tar"))
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


def test_per_node_launch_resumes_from_the_store_bit_for_bit(rig, prepared, hostfile_run,
                                                            mlflow_server):  # fmt: skip
    """The form for containers and Slurm steps: the same command on every node with its
    --node-rank (the hostfile copied onto each). It resumes the hostfile run's step-3
    checkpoint from a copy of the run under another prefix: no host has a file of it staged,
    so each rank fetches its own files (and those every rank reads) from the store."""
    first, _, _ = hostfile_run
    s3 = s3_fs(rig)
    src, dst = f"{BUCKET}/{first}", f"{BUCKET}/runs/per-node"
    for info in s3.get_file_info(pafs.FileSelector(src, recursive=True)):
        rel = info.path[len(src) + 1 :]
        if info.is_file and not rel.startswith(("checkpoints/step00000006/", "bundles/")):
            s3.copy_file(info.path, f"{dst}/{rel}")
    with s3.open_output_stream(f"{dst}/checkpoints/latest") as f:
        f.write(b"step00000003")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **RANK_ENV, **mlflow_server.as_job()}
    procs = []
    for r in (0, 1):
        rig.put(f"node{r}", "node0 slots=2\nnode1 slots=2\n", "/mnt/local/hostfile")
        procs.append(rig.popen(f"node{r}", [
            sys.executable, str(REPO / "launch" / "deepspeed_train.py"), "--hostfile",
            "/mnt/local/hostfile", "--no-ssh", "--node-rank", str(r), "--master-addr", "node0",
            "--master-port", "29600", BERT, f"data.path={prepared['uri']}",
            "train.out_dir=s3://plm/runs/per-node", "name=bert-rig", "mlflow.register=false",
            *STEPS,
        ], env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    OUTPUTS.extend(outs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "resumed from" in outs[0]
    # Each rank fetched its own files (the ones every rank reads: one rank of the node),
    # none of another rank's.
    for node, out in enumerate(outs):
        for rank in (2 * node, 2 * node + 1):
            said = re.search(rf"rank {rank}: fetched \d+ files \([^)]*\) of \S+ into \S+: "
                             r"([\w.]+(?:, [\w.]+)*)", out)  # fmt: skip
            assert said, out[-3000:]
            names = set(said[1].split(", "))
            assert f"trainer_rank{rank}.pt" in names, said[0]
            theirs = [n for r in range(4) if r != rank for n in names
                      if f"rank{r}." in n or f"rank_{r}_" in n]  # fmt: skip
            assert not theirs, said[0]
    want, got = losses(store_rows(rig, first)), losses(store_rows(rig, "runs/per-node"))
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]  # bitwise
    with s3.open_input_stream(f"{dst}/checkpoints/latest") as f:
        assert f.read().decode().strip() == "step00000006"


def test_laptop_loads_the_registered_model_and_node1_finetunes_it(
    rig, hostfile_run, mlflow_server, tmp_path
):
    # The laptop has no S3 keys: the artifacts come through the server (proxied). It
    # reads as the viewer.
    code = ("import mlflow, pandas as pd; m = mlflow.pyfunc.load_model('models:/bert-rig@current');"
            " out = m.predict(pd.DataFrame({'text': ['the cat reads the book']}));"
            " print('rows', len(out))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(mlflow_server.as_viewer())
    loaded = kept(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, cwd=tmp_path, timeout=300))  # fmt: skip
    assert loaded.returncode == 0 and "rows 1" in loaded.stdout, loaded.stderr[-3000:]

    import yaml

    # The task's files and config, copied onto node1 (its own disk).
    verbs = ["reads", "writes", "sees"]
    for split, n in (("train", 24), ("valid", 6), ("test", 6)):
        rows = [{"text": f"the cat {verbs[i % 3]} the book today", "label": verbs[i % 3]}
                for i in range(n)]  # fmt: skip
        rig.put("node1", "".join(json.dumps(r) + "\n" for r in rows),
                f"/mnt/local/task/{split}.jsonl")  # fmt: skip
    rig.put("node1", yaml.safe_dump({
        "name": FT_MODEL, "model": {"source": f"models:/{MODEL}@current"},
        "task": {"type": "classification", "max_length": 32},
        "data": {s: f"/mnt/local/task/{s}.jsonl" for s in ("train", "valid", "test")},
        "train": {"epochs": 1, "micro_batch_size": 8, "lr": 1.0e-3, "out_dir": "/mnt/local/ft"},
    }), "/mnt/local/ft.yaml")  # fmt: skip
    # As the job's user, its password in the URI's user part (in the environment, never
    # on a command line): plm takes it out of the URI, so no URI it shows or logs has it.
    secret = rig.get("node1", mlflow_server.password_file(JOB)).decode().strip()
    with_user = mlflow_server.url.replace("http://", f"http://{JOB}:{secret}@")
    out = kept(on(rig, "node1", [sys.executable, "-m", "pipeline.cli", "finetune",
                                 "/mnt/local/ft.yaml"],
                  env={**RANK_ENV, "MLFLOW_TRACKING_URI": with_user}))  # fmt: skip
    assert f"registered model {FT_MODEL}" in out.stdout, out.stdout[-3000:]

    from mlflow import MlflowClient

    with signed_in(VIEWER, mlflow_server.password(VIEWER)):
        client = MlflowClient(tracking_uri=mlflow_server.address)
        mv = client.get_model_version_by_alias(FT_MODEL, "current")
        run = client.get_run(mv.run_id)
    assert run.data.tags.get("source_uri") == f"models:/{MODEL}@current"


def test_the_store_out_of_reach_mid_upload_never_leaves_latest_on_a_partial_checkpoint(
    rig, prepared, tmp_path
):
    """node2 trains alone (one rank; the data and MLflow's store on its own disk, its working
    directory too: a sqlite store keeps artifacts in ./mlruns; out_dir on the bucket). Its
    link goes down (`ip link set eth0 down` in its namespace: the bucket out of reach)
    while checkpoints upload, and comes back 8 s later: the upload in flight stalls and
    goes on when the link is back (TCP's retransmissions, no error: the retries after an
    error are tests/unit/test_out_store.py's), training goes on until the next save, which
    waits for it (one checkpoint in flight), and the run finishes with its last checkpoints
    whole on the store. Down again with the trainer killed meanwhile: `latest` on the
    store names a whole checkpoint, never the one in flight, and the same command resumes
    from it. A bucket that does not exist: one `plm:` line, exit 2, before any step."""
    s3, uri, stage = s3_fs(rig), f"s3://{BUCKET}/runs/outage", "/mnt/local/outage-stage"
    on(rig, "node2", [sys.executable, "-c", "import pyarrow.fs as f; f.copy_files("
                      f"'s3://{BUCKET}/data', '/mnt/local/data')"])  # fmt: skip
    # In /mnt/local (nsenter cannot start a command in a folder of the host's own disk).
    args = ["sh", "-c", 'cd /mnt/local && exec "$@"', "sh", sys.executable, "-m",
            "pipeline.cli", "train", BERT, "data.path=/mnt/local/data",
            f"train.out_dir={uri}", f"train.local_dir={stage}", "train.save_every=5",
            "train.eval_every=0", "train.keep_last=2", "mlflow.register=false",
            "mlflow.tracking_uri=sqlite:////mnt/local/outage.db"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **RANK_ENV}
    netns = rig.host("node2").netns

    def link(state: str) -> None:  # node2's own end: down, its routes go and connects fail
        subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "eth0", state],
                       check=True)  # fmt: skip

    def start(steps: int, log: str) -> subprocess.Popen:
        out = open(tmp_path / log, "wb")  # noqa: SIM115
        return rig.popen("node2", [*args, f"train.max_steps={steps}"], env=env, cwd="/",
                         stdout=out, stderr=subprocess.STDOUT)  # fmt: skip

    def staged(step: int) -> bool:
        folder = f"{stage}/checkpoints/step{step:08d}"
        return on(rig, "node2", ["test", "-d", folder], check=False).returncode == 0

    def wait_for(check, what: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 300
        while not check():
            assert proc.poll() is None and time.monotonic() < deadline, what
            time.sleep(0.2)

    def whole(tag: str) -> bool:
        names = {i.base_name for i in s3.get_file_info(pafs.FileSelector(
            f"{BUCKET}/runs/outage/checkpoints/{tag}", allow_not_found=True))}  # fmt: skip
        return {"COMPLETE", "mp_rank_00_model_states.pt", "trainer_rank0.pt"} <= names

    def latest() -> str:
        with s3.open_input_stream(f"{BUCKET}/runs/outage/checkpoints/latest") as f:
            return f.read().decode().strip()

    proc = start(30, "first.log")
    try:
        wait_for(lambda: staged(10), "a second checkpoint staged", proc)
        link("down")
        time.sleep(8)
    finally:
        link("up")
    assert proc.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-4000:]
    assert latest() == "step00000030" and whole("step00000030") and whole("step00000025")
    assert not whole("step00000020")  # keep_last=2 on the store

    proc = start(400, "second.log")
    try:
        wait_for(lambda: staged(40), "a checkpoint staged after the resume", proc)
        link("down")
        time.sleep(2)
        for pid in pids_of(rig, "node2", b"pipeline.cli\0train"):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        link("up")
    tag = latest()
    assert "step00000030" <= tag <= "step00000040" and whole(tag), tag
    done = on(rig, "node2", [*args, f"train.max_steps={int(tag[4:]) + 2}"], env=env)
    assert f"resumed from {uri}/checkpoints/{tag}" in done.stdout, done.stdout[-3000:]

    bad = [a if not a.startswith("train.out_dir=") else "train.out_dir=s3://no-such-bucket/run"
           for a in args]  # fmt: skip
    missing = on(rig, "node2", [*bad, "train.max_steps=2"], env=env, check=False)
    lines = [x for x in missing.stderr.splitlines() if x.startswith("plm:")]
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr[-3000:]
    assert "s3://no-such-bucket/run" in lines[0] and "does not exist" in lines[0], lines
    assert "step 1:" not in missing.stdout


def test_what_listens_where(rig, ray_cluster, mlflow_server):
    node0 = rig.hosts[0].address
    mine = [(a, p) for a, p, _, _ in listeners(rig, "node0") if p == MLFLOW_PORT]
    assert mine == [(node0, MLFLOW_PORT)]
    for h in rig.hosts:
        for address, port, name, _pid in listeners(rig, h.name):
            if address in (h.address, "127.0.0.1"):
                continue
            assert address in ("*", "0.0.0.0", "::") and name in RAY_WILDCARD, (
                h.name, address, port, name)  # fmt: skip
    head = {(a, p) for a, p, _, _ in listeners(rig, "node0")}
    assert (node0, DASHBOARD_PORT) in head  # the dashboard: node0's address
    assert (node0, 22) in head and (node0, rigmod.S3_PORT) in head


# --- who may write to the tutorial's MLflow, and no secret anywhere (issue 49) -------------


def get(server, path: str, auth) -> dict:
    status, text = call(server.address, "GET", f"api/2.0/mlflow/{path}", auth=auth)
    assert status == 200, (path, status, text[:300])
    return json.loads(text)


def some_artifact(server, run_id: str, auth) -> str:
    """The path of a file among the run's artifacts (the bundle's, the model's)."""
    folders = [""]
    while folders:
        listing = get(server, f"artifacts/list?run_id={run_id}&path={folders.pop(0)}", auth)
        for entry in listing.get("files", []):
            if not entry["is_dir"]:
                return entry["path"]
            folders.append(entry["path"])
    raise AssertionError(f"run {run_id} has no artifact")


def test_the_tutorials_server_refuses_anonymous_and_viewer_writes(rig, mlflow_server,
                                                                  hostfile_run):  # fmt: skip
    """Anonymous: 401 on creating a run, logging a metric, uploading an artifact, deleting
    a run and moving an alias (on the hostfile run and its model) and on reading; the
    viewer: 403 on each, and it reads the run, its metrics, an artifact and the alias."""
    viewer = (VIEWER, mlflow_server.password(VIEWER))
    version = get(mlflow_server, f"registered-models/alias?name={MODEL}&alias=current",
                  viewer)["model_version"]  # fmt: skip
    run_id = version["run_id"]
    run = get(mlflow_server, f"runs/get?run_id={run_id}", viewer)["run"]
    w = {"exp": run["info"]["experiment_id"], "run": run_id, "version": version["version"]}
    assert_refused_everywhere(mlflow_server.address, w, MODEL, None, 401)
    assert call(mlflow_server.address, "GET", f"api/2.0/mlflow/runs/get?run_id={run_id}")[0] == 401
    assert_refused_everywhere(mlflow_server.address, w, MODEL, viewer, 403)
    run = get(mlflow_server, f"runs/get?run_id={run_id}", viewer)["run"]
    assert run["info"]["lifecycle_stage"] == "active" and run["info"]["status"] == "FINISHED"
    history = get(mlflow_server, f"metrics/get-history?run_id={run_id}&metric_key=loss",
                  viewer)["metrics"]  # fmt: skip
    # (steps 4-6 twice: the per-node form resumed this run from a copy of its checkpoint)
    assert sorted({m["step"] for m in history}) == [1, 2, 3, 4, 5, 6]
    logged = get(mlflow_server, f"metrics/get-history?run_id={run_id}&metric_key=loss",
                 viewer)["metrics"]  # fmt: skip
    assert not [m for m in logged if int(m["timestamp"]) == 0], logged  # the refused one
    path = some_artifact(mlflow_server, run_id, viewer)
    status, body = call(mlflow_server.address, "GET", f"api/2.0/mlflow-artifacts/artifacts/"
                        f"{w['exp']}/{run_id}/artifacts/{path}", auth=viewer)  # fmt: skip
    assert status == 200 and body, (path, status)
    again = get(mlflow_server, f"registered-models/alias?name={MODEL}&alias=current", viewer)
    assert again["model_version"]["version"] == version["version"]


def test_a_wrong_password_stops_plm_train_on_a_host_before_its_first_step(rig, prepared,
                                                                          mlflow_server):  # fmt: skip
    """On node1, against the tutorial's server: the job's user with a wrong password (from
    its password file): one `plm:` line, exit 2, no step, nothing on the store."""
    wrong = f"not-the-job-password-{secrets.token_hex(4)}"
    rig.put("node1", wrong + "\n", "/mnt/local/wrong.password", mode=0o600)
    env = {**RANK_ENV, **mlflow_server.as_job(),
           "MLFLOW_TRACKING_PASSWORD_FILE": "/mnt/local/wrong.password"}  # fmt: skip
    proc = kept(on(rig, "node1", [sys.executable, "-m", "pipeline.cli", "train", BERT,
                                  f"data.path={prepared['uri']}",
                                  f"train.out_dir=s3://{BUCKET}/runs/refused", f"name={MODEL}",
                                  *STEPS], env=env, check=False))  # fmt: skip
    refused_before_any_step(proc, f"user '{JOB}'", "HTTP 401", f"EDIT on experiment '{MODEL}'")
    assert wrong not in proc.stdout + proc.stderr
    assert not s3_fs(rig).get_file_info(f"{BUCKET}/runs/refused/metrics.jsonl").is_file


def test_a_store_uri_with_keys_is_refused_and_shown_redacted(rig):
    """The rig's real keys in a URI's user part: refused before anything reads it, the
    line shows `***@` (the search below finds neither key in what it printed)."""
    uri = f"s3://{rig.aws_key}:{rig.aws_secret}@{BUCKET}/data"
    proc = kept(on(rig, "node1", [sys.executable, "-m", "pipeline.cli", "train", BERT,
                                  f"data.path={uri}", "--dry-run"], check=False))  # fmt: skip
    refused_before_any_step(proc, f"data.path=s3://***@{BUCKET}/data", "user part")
    assert rig.aws_secret not in proc.stdout + proc.stderr


def test_node1_exports_the_final_bundle_for_transformers(rig, hostfile_run):
    """The tutorial's last step: the run's final bundle from the store onto node1's disk,
    `plm export --to hf` there."""
    prefix, _, _ = hostfile_run
    kept(on(rig, "node1", [sys.executable, "-c", "import os, pyarrow.fs as f; "
                           "os.makedirs('/mnt/local/bundle'); f.copy_files("
                           f"'s3://{BUCKET}/{prefix}/bundles/final', '/mnt/local/bundle')"]))  # fmt: skip
    kept(on(rig, "node1", [sys.executable, "-m", "pipeline.cli", "export", "--to", "hf",
                           "/mnt/local/bundle", "/mnt/local/hf"]))  # fmt: skip
    names = on(rig, "node1", ["ls", "/mnt/local/hf"]).stdout.split()
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names), names


def on_disk(rig, host: str, path: str) -> Path:
    """Where the laptop sees ``path`` of ``host``'s own disk (/mnt/local/...)."""
    return Path(rig.root, "hosts", host, "local", Path(path).relative_to("/mnt/local"))


def bucket_copy(rig, folder: Path) -> int:
    """Every object of the bucket, read through the S3 API into ``folder``; how many."""
    s3, n = s3_fs(rig), 0
    for info in s3.get_file_info(pafs.FileSelector(BUCKET, recursive=True)):
        if info.is_file:
            dest = folder / info.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            with s3.open_input_stream(info.path) as f:
                dest.write_bytes(f.read())
            n += 1
    return n


def test_no_secret_in_any_file_the_run_wrote(rig, ray_cluster, prepared, mlflow_server,
                                             hostfile_run, tmp_path_factory):  # fmt: skip
    """Issue 49.3, last in the module: after the tutorial's whole path (data job on Ray,
    training across hosts with data and out_dir on S3, MLflow with auth, a fine-tune, an
    export), none of its secrets (the S3 keys, the Ray token, the MLflow admin's, job's
    and viewer's passwords and the Flask key), raw, URL-encoded or inside base64, is in
    any file it wrote: every host's private dirs under the rig root (disk, /tmp with the
    Ray session logs of the head and the workers, ~/.cache, MLflow's sqlite store and its
    auth database, which holds salted hashes only, the servers' logs), every object of the
    bucket (data, manifest, tokenizer, checkpoints, bundles, metrics.jsonl, MLflow's
    artifacts), this session's temporary files (the laptop's data dir, the reference run)
    and every command's output. Only the files that hold a secret by design are left out,
    each said below."""
    root, node0 = Path(rig.root), rig.hosts[0].name
    auth = on_disk(rig, node0, mlflow_server.auth_dir)
    values = {"AWS access key": rig.aws_key, "AWS secret key": rig.aws_secret,
              "Ray token": ray_cluster["token"].read_text().strip(),
              "MLflow Flask key": (auth / "flask_secret_key").read_text().strip(),
              **{f"MLflow {u} password": mlflow_server.password(u)
                 for u in ("admin", JOB, VIEWER)}}  # fmt: skip
    skip = {root / "rig.json": "the rig's own state: the S3 keys it provisions hosts with",
            ray_cluster["token"]: "the laptop's Ray token, copied onto the hosts"}  # fmt: skip
    for h in rig.hosts:
        own = root / "hosts" / h.name
        skip[own / ".aws/credentials"] = "the host's S3 keys (~/.aws/credentials)"
        skip[own / ".ray/auth_token"] = "the host's Ray token (~/.ray/auth_token)"
        skip[on_disk(rig, h.name, mlflow_server.password_file(JOB))] = (
            "the job's password file, on every host (MLFLOW_TRACKING_PASSWORD_FILE)")  # fmt: skip
    for name in ("admin.password", "flask_secret_key", f"{VIEWER}.password"):
        skip[auth / name] = "the server's secrets and its users' passwords, on node0 (0600)"
    for user in (JOB, VIEWER):
        skip[mlflow_server.laptop_dir / f"{user}.password"] = "the laptop's copy (plm rig cp)"
    bucket = tmp_path_factory.mktemp("bucket-copy")
    assert bucket_copy(rig, bucket) > 50
    # What the search must have covered, so an empty answer means something.
    assert list(root.glob(f"hosts/{node0}/tmp/ray/session_*/logs/job-driver-*.log"))
    assert list(root.glob("hosts/node1/tmp/ray/session_*/logs/*"))
    assert list(bucket.glob(f"{BUCKET}/runs/bert/checkpoints/step00000006/*.pt"))
    assert list(bucket.glob(f"{BUCKET}/mlflow/**/MLmodel"))
    assert (bucket / BUCKET / "data/manifest.json").is_file()
    assert (root / "hosts/node0/local/mlflow.db").is_file() and (auth / "basic_auth.db").is_file()
    assert list(root.glob("hosts/node1/local/hf/*.safetensors")) and len(OUTPUTS) >= 10
    # The S3 server's own request log (the store's, as S3's server access logs are) names
    # the access key ID of presigned requests (X-Amz-Credential=KEY/date/...; MLflow's
    # proxied multipart uploads): an identifier, not the secret key, which is searched
    # there too. Every line that has it must be such a request.
    s3_log = root / "hosts" / node0 / "local" / "s3.log"
    for line in s3_log.read_text(errors="replace").splitlines():
        if rig.aws_key in line:
            assert f"X-Amz-Credential={rig.aws_key}" in line, line.replace(rig.aws_key, "KEY")
    hits = find_secrets([root, tmp_path_factory.getbasetemp()], values, skip,
                        {f"output {i}": text for i, text in enumerate(OUTPUTS)},
                        allow={s3_log: {"AWS access key"}})  # fmt: skip
    assert not hits, "\n".join(hits[:40])
    for path in skip:  # the exclusions are real files that do hold their secret
        assert path.is_file(), path
