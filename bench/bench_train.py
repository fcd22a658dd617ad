"""Training cost per REAL token: our Trainer vs a plain Hugging Face loop, side by side.

    python bench/bench_train.py                                   # bert-tiny, 4x256, bert-base
    python bench/bench_train.py --preset bert-tiny --preset 4x256 --json out.json
    python bench/bench_train.py --work-dir /tmp/bt               # keep (and reuse) the data
    python bench/bench_train.py --data-dir /tmp/bt/data          # reuse it: no Ray, no prepare
    python bench/bench_train.py --device cuda --precision bf16    # GPU machine: bench/gpu_run.sh
    python bench/bench_train.py --data-dir D --deny-import ray --deny-import mlflow  # as there

Data (once per run, or cached under --work-dir): a generated short-document English-like
corpus (sentences of 4-18 words: about 45% common English words, the rest pseudo-words of
English syllables with Zipf frequencies; documents of 1..--max-sentences sentences, so MLM
windows at seq 128 are about 40% padding; the measured fraction is printed), a WordPiece
tokenizer (`plm data tokenizer`, --vocab-size, BERT's 30522 by default) and shards
(`plm data prepare`, a local Ray job), both through the project's CLI.

Per preset, on the same windows (batches of our loader, objective mlm, packing window:
``[CLS] window [SEP]`` then padding to --seq), one round = one optimizer step of each side:

- ours: the real step, ``Trainer.train_step`` (pipeline/train/trainer.py) with its DeepSpeed
  engine, ZeRO stage 0, world size 1, fp32 (or --precision), dropout 0.1, AdamW, grad
  clipping 1.0, ``data.workers: 0``. Timed: the loader making the batch (reading shards,
  cutting windows, masking; in this process) + ``train_step``. When the config has
  ``train.unpad`` (``"unpad" in TrainSection.model_fields``), ours runs twice, unpad true
  and false.
- hf: ``transformers.BertForMaskedLM`` of the same shape (vocabulary = the tokenizer's,
  max positions, dropout 0.1), ``DataCollatorForLanguageModeling(mlm_probability=0.15)``
  on the same rows (each row's real tokens, padding stripped by attention_mask, the
  original ids before our masking), which pads to the longest row of the batch (its
  default), a plain loop: forward, ``loss.backward()``, grad clipping 1.0,
  ``torch.optim.AdamW`` (fused, as ours), fp32 or ``torch.autocast`` bf16. Timed: the
  collator + the step.

The sides alternate (ours, hf, hf, ours, ...; with two ours variants A B C, C B A, ...), so
a busy phase of a shared machine hits each alike. Cost = process CPU seconds
(time.process_time, every thread of the process) per 1000 real (non-padding) tokens,
median over the rounds; on CUDA, synchronised wall seconds instead. Reported per preset:
that cost, real tokens per second (wall), the ratio hf / ours of the medians (and the range
of the per-round ratios), the padding of the windows, torch threads, platform, cpu count
and the load average. A markdown table is printed; --json PATH writes everything.

On CUDA each side also gets its MFU and its peak memory (null on the CPU):

- MFU = model FLOPs per wall second / the device's dense peak for --precision (the
  project's table, ``pipeline.train.metrics.device_peak_flops``). Model FLOPs: the
  project's formula (``BERT.flops_per_token``: 6 (N + f H Vpad) + 12 L H T per token, T
  the mean real length a token attends to, f the labelled share), counted per batch as
  the trainer counts them for its logged MFU. That is the useful work on the real tokens,
  the same count for every side: a side that computes on padding or decodes every
  position gets no credit for it.
- peak memory: the side's own peak of ``torch.cuda.max_memory_allocated`` over its timed
  steps, its resident weights and optimizer state included (``benchlib.DeviceMemory``).
- ours' step alone (``step_only``, ``hf_over_ours_step_only``): without the loader, which
  runs in this process here and in data.workers processes under ``plm train``.

On CUDA the defaults are batch 128, 3 warm-up and 20 timed rounds for every preset.

With --data-dir (a data dir prepared earlier, e.g. by a run with --work-dir) nothing
imports Ray. MLflow is never contacted either way: the bench calls ``train_step`` only,
and the config points ``mlflow.tracking_uri`` at a sqlite file in a temp dir (DeepSpeed
itself tries ``import mlflow`` when it is installed: ``--deny-import mlflow`` runs as on
the GPU machine, where it is not). Run it with ``OMP_NUM_THREADS=1`` on a shared machine
(README: one torch thread). Shared parts: bench/benchlib.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from benchlib import (
    DeviceMemory,
    Ours,
    PlainLoop,
    add_common_args,
    experiment_config,
    load1,
    measure,
    mib,
    pct,
    session,
    speedup,
)

# Model shapes: layers, hidden, heads, feed-forward (the bert-tiny here is Google's
# 2 x 128 BERT-Tiny, not the project's 2 x 64 configs/models/bert-tiny.yaml).
PRESETS: dict[str, dict[str, int]] = {
    "bert-tiny": {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 512},
    "4x256": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024},
    "bert-base": {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072},
}
# (batch, timed rounds, warm-up rounds) per preset, on the CPU and on CUDA
DEFAULTS = {
    "cpu": {"bert-tiny": (32, 20, 2), "4x256": (32, 10, 2), "bert-base": (16, 3, 1)},
    "cuda": {p: (128, 20, 3) for p in PRESETS},
}
MAX_POSITIONS = 512


# --- the two sides ------------------------------------------------------------------------


def train_section_fields() -> set[str]:
    """The keys of the experiment config's ``train:`` section."""
    from pipeline import config

    section = getattr(config, "TrainConfig", None) or config.TrainSection
    return set(section.model_fields)


