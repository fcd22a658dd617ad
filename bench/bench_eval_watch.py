"""`plm eval --watch` beside training, on the rehearsal cluster (pipeline/rig.py; root):
training's time per step with and without the watcher, side by side in one run.

    # as root (or with sudo)
    python bench/bench_eval_watch.py [--steps 3000] [--save-every 600] [--pairs 2] [--json F]

Three hosts with a shared folder: node1 trains (`plm train`, bert-tiny, one rank), node2
watches the run (`plm eval SUITE --watch RUN`, a local Ray of its own) and node0 runs the
MLflow server both log to. A host of its own on a 2-core machine: node1's processes are
bound to CPU 0 and node2's and node0's to CPU 1 (`taskset`, inherited by every child).
Rounds alternate, alone then watched, watched then alone, ...; each is a fresh run. Time
per step = wall time between the run's first and last metrics rows over the steps between
them (saves included, the start-up not). Also checked: every checkpoint the watched run
wrote is in the watcher's table.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import rig_data, rig_env, up_rig  # noqa: E402

from pipeline import rig as rigmod  # noqa: E402

MLFLOW_PORT = 5002
CPU_TRAIN, CPU_OTHER = "0", "1"


def on_cpu(cpu: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *argv]


def plm(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def time_per_step(run: Path) -> tuple[float, int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "step_loss" in r]  # the training rows (not eval's)
    first, last = rows[0], rows[-1]
    return (last["time"] - first["time"]) / (last["step"] - first["step"]), last["step"]


def suite_file(base: Path, mlflow: str) -> Path:
    """One fine-tuning task of real text (the corpus' own sentences, which half)."""
    lines = [x for x in (base / "corpus.txt").read_text().splitlines() if x.strip()]
    rows = [{"text": x[:200], "label": "first" if i % 2 else "second"}
            for i, x in enumerate(lines[:160])]  # fmt: skip
    for name, part in (("train", rows[:120]), ("test", rows[120:])):
        (base / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    suite = {"name": "watch-bench", "seeds": [0],
             "budget": {"epochs": 1, "micro_batch_size": 16, "lr": 1.0e-3},
             "tasks": {"half": {"kind": "finetune", "task": {"type": "classification",
                                                              "max_length": 32},
                                "data": {"train": str(base / "train.jsonl"),
                                         "test": str(base / "test.jsonl")}}},
             "workers": {"cpus": 1}, "mlflow": {"tracking_uri": mlflow}}  # fmt: skip
    path = base / "suite.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(suite))
    return path


def one_round(rig, base: Path, k: int, watched: bool, args, env: dict, mlflow: str) -> dict:
    run = base / f"run{k}"
    train = plm("train", str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={base / 'data'}",
                f"train.out_dir={run}", f"train.max_steps={args.steps}",
                f"train.save_every={args.save_every}", "train.keep_last=100",
                "train.eval_every=0", "train.log_every=50", "train.bundle_every=0",
                f"mlflow.tracking_uri={mlflow}", f"name=watch{k}")  # fmt: skip
    watcher = None
    if watched:
        log = open(base / f"watch{k}.log", "wb")  # noqa: SIM115
        watcher = rig.popen("node2", on_cpu(CPU_OTHER, plm(
            "eval", str(base / "suite.json"), f"work_dir={base / f'eval{k}'}",
            "--watch", str(run), "--poll-s", "2")), env=env, cwd=str(base), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    t0 = time.monotonic()
    with open(base / f"train{k}.log", "wb") as out:
        rig.run("node1", on_cpu(CPU_TRAIN, train), env=env, cwd=str(base), stdout=out,
                stderr=subprocess.STDOUT, check=True)  # fmt: skip
    wall = time.monotonic() - t0
    per_step, last = time_per_step(run)
    row = {"round": k, "watched": watched, "s_per_step": per_step, "train_wall_s": wall,
           "steps": last}  # fmt: skip
    if watcher is not None:
        code = watcher.wait(timeout=1800)
        row["watch_after_train_s"] = time.monotonic() - t0 - wall
        cells = list(csv.DictReader(open(base / f"eval{k}" / "report" / "cells.csv")))
        scored = sorted({int(c["step"]) for c in cells if c["value"]})
        written = sorted(int(p.name[4:]) for p in (run / "checkpoints").glob("step*"))
        row |= {"watch_exit": code, "checkpoints": written, "scored": scored}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--save-every", type=int, default=600)
    ap.add_argument("--pairs", type=int, default=2, help="rounds alone + watched")
    ap.add_argument("--json")
    args = ap.parse_args()
    name = "wb"
    rig = up_rig(name, "bench_eval_watch", s3=False, ssh=False)
    base = rig.shared / "bench"
    base.mkdir()
    env = rig_env(REPO)
    try:
        rig_data(base, env)
        node0 = rig.hosts[0].address
        server = rig.popen("node0", on_cpu(CPU_OTHER, [
            str(Path(sys.executable).parent / "mlflow"), "server", "--host", node0,
            "--port", str(MLFLOW_PORT), "--allowed-hosts", f"{node0}:{MLFLOW_PORT}",
            "--backend-store-uri", f"sqlite:///{base / 'mlflow.db'}",
            "--artifacts-destination", str(base / "artifacts"), "--workers", "1"]),
            env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, cwd=str(base),
            stdout=open(base / "mlflow.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)  # fmt: skip
        mlflow = f"http://{node0}:{MLFLOW_PORT}"
        rigmod._wait_listening(rig, "node0", node0, MLFLOW_PORT, proc=server)
        suite_file(base, mlflow)
        order = [
            w for p in range(args.pairs) for w in ((False, True) if p % 2 == 0 else (True, False))
        ]
        rows = [one_round(rig, base, k, w, args, env, mlflow) for k, w in enumerate(order)]
    finally:
        rigmod.down(name)
    alone = [r["s_per_step"] for r in rows if not r["watched"]]
    watched = [r["s_per_step"] for r in rows if r["watched"]]
    pairs = [w / a for a, w in zip(alone, watched, strict=True)]
    summary = {
        "alone_ms_per_step": [round(x * 1000, 2) for x in alone],
        "watched_ms_per_step": [round(x * 1000, 2) for x in watched],
        "ratio_median": statistics.median(pairs), "ratio_pairs": [round(x, 3) for x in pairs],
        "every_checkpoint_scored": all(r["scored"] == r["checkpoints"] for r in rows
                                       if r["watched"]),
        "rows": rows,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
