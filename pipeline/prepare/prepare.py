"""`plm data prepare`, the driver: validate, plan, run the Ray job, write the manifest.

    validate (before Ray starts)  ->  plan units of work (``job.plan_units``)
    ->  the Ray job (``job.run_job``: dedup keys, dedup, workers write their shards)
    ->  name the parts ``shard-NNNNNN`` in source order  ->  manifest.json, last

The driver never sees a document: it plans, renames and counts, so its work and memory
grow with the number of units and shards. Output (any pyarrow filesystem URI, or a
local path) is byte-identical whatever the number of CPUs, workers or nodes.

Idempotence: the manifest records a fingerprint of (sources' size and modification
time, tokenizer sha256, output-relevant config, code version); the same fingerprint
means "up to date". The driver never reads a source's bytes: the write tasks hash the
slices they read, and the manifest lists those sha256 per source (its ``digests``). The
manifest is removed before a rebuild starts and written last, so a run killed half-way
leaves a folder without manifest that the next run cleans and completes. What is done
to the output folder itself (listing, foreign files, atomic writes, renames): store.py.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TOKENIZER_DIR,
    manifest_bytes,
    token_dtype,
)
from pipeline.errors import ConfigError
from pipeline.output import disk_full, no_space
from pipeline.prepare.config import (
    MAX_REJECT_EXAMPLES,
    PREPARE_VERSION,
    PrepareConfig,
    _sha256_json,
    load_entities,
)
from pipeline.prepare.readers import (
    ENCODING_HINT,
    Digest,
    InputError,
    Source,
    _open_text_stream,
    hash_docs,
    hash_range,
    python_docs,
    resolve_inputs,
)
from pipeline.prepare.store import (
    PrepareError,
    clear_own_files,
    existing_manifest,
    foreign_files,
    name_shards,
    output_fs,
    restore,
    snapshot,
    write_file,
)
from pipeline.prepare.tokenizer import (
    META_FILE,
    TOKENIZER_FILE,
    check_tokenizer_folder,
    tokenizer_files,
)
from pipeline.storage import check_store, is_uri


def _source_entries(sources: list[Source]) -> list[dict[str, Any]]:
    """The sources as the manifest lists them, before the job adds their digests. What
    identifies a file is its size and modification time (as ``make`` and ``rsync`` do):
    a listing, never a read. Only a source without a modification time (builtin:python-
    docs, or a filesystem that reports none) is identified by its content, hashed here."""
    entries = []
    for s in sources:
        entry = {"uri": s.uri, "format": s.format, "size": s.size, "mtime_ns": s.mtime_ns}
        if s.mtime_ns is None:
            digest = Digest()
            if s.format == "builtin":
                hash_docs(python_docs(), digest)
            else:
                hash_range(s, 0, None, digest)
            entry["sha256"] = digest.hexdigest()
        entries.append(entry)
    return entries


def fingerprint(config_hash: str, sources: list[dict[str, Any]], tokenizer_sha: str) -> str:
    return _sha256_json(
        {
            "format_version": FORMAT_VERSION,
            "prepare_version": PREPARE_VERSION,
            "data_config_hash": config_hash,
            "sources": [(s["uri"], s["size"], s["mtime_ns"], s.get("sha256")) for s in sources],
            "tokenizer": tokenizer_sha,
        }
    )


def _digests(results, n_sources: int) -> list[list[dict[str, Any]]]:
    """Per source, the sha256 of each slice the tasks read, in byte order: the ranges tile
    the file, and a file read whole has one whose sha256 is the file's."""
    found: list[list[tuple[int, int, str]]] = [[] for _ in range(n_sources)]
    for result in results:
        for source, start, end, sha in result.digests:
            found[source].append((start, end, sha))
    return [
        [{"bytes": [start, end], "sha256": sha} for start, end, sha in sorted(ranges)]
        for ranges in found
    ]


