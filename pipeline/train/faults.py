"""Faults between ranks, as one `plm:` line a person can act on.

A rank whose peer is gone meets it deep in gloo or NCCL: a RuntimeError carrying a C++
source location ("Connection reset by peer", "Timed out waiting 20000ms for recv"), raised
on every surviving rank with its Python stack. ``peer_fault`` turns such an error into a
``PeerLost`` naming this rank, its host, the step and the peer's address; `plm train` prints
its message and exits with ``EXIT_PEER_LOST``, which an elastic agent answers with a
restart (launch/elastic_train.py).

Before the first step, ``check_peers`` compares what each rank runs (Python, torch,
DeepSpeed, this package's source) and its clock: ranks that differ would diverge or
deadlock later, far from the cause, so the run refuses to start, naming them.
"""

from __future__ import annotations

import hashlib
import re
import socket
import sys
import time
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.errors import ConfigError

EXIT_PEER_LOST = 4
# Messages of the errors gloo, NCCL and the c10d store raise when a peer stops answering.
_TRANSPORT = re.compile(r"gloo|nccl|c10d|processgroup", re.I)
_ADDRESS = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3}|[0-9a-f:]+)\]:(\d+)", re.I)
_SOURCE_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


class PeerLost(Exception):
    """A collective or the rendezvous failed because another rank stopped or cannot be
    reached; the message names this rank, its host and the peer where known."""

    exit_code = EXIT_PEER_LOST


class RendezvousUnreachable(PeerLost):
    """A rank that cannot reach the rendezvous store (rendezvous.init_process_group); the
    message names the rank, its host, the address and what to check."""


def summary(err: BaseException) -> str:
    """The error's first line, without gloo's C++ source location and sign-off."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    line = _SOURCE_LOCATION.sub("", line)
    return line.split(". This is typically", 1)[0].strip()


def peer_fault(err: BaseException, rank: int, step: int, timeout_s: float) -> PeerLost | None:
    """``err`` as a PeerLost when it is a transport failure between ranks, else None."""
    is_dist = isinstance(err, dist.DistError)
    if not is_dist and not (isinstance(err, RuntimeError) and _TRANSPORT.search(str(err))):
        return None
    first = summary(err)
    peer = _ADDRESS.search(str(err))
    who = f" (peer {peer.group(1)})" if peer else ""
    if re.search(r"timed out|timeout", first, re.I):
        what = (
            f"a collective waited train.collective_timeout_s={timeout_s:g} s for its peers{who}: "
            "a host stopped answering or its link is down"
        )
    else:
        what = f"a peer's connection broke{who}: a rank or host stopped"
    return PeerLost(
        f"rank {rank} on {socket.gethostname()} at step {step}: {what} ({first}). Under "
        "launch/elastic_train.py the hosts still up start again from the last checkpoint; "
        "otherwise rerun the same command once every host is up"
    )


@cache
def source_fingerprint() -> str:
    """sha256 of this package's Python source: two hosts with another checkout differ."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def software() -> dict[str, str]:
    import deepspeed

    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "plm source": source_fingerprint(),
    }


def check_peers(max_clock_skew_s: float) -> None:
    """Every rank: the same software as rank 0, and a clock within ``max_clock_skew_s``
    of rank 0's (0: not checked). A ConfigError naming the ranks and hosts that differ
    (every rank raises it; rank 0 prints it)."""
    world = dist.get_world_size()
    if world == 1:
        return
    mine = {"host": socket.gethostname(), "software": software(), "time": 0.0}
    gathered: list[dict] = [{} for _ in range(world)]
    dist.barrier()  # the clocks are read as the ranks leave it, within milliseconds
    mine["time"] = time.time()
    dist.all_gather_object(gathered, mine)
    ref = gathered[0]
    problems = []
    for rank, other in enumerate(gathered[1:], start=1):
        diff = [
            f"{k} {other['software'][k]} (rank 0: {ref['software'][k]})"
            for k in ref["software"]
            if other["software"].get(k) != ref["software"][k]
        ]
        if diff:
            problems.append(f"rank {rank} on {other['host']} runs {', '.join(diff)}")
        skew = other["time"] - ref["time"]
        if max_clock_skew_s and abs(skew) > max_clock_skew_s:
            problems.append(
                f"rank {rank} on {other['host']} has a clock {skew:+.1f} s off rank 0's "
                f"(on {ref['host']}; train.max_clock_skew_s={max_clock_skew_s:g})"
            )
    if problems:
        raise ConfigError(
            "the ranks differ: "
            + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            + ". Install the same software on every host (one image) and sync the clocks "
            "(chrony/NTP)"
        )
