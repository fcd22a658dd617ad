"""Fine-tuning time per training example: `plm finetune` against `transformers`' Trainer,
on the same model and task, side by side in one process (issue 48).

    python bench/bench_finetune_vs_hf.py                          # bert-tiny, 5 pairs
    python bench/bench_finetune_vs_hf.py --repeats 3 --epochs 10 --json out.json
    python bench/bench_finetune_vs_hf.py --model 2x128 --threads 2
    python bench/bench_finetune_vs_hf.py --tiny                   # smoke run (seconds)

Set-up (once per run, untimed, nothing downloaded): the demo's topic task
(pipeline/finetune/demo_task.py: stdlib docstring paragraphs labelled asyncio / email /
logging / unittest, --train-per-class of each in train, up to --test-per-class in test), a
WordPiece tokenizer trained on ``builtin:python-docs`` (--vocab-size, the demo's 8000), a
BERT bundle with random weights (``save_bundle``; --model: the project's bert-tiny 2x64 by
default, MLM-only like the demo's pretrained bundle, so no pooler) and its
``export_to_hf`` folder. Both sides start from those same weights.

The two sides, the same recipe: --max-length, --batch (micro batch), --epochs, AdamW (torch's
fused kernel on both sides) at --lr, weight decay 0.01 (not on biases / LayerNorms), betas
0.9 / 0.999, eps 1e-8, linear decay after 10% warm-up, grad clipping 1.0, dropout 0.1, fp32,
CPU, one process, --threads torch threads (``torch.set_num_threads`` before each side
trains; the count seen when its loop starts is reported), no evaluation during training,
no checkpoints, no MLflow:

- ours: ``pipeline.finetune.loop.Finetuner(cfg, track=False).run()`` in this process (what
  ``plm finetune`` runs: DeepSpeed ZeRO-0, world size 1, the [CLS] vector -> dropout ->
  linear head), ``train.eval_every`` beyond the run so the only evaluation is the one at
  the last step (no valid split: it saves the final weights), then its test evaluation of
  the saved folder.
- hf: ``BertForSequenceClassification.from_pretrained(EXPORTED)`` (its pooler and classifier
  freshly initialised), the exported folder's ``AutoTokenizer`` (truncation at
  --max-length), ``DataCollatorWithPadding``, ``Trainer`` with ``TrainingArguments``
  (``eval_strategy="no"``, ``save_strategy="no"``, ``report_to=[]``,
  ``dataloader_num_workers=0``, ``use_cpu=True``, ``optim="adamw_torch_fused"``), then
  ``trainer.predict`` on the test split.

Both pad each batch to its longest row; the bench checks that both tokenize every row to the
same ids. The train split has a multiple of --batch rows, so both train on the same number
of examples (ours wraps an epoch's last batch round, HF's would be short).

What is timed: the training loop alone, with process CPU seconds (``time.process_time``,
every thread) and wall seconds:

- ours: from the first epoch's start (the loop's first ``shard_indices`` call) to the start
  of the first ``BestWeights.save`` (the save after the last step): every step's batch
  collation, forward, backward, optimizer step and loss read, the end-of-run log line.
  Model loading, DeepSpeed's set-up, the save and the test evaluation are outside.
- hf: from the Trainer's ``on_train_begin`` callback to its ``on_train_end``: the same span
  as its ``train_runtime`` (reported beside it, with ``train_samples_per_second``), i.e.
  the epochs' data loading, steps and logging; the model, the arguments, the accelerator
  and the optimizer are set up before it.

The examples each side trained on are counted where its batches are made (our loop's
``collate``, HF's collator); the per-epoch mean training loss of both is reported (ours from
the losses handed to ``engine.backward``, HF's from its epoch logs), and each side's test
accuracy, so a reader sees both did the same work.

Order: an untimed warm-up pair (one epoch each) unless --no-warmup, then --repeats pairs,
ours first in even pairs and HF first in odd ones (ours, HF, HF, ours, ...), so a busy phase
of a shared machine hits each alike. Per pair: CPU and wall seconds per example of each side
and the ratio ours / HF (> 1: ours slower); then the medians. A markdown table is printed,
and one JSON line last on stdout (also written to --json PATH). Run it with
``OMP_NUM_THREADS`` equal to --threads on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Model shapes over the project's bert-tiny preset (configs/models/bert-tiny.yaml: 2 x 64).
MODELS: dict[str, dict[str, int]] = {
    "bert-tiny": {},
    "2x128": {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 512},
    "4x256": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024},
}
TINY = {"train_per_class": 8, "test_per_class": 8, "epochs": 2, "repeats": 1, "vocab_size": 2000}


def now() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def load1() -> float:
    return os.getloadavg()[0]


# --- set-up -------------------------------------------------------------------------------


def set_up(args, work: Path) -> dict[str, Any]:
    """The task jsonl files, a tokenizer, a random-weights bundle and its HF export."""
    import torch

    from pipeline.export.hf import export_to_hf
    from pipeline.finetune.demo_task import build_topic_task
    from pipeline.models import build_model, resolve_model_config
    from pipeline.models.bundle import save_bundle
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    paths = build_topic_task(work / "task", args.train_per_class, args.test_per_class)
    del paths["valid"]  # no evaluation during training on either side
    n_train = sum(1 for _ in open(paths["train"], encoding="utf-8"))
    if n_train % args.batch:
        raise SystemExit(
            f"{n_train} train rows is not a multiple of --batch {args.batch}: the sides would "
            "train on different numbers of examples (ours wraps the last batch round)"
        )
    tok = work / "tok"
    train_tokenizer(["builtin:python-docs"],
                    TokenizerSpec(kind="wordpiece", vocab_size=args.vocab_size), tok)  # fmt: skip
    vocab = json.loads((tok / "tokenizer_meta.json").read_text())["vocab_size"]
    section = {"arch": "bert", "preset": "bert-tiny", "pair_head": False, **MODELS[args.model]}
    cfg = resolve_model_config(section, vocab)
    torch.manual_seed(args.seed)
    model = build_model("bert", cfg)
    n_params = sum(p.numel() for p in model.parameters())
    bundle = save_bundle(work / "bundle", "bert", cfg, model.state_dict(), tok)
    del model
    hf_dir = export_to_hf(bundle, work / "hf")
    labels = sorted({json.loads(line)["label"] for line in open(paths["train"], encoding="utf-8")})
    shape = {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads",
                                          "intermediate_size", "vocab_size")}  # fmt: skip
    return {"paths": paths, "bundle": bundle, "hf_dir": hf_dir, "labels": labels,
            "n_train": n_train, "shape": shape, "params": n_params}  # fmt: skip


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def epoch_means(losses: list[float], per_epoch: int) -> list[float]:
    return [statistics.fmean(losses[i : i + per_epoch]) for i in range(0, len(losses), per_epoch)]


# --- our side -----------------------------------------------------------------------------


@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def run_ours(args, s: dict, epochs: int, out_dir: Path) -> dict[str, Any]:
    """``Finetuner.run`` with markers around its training loop (see the module docstring)."""
    import torch

    from pipeline.finetune import loop
    from pipeline.finetune.config import validate_finetune

    cfg = validate_finetune(
        {
            "name": "bench-finetune-ours",
            "model": {"source": str(s["bundle"]), "init": "pretrained"},
            "task": {"type": "classification", "max_length": args.max_length, "pooling": "first"},
            "data": dict(s["paths"]),
            "train": {
                "epochs": epochs, "micro_batch_size": args.batch, "lr": args.lr,
                "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
                "warmup_ratio": 0.1, "schedule": "linear", "precision": "fp32",
                "seed": args.seed, "eval_every": 10**9, "patience": 0, "eval_batch_size": 64,
                "out_dir": str(out_dir),
            },
            "deepspeed": str(REPO / "configs" / "deepspeed" / "zero0.json"),
            "mlflow": {"register": False},
        }
    )  # fmt: skip
    marks: dict[str, Any] = {"examples": 0}
    first_shard, first_collate = loop.shard_indices, loop.collate

    def shard_indices(*a, **kw):
        if "start" not in marks:
            marks["start"], marks["threads"] = now(), torch.get_num_threads()
        return first_shard(*a, **kw)

    def collate(examples, *a, **kw):
        marks["examples"] += len(examples)
        return first_collate(examples, *a, **kw)

    class BestWeights(loop.BestWeights):
        def save(self, engine) -> None:
            marks.setdefault("end", now())
            super().save(engine)

    call0 = now()
    with (
        patched(loop, "shard_indices", shard_indices),
        patched(loop, "collate", collate),
        patched(loop, "BestWeights", BestWeights),
    ):
        ft = loop.Finetuner(cfg, track=False)
        torch.set_num_threads(args.threads)
        losses: list[Any] = []
        backward = ft.engine.backward

        def recording_backward(loss, *a, **kw):
            losses.append(loss.detach())
            return backward(loss, *a, **kw)

        ft.engine.backward = recording_backward
        result = ft.run()
    call1 = now()
    cpu = marks["end"][0] - marks["start"][0]
    wall = marks["end"][1] - marks["start"][1]
    n = marks["examples"]
    return {
        "examples": n, "steps": result.steps, "loop_cpu_s": cpu, "loop_wall_s": wall,
        "cpu_s_per_example": cpu / n, "wall_s_per_example": wall / n,
        "call_wall_s": call1[1] - call0[1], "threads": marks["threads"],
        "epoch_loss": epoch_means([float(x) for x in losses], ft.steps_per_epoch),
        "test_accuracy": (result.test or {}).get("accuracy"),
        "train_ids": [ex.views[0][0] for ex in ft.data.examples["train"]],
    }  # fmt: skip


# --- the transformers side ----------------------------------------------------------------

# What our side's process group leaves in the environment (pipeline.train.engine
# .ensure_dist_env): accelerate reads LOCAL_RANK / WORLD_SIZE as a multi-CPU launch and the
# Trainer would then wrap the model in DistributedDataParallel (find_unused_parameters=True).
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def single_process_hf():
    """The Trainer as in a plain ``python train.py``: the launcher variables hidden and
    accelerate's process-wide state reset (it remembers the first set-up), both before and
    after, so each HF run decides afresh and ours gets its environment back."""
    from accelerate.state import AcceleratorState, GradientState

    saved = {k: os.environ.pop(k) for k in LAUNCH_ENV if k in os.environ}
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        os.environ.update(saved)


def run_hf(args, s: dict, epochs: int, out_dir: Path) -> dict[str, Any]:
    """``Trainer.train`` timed between its on_train_begin and on_train_end callbacks."""
    with single_process_hf():
        return _run_hf(args, s, epochs, out_dir)


def _run_hf(args, s: dict, epochs: int, out_dir: Path) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import (
        AutoTokenizer,
        BertForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    transformers.logging.set_verbosity_error()
    call0 = now()
    labels = s["labels"]
    index = {lab: i for i, lab in enumerate(labels)}
    tok = AutoTokenizer.from_pretrained(s["hf_dir"])

    def encode(path: str) -> list[dict[str, Any]]:
        rows = read_jsonl(path)
        enc = tok([r["text"] for r in rows], truncation=True, max_length=args.max_length)
        return [
            {"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
             "attention_mask": enc["attention_mask"][i], "labels": index[r["label"]]}
            for i, r in enumerate(rows)
        ]  # fmt: skip

    train, test = encode(s["paths"]["train"]), encode(s["paths"]["test"])
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification.from_pretrained(
        s["hf_dir"], num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=index
    )
    pad = DataCollatorWithPadding(tok)
    marks: dict[str, Any] = {"examples": 0}

    def collator(features):
        marks["examples"] += len(features)
        return pad(features)

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            marks["start"], marks["threads"] = now(), torch.get_num_threads()

        def on_train_end(self, *a, **kw):
            marks["end"] = now()

    targs = TrainingArguments(
        output_dir=str(out_dir), num_train_epochs=epochs, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=64, learning_rate=args.lr, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        lr_scheduler_type="linear", warmup_steps=0.1, optim="adamw_torch_fused",
        eval_strategy="no", save_strategy="no", logging_strategy="epoch", report_to=[],
        dataloader_num_workers=0, dataloader_pin_memory=False, use_cpu=True,
        disable_tqdm=True, seed=args.seed, data_seed=args.seed,
    )  # fmt: skip
    trainer = Trainer(model=model, args=targs, train_dataset=train, data_collator=collator,
                      callbacks=[Timer()])  # fmt: skip
    torch.set_num_threads(args.threads)
    out = trainer.train()
    n = marks["examples"]  # before predict, whose batches go through the collator too
    pred = trainer.predict(test)
    accuracy = float((pred.predictions.argmax(-1) == pred.label_ids).mean())
    wrapped = type(trainer.model_wrapped).__name__  # not DistributedDataParallel
    call1 = now()
    cpu = marks["end"][0] - marks["start"][0]
    wall = marks["end"][1] - marks["start"][1]
    epoch_loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "examples": n, "steps": out.global_step, "loop_cpu_s": cpu, "loop_wall_s": wall,
        "cpu_s_per_example": cpu / n, "wall_s_per_example": wall / n,
        "call_wall_s": call1[1] - call0[1], "threads": marks["threads"],
        "train_runtime": out.metrics["train_runtime"],
        "train_samples_per_second": out.metrics["train_samples_per_second"],
        "epoch_loss": epoch_loss, "test_accuracy": accuracy,
        "train_ids": [r["input_ids"] for r in train],
        "attention": getattr(model.config, "_attn_implementation", None),
        "parallel_mode": str(targs.parallel_mode), "model_wrapped": wrapped,
    }  # fmt: skip


# --- measuring ----------------------------------------------------------------------------

SIDES = {"ours": run_ours, "hf": run_hf}


def run_pair(args, s: dict, work: Path, k: int, epochs: int, warmup: bool) -> dict[str, Any]:
    order = ["ours", "hf"] if k % 2 == 0 else ["hf", "ours"]
    pair: dict[str, Any] = {"order": order, "load_start": load1()}
    for name in order:
        out_dir = work / f"{'warmup' if warmup else 'pair'}{k}-{name}"
        pair[name] = SIDES[name](args, s, epochs, out_dir)
    pair["load_end"] = load1()
    ours, hf = pair["ours"], pair["hf"]
    pair["same_token_ids"] = ours.pop("train_ids") == hf.pop("train_ids")
    pair["ratio_cpu"] = ours["cpu_s_per_example"] / hf["cpu_s_per_example"]
    pair["ratio_wall"] = ours["wall_s_per_example"] / hf["wall_s_per_example"]
    tag = "warm-up" if warmup else f"pair {k}"
    print(
        f"{tag} ({' then '.join(order)}): ms/example CPU ours "
        f"{ours['cpu_s_per_example'] * 1e3:.3f} hf {hf['cpu_s_per_example'] * 1e3:.3f} -> "
        f"{pair['ratio_cpu']:.2f}x; wall ours {ours['wall_s_per_example'] * 1e3:.3f} hf "
        f"{hf['wall_s_per_example'] * 1e3:.3f} -> {pair['ratio_wall']:.2f}x; examples "
        f"{ours['examples']} / {hf['examples']}; test acc {ours['test_accuracy']:.3f} / "
        f"{hf['test_accuracy']:.3f}; threads {ours['threads']} / {hf['threads']}; load "
        f"{pair['load_start']:.2f} -> {pair['load_end']:.2f}",
        flush=True,
    )
    return pair


def markdown(res: dict[str, Any]) -> str:
    rows = [
        "| pair | order | ours ms/ex CPU (wall) | HF ms/ex CPU (wall) | HF train_runtime s "
        "| ours / HF CPU (wall) | test acc ours / HF | loss first -> last epoch, ours / HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, p in enumerate(res["pairs"]):
        o, h = p["ours"], p["hf"]
        rows.append(
            f"| {k} | {' -> '.join(p['order'])} | {o['cpu_s_per_example'] * 1e3:.3f} "
            f"({o['wall_s_per_example'] * 1e3:.3f}) | {h['cpu_s_per_example'] * 1e3:.3f} "
            f"({h['wall_s_per_example'] * 1e3:.3f}) | {h['train_runtime']:.2f} | "
            f"{p['ratio_cpu']:.2f}x ({p['ratio_wall']:.2f}x) | {o['test_accuracy']:.3f} / "
            f"{h['test_accuracy']:.3f} | {o['epoch_loss'][0]:.3f} -> {o['epoch_loss'][-1]:.3f} / "
            f"{h['epoch_loss'][0]:.3f} -> {h['epoch_loss'][-1]:.3f} |"
        )
    m = res["median"]
    rows.append(
        f"| median | | {m['ours_cpu_s_per_example'] * 1e3:.3f} | "
        f"{m['hf_cpu_s_per_example'] * 1e3:.3f} | | **{m['ratio_cpu']:.2f}x** "
        f"({m['ratio_wall']:.2f}x) | | |"
    )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="bert-tiny")
    ap.add_argument("--repeats", type=int, help="timed pairs (default 5; --tiny: 1)")
    ap.add_argument("--epochs", type=int, help="epochs per run (default 20, the demo's; --tiny: 2)")
    ap.add_argument("--batch", type=int, default=16, help="micro batch, both sides")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per input, both sides")
    ap.add_argument("--lr", type=float, default=1e-3, help="the demo's fine-tuning lr")
    ap.add_argument("--train-per-class", type=int, help="default 64 (x 4 classes); --tiny: 8")
    ap.add_argument("--test-per-class", type=int, help="default 75; --tiny: 8")
    ap.add_argument(
        "--vocab-size", type=int, help="WordPiece vocabulary (default 8000; --tiny: 2000)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up pair")
    ap.add_argument("--tiny", action="store_true", help="a smoke run: 1 pair, tiny task")
    ap.add_argument("--work-dir", type=Path, help="keep the set-up and run folders here")
    ap.add_argument("--json", type=Path, help="also write the JSON result here")
    args = ap.parse_args()
    defaults = {"train_per_class": 64, "test_per_class": 75, "epochs": 20, "repeats": 5,
                "vocab_size": 8000}  # fmt: skip
    for key, value in (TINY if args.tiny else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny:
        args.no_warmup = True
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU bench (both sides would pick CUDA)
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    tmp = None
    if args.work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-finetune-")
        work = Path(tmp.name)
    else:
        work = args.work_dir
        work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        s = set_up(args, work)
        print(f"set-up {time.perf_counter() - t0:.1f}s: {args.model} {s['shape']}, "
              f"{s['params'] / 1e6:.2f}M params; {s['n_train']} train rows x {args.epochs} "
              f"epochs, batch {args.batch}, max_length {args.max_length}, lr {args.lr}; "
              f"{args.threads} torch thread(s) (OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); load {load1():.2f}", flush=True)  # fmt: skip
        if not args.no_warmup:
            run_pair(args, s, work, 0, 1, warmup=True)
        pairs = [run_pair(args, s, work, k, args.epochs, warmup=False) for k in range(args.repeats)]
        med = statistics.median
        res = {
            "bench": "finetune_vs_hf", "model": args.model, "shape": s["shape"],
            "params": s["params"], "train_rows": s["n_train"], "epochs": args.epochs,
            "batch": args.batch, "max_length": args.max_length, "lr": args.lr,
            "threads": args.threads, "tiny": args.tiny,
            "median": {
                "ours_cpu_s_per_example": med(p["ours"]["cpu_s_per_example"] for p in pairs),
                "hf_cpu_s_per_example": med(p["hf"]["cpu_s_per_example"] for p in pairs),
                "ours_wall_s_per_example": med(p["ours"]["wall_s_per_example"] for p in pairs),
                "hf_wall_s_per_example": med(p["hf"]["wall_s_per_example"] for p in pairs),
                "ratio_cpu": med(p["ratio_cpu"] for p in pairs),
                "ratio_wall": med(p["ratio_wall"] for p in pairs),
            },
            "pairs": pairs,
            "info": {
                "platform": platform.platform(), "cpu_count": os.cpu_count(),
                "python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__,
                "hf_attention": pairs[0]["hf"].get("attention"),
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
            },
        }  # fmt: skip
        print(f"\n{markdown(res)}\n")
        line = json.dumps(res)
        if args.json:
            args.json.write_text(line + "\n", encoding="utf-8")
        print(line, flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
