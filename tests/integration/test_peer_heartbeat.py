"""pipeline/train/heartbeat.py with real processes and a real TCPStore: a frozen rank
(SIGSTOP: what a frozen host or a cut link looks like from the others) ends the others at
once, each with one `plm:` line naming it; so does a frozen store; a rank that ends on its
own, or whose main thread is busy, is never taken for silent.

Each process is `python -c SCRIPT RANK WORLD PORT MODE`: rank 0 serves the store; every
rank starts its heartbeat, then its main thread waits as a rank waits in a collective
(MODE "wait"), spins in Python (MODE "busy"), marks itself done and idles ("done"), runs
steps ("steps"; "stuck" stops after step 5), or runs steps around a real gloo all-reduce
("collective"; "held" stops inside step 6, before the all-reduce the others wait in)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pipeline.train.faults import EXIT_PEER_LOST
from pipeline.train.heartbeat import DONE, PREFIX

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

INTERVAL_S, TIMEOUT_S, STUCK_S = 0.2, 3.0, 2.0
SCRIPT = f"""
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from pipeline.train.heartbeat import Heartbeat
rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if rank == 0:
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
hb = Heartbeat("127.0.0.1", port, rank, world, round_id="t", interval_s={INTERVAL_S},
               timeout_s={TIMEOUT_S}, address="127.0.0.1", stuck_s={STUCK_S})
hb.start()
print("started", flush=True)
if mode in ("steps", "stuck"):  # steps of 50 ms; at step 5 the stuck one stops outside
    for k in range(1, 1000):   # a step, the others wait inside step 6 (a collective)
        hb.begin_step(k)
        if k == 6:
            time.sleep(3600)
        time.sleep(0.05)
        hb.end_step(k)
        if k == 5 and mode == "stuck":
            time.sleep(3600)  # a deadlock, a stalled read: the main thread goes no further
if mode in ("collective", "held"):
    store = server if rank == 0 else dist.TCPStore("127.0.0.1", port, is_master=False,
                                                   wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=3600))
    for k in range(1, 1000):
        hb.begin_step(k)
        if k == 6 and mode == "held":
            time.sleep(3600)  # a stalled read inside the step, outside any collective
        try:
            dist.all_reduce(torch.ones(1))  # the others wait here for it
        except RuntimeError:  # its connection closed: as plm train, let the watch name it
            if hb.settle():
                time.sleep(60)
            raise
        time.sleep(0.05)
        hb.end_step(k)
if mode == "done":
    hb.stop()
    print("done", flush=True)
    time.sleep(3600)
