"""Ray across hosts: the head on node0 with 0 CPUs, workers on node1 and node2 joined with
`ray start --address`, token authentication on; `ray job submit` from the laptop (the root
namespace) runs `plm data prepare` from s3:// to s3://. The shards are the bytes of a
local one-CPU run, and the manifest names the hosts that wrote them."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from cluster_util import REPO, assert_same_shards, listeners, on, tool
from conftest import synthetic_corpus

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.distributed]

GCS_PORT, DASHBOARD_PORT = 6379, 8265
# Ray 2.60's C++ gRPC servers (GCS, raylet, object manager), the dashboard agent and the
# autoscaler monitor take no bind address: they listen on the wildcard, which inside a
# host is its own address and its loopback (the only two it has: test_rig checks that).
RAY_WILDCARD = ("gcs_server", "raylet", "ray::DashboardA", "python3.11", "python3", "python")


def corpus_texts() -> dict[str, str]:
    return {"a.txt": synthetic_corpus(300, seed=1), "b.txt": synthetic_corpus(200, seed=2)}


@pytest.fixture(scope="module")
def ray_cluster(rig):
    token = rig.shared / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
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


def submit(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    return subprocess.run([sys.executable, str(REPO / "launch" / "ray_submit.py"), *args],
                          env={**clean, **env}, capture_output=True, text=True, timeout=600,
                          cwd=REPO)  # fmt: skip


def prepare_locally(rig, prepare: list[str], tmp_path) -> Path:
    """The same `plm data prepare` on the laptop on one CPU (the same S3 input)."""
    local = tmp_path / "local"
    env = {**os.environ, **rig.env(), "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "pipeline.cli", "data", "prepare", *prepare,
                    "--output", str(local), "--num-cpus", "1"],
                   env=env, cwd=tmp_path, check=True, capture_output=True)  # fmt: skip
    return local


def test_prepare_from_s3_to_s3_on_the_cluster(rig, ray_cluster, tmp_path):
    s3 = pafs.S3FileSystem(endpoint_override=rig.s3_endpoint, access_key=rig.aws_key,
                           secret_key=rig.aws_secret, region="us-east-1", scheme="http")  # fmt: skip
    bucket = rigmod.S3_BUCKET
    for name, text in corpus_texts().items():
        with s3.open_output_stream(f"{bucket}/ray/corpus/{name}") as f:
            f.write(text.encode())
    local_corpus = tmp_path / "corpus"
    local_corpus.mkdir()
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    for name, text in corpus_texts().items():
        (local_corpus / name).write_text(text)
    tok = train_tokenizer([str(local_corpus)], TokenizerSpec(kind="wordpiece", vocab_size=300),
                          rig.shared / "ray_tok")  # fmt: skip
    prepare = ["--input", f"s3://{bucket}/ray/corpus/", "--tokenizer", str(tok),
               "--shard-docs", "40", "--valid-fraction", "0.1", "--split-bytes", "20000"]  # fmt: skip
    # Without the token the cluster refuses the laptop.
    refused = submit(["--address", ray_cluster["address"], "--", *prepare, "--output",
                      f"s3://{bucket}/ray/refused"], {"HOME": str(tmp_path)})  # fmt: skip
    assert refused.returncode == 2 and "token" in refused.stderr, refused.stderr
    done = submit(
        ["--address", ray_cluster["address"], "--job-id", f"plm-rig-{secrets.token_hex(3)}",
         "--", *prepare, "--output", f"s3://{bucket}/ray/shards"],
        {"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(ray_cluster["token"])},
    )  # fmt: skip
    assert done.returncode == 0 and "SUCCEEDED" in done.stderr, done.stdout + done.stderr

    # The same command, run locally on one CPU (the laptop, reading the same S3 input).
    local = prepare_locally(rig, prepare, tmp_path)

    from pipeline.data.shards import manifest_bytes

    ours, theirs = assert_same_shards(s3, f"{bucket}/ray/shards", local)
    assert theirs["stats"]["units"] >= 4
    # The head ran no task; both workers wrote parts; the manifest names them.
    assert theirs["stats"]["writer_hosts"] == ["node1", "node2"]
    assert ours["stats"]["writer_hosts"] == [os.uname().nodename]
    assert manifest_bytes(theirs["tokenizer"]) == manifest_bytes(ours["tokenizer"])


def test_ray_listens_on_its_hosts_own_addresses(rig, ray_cluster):
    for h in rig.hosts:
        for address, port, name, _pid in listeners(rig, h.name):
            if address in (h.address, "127.0.0.1"):
                continue
            assert address in ("*", "0.0.0.0", "::") and name in RAY_WILDCARD, (
                h.name, address, port, name)  # fmt: skip
    head = {(a, p) for a, p, _, _ in listeners(rig, "node0")}
    assert (rig.hosts[0].address, DASHBOARD_PORT) in head  # the dashboard: node0's address
    assert (rig.hosts[0].address, 22) in head and (rig.hosts[0].address, rigmod.S3_PORT) in head


def test_near_dedup_on_the_cluster_gives_the_bytes_of_one_cpu(rig, ray_cluster, tmp_path):
    """`--near-dedup on` across the two worker nodes: the signatures are computed where
    the units are written, the band reducers and the components run anywhere; shards,
    counts and reject examples are those of a local one-CPU run."""
    sys.path.insert(0, str(REPO / "bench"))
    import planted_corpus

    s3 = pafs.S3FileSystem(endpoint_override=rig.s3_endpoint, access_key=rig.aws_key,
                           secret_key=rig.aws_secret, region="us-east-1", scheme="http")  # fmt: skip
    bucket = rigmod.S3_BUCKET
    docs, pairs = planted_corpus.generate(300_000, seed=5)
    local_corpus = tmp_path / "corpus"
    planted_corpus.write(local_corpus, docs, pairs, n_files=2)
    (local_corpus / "pairs.jsonl").unlink()
    for path in sorted(local_corpus.iterdir()):
        with s3.open_output_stream(f"{bucket}/near/corpus/{path.name}") as f:
            f.write(path.read_bytes())
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    tok = train_tokenizer([str(local_corpus)], TokenizerSpec(kind="wordpiece", vocab_size=300),
                          rig.shared / "near_tok")  # fmt: skip
    prepare = ["--input", f"s3://{bucket}/near/corpus/", "--tokenizer", str(tok),
               "--shard-docs", "40", "--split-bytes", "30000", "--near-dedup", "on"]  # fmt: skip
    done = submit(
        ["--address", ray_cluster["address"], "--job-id", f"plm-near-{secrets.token_hex(3)}",
         "--", *prepare, "--output", f"s3://{bucket}/near/shards"],
        {"HOME": str(tmp_path), "RAY_AUTH_TOKEN_PATH": str(ray_cluster["token"])},
    )  # fmt: skip
    assert done.returncode == 0 and "SUCCEEDED" in done.stderr, done.stdout + done.stderr
    local = prepare_locally(rig, prepare, tmp_path)
    ours, theirs = assert_same_shards(s3, f"{bucket}/near/shards", local)
    assert theirs["stats"]["writer_hosts"] == ["node1", "node2"]
    assert ours["rejected"]["near_duplicate"] >= 10
    for key in ("rejected", "reject_examples", "totals", "data_config"):
        assert theirs[key] == ours[key], key
