"""Near-duplicate removal (MinHash LSH) at any corpus size: "first in source order wins".

Along the data's path, with a document's place in source order (unit, position):

1. ``signatures`` (in the write task, on the cleaned text, beside the exact dedup key):
   the text's words (lowercased ``\\w`` runs; a CJK ideograph is a word of its own), word
   n-gram shingles hashed to 64 bits (numpy over the batch's UTF-8 bytes: one pass, no
   Python per word), and ``bands * rows`` MinHash values: the minimum over the shingles
   of ``(a * x + b) mod 2**64`` for odd ``a`` (a bijection, so two documents share a
   value exactly when the same shingle is the minimum: probability = their Jaccard).
2. ``band_keys`` -> ``partition``: one 64-bit key per band (the band's values and its
   index hashed together), rows (key, position) hash-partitioned by key into Q
   partitions, as the exact dedup does. Q grows with the input (``n_partitions``).
3. ``candidates`` (one reducer per partition): the rows with an equal key form a
   bucket; every member but the first in source order gives an edge (member -> first).
   Memory: its partition's rows, 16 bytes per document and band, bounded by Q.
4. Clusters (``scatter``, then rounds of ``large_star`` and ``small_star``): the
   connected components of the edges, over R partitions that each hold whole units (a
   document's partition is its unit's, modulo R). Each round is two shuffles keyed by a
   document; the edges never grow in number, so a task holds its partition's arcs
   (R sized for at most ``ARCS_PER_PARTITION`` each on average) and no more.
   Once a round starts from the same edges as the round before, every component is a
   star around its first document in source order: the others are its near-duplicates.
   The one exception to "bounded": the first document of a cluster holds an arc per
   member, so a single cluster of millions of copies lands in one partition.
5. The fix wave (``worker.fix_unit``) drops them with the exact duplicates; a fix task
   reads its own unit's partition of step 4's result, never the whole list.

A component joined through transitive edges can hold documents further apart than any
single band match implies (as in datatrove's and FineWeb's MinHash). Every step is a
function of the documents and their places alone: the result does not depend on P, Q,
R, or the number of CPUs, workers or nodes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

# Rows (band keys) one reducer holds at most (16 bytes each: 128 MiB).
ROWS_PER_PARTITION = 8 << 20
_AVG_DOC_BYTES = 256  # pessimistic input bytes per document, as for the exact dedup
_CHUNK_SHINGLES = 2048  # shingles hashed together: (2048 x bands*rows) uint64 stays in cache
_UNIT_SHIFT = 32  # a document id packed in one int64: unit << 32 | position
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class NearDedupSpec:
    """What the tasks need (the data config's ``near_dedup`` section, validated)."""

    ngram: int = 5
    bands: int = 14
    rows: int = 8

    @property
    def n_hashes(self) -> int:
        return self.bands * self.rows


def n_partitions(input_bytes: int, bands: int) -> int:
    rows = -(-input_bytes // _AVG_DOC_BYTES) * bands
    return max(1, -(-rows // ROWS_PER_PARTITION))


# ---------------------------------------------------------------------------
# Hash constants: splitmix64 of fixed seeds, computed in Python (no RNG version drift).


def _splitmix64(seed: int, n: int) -> list[int]:
    out = []
    state = seed & _MASK64
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


def _constants(seed: int, n: int, odd: bool = False) -> np.ndarray:
    values = _splitmix64(seed, n)
    return np.array([v | 1 if odd else v for v in values], dtype=np.uint64)


_BYTE_BASE = int(_constants(1, 1, odd=True)[0])
_SHINGLE_MULT = _constants(2, 64, odd=True)  # word k of a shingle times _SHINGLE_MULT[k]
_BAND_MULT = _constants(3, 256, odd=True)  # row r of a band times _BAND_MULT[r]
_BAND_SALT = _constants(4, 1)[0]


def _perm_constants(n_hashes: int) -> tuple[np.ndarray, np.ndarray]:
    return _constants(5, n_hashes, odd=True), _constants(6, n_hashes)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic), in place."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


# ---------------------------------------------------------------------------
# 1. Words, shingles, signatures

# A CJK ideograph is a word; other words are runs of \w (letters, digits, underscore).
_CJK_CLASS = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(f"[{_CJK_CLASS}]|[^\\W{_CJK_CLASS}]+")
# ASCII bytes that are word characters (as \w in ASCII); bytes >= 0x80 only occur in the
# words the regex path joins with spaces, so they are word bytes too.
_WORD_BYTE = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_":
    _WORD_BYTE[_c] = True
_WORD_BYTE[0x80:] = True
_POWERS = np.ones(1, dtype=np.uint64)
_INV_POWERS = np.ones(1, dtype=np.uint64)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """_BYTE_BASE ** i and its inverse mod 2**64, for i < n (grown on demand, kept)."""
    global _POWERS, _INV_POWERS
    if _POWERS.shape[0] < n:
        size = max(n, 2 * _POWERS.shape[0])
        inverse = pow(_BYTE_BASE, -1, 1 << 64)
        _POWERS = np.cumprod(np.full(size, _BYTE_BASE, dtype=np.uint64))
        _POWERS[1:], _POWERS[0] = _POWERS[:-1].copy(), 1
        _INV_POWERS = np.cumprod(np.full(size, inverse, dtype=np.uint64))
        _INV_POWERS[1:], _INV_POWERS[0] = _INV_POWERS[:-1].copy(), 1
    return _POWERS[:n], _INV_POWERS[:n]


def _word_bytes(text: str) -> bytes:
    """The text as bytes whose word-byte runs are its words, lowercased."""
    lowered = text.lower()
    if lowered.isascii():
        return lowered.encode("ascii")
    return " ".join(_WORD.findall(lowered)).encode("utf-8")


def words(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit hash of every word of the texts, in order; the index of each text's first
    word, plus the total at the end). A word's hash depends on its bytes only."""
    pieces = [_word_bytes(t) for t in texts]
    lengths = np.fromiter((len(p) + 1 for p in pieces), dtype=np.int64, count=len(pieces))
    doc_starts = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_starts[1:])
    buf = np.frombuffer(b"\n".join(pieces) + b"\n", dtype=np.uint8)
    is_word = _WORD_BYTE[buf]
    edges = np.diff(is_word.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    powers, inverse = _powers(buf.shape[0] + 1)
    weighted = (buf.astype(np.uint64) + np.uint64(1)) * powers[: buf.shape[0]]
    cumulative = np.zeros(buf.shape[0] + 1, dtype=np.uint64)
    np.cumsum(weighted, out=cumulative[1:])
    hashes = (cumulative[ends] - cumulative[starts]) * inverse[starts]
    first_word = np.searchsorted(starts, doc_starts)
    return _mix(hashes), first_word


def shingles(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit hash of every word ``ngram``-gram of each text, in order; the index of each
    text's first shingle, plus the total). A text with fewer words than ``ngram`` (but
    one at least) has one shingle: all its words."""
    hashes, first_word = words(texts)
    n_words = np.diff(first_word)
    doc = np.repeat(np.arange(len(texts)), n_words)
    end = first_word[1:][doc]  # the word after each word's text
    index = np.arange(hashes.shape[0])
    combined = np.zeros_like(hashes)
    for k in range(ngram):
        at = index + k
        inside = at < end
        combined += (
            np.where(inside, hashes[np.minimum(at, hashes.shape[0] - 1)], 0)
            * (_SHINGLE_MULT[k % _SHINGLE_MULT.shape[0]])
        )
    keep = (index + ngram <= end) | ((index == first_word[:-1][doc]) & (n_words[doc] < ngram))
    per_doc = np.bincount(doc[keep], minlength=len(texts))
    first = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(per_doc, out=first[1:])
    return _mix(combined[keep]), first


def signatures(texts: list[str], spec: NearDedupSpec) -> tuple[np.ndarray, np.ndarray]:
    """(len(texts), bands * rows) uint64 MinHash signatures, and which texts have one (a
    text without a word has none: its row is all ones and must not be keyed)."""
    values, first = shingles(texts, spec.ngram)
    mult, add = _perm_constants(spec.n_hashes)
    sigs = np.full((len(texts), spec.n_hashes), np.iinfo(np.uint64).max, dtype=np.uint64)
    doc = np.repeat(np.arange(len(texts)), np.diff(first))
    buf = np.empty((_CHUNK_SHINGLES, spec.n_hashes), dtype=np.uint64)
    for lo in range(0, values.shape[0], _CHUNK_SHINGLES):
        chunk, owner = values[lo : lo + _CHUNK_SHINGLES], doc[lo : lo + _CHUNK_SHINGLES]
        out = buf[: chunk.shape[0]]
        np.multiply(chunk[:, None], mult[None, :], out=out)
        out += add
        cut = np.flatnonzero(np.diff(owner, prepend=-1))
        docs = owner[cut]
        sigs[docs] = np.minimum(sigs[docs], np.minimum.reduceat(out, cut, axis=0))
    return sigs, np.diff(first) > 0


# ---------------------------------------------------------------------------
# 2. Band keys, partitions


def band_keys(sigs: np.ndarray, spec: NearDedupSpec) -> np.ndarray:
    """(n, bands) uint64: each band's ``rows`` values and the band's index hashed."""
    n = sigs.shape[0]
    bands = sigs.reshape(n, spec.bands, spec.rows) * _BAND_MULT[: spec.rows]
    keys = bands.sum(axis=2, dtype=np.uint64)
    keys += (np.arange(spec.bands, dtype=np.uint64) + np.uint64(1)) * _BAND_SALT
    return _mix(keys)


def partition(keys: np.ndarray, positions: np.ndarray, n: int) -> list[np.ndarray]:
    """Band keys (n_docs, bands) of documents at ``positions`` -> n int64 arrays of rows
    (key, position), one per partition, by key mod n."""
    flat = keys.reshape(-1)
    rows = np.empty((flat.shape[0], 2), dtype=np.int64)
    rows[:, 0] = flat.view(np.int64)
    rows[:, 1] = np.repeat(positions.astype(np.int64), keys.shape[1] if keys.ndim == 2 else 1)
    which = flat % np.uint64(n)
    return [rows[which == p] for p in range(n)]


# ---------------------------------------------------------------------------
# 3. Candidates (one reducer per partition)


def pack(unit: np.ndarray, position: np.ndarray) -> np.ndarray:
    """(unit, position) as one int64 that sorts in source order."""
    return (unit.astype(np.int64) << _UNIT_SHIFT) | position.astype(np.int64)


def unpack(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ids >> _UNIT_SHIFT, ids & ((1 << _UNIT_SHIFT) - 1)


def candidates(units: list[int], parts: list[np.ndarray]) -> np.ndarray:
    """One reducer: ``parts[i]`` are unit ``units[i]``'s rows of this partition. Returns
    int64 (m, 2) edges (document, the first document of a bucket it shares), packed ids,
    unique and sorted; the document always comes after the first."""
    if not parts or not sum(p.shape[0] for p in parts):
        return np.zeros((0, 2), dtype=np.int64)
    rows = np.concatenate(parts)
    unit = np.repeat(np.asarray(units, dtype=np.int64), [p.shape[0] for p in parts])
    ids = pack(unit, rows[:, 1])
    order = np.lexsort((ids, rows[:, 0]))
    key, ids = rows[order, 0], ids[order]
    first = _first_of_group(key, ids)
    member = ids != first  # the first of a bucket (and its repeats in other bands) aside
    return _unique_edges(np.stack([ids[member], first[member]], axis=1))


def _first_of_group(key: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Rows sorted by ``key`` (and ``values`` within a key): each row's group's first
    value (the least)."""
    starts = np.ones(key.shape[0], dtype=bool)
    starts[1:] = key[1:] != key[:-1]
    return values[np.maximum.accumulate(np.where(starts, np.arange(key.shape[0]), 0))]


def _unique_edges(edges: np.ndarray) -> np.ndarray:
    if not edges.shape[0]:
        return edges.reshape(0, 2)
    order = np.lexsort((edges[:, 1], edges[:, 0]))
    edges = edges[order]
    new = np.ones(edges.shape[0], dtype=bool)
    new[1:] = (edges[1:, 0] != edges[:-1, 0]) | (edges[1:, 1] != edges[:-1, 1])
    return edges[new]


# ---------------------------------------------------------------------------
# 4. Clusters: connected components over R partitions of whole units, in rounds
#
# Kiveris et al., "Connected Components in MapReduce and Beyond" (SoCC 2014): two
# operations that map an edge set to one with the same components and no more edges,
# each one shuffle keyed by a node, alternated until the edges stop changing; then every
# component is a star around its least node (O(log^2 n) rounds; a chain of 100,000
# documents in random order takes 15). An edge (a, b) always has a > b: packed ids, so
# "least" is "first in source order".

# Arcs (two per edge, 16 bytes each) one partition holds on average: 4M arcs, a task's
# peak of about 300 MiB (bench/bench_clusters.py measures about 150 bytes per edge).
ARCS_PER_PARTITION = 4 << 20


def cluster_partitions(n_edges: int, n_units: int) -> int:
    """R: enough partitions for ``2 * n_edges`` arcs, at most one per unit."""
    return max(1, min(n_units, -(-2 * n_edges // ARCS_PER_PARTITION)))


def _split(rows: np.ndarray, n: int) -> list[np.ndarray]:
    """(k, 2) rows -> n arrays by the partition of column 0's node: its unit's, so one
    partition holds whole units (a fix task reads one partition's result)."""
    which = (rows[:, 0] >> _UNIT_SHIFT) % n
    return [rows[which == p] for p in range(n)]


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return _unique_edges(np.concatenate(pieces)) if pieces else np.zeros((0, 2), np.int64)


def scatter(edges: np.ndarray, n: int) -> list[np.ndarray]:
    """Edges -> arcs (node, neighbour) both ways, split by the node's partition: a band
    reducer's edges as the first large-star's input, and each small-star's output."""
    return _split(np.concatenate([edges, edges[:, ::-1]]).reshape(-1, 2), n)


def large_star(pieces: list[np.ndarray], n: int) -> tuple[list[np.ndarray], bytes, np.ndarray]:
    """One partition: every node links each larger neighbour to the least of itself and
    its neighbours. Returns the new edges by the partition of their larger node, a
    digest of the arcs taken in (the same in every partition as the round before: the
    edges stopped changing), and the arcs from a larger to a smaller node: once stopped,
    the partition's near-duplicates (near-duplicate, first of its cluster), sorted."""
    arcs = _joined(pieces)  # sorted by node
    digest = hashlib.blake2b(arcs.tobytes(), digest_size=16).digest()
    least = np.minimum(arcs[:, 0], _first_of_group(arcs[:, 0], arcs[:, 1]))
    up = arcs[:, 1] > arcs[:, 0]
    out = np.stack([arcs[up, 1], least[up]], axis=1)
    return _split(out, n), digest, arcs[arcs[:, 0] > arcs[:, 1]]


def small_star(pieces: list[np.ndarray], n: int) -> list[np.ndarray]:
    """One partition: every node links itself and each smaller neighbour to the least of
    these. Returns the new edges as arcs both ways, by partition."""
    edges = _joined(pieces)  # (node of this partition, a smaller neighbour), sorted
    least = _first_of_group(edges[:, 0], edges[:, 1])
    out = np.concatenate([np.stack([edges[:, 1], least], axis=1),
                          np.stack([edges[:, 0], least], axis=1)])  # fmt: skip
    return scatter(_unique_edges(out[out[:, 0] != out[:, 1]]), n)


def components(reduced: list[np.ndarray], n: int = 1, call=None) -> tuple[np.ndarray, int]:
    """All reducers' edges through ``n`` partitions in one process, the same calls the
    Ray job runs as tasks: int64 (k, 2) rows (near-duplicate, the first document of its
    component), sorted, and the rounds taken. ``call(step, *args)`` runs each step
    (default: directly; bench/bench_clusters.py traces each one's memory)."""
    call = call or (lambda step, *args: step(*args))
    arcs = [call(scatter, edges, n) for edges in reduced]
    seen, rounds = None, 0
    while True:
        rounds += 1
        large = [call(large_star, [a[p] for a in arcs], n) for p in range(n)]
        digests = [digest for _, digest, _ in large]
        if digests == seen:
            rows = np.concatenate([removed for _, _, removed in large])
            return rows[np.argsort(rows[:, 0], kind="stable")], rounds
        seen = digests
        arcs = [call(small_star, [out[p] for out, _, _ in large], n) for p in range(n)]


def of_unit(unit: int, removed: np.ndarray) -> dict[int, tuple[int, int]]:
    """Unit ``unit``'s near-duplicates: position -> (unit, position) of the kept one."""
    lo, hi = np.searchsorted(removed[:, 0], [unit << _UNIT_SHIFT, (unit + 1) << _UNIT_SHIFT])
    _, positions = unpack(removed[lo:hi, 0])
    kept_unit, kept_position = unpack(removed[lo:hi, 1])
    return {
        p: (u, k)
        for p, u, k in zip(
            positions.tolist(), kept_unit.tolist(), kept_position.tolist(), strict=True
        )
    }


def units_of(removed: np.ndarray) -> np.ndarray:
    """The units that hold a near-duplicate (sorted)."""
    return np.unique(removed[:, 0] >> _UNIT_SHIFT)
