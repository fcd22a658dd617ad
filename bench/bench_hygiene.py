"""Near-dedup (and, once merged, the quality filters) against datatrove, in CPU seconds.

    python bench/bench_hygiene.py [--mb 100] [--workers 2] [--workdir /var/tmp/plm-hygiene]
        [--dt-python /tmp/dtvenv/bin/python] [--filters]

datatrove is no dependency: install it in a scratch venv (``python -m venv /tmp/dtvenv &&
/tmp/dtvenv/bin/pip install "datatrove[processing]==0.10.1" spacy``; its English word
tokenizer is spaCy's).

Corpus: ``bench/planted_corpus.py`` (real paragraphs with planted near-duplicates at
known Jaccard similarities), ``--mb`` MB of jsonl in 4 files, generated once into the
work dir (seeded: the same bytes every time).

Measured, each side as a command in a fresh process, CPU seconds of its whole process
tree (``bench_prepare.tree_cpu``: every process's own user + system time):
- ours, ``plm data prepare --num-cpus W`` with ``--near-dedup off`` (today's prepare) and
  ``on``; the added cost of near-dedup is their ratio (goal <= 1.5x), and the manifest's
  ``worker_cpu_seconds_near_dedup`` is near-dedup's own part (signatures, reducers,
  cluster rounds; the fix wave is counted with the exact dedup's);
- datatrove, its MinHash pipeline's 4 stages (``MinhashDedupSignature``, ``...Buckets``,
  ``...Cluster``, ``...Filter``; 5-gram shingles, 14 bands x 8 rows, as ours), its
  ``LocalPipelineExecutor`` with W tasks and W workers (14 bucket tasks, 1 cluster task).
  Our near-dedup's own CPU against its 4 stages is "the same work" (goal <= 1.0x); our
  whole prepare also tokenizes and writes shards, which datatrove does not.

The documents each removes: ours from a replay of the prepare's steps in this process
(clean, exact dedup, ``near_dedup``; its count is checked against the manifest's),
datatrove's from the exclusion writer of its filter stage (the corpus's ``id`` field).
Agreement: the share of documents on which both decide the same (kept or removed).
Against the planted pairs: the share of copies at J >= 0.8 removed (recall) and at
J <= 0.5 (false removals), for both.

``--filters``: datatrove's Gopher quality and C4 filters run first (their own stage,
writing the filtered corpus the 4 MinHash stages read), and ours with the quality
filters of the data config given by ``--our-filters-config`` (the filters of issue 32
part 2: pass the YAML that turns them on once that branch is merged). Removals are then
reported by filter, side by side.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import planted_corpus  # noqa: E402
from bench_prepare import tree_cpu  # noqa: E402

DATATROVE = r"""
import json, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster,
                                      MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

corpus, out, workers, filters = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
times = {}

def run(name, pipeline, tasks, n_workers):
    t = time.perf_counter()
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=n_workers,
                          logging_dir=f"{out}/logs/{name}").run()
    times[name] = round(time.perf_counter() - t, 2)

source, pattern = corpus, "corpus-*.jsonl"
if filters:
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter
    run("filters", [JsonlReader(corpus, glob_pattern=pattern),
                    GopherQualityFilter(exclusion_writer=JsonlWriter(f"{out}/removed/gopher")),
                    C4QualityFilter(exclusion_writer=JsonlWriter(f"{out}/removed/c4")),
                    JsonlWriter(f"{out}/filtered")], workers, workers)
    source, pattern = f"{out}/filtered", "*.jsonl.gz"
run("signatures", [JsonlReader(source, glob_pattern=pattern),
                   MinhashDedupSignature(output_folder=f"{out}/sigs", config=cfg, language="en")],
    workers, workers)
run("buckets", [MinhashDedupBuckets(input_folder=f"{out}/sigs", output_folder=f"{out}/buckets",
                                    config=cfg)], cfg.num_buckets, workers)
run("cluster", [MinhashDedupCluster(input_folder=f"{out}/buckets",
                                    output_folder=f"{out}/remove_ids", config=cfg)], 1, 1)
run("filter", [JsonlReader(source, glob_pattern=pattern),
               MinhashDedupFilter(input_folder=f"{out}/remove_ids",
                                  exclusion_writer=JsonlWriter(f"{out}/removed/minhash")),
               JsonlWriter(f"{out}/kept")], workers, workers)
