"""Where ours' training step spends its time: phase times and the profiler's top operators.

    python bench/gpu_profile.py --data-dir bench/gpu_carry/gpt --what gpt --out DIR
    python bench/gpu_profile.py --data-dir bench/gpu_carry/bert --what bert-unpad --out DIR

For the step that bench_gpt.py / bench_train.py time as "ours" (``Trainer.train_step``,
ZeRO-0, world size 1, bf16 on CUDA): after --warmup steps, --steps steps with the device
synchronised around each phase (the batch to the device + forward, the loss, backward,
the optimizer step; wall ms per phase, median), then --profile steps under
``torch.profiler`` (CPU and CUDA), whose operator tables (by device time and by CPU self
time) go to DIR/profile-WHAT.txt. The phases are found by wrapping the trainer's own
methods on this instance only; nothing in the project changes. CPU: tiny presets (--cpu).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402


def build(args, tmp: Path):
    import bench_gpt
    import bench_train

    precision = "fp32" if args.cpu else "bf16"
    if args.what == "gpt":
        ns = SimpleNamespace(preset="gpt2-tiny" if args.cpu else "gpt2-124m",
                             batch=4 if args.cpu else 16, seq=64 if args.cpu else 1024, lr=6e-4, seed=0, dropout=0.0,
                             precision=precision)  # fmt: skip
        return bench_gpt.gpt_config(ns, Path(args.data_dir), tmp / "run", args.compile)
    preset = "bert-tiny" if args.cpu else "bert-base"
    ns = SimpleNamespace(batch_of={preset: 8 if args.cpu else 128}, seq=64 if args.cpu else 128,
                         lr=1e-4, seed=0,
                         precision=precision)  # fmt: skip
    return bench_train.bert_config(ns, preset, Path(args.data_dir), tmp / "run",
                                   args.what == "bert-unpad")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--what", choices=["gpt", "bert-unpad", "bert-padded"], required=True)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="tiny presets, fp32, on the CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=2)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    benchlib.deny_imports(["ray", "mlflow"])
    import tempfile

    import torch

    from pipeline.train.trainer import Trainer

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    tmp = Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    trainer = Trainer(build(args, tmp))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    phases: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            sync()
            t0 = time.perf_counter()
            with torch.profiler.record_function(f"plm::{name}"):
                out = fn(*a, **kw)
            sync()
            phases.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            return out

        return wrapper

    trainer.device_batch = timed("to_device", trainer.device_batch)
    trainer.forward = timed("forward", trainer.forward)
    trainer.objective.loss = timed("loss", trainer.objective.loss)
    engine = trainer.engine
    engine.backward = timed("backward", engine.backward)
    engine.step = timed("optimizer_step", engine.step)
    stream = iter(trainer.stream)
    whole: list[float] = []

    def one_step():
        batch = next(stream)
        sync()
        t0 = time.perf_counter()
        trainer.train_step(iter([batch]))
        sync()
        whole.append((time.perf_counter() - t0) * 1e3)
        trainer.step += 1

    for _ in range(args.warmup):
        one_step()
    phases.clear()
    whole.clear()
    for _ in range(args.steps):
        one_step()
    lines = [f"{args.what}{' compiled' if args.compile else ''}: "
             f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}",
             f"whole step (synced): median {statistics.median(whole):.2f} ms "
             f"{[round(x, 2) for x in whole]}"]  # fmt: skip
    accounted = 0.0
    for name, ms in phases.items():
        med = statistics.median(ms)
        accounted += med * len(ms) / args.steps
        lines.append(f"  {name:15s} median {med:8.2f} ms  calls/step {len(ms) / args.steps:.0f}")
    lines.append(f"  {'(rest)':15s} {statistics.median(whole) - accounted:8.2f} ms")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.profile):
            one_step()
    table = prof.key_averages()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    report = "\n".join(lines)
    print(report, flush=True)
    text = (report + f"\n\n== by {sort}\n" + table.table(sort_by=sort, row_limit=40)
            + "\n== by self_cpu_time_total\n" + table.table(sort_by="self_cpu_time_total",
                                                            row_limit=30))  # fmt: skip
    name = f"profile-{args.what}{'-compiled' if args.compile else ''}.txt"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / name).write_text(text)
    print(table.table(sort_by=sort, row_limit=15), flush=True)
    trainer.stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
