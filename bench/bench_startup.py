"""Time to the first step and to exit of a 1-step `plm train` (bert-tiny, a new sqlite
MLflow store), code trees side by side, taking turns, against `import torch`.

    python bench/bench_startup.py --data DATA_DIR [--rounds 5] TREE [TREE ...]

Each run is a fresh `python -m pipeline.cli train configs/test/bert-tiny.yaml
train.max_steps=1` with ``PYTHONPATH=TREE`` (a checkout or worktree: before and after a
change), a new out_dir and a new sqlite store (its migrations included), one torch thread.
Printed per tree: the median (min, max) of the seconds until the `step 1:` line and until
exit, and of exit / `import torch` (a fresh `python -c "import torch"` timed in the same
round: the goal is <= 4x); the same for the CPU seconds (user + system) of each process,
which other work on the machine changes less than the wall time. The command returns once the run, its params, tags, metrics and
model are in the store: after each run (untimed) the store is read through MLflow's client
and a run that left any of them out stops the bench. DATA_DIR: any prepared data dir of a
WordPiece tokenizer (`plm demo` writes demo/data).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def waited(proc: subprocess.Popen) -> tuple[int, float]:
    """Reap ``proc``: its exit code and its CPU seconds (user + system)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def one_run(tree: str, data: str) -> tuple[float, float, float]:
    work = tempfile.mkdtemp(prefix="bench-startup-")
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pipeline.cli", "train", f"{tree}/configs/test/bert-tiny.yaml",
           f"data.path={data}", "train.max_steps=1", "train.eval_every=0",
           "train.save_every=0", f"train.out_dir={work}/run",
           f"mlflow.tracking_uri=sqlite:///{work}/mlflow.db"]  # fmt: skip
    try:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=work, env=env)  # fmt: skip
        first = None
        for line in proc.stdout:
            if first is None and "step 1:" in line:
                first = time.monotonic() - start
        proc.stdout.close()
        code, cpu = waited(proc)
        total = time.monotonic() - start
        if code != 0 or first is None:
            raise SystemExit(f"{tree}: plm train exited {code} (first step seen: {first})")
        check_store(tree, f"sqlite:///{work}/mlflow.db")
        return first, total, cpu
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_store(tree: str, uri: str) -> None:
    """What the timed command must have left in its store, read through MLflow's client."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("bert-tiny").experiment_id])
    mv = client.get_model_version_by_alias("bert-tiny", "current")
    missing = [what for what, ok in (
        ("a FINISHED run", run.info.status == "FINISHED"),
        ("its params", run.data.params.get("train.max_steps") == "1"),
        ("its tags", "code_version" in run.data.tags),
        ("the step-1 loss", [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]),
        ("the model artifacts", bool(client.list_artifacts(run.info.run_id, "model"))),
        ("the registered model", mv.run_id == run.info.run_id),
    ) if not ok]  # fmt: skip
    if missing:
        raise SystemExit(f"{tree}: plm train exited 0 without {', '.join(missing)} in {uri}")


def import_torch() -> tuple[float, float]:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", "import torch"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    code, cpu = waited(proc)
    if code != 0:
        raise SystemExit(f"python -c 'import torch' exited {code}")
    return time.monotonic() - start, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[tuple[float, ...]]] = {t: [] for t in args.trees}
    torch_s, torch_cpu = [], []
    for r in range(args.rounds):
        wall, cpu = import_torch()
        torch_s.append(wall)
        torch_cpu.append(cpu)
        for tree in args.trees:
            first, total, run_cpu = one_run(tree, args.data)
            times[tree].append((first, total, total / wall, run_cpu, run_cpu / cpu))
            print(f"round {r + 1} {tree}: first step {first:.2f} s, exit {total:.2f} s "
                  f"({total / wall:.2f}x import torch {wall:.2f} s), CPU {run_cpu:.2f} s "
                  f"({run_cpu / cpu:.2f}x {cpu:.2f} s)", flush=True)  # fmt: skip

    def spread(xs: list[float], unit: str) -> str:
        return f"{statistics.median(xs):.2f}{unit} [{min(xs):.2f}, {max(xs):.2f}]"

    print(f"import torch: {spread(torch_s, ' s')}, CPU {spread(torch_cpu, ' s')}")
    for tree, runs in times.items():
        firsts, totals, ratios, cpus, cpu_ratios = ([x[i] for x in runs] for i in range(5))
        print(
            f"{tree}: first step {spread(firsts, ' s')}, exit {spread(totals, ' s')}, "
            f"exit / import torch {spread(ratios, 'x')}; CPU {spread(cpus, ' s')}, "
            f"/ import torch's {spread(cpu_ratios, 'x')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
