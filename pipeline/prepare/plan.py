"""``plm data tokenizer|prepare --dry-run``: validate the inputs and config, print the plan.

Nothing starts: no Ray, no tokenizer training, nothing written. The launchers (Ray job
submission, Kubernetes manifests) run these to check a command line before a cluster
spends time on it. The checks are the ones the real commands make before they start
work, so a dry run that passes means the real run gets past its validation. `prepare`'s
says how much its output's filesystem has free, and refuses one that cannot hold even the
tokenizer's files (exit 5, as the real run on a full disk).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.data.shards import MANIFEST
from pipeline.output import DiskFull, free_bytes, size_text
from pipeline.prepare.readers import InputError, Source, resolve_inputs
from pipeline.prepare.tokenizer import (
    TokenizerSpec,
    check_tokenizer_folder,
    load_tokenizer,
    tokenizer_files,
)

if TYPE_CHECKING:
    from pipeline.prepare.config import PrepareConfig


def _sources_line(sources: list[Source]) -> str:
    formats = sorted({s.format for s in sources})
    total = sum(s.size for s in sources)
    return f"{len(sources)} source(s), {total:,} bytes ({', '.join(formats)})"


def _output_state(out: Path) -> str:
    """What the real run would do with ``out``; raises where it would refuse."""
    if not out.exists():
        return "new folder"
    if not out.is_dir():
        raise InputError(f"output {out} exists and is not a folder")
    if (out / MANIFEST).is_file():
        return "holds a data dir: rebuilt unless up to date (same inputs, tokenizer, config)"
    return "exists without manifest: cleaned and written"


def print_tokenizer_plan(inputs: list[str], spec: TokenizerSpec, output: str | Path) -> int:
    from pipeline.storage import check_store, is_uri

    for item in inputs:
        if is_uri(item):
            check_store(item, "--input")
    sources = resolve_inputs(list(inputs), text_field=spec.text_field)
    if is_uri(output):
        check_store(str(output), "--output")  # the bucket, credentials, endpoint
        state = "a filesystem URI: files replaced"
    else:
        out = Path(output)
        if out.exists() and not out.is_dir():
            raise InputError(f"--output {out} exists and is not a folder")
        state = "exists: files replaced" if out.exists() else "new folder"
    lines = [
        f"inputs          {_sources_line(sources)}",
        f"tokenizer       {spec.kind}, vocab {spec.vocab_size:,}, lowercase {spec.lowercase}",
        f"sample          up to {spec.sample_docs:,} documents (seed {spec.seed})",
        f"output          {output}  ({state})",
    ]
    print("\n".join(lines))
    print("dry run: inputs valid, nothing started")
    return 0


def print_prepare_plan(cfg: PrepareConfig) -> int:
    from pipeline.prepare.job import plan_units
    from pipeline.prepare.store import PrepareError, foreign_files, output_fs

    sources = resolve_inputs(cfg.inputs, text_field=cfg.text_field)
    tok_dir = cfg.tokenizer  # a folder or a URI
    check_tokenizer_folder(tok_dir)
    _, meta = load_tokenizer(tok_dir)  # checks both files and the fingerprint
    fs, root = output_fs(cfg.output)
    out = Path(root) if "://" not in cfg.output else cfg.output
    state = _output_state(out) if isinstance(out, Path) else "a filesystem URI"
    free = free_bytes(out) if isinstance(out, Path) else None
    if free is not None:
        least = sum(len(b) for b in tokenizer_files(tok_dir))  # what the output holds first
        if free < least:
            raise DiskFull(
                f"--output {out}: its filesystem has {size_text(free)} free, less than the "
                f"tokenizer's files alone ({size_text(least)}) before any shard: free space "
                "there or pass --output DIR on a bigger disk"
            )
        state += f"; {size_text(free)} free on its filesystem"
    foreign = foreign_files(fs, root)
    if foreign and not cfg.force:
        raise PrepareError(
            f"output {out} holds files `plm data prepare` did not write: "
            f"{', '.join(foreign[:10])}. Choose an empty or new --output, or pass --force."
        )
    if cfg.shard_docs:
        shards = f"{cfg.shard_docs:,} documents per shard"
    else:
        shards = f"{cfg.effective_shard_bytes:,} bytes per shard"
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    ray = f"cluster at {address}" if address else f"local Ray ({cfg.num_cpus or 'all'} CPUs)"
    lines = [
        f"inputs          {_sources_line(sources)}",
        f"tokenizer       {tok_dir}: {meta['kind']}, vocab {meta['vocab_size']:,}, "
        f"sha256 {meta['sha256'][:12]}",
        f"output          {out}  ({state})",
        f"split           valid fraction {cfg.valid_fraction} (by a hash of each document)",
        f"shards          {shards}, blocks of {cfg.block_tokens:,} tokens; documents over "
        f"{cfg.max_doc_tokens:,} tokens are cut",
        f"work            {len(plan_units(sources, cfg.split_bytes))} units of up to "
        f"{cfg.split_bytes:,} input bytes, one Ray task each (they write the shards)",
        f"ray             {ray}",
    ]
    print("\n".join(lines))
    print("dry run: config valid, nothing started")
    return 0
