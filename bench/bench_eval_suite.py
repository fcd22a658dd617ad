"""Does `plm eval` measure what it should, on real text? And what do k Ray workers buy?

1. Pretraining corpus: `builtin:python-docs` without the docstrings of four packages
   (asyncio, email, logging, unittest): no text of the tasks below is ever pretrained on.
2. bert-tiny pretrained with the demo's recipe (MLM, 2500 steps of 32 x 64 tokens),
   a checkpoint every 250 steps; the suite scores random init and the checkpoints of
   steps 250, 1000 and 2500 (``--steps``).
3. Four tasks built from the held-out packages' docstrings (configs/eval/python-docs.yaml),
   each a probe of the frozen model (a head trained on its mean-pooled or per-word
   features):
   - ``topic``: which package a paragraph comes from (the demo's task, 4 classes);
   - ``pair``: do two paragraphs come from the same package (a sentence-pair task);
   - ``segment``: two paragraph openings joined; tag each word with its package (BIO
     tags, ranked by token accuracy);
   - ``share``: 20 words from two groups of packages; regress the first group's share.
   Three seeds each: 4 models x 4 tasks x 3 seeds = 48 cells. ``budget.mode=full``
   fine-tunes every weight instead (BENCHMARKS.md has both).
4. The same suite on a local Ray (one cell per CPU) and in one process (``--no-ray``),
   timed side by side; the tables must be equal.

``--arch gpt2``: gpt2-tiny (byte-level BPE, CLM) on the same corpus, and the zero-shot
suite configs/eval/python-docs-causal.yaml (held-out perplexity, last-word accuracy on the
held-out packages' paragraphs), scored by lm-evaluation-harness.

    python bench/bench_eval_suite.py --workdir runs/bench-eval     # about 10 min, 2 cores
    python bench/bench_eval_suite.py --workdir runs/bench-eval-gpt2 --arch gpt2 --skip-alone
    python bench/bench_eval_suite.py --workdir runs/bench-eval --tag=-long budget.epochs=150

Prints the table and a JSON line (the scores, both wall times, the ratio, the cells' own
seconds on each side). ``key=value`` arguments override the suite (longer cells above).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = ("asyncio", "email", "logging", "unittest")  # pipeline/finetune/demo_task.TOPICS


def pretraining_corpus(out: Path) -> Path:
    """python-docs as jsonl (a document a docstring), without the held-out packages'."""
    from pipeline.prepare.readers import _docs_of_source, _module_files, python_docs

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = set()
    for pkg in HELD_OUT:
        for path in _module_files(stdlib, pkg):
            held.update(d.strip() for d in _docs_of_source(path.read_bytes()) if d.strip())
    docs = [d for d in python_docs() if d not in held]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    print(f"[bench] corpus: {len(docs)} documents ({len(held)} held out) -> {out}", flush=True)
    return out


def _split(text: str) -> str:
    b = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 100
    return "train" if b < 50 else "valid" if b < 70 else "test"


def _paragraphs() -> dict[str, dict[str, list[str]]]:
    from pipeline.finetune.demo_task import topic_paragraphs

    out: dict[str, dict[str, list[str]]] = {}
    for topic in HELD_OUT:
        for p in sorted(topic_paragraphs(topic)):
            out.setdefault(_split(p), {}).setdefault(topic, []).append(p)
    return out


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def pair_task(out: Path, paras, n_train: int = 64, n_test: int = 200) -> None:
    """(A, B, same|different), half of each, A and B never the same paragraph."""
    for split, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        rng, rows = random.Random(seed), []
        for i in range(n):
            x = rng.choice(HELD_OUT)
            y = x if i % 2 == 0 else rng.choice([t for t in HELD_OUT if t != x])
            a, b = rng.sample(paras[split][x], 2) if x == y else (
                rng.choice(paras[split][x]), rng.choice(paras[split][y]))  # fmt: skip
            rows.append({"text": a, "text_pair": b, "label": "same" if x == y else "different"})
        _write(out / f"{split}.jsonl", rows)


