"""The data job loses a host (issue 30): `plm data prepare` from s3:// to s3:// on the rig's
Ray cluster (head on node0 with no CPUs, one-CPU workers on node1 and node2, token
authentication), submitted with launch/ray_submit.py from the laptop (the root namespace).

- A worker host dies mid-job (every Ray process of node2 SIGKILLed): the job finishes on
  node1 alone, and its shards are the bytes of a local one-CPU run.
- The head dies mid-job (every Ray process of node0, the job's driver with them):
  ray_submit.py ends with one `plm:` line; the same command on a fresh cluster finishes
  the job, redoing only the units that had no record, and gives the same bytes.

This cluster has its own ports, so it never meets test_ray_cluster.py's, and the fixture
SIGKILLs every Ray process it started (by PID, in the hosts' namespaces) at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from cluster_util import (
    REPO,
    RayCluster,
    assert_same_shards,
    kill_ray,
    ray_cluster_on,
    ray_pids,
    s3_fs,
)
from conftest import synthetic_corpus

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

SPLIT_BYTES = 5000  # about 36 units from the 180 kB corpus


def task_titles(rig: rigmod.Rig, host: str) -> list[str]:
    """The write tasks running on ``host`` (a Ray worker's title names its task)."""
    found = []
    for pid in ray_pids(rig, host):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith("ray::_write_task"):
            found.append(title)
    return found


@pytest.fixture(scope="module")
def ray_cluster(rig, tmp_path_factory):
    with ray_cluster_on(rig, tmp_path_factory.mktemp("faults-ray")) as cluster:
        yield cluster


def corpus_texts() -> dict[str, str]:
    return {"a.txt": synthetic_corpus(300, seed=11), "b.txt": synthetic_corpus(200, seed=12)}


@pytest.fixture(scope="module")
def job(rig, tmp_path_factory):
    """The corpus and the tokenizer on S3, the `plm data prepare` arguments
    (less --output), and the output of the same command run locally on one CPU."""
    s3 = s3_fs(rig)
    bucket = rigmod.S3_BUCKET
    work = tmp_path_factory.mktemp("faults")
    (work / "corpus").mkdir()
    for name, text in corpus_texts().items():
        (work / "corpus" / name).write_text(text)
        with s3.open_output_stream(f"{bucket}/faults/corpus/{name}") as f:
            f.write(text.encode())
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    tok = train_tokenizer([str(work / "corpus")], TokenizerSpec(kind="wordpiece", vocab_size=300),
                          work / "tok")  # fmt: skip
    pafs.copy_files(str(tok), f"{bucket}/faults/tok", destination_filesystem=s3)
    args = ["--input", f"s3://{bucket}/faults/corpus/", "--tokenizer", f"s3://{bucket}/faults/tok",
            "--shard-docs", "40", "--valid-fraction", "0.1", "--split-bytes", str(SPLIT_BYTES)]  # fmt: skip
    local = work / "local"
    env = {**os.environ, **rig.env(), "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "pipeline.cli", "data", "prepare", *args, "--output",
                    str(local), "--num-cpus", "1"],
                   env=env, cwd=work, check=True, capture_output=True, timeout=600)  # fmt: skip
    return {"args": args, "local": local, "work": work}


def submit_argv(cluster: RayCluster, job_id: str, args: list[str], output: str) -> list[str]:
    return [sys.executable, str(REPO / "launch" / "ray_submit.py"), "--address", cluster.address,
            "--job-id", job_id, "--", *args, "--output", output]  # fmt: skip


