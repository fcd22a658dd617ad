"""Throughput of `plm data prepare` vs the same tokenizer's raw `encode_batch`, at 1 and 2 CPUs.

    python bench/bench_prepare.py [--copies K] [--join J] [--rounds R] [--no-stage]
                                  [--no-raw] [--pin] [--stage-only] [--workdir DIR]

Corpus: builtin:python-docs (about 1.7 MB), or --copies K variants of it written to a
txt file (each document prefixed with its copy number, so dedup keeps them all), every
--join J consecutive documents made one (article-length documents). Both sides get the
same documents; MB/s counts raw UTF-8 text in.

- raw: one process, tokenizer loaded, `encode_batch(all documents)` timed alone, with
  RAYON_NUM_THREADS=N (its Rust thread pool is the parallelism). Also printed, as other
  references: `encode_batch_fast` (no offsets) over all documents, and `encode_batch` in
  calls of 256 documents (as the actors take them; one call over everything holds every
  Encoding at once, gigabytes at 170 MB). --no-raw skips them: only prepare at each CPU
  count and the 2-vs-1-CPU scaling (corpora where raw's three runs take too long).
- --pin confines each run to N cores (sched_setaffinity, inherited by every process the
  run starts): without it, `--num-cpus 1` gives Ray one CPU for the actors while the
  driver and Ray's own processes use the machine's other core, which raw never gets.
- prepare: the whole `plm data prepare --num-cpus N --force` command as a user runs it
  (process start, validation, hashing, local Ray start, the job, manifest, Ray stop),
  and the pipeline part alone as the command reports it (after Ray is up, before it
  stops). With --rounds R the CPU counts take turns R times and the ratios are medians
  of per-round ratios.
- stage: the actors' work without Ray, in one process, one thread: `Encoder` (clean,
  segment, encode_batch, serialize) over the same documents in batches of 256, CPU
  seconds against raw `encode_batch` CPU seconds, and its parts one by one (medians of
  5 rounds run round-robin). The ceiling of prepare/raw at one CPU were Ray free. It
  runs after the timed runs; --no-stage skips it.
Peak memory: the largest sum of RSS over the process tree (driver + Ray processes),
sampled every 0.1 s, and the driver's own peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

RAW = r"""
import json, os, resource, sys, time
from pipeline.data.tokenizer import load_tokenizer
texts = json.load(open(sys.argv[2]))
tok, _ = load_tokenizer(sys.argv[1])
t, c = time.perf_counter(), time.process_time()
enc = tok.encode_batch(texts, add_special_tokens=False)
seconds, cpu = time.perf_counter() - t, time.process_time() - c
tokens = sum(len(e.ids) for e in enc)
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
del enc
t = time.perf_counter()  # the same without offsets (what prepare's WordPiece path calls)
tok.encode_batch_fast(texts, add_special_tokens=False)
fast_seconds = time.perf_counter() - t
t = time.perf_counter()  # 256 documents per call, as prepare's actors take them
for i in range(0, len(texts), 256):
    tok.encode_batch(texts[i : i + 256], add_special_tokens=False)
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens, "rss_mb": rss_mb,
                  "fast_seconds": fast_seconds, "batched_seconds": time.perf_counter() - t}))
"""

STAGE = r"""
import json, os, statistics, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"
import numpy as np
from pipeline.data import segment
from pipeline.data.clean import CleanConfig, clean, dedup_key, reject_reason
from pipeline.data.prepare import Encoder, _language
from pipeline.data.shards import Document, sample_record, split_of, token_dtype
from pipeline.data.tokenizer import load_tokenizer
texts = json.load(open(sys.argv[2]))
tok, meta = load_tokenizer(sys.argv[1])
enc = Encoder(sys.argv[1], ["0" * 16], ["bench"], {}, 0.02, 1024)
n = len(texts)
batch = {"source": np.zeros(n, np.int32), "ordinal": np.arange(n), "line": np.zeros(n, np.int64),
         "text": np.array(texts, dtype=object), "reject": np.array([""] * n, dtype=object),
         "detail": np.array([""] * n, dtype=object)}
