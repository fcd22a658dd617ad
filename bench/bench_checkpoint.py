"""How long a checkpoint save blocks training, against the step it interrupts (issue 30).

    python bench/bench_checkpoint.py                       # bert-base, ZeRO-2, 1 and 2 ranks
    python bench/bench_checkpoint.py --ranks 1 --saves 2   # quicker
    python bench/bench_checkpoint.py --out-dir /mnt/nvme/x # checkpoints on another disk

Data (as bench_train.py, through benchlib): a generated English-like corpus, a WordPiece
tokenizer of --vocab-size (BERT's 30522 by default) and shards, cached under --work-dir.

Per world size (1 rank: a plain process; 2 ranks: ``deepspeed --num_gpus 2`` with the CPU
accelerator and gloo, one torch thread per rank), each rank builds the real ``Trainer``
(bert-base from configs/models, objective mlm, ZeRO-2 from configs/deepspeed/zero2.json,
--precision, micro batch --micro-batch x --seq, grad_accum 1, ``train.keep_last`` as
configured) and runs ``Trainer.train_step`` on its loader as ``Trainer.run`` does. After
--warmup steps it repeats --saves times: --steps-between timed steps, then one timed
``Trainer.save()``. Then, outside the timed part, rank 0 fsyncs every file of the new
checkpoint (the save itself fsyncs only our small files: DeepSpeed's ``torch.save``
returns once the bytes are in the page cache): what was still not on the disk when the
save returned (the kernel writes back during the save already, so this is no disk
bandwidth).

Measured on rank 0, wall seconds (training is blocked in wall time), the device
synchronised first on CUDA:

- step: one optimizer step (``train_step``, its loader included), median over all timed
  steps;
- save blocked: from the call of ``Trainer.save()`` to its return;
- its parts, timed by wrapping what ``CheckpointManager.save`` calls: DeepSpeed's
  ``save_checkpoint`` (split into each ``torch.save`` of its checkpoint engine: the model
  states file, the ZeRO optimizer partition; the rest is its state-dict gathering and
  barriers), our trainer state file (pickling + fsync'd write), config.yaml /
  ds_config.json, the three barriers of ``CheckpointManager.save``, COMPLETE, ``latest``,
  pruning the checkpoint that ``keep_last`` drops, and the rest (``prune_bundles``, the
  log line, reading the metrics window);
- bytes: the files of the checkpoint folder (every rank's), after the save;
- memory: after the timed saves, one more save whose writes are waited for at once (no
  step in between): rank 0's peak resident memory (VmHWM, reset first) above what it held
  before the call. A synchronous save's is torch.save's; an asynchronous one's is what the
  writer holds or copies.

Prints one table per world size and a summary with the ratio save blocked / step; --json
writes everything. The checkpoints go under --out-dir (default: a temp dir in /var/tmp),
removed at the end.
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
sys.path.insert(0, str(REPO / "bench"))

from benchlib import add_common_args, data_info, load1, prepare_data  # noqa: E402


def experiment(args, data: Path, run_dir: Path):
    from pipeline.config import validate_dict

    raw = {
        "name": "bench-checkpoint",
        "model": {"arch": "bert", "preset": args.preset},
        "objective": {"kind": "mlm"},
        "data": {"path": str(data), "seq_len": args.seq, "workers": 0},
        "train": {
            "micro_batch_size": args.micro_batch, "grad_accum": 1, "precision": args.precision,
            "max_steps": 1_000_000, "warmup_steps": 0, "schedule": "constant",
            "eval_every": 0, "save_every": 0, "log_every": 1_000_000, "resume": "never",
            "keep_last": args.keep_last, "out_dir": str(run_dir),
            "async_save": args.async_save == "on",
        },
        "deepspeed": f"configs/deepspeed/zero{args.stage}.json",
        "mlflow": {"tracking_uri": f"sqlite:///{run_dir / 'mlflow.db'}", "register": False},
    }  # fmt: skip
    return validate_dict(raw, "bench-checkpoint")


class Parts:
    """Wall seconds per named part of a save, filled by the wrappers of ``instrument``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, name_of, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name_of(*a, **kw), time.perf_counter() - t0)

        return wrapper


class TimedBarriers:
    """``torch.distributed`` as ``pipeline.train.checkpoint`` sees it, its barriers timed."""

    def __init__(self, dist, parts: Parts):
        self._dist, self._parts, self._n = dist, parts, 0

    def barrier(self, *a, **kw):
        self._n += 1
        t0 = time.perf_counter()
        try:
            return self._dist.barrier(*a, **kw)
        finally:
            self._parts.add("barriers (3, CheckpointManager.save)", time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._dist, name)


