"""The CPU cost of language ID and the `web` filter preset, side by side in one run.

    python bench/bench_filters.py [--repeat 3] [--prepare]

Corpus: ``builtin:python-docs`` (about 2 MB of English docstrings and reference text,
cleaned as prepare cleans it). Printed, each measured in this process, best of
``--repeat``, the two sides taking turns:
- per stage: CPU seconds of cleaning alone, of language ID (``langid.identify``) and of
  the ``web`` filters (``quality.run_filters``) over every document, and their MB/s;
- with ``--prepare``: the whole ``plm data prepare --num-cpus 1`` on the same corpus
  without filters and with ``configs/data/web.yaml``, the workers' CPU seconds from each
  manifest's ``stats`` (one local Ray each; a tokenizer is trained first).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu() -> float:
    return time.process_time()


def stages(repeat: int) -> None:
    from pipeline.prepare.clean import CleanConfig, clean_many
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.langid import identify
    from pipeline.prepare.quality import run_filters
    from pipeline.prepare.readers import python_docs

    docs = list(python_docs())
    mb = sum(len(d.encode()) for d in docs) / 1e6
    filters = PrepareConfig(inputs=["x"], tokenizer="t", output="o", filters="web").filters
    texts = clean_many(docs, CleanConfig())
    codes = [identify(t) for t in texts]  # warm-up, and the codes the filters see
    sides = {
        "clean": lambda: clean_many(docs, CleanConfig()),
        "language ID": lambda: [identify(t) for t in texts],
        "web filters": lambda: [
            run_filters(t, c, filters) for t, c in zip(texts, codes, strict=True)
        ],
    }
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(repeat):
        for name, run in sides.items():
            started = _cpu()
            run()
            best[name] = min(best[name], _cpu() - started)
    kept = sum(
        run_filters(t, c, filters).text is not None for t, c in zip(texts, codes, strict=True)
    )
    print(
        f"{len(docs):,} documents, {mb:.2f} MB; web filters keep {kept:,}; "
        f"languages: {dict(sorted(__import__('collections').Counter(codes).most_common(4)))}"
    )
    print("| stage | CPU s | MB/s | docs/s |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds:.2f} | {mb / seconds:.1f} | {len(docs) / seconds:,.0f} |")


def prepare_side_by_side() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tok"
        plm = [sys.executable, "-m", "pipeline.cli"]
        subprocess.run([*plm, "data", "tokenizer", "--input", "builtin:python-docs", "--kind",
                        "wordpiece", "--vocab-size", "8000", "--output", str(tok)],
                       check=True, capture_output=True)  # fmt: skip
        print("| prepare (python-docs, --num-cpus 1) | wall s | worker CPU s | documents kept |")
        print("|---|---|---|---|")
        for name, config in (("no filters", "default.yaml"), ("web.yaml", "web.yaml")):
            out = Path(tmp) / name.replace(" ", "-").replace(".", "-")
            subprocess.run([*plm, "data", "prepare", "--config", str(ROOT / "configs/data" / config),
                            "--tokenizer", str(tok), "--output", str(out), "--num-cpus", "1"],
                           check=True, capture_output=True)  # fmt: skip
            m = json.loads((out / "manifest.json").read_text())
            s = m["stats"]
            print(
                f"| {name} | {s['wall_seconds']:.1f} | {s['worker_cpu_seconds']:.1f} | "
                f"{m['totals']['documents_kept']:,} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prepare", action="store_true")
    args = ap.parse_args()
    stages(args.repeat)
    if args.prepare:
        prepare_side_by_side()


if __name__ == "__main__":
    main()
