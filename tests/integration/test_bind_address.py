"""A 2-rank `plm train` listens on MASTER_ADDR only: rank 0's rendezvous store and every
gloo process group of both ranks (pipeline/train/rendezvous.py), none on a wildcard."""

from __future__ import annotations

import subprocess
import time

import pytest
from conftest import REPO, deepspeed_argv, deepspeed_env, falls, free_port, step_losses
from listeners import descendants, listeners_of

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ADDR = "127.0.0.2"  # a loopback alias Linux answers without any configuration
BERT = str(REPO / "configs/test/bert-tiny.yaml")


def _ranks(pids: list[int]) -> list[int]:
    """The processes among PIDS that run `plm train` (not the launchers)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"pipeline.cli" in argv and not any(a.startswith(b"deepspeed.") for a in argv):
            out.append(pid)
    return out


def test_every_listener_of_a_two_rank_run_is_on_master_addr(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    target = ["--module", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
              f"train.out_dir={run_dir}", "train.max_steps=12", "train.save_every=6",
              "train.eval_every=6", "train.log_every=1", "mlflow.register=false"]  # fmt: skip
    cmd = deepspeed_argv(target, port, master_addr=ADDR, hostfile=tmp_path / "hostfile")
    log = tmp_path / "launch.log"
    seen: set[tuple[str, int, int]] = set()  # (address, port, pid)
    ranks: set[int] = set()
    ss_lines: set[str] = set()  # `ss -ltnpH`'s lines of the same processes
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=deepspeed_env(), stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                pids = descendants(proc.pid)
                ranks.update(_ranks(pids))
                new = set(listeners_of(pids)) - seen
                if new:
                    ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True)
                    ss_lines |= {x.strip() for x in ss.stdout.splitlines()
                                 if any(f"pid={pid}," in x for _, _, pid in new)}  # fmt: skip
                    seen |= new
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert "world size 2" in text
    report = "\n".join(sorted(ss_lines))
    print(report)
    wrong = [x for x in seen if x[0] != ADDR]
    assert not wrong, f"listening elsewhere than {ADDR}: {wrong}\n{report}"
    assert len(ranks) == 2, ranks
    # rank 0's store on MASTER_PORT, and gloo's own listeners in each rank
    assert [pid for _, p, pid in seen if p == port] and {pid for _, _, pid in seen} == ranks, seen
    assert {pid for _, p, pid in seen if p != port} == ranks, seen
    # `ss` saw them alike: each line's local address is ADDR (no 0.0.0.0, [::], *)
    assert ss_lines and all(line.split()[3] == f"{ADDR}:" + line.split()[3].rsplit(":", 1)[1]
                            for line in ss_lines), report  # fmt: skip
    values = step_losses(run_dir)
    assert len(values) == 12 and falls(values), values
