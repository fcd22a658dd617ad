"""What the two training benches share: bench_train.py (BERT vs Hugging Face) and
bench_gpt.py (GPT-2 vs a nanoGPT-style baseline written there).

- the data: a generated short-document corpus, then the project's CLI (``plm data
  tokenizer``, ``plm data prepare``), cached under a work dir;
- our side: the experiment config and ``Trainer.train_step`` (``Ours``); the baselines'
  plain PyTorch step (``PlainLoop``);
- the measuring: one round = one optimizer step of every side on the same batch, the sides
  alternating (A B C, C B A, ...); process CPU seconds on the CPU, synchronised wall
  seconds on CUDA (``Clock``); each side's own peak of allocated GPU memory
  (``DeviceMemory``); MFU from the project's FLOPs model and peak table (``side_report``);
- ``--deny-import``: packages this process must run without (the GPU machine has no Ray
  and no MLflow).

Nothing here imports torch or the pipeline at module level, so ``deny_imports`` acts
before anything else is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_VERSION = 2  # bump when the corpus generator or the stamp changes (invalidates caches)

# --- imports ------------------------------------------------------------------------------


def deny_imports(names: list[str]) -> None:
    """Make ``names`` unimportable in this process, as if they were not installed (on the
    GPU machine Ray and MLflow are not): ``None`` in ``sys.modules`` makes ``import``
    raise ModuleNotFoundError and ``importlib.util.find_spec`` return None, so optional
    imports elsewhere (DeepSpeed's autotuner tries ``import mlflow``, torch probes for
    zstandard) take their not-installed path, and a required one fails."""
    loaded = sorted(n for n in names if sys.modules.get(n) is not None)
    if loaded:
        raise SystemExit(f"--deny-import: {', '.join(loaded)} already imported")
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


def third_party_modules() -> list[str]:
    """Top-level packages imported so far, outside the standard library (a denied one,
    None in ``sys.modules``, is not imported)."""
    std = set(sys.stdlib_module_names)
    tops = {m.partition(".")[0] for m, mod in list(sys.modules.items()) if mod is not None}
    return sorted(m for m in tops if m not in std and not m.startswith("_"))


# --- data ---------------------------------------------------------------------------------

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
    is on PYTHONPATH, as for the benches)."""
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


def add_common_args(ap, *, docs: int, words: int, vocab_size: int) -> None:
    """The options every bench has: device, precision, threads, the corpus / tokenizer /
    prepare knobs (defaults per bench), --deny-import and --json."""
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, i.e. OMP_NUM_THREADS)")  # fmt: skip
    ap.add_argument("--work-dir", help="keep the corpus, tokenizer and shards here (reused)")
    ap.add_argument("--data-dir", help="a data dir prepared earlier: skip the data stage")
    ap.add_argument("--docs", type=int, default=docs, help="documents in the corpus")
    ap.add_argument("--max-sentences", type=int, default=15, help="documents have 1..N sentences")
    ap.add_argument("--words", type=int, default=words, help="pseudo-words in the word list")
    ap.add_argument("--vocab-size", type=int, default=vocab_size, help="tokenizer vocabulary")
    ap.add_argument("--prepare-cpus", type=int, default=1, help="plm data prepare --num-cpus")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deny-import", action="append", default=[], metavar="PACKAGE",
                    help="run as if PACKAGE were not installed (repeatable: ray, mlflow)")  # fmt: skip
    ap.add_argument("--json", help="write the results here")


def prepare_data(work: Path, kind: str, args) -> Path:
    """Corpus -> tokenizer of ``kind`` (wordpiece: lowercased; bpe: byte-level) -> shards
    under ``work``, through the project's CLI; reused when made with the same knobs."""
    knobs = {"version": DATA_VERSION, "kind": kind, "docs": args.docs,
             "max_sentences": args.max_sentences, "words": args.words,
             "vocab_size": args.vocab_size, "seed": args.seed}  # fmt: skip
    stamp, data = work / "bench_data.json", work / "data"
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
    lowercase = ["--lowercase"] if kind == "wordpiece" else []
    plm_cli("data", "tokenizer", "--input", str(corpus), "--kind", kind, *lowercase,
            "--vocab-size", str(args.vocab_size), "--output", str(tok), "--seed", str(args.seed))  # fmt: skip
    plm_cli("data", "prepare", "--input", str(corpus), "--tokenizer", str(tok), "--output",
            str(data), "--valid-fraction", "0.01", "--num-cpus", str(args.prepare_cpus),
            "--force")  # fmt: skip
    stamp.write_text(json.dumps(knobs))
    return data


