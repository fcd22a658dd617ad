"""`plm data inspect DIR [--verify]`: what a prepared data directory holds, and whether it is intact."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.data.shards import DataDir, ShardError
from pipeline.prepare.readers import DEFAULT_MAX_DOC_BYTES, ENCODING_HINT, texts_at


def summarize(data: DataDir) -> list[str]:
    """Human-readable lines: totals, splits, languages, what each stage removed,
    tokenizer, sources."""
    m = data.manifest
    totals = m.get("totals", {})
    lines = [
        f"data dir     {data.where()}",
        f"format       v{m['format_version']}  token dtype {m.get('token_dtype', '?')}  "
        f"config hash {str(m.get('data_config_hash', '?'))[:16]}",
        f"totals       {totals.get('n_docs', 0):,} docs  {totals.get('n_tokens', 0):,} tokens  "
        f"{totals.get('n_shards', 0)} shards  {totals.get('bytes', 0):,} bytes",
    ]
    lines.extend(_kept_line(m))
    for split, info in sorted(m["splits"].items()):
        lines.append(
            f"  {split:<10} {info['n_docs']:,} docs  {info['n_tokens']:,} tokens  "
            f"{len(info['shards'])} shards  {info.get('pattern', '')}"
        )
    lines.extend(removed_table(m))
    languages = totals.get("languages", {})
    if languages:
        kept = sum(languages.values()) or 1
        shown = sorted(languages.items(), key=lambda kv: (-kv[1], kv[0]))
        lines.append(
            "languages    "
            + "  ".join(f"{code} {n:,} ({n / kept:.1%})" for code, n in shown[:12])
            + (f"  ... {len(shown) - 12} more" if len(shown) > 12 else "")
        )
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


def _kept_line(m: dict) -> list[str]:
    """How the documents kept became the shards' docs: a document over max_doc_tokens is
    cut into pieces, each a doc of its own, so the shards can hold more docs than there
    are documents (and the languages line counts documents). Nothing for a manifest that
    does not count the documents kept."""
    totals = m.get("totals", {})
    kept = totals.get("documents_kept")
    if kept is None:
        return []
    n_docs = totals.get("n_docs", 0)
    read = totals.get("documents_read")
    line = f"kept         {kept:,} documents" + (f" of {read:,} read" if read is not None else "")
    extra = n_docs - kept
    if extra > 0:
        limit = m.get("data_config", {}).get("max_doc_tokens")
        over = f"over max_doc_tokens ({limit:,} tokens)" if limit else "over max_doc_tokens"
        line += (
            f"; they are {n_docs:,} docs in the shards ({extra:,} more): a document {over} "
            "is cut into pieces, one doc each"
        )
    return [line]


# Which stage of `plm data prepare` rejects a document for a reason (docs/data.md).
STAGE_OF = {
    "invalid_utf8": "read",
    "nul_bytes": "read",
    "bad_json": "read",
    "no_text": "read",
    "truncated": "read",
    "too_long": "read/clean",
    "too_short": "clean",
    "language": "language",
    "gopher_repetition": "filters",
    "gopher_quality": "filters",
    "c4": "filters",
    "fineweb": "filters",
    "duplicate": "dedup",
    "no_tokens": "tokenize",
}
STAGES = ("read", "read/clean", "clean", "language", "filters", "dedup", "tokenize")
EXAMPLES_SHOWN = 2  # per reason
EXAMPLE_TEXT = 60  # characters of a filtered document's text


def removed_table(m: dict) -> list[str]:
    """What each stage removed, as a plain table: reason, documents, their share of the
    documents read, a few examples (where: source, ordinal, line; why: the rule; the start
    of the text). Then the documents each filter rule rejected and the lines it removed
    from documents it kept. A reason no stage above names shows under ``other``."""
    rejected = m.get("rejected", {})
    totals = m.get("totals", {})
    read = totals.get("documents_read") or totals.get("n_docs", 0) + sum(rejected.values())
    examples = _with_texts(
        m, {r: e[:EXAMPLES_SHOWN] for r, e in m.get("reject_examples", {}).items()}
    )
    out = [f"rejected     {sum(rejected.values()):,} docs of {read:,} read"]
    if rejected:
        out.append(f"  {'stage':<11} {'reason':<18} {'docs':>9} {'share':>7}  examples")
    order = {stage: k for k, stage in enumerate(STAGES)}
    rows = sorted(
        rejected.items(),
        key=lambda kv: (order.get(STAGE_OF.get(kv[0], "other"), len(order)), -kv[1], kv[0]),
    )
    for reason, count in rows:
        stage = STAGE_OF.get(reason, "other")
        share = f"{count / read:.1%}" if read else "-"
        shown = [_example_text(e) for e in examples.get(reason, [])[:EXAMPLES_SHOWN]]
        first = shown[0] if shown else ""
        out.append(f"  {stage:<11} {reason:<18} {count:>9,} {share:>7}  {first}".rstrip())
        out.extend(f"  {'':<11} {'':<18} {'':>9} {'':>7}  {more}" for more in shown[1:])
    if rejected.get("invalid_utf8"):
        out.append(f"  invalid_utf8: {ENCODING_HINT}")
    rules = m.get("filter_rules", {})
    removed = m.get("lines_removed", {})
    if rules or removed:
        out.append(f"  {'filter rule':<32} {'docs rejected':>13} {'lines removed':>13}")
        for rule in sorted(set(rules) | set(removed)):
            out.append(f"  {rule:<32} {rules.get(rule, 0):>13,} {removed.get(rule, 0):>13,}")
    return out


def _with_texts(m: dict, examples: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The examples, those without text (a reject found before any filter read it: too
    short, duplicate, no tokens) given the start of their text read back from the
    source where it is still the file prepared (``readers.texts_at``; one read per
    source and slice). The manifest itself is left as it is."""
    config = m.get("data_config", {})
    sources = {s.get("uri"): s for s in m.get("sources", [])}
    missing: dict[tuple, list[dict]] = {}
    out: dict[str, list[dict]] = {}
    for reason, shown in examples.items():
        out[reason] = [dict(e) for e in shown]
        for e in out[reason]:
            if "text" not in e and e.get("source") in sources and "ordinal" in e:
                rows = e.get("row_groups")
                key = (
                    e["source"],
                    e.get("from_byte", 0),
                    tuple(rows) if rows is not None else None,
                )
                missing.setdefault(key, []).append(e)
    for (uri, start, rows), found in missing.items():
        entry = sources[uri]
        texts = texts_at(
            uri,
            [e["ordinal"] for e in found],
            start=start,
            row_groups=list(rows) if rows is not None else None,
            text_field=config.get("text_field", "text"),
            max_doc_bytes=config.get("max_doc_bytes") or DEFAULT_MAX_DOC_BYTES,
            size=entry.get("size"),
            mtime_ns=entry.get("mtime_ns"),
        )
        for e in found:
            if e["ordinal"] in texts:
                e["text"] = texts[e["ordinal"]][: EXAMPLE_TEXT * 4]
    return out