def _file_part(path) -> str:
    name = Path(str(path)).name
    if name.startswith("trainer_rank"):
        return "our trainer state (loader, RNG; fsync'd)"
    if name in ("config.yaml", "ds_config.json"):
        return "config.yaml + ds_config.json"
    if name == "COMPLETE":
        return "COMPLETE"
    if name == "latest":
        return "latest pointer"
    return f"other file {name}"


def _ds_file_part(state_dict, path) -> str:
    name = Path(str(path)).name
    if "optim_states" in name:
        return "  torch.save ZeRO optimizer partition (fp32 master + Adam moments)"
    if "model_states" in name:
        return "  torch.save model states (module weights, scheduler, client state)"
    return f"  torch.save {name}"


def instrument(trainer, parts: Parts) -> None:
    """Wrap what a save calls so ``parts`` gets each piece's wall seconds (on every rank;
    rank 0's are reported)."""
    import pipeline.train.checkpoint as ckpt_mod

    engine = trainer.engine
    ce = engine.checkpoint_engine
    ce.save = parts.timed(_ds_file_part, ce.save)
    engine.save_checkpoint = parts.timed(
        lambda *a, **kw: "DeepSpeed save_checkpoint", engine.save_checkpoint
    )
    ckpt_mod.atomic_write = parts.timed(lambda path, data: _file_part(path), ckpt_mod.atomic_write)
    ckpt_mod._torch_bytes = parts.timed(
        lambda obj: "our trainer state (loader, RNG; fsync'd)", ckpt_mod._torch_bytes
    )
    ckpt_mod.dist = TimedBarriers(ckpt_mod.dist, parts)
    trainer.ckpt._prune = parts.timed(lambda **kw: "prune (keep_last)", trainer.ckpt._prune)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fsync_folder(folder: Path) -> tuple[float, int]:
    """fsync every file under ``folder``: (seconds, bytes)."""
    t0 = time.perf_counter()
    total = 0
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - t0, total


def rank_main(args) -> None:
    import torch.distributed as dist

    import pipeline.train.checkpoint as ckpt_mod
    from pipeline.train.trainer import Trainer

    cfg = experiment(args, Path(args.data_dir), Path(args.run_dir))
    trainer = Trainer(cfg)
    rank, world = trainer.rank, trainer.world
    if cfg.train.async_save:  # installed now, so that instrument() wraps its save
        trainer.ckpt.install_writer(trainer.engine)
    it = iter(trainer.stream)
    steps: list[float] = []
    saves: list[dict] = []

    def step(timed: bool) -> None:
        _sync()
        t0 = time.perf_counter()
        record = trainer.train_step(it)
        trainer.step += 1
        if record is not None:
            trainer.window.append(record)  # as Trainer.run: save() reads the window
        _sync()
        if timed:
            steps.append(time.perf_counter() - t0)

    for _ in range(args.warmup):
        step(timed=False)
    for _ in range(args.saves):
        for _ in range(args.steps_between):
            step(timed=True)
        parts = Parts()
        saved = (ckpt_mod.atomic_write, ckpt_mod._torch_bytes, ckpt_mod.dist)
        instrument(trainer, parts)
        _sync()
        t0 = time.perf_counter()
        tag = trainer.save()
        blocked = time.perf_counter() - t0
        ckpt_mod.atomic_write, ckpt_mod._torch_bytes, ckpt_mod.dist = saved
        del trainer.engine.save_checkpoint, trainer.ckpt._prune  # back to the class's
        del trainer.engine.checkpoint_engine.save
        # what Checkpointer.step_done does next with train.bundle_every: 1 (the default)
        _sync()
        t0 = time.perf_counter()
        trainer.bundle(tag)
        bundle_s = time.perf_counter() - t0
        # Asynchronous: training goes on while the files are written; then the wait (if
        # any) for the writes, as the next save or the end of the run makes it.
        writing_steps: list[float] = []
        finish_wait = 0.0
        if trainer.ckpt.pending is not None:
            for _ in range(args.steps_between):
                before = len(steps)
                step(timed=True)
                writing_steps.append(steps.pop(before))
            t0 = time.perf_counter()
            trainer.ckpt.finish()
            finish_wait = time.perf_counter() - t0
        folder = trainer.ckpt.root / tag
        flush_s, nbytes = fsync_folder(folder) if rank == 0 else (0.0, 0)
        dist.barrier()
        saves.append({"tag": tag, "blocked_s": blocked, "parts": parts.seconds,
                      "bytes": nbytes, "fsync_after_s": flush_s, "bundle_s": bundle_s,
                      "writing_steps_s": writing_steps, "finish_wait_s": finish_wait})  # fmt: skip
    files = sorted(p.name for p in (trainer.ckpt.root / saves[-1]["tag"]).iterdir())
    # Memory: one more save, then its writes waited for at once (no step in between, so
    # no activations): the rank's peak resident memory above what it held before the call.
    _reset_peak_rss()
    before = _rss_kib("VmRSS")
    trainer.save()
    trainer.ckpt.finish()
    save_extra_mib = (_rss_kib("VmHWM") - before) / 1024
    if rank == 0:
        out = {
            "world": world, "params": trainer.n_params, "vocab_size": trainer.meta["vocab_size"],
            "steps_s": steps, "saves": saves, "torch_threads": _threads(),
            "rss_before_save_mib": before / 1024, "save_peak_extra_mib": save_extra_mib,
            "rank0_files": files,
        }  # fmt: skip
        Path(args.result).write_text(json.dumps(out, indent=1))
    trainer.stream.close()