# ---------------------------------------------------------------------------
# The job


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_prepare(cfg: PrepareConfig) -> Path | str:
    """Validate, then (unless up to date) run the Ray job and write the data dir.
    Returns the data dir: a Path for a local output, else the URI."""
    import pyarrow.fs as pafs

    cpu_started, started = _cpu_seconds(), time.perf_counter()
    # 1. Validate everything before Ray starts.
    for item in cfg.inputs:  # a URI's store answers (bucket, credentials, endpoint)
        if is_uri(item):
            check_store(item, "--input")
    sources = resolve_inputs(cfg.inputs, text_field=cfg.text_field)
    check_tokenizer_folder(cfg.tokenizer)
    tok_files = tokenizer_files(cfg.tokenizer)  # a folder or a URI; the sha256 checked
    meta = json.loads(tok_files[1])
    entities = load_entities(cfg.entities, cfg.clean) if cfg.entities else None
    fs, root = output_fs(cfg.output)
    if fs.get_file_info(root).type == pafs.FileType.File:
        raise PrepareError(f"output {cfg.output} exists and is not a folder")
    config_hash = _sha256_json(cfg.output_settings())
    entries = _source_entries(sources)
    fp = fingerprint(config_hash, entries, meta["sha256"])
    existing = existing_manifest(fs, root)
    if existing and existing.get("fingerprint") == fp and not cfg.force:
        print(f"{cfg.output}: up to date (same inputs, tokenizer and config); --force rebuilds it")
        return _result(cfg, root)
    foreign = foreign_files(fs, root)
    if foreign and not cfg.force:
        shown = ", ".join(foreign[:10]) + (
            f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        )
        raise PrepareError(
            f"output {cfg.output} holds files `plm data prepare` did not write: {shown}. "
            "Choose an empty or new --output, or pass --force (they are left in place)."
        )
    if existing is not None and not cfg.force:
        raise PrepareError(
            f"output {cfg.output} holds a data dir prepared from other inputs, tokenizer or "
            "config; pass --force to replace it or choose another --output"
        )
    # A run refused from here on (input that gives no document, an unreadable input met by
    # a task) leaves the output as it found it: no folder where there was none, nothing
    # new in one that was there. A run that crashes or is killed keeps what it wrote: the
    # next run of the same job reuses its finished units (records.py).
    before = snapshot(fs, root)
    try:
        return _build(cfg, sources, meta, tok_files, entities, fs, root, (config_hash, entries, fp),
                      (started, cpu_started))  # fmt: skip
    except ConfigError:
        restore(fs, root, before)
        raise
    except Exception as err:  # the driver's writes or a task's (a RayTaskError's cause)
        full = no_space(err)
        if full is None:
            raise
        raise disk_full(
            full, cfg.output, then="free space there or pass --output DIR on a bigger disk, "
            "and run the same command again: the units a run finished are kept, not redone",
        ) from None  # fmt: skip


def _build(cfg, sources, meta, tok_files, entities, fs, root, fingerprints, clocks):
    """``run_prepare`` once validated: the job, the shards' names and the manifest."""
    from pipeline.prepare import near_dedup, records
    from pipeline.prepare.dedup import n_partitions
    from pipeline.prepare.job import plan_units

    config_hash, entries, fp = fingerprints
    started, cpu_started = clocks

    # 2. Start clean: no manifest until the end, no stale shards or temp files; but the
    # parts of units an earlier run of this same job finished (a rerun after the driver
    # or the head died) are kept with their records, and not redone (records.py).
    units = plan_units(sources, cfg.split_bytes)
    input_bytes = sum(s.size for s in sources)
    partitions = n_partitions(input_bytes)
    near_partitions = (
        near_dedup.n_partitions(input_bytes, cfg.near_dedup.bands) if cfg.near_dedup.enabled else 0
    )
    job_id = {
        "fingerprint": fp, "units": len(units), "partitions": [partitions, near_partitions],
    }  # fmt: skip
    _start_output(fs, root, job_id, tok_files)

    # 3. The Ray job; the workers write the shards.
    spec = _job_spec(cfg, sources, fs, root, tok_files[0], meta, entities)
    job, ray_ready, ray_start_cpu = _run_job(cfg, spec, units, partitions, near_partitions)
    results = job["results"]
    splits = name_shards(fs, root, results)

    # 4. Counts, stats and the manifest, last and atomically.
    tally = _Tally.of(results)
    digests = _digests(results, len(entries))
    for i, entry in enumerate(entries):
        entry["n_docs_read"], entry["n_docs_kept"] = tally.read[i], tally.kept[i]
        entry["digests"] = digests[i]
    n_tokens = sum(info["n_tokens"] for info in splits.values())
    wall = time.perf_counter() - started
    driver_cpu = _cpu_seconds() - cpu_started
    worker_cpu = (
        job["dedup_cpu_seconds"] + job["write_cpu_seconds"] + job["near_dedup_reducer_cpu_seconds"]
    )
    stats = _stats(
        cfg,
        job,
        wall=wall,
        ray_start=ray_ready - started,
        driver_cpu=driver_cpu,
        ray_start_cpu=ray_start_cpu,
        worker_cpu=worker_cpu,
        input_bytes=input_bytes,
        n_tokens=n_tokens,
        n_units=len(units),
        partitions=partitions,
        near_partitions=near_partitions,
    )
    manifest = _manifest(cfg, fingerprints, meta, splits, tally, stats)
    if manifest["totals"]["n_docs"] == 0:  # an unusable input: no data dir, exit 2
        raise InputError(_nothing_usable(cfg, sources, manifest["totals"], tally.rejected))
    write_file(fs, f"{root}/{MANIFEST}", manifest_bytes(manifest))
    records.finish(fs, root)
    _report(cfg, manifest, tally, wall, driver_cpu, worker_cpu)
    return _result(cfg, root)