print(json.dumps(times))
"""


def removed_ids(folder: Path) -> set[int]:
    ids: set[int] = set()
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as stream:
            ids.update(int(json.loads(line)["id"]) for line in stream)
    return ids


def our_removals(corpus: Path) -> tuple[set[int], set[int]]:
    """(exact duplicates, near-duplicates) as global indices: the prepare's steps (clean,
    length filters, exact dedup, near-dedup) replayed in this process."""
    import numpy as np

    from pipeline.prepare import near_dedup as nd
    from pipeline.prepare.clean import CleanConfig, clean_many, dedup_key, reject_reason

    texts = []
    for path in sorted(corpus.glob("corpus-*.jsonl")):
        with path.open(encoding="utf-8") as stream:
            texts.extend(json.loads(line)["text"] for line in stream)
    cfg = CleanConfig()
    cleaned = clean_many(texts, cfg)
    seen: set[bytes] = set()
    exact, keyed, at = set(), [], []
    for i, text in enumerate(cleaned):
        if reject_reason(text, cfg):
            continue
        key = dedup_key(text)
        if key in seen:
            exact.add(i)
            continue
        seen.add(key)
        keyed.append(text)
        at.append(i)
    spec = nd.NearDedupSpec()
    keys, positions = [], []
    for lo in range(0, len(keyed), 256):
        sigs, ok = nd.signatures(keyed[lo : lo + 256], spec)
        keys.append(nd.band_keys(sigs[ok], spec))
        positions.append(np.asarray(at[lo : lo + 256])[ok])
    parts = nd.partition(np.concatenate(keys), np.concatenate(positions), 4)
    removed, _ = nd.components([nd.candidates([0], [p]) for p in parts])
    return exact, set(nd.unpack(removed[:, 0])[1].tolist())


def reasons(folder: Path) -> dict[str, int]:
    """Documents datatrove's exclusion writer wrote, by its ``filter_reason``."""
    from collections import Counter

    found: Counter = Counter()
    for path in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as stream:
            for line in stream:
                found[json.loads(line).get("metadata", {}).get("filter_reason", "?")] += 1
    return dict(found.most_common())