deadline = time.monotonic() + 3600
while time.monotonic() < deadline:
    if mode == "busy":
        sum(i * i for i in range(200000))  # the GIL in Python's hands, switching
    else:
        time.sleep(1)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    def __init__(self, modes: list[str]):
        self.port = free_port()
        self.procs = []
        for rank, mode in enumerate(modes):
            p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(rank), str(len(modes)),
                                  str(self.port), mode], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
            assert p.stdout.readline().strip() == "started", p.communicate()
            self.procs.append(p)
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                   wait_for_workers=False, timeout=timedelta(seconds=30))  # fmt: skip

    def beats(self, rank: int) -> int:
        raw = self.store.get(f"{PREFIX}t/{rank}")
        return -1 if raw == DONE.encode() else json.loads(raw)["n"]

    def wait_beats(self, rank: int, n: int) -> None:
        """Until ``rank`` has beaten ``n`` more times: time measured in its own beats."""
        target = self.beats(rank) + n
        while self.beats(rank) < target:
            time.sleep(INTERVAL_S)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def ended(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


def assert_rank_1_stuck_and_named(ranks: Ranks, says: str) -> None:
    """Rank 1 (stopped after step 5) ends stuck with its stacks, its line saying ``says``
    too (exit 6); ranks 0 and 2 name it (exit 4)."""
    from pipeline.train.heartbeat import EXIT_STUCK

    try:
        code, err = ended(ranks.procs[1])
        lines = [x for x in err.splitlines() if x.startswith("plm:")]
        assert code == EXIT_STUCK and len(lines) == 1, err
        assert "this rank made no progress" in lines[0] and "after step 5" in lines[0], lines
        assert "stuck" in lines[0] and says in lines[0], lines
        assert "in <module>" in err and "Thread 0x" in err, err  # faulthandler's stacks
        for p in (ranks.procs[0], ranks.procs[2]):
            code, err = ended(p)
            named = [x for x in err.splitlines() if x.startswith("plm:")]
            assert code == EXIT_PEER_LOST and len(named) == 1, err
            assert "rank 1 on " in named[0] and "stuck" in named[0], named
    finally:
        ranks.close()


def test_a_frozen_rank_ends_the_others_at_once_naming_it():
    ranks = Ranks(["wait", "wait", "wait"])
    try:
        ranks.wait_beats(2, 3)
        os.kill(ranks.procs[2].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        for p in ranks.procs[:2]:
            code, err = ended(p)
            lines = [x for x in err.splitlines() if x.startswith("plm:")]
            assert code == EXIT_PEER_LOST and len(lines) == 1, err
            assert "rank 2 on " in lines[0] and "(127.0.0.1) has been silent" in lines[0]
            assert "Traceback" not in err
        print(
            f"both survivors ended {time.monotonic() - t0:.1f} s after the freeze "
            f"(heartbeat timeout {TIMEOUT_S} s)"
        )
    finally:
        os.kill(ranks.procs[2].pid, signal.SIGCONT)
        ranks.close()


def test_a_frozen_store_ends_the_others():
    ranks = Ranks(["wait", "wait", "wait"])
    try:
        ranks.wait_beats(1, 3)
        os.kill(ranks.procs[0].pid, signal.SIGSTOP)  # rank 0 serves the store
        for p in ranks.procs[1:]:
            code, err = ended(p)
            assert code == EXIT_PEER_LOST, err
            assert "the rendezvous store at 127.0.0.1:" in err and "has been silent" in err
    finally:
        os.kill(ranks.procs[0].pid, signal.SIGCONT)
        ranks.close()


def test_a_rank_that_beats_but_stays_behind_is_stuck_with_its_stack_and_named():
    """Rank 1 stops after step 5 (its heartbeat goes on) while ranks 0 and 2 wait inside
    step 6: rank 1 writes its threads' stacks and ends with exit 6; the others, ahead of
    it, are not stuck themselves: they name rank 1 and end with exit 4."""
    assert_rank_1_stuck_and_named(Ranks(["steps", "stuck", "steps"]),
                                  "stacks of its threads are above")  # fmt: skip


def test_a_rank_stuck_inside_a_step_that_the_others_wait_for_in_a_collective():
    """Rank 1 stops inside step 6, before its all-reduce; ranks 0 and 2 wait in that
    all-reduce (inside step 6 too: nobody is ahead). The one outside the collective is the
    cause: rank 1 ends stuck with its stacks (exit 6), the others name it (exit 4), long
    before the collective's own timeout (an hour here)."""
    assert_rank_1_stuck_and_named(Ranks(["collective", "held", "collective"]),
                                  "outside any collective")  # fmt: skip


def test_a_rank_that_is_done_or_busy_is_never_silent():
    ranks = Ranks(["wait", "done", "busy"])
    try:
        assert ranks.procs[1].stdout.readline().strip() == "done"
        ranks.procs[1].kill()  # gone for good, after marking itself done
        ranks.procs[1].wait()
        # Three timeouts' worth of beats of the busy rank (whose main thread holds the GIL
        # most of the time), measured in its own beats: nobody ends.
        ranks.wait_beats(2, int(3 * TIMEOUT_S / INTERVAL_S))
        assert ranks.procs[0].poll() is None and ranks.procs[2].poll() is None
        assert ranks.beats(1) == -1
    finally:
        ranks.close()


def test_plm_train_leaves_a_frozen_peer_in_seconds_not_the_collective_timeout(tiny_data,
                                                                              tmp_path):  # fmt: skip
    """2 ranks of `plm train` (torchrun-style environment, the defaults: a 300 s collective
    timeout, a 10 s heartbeat timeout); rank 1 frozen mid-run (SIGSTOP, as a frozen host):
    rank 0 leaves its collective, says who went silent in one line and exits 4 (what an
    elastic agent restarts on), long before the collective timeout."""
    from conftest import REPO, rank_env

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = rank_env(rank, 2, port)
        cmd = [sys.executable, "-m", "pipeline.cli", "train",
               str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={tiny_data}",
               f"train.out_dir={tmp_path / 'run'}", "train.max_steps=100000",
               "train.save_every=0", "train.eval_every=0", "train.log_every=1",
               f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
               "deepspeed=configs/deepspeed/zero2.json"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    try:
        seen = []
        while not any(x.startswith("[plm train] step 3:") for x in seen):
            line = procs[0].stdout.readline()
            assert line, "".join(seen[-50:])
            seen.append(line)
        os.kill(procs[1].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, _ = procs[0].communicate(timeout=200)  # the collective timeout is 300 s
        took = time.monotonic() - frozen_at
        lines = [x for x in out.splitlines() if x.startswith("plm:")]
        assert procs[0].returncode == EXIT_PEER_LOST, "".join(seen[-20:]) + out[-4000:]
        assert len(lines) == 1 and "rank 1 on " in lines[0] and "has been silent" in lines[0]
        assert "Traceback" not in out
        print(f"rank 0 left {took:.1f} s after rank 1 froze: {lines[0]}")
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_plm_train_names_a_rank_whose_loader_stalls_as_stuck_with_its_stack(tiny_data,
                                                                            tmp_path):  # fmt: skip
    """2 ranks of `plm train`; rank 1's data-loader workers frozen (SIGSTOP: a stalled
    filesystem under them). Rank 1's main thread waits for a batch inside its step, its
    heartbeat goes on, rank 0 waits for it in the step's collective: rank 1 writes its
    stacks (the loader's wait in them) and exits 6, rank 0 names it as stuck and exits 4,
    long before the collective timeout (300 s)."""
    from conftest import REPO, child_pids, rank_env

    from pipeline.train.heartbeat import EXIT_STUCK

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = rank_env(rank, 2, port)
        cmd = [sys.executable, "-m", "pipeline.cli", "train",
               str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={tiny_data}",
               f"train.out_dir={tmp_path / 'run'}", "train.max_steps=100000",
               "train.save_every=0", "train.eval_every=0", "train.log_every=1",
               "train.stuck_timeout_s=5", "data.workers=1",
               f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]  # fmt: skip
        # rank 1's output to a file: its frozen loader holds what it inherited open
        out = subprocess.PIPE if rank == 0 else open(tmp_path / "rank1.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    frozen: list[int] = []
    try:
        seen = []
        while not any(x.startswith("[plm train] step 5:") for x in seen):
            line = procs[0].stdout.readline()
            assert line, "".join(seen[-50:])
            seen.append(line)
        frozen = child_pids(procs[1].pid)
        assert frozen, "rank 1 has no loader worker"
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        procs[1].wait(timeout=200)
        out1 = (tmp_path / "rank1.log").read_text()
        out0, _ = procs[0].communicate(timeout=60)
        assert procs[1].returncode == EXIT_STUCK, out1[-4000:]
        mine = [x for x in out1.splitlines() if x.startswith("plm:")]
        assert len(mine) == 1 and "this rank made no progress" in mine[0], out1[-4000:]
        assert "dataloader.py" in out1 and "Thread 0x" in out1, out1[-4000:]
        named = [x for x in out0.splitlines() if x.startswith("plm:")]
        assert procs[0].returncode == EXIT_PEER_LOST, out0[-4000:]
        assert len(named) == 1 and "rank 1 on " in named[0] and "stuck" in named[0], named
        assert "Traceback" not in out0
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
