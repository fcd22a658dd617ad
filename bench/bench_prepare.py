"""`plm data prepare` at scale, in CPU seconds, side by side in one run.

    python bench/bench_prepare.py [--mb 200] [--num-cpus 2] [--workdir DIR] [--keep]

A 2-core machine's wall clock cannot show how a job scales across nodes; CPU seconds
can: what the job costs per MB of input, and how much of it is the driver's (the part
that does not spread over more nodes).

Corpus: ``--mb`` MB of jsonl, one file, documents of ~300 bytes (seeded random
sentences over a 5,000-word vocabulary, each document distinct), so one big file must
be cut into byte ranges for several tasks, and Ray's fixed start-up is amortised.

Printed, each measured in this run:
- raw: one process, the same tokenizer, ``encode_batch`` over all documents in calls of
  256 (RAYON_NUM_THREADS=1), CPU seconds of the calls alone.
- hf datasets (only when ``--hf-python`` has the ``datasets`` package; it is no dependency):
  ``load_dataset("json")``, ``map(tokenize, batched)``, ``save_to_disk``, CPU seconds of
  its process.
- prepare: the whole `plm data prepare --num-cpus N` command as a user runs it, CPU
  seconds of its whole process tree (driver, Ray's own processes, workers; each one's
  own time, sampled every 0.05 s, see ``tree_cpu``), the driver's own CPU from the manifest's ``stats``, bytes on
  disk (shards + indexes) against the token ids' bytes (n_tokens x itemsize).
- start-up: a data dir 1x and 8x as large (the second made by listing every shard
  eight times in a copy of the manifest: the same files, eight times the documents for
  the loader), the time from nothing to the first batch of `PretrainStream` (mlm+nsp,
  seq 128) in a fresh process (imports included), median of 7, the two taking turns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

RAW = r"""
import json, os, sys, time
os.environ["RAYON_NUM_THREADS"] = "1"
from pipeline.prepare.tokenizer import load_tokenizer
tok, _ = load_tokenizer(sys.argv[1])
texts = [json.loads(line)["text"] for line in open(sys.argv[2], encoding="utf-8")]
c = time.process_time()
tokens = 0
for i in range(0, len(texts), 256):
    tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i : i + 256], add_special_tokens=False))
print(json.dumps({"cpu_seconds": time.process_time() - c, "tokens": tokens}))
"""

HF = r"""
import os, sys, json, time
os.environ["RAYON_NUM_THREADS"] = "1"
c = time.process_time()
from datasets import load_dataset
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
ds = load_dataset("json", data_files=sys.argv[2], split="train")
ds = ds.map(lambda b: {"ids": [e.ids for e in tok.encode_batch(b["text"], add_special_tokens=False)]},
            batched=True, batch_size=256, remove_columns=["text"])
ds.save_to_disk(sys.argv[3])
print(json.dumps({"cpu_seconds": time.process_time() - c}))
"""

STARTUP = r"""
import sys, time
t = time.perf_counter()
import json
from pipeline.config import ObjectiveSection
from pipeline.loader.stream import PretrainStream
from pipeline.objectives import build_objective
meta = json.load(open(sys.argv[2]))
obj = build_objective(ObjectiveSection(kind="mlm+nsp"), meta["roles"], meta["vocab_size"], 128)
s = PretrainStream(sys.argv[1], "train", obj, micro_batch_size=32, seed=1)
next(iter(s))
print(time.perf_counter() - t)
"""

WORDS = None


def make_corpus(path: Path, mb: int, seed: int = 0) -> int:
    """~300-byte documents of random sentences; returns the number of documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(5000)]
    vocab = np.array(vocab)
    target, written, n = mb * 1_000_000, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            ids = rng.integers(0, len(vocab), (4096, 48))
            lines = []
            for row in ids:
                words = vocab[row].tolist()
                text = (
                    " ".join(words[:16]).capitalize() + ". " + " ".join(words[16:32]).capitalize()
                    + ". " + " ".join(words[32:]).capitalize() + f". Doc {n}."
                )  # fmt: skip
                lines.append(json.dumps({"text": text}) + "\n")
                n += 1
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk.encode())
    return n


def make_tokenizer(corpus: Path, work: Path, env: dict) -> Path:
    """A WordPiece tokenizer (8,000 words) trained on the corpus' first 20,000 documents."""
    tok, sample = work / "tok", work / "sample.txt"
    with open(corpus, encoding="utf-8") as f, open(sample, "w", encoding="utf-8") as g:
        for i, line in enumerate(f):
            if i >= 20_000:
                break
            g.write(json.loads(line)["text"] + "\n\n")
    subprocess.run(["plm", "data", "tokenizer", "--input", str(sample), "--kind", "wordpiece",
                    "--vocab-size", "8000", "--output", str(tok)], check=True, env=env,
                   capture_output=True)  # fmt: skip
    return tok