def data_info(data: Path) -> dict[str, Any]:
    meta = json.loads((data / "tokenizer" / "tokenizer_meta.json").read_text())
    manifest = json.loads((data / "manifest.json").read_text())
    return {"data_dir": str(data), "tokenizer": meta["kind"], "vocab_size": meta["vocab_size"],
            "documents": manifest["totals"]["n_docs"], "tokens": manifest["totals"]["n_tokens"]}  # fmt: skip


@dataclass
class Session:
    """A bench run's setting (``session``): the device, the data dir, a temp dir, and
    ``info`` (the machine, torch, the device's peak FLOP/s, the data)."""

    args: Any
    dev: Any
    data: Path
    tmp: Path
    info: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)

    def finish(self, payload: dict[str, Any]) -> None:
        """Complete ``info`` (elapsed time, the imports denied and the third-party modules
        loaded), print the closing line, write ``{"info": ..., **payload}`` to --json."""
        info = self.info
        info["elapsed_s"] = time.perf_counter() - self.started
        info["denied_imports"] = self.args.deny_import
        info["imported"] = third_party_modules()
        print(f"{info['torch_threads']} torch threads, {info['cpu_count']} cpus, "
              f"{info['processor']}; whole run {info['elapsed_s']:.0f} s")  # fmt: skip
        if self.args.json:
            Path(self.args.json).write_text(json.dumps({"info": info, **payload}, indent=1))
            print(f"wrote {self.args.json}")


