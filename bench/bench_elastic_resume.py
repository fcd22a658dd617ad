"""Time of a 2 -> 1 rank resume of bert-base-sized state, conversion included (CPU, gloo).

    python bench/bench_elastic_resume.py [--preset bert-base] [--vocab 30522] [--stage 2]

1. `deepspeed --num_gpus 2` (CPU accelerator): each rank builds the model from the registry
   (bert-base: 12 x 768, vocab 30522 = BERT's), runs `deepspeed.initialize` with our
   DeepSpeed config (configs/deepspeed/zeroN.json + AdamW), one optimizer step on random
   tokens (so Adam's moments exist), and saves through our CheckpointManager: 2-rank ZeRO
   state, the trainer state, COMPLETE, latest.
2. the same 2 ranks resume it as is (the same-world-size baseline): load time.
3. one plain process (world size 1): ds_to_universal conversion (CheckpointManager.
   to_universal), then the load of the universal checkpoint into a freshly initialised
   1-rank engine (CheckpointManager.load(universal=True)). Engine start-up is timed apart.

Each phase checks that the fp32 weights it ends with equal the saved ones (sum of |w|).
Prints one table; the folder of checkpoints is deleted at the end (--keep to keep it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _engine(args, world: int):
    import torch

    from pipeline.config import validate_dict
    from pipeline.models.registry import build_model, resolve_model_config
    from pipeline.train import engine as ds_engine
    from pipeline.train.schedule import scheduler_factory

    cfg = validate_dict({
        "name": "bench", "model": {"arch": "bert", "preset": args.preset}, "data": {"path": "x"},
        "train": {"micro_batch_size": 2, "grad_accum": 2 // world, "warmup_steps": 0,
                  "max_steps": 10, "precision": args.precision},
        "deepspeed": f"configs/deepspeed/zero{args.stage}.json",
    })  # fmt: skip
    ds = ds_engine.build_ds_config(cfg, world)
    if world == 1:
        ds["checkpoint"] = {"load_universal": True}
    t0 = time.perf_counter()
    model_cfg = resolve_model_config(cfg.model.model_dump(), args.vocab)
    torch.manual_seed(0)
    model = build_model("bert", model_cfg)
    engine = ds_engine.initialize(model, ds, scheduler_factory(cfg.train))
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3
    return engine, ds, time.perf_counter() - t0, n_params


def _weight_sum(engine) -> float:
    from pipeline.train.full_weights import consolidated_state_dict

    sd = consolidated_state_dict(engine)
    return None if sd is None else float(sum(v.double().abs().sum() for v in sd.values()))


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.train import engine as ds_engine
    from pipeline.train.checkpoint import CheckpointManager

    ds_engine.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, ds, init_s, n_params = _engine(args, world)
    mgr = CheckpointManager(args.dir, keep_last=2, rank=rank, world_size=world)
    out: dict = {"phase": args.phase, "world": world, "init_s": init_s, "params": n_params}
    if args.phase == "save":
        g = torch.Generator().manual_seed(rank)
        for _ in range(engine.gradient_accumulation_steps()):
            ids = torch.randint(5, args.vocab, (2, 32), generator=g)
            loss = engine(input_ids=ids)["mlm_logits"].float().logsumexp(-1).mean()
            engine.backward(loss)
            engine.step()
        t0 = time.perf_counter()
        mgr.save(engine, 1, {"loader": {}}, {"name": "bench"}, ds, {"zero_stage": args.stage})
        out["save_s"] = time.perf_counter() - t0
    elif args.phase == "same":
        t0 = time.perf_counter()
        mgr.load(engine, mgr.latest())
        out["load_s"] = time.perf_counter() - t0
    else:  # "resume": world size 1, from the 2-rank checkpoint
        tag = mgr.latest()
        out["convert_s"] = mgr.to_universal(tag)
        t0 = time.perf_counter()
        mgr.load(engine, tag, universal=True)
        out["load_s"] = time.perf_counter() - t0
    out["weight_sum"] = _weight_sum(engine)
    if rank == 0:
        Path(args.dir, f"{args.phase}.json").write_text(json.dumps(out))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="bert-base")
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--phase", choices=["save", "same", "resume"])
    p.add_argument("--dir")
    p.add_argument("--keep", action="store_true")
    args, _ = p.parse_known_args()  # the launcher adds --local_rank
    if args.phase:
        return rank_main(args)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench-elastic-"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    common = [f"--preset={args.preset}", f"--vocab={args.vocab}", f"--stage={args.stage}",
              f"--precision={args.precision}", f"--dir={folder}"]  # fmt: skip
    me = str(Path(__file__).resolve())
    wall = {}
    for phase, ranks in (("save", 2), ("same", 2), ("resume", 1)):
        if ranks == 2:
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                   "--master_port", str(_port()), me, f"--phase={phase}", *common]  # fmt: skip
        else:
            cmd = [sys.executable, me, f"--phase={phase}", *common]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall[phase] = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"phase {phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = {ph: json.loads((folder / f"{ph}.json").read_text()) for ph in wall}
    ckpt = folder / "checkpoints" / "step00000001"
    size = sum(f.stat().st_size for f in ckpt.glob("*.pt")) / 2**20
    uni = sum(f.stat().st_size for f in (ckpt / "universal").rglob("*") if f.is_file()) / 2**20
    r, s = res["resume"], res["same"]
    print(f"model {args.preset}, vocab {args.vocab}: {r['params']:,} parameters, ZeRO-{args.stage}, "
          f"{args.precision}; checkpoint {size:.0f} MiB (2 ranks), universal copy {uni:.0f} MiB")  # fmt: skip
    print(
        "| resume | conversion s | load s | conversion + load s | engine start s | process wall s |"
    )
    print("|---|---|---|---|---|---|")
    print(f"| 2 -> 2 ranks (same world size) | - | {s['load_s']:.2f} | {s['load_s']:.2f} | "
          f"{s['init_s']:.2f} | {wall['same']:.1f} |")  # fmt: skip
    print(f"| 2 -> 1 rank (universal) | {r['convert_s']:.2f} | {r['load_s']:.2f} | "
          f"{r['convert_s'] + r['load_s']:.2f} | {r['init_s']:.2f} | {wall['resume']:.1f} |")  # fmt: skip
    sums = {ph: res[ph]["weight_sum"] for ph in res}
    ok = max(sums.values()) - min(sums.values()) <= 1e-9 * abs(sums["save"])
    print(f"fp32 weights after each phase equal the saved ones: {ok} ({sums})")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
