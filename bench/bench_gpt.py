"""GPT-2 124M at seq 1024: our Trainer vs a nanoGPT-style baseline, side by side on the
same token windows.

    python bench/bench_gpt.py --device cuda --precision bf16      # GPU machine: bench/gpu_run.sh
    python bench/bench_gpt.py --device cuda --precision bf16 --data-dir D --json out.json
    python bench/bench_gpt.py --preset gpt2-tiny --sides ours,baseline   # CPU smoke (seconds)

Data (once per run, or cached under --work-dir): bench_train's generated corpus (more
pseudo-words, so the BPE reaches its size), a byte-level BPE tokenizer of 50,257 tokens
(``plm data tokenizer --kind bpe``; the model pads it to 50,304) and shards (``plm data
prepare``), through the project's CLI. --data-dir takes one prepared earlier (no Ray).

The batches are our loader's: the clm objective's blocks of --seq tokens of the
eod-joined document stream (input ids and the next-token labels; no padding). One round
= one optimizer step of every side on the same batch; the sides alternate (A B C D,
D C B A, ...). The sides (--sides, default all four):

- ``ours`` / ``ours compiled``: ``Trainer.train_step`` (pipeline/train/trainer.py) with
  the project's gpt2 model and the clm objective (chunked cross-entropy), DeepSpeed ZeRO-0,
  world size 1, ``data.workers: 0`` (the loader's cost is included), train.precision
  (bf16: DeepSpeed keeps bf16 weights and fp32 master weights in the optimizer), AdamW
  fused, grad clipping 1.0; ``train.compile`` false / true (regional: each block).
- ``baseline`` / ``baseline compiled``: bench/baseline_gpt.py, the same shape; fp32
  weights and ``torch.autocast`` bf16, the cross-entropy over the whole logits,
  ``torch.optim.AdamW`` (fused), grad clipping 1.0; eager / ``torch.compile`` of
  the whole model (default mode).

Both: lr 6e-4 constant, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only,
dropout --dropout (0: GPT-2 reproductions train without it).

Reported per side, over the timed rounds: real tokens/s (wall; every token is real here),
the cost per 1k tokens (CPU s on the CPU, synchronised wall s on CUDA, median), MFU, peak
GPU memory (its own, resident weights and optimizer state included: benchlib.DeviceMemory),
first and last loss; for each ours side, its tokens/s over each baseline's (ratio of the
median costs, and the per-round range), and its step alone (``step_only``: without the
loader, which ``plm train`` runs in data.workers processes beside the step). MFU = model FLOPs per wall second / the device's
dense peak for --precision (pipeline.train.metrics.device_peak_flops: H100 SXM bf16 989.5
TFLOP/s). Model FLOPs per token = ``GPT2.flops_per_token`` (pipeline/models/gpt2.py):
6 (N + H Vpad) + 12 L H T, N the non-embedding parameters, H Vpad the tied LM head, T =
--seq (attention not halved for the causal mask, the PaLM / nanoGPT convention); both
sides compute the same model, so the same count serves both. MFU and memory are null on
the CPU. A markdown table is printed; --json PATH writes everything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import (
    DeviceMemory,
    Ours,
    PlainLoop,
    add_common_args,
    data_info,
    experiment_config,
    load1,
    measure,
    mib,
    pct,
    session,
    speedup,
)

PRESETS: dict[str, dict[str, int]] = {
    "gpt2-124m": {"num_layers": 12, "hidden_size": 768, "num_heads": 12,
                  "intermediate_size": 3072, "max_positions": 1024},
    "gpt2-tiny": {"num_layers": 2, "hidden_size": 64, "num_heads": 2,
                  "intermediate_size": 256, "max_positions": 256},
}  # fmt: skip
DEFAULTS = {  # batch, seq, timed rounds, warm-up rounds (the compiled sides compile in warm-up)
    "gpt2-124m": {"batch": 16, "seq": 1024, "rounds": 10, "warmup": 3},
    "gpt2-tiny": {"batch": 4, "seq": 64, "rounds": 3, "warmup": 1},
}
SIDES = ("ours", "ours compiled", "baseline", "baseline compiled")
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1


def gpt_config(args, data: Path, run_dir: Path, compile: bool):
    model = {"arch": "gpt2", **PRESETS[args.preset], "dropout": args.dropout,
             "attention_dropout": args.dropout}  # fmt: skip
    train = {"micro_batch_size": args.batch, "lr": args.lr, "weight_decay": WEIGHT_DECAY,
             "betas": list(BETAS), "eps": EPS, "seed": args.seed, "precision": args.precision,
             "compile": compile}  # fmt: skip
    return experiment_config(f"bench-gpt-{args.preset}", model, {"kind": "clm"}, data, args.seq,
                             train, run_dir)  # fmt: skip


class Baseline(PlainLoop):
    """bench/baseline_gpt.py's GPT in a plain loop; ``compiled``: ``torch.compile`` of it."""

    def __init__(self, args, vocab: int, dev, compiled: bool):
        import torch
        from baseline_gpt import GPT

        shape = PRESETS[args.preset]
        torch.manual_seed(args.seed)
        model = GPT(vocab, shape["max_positions"], shape["num_layers"], shape["hidden_size"],
                    shape["num_heads"], shape["intermediate_size"]).to(dev).train()  # fmt: skip
        super().__init__(model, model.param_groups(WEIGHT_DECAY), dev, args.precision, args.lr,
                         BETAS, EPS)  # fmt: skip
        self.forward = torch.compile(model) if compiled else model

    def arg(self, batch: dict) -> tuple:
        return batch["input_ids"], batch["labels"]

    def inputs(self, arg: tuple) -> tuple:
        return tuple(t.to(self.dev, non_blocking=True) for t in arg)

    def loss(self, inputs: tuple):
        return self.forward(*inputs)