cfg = CleanConfig()
kept = [(c, _language(c)) for c in (clean(t, cfg) for t in texts) if reject_reason(c, cfg) is None]
docs, langs = [t for t, _ in kept], [g for _, g in kept]
batches = [slice(i, i + 256) for i in range(0, len(docs), 256)]  # as the actor gets them
seg = segment.Segmenter(tok, 1024)
dtype = token_dtype(meta["vocab_size"])
def segmentation():
    return [p for b in batches for p in seg(docs[b], langs[b])]
pieces = segmentation()
marked_docs = [segment.mark_sentence_ends(t)[0] for t in docs]
def encode_marked():  # each batch's Encodings dropped before the next, as in the actor
    for b in batches:
        (seg.marking or tok).encode_batch_fast(marked_docs[b], add_special_tokens=False)
def serialize():
    for t, g, ps in zip(docs, langs, pieces):
        dedup_key(t), split_of(t, 0.02)
        for k, p in enumerate(ps):
            meta = {"source": "bench", "language": g, "n_tokens": p.n_tokens}
            sample_record(Document(key=f"{'0' * 16}-{k:010d}-0000", tokens=p.tokens,
                                   sents=p.sents, words=p.words, meta=meta), dtype)
# The whole Encoder, raw encode_batch, and the Encoder's parts one at a time on the same
# documents, measured round-robin (this VM's speed drifts), medians of 5 rounds.
timed = {
    "raw": lambda: tok.encode_batch(texts, add_special_tokens=False),
    "raw_fast": lambda: tok.encode_batch_fast(texts, add_special_tokens=False),
    "stage": lambda: [enc({k: v[i : i + 256] for k, v in batch.items()}) for i in range(0, n, 256)],
    "clean + filter + language": lambda: [
        reject_reason(c, cfg) or _language(c) for c in (clean(t, cfg) for t in texts)],
    "Segmenter (256 per call)": segmentation,
    "  sentence_ends (regex) + marks": lambda: [segment.mark_sentence_ends(t) for t in docs],
    "  encode_batch_fast (marked, 256 per call)": encode_marked,
    "dedup key + split + sample_record": serialize,
}
runs = {k: [] for k in timed}
for _ in range(5):
    for k, f in timed.items():
        c = time.process_time(); f(); runs[k].append(time.process_time() - c)
med = {k: statistics.median(v) for k, v in runs.items()}
ratio = statistics.median(r / s for r, s in zip(runs["raw"], runs["stage"]))
ratio_fast = statistics.median(r / s for r, s in zip(runs["raw_fast"], runs["stage"]))
print(json.dumps({"raw_cpu": med.pop("raw"), "stage_cpu": med.pop("stage"), "ratio": ratio,
                  "raw_fast_cpu": med.pop("raw_fast"), "ratio_fast": ratio_fast,
                  "parts": med, "tokens": int(sum(len(p.tokens) for ps in pieces for p in ps))}))
"""


def documents(copies: int, join: int = 1) -> list[str]:
    """python-docs, ``copies`` times (each copy's documents prefixed with its number, so
    dedup keeps them), every ``join`` consecutive documents made one (longer documents:
    python-docs averages ~590 characters, web pages and articles several thousand)."""
    from pipeline.data.readers import python_docs

    docs = list(python_docs())
    if copies > 1:
        docs = [f"[copy {k}] {d}" for k in range(copies) for d in docs]
    if join > 1:
        docs = ["\n".join(docs[i : i + join]) for i in range(0, len(docs), join)]
    return docs


def run_stage(tok: Path, texts_json: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STAGE, str(tok), str(texts_json)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def pinned_to(cpus: int | None):
    """A preexec_fn that confines a process and its children to the first ``cpus`` cores
    (None: no confinement)."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, set(range(cpus)))


