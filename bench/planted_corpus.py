"""A corpus with planted near-duplicates at known Jaccard similarities (tests and benches).

    python bench/planted_corpus.py --mb 100 --out /var/tmp/planted [--seed 0]

Real text: the paragraphs of ``builtin:python-docs`` (the language reference topics and
the standard library's docstrings), cut into sentences. A base document is a seeded draw
of 6-30 of those sentences (so base documents rarely share a 5-gram run); a planted copy
is a base document after word-level edits (a word replaced by another word of the text,
deleted, or a word inserted, at random places) until the exact Jaccard similarity of
the two documents' shingles (``pipeline.prepare.near_dedup.shingles``: the pipeline's own
words and n-grams) is the drawn target. Each copy lands at a random place after its
original, so copies fall into the same unit as their original and into later ones.

Planted (shares of the base documents):
- ``high``: 1 to 3 copies, each at a target J in [0.8, 1.0) (a cluster of up to 4);
- ``mid``: one copy at J in (0.5, 0.8);
- ``low``: one copy at J in [0.1, 0.5] (a base with a low copy has no other copy);
- ``exact``: one exact copy.

Written: ``corpus-NNN.jsonl`` files (``{"text": ..., "id": global index}`` a line, the order above; several
files so the corpus is read as several sources), and ``pairs.jsonl``: one line per planted
copy: kind, target and exact J, ngram, the original's and the copy's global index (their
order in the files, counting from 0 over the files in name order).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHARES = {"high": 0.12, "mid": 0.04, "low": 0.08, "exact": 0.02}
RANGES = {"high": (0.8, 1.0), "mid": (0.5, 0.8), "low": (0.1, 0.5), "exact": (1.0, 1.0)}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


@dataclass
class Pair:
    kind: str
    target: float
    jaccard: float
    original: int  # global index in the corpus
    copy: int


@functools.cache
def sentences() -> list[str]:
    """The sentences of builtin:python-docs with 6 words or more, in a fixed order."""
    from pipeline.prepare.readers import python_docs

    found = []
    for doc in python_docs():
        for piece in _SENTENCE_END.split(doc):
            piece = " ".join(piece.split())
            if len(piece.split()) >= 6:
                found.append(piece)
    return found


def jaccard(a: str, b: str, ngram: int) -> float:
    """Exact Jaccard similarity of the two texts' shingle sets (the pipeline's shingles)."""
    from pipeline.prepare.near_dedup import shingles

    values, first = shingles([a, b], ngram)
    x, y = set(values[first[0] : first[1]].tolist()), set(values[first[1] : first[2]].tolist())
    return len(x & y) / len(x | y) if x or y else 1.0


def edited(text: str, target: float, ngram: int, vocab: list[str], rng: random.Random):
    """``text`` after the number of word edits that brings its Jaccard with the original
    closest to ``target`` (binary search over a seeded edit sequence); (copy, J)."""
    words = text.split()
    ops = []
    for _ in range(len(words)):
        op = rng.random()
        kind = "replace" if op < 0.6 else "delete" if op < 0.8 else "insert"
        ops.append((kind, rng.random(), rng.choice(vocab)))

    def apply(k: int) -> str:
        out = list(words)
        for kind, where, word in ops[:k]:
            i = int(where * len(out))
            if kind == "replace" and out:
                out[min(i, len(out) - 1)] = word
            elif kind == "delete" and len(out) > ngram + 1:
                del out[min(i, len(out) - 1)]
            else:
                out.insert(i, word)
        return " ".join(out)

    lo, hi = 1, len(ops)  # J falls (roughly) as k grows
    while lo < hi:
        mid = (lo + hi) // 2
        if jaccard(text, apply(mid), ngram) > target:
            lo = mid + 1
        else:
            hi = mid
    best = min({max(1, lo - 1), lo}, key=lambda k: abs(jaccard(text, apply(k), ngram) - target))
    copy = apply(best)
    return copy, jaccard(text, copy, ngram)


def generate(
    n_bytes: int, seed: int = 0, ngram: int = 5, shares: dict[str, float] | None = None
) -> tuple[list[str], list[Pair]]:
    """Documents (in source order) of about ``n_bytes`` of text, and the planted pairs."""
    shares = shares or SHARES
    rng = random.Random(seed)
    pool = sentences()
    vocab = sorted({w for s in pool[:5000] for w in s.split()})
    bases: list[str] = []
    size = 0
    while size < n_bytes:
        doc = " ".join(rng.sample(pool, rng.randint(6, 30)))
        bases.append(doc)
        size += len(doc) + 1
        for kind, share in shares.items():  # the copies' expected bytes count too
            size += int(len(doc) * share * (2 if kind == "high" else 1))
    placed: list[tuple[float, int, str]] = [(float(i), 0, d) for i, d in enumerate(bases)]
    planted: list[tuple[str, float, float, int, int]] = []  # kind, target, J, base, slot
    cumulative = []
    total = 0.0
    for kind, share in shares.items():
        total += share
        cumulative.append((total, kind))
    for i, doc in enumerate(bases):
        draw = rng.random()
        kind = next((k for edge, k in cumulative if draw < edge), None)
        if kind is None:
            continue
        n_copies = rng.randint(1, 3) if kind == "high" else 1
        for _ in range(n_copies):
            lo, hi = RANGES[kind]
            target = lo if lo == hi else rng.uniform(lo, hi)
            copy, j = (doc, 1.0) if kind == "exact" else edited(doc, target, ngram, vocab, rng)
            at = rng.uniform(i + 0.01, len(bases))
            planted.append((kind, target, j, i, len(placed)))
            placed.append((at, len(placed), copy))
    order = sorted(range(len(placed)), key=lambda k: (placed[k][0], placed[k][1]))
    where = {slot: rank for rank, slot in enumerate(order)}
    docs = [placed[k][2] for k in order]
    pairs = [
        Pair(kind, round(target, 4), round(j, 4), where[base], where[slot])
        for kind, target, j, base, slot in planted
    ]
    return docs, pairs


def write(out: Path, docs: list[str], pairs: list[Pair], n_files: int = 4) -> list[Path]:
    """The corpus as ``n_files`` jsonl files and ``pairs.jsonl``; the files' paths."""
    out.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // n_files)
    paths = []
    for f in range(n_files):
        path = out / f"corpus-{f:03d}.jsonl"
        with path.open("w", encoding="utf-8") as stream:
            for k in range(f * per_file, min((f + 1) * per_file, len(docs))):
                stream.write(json.dumps({"text": docs[k], "id": str(k)}) + "\n")
        paths.append(path)
    with (out / "pairs.jsonl").open("w", encoding="utf-8") as stream:
        for p in pairs:
            stream.write(json.dumps(p.__dict__) + "\n")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=4)
    args = parser.parse_args()
    docs, pairs = generate(int(args.mb * 1e6), seed=args.seed)
    write(args.out, docs, pairs, args.files)
    print(f"{args.out}: {len(docs):,} documents, {len(pairs):,} planted copies")


if __name__ == "__main__":
    main()
