"""Every rank's heartbeat, and its watch on the others': a silent host found in seconds.

A host that goes silent (a cut link, a power loss, a hung kernel, a frozen VM) leaves the
other ranks inside a gloo or NCCL collective until ``train.collective_timeout_s`` (300 s by
default), and in some places (a store call, DeepSpeed's own collectives) longer. So each
rank runs a thread that, every ``interval_s``:

- writes its beat (a counter, its step, host and address) under its key in the round's
  rendezvous store, through a connection of its own;
- reads every other rank's beat in one request. A rank whose counter has not moved for
  ``timeout_s`` (``train.heartbeat_timeout_s``) by this rank's own clock is silent; so is
  the store itself when a request fails (rank 0's host is silent, or this host's link).

A silent peer ends this rank at once, wherever its main thread waits: one ``plm:`` line
naming the peer's rank, host and address, the time it was last heard and what happens
next; then ``os._exit(EXIT_PEER_LOST)``, which an elastic agent answers with a new round
on the hosts still up, from the last checkpoint, as for a killed host. A rank that ends on
its own (the run's end, a stop, an error it raises) marks its key ``done`` first, so its
silence is never taken for a fault.

A rank that beats but makes no progress (a deadlock, a stalled read) is found by its own
watch. The beat says where the rank is (inside step k, or past it) and whether its main
thread waits in a collective (a frame of torch.distributed, DeepSpeed's comm or autograd's
backward, which runs ZeRO's reductions). A rank with no progress for ``stuck_s``
(``train.stuck_timeout_s``) or 10x its median step (``long_s`` before its first step,
around saves, evaluations, bundles and rank 0's MLflow logging, and while its checkpoint
files are still written or uploaded), outside any collective, while every other rank went
on or waits in one, is the one they wait for: it writes the stacks of all its threads, says
so in one line and exits ``EXIT_STUCK``; its verdict makes the others name it. Ranks that
all wait in a collective are left to the collective timeout: none of them is the cause.

The beat comes from a thread, not the training loop: a rank slow in a save, an upload, a
resize's conversion or a garbage collection still beats. Only a whole host's processes
stopping (or its link) stops it. Torch's long operations release the GIL; a C extension
that held it for longer than ``timeout_s`` would be taken for silence.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from pipeline.train.faults import EXIT_PEER_LOST
from pipeline.train.rendezvous import local_address, master_addr_port

PREFIX = "plm/heartbeat/"
DONE = "done"
EXIT_STUCK = 6  # this rank made no progress while the others went on
NOTE_FILE = "heartbeat_silent.json"  # in a survivor's run folder, for the next round
# Where a main thread waits for its peers: a collective, or a backward pass (ZeRO reduces
# the gradients from autograd's hooks; on a GPU from autograd's own threads).
_WAITING_IN = tuple(os.path.join(*parts) for parts in (
    ("torch", "distributed", ""), ("deepspeed", "comm", ""), ("torch", "autograd", "")))  # fmt: skip


@dataclass(frozen=True)
class Silent:
    """What a watch found: who went silent, since when, and what this rank is."""

    rank: int  # -1: the store itself
    host: str
    address: str
    step: int
    silent_s: float
    last_heard: float  # time.time() of the last beat seen
    by_rank: int
    by_host: str
    stuck: bool = False  # beating, but no progress: its main thread is stuck

    def line(self, store: str) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.last_heard))
        if self.stuck:
            me = self.rank == self.by_rank
            return (
                f"plm: rank {self.by_rank} on {self.by_host}: "
                + ("this rank" if me else f"rank {self.rank} on {self.host} ({self.address})")
                + f" made no progress for {self.silent_s:.0f} s after step {self.step}, "
                "outside any collective, while the others went on or waited for it: stuck"
                + ("; the stacks of its threads are above" if me else "; leaving the step")
                + ". Under launch/elastic_train.py the round starts again from the last "
                "checkpoint"
            )
        if self.rank < 0:
            who = f"the rendezvous store at {store} (rank 0's host, or this host's link)"
        else:
            who = f"rank {self.rank} on {self.host} ({self.address})"
        return (
            f"plm: rank {self.by_rank} on {self.by_host}: {who} has been silent for "
            f"{self.silent_s:.0f} s (last heard at {when}, at step {self.step}): leaving the "
            "step. Under launch/elastic_train.py the hosts still up start again from the last "
            "checkpoint without it; otherwise rerun once every host is up"
        )


def _beat(count: int, step: int, host: str, address: str, at: int = 0,
          waits: bool = False) -> bytes:  # fmt: skip
    """``at``: where the rank is, 2k-1 inside step k, 2k once step k is done; ``waits``:
    its main thread is inside a collective."""
    return json.dumps({"n": count, "step": step, "host": host, "addr": address,
                       "at": at, "wait": waits}).encode()  # fmt: skip


def waits_for_peers(frame) -> bool:
    """Whether a thread whose innermost frame is ``frame`` waits inside a collective."""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _WAITING_IN):
            return True
        frame = frame.f_back
    return False


class Heartbeat:
    """The beat and the watch of one rank; ``start()`` after the process group is up,
    ``begin_step(k)`` / ``end_step(k)`` around each step, ``long_phase()`` before a save
    or an evaluation, ``stop()`` (marks this rank done) before it ends. ``long_wait``: a
    check, from this thread, that something this rank may wait long for is under way (its
    checkpoint files still written or uploaded: the next update waits for them)."""

    def __init__(
        self,
        addr: str,
        port: int,
        rank: int,
        world: int,
        *,
        round_id: str,
        interval_s: float = 1.0,
        timeout_s: float = 10.0,
        address: str = "",
        on_silent: Callable[[Silent, str], None] | None = None,
        stuck_s: float = 60.0,
        long_s: float = 1800.0,
        long_wait: Callable[[], bool] | None = None,
    ):
        self.addr, self.port, self.rank, self.world = addr, port, rank, world
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.stuck_s, self.long_s = stuck_s, long_s  # progress bounds (0: not watched)
        self.long_wait = long_wait
        self.join_timeout_s = max(60.0, 6 * timeout_s)  # ranks start their beats seconds apart
        self.host = socket.gethostname()
        self.address = address or self.host
        self.keys = [f"{PREFIX}{round_id}/{r}" for r in range(world)]
        # The first rank to find a silent peer says so here, so the others name the same
        # one (not the store, when the finder served it and is gone).
        self.verdict = f"{PREFIX}{round_id}/verdict"
        self.on_silent = on_silent or leave
        self.step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.TCPStore | None = None
        self._last_ok = time.monotonic()  # the store's last answer
        self._last: dict[int, dict] = {}  # each peer's last beat
        self._once = threading.Lock()
        self._found = threading.Event()  # a silent peer was named (settle)
        self._owner_done = False  # rank 0 has ended: the store may go with its process
        self._at = 0  # this rank's place in the run (_beat), and each peer's
        self._peer_at: dict[int, int] = {}
        self._peer_waits: dict[int, bool] = {}
        self._main = threading.get_ident()  # the training loop's thread (start())
        self._progress_at = time.monotonic()
        self._began = self._progress_at
        self._durations: list[float] = []
        self._first = True  # before the first step: the resume, a conversion
        self._long_now = False

    @property
    def where(self) -> str:
        return f"{self.addr}:{self.port}"

    def _connect(self) -> dist.TCPStore:
        # Its own client: each request waits at most half the timeout, so a silent store
        # is found within it.
        return dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(self.timeout_s / 2, 1.0)))  # fmt: skip

    def start(self) -> None:
        self._main = threading.get_ident()
        self._store = self._connect()
        if self.rank == 0:
            self._store.set(self.verdict, b"")
        self._store.set(self.keys[self.rank], _beat(0, self.step, self.host, self.address))
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="plm-heartbeat", daemon=True)
        self._thread.start()
        # A request to a store whose host froze may never return (the connection stays
        # open): this second thread watches the first one's last answer.
        threading.Thread(target=self._watch_store, name="plm-heartbeat-store",
                         daemon=True).start()  # fmt: skip

    # --- progress: a rank that beats but does not move ------------------------------------
    def begin_step(self, step: int) -> None:
        self._at, self._began = 2 * step - 1, time.monotonic()
        self._progress_at, self._long_now = self._began, False

    def end_step(self, step: int) -> None:
        now = time.monotonic()
        if not self._first:  # the first step's time is the resume's and warm-up's
            self._durations.append(now - self._began)
            del self._durations[:-50]
        self.step, self._at, self._progress_at, self._first = step, 2 * step, now, False

    def long_phase(self) -> None:
        """From now to the next step, the long bound: a save, an evaluation, a bundle,
        rank 0's MLflow logging, the run's end."""
        self._progress_at, self._long_now = time.monotonic(), True

    def _waiting_long(self) -> bool:
        try:
            return self.long_wait is not None and bool(self.long_wait())
        except Exception:  # a failed write: the main thread raises it; until then, long
            return True

    def bound_s(self) -> float:
        """How long this rank may make no progress: the larger of stuck_s and 10x its
        median step; the long bound before its first step, in a long phase and while
        ``long_wait`` says so."""
        if not self._durations or self._first or self._long_now or self._waiting_long():
            return self.long_s
        ordered = sorted(self._durations)
        return max(self.stuck_s, 10 * ordered[len(ordered) // 2])

    def main_waits(self) -> bool:
        """The training loop's thread waits inside a collective (for its peers)."""
        return waits_for_peers(sys._current_frames().get(self._main))

    def _check_progress(self, waits: bool) -> None:
        """This rank the one the others wait for, for longer than the bound: stuck. That
        is, no progress, outside any collective, while every peer went on or waits in
        one (``waits``: this rank's main thread is in one)."""
        if not self.stuck_s or waits or not self._peer_at:
            return
        quiet = time.monotonic() - self._progress_at
        if quiet <= self.stuck_s:  # cheap first: bound_s may ask the checkpoint
            return
        behind = all(at > self._at or self._peer_waits.get(r, False)
                     for r, at in self._peer_at.items())  # fmt: skip
        if behind and quiet > self.bound_s():
            self._silent(Silent(self.rank, self.host, self.address, self.step, quiet,
                                time.time() - quiet, self.rank, self.host, stuck=True))  # fmt: skip

    def stop(self) -> None:
        """Mark this rank done (its silence from now on is no fault) and end the threads."""
        self._stop.set()
        if self._store is None:
            return
        marked = threading.Thread(target=self._mark_done, daemon=True)
        marked.start()
        marked.join(timeout=self.timeout_s)  # a store that no longer answers: nobody is left

    def _mark_done(self) -> None:
        try:
            self._store.set(self.keys[self.rank], DONE.encode())
        except Exception:  # the store is gone: nobody is left to mistake us
            pass

    def _tell(self, found: Silent) -> None:
        """Write the verdict for the others (bounded: the store may be what went)."""
        v = {"rank": found.rank, "host": found.host, "address": found.address,
             "step": found.step, "silent_s": found.silent_s, "last_heard": found.last_heard,
             "stuck": found.stuck}  # fmt: skip
        told = threading.Thread(target=self._store.set, args=(self.verdict, json.dumps(v)),
                                daemon=True)  # fmt: skip
        told.start()
        told.join(timeout=self.interval_s)

    def _watch_store(self) -> None:
        while not self._stop.wait(self.interval_s):
            quiet = time.monotonic() - self._last_ok
            if self._owner_done:  # rank 0 serves the store (but for an agent's): it may go
                return
            if quiet > self.timeout_s + self.interval_s:
                info = self._last.get(0, {})
                self._silent(Silent(-1, info.get("host", self.addr), self.addr,
                                    int(info.get("step", self.step)), quiet,
                                    time.time() - quiet, self.rank, self.host))  # fmt: skip
                return

    def _joined(self) -> bool:
        """Wait until every rank has beaten once (a multi_get of a key not there yet would
        wait out the request's timeout); a rank that never does is silent."""
        try:
            self._store.wait([*self.keys, self.verdict], timedelta(seconds=self.join_timeout_s))
            self._last_ok = time.monotonic()
            return True
        except Exception:
            if self._stop.is_set():
                return False
            missing = [r for r, k in enumerate(self.keys) if not self._check(k)]
            peer = missing[0] if missing else -1
            self._silent(Silent(peer, "?", "?", 0, self.join_timeout_s,
                                time.time() - self.join_timeout_s, self.rank, self.host))  # fmt: skip
            return False

    def _check(self, key: str) -> bool:
        try:
            return self._store.check([key])
        except Exception:
            return False

    def _run(self) -> None:
        self._last_ok = time.monotonic() + self.join_timeout_s  # the join has its own bound
        if not self._joined():
            return
        count, seen, heard = 0, {}, {}
        started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            count += 1
            waits = self.main_waits()
            try:
                self._store.set(self.keys[self.rank], _beat(count, self.step, self.host,
                                                            self.address, self._at, waits))  # fmt: skip
                *values, verdict = self._store.multi_get([*self.keys, self.verdict])
            except Exception:  # the store timed out or its connection broke: _watch_store
                return
            now = self._last_ok = time.monotonic()
            if verdict:  # another rank found one first: the same one, in this rank's words
                v = json.loads(verdict)
                self._silent(Silent(v["rank"], v["host"], v["address"], v["step"],
                                    v["silent_s"], v["last_heard"], self.rank, self.host,
                                    v.get("stuck", False)), tell=False)  # fmt: skip
                return
            for peer, raw in enumerate(values):
                if peer == self.rank or raw == DONE.encode():
                    heard.pop(peer, None)
                    self._peer_at.pop(peer, None)
                    self._owner_done |= peer == 0 and raw == DONE.encode()
                    continue
                info = json.loads(raw)
                # every read: a live peer's beat changes each time
                self._peer_at[peer], self._peer_waits[peer] = info["at"], info.get("wait", False)
                if seen.get(peer) != info["n"]:
                    seen[peer], heard[peer], self._last[peer] = info["n"], now, info
                    continue
                quiet = now - heard.get(peer, started)
                if quiet > self.timeout_s:
                    self._silent(Silent(peer, info["host"], info["addr"], int(info["step"]),
                                        quiet, time.time() - quiet, self.rank, self.host))  # fmt: skip
                    return
            self._check_progress(waits)

    def settle(self) -> bool:
        """The main thread met a broken collective: wait up to two beats for this watch
        (or another rank's verdict) to name a silent peer. True: one is named, and this
        watch ends the process; False: nothing silent, the break is the main thread's to
        report (a killed peer's connections close at once)."""
        return self._found.wait(timeout=3 * self.interval_s)

    def _silent(self, found: Silent, tell: bool = True) -> None:
        with self._once:
            if not self._stop.is_set():
                self._stop.set()
                self._found.set()
                if tell and found.rank >= 0:
                    self._tell(found)
                # Give the others two beats to read the verdict before this rank goes: its
                # going breaks their collectives, and rank 0's process may serve the store.
                if (tell and found.rank >= 0) or self.rank == 0:
                    time.sleep(2 * self.interval_s)
                self.on_silent(found, self.where)