def segment_task(out: Path, paras, n_train: int = 48, n_test: int = 150) -> None:
    """The opening words of a paragraph of package X then of one of package Y != X, each
    word tagged B-X / I-X / B-Y / I-Y: where does the topic change, and to what?"""
    for split, n, seed in (("train", n_train, 3), ("test", n_test, 4)):
        rng, rows = random.Random(seed), []
        for _ in range(n):
            x, y = rng.sample(HELD_OUT, 2)
            words, tags = [], []
            for topic in (x, y):
                w = rng.choice(paras[split][topic]).split()[: rng.randint(10, 20)]
                words += w
                tags += [f"B-{topic}"] + [f"I-{topic}"] * (len(w) - 1)
            rows.append({"text": words, "label": tags})
        _write(out / f"{split}.jsonl", rows)


GROUP_A, GROUP_B = ("asyncio", "email"), ("logging", "unittest")


def share_task(out: Path, paras, n_train: int = 80, n_test: int = 200) -> None:
    """20 words: k opening words of an asyncio or email paragraph and 20 - k of a logging
    or unittest one, in either order; the target is the share of the first group's."""
    for split, n, seed in (("train", n_train, 5), ("test", n_test, 6)):
        rng, rows = random.Random(seed), []
        for _ in range(n):
            k = rng.randint(0, 20)
            wa = rng.choice(paras[split][rng.choice(GROUP_A)]).split()[:k]
            wb = rng.choice(paras[split][rng.choice(GROUP_B)]).split()[: 20 - k]
            words = wa + wb if rng.random() < 0.5 else wb + wa
            rows.append({"text": " ".join(words), "label": round(len(wa) / max(1, len(words)), 3)})
        _write(out / f"{split}.jsonl", rows)


def build_tasks(workdir: Path) -> None:
    from pipeline.finetune.demo_task import build_topic_task

    build_topic_task(workdir / "tasks" / "topic")
    paras = _paragraphs()
    pair_task(workdir / "tasks" / "pair", paras)
    segment_task(workdir / "tasks" / "segment", paras)
    share_task(workdir / "tasks" / "share", paras)
    # the zero-shot tasks' text: the held-out packages' test paragraphs, a document a row
    held = [{"text": p} for topic in HELD_OUT for p in paras["test"][topic][:60]]
    _write(workdir / "tasks" / "heldout" / "test.jsonl", held)


RECIPES = {  # the demo's for bert-tiny; the same schedule for gpt2-tiny (CLM, byte-level BPE)
    "bert": ("bert-tiny.yaml", "wordpiece", ["objective.kind=mlm"]),
    "gpt2": ("gpt2-tiny.yaml", "bpe", ["objective.kind=clm", "train.schedule=linear"]),
}


