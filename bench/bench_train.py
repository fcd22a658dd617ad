"""Training cost per REAL token: our Trainer vs a plain Hugging Face loop, side by side.

    python bench/bench_train.py                                   # bert-tiny, 4x256, bert-base
    python bench/bench_train.py --preset bert-tiny --preset 4x256 --json out.json
    python bench/bench_train.py --work-dir /tmp/bt               # keep (and reuse) the data
    python bench/bench_train.py --data-dir /tmp/bt/data          # reuse it: no Ray, no prepare
    python bench/bench_train.py --device cuda --precision bf16    # GPU machine (not run here)

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
  ``torch.optim.AdamW`` (fused on CUDA), fp32 or ``torch.autocast`` bf16. Timed: the
  collator + the step.

The sides alternate (ours, hf, hf, ours, ...; with two ours variants A B C, C B A, ...), so
a busy phase of a shared machine hits each alike. Cost = process CPU seconds
(time.process_time, every thread of the process) per 1000 real (non-padding) tokens,
median over the rounds; on CUDA, synchronised wall seconds instead. Reported per preset:
that cost, real tokens per second (wall), the ratio hf / ours of the medians (and the range
of the per-round ratios), the padding of the windows, torch threads, platform, cpu count
and the load average. A markdown table is printed; --json PATH writes everything.

With --data-dir (a data dir prepared earlier, e.g. by a run with --work-dir) nothing
imports Ray. MLflow is never contacted either way: the bench calls ``train_step`` only,
and the config points ``mlflow.tracking_uri`` at a sqlite file in a temp dir. Run it
with ``OMP_NUM_THREADS=1`` on a shared machine (README: one torch thread).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Model shapes: layers, hidden, heads, feed-forward (the bert-tiny here is Google's
# 2 x 128 BERT-Tiny, not the project's 2 x 64 configs/models/bert-tiny.yaml).
PRESETS: dict[str, dict[str, int]] = {
    "bert-tiny": {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 512},
    "4x256": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024},
    "bert-base": {"num_layers": 12, "hidden_size": 768, "num_heads": 12, "intermediate_size": 3072},
}
DEFAULT_BATCH = {"bert-tiny": 32, "4x256": 32, "bert-base": 16}
DEFAULT_ROUNDS = {"bert-tiny": 20, "4x256": 10, "bert-base": 3}
DEFAULT_WARMUP = {"bert-tiny": 2, "4x256": 2, "bert-base": 1}
MAX_POSITIONS = 512
DATA_VERSION = 1  # bump when the corpus generator changes (invalidates --work-dir caches)

# --- corpus -------------------------------------------------------------------------------

COMMON = """the of and to a in is that it was for on are as with his they at be this from
have or by one had not but what all were when we there can an your which their said if do
will each about how up out them then she many some so these would other into has more her
two like him see time could no make than first been its who now people my made over did
down only way find use may water long little very after words called just where most know
get through back much before go good new write our used me man too any day same right look
think also around another came come work three word must because does part even place well
such here take why things help put years different away again off went old number great
tell men say small every found still between name should home big give air line set own
under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough
took sometimes four head above kind began almost live page got earth need far hand high year
mother light parts country father let night following picture being study second eyes soon
times story boys since white days ever paper hard near sentence better best across during
today others however sure means knew its try told young miles sun ways thing whole hear
example heard several change answer room sea against top turned learn point city play toward
five using himself usually""".split()
ONSETS = ["", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
          "v", "w", "br", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "str",
          "th", "tr", "ch", "sp", "wh"]  # fmt: skip
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "io", "y", "ie", "oa"]
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "ld", "ss"]
SUFFIXES = ["", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "ment", "able", "al"]


def pseudo_words(n: int, rng) -> list[str]:
    """``n`` distinct words of 1-4 English-like syllables, shortest first (Zipf rank 1
    is the shortest word, as in English)."""
    common = set(COMMON)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        k = int(rng.choice(4, p=[0.35, 0.4, 0.2, 0.05])) + 1
        w = "".join(
            str(rng.choice(ONSETS)) + str(rng.choice(VOWELS)) + str(rng.choice(CODAS))
            for _ in range(k)
        ) + str(rng.choice(SUFFIXES))
        if len(w) > 2 and w not in seen and w not in common:
            seen.add(w)
            out.append(w)
    return sorted(out, key=len)


def write_corpus(path: Path, n_docs: int, max_sentences: int, n_words: int, seed: int) -> None:
    """Blank-line separated documents of 1..max_sentences sentences of 4-18 words; about
    45% of the words from COMMON (uniform), the rest pseudo-words with Zipf frequencies."""
    import numpy as np

    rng = np.random.default_rng(seed)
    content = np.array(pseudo_words(n_words, rng))
    cdf = np.cumsum(1.0 / np.arange(1, n_words + 1))
    cdf /= cdf[-1]
    common = np.array(COMMON)
    ends = np.array([".", ".", ".", ".", "?", "!"])
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            sents = []
            for _ in range(int(rng.integers(1, max_sentences + 1))):
                n = int(rng.integers(4, 19))
                picks = np.minimum(np.searchsorted(cdf, rng.random(n)), n_words - 1)
                words = np.where(
                    rng.random(n) < 0.45, common[rng.integers(0, len(common), n)], content[picks]
                ).tolist()
                if n > 8 and rng.random() < 0.3:  # a comma now and then
                    words[int(rng.integers(2, n - 2))] += ","
                sents.append(" ".join(words).capitalize() + str(rng.choice(ends)))
            f.write(" ".join(sents) + "\n\n")


def plm_cli(*args: str) -> None:
    """``plm ARGS`` in a fresh process: the CLI a user runs (this checkout's code when it
    is on PYTHONPATH, as for this script)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(
            f"plm {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    for line in lines[-2:]:
        print(f"  | {line}")


def prepare_data(work: Path, args) -> Path:
    """Corpus -> tokenizer -> shards under ``work`` (reused when made with the same knobs)."""
    knobs = {"version": DATA_VERSION, "docs": args.docs, "max_sentences": args.max_sentences,
             "words": args.words, "vocab_size": args.vocab_size, "seed": args.seed}  # fmt: skip
    stamp, data = work / "bench_train_data.json", work / "data"
    if (data / "manifest.json").is_file() and stamp.is_file():
        if json.loads(stamp.read_text()) == knobs:
            print(f"data: reusing {data} ({stamp.name} matches)")
            return data
    work.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    corpus, tok = work / "corpus.txt", work / "tokenizer"
    t0 = time.perf_counter()
    write_corpus(corpus, args.docs, args.max_sentences, args.words, args.seed)
    print(f"data: corpus {corpus.stat().st_size / 1e6:.1f} MB, {args.docs:,} documents "
          f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    plm_cli("data", "tokenizer", "--input", str(corpus), "--kind", "wordpiece", "--lowercase",
            "--vocab-size", str(args.vocab_size), "--output", str(tok), "--seed", str(args.seed))  # fmt: skip
    plm_cli("data", "prepare", "--input", str(corpus), "--tokenizer", str(tok), "--output",
            str(data), "--valid-fraction", "0.01", "--num-cpus", str(args.prepare_cpus),
            "--force")  # fmt: skip
    stamp.write_text(json.dumps(knobs))
    return data


# --- the two sides ------------------------------------------------------------------------


def train_section_fields() -> set[str]:
    """The keys of the experiment config's ``train:`` section."""
    from pipeline import config

    section = getattr(config, "TrainConfig", None) or config.TrainSection
    return set(section.model_fields)


def experiment_config(args, preset: str, data: Path, run_dir: Path, unpad: bool | None):
    from pipeline.config import validate_dict

    train: dict[str, Any] = {
        "max_steps": 1_000_000, "micro_batch_size": args.batch_of[preset], "grad_accum": 1,
        "lr": args.lr, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-6,
        "grad_clip": 1.0, "warmup_steps": 0, "schedule": "constant", "seed": args.seed,
        "precision": args.precision, "eval_every": 0, "save_every": 0, "log_every": 1_000_000,
        "resume": "never", "out_dir": str(run_dir),
    }  # fmt: skip
    if unpad is not None:
        train["unpad"] = unpad
    raw = {
        "name": f"bench-train-{preset}",
        "model": {"arch": "bert", "preset": "bert-base", **PRESETS[preset],
                  "max_positions": MAX_POSITIONS, "dropout": 0.1, "attention_dropout": 0.1},
        "objective": {"kind": "mlm"},
        "data": {"path": str(data), "seq_len": args.seq, "workers": 0},
        "train": train,
        "deepspeed": "configs/deepspeed/zero0.json",
        "mlflow": {"tracking_uri": f"sqlite:///{run_dir.parent / 'mlflow.db'}", "register": False},
    }  # fmt: skip
    return validate_dict(raw, f"bench_train {preset}")


class Ours:
    """The project's Trainer; ``step`` runs ``train_step`` on a batch the caller made."""

    def __init__(self, cfg):
        from pipeline.train.trainer import Trainer

        self.trainer = Trainer(cfg)
        self.model = self.trainer.engine.module
        self.losses: list[float] = []
        self.out: Any = None

    def step(self, batch: dict) -> None:
        self.out = self.trainer.train_step(iter([batch]))
        self.trainer.step += 1  # as Trainer.run does (the dropout seed follows it)

    def read_loss(self) -> None:
        """After the timed part: ``train_step`` returns a dict of floats, or (since the
        metrics stay on the device) a record whose ``values`` start with the loss."""
        out, self.out = self.out, None
        if out is not None:
            self.losses.append(float(out["loss"] if isinstance(out, dict) else out.values[0]))

    def close(self) -> None:
        self.trainer.stream.close()


class HF:
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
        self.model = BertForMaskedLM(config).to(dev).train()
        self.collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm_probability=0.15)
        extra = {"fused": True} if dev.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                     eps=1e-6, weight_decay=0.01, **extra)  # fmt: skip
        self.dev, self.bf16 = dev, args.precision == "bf16"
        self.losses: list[float] = []
        self.padded = self.slots = 0  # what the collator's dynamic padding left

    def step(self, rows: list[list[int]]) -> None:
        import torch

        batch = self.collator([{"input_ids": r} for r in rows])
        self.mask = batch["attention_mask"]  # counted after the timed part
        batch = {k: v.to(self.dev, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()

    def read_loss(self) -> None:
        self.losses.append(float(self.loss))
        self.padded += int(self.mask.numel() - self.mask.sum())
        self.slots += self.mask.numel()

    def close(self) -> None:
        pass


def real_rows(batch: dict) -> list[list[int]]:
    """Each row's real tokens (attention_mask), with the ids our masking replaced put back:
    ``[CLS] window [SEP]``, what the collator gets."""
    ids = batch["input_ids"].where(batch["mlm_labels"] < 0, batch["mlm_labels"])
    keep = batch["attention_mask"].bool()
    return [row[k].tolist() for row, k in zip(ids, keep, strict=True)]


# --- measuring ----------------------------------------------------------------------------


class Clock:
    """(cpu, wall) readings: process CPU seconds on the CPU; on CUDA the device is
    synchronised first and the cost is the wall time (CPU seconds then mean little)."""

    def __init__(self, dev):
        import torch

        self.cuda = dev.type == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)

    def now(self) -> tuple[float, float]:
        self.sync()
        return time.process_time(), time.perf_counter()

    def cost(self, start: tuple[float, float], end: tuple[float, float]) -> tuple[float, float]:
        cpu, wall = end[0] - start[0], end[1] - start[1]
        return (wall if self.cuda else cpu), wall


def load1() -> float:
    return os.getloadavg()[0]


def run_preset(args, preset: str, data: Path, meta: dict, tmp: Path, dev, has_unpad: bool):
    import torch

    variants: list[tuple[str, bool | None]] = (
        [("ours unpad", True), ("ours padded", False)] if has_unpad else [("ours", None)]
    )
    sides: dict[str, Any] = {}
    for name, unpad in variants:
        run_dir = tmp / f"{preset}-{name.replace(' ', '-')}"
        sides[name] = Ours(experiment_config(args, preset, data, run_dir, unpad))
    sides["hf"] = HF(args, preset, data, meta, dev)
    # The Trainer may set torch's threads (cores per rank when OMP_NUM_THREADS is unset):
    # both sides run with the count this process started with (or --threads).
    torch.set_num_threads(args.threads_wanted)
    first = sides[variants[0][0]]
    stream = iter(first.trainer.stream)  # every side trains on these batches
    clock = Clock(dev)
    order = list(sides)
    n_ours = sum(p.numel() for p in first.model.parameters())
    n_hf = sum(p.numel() for p in sides["hf"].model.parameters())
    attn = getattr(sides["hf"].model.config, "_attn_implementation", "?")
    B = args.batch_of[preset]
    print(f"\n== {preset}: {PRESETS[preset]}, batch {B} x seq {args.seq}, {args.precision}, "
          f"{dev.type}; params ours {n_ours / 1e6:.2f}M, hf {n_hf / 1e6:.2f}M (attention "
          f"{attn}); warmup {args.warmup_of[preset]}, rounds {args.rounds_of[preset]}; "
          f"load {load1():.2f}", flush=True)  # fmt: skip
    cost: dict[str, list[float]] = {n: [] for n in sides}
    wall: dict[str, list[float]] = {n: [] for n in sides}
    tokens: list[int] = []
    slots = 0
    load_start = load1()
    warmup, rounds = args.warmup_of[preset], args.rounds_of[preset]
    for r in range(warmup + rounds):
        if r == warmup:  # the collator's padding of the timed rounds only
            sides["hf"].padded = sides["hf"].slots = 0
        t0 = clock.now()
        batch = next(stream)  # the loader's share of ours (in this process: workers 0)
        loader_cost, loader_wall = clock.cost(t0, clock.now())
        rows = real_rows(batch)
        n_real = int(batch["attention_mask"].sum())
        timed = r >= warmup
        line = []
        for name in order if r % 2 == 0 else order[::-1]:
            side = sides[name]
            if name == "hf":
                arg: Any = rows
            else:
                arg = {k: v.clone() for k, v in batch.items()}
            t0 = clock.now()
            side.step(arg)
            c, w = clock.cost(t0, clock.now())
            side.read_loss()
            if name != "hf":
                c, w = c + loader_cost, w + loader_wall
            line.append(f"{name} {c / n_real * 1e3:.3f}")
            if timed:
                cost[name].append(c)
                wall[name].append(w)
        if timed:
            tokens.append(n_real)
            slots += batch["attention_mask"].numel()
        tag = f"round {r - warmup}" if timed else f"warmup {r}"
        print(f"  {tag}: {n_real} real tokens ({1 - n_real / batch['attention_mask'].numel():.0%}"
              f" padding); s/1k real tokens: " + ", ".join(line), flush=True)  # fmt: skip
    load_end = load1()
    real = sum(tokens)
    result: dict[str, Any] = {
        "preset": preset, "shape": PRESETS[preset], "batch": B, "seq": args.seq,
        "precision": args.precision, "device": dev.type, "rounds": rounds, "warmup": warmup,
        "params": {"ours": n_ours, "hf": n_hf}, "hf_attention": attn,
        "padding_fraction": 1 - real / slots,
        "hf_padding_fraction": sides["hf"].padded / max(sides["hf"].slots, 1),
        "real_tokens_per_round": tokens, "load_start": load_start, "load_end": load_end,
        "torch_threads": torch.get_num_threads(),
        "cost_metric": "wall_s" if clock.cuda else "cpu_s", "sides": {},
    }  # fmt: skip
    for name in sides:
        per_1k = [c / n * 1e3 for c, n in zip(cost[name], tokens, strict=True)]
        result["sides"][name] = {
            "cost_per_round": cost[name], "wall_per_round": wall[name],
            "cost_per_1k_real_tokens": statistics.median(per_1k),
            "real_tokens_per_s_wall": real / sum(wall[name]),
            "loss_first": sides[name].losses[0], "loss_last": sides[name].losses[-1],
        }  # fmt: skip
    hf = result["sides"]["hf"]
    for name, _ in variants:
        ours = result["sides"][name]
        per_round = [h / o for h, o in zip(cost["hf"], cost[name], strict=True)]
        ours["hf_over_ours"] = hf["cost_per_1k_real_tokens"] / ours["cost_per_1k_real_tokens"]
        ours["hf_over_ours_rounds"] = [min(per_round), max(per_round)]
    for side in sides.values():
        side.close()
    del sides, first, stream
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def markdown(results: list[dict], info: dict) -> str:
    unit = "GPU wall s" if info["device"] == "cuda" else "CPU s"
    head = (
        f"| preset | batch x seq | window padding (hf batches) | side | {unit} / 1k real tokens "
        "| real tokens/s (wall) | hf / this | per-round hf / this | loss first -> last | "
        "load (start -> end) |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    out = []
    for res in results:
        pad = f"{res['padding_fraction']:.1%} ({res['hf_padding_fraction']:.1%})"
        for name, s in res["sides"].items():
            ratio = rng = ""
            if "hf_over_ours" in s:
                ratio = f"**{s['hf_over_ours']:.2f}x**"
                rng = f"{s['hf_over_ours_rounds'][0]:.2f}-{s['hf_over_ours_rounds'][1]:.2f}"
            out.append(
                f"| {res['preset']} | {res['batch']} x {res['seq']} | {pad} | {name} | "
                f"{s['cost_per_1k_real_tokens']:.3f} | {s['real_tokens_per_s_wall']:,.0f} | "
                f"{ratio} | {rng} | {s['loss_first']:.2f} -> {s['loss_last']:.2f} | "
                f"{res['load_start']:.2f} -> {res['load_end']:.2f} |"
            )
    return head + "\n".join(out)


def window_padding(data: Path, seq: int, batch: int, n_batches: int = 64) -> float:
    """Padding share of the first ``n_batches`` MLM windows batches (the corpus' mix)."""
    import itertools

    from pipeline.config import ObjectiveSection
    from pipeline.data.stream import PretrainStream
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
    ap.add_argument("--batch", type=int, help="micro batch (default 32; 16 for bert-base)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, help="timed rounds (default 20 / 10 / 3 for bert-base)")
    ap.add_argument("--warmup", type=int, help="untimed rounds (default 2; 1 for bert-base)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, i.e. OMP_NUM_THREADS)")  # fmt: skip
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--work-dir", help="keep the corpus, tokenizer and shards here (reused)")
    ap.add_argument("--data-dir", help="a data dir prepared earlier: skip the data stage")
    ap.add_argument("--docs", type=int, default=8000, help="documents in the corpus")
    ap.add_argument("--max-sentences", type=int, default=15, help="documents have 1..N sentences")
    ap.add_argument("--words", type=int, default=20000, help="pseudo-words in the word list")
    ap.add_argument("--vocab-size", type=int, default=30522, help="WordPiece vocabulary")
    ap.add_argument("--prepare-cpus", type=int, default=1, help="plm data prepare --num-cpus")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    presets = args.preset or list(PRESETS)
    args.batch_of = {p: args.batch or DEFAULT_BATCH[p] for p in presets}
    args.rounds_of = {p: args.rounds or DEFAULT_ROUNDS[p] for p in presets}
    args.warmup_of = {p: DEFAULT_WARMUP[p] if args.warmup is None else args.warmup for p in presets}
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer picks CUDA whenever it sees one
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads_wanted = torch.get_num_threads()
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        if args.data_dir:
            data = Path(args.data_dir)
        else:
            data = prepare_data(Path(args.work_dir) if args.work_dir else tmp / "work", args)
        meta = json.loads((data / "tokenizer" / "tokenizer_meta.json").read_text())
        manifest = json.loads((data / "manifest.json").read_text())
        padding = window_padding(data, args.seq, 32)
        has_unpad = "unpad" in train_section_fields()
        info = {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "device": args.device,
            "cuda_device": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "precision": args.precision, "data_dir": str(data), "vocab_size": meta["vocab_size"],
            "documents": manifest["totals"]["n_docs"], "tokens": manifest["totals"]["n_tokens"],
            "window_padding_first_64_batches": padding, "train_unpad_key": has_unpad,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
        }  # fmt: skip
        try:
            import transformers

            info["transformers"] = transformers.__version__
        except ImportError:
            info["transformers"] = None
        print(f"machine: {info['platform']}, {info['processor']}, {info['cpu_count']} cpus; "
              f"torch {info['torch']} ({info['torch_threads']} threads), transformers "
              f"{info['transformers']}; load {load1():.2f}")  # fmt: skip
        print(f"data: {data}: {info['documents']:,} documents, {info['tokens']:,} tokens, "
              f"vocabulary {meta['vocab_size']:,}; MLM windows at seq {args.seq}: "
              f"{padding:.1%} padding (first 64 batches of 32)")  # fmt: skip
        print(f"train.unpad in the config: {'yes: ours runs with true and false' if has_unpad else 'no'}")  # fmt: skip
        results = [run_preset(args, p, data, meta, tmp, dev, has_unpad) for p in presets]
        info["elapsed_s"] = time.perf_counter() - t_start
        table = markdown(results, info)
        print(f"\n{table}\n")
        print(f"{info['torch_threads']} torch threads, {info['cpu_count']} cpus, "
              f"{info['processor']}; whole run {info['elapsed_s']:.0f} s")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps({"info": info, "results": results}, indent=1))
            print(f"wrote {args.json}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
