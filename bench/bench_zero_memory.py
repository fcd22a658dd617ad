"""Per-rank memory of parameters + optimizer state: ZeRO-3 vs ZeRO-0, 2 ranks on the CPU.

    python bench/bench_zero_memory.py [--precision fp32|bf16] [--ranks 2] [--hidden 256] ...
    python bench/bench_zero_memory.py --ranks 1 --stages 0,2 --hidden 768 --layers 12 \
        --vocab 30522        # what ZeRO-2 costs on one rank at bert-base (deepspeed: auto)

Launches the real `deepspeed` launcher (CPU accelerator, gloo) once per stage. Each rank
builds a BERT from the registry, runs DeepSpeed initialize + 2 optimizer steps (so Adam's
moments exist), then counts the bytes of the tensors it holds, each storage once:

* params: the module's parameters, or under ZeRO-3 each parameter's own partition
  (``param.ds_tensor``) and the flat partition buffers behind them;
* optimizer: the ZeRO optimizer's fp32 partitions (0 extra bytes when they alias the
  params, as in fp32 training) and every tensor in the inner torch optimizer's state.

It also reports all live tensor storages found by the garbage collector (params, grads,
optimizer state, buffers), as a cross-check. Prints a side-by-side table and ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _storage_key(t) -> int:
    return t.untyped_storage().data_ptr()


def _add(seen: dict[int, int], t) -> None:
    import torch

    if isinstance(t, torch.Tensor) and t.numel() > 0:
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), s.nbytes())


def measure(
    stage: int, hidden: int, layers: int, vocab: int, precision: str, out_dir: Path
) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.config import validate_dict
    from pipeline.models.registry import build_model, resolve_model_config
    from pipeline.train import engine as ds_engine
    from pipeline.train.schedule import scheduler_factory

    cfg = validate_dict(
        {
            "name": "bench",
            "model": {"arch": "bert", "preset": "bert-tiny", "hidden_size": hidden,
                      "num_layers": layers, "num_heads": 4, "intermediate_size": 4 * hidden},
            "data": {"path": "unused", "seq_len": 64},
            "train": {"micro_batch_size": 2, "max_steps": 10, "warmup_steps": 0,
                      "precision": precision},
            "deepspeed": f"configs/deepspeed/zero{stage}.json",
        }
    )  # fmt: skip
    ds_engine.init_distributed()
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = build_model("bert", resolve_model_config(cfg.model.model_dump(), vocab))
    n_params = sum(p.numel() for p in model.parameters())
    engine = ds_engine.initialize(
        model, ds_engine.build_ds_config(cfg, world), scheduler_factory(cfg.train)
    )
    for _ in range(2):
        ids = torch.randint(5, vocab, (2, 64))
        out = engine(
            input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones_like(ids)
        )
        loss = out["mlm_logits"].float().pow(2).mean() + out["nsp_logits"].float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    gc.collect()

    params: dict[int, int] = {}
    for p in engine.module.parameters():
        _add(params, p.ds_tensor if hasattr(p, "ds_tensor") else p.data)
    zopt = engine.optimizer
    for name in ("fp16_partitioned_groups_flat",):
        for t in getattr(zopt, name, None) or []:
            _add(params, t)
    optim: dict[int, int] = {}
    # fp32 master weights: ZeRO-3, ZeRO-1/2, the bf16 optimizer, and the fp16/bf16 wrappers
    # DeepSpeed 0.19.8 uses at stage 0 (fp32_groups_flat; unfused: fp32_groups, per param)
    for name in (
        "fp32_groups_flat",
        "fp32_groups",
        "fp32_partitioned_groups_flat",
        "single_partition_of_fp32_groups",
        "fp32_groups_flat_partition",
    ):
        for item in getattr(zopt, name, None) or []:
            for t in item if isinstance(item, list) else [item]:
                if _storage_key(t) not in params:
                    _add(optim, t)
    inner = getattr(zopt, "optimizer", zopt)
    for state in inner.state.values():
        for t in state.values():
            if hasattr(t, "untyped_storage") and t.numel() > 1:  # not the scalar step count
                _add(optim, t)
    everything: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                _add(everything, obj)
        except Exception:
            pass
    rank = dist.get_rank()
    result = {
        "stage": stage, "rank": rank, "world": world, "n_params": n_params,
        "params_bytes": sum(params.values()), "optimizer_bytes": sum(optim.values()),
        "all_live_tensor_bytes": sum(everything.values()),
    }  # fmt: skip
    (out_dir / f"zero{stage}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def launch(stage: int, ranks: int, args, out_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
        "--master_port", str(port), str(Path(__file__).resolve()), "--worker", str(stage),
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
        "--precision", args.precision, "--out", str(out_dir),
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--stages", default="0,3", help="ZeRO stages to compare, the first is the base")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        sys.path.insert(0, str(REPO))
        measure(args.worker, args.hidden, args.layers, args.vocab, args.precision, Path(args.out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        stages = [int(x) for x in args.stages.split(",")]
        for stage in stages:
            launch(stage, args.ranks, args, out)
        rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    MiB = 2**20
    n = rows[0]["n_params"]
    print(f"BERT hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {n:,} parameters, "
          f"{args.precision}, {args.ranks} ranks, CPU (gloo)")  # fmt: skip
    print(
        f"{'stage':>6} {'rank':>4} {'params MiB':>11} {'optim MiB':>10} {'p+o MiB':>9} {'all live MiB':>13}"
    )
    for r in rows:
        po = r["params_bytes"] + r["optimizer_bytes"]
        print(f"{r['stage']:>6} {r['rank']:>4} {r['params_bytes'] / MiB:>11.2f} "
              f"{r['optimizer_bytes'] / MiB:>10.2f} {po / MiB:>9.2f} {r['all_live_tensor_bytes'] / MiB:>13.2f}")  # fmt: skip

    def worst(stage, key):
        return max(sum(r[k] for k in key) for r in rows if r["stage"] == stage)

    base = stages[0]
    po, live = ("params_bytes", "optimizer_bytes"), ("all_live_tensor_bytes",)
    for stage in stages[1:]:
        print(f"ratio ZeRO-{stage} / ZeRO-{base}, params + optimizer state (max over ranks): "
              f"{worst(stage, po) / worst(base, po):.3f}")  # fmt: skip
        print(f"ratio ZeRO-{stage} / ZeRO-{base}, all live tensors (max over ranks): "
              f"{worst(stage, live) / worst(base, live):.3f}, "
              f"+{(worst(stage, live) - worst(base, live)) / MiB:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