def _reset_peak_rss() -> None:
    """VmHWM starts again from the current resident size (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args, ranks: int, data: Path, out_dir: Path) -> dict:
    run_dir = out_dir / f"run-{ranks}"
    result = out_dir / f"result-{ranks}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(max(1, 2 // ranks)),
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    if args.device == "cuda":
        env.pop("DS_ACCELERATOR")
    me = str(Path(__file__).resolve())
    inner = [me, "--rank-main", f"--data-dir={data}", f"--run-dir={run_dir}",
             f"--result={result}", f"--preset={args.preset}", f"--stage={args.stage}",
             f"--precision={args.precision}", f"--micro-batch={args.micro_batch}",
             f"--seq={args.seq}", f"--warmup={args.warmup}", f"--saves={args.saves}",
             f"--steps-between={args.steps_between}", f"--keep-last={args.keep_last}",
             f"--device={args.device}", f"--async-save={args.async_save}"]  # fmt: skip
    if ranks == 1:
        cmd = [sys.executable, *inner]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
               "--master_port", str(_port()), *inner]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{ranks} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    res = json.loads(result.read_text())
    res["process_wall_s"] = time.perf_counter() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    return res


def report(res: dict) -> dict:
    step = statistics.median(res["steps_s"])
    blocked = [s["blocked_s"] for s in res["saves"]]
    med = statistics.median(blocked)
    nbytes = statistics.median(s["bytes"] for s in res["saves"])
    flush = statistics.median(s["fsync_after_s"] for s in res["saves"])
    with_bundle = statistics.median(s["blocked_s"] + s["bundle_s"] for s in res["saves"])
    print(f"\n## {res['world']} rank(s): {res['params']:,} parameters (vocab {res['vocab_size']:,}), "
          f"{res['torch_threads']} torch thread(s) per rank; rank 0 wrote "
          f"{', '.join(res['rank0_files'])}")  # fmt: skip
    names = list(dict.fromkeys(n for s in res["saves"] for n in s["parts"]))
    print("| part of Trainer.save() on rank 0 | " + " | ".join(
        f"save {i + 1} s" for i in range(len(blocked))) + " | share of the median |")  # fmt: skip
    print("|---|" + "---|" * (len(blocked) + 1))

    def row(name: str, values: list[float]) -> None:
        share = statistics.median(values) / med if med else 0.0
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {share:.0%} |")

    for name in names:
        if name.startswith("  "):
            continue
        row(name, [s["parts"].get(name, 0.0) for s in res["saves"]])
        if name == "DeepSpeed save_checkpoint":
            for sub in (n for n in names if n.startswith("  ")):
                row(sub, [s["parts"].get(sub, 0.0) for s in res["saves"]])
            row("  the rest of save_checkpoint (state dicts, its barriers)", [
                s["parts"].get(name, 0.0)
                - sum(v for k, v in s["parts"].items() if k.startswith("  "))
                for s in res["saves"]])  # fmt: skip
    row("the rest of Trainer.save (window read, prune_bundles, log)", [
        s["blocked_s"] - sum(v for k, v in s["parts"].items() if not k.startswith("  "))
        for s in res["saves"]])  # fmt: skip
    row("**save blocked (total)**", blocked)
    row("then Trainer.bundle(tag) (train.bundle_every: 1, the default)",
        [s["bundle_s"] for s in res["saves"]])  # fmt: skip
    flushes = ", ".join(f"{s['fsync_after_s']:.2f}" for s in res["saves"])
    print(f"fsync of the checkpoint's files after the save (not part of it): {flushes} s")
    writing = [t for s in res["saves"] for t in s.get("writing_steps_s", [])]
    print(
        f"rank 0's peak resident memory above the {res['rss_before_save_mib']:,.0f} MiB it "
        f"held, one more save and its writes: {res['save_peak_extra_mib']:,.0f} MiB"
    )
    return {"world": res["world"], "params": res["params"], "bytes": nbytes, "step_s": step,
            "steps": len(res["steps_s"]), "blocked_s": med, "blocked_min": min(blocked),
            "blocked_max": max(blocked), "ratio": med / step, "fsync_after_s": flush,
            "with_bundle_s": with_bundle, "ratio_with_bundle": with_bundle / step,
            "writing_step_s": statistics.median(writing) if writing else None,
            "finish_wait_s": statistics.median(s.get("finish_wait_s", 0.0) for s in res["saves"]),
            "save_peak_extra_mib": res["save_peak_extra_mib"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap, docs=20_000, words=40_000, vocab_size=30522)
    ap.add_argument("--preset", default="bert-base")
    ap.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    ap.add_argument("--ranks", default="1,2", help="world sizes, comma-separated")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=2)
    ap.add_argument(
        "--keep-last",
        type=int,
        default=1,
        help="train.keep_last: 1 = every save after the first prunes one",
    )
    ap.add_argument("--out-dir", help="where the checkpoints go (default: a temp dir in /var/tmp)")
    ap.add_argument("--async-save", choices=["on", "off", "both"], default="both",
                    help="train.async_save; both: each world size with off, then on")  # fmt: skip
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()  # the launcher adds --local_rank
    if args.rank_main:
        if args.device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return rank_main(args)
    started = time.perf_counter()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-ckpt-", dir="/var/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    disk = subprocess.run(["df", "-h", "--output=source,fstype,size,avail", str(out_dir)],
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]  # fmt: skip
    try:
        work = Path(args.work_dir) if args.work_dir else out_dir / "work"
        data = Path(args.data_dir) if args.data_dir else prepare_data(work, "wordpiece", args)
        info = data_info(data)
        print(f"data: {data}: {info['documents']:,} documents, {info['tokens']:,} tokens, "
              f"vocabulary {info['vocab_size']:,}\ncheckpoints under {out_dir} ({disk.split()}); "
              f"{os.cpu_count()} cpus, load {load1():.2f}")  # fmt: skip
        summary = []
        modes = ["off", "on"] if args.async_save == "both" else [args.async_save]
        for ranks in [int(x) for x in args.ranks.split(",")]:
            for mode in modes:  # side by side: the same world size, synchronous then not
                res = run_world(argparse.Namespace(**{**vars(args), "async_save": mode}),
                                ranks, data, out_dir)  # fmt: skip
                summary.append({**report(res), "async": mode,
                                "process_wall_s": res["process_wall_s"], "raw": res})  # fmt: skip
    finally:
        if not args.out_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
    print(f"\n## Summary: {args.preset}, ZeRO-{args.stage}, {args.precision}, micro batch "
          f"{args.micro_batch} x {args.seq}, grad_accum 1; load {load1():.2f}")  # fmt: skip
    print(
        "| ranks | async_save | bytes per checkpoint | step (median) s | save blocked (median, "
        "range) s | **save blocked / step** | save + bundle s | (save + bundle) / step "
        "| step while writing s | wait for the writes s | fsync after the save s "
        "| peak memory above the step's, a save and its writes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        writing = f"{s['writing_step_s']:.2f}" if s["writing_step_s"] is not None else "-"
        print(f"| {s['world']} | {s['async']} | {s['bytes'] / 2**20:,.0f} MiB | {s['step_s']:.2f} "
              f"({s['steps']} steps) | {s['blocked_s']:.2f} ({s['blocked_min']:.2f}-"
              f"{s['blocked_max']:.2f}) | **{s['ratio']:.2f}** | {s['with_bundle_s']:.2f} | "
              f"{s['ratio_with_bundle']:.2f} | {writing} | {s['finish_wait_s']:.2f} | "
              f"{s['fsync_after_s']:.2f} | {s['save_peak_extra_mib']:,.0f} MiB |")  # fmt: skip
    print(f"whole run {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "disk": disk,
                                               "summary": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
