"""Helpers of the `cluster` tests (the rig fixture is in this folder's conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline import rig as rigmod

REPO = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    """A console script of this Python environment (ray, mlflow, moto_server)."""
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def on(rig: rigmod.Rig, host: str, argv: list[str], *, env: dict | None = None,
       timeout: float = 600, check: bool = True, cwd: str = "/") -> subprocess.CompletedProcess:  # fmt: skip
    """``argv`` on ``host``, output captured; fails the test with it unless it exits 0."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = rig.run(host, argv, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"on {host}: {' '.join(argv)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


def pids_of(rig: rigmod.Rig, host: str, *markers: bytes) -> list[int]:
    """The processes of ``host`` whose command line (NUL-separated) holds one of ``markers``."""
    found = []
    for pid in rig.pids(host):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:  # gone already
            continue
        if any(m in cmd for m in markers):
            found.append(pid)
    return found


def s3_fs(rig: rigmod.Rig):
    """The rig's S3 server, as the laptop reaches it (pyarrow's S3 filesystem)."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=rig.s3_endpoint, access_key=rig.aws_key,
                             secret_key=rig.aws_secret, region="us-east-1", scheme="http")  # fmt: skip


MLFLOW_PORT = 5000


def start_mlflow(rig: rigmod.Rig, db: str, artifacts: str, log: str) -> tuple[str, str]:
    """`mlflow server` on node0, as docs/cluster.md starts it: its sqlite store ``db`` on
    node0's own disk, artifacts proxied to ``artifacts`` (an s3:// URI), no job workers,
    output appended to ``log`` (a path on the laptop). Its URL by name and by address."""
    node0 = rig.hosts[0]
    out = open(log, "ab")  # noqa: SIM115  (the server's, for as long as it runs)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    rig.popen("node0", [
        tool("mlflow"), "server", "--host", node0.address, "--port", str(MLFLOW_PORT),
        "--allowed-hosts", f"{node0.address}:{MLFLOW_PORT},node0:{MLFLOW_PORT}",
        "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", artifacts,
        "--workers", "1",
    ], env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    wait_port(node0.address, MLFLOW_PORT)
    return f"http://node0:{MLFLOW_PORT}", f"http://{node0.address}:{MLFLOW_PORT}"


def wait_port(address: str, port: int, timeout: float = 120) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def listeners(rig: rigmod.Rig, host: str) -> list[tuple[str, int, str, int]]:
    """Every TCP listener on ``host``: (address, port, process name, pid), from `ss`."""
    out = subprocess.run(["ip", "netns", "exec", rig.host(host).netns, "ss", "-ltnpH"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = []
    for line in out.splitlines():
        fields = line.split()
        local, users = fields[3], " ".join(fields[5:])
        address, _, port = local.rpartition(":")
        name = users.split('"')[1] if '"' in users else "?"
        pid = int(users.split("pid=")[1].split(",")[0]) if "pid=" in users else -1
        found.append((address.strip("[]").removeprefix("::ffff:"), int(port), name, pid))
    return found


def assert_same_shards(s3, root: str, local: Path) -> tuple[dict, dict]:
    """The data dir at ``root`` on the S3 filesystem holds the shards and indexes of the
    local data dir ``local``, byte for byte (at least 8 files); (local, remote) manifests."""
    import json

    from pipeline.data.shards import load_manifest

    ours = load_manifest(local)
    with s3.open_input_file(f"{root}/manifest.json") as f:
        theirs = json.loads(f.read())
    n_files = 0
    for split, info in ours["splits"].items():
        assert [e["sha256"] for e in theirs["splits"][split]["shards"]] == [
            e["sha256"] for e in info["shards"]
        ]
        for entry in info["shards"]:
            for name in (entry["name"], entry["index"]):
                with s3.open_input_file(f"{root}/{name}") as f:
                    assert f.read() == (local / name).read_bytes(), name
                n_files += 1
    assert n_files >= 8
    return ours, theirs


SMALL_SUBNETS = ("198.18.0.240/29", "198.18.0.232/29", "198.18.0.224/29", "198.18.0.248/29",
                 "198.18.0.120/29", "198.18.0.56/29")  # fmt: skip


def small_rig(name: str, n_hosts: int, **kwargs) -> rigmod.Rig:
    """A rig of the test's own beside the session's, on the first small subnet free."""
    import pytest

    why = rigmod.check_prerequisites(ssh=kwargs.get("ssh", True))
    if why:
        pytest.skip(why)
    for subnet in SMALL_SUBNETS:
        try:
            return rigmod.up(n_hosts, name=name, subnet=subnet, **kwargs)
        except rigmod.RigError as err:
            if "overlaps" not in str(err):
                raise
    raise AssertionError("every small test subnet is in use: `plm rig down` the other rigs")