def build_sides(args, data: Path, tmp: Path, dev, memory: DeviceMemory) -> dict[str, Any]:
    from pipeline.models.blocks import padded_vocab_size

    vocab = padded_vocab_size(data_info(data)["vocab_size"])  # what our model pads it to
    sides: dict[str, Any] = {}
    for name in args.sides:
        compiled = name.endswith("compiled")
        with memory.building(name):
            if name.startswith("ours"):
                run_dir = tmp / name.replace(" ", "-")
                sides[name] = Ours(gpt_config(args, data, run_dir, compiled))
            else:
                sides[name] = Baseline(args, vocab, dev, compiled)
    return sides


def run(args, data: Path, tmp: Path, dev, peak: float | None) -> dict[str, Any]:
    import torch

    memory = DeviceMemory(dev)
    sides = build_sides(args, data, tmp, dev, memory)
    torch.set_num_threads(args.threads_wanted)  # the Trainer may have changed it
    params = {n: sum(p.numel() for p in s.model.parameters()) for n, s in sides.items()}
    print(f"\n== {args.preset}: {PRESETS[args.preset]}, batch {args.batch} x seq {args.seq}, "
          f"{args.precision}, {dev.type}; params {', '.join(f'{n} {v / 1e6:.2f}M' for n, v in params.items())}; "
          f"warmup {args.warmup}, rounds {args.rounds}; load {load1():.2f}", flush=True)  # fmt: skip
    r, measured = measure(sides, memory, dev, args.warmup, args.rounds, peak)
    result: dict[str, Any] = {
        "preset": args.preset, "shape": PRESETS[args.preset], "batch": args.batch,
        "seq": args.seq, "precision": args.precision, "dropout": args.dropout, "params": params,
        "flops_per_token": r.flops[0] / r.tokens[0],
        "flops_formula": "GPT2.flops_per_token: 6 (N + H Vpad) + 12 L H T, T = seq",
        **measured,
    }  # fmt: skip
    baselines = [n for n in sides if n.startswith("baseline")]
    for name in sides:
        if name.startswith("ours"):
            result["sides"][name]["over"] = {
                b: {**dict(zip(("ratio", "rounds"), speedup(r, name, b), strict=True)),
                    "ratio_step_only": speedup(r, name, b, step_only=True)[0]}
                for b in baselines
            }  # fmt: skip
    return result


