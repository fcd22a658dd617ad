"""Training speed by CPU thread setting, on an idle machine and on a loaded one (issue 52.5).

    python bench/bench_threads.py --data DATA_DIR                  # 1 and 2 ranks, idle and loaded
    python bench/bench_threads.py --data DATA_DIR --load 6 --rounds 1

Each run is the CLI a user runs: `plm train configs/test/bert-tiny.yaml` for --steps steps
(no save, no evaluation, a new sqlite MLflow store), 1 rank as a plain process, 2 ranks
under `deepspeed --num_gpus 2` (the CPU accelerator, gloo). The settings, in turn within a
round: what plm chooses by itself (nothing set), and each variable of SETTINGS set in the
environment as a user would. "Loaded" is --load busy Python loops at the same priority,
started before the runs and killed by PID after them (load about --load on top). Measured
per run: the median tokens/s of rank 0's metrics.jsonl rows after --skip steps (the
trainer's own figure: tokens of the global batch over the step's wall time), and the
run's wall seconds. DATA_DIR: a prepared data dir of a WordPiece tokenizer (`plm demo`
writes demo/data).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> the environment a user would set (plm's own choice is "plm's choice": nothing)
SETTINGS = {
    "plm's choice": {},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
    "OMP_NUM_THREADS=2": {"OMP_NUM_THREADS": "2"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(data: str, ranks: int, extra: dict[str, str], steps: int, skip: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(extra, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    train = ["train", str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={data}",
             f"train.out_dir={work / 'run'}", f"train.max_steps={steps}", "train.save_every=0",
             "train.eval_every=0", "train.log_every=1", "mlflow.register=false",
             f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}"]  # fmt: skip
    if ranks == 1:
        cmd = [sys.executable, "-m", "pipeline.cli", *train]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
               "--master_port", str(free_port()), "--module", "pipeline.cli", *train]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{ranks} ranks, {extra} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > skip]
    shutil.rmtree(work, ignore_errors=True)
    return {"tokens_per_s": statistics.median(rates), "wall_s": wall}


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a prepared data dir (WordPiece)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    ap.add_argument("--load", type=int, default=12, help="busy loops of the loaded machine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results: list[dict] = []
    for loaded in (False, True):
        load = start_load(args.load) if loaded else []
        try:
            time.sleep(5 if loaded else 0)
            for rnd in range(args.rounds):
                for ranks in args.ranks:
                    for name in args.settings:
                        r = one_run(args.data, ranks, SETTINGS[name], args.steps, args.skip)
                        r.update(loaded=loaded, ranks=ranks, setting=name, round=rnd,
                                 load1=os.getloadavg()[0])  # fmt: skip
                        results.append(r)
                        print(f"{'loaded' if loaded else 'idle'} {ranks} rank(s) {name}: "
                              f"{r['tokens_per_s']:,.0f} tok/s, {r['wall_s']:.0f} s "
                              f"(load {r['load1']:.1f})", flush=True)  # fmt: skip
        finally:
            stop_load(load)
    print("\n| machine | ranks | setting | tokens/s (median of runs) | run s |")
    print("|---|---|---|---|---|")
    for loaded in (False, True):
        for ranks in args.ranks:
            for name in args.settings:
                rs = [r for r in results if (r["loaded"], r["ranks"], r["setting"]) == (loaded, ranks, name)]  # fmt: skip
                tok = statistics.median(r["tokens_per_s"] for r in rs)
                wall = statistics.median(r["wall_s"] for r in rs)
                where = f"loaded (+{args.load} busy loops)" if loaded else "idle"
                print(f"| {where} | {ranks} | {name} | {tok:,.0f} | {wall:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