def bert_config(args, preset: str, data: Path, run_dir: Path, unpad: bool | None):
    model = {"arch": "bert", "preset": "bert-base", **PRESETS[preset],
             "max_positions": MAX_POSITIONS, "dropout": 0.1, "attention_dropout": 0.1}  # fmt: skip
    train: dict[str, Any] = {
        "micro_batch_size": args.batch_of[preset], "lr": args.lr, "weight_decay": 0.01,
        "betas": [0.9, 0.999], "eps": 1e-6, "seed": args.seed, "precision": args.precision,
    }  # fmt: skip
    if unpad is not None:
        train["unpad"] = unpad
    return experiment_config(f"bench-train-{preset}", model, {"kind": "mlm"}, data, args.seq,
                             train, run_dir)  # fmt: skip


class HF(PlainLoop):
    """``BertForMaskedLM`` + ``DataCollatorForLanguageModeling``, a plain PyTorch loop."""

    def __init__(self, args, preset: str, data: Path, meta: dict, dev):
        import torch
        import transformers
        from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

        transformers.logging.set_verbosity_error()
        shape, roles = PRESETS[preset], meta["roles"]
        names = {int(i): s for s, i in meta["special_tokens"].items()}
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(data / "tokenizer" / "tokenizer.json"),
            **{f"{r}_token": names[int(roles[r])] for r in ("unk", "pad", "cls", "sep", "mask")},
        )
        config = BertConfig(
            vocab_size=meta["vocab_size"], hidden_size=shape["hidden_size"],
            num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
            intermediate_size=shape["intermediate_size"], max_position_embeddings=MAX_POSITIONS,
            type_vocab_size=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            layer_norm_eps=1e-12, pad_token_id=int(roles["pad"]),
        )  # fmt: skip
        torch.manual_seed(args.seed)
        model = BertForMaskedLM(config).to(dev).train()
        groups = [{"params": list(model.parameters()), "weight_decay": 0.01}]
        super().__init__(model, groups, dev, args.precision, args.lr, (0.9, 0.999), 1e-6)
        self.collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm_probability=0.15)
        self.padded: list[int] = []  # per step: what the collator's dynamic padding left
        self.slots: list[int] = []

    def arg(self, batch: dict) -> list[list[int]]:
        return real_rows(batch)

    def inputs(self, rows: list[list[int]]) -> dict:
        batch = self.collator([{"input_ids": r} for r in rows])
        self.mask = batch["attention_mask"]  # counted after the timed part
        return {k: v.to(self.dev, non_blocking=True) for k, v in batch.items()}

    def loss(self, batch: dict):
        return self.model(**batch).loss

    def read_loss(self) -> None:
        super().read_loss()
        self.padded.append(int(self.mask.numel() - self.mask.sum()))
        self.slots.append(self.mask.numel())