def _start_output(fs, root: str, job_id: dict[str, Any], tok_files: tuple[bytes, bytes]) -> None:
    """The output folder made ready for the job: what earlier runs wrote is removed,
    except the finished units of an earlier run of this same job (``job_id``; records.py);
    the split and tokenizer folders are made and the tokenizer's files written."""
    from pipeline.prepare import records

    fs.create_dir(root, recursive=True)
    kept = records.start(fs, root, job_id)
    clear_own_files(fs, root, keep=frozenset(n for names in kept.values() for n in names))
    if kept:
        print(f"prepare: {len(kept)} of {job_id['units']} units were finished by an earlier "
              "run of this job: kept, not redone", flush=True)  # fmt: skip
    for sub in (*SPLITS, TOKENIZER_DIR):
        fs.create_dir(f"{root}/{sub}", recursive=True)
    tokenizer_bytes, meta_bytes = tok_files
    write_file(fs, f"{root}/{TOKENIZER_DIR}/{TOKENIZER_FILE}", tokenizer_bytes)
    write_file(fs, f"{root}/{TOKENIZER_DIR}/{META_FILE}", meta_bytes)


def _job_spec(cfg: PrepareConfig, sources, fs, root: str, tokenizer_bytes: bytes, meta, entities):
    """What every task of the job needs (``unit.JobSpec``)."""
    from pipeline.prepare.unit import JobSpec

    return JobSpec(
        sources=sources,
        output=root,
        fs=fs,
        tokenizer_json=tokenizer_bytes.decode("utf-8"),
        vocab_size=meta["vocab_size"],
        clean=cfg.clean.model_dump(),
        valid_fraction=cfg.valid_fraction,
        max_doc_tokens=cfg.max_doc_tokens,
        max_doc_bytes=cfg.max_doc_bytes,
        shard_docs=cfg.shard_docs,
        shard_bytes=cfg.effective_shard_bytes,
        block_tokens=cfg.block_tokens,
        batch_docs=cfg.batch_docs,
        entities=entities,
        builtin_docs=python_docs() if any(s.format == "builtin" for s in sources) else None,
        language_id=cfg.language_id,
        languages=cfg.kept_languages(),
        filters=tuple(cfg.filters),
        near_dedup=cfg.near_dedup.spec() if cfg.near_dedup.enabled else None,
    )


def _run_job(cfg: PrepareConfig, spec, units, partitions: int, near_partitions: int):
    """The Ray job on the cluster joined (or the local Ray started, and shut down after):
    (its results, when Ray was ready, the driver's CPU seconds to get it ready)."""
    from pipeline.prepare.job import init_ray, run_job

    cpu_before_ray = _cpu_seconds()
    own_ray = init_ray(cfg.ray_address, cfg.num_cpus)
    ray_ready, ray_start_cpu = time.perf_counter(), _cpu_seconds() - cpu_before_ray
    try:
        job = run_job(spec, units, partitions, near_partitions)
    finally:
        if own_ray:
            import ray

            ray.shutdown()
    return job, ray_ready, ray_start_cpu


