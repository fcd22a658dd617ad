"""Elastic `plm train`: torch's elastic agent (torchrun) on every host, so a run carries on
by itself when a host dies, is preempted or comes back.

    # the same command on every host (3 hosts, at least 2 to train):
    python launch/elastic_train.py --nnodes 2:3 --nproc-per-node 8 \\
        --rdzv-endpoint node0:29400 CONFIG [key=value ...]

What happens (docs/elastic.md):
- the agents meet at ``--rdzv-endpoint`` (torch's c10d rendezvous; the agent on that host
  serves it, so that host must stay up, as a Ray head must) and start their ranks;
- a rank whose peer is gone fails: at once when the peer's processes died (its
  connections close), within ``train.collective_timeout_s`` when its host or link went
  silent. Each agent then stops its ranks and meets the others again; the hosts still
  up (at least MIN) start again from the last checkpoint on the new world size, the
  global batch kept (``train.global_batch``: grad_accum follows the world size);
- a host that comes back (its agent started again) is taken in at the next boundary: the
  agents stop their ranks with SIGTERM, which checkpoints at the next step boundary, and
  all start again, so no step is recomputed. A SIGTERM to one agent (a preemption notice)
  stops every rank the same way; the others carry on without that host.

Before anything starts it checks the command and runs `plm train --dry-run` at every world
size MIN..MAX, so a global batch that one of them cannot keep fails here.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shlex
import subprocess
import sys

HEARTBEAT_S = 3  # the agents' keep-alive period in the rendezvous
HEARTBEATS_MISSED = 3  # a host is dropped from the rendezvous after this many


class LaunchError(Exception):
    """A launch that cannot work as given; the message says what to change."""


def parse_nnodes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {text}: expected MIN:MAX (e.g. 2:3) or N") from None
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return low, high


def override(overrides: list[str], key: str) -> str | None:
    """The value ``key=...`` has among the overrides (the last one wins), or None."""
    found = None
    for item in overrides:
        name, sep, value = item.partition("=")
        if sep and name.strip() == key:
            found = value.strip()
    return found


def run_id(config: str, overrides: list[str]) -> str:
    """The same on every host for the same command: the rendezvous of one run."""
    text = "\0".join([os.path.basename(config), *sorted(overrides)])
    return "plm-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_batch(cfg, n_nodes: tuple[int, int], nproc: int) -> list[str]:
    """``train.global_batch`` to add (when the config leaves it unset: micro x grad_accum
    x the most ranks) after checking that every world size MIN..MAX keeps it."""
    t = cfg.train
    added = []
    global_batch = t.global_batch
    if global_batch is None:
        global_batch = t.micro_batch_size * t.grad_accum * n_nodes[1] * nproc
        added = [f"train.global_batch={global_batch}"]
    sizes = [n * nproc for n in range(n_nodes[0], n_nodes[1] + 1)]
    if any(global_batch % (t.micro_batch_size * ranks) for ranks in sizes):
        step = t.micro_batch_size * math.lcm(*sizes)
        fits = -(-global_batch // step) * step  # the next multiple that every size keeps
        raise LaunchError(
            f"a global batch of {global_batch} (train.global_batch, else micro_batch_size x "
            f"grad_accum x the most ranks) cannot be kept on {', '.join(map(str, sizes))} "
            f"ranks with train.micro_batch_size={t.micro_batch_size}: pass "
            f"train.global_batch={fits} (any multiple of {step})"
        )
    return added


def torchrun_argv(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    low, high = parse_nnodes(args.nnodes)
    conf = {
        "join_timeout": args.join_timeout,  # a lone host waits this long for MIN hosts
        "last_call_timeout": args.last_call,  # after MIN: how long the round waits for more
        "close_timeout": 30,
        "keep_alive_interval": HEARTBEAT_S,
        "keep_alive_max_attempt": HEARTBEATS_MISSED,
    }
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={low}:{high}", f"--nproc-per-node={args.nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
        f"--rdzv-id={args.run_id or run_id(args.config, overrides)}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        f"--max-restarts={args.max_restarts}", "--monitor-interval=0.5",
        "-m", "pipeline.cli", "train", args.config, *overrides,
    ]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/elastic_train.py",
        description="`plm train` under torch's elastic agent: one agent per host.",
    )
    parser.add_argument("config", help="experiment YAML (the same path on every host)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    # Defaults from the PET_* variables the Kubeflow training operator gives an elastic
    # PyTorchJob's pods (k8s/training/elastic), which torchrun itself reads too.
    env = os.environ
    parser.add_argument(
        "--nnodes", default=env.get("PET_NNODES"), help="MIN:MAX hosts (e.g. 2:3; PET_NNODES)"
    )
    parser.add_argument(
        "--nproc-per-node", type=int, default=int(env.get("PET_NPROC_PER_NODE", "1")),
        help="ranks per host (PET_NPROC_PER_NODE)",
    )  # fmt: skip
    parser.add_argument(
        "--rdzv-endpoint", default=env.get("PET_RDZV_ENDPOINT"),
        help="HOST:PORT of the rendezvous, a host that stays up (PET_RDZV_ENDPOINT)",
    )  # fmt: skip
    parser.add_argument("--run-id", help="the rendezvous id (default: from the command)")
    parser.add_argument(
        "--max-restarts", type=int, default=int(env.get("PET_MAX_RESTARTS", "10")),
        help="failures survived; a host joining is free (PET_MAX_RESTARTS)",
    )  # fmt: skip
    parser.add_argument("--join-timeout", type=int, default=600, help="seconds to wait for MIN")
    parser.add_argument(
        "--last-call", type=int, default=5, help="seconds a round waits for more than MIN hosts"
    )
    parser.add_argument("--skip-dry-run", action="store_true")
    parser.add_argument(
        "--print-only", action="store_true", help="print the command, start nothing"
    )
    return parser.parse_intermixed_args(argv)  # overrides before or after the flags


def dry_run(args: argparse.Namespace, overrides: list[str], low: int, high: int) -> None:
    cmd = [sys.executable, "-m", "pipeline.cli", "train", args.config, *overrides, "--dry-run"]
    for n in sorted({low, high}):
        env = {**os.environ, "WORLD_SIZE": str(n * args.nproc_per_node)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LaunchError(f"`plm train --dry-run` on {n} hosts refused the run:\n"
                              f"{proc.stderr.strip()}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not args.nnodes or not args.rdzv_endpoint:
            raise LaunchError("give --nnodes MIN:MAX and --rdzv-endpoint HOST:PORT (or PET_NNODES "
                              "and PET_RDZV_ENDPOINT, as the training operator sets them)")  # fmt: skip
        if os.environ.get("PET_RDZV_BACKEND", "c10d") != "c10d":
            raise LaunchError(f"PET_RDZV_BACKEND={os.environ['PET_RDZV_BACKEND']}: this launch "
                              "uses torch's c10d rendezvous (elasticPolicy.rdzvBackend: c10d)")  # fmt: skip
        low, high = parse_nnodes(args.nnodes)
        if args.nproc_per_node < 1:
            raise LaunchError("--nproc-per-node must be at least 1")
        if ":" not in args.rdzv_endpoint:
            raise LaunchError(f"--rdzv-endpoint {args.rdzv_endpoint}: expected HOST:PORT")
        from pipeline.config import load_config
        from pipeline.errors import ConfigError

        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as err:
            raise LaunchError(str(err)) from None
        if cfg.train.resume != "auto":
            raise LaunchError("train.resume=never: an elastic run resumes from its checkpoints")
        if not cfg.train.save_every:
            raise LaunchError("train.save_every=0: an elastic run needs checkpoints to go back to")
        overrides = [*args.overrides, *plan_batch(cfg, (low, high), args.nproc_per_node)]
        cmd = torchrun_argv(args, overrides)
        if args.print_only:
            print(shlex.join(cmd))
            return 0
        if not args.skip_dry_run:
            dry_run(args, overrides, low, high)
    except LaunchError as err:
        print(f"plm: elastic_train: {err}", file=sys.stderr)
        return 2
    # The agent gives its ranks this long after SIGTERM before SIGKILL: time to reach a
    # step boundary and checkpoint (train.stop_grace_s), plus a margin.
    env = {**os.environ}
    # A store of each round's own for the ranks (rank 0 serves it on a new port, as on a
    # plain launch), not the agents' store shared by every round: keys the ranks of a
    # failed round left there would be read by the next (gloo dialled dead ports).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(cfg.train.stop_grace_s) + 10))
    print(f"elastic: {shlex.join(cmd[2:])}", file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, env)  # this process becomes the agent: a SIGTERM reaches it


if __name__ == "__main__":
    sys.exit(main())