def pretrain(workdir: Path, steps: int, arch: str) -> Path:
    from pipeline.config import CONFIGS_DIR, load_config
    from pipeline.demo import BETAS, LR, MASK_PROBABILITY, VOCAB_SIZE
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.prepare import run_prepare
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer
    from pipeline.train.trainer import train

    run = workdir / "run"
    if (run / "bundles" / "final").is_dir():
        print(f"[bench] pretraining: reusing {run}", flush=True)
        return run
    corpus = pretraining_corpus(workdir / "corpus.jsonl")
    config, kind, objective = RECIPES[arch]
    tok = train_tokenizer([str(corpus)], TokenizerSpec(kind=kind, vocab_size=VOCAB_SIZE),
                          workdir / "tokenizer")  # fmt: skip
    data = run_prepare(PrepareConfig(inputs=[str(corpus)], tokenizer=str(tok),
                                     output=str(workdir / "data"), valid_fraction=0.05,
                                     shard_docs=500, max_doc_tokens=512, num_cpus=2))  # fmt: skip
    mlm = [f"objective.mlm.probability={MASK_PROBABILITY}"] if arch == "bert" else []
    cfg = load_config(CONFIGS_DIR / "test" / config, [
        f"name={arch}-tiny-docs", f"data.path={data}", "data.seq_len=64", *objective, *mlm,
        f"train.max_steps={steps}",
        "train.micro_batch_size=32", f"train.lr={LR}", f"train.betas=[{BETAS[0]}, {BETAS[1]}]",
        f"train.warmup_steps={steps // 10}", "train.log_every=50", "train.eval_every=250",
        "train.eval_batches=4", "train.save_every=250", "train.keep_last=20",
        "train.bundle_every=0", f"train.out_dir={run}", "deepspeed=auto",
        f"mlflow.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
    ])  # fmt: skip
    t0 = time.perf_counter()
    train(cfg)
    print(f"[bench] pretraining: {steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return run


def run_eval(workdir: Path, sources: list[str], ray: bool, suite: Path, tag: str,
             overrides: list[str]) -> dict:  # fmt: skip
    """`plm eval` as a user runs it, in a process of its own; returns the wall time and the
    table's file."""
    store = f"sqlite:///{workdir / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "pipeline.cli", "eval", str(suite), f"work_dir={workdir / tag}",
           "workers.cpus=1", *overrides, "--tracking-uri", store, "--models", *sources]  # fmt: skip
    if not ray:
        cmd.append("--no-ray")
    from pipeline.eval.runner import LAUNCHER_VARIABLES  # this process trained: not its rank

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"plm eval failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    table = [ln for ln in proc.stdout.splitlines() if not ln.startswith("[plm")]
    return {
        "wall_s": wall,
        "table": "\n".join(table[-5:]),
        "csv": str(workdir / tag / "report" / "table.csv"),
    }


def cell_seconds(cells_csv: Path, side: str) -> dict:
    """The cells' own seconds (their sum, the slowest): the rest of the wall is fixed cost."""
    import csv

    seconds = {(r["model"], r["task"], r["seed"]): float(r["seconds"])
               for r in csv.DictReader(open(cells_csv, encoding="utf-8"))}  # fmt: skip
    return {f"{side}_cells_s": round(sum(seconds.values()), 1),
            f"{side}_slowest_cell_s": round(max(seconds.values()), 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="runs/bench-eval")
    ap.add_argument("--pretrain-steps", type=int, default=2500)
    ap.add_argument("--steps", default="250,1000,2500", help="the checkpoints scored")
    ap.add_argument("--arch", choices=sorted(RECIPES), default="bert")
    ap.add_argument("--skip-alone", action="store_true", help="only the Ray run")
    ap.add_argument("--tag", default="", help="suffix of the runs' work dirs")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="of the suite, e.g. "
                    "budget.epochs=150 (longer cells)")  # fmt: skip
    args = ap.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    run = pretrain(workdir, args.pretrain_steps, args.arch)
    build_tasks(workdir)
    name = "python-docs.yaml" if args.arch == "bert" else "python-docs-causal.yaml"
    suite = REPO / "configs" / "eval" / name
    ckpts = [str(run / "checkpoints" / f"step{int(s):08d}") for s in args.steps.split(",")]
    sources = ["random", *ckpts]
    ray = run_eval(workdir, sources, True, suite, f"on-ray{args.tag}", args.overrides)
    print(ray["table"], flush=True)
    out = {"ray_wall_s": round(ray["wall_s"], 1), "cpus": os.cpu_count(), "table": ray["csv"]}
    if not args.skip_alone:
        alone = run_eval(workdir, sources, False, suite, f"one-process{args.tag}", args.overrides)
        same = Path(ray["csv"]).read_text() == Path(alone["csv"]).read_text()
        out |= {"one_process_wall_s": round(alone["wall_s"], 1),
                "speedup": round(alone["wall_s"] / ray["wall_s"], 2), "tables_equal": same}  # fmt: skip
        out |= cell_seconds(Path(ray["csv"]).parent / "cells.csv", "ray")
        out |= cell_seconds(Path(alone["csv"]).parent / "cells.csv", "one_process")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