def _example_text(example: dict) -> str:
    where = f"{Path(str(example.get('source', '?'))).name}#{example.get('ordinal', '?')}"
    if example.get("line"):
        where += f" line {example['line']}"
    if example.get("from_byte"):
        where += f" (from byte {example['from_byte']:,})"
    if example.get("detail"):
        where += f" [{example['detail']}]"
    if example.get("text"):
        text = " ".join(str(example["text"]).split())
        text = text if len(text) <= EXAMPLE_TEXT else text[: EXAMPLE_TEXT - 3] + "..."
        where += f" {text!r}"
    return where


def _digest_text(source: dict) -> str:
    """One sha256 for a source read whole; a count of the ranges for one read in slices."""
    digests = source.get("digests")
    if digests is None:  # a manifest written before the tasks hashed their slices
        return f"sha256 {str(source.get('sha256', '?'))[:16]}"
    if len(digests) == 1:
        return f"sha256 {digests[0]['sha256'][:16]}"
    return f"sha256 of {len(digests)} byte ranges"


def inspect_data(dir: str | Path, verify: bool = False) -> int:
    """Print the summary; with ``verify`` re-hash every shard. Exit code 1 on any problem
    ``verify`` finds; 2, with one `plm:` line, when ``dir`` is no finished data dir (missing,
    no manifest, a manifest of another format): bad input, as for every command.
    ``dir``: a folder, or a URI (``s3://bucket/prefix``: only the manifest is read unless
    ``verify``)."""
    try:
        data = DataDir(dir)
    except ShardError as err:
        print(f"plm: {err}", file=sys.stderr)
        return 2
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
