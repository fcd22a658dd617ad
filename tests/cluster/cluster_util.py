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
