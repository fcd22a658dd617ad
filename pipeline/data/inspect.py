"""`plm data inspect DIR [--verify]`: what a prepared data directory holds, and whether it is intact."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.data.shards import DataDir, ShardError


def summarize(data: DataDir) -> list[str]:
    """Human-readable lines: totals, splits, rejects, tokenizer, sources."""
    m = data.manifest
    totals = m.get("totals", {})
    lines = [
        f"data dir     {data.where()}",
        f"format       v{m['format_version']}  token dtype {m.get('token_dtype', '?')}  "
        f"config hash {str(m.get('data_config_hash', '?'))[:16]}",
        f"totals       {totals.get('n_docs', 0):,} docs  {totals.get('n_tokens', 0):,} tokens  "
        f"{totals.get('n_shards', 0)} shards  {totals.get('bytes', 0):,} bytes",
    ]
    for split, info in sorted(m["splits"].items()):
        lines.append(
            f"  {split:<10} {info['n_docs']:,} docs  {info['n_tokens']:,} tokens  "
            f"{len(info['shards'])} shards  {info.get('pattern', '')}"
        )
    rejected = m.get("rejected", {})
    total_rejected = sum(rejected.values())
    lines.append(f"rejected     {total_rejected:,} docs")
    for reason, count in sorted(rejected.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {reason:<14} {count:,}")
    tok = m.get("tokenizer", {})
    lines.append(
        f"tokenizer    {tok.get('kind', '?')}  vocab {tok.get('vocab_size', '?')}  "
        f"{data.where(tok.get('path', '?'))}  sha256 {str(tok.get('fingerprint', '?'))[:16]}"
    )
    sources = m.get("sources", [])
    lines.append(f"sources      {len(sources)}")
    for src in sources[:20]:
        lines.append(f"  {src['uri']}  {src['size']:,} bytes  {_digest_text(src)}")
    if len(sources) > 20:
        lines.append(f"  ... {len(sources) - 20} more")
    return lines


def _digest_text(source: dict) -> str:
    """One sha256 for a source read whole; a count of the ranges for one read in slices."""
    digests = source.get("digests")
    if digests is None:  # a manifest written before the tasks hashed their slices
        return f"sha256 {str(source.get('sha256', '?'))[:16]}"
    if len(digests) == 1:
        return f"sha256 {digests[0]['sha256'][:16]}"
    return f"sha256 of {len(digests)} byte ranges"


def inspect_data(dir: str | Path, verify: bool = False) -> int:
    """Print the summary; with ``verify`` re-hash every shard. Exit code 1 on any problem.
    ``dir``: a folder, or a URI (``s3://bucket/prefix``: only the manifest is read unless
    ``verify``)."""
    try:
        data = DataDir(dir)
    except ShardError as err:
        print(f"plm: {err}", file=sys.stderr)
        return 1
    print("\n".join(summarize(data)))
    if not verify:
        return 0
    problems = data.verify()
    if problems:
        for problem in problems:
            print(f"plm: verify: {data.where()}: {problem}", file=sys.stderr)
        print(f"verify       FAILED: {len(problems)} problem(s)")
        return 1
    n = sum(len(info["shards"]) for info in data.manifest["splits"].values())
    print(f"verify       ok: {n} shards re-hashed, indexes match")
    return 0