def real_rows(batch: dict) -> list[list[int]]:
    """Each row's real tokens (attention_mask), with the ids our masking replaced put back:
    ``[CLS] window [SEP]``, what the collator gets."""
    ids = batch["input_ids"].where(batch["mlm_labels"] < 0, batch["mlm_labels"])
    keep = batch["attention_mask"].bool()
    return [row[k].tolist() for row, k in zip(ids, keep, strict=True)]


# --- measuring ----------------------------------------------------------------------------


def run_preset(args, preset: str, data: Path, meta: dict, tmp: Path, dev, has_unpad: bool,
               peak: float | None):  # fmt: skip
    import torch

    variants: list[tuple[str, bool | None]] = (
        [("ours unpad", True), ("ours padded", False)] if has_unpad else [("ours", None)]
    )
    memory = DeviceMemory(dev)
    sides: dict[str, Any] = {}
    for name, unpad in variants:
        run_dir = tmp / f"{preset}-{name.replace(' ', '-')}"
        with memory.building(name):
            sides[name] = Ours(bert_config(args, preset, data, run_dir, unpad))
    with memory.building("hf"):
        sides["hf"] = HF(args, preset, data, meta, dev)
    # The Trainer may set torch's threads (cores per rank when OMP_NUM_THREADS is unset):
    # both sides run with the count this process started with (or --threads).
    torch.set_num_threads(args.threads_wanted)
    n_ours = sum(p.numel() for p in sides[variants[0][0]].model.parameters())
    hf = sides["hf"]
    n_hf = sum(p.numel() for p in hf.model.parameters())
    attn = getattr(hf.model.config, "_attn_implementation", "?")
    B = args.batch_of[preset]
    warmup, rounds = args.warmup_of[preset], args.rounds_of[preset]
    print(f"\n== {preset}: {PRESETS[preset]}, batch {B} x seq {args.seq}, {args.precision}, "
          f"{dev.type}; params ours {n_ours / 1e6:.2f}M, hf {n_hf / 1e6:.2f}M (attention "
          f"{attn}); warmup {warmup}, rounds {rounds}; load {load1():.2f}", flush=True)  # fmt: skip
    r, measured = measure(sides, memory, dev, warmup, rounds, peak)
    result: dict[str, Any] = {
        "preset": preset, "shape": PRESETS[preset], "batch": B, "seq": args.seq,
        "precision": args.precision, "params": {"ours": n_ours, "hf": n_hf},
        "hf_attention": attn, "padding_fraction": 1 - sum(r.tokens) / sum(r.slots),
        "hf_padding_fraction": sum(hf.padded[-rounds:]) / max(sum(hf.slots[-rounds:]), 1),
        "torch_threads": torch.get_num_threads(), **measured,
    }  # fmt: skip
    for name, _ in variants:
        ours = result["sides"][name]
        ours["hf_over_ours"], ours["hf_over_ours_rounds"] = speedup(r, name, "hf")
        ours["hf_over_ours_step_only"] = speedup(r, name, "hf", step_only=True)[0]
    del sides, hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def step_only(side: dict) -> str:
    """Ours' step alone (the loader runs in this process here; ``plm train`` runs it in
    ``data.workers`` processes): tokens/s, MFU, hf / this."""
    if "step_only" not in side:
        return ""
    s = side["step_only"]
    return (f"{s['real_tokens_per_s_wall']:,.0f} tokens/s, MFU {pct(s['mfu'])}, "
            f"{side['hf_over_ours_step_only']:.2f}x")  # fmt: skip