@contextlib.contextmanager
def session(args, kind: str):
    """Start a bench run: ``--deny-import`` first, then the device (CUDA hidden on the CPU),
    torch's threads (--threads, else what the process started with: ``threads_wanted``,
    which the sides run with), a temp dir (removed at the end) and the data dir: --data-dir,
    or one prepared with a ``kind`` tokenizer under --work-dir (else the temp dir)."""
    deny_imports(args.deny_import)
    dev = pick_device(args.device)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads_wanted = torch.get_num_threads()
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    try:
        if args.data_dir:
            data = Path(args.data_dir)
        else:
            data = prepare_data(Path(args.work_dir) if args.work_dir else tmp / "work", kind, args)
        info = {**machine_info(dev, args.precision), **data_info(data)}
        print(f"machine: {info['platform']}, {info['processor']}, {info['cpu_count']} cpus; "
              f"torch {info['torch']} ({info['torch_threads']} threads); "
              f"{info['cuda_device'] or 'cpu'}, peak {info['peak_flops'] or 0:.3g} FLOP/s "
              f"({args.precision}); load {load1():.2f}\ndata: {data}: {info['documents']:,} "
              f"documents, {info['tokens']:,} tokens, {info['tokenizer']} vocabulary "
              f"{info['vocab_size']:,}")  # fmt: skip
        yield Session(args, dev, data, tmp, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- our side -----------------------------------------------------------------------------


def experiment_config(name: str, model: dict, objective: dict, data: Path, seq: int,
                      train: dict, run_dir: Path):  # fmt: skip
    """The validated experiment config of a bench run: ``train`` over the bench defaults
    (constant lr, no warm-up, no eval / checkpoints / logging), ZeRO-0, world size 1,
    ``data.workers: 0`` (the loader runs in this process), MLflow never contacted (only
    ``train_step`` runs; the URI points at a file in the run's temp dir)."""
    from pipeline.config import validate_dict

    defaults = {"max_steps": 1_000_000, "grad_accum": 1, "grad_clip": 1.0, "warmup_steps": 0,
                "schedule": "constant", "eval_every": 0, "save_every": 0,
                "log_every": 1_000_000, "resume": "never", "out_dir": str(run_dir)}  # fmt: skip
    raw = {
        "name": name, "model": model, "objective": objective,
        "data": {"path": str(data), "seq_len": seq, "workers": 0},
        "train": {**defaults, **train},
        "deepspeed": "configs/deepspeed/zero0.json",
        "mlflow": {"tracking_uri": f"sqlite:///{run_dir.parent / 'mlflow.db'}", "register": False},
    }  # fmt: skip
    return validate_dict(raw, name)


class Ours:
    """The project's Trainer; ``step`` runs ``train_step`` on a batch the loader made. Its
    cost includes the loader's (the batch is cut and masked in this process)."""

    pays_loader = True

    def __init__(self, cfg):
        from pipeline.train.trainer import Trainer

        self.trainer = Trainer(cfg)
        self.model = self.trainer.engine.module
        self.losses: list[float] = []
        self.out: Any = None

    def arg(self, batch: dict) -> dict:
        return {k: v.clone() for k, v in batch.items()}

    def step(self, batch: dict) -> None:
        self.out = self.trainer.train_step(iter([batch]))
        self.trainer.step += 1  # as Trainer.run does (the dropout seed follows it)

    def read_loss(self) -> None:
        """After the timed part: ``train_step`` returns a record whose ``values`` start
        with the loss (older trainers: a dict of floats)."""
        out, self.out = self.out, None
        if out is not None:
            self.losses.append(float(out["loss"] if isinstance(out, dict) else out.values[0]))

    def flops(self, batch: dict) -> float:
        """Model FLOPs (forward + backward) of ``batch``, counted as the trainer counts them
        for its logged MFU: the real tokens x the model's ``flops_per_token`` at the mean
        attended length and the decoded share of the batch (trainer._log_window)."""
        from pipeline.train.batch_stats import n_tokens, work_stats

        squares, decoded = work_stats(batch)
        n = n_tokens(batch)
        return n * self.trainer.model_flops(squares / n, min(decoded / n, 1.0))

    def close(self) -> None:
        self.trainer.stream.close()


class PlainLoop:
    """A baseline's step, a plain PyTorch loop: ``inputs`` (untimed hooks aside, part of
    the step: collating, moving to the device), the loss under ``torch.autocast`` bf16 (or
    fp32), ``backward``, grad clipping 1.0, ``torch.optim.AdamW`` (fused, as ours), gradients
    set to None. Subclasses give ``arg``, ``inputs`` and ``loss``."""

    pays_loader = False

    def __init__(self, model, groups: list[dict], dev, precision: str, lr: float,
                 betas: tuple[float, float], eps: float):  # fmt: skip
        import torch

        self.model = model
        # fused on the GPU and on the CPU, as the Trainer's (pipeline/train/engine.py)
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        self.dev, self.bf16 = dev, precision == "bf16"
        self.losses: list[float] = []

    def arg(self, batch: dict) -> Any:
        raise NotImplementedError

    def inputs(self, arg: Any) -> Any:
        raise NotImplementedError

    def loss(self, inputs: Any):
        raise NotImplementedError

    def step(self, arg: Any) -> None:
        import torch

        inputs = self.inputs(arg)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss(inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last = loss.detach()

    def read_loss(self) -> None:
        self.losses.append(float(self.last))

    def close(self) -> None:
        pass


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


class DeviceMemory:
    """Each side's own peak of allocated CUDA memory while every side stays resident.

    ``resident[name]``: what the side holds between steps (weights, optimizer state, ...),
    the growth of ``torch.cuda.memory_allocated`` while it was built, plus what each of its
    steps kept. Over a step, ``max_memory_allocated`` (reset first) minus what was allocated
    before it is the step's rise; the side's peak is that plus its resident bytes, i.e.
    what it would have peaked at alone. Only timed steps count. On the CPU: nothing (None).
    """

    def __init__(self, dev):
        import torch

        self.cuda = dev.type == "cuda"
        self.torch = torch
        self.resident: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    @contextlib.contextmanager
    def building(self, name: str):
        before = self._allocated()
        yield
        self.resident[name] = self._allocated() - before

    @contextlib.contextmanager
    def step(self, name: str, timed: bool):
        if not self.cuda:
            yield
            return
        cuda = self.torch.cuda
        before = cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        yield
        cuda.synchronize()
        own = self.resident.get(name, 0)
        if timed:
            self.peak[name] = max(
                self.peak.get(name, 0), cuda.max_memory_allocated() - before + own
            )
        self.resident[name] = own + cuda.memory_allocated() - before

    def _allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0


@dataclass
class Rounds:
    """What ``alternate`` measured, per timed round."""

    cost: dict[str, list[float]]  # per side: CPU s (cpu) or wall s (cuda), loader included
    wall: dict[str, list[float]]  # (for the sides that pay it)
    step_cost: dict[str, list[float]]  # the same for the step alone
    step_wall: dict[str, list[float]]
    tokens: list[int] = field(default_factory=list)  # real (non-padding) tokens
    slots: list[int] = field(default_factory=list)  # positions, padding included
    flops: list[float] = field(default_factory=list)  # model FLOPs of the batch
    loader: list[float] = field(default_factory=list)  # the loader's cost


def alternate(sides: dict, stream, warmup: int, rounds: int, clock: Clock,
              memory: DeviceMemory, flops_of) -> Rounds:  # fmt: skip
    """``warmup + rounds`` rounds; each takes the loader's next batch (timed: the loader's
    cost, added to the sides that pay it) and runs one step of every side on it, in the
    order of ``sides`` on even rounds and reversed on odd ones, so a busy phase of a
    shared machine hits each side alike. ``flops_of(batch)``: its model FLOPs."""
    order = list(sides)
    out = Rounds(*({n: [] for n in order} for _ in range(4)))
    for r in range(warmup + rounds):
        t0 = clock.now()
        batch = next(stream)
        loader_cost, loader_wall = clock.cost(t0, clock.now())
        n_slots = batch["input_ids"].numel()
        # clm batches carry no mask: their packed rows have no padding
        n_real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else n_slots
        timed = r >= warmup
        line = []
        for name in order if r % 2 == 0 else order[::-1]:
            side = sides[name]
            arg = side.arg(batch)
            with memory.step(name, timed):
                t0 = clock.now()
                side.step(arg)
                step = clock.cost(t0, clock.now())
                side.read_loss()
            c, w = step
            if side.pays_loader:
                c, w = c + loader_cost, w + loader_wall
            line.append(f"{name} {c / n_real * 1e3:.4g}")
            if timed:
                out.cost[name].append(c)
                out.wall[name].append(w)
                out.step_cost[name].append(step[0])
                out.step_wall[name].append(step[1])
        if timed:
            out.tokens.append(n_real)
            out.slots.append(n_slots)
            out.flops.append(flops_of(batch))
            out.loader.append(loader_cost)
        tag = f"round {r - warmup}" if timed else f"warmup {r}"
        unit = "wall" if clock.cuda else "CPU"
        print(f"  {tag}: {n_real} real tokens ({1 - n_real / n_slots:.0%} padding); {unit} s/1k "
              f"real tokens: " + ", ".join(line), flush=True)  # fmt: skip
    return out


def side_report(r: Rounds, name: str, side, memory: DeviceMemory, peak: float | None) -> dict:
    """One side's figures over the timed rounds. ``mfu``: model FLOPs per wall second over
    ``peak`` (None where the peak is unknown, e.g. on the CPU); ``peak_memory_bytes``: its
    own peak of allocated GPU memory (None on the CPU). A side that pays the loader also
    gets ``step_only``: the same figures for its step alone (``plm train`` runs the loader
    in ``data.workers`` processes beside the step; here it runs in this process)."""

    def figures(cost: list[float], wall: list[float]) -> dict[str, Any]:
        flops_per_s = sum(r.flops) / sum(wall)
        return {
            "cost_per_1k_real_tokens": statistics.median(
                c / n * 1e3 for c, n in zip(cost, r.tokens, strict=True)
            ),
            "real_tokens_per_s_wall": sum(r.tokens) / sum(wall),
            "model_flops_per_s": flops_per_s, "mfu": flops_per_s / peak if peak else None,
        }  # fmt: skip

    out = {
        "cost_per_round": r.cost[name], "wall_per_round": r.wall[name],
        **figures(r.cost[name], r.wall[name]), "peak_memory_bytes": memory.peak.get(name),
        "loss_first": side.losses[0], "loss_last": side.losses[-1],
    }  # fmt: skip
    if side.pays_loader:
        out["step_only"] = figures(r.step_cost[name], r.step_wall[name])
    return out


def measure(sides: dict, memory: DeviceMemory, dev, warmup: int, rounds: int,
            peak: float | None) -> tuple[Rounds, dict[str, Any]]:  # fmt: skip
    """``alternate`` over the batches of the first ``Ours`` side's loader (every side trains
    on them; its ``flops`` counts them), then close the sides. Returns the rounds and the
    result fields every bench reports, ``sides`` (``side_report``) among them."""
    first = next(side for side in sides.values() if isinstance(side, Ours))
    load_start = load1()
    r = alternate(sides, iter(first.trainer.stream), warmup, rounds, Clock(dev), memory,
                  first.flops)  # fmt: skip
    result = {
        "device": dev.type, "warmup": warmup, "rounds": rounds,
        "cost_metric": "wall_s" if dev.type == "cuda" else "cpu_s",
        "real_tokens_per_round": r.tokens, "model_flops_per_round": r.flops,
        "loader_cost_per_round": r.loader, "load_start": load_start, "load_end": load1(),
        "sides": {name: side_report(r, name, side, memory, peak) for name, side in sides.items()},
    }  # fmt: skip
    for side in sides.values():
        side.close()
    return r, result


def speedup(r: Rounds, fast: str, slow: str, step_only: bool = False) -> tuple[float, list[float]]:
    """Real tokens per second of ``fast`` over ``slow``: the ratio of their median costs per
    real token, and the range of the per-round ratios; ``step_only``: without the loader."""
    costs = r.step_cost if step_only else r.cost

    def median_per_token(name: str) -> float:
        return statistics.median(c / n for c, n in zip(costs[name], r.tokens, strict=True))

    per_round = [s / f for s, f in zip(costs[slow], costs[fast], strict=True)]
    return median_per_token(slow) / median_per_token(fast), [min(per_round), max(per_round)]


def load1() -> float:
    return os.getloadavg()[0]


def pick_device(name: str):
    """torch.device for --device; on the CPU, CUDA is hidden first (the Trainer picks CUDA
    whenever it sees one)."""
    if name == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def machine_info(dev, precision: str) -> dict[str, Any]:
    """The machine, torch and the device's dense peak FLOP/s for ``precision`` (the
    project's table, pipeline/train/metrics.py; None on the CPU or an unknown GPU)."""
    import torch

    from pipeline.train.metrics import device_peak_flops

    cuda = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if cuda else None
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "device": dev.type, "cuda_device": name, "precision": precision,
        "peak_flops": device_peak_flops(precision, name) if cuda else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }  # fmt: skip


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


# --- the rehearsal cluster's benches (bench_elastic_cluster.py, bench_eval_watch.py) ------

RIG_SUBNETS = ("198.18.0.64/26", "198.18.0.192/26", "198.18.0.128/26", "198.18.0.0/26")


def up_rig(name: str, bench: str, **kwargs):
    """3 rig hosts with a shared folder on a part of 198.18.0.0/24 no other rig here
    uses (a rig of this name left by an earlier run is taken down first)."""
    from pipeline import rig as rigmod

    why = rigmod.check_prerequisites(ssh=kwargs.get("ssh", True))
    if why:
        raise SystemExit(f"plm: {bench}: {why}")
    rigmod.down(name)
    for subnet in RIG_SUBNETS:
        try:
            return rigmod.up(3, name=name, subnet=subnet, shared=True, **kwargs)
        except rigmod.RigError as err:
            if "overlaps" not in str(err):
                raise
    raise SystemExit(f"plm: {bench}: every subnet is taken by another rig")


def rig_env(repo: Path) -> dict[str, str]:
    """What the rig benches' processes run with: the CPU accelerator, one thread, this
    checkout's code."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(repo)}  # fmt: skip


def rig_data(base: Path, env: dict[str, str]) -> Path:
    """The rig benches' data: a 600-document corpus, a 2,000-word WordPiece tokenizer and
    its shards under ``base`` (the shared folder), through the CLI; the data dir."""
    write_corpus(base / "corpus.txt", 600, 12, 3000, 1234)
    for cmd in (
        ["data", "tokenizer", "--input", str(base / "corpus.txt"), "--kind", "wordpiece",
         "--vocab-size", "2000", "--output", str(base / "tok")],
        ["data", "prepare", "--input", str(base / "corpus.txt"), "--tokenizer",
         str(base / "tok"), "--output", str(base / "data"), "--num-cpus", "1"],
    ):  # fmt: skip
        subprocess.run([sys.executable, "-m", "pipeline.cli", *cmd], env=env, check=True,
                       capture_output=True)  # fmt: skip
    return base / "data"