def tree_cpu(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the whole process tree, stdout).

    Each process's own user + system time, sampled every 0.05 s, its last sample kept:
    what a process spends after its last sample is missed (under 0.05 s of CPU each).
    Its ``children_*`` times are not added: they repeat those of its exited children,
    already sampled. (``RUSAGE_CHILDREN`` with a subreaper cannot replace the sampling:
    it saw 4 of about 28 CPU s, as a raylet that ignores SIGCHLD reaps without accounting.)
    """
    start = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cpu: dict[int, float] = {}
    while proc.poll() is None:
        try:
            for p in [proc, *proc.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{err[-3000:]}")
    return time.perf_counter() - start, sum(cpu.values()), out


def eight_times(src: Path, dst: Path) -> None:
    """A data dir listing every shard of ``src`` eight times (copies of the files)."""
    dst.mkdir()
    shutil.copytree(src / "tokenizer", dst / "tokenizer")
    manifest = json.loads((src / "manifest.json").read_text())
    for split, info in manifest["splits"].items():
        (dst / split).mkdir()
        entries = []
        for _ in range(8):
            for e in info["shards"]:
                n = len(entries)
                name, index = f"{split}/shard-{n:06d}.tar", f"{split}/shard-{n:06d}.idx.npy"
                os.link(src / e["name"], dst / name)
                os.link(src / e["index"], dst / index)
                entries.append({**e, "name": name, "index": index})
        info["shards"] = entries
        info["n_docs"] *= 8
        info["n_tokens"] *= 8
    (dst / "manifest.json").write_text(json.dumps(manifest))


def startup(dirs: list[Path], rounds: int = 7) -> list[float]:
    """Median seconds to the first batch per data dir; the dirs take turns round by round,
    so a change in the machine's load hits them alike."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times: list[list[float]] = [[] for _ in dirs]
    for _ in range(rounds):
        for data, mine in zip(dirs, times, strict=True):
            meta = data / "tokenizer" / "tokenizer_meta.json"
            out = subprocess.run([sys.executable, "-c", STARTUP, str(data), str(meta)], env=env,
                                 capture_output=True, text=True, check=True)  # fmt: skip
            mine.append(float(out.stdout.strip().splitlines()[-1]))
    return [statistics.median(mine) for mine in times]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--hf-python",
        default=sys.executable,
        help="interpreter with `datasets` installed (it is no dependency of plm), e.g. a venv "
        "made with --system-site-packages plus `pip install datasets`",
    )
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    n_docs = make_corpus(corpus, args.mb)
    mb = corpus.stat().st_size / 1e6
    print(f"corpus: {mb:.1f} MB, {n_docs:,} documents of ~{corpus.stat().st_size / n_docs:.0f} B")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tok = make_tokenizer(corpus, work, env)

    raw = json.loads(subprocess.run([sys.executable, "-c", RAW, str(tok), str(corpus)], env=env,
                     capture_output=True, text=True, check=True).stdout.splitlines()[-1])  # fmt: skip
    print(f"raw encode_batch:   {raw['cpu_seconds']:8.1f} CPU s  ({raw['tokens']:,} tokens)")

    hf = None
    has_datasets = subprocess.run([args.hf_python, "-c", "import datasets"], capture_output=True)
    if has_datasets.returncode == 0:
        out = subprocess.run([args.hf_python, "-c", HF, str(tok / "tokenizer.json"), str(corpus),
                              str(work / "hf")], env=env, capture_output=True, text=True,
                             check=True)  # fmt: skip
        hf = json.loads(out.stdout.splitlines()[-1])
        print(f"hf datasets:        {hf['cpu_seconds']:8.1f} CPU s")
    else:
        print(f"hf datasets:        not measured ({args.hf_python} has no `datasets` package)")

    data = work / "data"
    cmd = ["plm", "data", "prepare", "--input", str(corpus), "--tokenizer", str(tok),
           "--output", str(data), "--num-cpus", str(args.num_cpus), "--force"]  # fmt: skip
    wall, cpu, _ = tree_cpu(cmd, env)
    m = json.loads((data / "manifest.json").read_text())
    st = m["stats"]
    itemsize = 2 if m["token_dtype"] == "uint16" else 4
    index_bytes = sum((data / e["index"]).stat().st_size
                      for info in m["splits"].values() for e in info["shards"])  # fmt: skip
    on_disk = m["totals"]["bytes"] + index_bytes
    token_bytes = m["totals"]["n_tokens"] * itemsize
    print(f"prepare:            {cpu:8.1f} CPU s (whole tree), {wall:.1f} s wall, "
          f"{st['units']} units, {m['totals']['n_shards']} shards")  # fmt: skip
    print(f"  driver {st['driver_cpu_seconds']:.2f} CPU s (Ray's import and start "
          f"{st['driver_cpu_seconds_ray_start']:.2f}), workers' tasks "
          f"{st['worker_cpu_seconds']:.1f} CPU s (dedup reducers + rewrites "
          f"{st['worker_cpu_seconds_dedup']:.1f}, {st['units_rewritten_for_duplicates']} "
          "units rewritten)")  # fmt: skip
    print("ratios (goal):")
    print(f"  prepare CPU / raw encode_batch CPU   {cpu / raw['cpu_seconds']:6.2f}  (<= 1.5)")
    if hf:
        print(f"  prepare CPU / hf datasets CPU        {cpu / hf['cpu_seconds']:6.2f}  (<= 1.0)")
    own = st["driver_cpu_seconds"] - st["driver_cpu_seconds_ray_start"]
    print(
        f"  driver CPU / total CPU               {st['driver_cpu_seconds'] / cpu:6.3f}  (<= 0.03)"
    )
    print(f"    without Ray's import and start     {own / cpu:6.3f}")
    print(f"  bytes on disk / token bytes          {on_disk / token_bytes:6.3f}  (<= 1.3)")
    big = work / "data8"
    if big.exists():
        shutil.rmtree(big)
    eight_times(data, big)
    t1, t8 = startup([data, big])
    print(f"  first batch, 8x data / 1x data       {t8 / t1:6.2f}  (<= 1.1)  "
          f"({t1:.2f} s vs {t8:.2f} s)")  # fmt: skip
    if not args.keep and not args.workdir:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
