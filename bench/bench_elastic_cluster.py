"""Losing a host, on the rehearsal cluster (pipeline/rig.py; root): what each membership
change of an elastic run costs, bert-tiny on 3 hosts x 1 rank (launch/elastic_train.py).

    # as root (or with sudo)
    python bench/bench_elastic_cluster.py [--timeout 300] [--steps 5000] [--keep]

One run goes through five changes, each started when the run is past a given step:
1. kill: every training process of node2 (agent and rank) gets SIGKILL;
2. back: node2's agent is started again;
3. link cut: node2's link goes down (`ip link set <veth> down`), nothing is killed;
   then the link comes back up, and node2's agent, alive all along, rejoins (4. relink);
5. preempted: SIGTERM to node2's agent (a preemption notice);
6. back again, then 7. frozen: every process of node2 gets SIGSTOP (a frozen VM).

A silent host (3 and 7) is found by the ranks' heartbeats (``train.heartbeat_timeout_s``,
10 s by default); ``--timeout`` (``train.collective_timeout_s``, default 300) is the last
bound of a collective.

For each: the time from the event to the end of the first step after it, split into
detection (event -> the first survivor's rank fails, from the agents' log timestamps; for
a change that adds a host, event -> the running ranks are told to stop), rendezvous and
restart (-> the new rank process starts), and start-up (process start -> first step done:
imports, DeepSpeed, the resume, one step; the run's elastic/startup_s); and the steps
recomputed (the run's elastic/steps_recomputed). Prints one table, writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import rig_data, rig_env, up_rig  # noqa: E402

from pipeline import rig as rigmod  # noqa: E402

AGENT_TIME = re.compile(
    r"^[WEI](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*(?:failed \(exitcode|Sending process)"
)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def training_pids(rig, host: str) -> list[int]:
    found = []
    for pid in rig.pids(host):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" in cmd or b"pipeline.cli" in cmd:
            found.append(pid)
    return found


def agent_events(log: Path, after: float) -> list[float]:
    """Times of the agent's "failed (exitcode" / "Sending process ... SIGTERM" lines."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = AGENT_TIME.match(line)
        if m:
            day = datetime.now().strftime("%Y")
            stamp = datetime.strptime(f"{day}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            t = stamp.timestamp()
            if t >= after:
                out.append(t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=int, default=300, help="train.collective_timeout_s")
    ap.add_argument("--steps", type=int, default=5000, help="more than the scenario needs")
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true", help="leave the rig up")
    args = ap.parse_args()
    name = "eb"
    rig = up_rig(name, "bench_elastic_cluster")
    base = rig.shared / "bench"
    base.mkdir()
    env = rig_env(REPO)
    try:
        rig_data(base, env)
        run_dir = base / "run"
        cmd = [
            sys.executable, str(REPO / "launch/elastic_train.py"), "--nnodes", "2:3",
            "--rdzv-endpoint", "node0:29400", "--last-call", "8", "--skip-dry-run",
            str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={base / 'data'}",
            f"train.out_dir={run_dir}", f"train.max_steps={args.steps}", "train.save_every=10",
            "train.eval_every=0", "train.log_every=1", "train.global_batch=48",
            "train.bundle_every=0", "mlflow.register=false",
            f"mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}",
            f"train.collective_timeout_s={args.timeout}",
        ]  # fmt: skip
        agents, logs = {}, {}

        def start(host: str, k: int) -> None:
            logs[host] = base / f"{host}-{k}.log"
            agents[host] = rig.popen(host, cmd, env=env, cwd=str(base),
                                     stdout=open(logs[host], "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

        def wait(pred, what: str, limit: float = 600):
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                got = pred()
                if got:
                    return got
                time.sleep(0.1)
            raise SystemExit(f"bench: no {what} within {limit:.0f} s; logs in {base}")

        def changes() -> int:
            return max((r.get("elastic/changes", 0) for r in rows(run_dir)), default=0)

        def past(step: int) -> bool:
            return any(r.get("step", 0) >= step and "step_loss" in r for r in rows(run_dir))

        def last_step() -> int:
            return max((r["step"] for r in rows(run_dir) if "step_loss" in r), default=0)

        for h in ("node0", "node1", "node2"):
            start(h, 0)
        wait(lambda: past(25) and rows(run_dir)[-1].get("world_size") == 3, "3-rank steps")
        veth = rig.host("node2").veth
        results = []

        def change(label: str, event) -> None:
            n = changes()
            at = time.time()
            event()
            row = wait(lambda: next((r for r in rows(run_dir)
                                     if r.get("elastic/changes") == n + 1), None),
                       f"change after {label}")  # fmt: skip
            survivors = [logs["node0"], logs["node1"]]
            detected = min((t for log in survivors for t in agent_events(log, at)), default=None)
            total = row["time"] - at
            startup = row["elastic/startup_s"]
            detect = (detected - at) if detected else float("nan")
            results.append({
                "change": label, "world": f"{int(row['elastic/old_world_size'])} -> "
                f"{int(row['elastic/world_size'])}", "detect_s": detect,
                "rendezvous_restart_s": total - detect - startup, "startup_s": startup,
                "event_to_first_step_s": total,
                "steps_recomputed": int(row["elastic/steps_recomputed"]),
            })  # fmt: skip
            print(f"{label}: {results[-1]}", flush=True)
            target = last_step() + 15
            wait(lambda: past(target), f"15 steps after {label}")

        def kill() -> None:
            for pid in training_pids(rig, "node2"):
                os.kill(pid, signal.SIGKILL)

        change("kill (SIGKILL)", kill)
        change("back (agent started)", lambda: start("node2", 1))
        cut_at = {}

        def cut() -> None:
            cut_at["t"] = time.time()
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)

        change("link cut", cut)
        change("link back up", lambda: subprocess.run(["ip", "link", "set", veth, "up"],
                                                      check=True))  # fmt: skip
        change("SIGTERM (preempted)", lambda: agents["node2"].send_signal(signal.SIGTERM))
        change("back again (agent started)", lambda: start("node2", 2))

        def freeze() -> None:  # a frozen VM: every process of the host stops, nothing dies
            for pid in training_pids(rig, "node2"):
                os.kill(pid, signal.SIGSTOP)

        change("frozen (SIGSTOP of every process)", freeze)
        for h in ("node0", "node1"):  # the figures are in: stop the run (a checkpoint)
            agents[h].send_signal(signal.SIGTERM)
        codes = {h: agents[h].wait(timeout=300) for h in ("node0", "node1")}
        print(f"agents stopped with SIGTERM: exit codes {codes}")
        table = ["| change | world | detection s | rendezvous + restart s | start-up s | "
                 "event to first step s | steps recomputed |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in results:
            table.append(
                f"| {r['change']} | {r['world']} | {r['detect_s']:.1f} | "
                f"{r['rendezvous_restart_s']:.1f} | {r['startup_s']:.1f} | "
                f"{r['event_to_first_step_s']:.1f} | {r['steps_recomputed']} |"
            )
        print("\n".join(table))
        if args.json:
            Path(args.json).write_text(json.dumps({"timeout": args.timeout, "results": results},
                                                  indent=2))  # fmt: skip
    finally:
        for h in ("node0", "node1", "node2"):
            for pid in training_pids(rig, h):
                os.kill(pid, signal.SIGKILL)
        if not args.keep:
            rigmod.down(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