def _stats(
    cfg: PrepareConfig,
    job: dict[str, Any],
    *,
    wall: float,
    ray_start: float,
    driver_cpu: float,
    ray_start_cpu: float,
    worker_cpu: float,
    input_bytes: int,
    n_tokens: int,
    n_units: int,
    partitions: int,
    near_partitions: int,
) -> dict[str, Any]:
    """The manifest's ``stats``: seconds (wall, and CPU of the driver and the workers),
    throughput, and how the job was cut (units, dedup and near-dedup partitions)."""
    stats = {
        "wall_seconds": round(wall, 3),
        "ray_start_seconds": round(ray_start, 3),
        "input_bytes": input_bytes,
        "input_mb_per_s": round(input_bytes / 1e6 / wall, 3),
        "tokens_per_s": round(n_tokens / wall, 1),
        "driver_cpu_seconds": round(driver_cpu, 3),
        # Of it, importing Ray and starting (or joining) it: a fixed cost.
        "driver_cpu_seconds_ray_start": round(ray_start_cpu, 3),
        "worker_cpu_seconds": round(worker_cpu, 3),
        "worker_cpu_seconds_dedup": round(job["dedup_cpu_seconds"], 3),
        "units_rewritten_for_duplicates": job["units_fixed"],
        "units_reused": job["units_reused"],  # finished by an earlier run of the same job
        "units": n_units,
        "writer_nodes": job["nodes"],
        "writer_hosts": job["hosts"],  # the hostnames of the nodes that wrote parts
        "dedup_partitions": partitions,
    }
    if cfg.near_dedup.enabled:
        # Signatures (inside the write tasks' CPU), candidate reducers and cluster rounds.
        stats["worker_cpu_seconds_near_dedup"] = round(job["near_dedup_cpu_seconds"], 3)
        stats["near_dedup_partitions"] = near_partitions
        stats["near_dedup_cluster_partitions"] = job["near_dedup_cluster_partitions"]
        stats["near_dedup_cluster_rounds"] = job["near_dedup_cluster_rounds"]
    return stats


@dataclass
class _Tally:
    """The units' counts summed, and the first reject examples of each reason."""

    read: Counter = field(default_factory=Counter)  # source index -> documents
    kept: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    languages: Counter = field(default_factory=Counter)
    filter_rules: Counter = field(default_factory=Counter)
    lines_removed: Counter = field(default_factory=Counter)
    language_skips: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def of(cls, results) -> _Tally:
        tally = cls()
        for r in results:
            tally.read.update(r.read)
            tally.kept.update(r.kept)
            tally.rejected.update(r.rejected)
            tally.languages.update(r.languages)
            tally.filter_rules.update(r.filter_rules)
            tally.lines_removed.update(r.lines_removed)
            tally.language_skips.update(r.filter_language_skips)
            for reason, found in r.examples.items():
                kept = tally.examples.setdefault(reason, [])
                kept.extend(found[: MAX_REJECT_EXAMPLES - len(kept)])
        return tally


def _manifest(cfg: PrepareConfig, fingerprints, meta, splits, tally: _Tally, stats):
    """manifest.json's content."""
    config_hash, entries, fp = fingerprints
    all_shards = [s for info in splits.values() for s in info["shards"]]
    return {
        "format_version": FORMAT_VERSION,
        "prepare_version": PREPARE_VERSION,
        "fingerprint": fp,
        "data_config_hash": config_hash,
        "data_config": cfg.output_settings(),
        "tokenizer": {
            "path": TOKENIZER_DIR,
            "fingerprint": meta["sha256"],
            "kind": meta["kind"],
            "vocab_size": meta["vocab_size"],
        },
        "token_dtype": token_dtype(meta["vocab_size"]).name,
        "sources": entries,
        "splits": splits,
        "totals": {
            "n_docs": sum(info["n_docs"] for info in splits.values()),
            "n_tokens": sum(info["n_tokens"] for info in splits.values()),
            "n_shards": len(all_shards),
            "bytes": sum(s["bytes"] for s in all_shards),
            "documents_read": sum(tally.read.values()),
            "documents_kept": sum(tally.kept.values()),
            "languages": dict(sorted(tally.languages.items())),
        },
        "rejected": dict(sorted(tally.rejected.items())),
        "reject_examples": dict(sorted(tally.examples.items())),
        # Quality filters: documents rejected per "filter.rule", lines removed per rule.
        "filter_rules": dict(sorted(tally.filter_rules.items())),
        "lines_removed": dict(sorted(tally.lines_removed.items())),
        # Per filter, per language: documents it did not judge (outside its `languages`).
        "filter_language_skips": _nested(tally.language_skips),
        "stats": stats,
    }