def markdown(results: list[dict], info: dict) -> str:
    cuda = info["device"] == "cuda"
    unit = "GPU wall s" if cuda else "CPU s"
    gpu_cols = (" MFU | peak MiB | ours without the loader |", "---|---|---|") if cuda else ("", "")
    head = (
        f"| preset | batch x seq | window padding (hf batches) | side | {unit} / 1k real tokens "
        f"| real tokens/s (wall) | hf / this | per-round hf / this |{gpu_cols[0]} loss first -> "
        f"last | load (start -> end) |\n|---|---|---|---|---|---|---|---|{gpu_cols[1]}---|---|\n"
    )
    out = []
    for res in results:
        pad = f"{res['padding_fraction']:.1%} ({res['hf_padding_fraction']:.1%})"
        for name, s in res["sides"].items():
            ratio = rng = ""
            if "hf_over_ours" in s:
                ratio = f"**{s['hf_over_ours']:.2f}x**"
                rng = f"{s['hf_over_ours_rounds'][0]:.2f}-{s['hf_over_ours_rounds'][1]:.2f}"
            gpu = (
                f" {pct(s['mfu'])} | {mib(s['peak_memory_bytes'])} | {step_only(s)} |"
                if cuda
                else ""
            )
            out.append(
                f"| {res['preset']} | {res['batch']} x {res['seq']} | {pad} | {name} | "
                f"{s['cost_per_1k_real_tokens']:.4g} | {s['real_tokens_per_s_wall']:,.0f} | "
                f"{ratio} | {rng} |{gpu} {s['loss_first']:.2f} -> {s['loss_last']:.2f} | "
                f"{res['load_start']:.2f} -> {res['load_end']:.2f} |"
            )
    return head + "\n".join(out)


def window_padding(data: Path, seq: int, batch: int, n_batches: int = 64) -> float:
    """Padding share of the first ``n_batches`` MLM windows batches (the corpus' mix)."""
    import itertools

    from pipeline.config import ObjectiveSection
    from pipeline.loader.stream import PretrainStream
    from pipeline.objectives import build_objective

    meta = json.loads((data / "tokenizer" / "tokenizer_meta.json").read_text())
    specials = {int(i) for i in meta.get("special_tokens", {}).values()}
    obj = build_objective(
        ObjectiveSection(kind="mlm"), meta["roles"], meta["vocab_size"], seq, specials
    )
    stream = PretrainStream(data, "train", obj, micro_batch_size=batch, seed=1)
    real = slots = 0
    for b in itertools.islice(iter(stream), n_batches):
        real += int(b["attention_mask"].sum())
        slots += b["attention_mask"].numel()
    return 1 - real / slots


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", action="append", choices=list(PRESETS),
                    help="repeatable; default: all three")  # fmt: skip
    ap.add_argument("--batch", type=int, help="micro batch (CPU: 32, 16 for bert-base; CUDA: 128)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, help="timed rounds (CPU: 20 / 10 / 3; CUDA: 20)")
    ap.add_argument("--warmup", type=int, help="untimed rounds (CPU: 2, 1 for bert-base; CUDA: 3)")
    ap.add_argument("--lr", type=float, default=1e-4)
    add_common_args(ap, docs=8000, words=20000, vocab_size=30522)
    args = ap.parse_args()
    presets = args.preset or list(PRESETS)
    defaults = DEFAULTS[args.device]
    args.batch_of = {p: args.batch or defaults[p][0] for p in presets}
    args.rounds_of = {p: args.rounds or defaults[p][1] for p in presets}
    args.warmup_of = {p: defaults[p][2] if args.warmup is None else args.warmup for p in presets}
    with session(args, "wordpiece") as run:
        meta = json.loads((run.data / "tokenizer" / "tokenizer_meta.json").read_text())
        padding = window_padding(run.data, args.seq, 32)
        has_unpad = "unpad" in train_section_fields()
        info = run.info
        info.update(window_padding_first_64_batches=padding, train_unpad_key=has_unpad)
        try:
            import transformers

            info["transformers"] = transformers.__version__
        except ImportError:
            info["transformers"] = None
        print(f"transformers {info['transformers']}; MLM windows at seq {args.seq}: "
              f"{padding:.1%} padding (first 64 batches of 32)")  # fmt: skip
        print(f"train.unpad in the config: {'yes: ours runs with true and false' if has_unpad else 'no'}")  # fmt: skip
        results = [
            run_preset(args, p, run.data, meta, run.tmp, run.dev, has_unpad, info["peak_flops"])
            for p in presets
        ]
        print(f"\n{markdown(results, info)}\n")
        run.finish({"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