def laptop_env(cluster: RayCluster, home: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    return {**clean, "HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(cluster.token)}


def records_in(s3: pafs.S3FileSystem, root: str) -> list[int]:
    """The units whose record is in the output (``units/unit-NNNNNN.npz``)."""
    found = s3.get_file_info(pafs.FileSelector(f"{root}/units", allow_not_found=True))
    return sorted(
        int(e.base_name[5:-4])
        for e in found
        if e.base_name.startswith("unit-") and e.base_name.endswith(".npz")
    )


def submit_until_records(argv: list[str], env: dict[str, str], s3, root: str, cwd: Path):
    """Submit, and return (the running ray_submit.py, the records seen) once the job has
    finished 2 units; fails if it ends first."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 400
    while len(seen := records_in(s3, root)) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (or hung) before 2 units were done:\n{out}\n{err}")
        time.sleep(0.2)
    return proc, seen


def assert_bytes_of_local_run(s3, root: str, local: Path) -> dict:
    """The output's shards and indexes are the local one-CPU run's bytes; its manifest."""
    ours, theirs = assert_same_shards(s3, root, local)
    for key in ("totals", "rejected", "sources", "data_config"):
        assert theirs[key] == ours[key], key
    assert theirs["stats"]["units"] == ours["stats"]["units"] >= 30
    return theirs


def test_a_worker_host_dies_mid_job(rig, ray_cluster, job, tmp_path):
    """node2 dies (SIGKILL to its raylet, its workers and agents) while the job runs.

    How Ray recovers: the driver owns every task; the RPC to a task's worker on node2
    fails, and Ray resubmits the task (tasks' `max_retries` is 3 by default, used here as
    is). The GCS marks node2 dead when its health checks fail (tightened on the head,
    HEALTH_CHECK above, only to keep the test short: Ray's defaults take about 15 s), and
    the scheduler stops placing tasks there. Objects that lived only in node2's object
    store (a write task's key partitions, if large) are rebuilt by lineage reconstruction:
    the write task runs again, finds the unit's record in the output and returns it
    without reading the unit again. The job ends on node1 alone with the same bytes."""
    s3 = s3_fs(rig)
    root = f"{rigmod.S3_BUCKET}/faults/a"
    argv = submit_argv(ray_cluster, f"plm-faults-a-{secrets.token_hex(3)}", job["args"],
                       f"s3://{root}")  # fmt: skip
    proc, seen = submit_until_records(argv, laptop_env(ray_cluster, tmp_path), s3, root,
                                      tmp_path)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (running := task_titles(rig, "node2")):  # kill it with a unit half-done
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("node2 ran no write task after the first units:\n"
                                 + "".join(proc.communicate()))  # fmt: skip
        time.sleep(0.05)
    killed = kill_ray(rig, "node2")
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "SUCCEEDED" in err, out[-4000:] + err[-4000:]
    assert killed and ray_pids(rig, "node2") == []
    manifest = assert_bytes_of_local_run(s3, root, job["local"])
    assert "node1" in manifest["stats"]["writer_hosts"]
    assert len(seen) < manifest["stats"]["units"]  # node2 died with units left to do
    assert records_in(s3, root) == []  # the records go once the manifest is written
    print(f"killed {len(killed)} Ray processes of node2 ({running}) after {len(seen)} units; "
          f"the job ended {time.monotonic() - killed_at:.1f} s later; "
          f"stats: {json.dumps(manifest['stats'])}")  # fmt: skip


def test_b_the_head_dies_and_a_rerun_finishes_the_job(rig, ray_cluster, job, tmp_path):
    """node0 dies (its GCS, dashboard, raylet and the job's driver) while the job runs:
    ray_submit.py says so in one `plm:` line. The workers' Ray is stopped too (what a
    user does before starting the cluster again); a fresh cluster and the same command
    finish the job: the units with a record (and their parts) are kept, the
    rest are redone, and the bytes are those of a local one-CPU run."""
    if not ray_pids(rig, "node2"):
        ray_cluster.start_worker("node2")  # test A killed it
    s3 = s3_fs(rig)
    root = f"{rigmod.S3_BUCKET}/faults/b"
    argv = submit_argv(ray_cluster, f"plm-faults-b-{secrets.token_hex(3)}", job["args"],
                       f"s3://{root}")  # fmt: skip
    env = laptop_env(ray_cluster, tmp_path)
    proc, _ = submit_until_records(argv, env, s3, root, tmp_path)
    assert kill_ray(rig, "node0")
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=300)
    print(f"ray_submit.py ended {time.monotonic() - killed_at:.1f} s after the head died")
    assert proc.returncode == 1, out[-4000:] + err[-4000:]
    assert "Traceback" not in err, err[-6000:]
    lines = [x for x in err.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1, err[-6000:]
    assert ray_cluster.address in lines[0] and "ray start --head" in lines[0], lines[0]
    assert "rerun this same command" in lines[0] and "kept" in lines[0], lines[0]
    print(lines[0])

    left = {h: len(ray_pids(rig, h)) for h in ("node1", "node2")}
    print(f"Ray processes left on the workers after the head died: {left}")
    ray_cluster.stop()  # what is left of the old cluster: node1's and node2's Ray
    from pipeline.prepare import records

    done = records_in(s3, root)
    for unit in done:  # a record is saved after its unit's parts: they are all there
        result = records.load(s3, root, unit)[0]
        for parts in result.parts.values():
            for part in parts:
                for name in (part["name"], part["index"]):
                    assert s3.get_file_info(f"{root}/{name}").type == pafs.FileType.File, name
    assert not any(e.base_name == "manifest.json" for e in s3.get_file_info(
        pafs.FileSelector(root)))  # fmt: skip

    ray_cluster.start()
    again = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0 and "SUCCEEDED" in again.stderr, (
        again.stdout[-4000:] + again.stderr[-4000:])  # fmt: skip
    manifest = assert_bytes_of_local_run(s3, root, job["local"])
    assert manifest["stats"]["units_reused"] == len(done), (len(done), manifest["stats"])
    assert 0 < len(done) < manifest["stats"]["units"]
    assert f"{len(done)} of {manifest['stats']['units']} units were finished" in again.stdout
    assert s3.get_file_info(f"{root}/units").type == pafs.FileType.NotFound
    print(f"{len(done)} of {manifest['stats']['units']} units kept; "
          f"stats: {json.dumps(manifest['stats'])}")  # fmt: skip