def _report(cfg: PrepareConfig, manifest, tally: _Tally, wall, driver_cpu, worker_cpu) -> None:
    """The run's summary line, and its warnings (on stderr)."""
    totals, splits, stats = manifest["totals"], manifest["splits"], manifest["stats"]
    rejected = tally.rejected
    per_split = ", ".join(f"{k} {v['n_docs']:,}" for k, v in splits.items())
    rejects = ", ".join(f"{k} {v:,}" for k, v in sorted(rejected.items()))
    print(
        f"{cfg.output}: {totals['n_docs']:,} documents, {totals['n_tokens']:,} tokens in "
        f"{totals['n_shards']} shards ({per_split}); rejected {sum(rejected.values()):,} "
        f"({rejects or 'none'})\n"
        f"  {wall:.1f} s wall ({stats['ray_start_seconds']:.1f} s Ray start), "
        f"{stats['input_mb_per_s']:.2f} MB/s of input, {stats['tokens_per_s']:,.0f} tokens/s; "
        f"CPU: driver {driver_cpu:.1f} s, workers {worker_cpu:.1f} s "
        f"({stats['units']} units, {stats['dedup_partitions']} dedup partition(s))"
    )
    if rejected.get("truncated"):
        cut = sorted({e["source"] for e in tally.examples.get("truncated", [])})
        more = rejected["truncated"] - len(cut)
        print(
            f"warning: {rejected['truncated']} compressed input(s) break off before their end: "
            f"{', '.join(cut)}{f' and {more} more' if more > 0 else ''}; the documents before "
            "the break were kept (manifest.json reject_examples.truncated says where)",
            file=sys.stderr,
        )
    if splits["valid"]["n_docs"] == 0 and cfg.valid_fraction > 0:
        print(
            f"warning: no document fell into the valid split (valid_fraction={cfg.valid_fraction})",
            file=sys.stderr,
        )


def _nested(counts: Counter) -> dict[str, dict[str, int]]:
    """{"c4/la": 3} -> {"c4": {"la": 3}}, sorted."""
    out: dict[str, dict[str, int]] = {}
    for key, n in sorted(counts.items()):
        name, language = key.split("/", 1)
        out.setdefault(name, {})[language] = n
    return out


def _nothing_usable(
    cfg: PrepareConfig, sources: list[Source], totals: dict[str, Any], rejected: Counter
) -> str:
    """Why the inputs gave no document, as one sentence: empty, or every document
    rejected (by reason); for jsonl documents without the text field, the fields that
    the first JSON object has and the flag that picks one."""
    where = ", ".join(s.uri for s in sources[:3]) + (
        f" and {len(sources) - 3} more" if len(sources) > 3 else ""
    )
    read = totals["documents_read"]
    if not read:
        why = "holds no document (empty?)" if len(sources) == 1 else "hold no document (empty?)"
        msg = f"{where} {why}"
    else:
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(rejected.items()))
        msg = f"none of the {read:,} documents of {where} is usable (rejected: {reasons})"
    if rejected.get("no_text"):
        fields = _jsonl_fields(sources)
        seen = f"; fields seen: {', '.join(fields)}" if fields else ""
        msg += (
            f"; {rejected['no_text']:,} JSON lines have no string field {cfg.text_field!r}"
            f"{seen}: pass --text-field NAME (data config text_field)"
        )
    if rejected.get("invalid_utf8"):
        msg += f"; {ENCODING_HINT}"
    return f"{msg}; no data dir was written (manifest.json), nothing to train on"


def _jsonl_fields(sources: list[Source]) -> list[str]:
    """The keys of the first JSON object of the first jsonl source that has one (read from
    its first 1 MB), for the hint above; [] when none is found."""
    for source in sources:
        if not source.format.startswith("jsonl"):
            continue
        try:
            with _open_text_stream(source) as stream:
                for line in stream.read(1 << 20).splitlines():
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        return sorted(obj)
        except (OSError, EOFError):
            continue
    return []


def _result(cfg: PrepareConfig, root: str) -> Path | str:
    return cfg.output if "://" in cfg.output else Path(root)