def run_raw(tok: Path, texts_json: Path, cpus: int, pin_cpus: int | None = None) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": str(cpus), "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run(
        [sys.executable, "-c", RAW, str(tok), str(texts_json)],
        env=env,
        preexec_fn=pinned_to(pin_cpus),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_prepare(cmd: list[str], pin_cpus: int | None = None) -> dict:
    start = time.perf_counter()
    proc = psutil.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=pinned_to(pin_cpus),
    )
    peak_tree = peak_driver = 0
    cpu: dict[int, float] = {}  # pid -> last seen user+system CPU seconds
    names: dict[int, str] = {}
    while proc.poll() is None:
        try:
            tree = [proc, *proc.children(recursive=True)]
            rss = 0
            for p in tree:
                try:
                    rss += p.memory_info().rss
                    times = p.cpu_times()
                    cpu[p.pid] = times.user + times.system
                    names.setdefault(p.pid, " ".join(p.cmdline()[:2])[-60:] or p.name())
                except psutil.Error:
                    pass
            peak_tree = max(peak_tree, rss)
            peak_driver = max(peak_driver, proc.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    stdout = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{stdout}")
    pipeline = float(re.search(r"pipeline ([\d.]+)s", stdout).group(1))
    return {
        "seconds": seconds,
        "pipeline_seconds": pipeline,
        "cpu_seconds": sum(cpu.values()),
        "cpu_top": sorted(((v, names.get(k, "?")) for k, v in cpu.items()), reverse=True)[:6],
        "tree_mb": peak_tree / 2**20,
        "driver_mb": peak_driver / 2**20,
        "stdout": stdout.strip(),
    }


def print_stage(stage: dict) -> None:
    print(f"stage in one process (CPU s, median of 5): raw encode_batch {stage['raw_cpu']:.2f}, "
          f"Encoder {stage['stage_cpu']:.2f} -> {stage['ratio']:.2f}x "
          f"(the ceiling of prepare/raw at 1 CPU); raw encode_batch_fast (no offsets) "
          f"{stage['raw_fast_cpu']:.2f} -> {stage['ratio_fast']:.2f}x")  # fmt: skip
    top = {k: v for k, v in stage["parts"].items() if not k.startswith(" ")}
    rest = stage["stage_cpu"] - sum(top.values())
    print(f"  the Encoder's parts (CPU s, and per CPU s of raw encode_batch), "
          f"{stage['tokens']:,} tokens:")  # fmt: skip
    for name, seconds in [*stage["parts"].items(), ("the rest (batch glue, packing)", rest)]:
        print(f"  {name:48s} {seconds:6.3f}  {seconds / stage['raw_cpu']:5.2f}")


def print_run(cpus: int, mb: float, raw: dict | None, prep: dict, tokens: int) -> None:
    print(f"\n--- {cpus} CPU(s), load average {os.getloadavg()[0]:.1f}")
    if raw is not None:
        print(f"raw encode_batch   {raw['seconds']:7.2f}s  {mb / raw['seconds']:6.2f} MB/s  "
              f"{raw['tokens'] / raw['seconds']:>10,.0f} tok/s  peak {raw['rss_mb']:.0f} MB")  # fmt: skip
    print(f"prepare (command)  {prep['seconds']:7.2f}s  {mb / prep['seconds']:6.2f} MB/s  "
          f"{tokens / prep['seconds']:>10,.0f} tok/s  "
          f"peak tree {prep['tree_mb']:.0f} MB, driver {prep['driver_mb']:.0f} MB")  # fmt: skip
    print(f"prepare (pipeline) {prep['pipeline_seconds']:7.2f}s  "
          f"{mb / prep['pipeline_seconds']:6.2f} MB/s  "
          f"{tokens / prep['pipeline_seconds']:>10,.0f} tok/s")  # fmt: skip
    raw_cpu = "" if raw is None else f"raw {raw['cpu_seconds']:.2f}  "
    print(f"CPU seconds        {raw_cpu}prepare tree {prep['cpu_seconds']:.2f} "
          f"(all processes: driver, Ray's own, workers)")  # fmt: skip
    print("  CPU by process: " + "; ".join(f"{n} {v:.1f}s" for v, n in prep["cpu_top"]))
    if raw is not None:
        print(f"ratio prepare/raw: command {raw['seconds'] / prep['seconds']:.2f}x, "
              f"pipeline {raw['seconds'] / prep['pipeline_seconds']:.2f}x (target >= 0.8x); "
              f"against encode_batch_fast {raw['fast_seconds']:.2f}s: "
              f"pipeline {raw['fast_seconds'] / prep['pipeline_seconds']:.2f}x; against "
              f"encode_batch of 256 documents per call {raw['batched_seconds']:.2f}s: "
              f"pipeline {raw['batched_seconds'] / prep['pipeline_seconds']:.2f}x")  # fmt: skip
    print(f"  {prep['stdout'].splitlines()[-1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--workdir", default=tempfile.mkdtemp(prefix="bench-prepare-"))
    parser.add_argument("--join", type=int, default=1, help="join K documents into one")
    parser.add_argument("--cpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat the raw/prepare runs, CPU counts in turn"
    )
    parser.add_argument(
        "--stage-only",
        action="store_true",
        help="only the in-process stage vs raw CPU seconds (robust on a loaded machine)",
    )
    parser.add_argument(
        "--no-stage", action="store_true", help="skip the in-process stage (large corpora)"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="confine each run (prepare with all of Ray's processes, raw) to N cores",
    )
    parser.add_argument(
        "--no-raw",
        action="store_true",
        help="prepare only: the 2-vs-1-CPU scaling without the raw references (large corpora)",
    )
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tok = work / "tok-wordpiece-8k"
    if not (tok / "tokenizer.json").is_file():
        subprocess.run(
            [
                "plm",
                "data",
                "tokenizer",
                "--input",
                "builtin:python-docs",
                "--kind",
                "wordpiece",
                "--vocab-size",
                "8000",
                "--output",
                str(tok),
            ],  # fmt: skip
            check=True,
            capture_output=True,
        )
    texts = documents(args.copies, args.join)
    texts_json = work / "texts.json"
    texts_json.write_text(json.dumps(texts))
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    if args.copies == 1 and args.join == 1:
        source = "builtin:python-docs"
    else:
        corpus = work / f"python-docs-x{args.copies}-join{args.join}.txt"
        # Documents may hold blank lines; the txt reader splits on them, so join each
        # document's paragraphs with single newlines (the same text, one document each).
        corpus.write_text("\n\n".join(re.sub(r"\n\s*\n", "\n", t) for t in texts) + "\n")
        source = str(corpus)
    print(f"corpus {source}: {len(texts):,} documents, {mb:.2f} MB; machine: "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    if args.stage_only:
        print_stage(run_stage(tok, texts_json))
        return 0
    # This VM's speed drifts by tens of percent over minutes: the CPU counts take turns
    # within a round, and the ratios are medians of per-round ratios (neighbouring runs).
    runs: dict[int, list[tuple[dict, dict]]] = {cpus: [] for cpus in args.cpus}
    for _ in range(args.rounds):
        for cpus in args.cpus:
            pin_cpus = cpus if args.pin else None
            raw = None if args.no_raw else run_raw(tok, texts_json, cpus, pin_cpus)
            cmd = ["plm", "data", "prepare", "--input", source, "--tokenizer", str(tok),
                   "--output", str(work / f"data-{cpus}"), "--num-cpus", str(cpus),
                   "--shard-docs", "1000", "--force"]  # fmt: skip
            prep = run_prepare(cmd, pin_cpus)
            tokens = json.loads((work / f"data-{cpus}" / "manifest.json").read_text())["totals"]
            print_run(cpus, mb, raw, prep, tokens["n_tokens"])
            runs[cpus].append((raw, prep))
    print(f"\nmedians over {args.rounds} round(s):")
    if not args.no_raw:  # the ratios to raw need raw
        for cpus, pairs in runs.items():
            pipeline = statistics.median(r["seconds"] / p["pipeline_seconds"] for r, p in pairs)
            command = statistics.median(r["seconds"] / p["seconds"] for r, p in pairs)
            batched = statistics.median(
                r["batched_seconds"] / p["pipeline_seconds"] for r, p in pairs
            )
            print(f"  {cpus} CPU(s): prepare/raw pipeline {pipeline:.2f}x, command {command:.2f}x "
                  f"(target >= 0.8x); pipeline against raw in calls of 256 documents "
                  f"{batched:.2f}x")  # fmt: skip
    if 1 in runs and 2 in runs:
        rounds = list(zip(runs[1], runs[2], strict=True))
        scaling = {
            "pipeline": [
                p1["pipeline_seconds"] / p2["pipeline_seconds"] for (_, p1), (_, p2) in rounds
            ],
            "command": [p1["seconds"] / p2["seconds"] for (_, p1), (_, p2) in rounds],
        }
        if not args.no_raw:
            scaling["raw"] = [r1["seconds"] / r2["seconds"] for (r1, _), (r2, _) in rounds]
        for label, ratios in scaling.items():
            print(f"  scaling 2 vs 1 CPU, {label}: {statistics.median(ratios):.2f}x "
                  f"(per round: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 1.7x)")  # fmt: skip
    if not args.no_stage:  # last: its big in-process run must not disturb the runs above
        print()
        print_stage(run_stage(tok, texts_json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
