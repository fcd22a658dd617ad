"""Exact dedup at any corpus size: "first occurrence in source order wins".

A document's place in source order is (unit, position). Each unit's keys (16-byte
blake2b of the cleaned text) are hash-partitioned into P partitions (``partition``); one
reducer per partition (``duplicates``) sorts its keys with their places and marks every
occurrence after the first. Its memory is 1/P of the corpus's keys (32 bytes a
document), so P grows with the corpus (``n_partitions``) and no process ever holds all
keys. The result does not depend on P: a key lives in exactly one partition. A reducer
returns its duplicates in min(P, units) groups by unit (``by_unit_group``), and a fix
task takes its unit's group of each: 1/P of the duplicates at most, not all of them.
"""

from __future__ import annotations

import numpy as np

KEY_BYTES = 16
# Keys one reducer holds at most (32 bytes each with its place: 256 MiB).
KEYS_PER_PARTITION = 8 << 20
_AVG_DOC_BYTES = 256  # a pessimistic input bytes per document, to size P from the input


def n_partitions(input_bytes: int) -> int:
    return max(1, -(-input_bytes // (_AVG_DOC_BYTES * KEYS_PER_PARTITION)))


def partition(keys: bytes, positions: np.ndarray, n: int) -> list[np.ndarray]:
    """Keys (concatenated, 16 bytes each) and their positions -> n int64 arrays of rows
    (key high, key low, position), one per partition, by the key's high 8 bytes mod n."""
    words = np.frombuffer(keys, dtype=">u8").reshape(-1, 2).astype(np.uint64)
    rows = np.empty((positions.shape[0], 3), dtype=np.int64)
    rows[:, :2] = words.view(np.int64)
    rows[:, 2] = positions
    which = words[:, 0] % np.uint64(n)
    return [rows[which == p] for p in range(n)]


def duplicates(units: list[int], parts: list[np.ndarray]) -> np.ndarray:
    """One reducer: ``parts[i]`` are unit ``units[i]``'s rows of this partition. Returns
    int64 (n, 2) rows (unit, position) of every occurrence after the first, sorted."""
    if not parts:
        return np.zeros((0, 2), dtype=np.int64)
    rows = np.concatenate(parts)
    unit = np.concatenate(
        [np.full(p.shape[0], u, dtype=np.int64) for u, p in zip(units, parts, strict=True)]
    )
    order = np.lexsort((rows[:, 2], unit, rows[:, 1], rows[:, 0]))
    hi, lo = rows[order, 0], rows[order, 1]
    repeat = np.zeros(order.shape[0], dtype=bool)
    repeat[1:] = (hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])
    dups = np.stack([unit[order][repeat], rows[order, 2][repeat]], axis=1)
    return dups[np.lexsort((dups[:, 1], dups[:, 0]))] if dups.size else dups.reshape(0, 2)


def by_unit_group(dups: np.ndarray, n: int) -> list[np.ndarray]:
    """A reducer's duplicates -> n arrays by ``unit % n`` (each still sorted): a fix task
    fetches its unit's group from every reducer, about 1/n of the duplicates, never all."""
    which = dups[:, 0] % n
    return [dups[which == g] for g in range(n)]


def of_unit(unit: int, reduced: list[np.ndarray]) -> set[int]:
    """The positions of unit ``unit`` that any reducer marked as duplicates."""
    out: set[int] = set()
    for dups in reduced:
        lo, hi = np.searchsorted(dups[:, 0], [unit, unit + 1])
        out.update(dups[lo:hi, 1].tolist())
    return out