def leave(found: Silent, store: str) -> None:
    """Say who went silent (or is stuck) and end this process at once, wherever its main
    thread waits: the elastic agent starts the next round. A rank that is itself stuck
    writes the stacks of all its threads first (where its main thread waits)."""
    me = found.stuck and found.rank == found.by_rank
    try:
        if me:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.write(found.line(store) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stderr must not keep this rank in the step
        pass
    os._exit(EXIT_STUCK if me else EXIT_PEER_LOST)


def start_for_rank(
    rank: int,
    world: int,
    timeout_s: float,
    on_silent: Callable[[Silent, str], None] | None = None,
    stuck_s: float = 60.0,
    long_wait: Callable[[], bool] | None = None,
) -> Heartbeat | None:
    """This rank's heartbeat in the process group's store (MASTER_ADDR:MASTER_PORT: rank
    0's, or the elastic agent's for this round), started; None on one rank or when
    ``train.heartbeat_timeout_s`` is 0."""
    if world == 1 or timeout_s <= 0:
        return None
    addr, port = master_addr_port()
    # Each round of an elastic run has a store of its own (launch/elastic_train.py; the
    # agents' restart counts differ from host to host, so they cannot name the round).
    round_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    beat = Heartbeat(addr, port, rank, world, round_id=round_id, timeout_s=timeout_s,
                     interval_s=min(1.0, timeout_s / 10), address=local_address(addr, port),
                     on_silent=on_silent, stuck_s=stuck_s, long_wait=long_wait)  # fmt: skip
    beat.start()
    return beat


def take_note(run_dir: Path) -> dict | None:
    """The note a survivor of the round before left (``NOTE_FILE``), removed once read."""
    path = Path(run_dir) / NOTE_FILE
    try:
        note = json.loads(path.read_text(encoding="utf-8"))
        path.unlink()
        return note
    except (OSError, ValueError):
        return None