def markdown(res: dict) -> str:
    """One row per side. Ours' figures include the loader (run in this process); the
    ``without the loader`` column gives its step alone: tokens/s, MFU and the ratios."""
    baselines = [n for n in res["sides"] if n.startswith("baseline")]
    unit = "GPU wall s" if res["device"] == "cuda" else "CPU s"
    cols = "".join(f" ours / {b} (per round) |" for b in baselines)
    lines = [
        f"| side | tokens/s | {unit} / 1k tokens | MFU | peak MiB |{cols} without the loader "
        "| loss first -> last |",
        "|---|---|---|---|---|" + "---|" * len(baselines) + "---|---|",
    ]
    for name, s in res["sides"].items():
        ratios = alone = ""
        for b in baselines:
            o = s.get("over", {}).get(b)
            ratios += f" **{o['ratio']:.2f}x** ({o['rounds'][0]:.2f}-{o['rounds'][1]:.2f}) |" if o else " |"  # fmt: skip
        if "step_only" in s:
            st, over = s["step_only"], s["over"]
            alone = (f"{st['real_tokens_per_s_wall']:,.0f} tokens/s, MFU {pct(st['mfu'])}"
                     + "".join(f", {over[b]['ratio_step_only']:.2f}x" for b in baselines))  # fmt: skip
        lines.append(
            f"| {name} | {s['real_tokens_per_s_wall']:,.0f} | {s['cost_per_1k_real_tokens']:.4g} "
            f"| {pct(s['mfu'])} | {mib(s['peak_memory_bytes'])} |{ratios} {alone} | "
            f"{s['loss_first']:.3f} -> {s['loss_last']:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=list(PRESETS), default="gpt2-124m")
    ap.add_argument("--batch", type=int, help="micro batch (gpt2-124m: 16; gpt2-tiny: 4)")
    ap.add_argument("--seq", type=int, help="tokens per row (gpt2-124m: 1024; gpt2-tiny: 64)")
    ap.add_argument("--rounds", type=int, help="timed rounds (gpt2-124m: 10; gpt2-tiny: 3)")
    ap.add_argument("--warmup", type=int, help="untimed rounds (gpt2-124m: 3; gpt2-tiny: 1)")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help=f"comma-separated, at least one ours side (default: {','.join(SIDES)})")  # fmt: skip
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--dropout", type=float, default=0.0, help="ours' dropout (the baseline has none)")  # fmt: skip
    add_common_args(ap, docs=12000, words=60000, vocab_size=50257)
    args = ap.parse_args()
    for key, value in DEFAULTS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown or not any(s.startswith("ours") for s in args.sides):
        ap.error(f"--sides: {', '.join(unknown) or 'no ours side'}; choose from {', '.join(SIDES)}")
    if args.dropout and any(s.startswith("baseline") for s in args.sides):
        ap.error("--dropout: the baseline has no dropout; run it with --sides ours,...")
    with session(args, "bpe") as run_:
        result = run(args, run_.data, run_.tmp, run_.dev, run_.info["peak_flops"])
        print(f"\n{markdown(result)}\n")
        loader = statistics.median(result["loader_cost_per_round"]) / args.batch / args.seq
        print(f"FLOPs per token {result['flops_per_token']:.4g} ({result['flops_formula']}); "
              f"the loader, in ours' cost: {loader * 1e3:.4f} s / 1k tokens (median)")  # fmt: skip
        run_.finish({"result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