def filter_report(on: dict, dt_out: Path, results: dict, dt_cpu: float, stages) -> dict:
    """--filters: documents removed per filter and rule on each side, and the CPU."""
    rules = on.get("filter_rules", {})
    return {
        "documents": on["totals"]["documents_read"],
        "ours_cpu_filters_and_near_dedup": round(results["on"]["cpu"], 1),
        "ours_cpu_filters_only": round(results["off"]["cpu"], 1),
        "datatrove_cpu_filters_and_minhash": round(dt_cpu, 1),
        "cpu_ratio": round(results["on"]["cpu"] / dt_cpu, 3),
        "datatrove_stage_wall": stages,
        "ours_rejected": on["rejected"],
        "ours_rules": dict(sorted(rules.items(), key=lambda kv: -kv[1])),
        "ours_lines_removed": on.get("lines_removed", {}),
        "ours_kept": on["totals"]["documents_kept"],
        "datatrove_removed": {
            name: reasons(dt_out / "removed" / name) for name in ("gopher", "c4", "minhash")
        },  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/plm-hygiene"))
    parser.add_argument("--dt-python", default="/tmp/dtvenv/bin/python")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--filters", action="store_true", help="Gopher + C4 (see the doc)")
    parser.add_argument("--our-filters-config", help="data config YAML with our filters on")
    args = parser.parse_args()
    if args.filters and not args.our_filters_config:
        raise SystemExit(
            "plm: --filters needs --our-filters-config (a data config with the quality "
            "filters of issue 32 part 2 on; that branch is not merged here)"
        )
    work = args.workdir
    corpus = work / f"corpus-{args.mb:g}mb-seed{args.seed}"
    if not (corpus / "pairs.jsonl").exists():
        t = time.perf_counter()
        docs, pairs = planted_corpus.generate(int(args.mb * 1e6), seed=args.seed)
        planted_corpus.write(corpus, docs, pairs)
        print(f"corpus: {len(docs):,} documents in {time.perf_counter() - t:.0f} s", flush=True)
    pairs = [json.loads(line) for line in (corpus / "pairs.jsonl").open()]
    n_bytes = sum(p.stat().st_size for p in corpus.glob("corpus-*.jsonl"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plm = [sys.executable, "-m", "pipeline.cli"]
    tok = work / "tok"
    if not (tok / "tokenizer.json").exists():
        subprocess.run([*plm, "data", "tokenizer", "--input", str(corpus / "corpus-000.jsonl"),
                        "--kind", "wordpiece",
                        "--vocab-size", "8000", "--sample-docs", "20000", "--output", str(tok)],
                       env=env, check=True, capture_output=True)  # fmt: skip
    results = {}
    for mode in ("off", "on"):
        out = work / f"ours-{mode}"
        inputs = [str(p) for p in sorted(corpus.glob("corpus-*.jsonl"))]  # not pairs.jsonl
        cmd = [*plm, "data", "prepare", "--input", *inputs, "--tokenizer", str(tok),
               "--output", str(out), "--num-cpus", str(args.workers), "--force",
               "--near-dedup", mode]  # fmt: skip
        if args.filters:
            cmd += ["--config", args.our_filters_config]
        wall, cpu, _ = tree_cpu(cmd, env)
        manifest = json.loads((out / "manifest.json").read_text())
        results[mode] = {"wall": wall, "cpu": cpu, "manifest": manifest}
        print(f"ours near-dedup {mode}: {cpu:.1f} CPU s, {wall:.1f} s wall", flush=True)
    dt_out = work / "datatrove"
    subprocess.run(["rm", "-rf", str(dt_out)], check=True)
    wall, cpu, stdout = tree_cpu(
        [args.dt_python, "-c", DATATROVE, str(corpus), str(dt_out), str(args.workers),
         "1" if args.filters else "0"], {**os.environ, "PYTHONPATH": ""}
    )  # fmt: skip
    stages = json.loads(stdout.strip().splitlines()[-1])
    print(f"datatrove: {cpu:.1f} CPU s, {wall:.1f} s wall, stages {stages}", flush=True)

    on = results["on"]["manifest"]
    if args.filters:  # the filters' side by side (the replay below knows no filters)
        print(json.dumps(filter_report(on, dt_out, results, cpu, stages), indent=1))
        return
    exact, near = our_removals(corpus)
    assert len(near) == on["rejected"].get("near_duplicate", 0), "replay != prepare"
    assert len(exact) == on["rejected"].get("duplicate", 0), "replay != prepare"
    ours = exact | near
    theirs = removed_ids(dt_out / "removed" / "minhash")
    n_docs = on["totals"]["documents_read"]
    agree = 1 - len(ours ^ theirs) / n_docs

    def planted(removed: set[int]) -> tuple[float, float, int, int]:
        high = [p for p in pairs if p["jaccard"] >= 0.8]
        low = [p for p in pairs if p["jaccard"] <= 0.5]
        return (sum(p["copy"] in removed for p in high) / len(high),
                sum(p["copy"] in removed for p in low) / len(low), len(high), len(low))  # fmt: skip

    near_cpu = on["stats"]["worker_cpu_seconds_near_dedup"]
    report = {
        "corpus_mb": round(n_bytes / 1e6, 1),
        "documents": n_docs,
        "workers": args.workers,
        "ours_off_cpu": round(results["off"]["cpu"], 1),
        "ours_on_cpu": round(results["on"]["cpu"], 1),
        "ours_near_dedup_cpu": near_cpu,
        "added_cost": round(results["on"]["cpu"] / results["off"]["cpu"], 3),
        "datatrove_cpu": round(cpu, 1),
        "datatrove_stage_wall": stages,
        "near_dedup_vs_datatrove": round(near_cpu / cpu, 3),
        "prepare_on_vs_datatrove": round(results["on"]["cpu"] / cpu, 3),
        "removed_ours": {"duplicate": len(exact), "near_duplicate": len(near)},
        "removed_datatrove_minhash": len(theirs),
        "removed_both": len(ours & theirs),
        "agreement_share_of_documents": round(agree, 5),
        "planted_ours": planted(ours),
        "planted_datatrove": planted(theirs),
        "ours_rejected": on["rejected"],
    }
    if args.filters:
        report["removed_datatrove_filters"] = {
            name: len(removed_ids(dt_out / "removed" / name)) for name in ("gopher", "c4")
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
