"""The resumable training stream: shards -> objective examples -> batches, by (seed, epoch, cursor).

How an epoch is laid out (from the manifest and the shard indexes alone, no document read):

* The split's documents get global ids in manifest order (shard by shard) and are cut
  into *chunks* of ``chunk_docs`` consecutive documents of one shard.
* The objective's layout gives each document an *extent* (its number of windows for
  mlm/nsp, its tokens plus a separator for the joined streams of clm/plm/full_sentences);
  at start the stream reads every document's token count once (4 bytes each, the blocks'
  ``docs.npy``) and keeps only per-chunk sums: O(chunks) memory, no per-document table.
* Epoch ``e``: the chunks are put in a seeded random order and taken ``group_chunks``
  at a time into *groups*. From the per-chunk sums alone, each group's start on the
  layout's axis, the epoch's number of units and each group's first unit are known.
* A group is listed only when a batch needs it: its non-empty documents, in a seeded
  shuffle (by (seed, epoch, group)); the objective lays out that group (with the groups
  next to it when a unit crosses a group boundary), so any unit is found in O(log n).
  The epoch's order is the groups' orders end to end, and a slice's units equal those
  of a layout of the whole epoch (tested).
* The units of each group are shuffled once more (seeded by (seed, epoch, group)): the
  epoch's unit order. Global batch g is units [g*W*B, (g+1)*W*B) of it and rank r takes
  [g*W*B + r*B, g*W*B + (r+1)*B), so every rank gets exactly floor(n_units / (W*B))
  batches per epoch (the remainder is dropped; the next epoch reshuffles everything).

So the start costs one read of the token counts and O(chunks) arithmetic, and a batch
lays out one or two groups of ~2048 documents: a data dir 8x as large starts as fast.

Why groups rather than one permutation of all units: reading a document is the
expensive step (its block's crc32 on first use, then slices of the block's members),
and a document yields several units (windows) and serves as the random partner of others
(NSP). Within a group, all of that happens while the document sits in a small LRU
cache, so each document is decoded about once per epoch per process, instead of once
per unit. A group spans ``chunk_docs * group_chunks`` (default 2048) documents drawn
from 32 random places of the corpus: a seeded, seekable equivalent of webdataset's
shard shuffling plus a shuffle buffer of that size.

Determinism and resuming: batch (epoch, g) is a pure function of the manifest, the seed,
the objective and (epoch, g); every example draws from its own Generator seeded by
(seed, split, epoch, unit) (without the epoch when the objective is static, so a
static example is the same in every epoch). So the state is just (epoch, next batch),
saved as the global sample cursor; resuming computes batch g directly, reading only
the documents it needs through the shard index (``DataDir.read`` seeks to the sample),
and any number of loader workers gives the same batches: worker k of n builds batches
k, k+n, ... and the main process puts them back in order.

Checks: when the stream is built (before any worker starts, so all ranks agree on the
usable shards and hence on the number of batches) every shard's size is compared with
the manifest and, with ``verify_checksums``, every (small) block index is hashed: the
start-up cost grows with the number of shards, not with the bytes of data. The data
itself is checked block by block as it is read (crc32 in the index, ``DataDir.read``),
so a corrupt byte never reaches a batch: it raises ``ShardError`` naming the shard. With
``on_bad_shard="skip"`` a bad shard is left out of the plan and counted
(``skipped_shards``) instead; to find corrupt ones before the plan is made, that mode
re-hashes every shard of the split at start (its cost: reading all the data once).

The train split cycles epochs forever; any other split is one fixed pass (epoch 0's
order, the same batches at every evaluation).

Mixtures (``data.sources``, a list of ``MixSource``): each source is laid out as above on
its own and cycles its own epochs. Mixture position p reads source k's unit j as
``_Interleave`` puts them (deterministic, by weight: any window of n positions holds
n * w_k units of source k, give or take one), and source unit j is unit j mod n_k of
that source's epoch j // n_k. A nominal epoch e covers positions [e * N, (e + 1) * N)
(N: all sources' units together), so the cursor (epoch, samples) names the same
positions on any world size; batch rows carry ``source_ids``. Recurrent objectives give
each row of the global batch to one source (rows shared by weight) and read that source's
stream row-wise as above, so a row's memory never crosses sources.
"""

from __future__ import annotations

import hashlib
import math
import struct
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data.shards import DataDir, Document, ShardError
from pipeline.errors import ConfigError
from pipeline.objectives.base import Layout, Objective, Unit

# 2: groups laid out lazily: the same seed gives another order than 1.
STATE_VERSION = 2
# Seed-sequence salts, so the different random streams never coincide.
_ORDER, _UNITS, _EXAMPLE, _GROUP = 11, 12, 13, 14


class _RngPool:
    """One Generator per batch row, re-seeded in place for every example.

    An example's Generator is numpy's PCG64 with state and increment taken from a
    blake2b hash of its key (seed, salt, split, epoch, unit): as independent as
    ``default_rng(key)`` would make it, but without a SeedSequence per example,
    which would cost more than building the example.
    """

    def __init__(self):
        self._generators: list[np.random.Generator] = []

    def get(self, keys: list[list[int]]) -> list[np.random.Generator]:
        while len(self._generators) < len(keys):
            self._generators.append(np.random.Generator(np.random.PCG64(0)))
        for generator, key in zip(self._generators, keys, strict=False):
            digest = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=32).digest()
            generator.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {
                    "state": int.from_bytes(digest[:16], "little"),
                    "inc": int.from_bytes(digest[16:], "little") | 1,
                },
                "has_uint32": 0,
                "uinteger": 0,
            }
        return self._generators[: len(keys)]


class _EpochPlan:
    """Epoch ``e``'s order, built lazily: the chunk order and every group's place on the
    layout's axis come from per-chunk sums (O(chunks)); a group's documents are listed,
    shuffled and laid out only when a batch reads from it."""

    def __init__(self, source: _Source, epoch: int):
        self.source, self.epoch = source, epoch
        rng = np.random.default_rng([source.seed, _ORDER, source.split_salt, epoch])
        self.chunks = rng.permutation(source.chunk_extent.shape[0])
        firsts = np.arange(0, self.chunks.shape[0], source.group_chunks)
        extents = np.add.reduceat(source.chunk_extent[self.chunks], firsts)
        self.offsets = np.concatenate([[0], np.cumsum(extents)])  # each group's start, total
        self.total = int(self.offsets[-1])
        self.n_units = source.rule.count(self.total)
        # The units of group k are [span_starts[k], span_starts[k + 1]).
        first_units = np.minimum(source.rule.first_unit(self.offsets[:-1]), self.n_units)
        self.span_starts = np.append(first_units, self.n_units)
        self._groups: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._layouts: OrderedDict[tuple[int, int], Layout] = OrderedDict()
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._ahead: set[int] = set()  # groups whose next group was asked for

    def locate(self, positions: np.ndarray, shuffle: bool = True) -> tuple[list[Unit], np.ndarray]:
        """(units at these positions of the epoch's unit order, their groups); with
        ``shuffle=False`` the units keep the layout order inside their group."""
        groups = np.searchsorted(self.span_starts, positions, side="right") - 1
        self._look_ahead(int(groups.max()), int(positions.max()))
        units = positions.copy()
        if shuffle and groups.min() == groups.max():  # the usual case: one group
            start = int(self.span_starts[groups[0]])
            units = start + self._perm(int(groups[0]))[positions - start]
        elif shuffle:
            for group in np.unique(groups).tolist():
                inside = groups == group
                start = int(self.span_starts[group])
                units[inside] = start + self._perm(group)[positions[inside] - start]
        return self._units(units), groups

    def _look_ahead(self, group: int, position: int) -> None:
        """Past the middle of a group: the next group's blocks, fetched in the background
        while the rest of this one is read (a remote data dir; a local one has nothing to
        do). Not earlier, so a run that stops has fetched little it never read."""
        start, stop = (
            self.span_starts[group],
            self.span_starts[min(group + 1, len(self.span_starts) - 1)],
        )
        if group in self._ahead or position - start < (stop - start) // 2:
            return
        self._ahead.add(group)
        self.source.data.will_need(self.chunk_ranges(group + 1))

    def _units(self, us: np.ndarray) -> list[Unit]:
        """Units by number, each from a layout of the groups its span touches."""
        lo, hi = self.source.rule.span(us)
        last_group = self.offsets.shape[0] - 2
        firsts = np.searchsorted(self.offsets, lo, side="right") - 1
        lasts = np.minimum(np.searchsorted(self.offsets, hi - 1, side="right") - 1, last_group)
        keys = firsts * (last_group + 1) + lasts
        if keys.min() == keys.max():  # the usual case: all in one group (or pair)
            return self._layout(*divmod(int(keys[0]), last_group + 1)).units(us)
        out: list[Unit] = [None] * us.shape[0]  # type: ignore[list-item]
        for key in np.unique(keys).tolist():
            rows = np.flatnonzero(keys == key)
            layout = self._layout(*divmod(key, last_group + 1))
            for row, unit in zip(rows.tolist(), layout.units(us[rows]), strict=True):
                out[row] = unit
        return out

    def _layout(self, first: int, last: int) -> Layout:
        """The objective's layout of groups first..last (their documents in epoch order)."""
        layout = self._layouts.get((first, last))
        if layout is None:
            parts = [self.group(g) for g in range(first, last + 1)]
            order, n = (np.concatenate(column) for column in zip(*parts, strict=True))
            offset = int(self.offsets[first])
            layout = self.source.objective.layout(order, n, offset, self.total)
            self._layouts[(first, last)] = layout
            if len(self._layouts) > self.source.cache_groups:
                self._layouts.popitem(last=False)
        return layout

    def group(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(global ids, token counts) of the group's non-empty documents, shuffled."""
        found = self._groups.get(group)
        if found is not None:
            return found
        src = self.source
        ids, lengths = [], []
        chunks = self.chunks[group * src.group_chunks : (group + 1) * src.group_chunks]
        for c in chunks.tolist():
            shard, first = int(src.chunk_shard[c]), int(src.chunk_first[c])
            n = src.data.doc_lengths(src.shards[shard], first, first + int(src.chunk_size[c]))
            keep = np.flatnonzero(n > 0)
            ids.append(src.doc_base[shard] + first + keep)
            lengths.append(n[keep])
        # A remote data dir fetches this group's blocks in the background (the next
        # group's are asked for once half of this one is read: ``locate``).
        src.data.will_need(self.chunk_ranges(group))
        seed = [src.seed, _GROUP, src.split_salt, self.epoch, group]
        docs, n = np.concatenate(ids), np.concatenate(lengths)
        perm = np.random.default_rng(seed).permutation(docs.shape[0])
        found = self._groups[group] = (docs[perm], n[perm])
        if len(self._groups) > src.cache_groups:
            self._groups.popitem(last=False)
        return found

    def chunk_ranges(self, group: int) -> list[tuple[str, int, int]]:
        """(shard, first document, stop) of each chunk of a group, in the group's order."""
        src = self.source
        chunks = self.chunks[group * src.group_chunks : (group + 1) * src.group_chunks]
        return [
            (src.shards[int(src.chunk_shard[c])], int(src.chunk_first[c]),
             int(src.chunk_first[c] + src.chunk_size[c]))
            for c in chunks.tolist()
        ]  # fmt: skip

    def _perm(self, group: int) -> np.ndarray:
        perm = self._perms.get(group)
        if perm is None:
            seed = [self.source.seed, _UNITS, self.source.split_salt, self.epoch, group]
            size = int(self.span_starts[group + 1] - self.span_starts[group])
            perm = self._perms[group] = np.random.default_rng(seed).permutation(size)
            if len(self._perms) > self.source.cache_groups:
                self._perms.popitem(last=False)
        return perm

    def pool(self, group: int) -> np.ndarray:
        return self.group(group)[0]


class _Source:
    """One data dir's split as the stream reads it: per-chunk sums, lazy epoch plans and
    the decoded-document cache (see the module docstring). A copy lives in every loader
    worker."""

    def __init__(
        self,
        data: DataDir,
        split: str,
        shards: list[str],
        objective: Objective,
        seed: int,
        chunk_docs: int,
        group_chunks: int,
        cache_docs: int,
        cache_groups: int,
        cycle: bool,
    ):
        self.data, self.shards, self.objective = data, shards, objective
        self.split_salt = 0 if split == "train" else 1 + sum(split.encode())
        self.seed, self.group_chunks, self.cycle = seed, group_chunks, cycle
        self.cache_docs, self.cache_groups = cache_docs, cache_groups
        # The layout's rule (extents, unit count, spans) without documents.
        self.rule = objective.layout(np.zeros(0, np.int64), np.zeros(0, np.int64))
        # Chunks: runs of chunk_docs consecutive documents of one shard, empty ones
        # included (they take no extent, and are left out when a group is listed).
        # Global document id = doc_base[shard] + the document's number in its shard.
        # One pass over the documents' token counts (4 bytes each), nothing kept per
        # document: the start costs O(documents) reads and O(chunks) memory.
        columns: list[list[np.ndarray]] = [[], [], [], []]
        n_docs = []
        for s, name in enumerate(shards):
            n = data.doc_lengths(name)
            starts = np.arange(0, n.shape[0], chunk_docs)
            extent = np.where(n > 0, self.rule.extent(n), 0)
            columns[0].append(np.full(starts.shape[0], s, dtype=np.int64))
            columns[1].append(starts)
            columns[2].append(np.minimum(starts + chunk_docs, n.shape[0]) - starts)
            columns[3].append(np.add.reduceat(extent, starts) if starts.size else starts)
            n_docs.append(n.shape[0])
        self.chunk_shard, self.chunk_first, self.chunk_size, self.chunk_extent = (
            np.concatenate(c).astype(np.int64) for c in columns
        )
        self.doc_base = np.concatenate([[0], np.cumsum(n_docs)]).astype(np.int64)
        if not self.chunk_extent.any():
            raise ShardError(f"{data.where()}: split {split!r} has no non-empty documents")
        self._all_docs: np.ndarray | None = None
        self._plans: OrderedDict[int, _EpochPlan] = OrderedDict()
        self._cache: OrderedDict[int, Document] = OrderedDict()
        self.docs_read = 0
        self.n_units = self.plan(0).n_units

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_plans"], state["_cache"], state["docs_read"] = OrderedDict(), OrderedDict(), 0
        return state

    @property
    def all_docs(self) -> np.ndarray:
        """Every non-empty document of the split: the partner pool of static objectives
        (their examples must not depend on the epoch's groups). Built on first use."""
        if self._all_docs is None:
            ids = [
                self.doc_base[s] + np.flatnonzero(self.data.doc_lengths(name) > 0)
                for s, name in enumerate(self.shards)
            ]
            self._all_docs = np.concatenate(ids)
        return self._all_docs

    def plan(self, epoch: int) -> _EpochPlan:
        epoch = epoch if self.cycle else 0
        plan = self._plans.get(epoch)
        if plan is None:
            plan = self._plans[epoch] = _EpochPlan(self, epoch)
            if len(self._plans) > 2:
                self._plans.popitem(last=False)
        return plan

    def read(self, doc_id: int) -> Document:
        doc = self._cache.get(doc_id)
        if doc is not None:
            self._cache.move_to_end(doc_id)
            return doc
        s = int(np.searchsorted(self.doc_base, doc_id, side="right")) - 1
        shard, sample = self.shards[s], doc_id - int(self.doc_base[s])
        doc = self.data.read(shard, sample)
        self.docs_read += 1
        if doc.n_tokens and int(doc.tokens.max()) >= self.objective.vocab_size:
            raise ShardError(
                f"{self.data.where(shard)} document {sample} ({doc.key}) holds token id "
                f"{int(doc.tokens.max())} >= the vocabulary size {self.objective.vocab_size}: "
                "the shards and the tokenizer do not match"
            )
        self._cache[doc_id] = doc
        if len(self._cache) > self.cache_docs:
            self._cache.popitem(last=False)
        return doc


class _Interleave:
    """Which source each position of a weighted mixture reads, and its unit number there.

    Unit ``j`` of source ``k`` sits at time ``(j + 1/2) / w_k`` (weights normalised to sum
    1); the mixture's positions are all sources' units in time order (ties: lower source
    first). Any ``n`` consecutive positions hold ``n * w_k`` units of source ``k`` give or
    take one, and position ``p`` is found in O(sources) without walking from the start:
    at time ``p + 1/2`` about ``p`` units have passed, and a few steps correct the count.
    """

    def __init__(self, weights: list[float]):
        total = math.fsum(weights)
        self.w = [w / total for w in weights]

    def time(self, k: int, j: int) -> float:
        return (j + 0.5) / self.w[k]

    def _before(self, k: int, tau: float) -> int:
        """Units of source k whose time is < tau (the same ``time`` as every comparison)."""
        j = max(0, int(tau * self.w[k]))
        while self.time(k, j) < tau:
            j += 1
        while j > 0 and self.time(k, j - 1) >= tau:
            j -= 1
        return j

    def counts(self, position: int) -> list[int]:
        """Units of each source among the first ``position`` positions."""
        tau = position + 0.5
        c = [self._before(k, tau) for k in range(len(self.w))]
        n = sum(c)
        while n > position:  # drop the latest units until exactly `position` remain
            k = max((k for k in range(len(c)) if c[k]), key=lambda k: (self.time(k, c[k] - 1), k))
            c[k] -= 1
            n -= 1
        while n < position:
            k = min(range(len(c)), key=lambda k: (self.time(k, c[k]), k))
            c[k] += 1
            n += 1
        return c

    def take(self, position: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(sources, their unit numbers) of positions [position, position + n): the ``n``
        smallest (time, source) among each source's next ``n`` units, in one sort."""
        c = np.array(self.counts(position), dtype=np.int64)
        j = c[:, None] + np.arange(n, dtype=np.int64)  # (sources, n) candidate units
        k = np.broadcast_to(np.arange(c.shape[0], dtype=np.int64)[:, None], j.shape)
        t = (j + 0.5) / np.array(self.w)[:, None]  # the same float as ``time``
        first = np.lexsort((k.ravel(), t.ravel()))[:n]
        return k.ravel()[first], j.ravel()[first]


class _Core:
    """Everything needed to build any batch of one rank, from one source or a weighted
    mixture of several; a copy lives in every loader worker."""

    def __init__(
        self,
        sources: list[_Source],
        weights: list[float],
        objective: Objective,
        micro_batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        cycle: bool,
        step_samples: int | None = None,
    ):
        self.sources, self.objective = sources, objective
        self.B, self.seed, self.rank, self.W, self.cycle = (
            micro_batch_size, seed, rank, world_size, cycle,
        )  # fmt: skip
        self.split_salt = sources[0].split_salt
        self.mix = _Interleave(weights) if len(sources) > 1 else None
        self._rngs = _RngPool()
        # A mixture's epoch is nominal (as many units as the sources hold together): its
        # positions run on across epochs, each source cycling its own epochs as it goes.
        self.source_units = np.array([source.n_units for source in sources], dtype=np.int64)
        self.n_units = int(self.source_units.sum())
        # An epoch ends at a multiple of ``step_samples`` (the global batch of an optimizer
        # step): a step never straddles two epochs, and the cursor at every step boundary
        # is a multiple of any world size x micro batch that keeps that global batch, so
        # an elastic run resumes there on any of them. (Recurrent rows lay the epoch out
        # per row, by batches: not cut that way.)
        per_batch = self.W * self.B
        step = per_batch if objective.recurrent_rows else (step_samples or per_batch)
        if step % per_batch:
            raise ValueError(f"step_samples {step} is not a multiple of {per_batch}")
        self.batches_per_epoch = self.n_units // step * (step // per_batch)
        self.row_sources: list[tuple[int, int]] = []
        self.row_batches: list[int] = []
        if self.mix is not None and objective.recurrent_rows:
            # Each row of the global batch reads one source's stream to the end (so a
            # recurrent memory never crosses sources); rows are shared by the weights.
            ks, js = self.mix.take(0, self.W * self.B)
            self.row_sources = list(zip(ks.tolist(), js.tolist(), strict=True))
            rows = Counter(k for k, _ in self.row_sources)
            self.row_batches = [s.n_units // max(rows[k], 1) for k, s in enumerate(sources)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_rngs"] = _RngPool()
        return state

    @property
    def docs_read(self) -> int:
        return sum(source.docs_read for source in self.sources)

    def too_small(self) -> int | None:
        """A source (its index) that cannot fill its part of a global batch, -1 when the
        whole stream cannot, None when every batch can be made."""
        for k, source in enumerate(self.sources):
            if source.n_units == 0 or (self.row_batches and self.row_batches[k] == 0):
                return k
        return -1 if self.batches_per_epoch == 0 else None

    def units(self, epoch: int, index: int) -> list[tuple[int, int, Unit, int]]:
        """(source, source epoch, unit, group) of each row of this rank's batch."""
        rows = np.arange(self.rank * self.B, (self.rank + 1) * self.B)
        if self.mix is None:
            source = self.sources[0]
            if self.objective.recurrent_rows:
                # Row j of every global batch reads units [j * n, (j + 1) * n) of the
                # epoch's layout order in turn (n = batches per epoch), so a recurrent
                # model's memory of row j always holds the segment just before this one.
                positions, shuffle = rows * self.batches_per_epoch + index, False
            else:
                positions, shuffle = index * self.W * self.B + rows, True
            units, groups = source.plan(epoch).locate(positions, shuffle)
            return [(0, epoch, u, g) for u, g in zip(units, groups.tolist(), strict=True)]
        epoch = epoch if self.cycle else 0
        if self.objective.recurrent_rows:
            shuffle = False
            wanted = []  # (source, its epoch, position in that epoch) of each row
            for row in rows.tolist():
                k, j = self.row_sources[row]
                source_epoch, at = divmod(
                    epoch * self.batches_per_epoch + index, self.row_batches[k]
                )
                wanted.append((k, source_epoch, j * self.row_batches[k] + at))
            ks, epochs, positions = (np.array(c, dtype=np.int64) for c in zip(*wanted, strict=True))
        else:
            # Nominal epoch e covers mixture positions [e * n_units, (e + 1) * n_units), of
            # which its batches take the first batches_per_epoch * W * B: the cursor
            # (epoch, samples) names the same positions whatever W and B are.
            shuffle = True
            first = epoch * self.n_units + index * self.W * self.B + int(rows[0])
            ks, js = self.mix.take(first, self.B)
            epochs, positions = np.divmod(js, self.source_units[ks])
        out: list[tuple[int, int, Unit, int]] = [None] * self.B  # type: ignore[list-item]
        pairs = ks * (int(epochs.max()) + 1) + epochs
        for pair in np.unique(pairs).tolist():
            at = np.flatnonzero(pairs == pair)
            k, source_epoch = int(ks[at[0]]), int(epochs[at[0]])
            units, groups = self.sources[k].plan(source_epoch).locate(positions[at], shuffle)
            for i, unit, group in zip(at.tolist(), units, groups.tolist(), strict=True):
                out[i] = (k, source_epoch, unit, group)
        return out

    def batch(self, epoch: int, index: int) -> dict[str, torch.Tensor]:
        objective = self.objective
        rows = self.units(epoch, index)
        # An example's randomness: (seed, split, epoch of its source unless static, source
        # in a mixture, unit); the same unit met again in a later epoch draws anew.
        key = [self.seed, _EXAMPLE, self.split_salt]
        mixed = self.mix is not None
        rngs = self._rngs.get(
            [
                key + [0 if objective.static else e + 1] + [k] * mixed + list(unit.key)
                for k, e, unit, _ in rows
            ]
        )
        docs = []
        for (k, source_epoch, unit, group), rng in zip(rows, rngs, strict=True):
            source = self.sources[k]
            pool = source.all_docs if objective.static else source.plan(source_epoch).pool(group)
            docs.append([source.read(d) for d in objective.needs(unit, rng, pool)])
        units = [unit for _, _, unit, _ in rows]
        if objective.staged:  # ERNIE: masking stages by training progress (None: eval pass)
            position = epoch * self.batches_per_epoch + index if self.cycle else None
            batch = objective.make_batch(units, docs, rngs, position=position)
        else:
            batch = objective.make_batch(units, docs, rngs)
        if mixed:
            batch["source_ids"] = torch.tensor([row[0] for row in rows], dtype=torch.int64)
        return batch


class _WorkerBatches(IterableDataset):
    """Batches at global positions first + k, first + k + n, ... for worker k of n."""

    def __init__(self, core: _Core, first: int, stop: int | None):
        self.core, self.first, self.stop = core, first, stop

    def __iter__(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        position = self.first + k
        while self.stop is None or position < self.stop:
            epoch, index = divmod(position, self.core.batches_per_epoch)
            yield position, self.core.batch(epoch, index)
            position += n


@dataclass(frozen=True)
class MixSource:
    """One data dir of a mixture (``data.sources``): its weight and the name its metrics
    carry (``eval_loss/<name>``)."""

    path: str | Path | DataDir
    weight: float = 1.0
    name: str = ""


class PretrainStream:
    """Iterable of batch dicts (torch tensors) for one rank; see the module docstring.

    ``data``: one data dir, or a list of ``MixSource`` to read a weighted mixture (each
    batch then also holds ``source_ids``, the source of every row).
    ``chunk_docs``/``group_chunks``: locality of the shuffle (documents per chunk, chunks
    per group); ``cache_docs``: decoded documents kept per process (default: two groups).
    ``cycle``: cycle epochs forever (default for "train") or one fixed pass (other splits).
    """

    def __init__(
        self,
        data: str | Path | DataDir | list[MixSource],
        split: str,
        objective: Objective,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        verify_checksums: bool = True,
        on_bad_shard: str = "error",
        *,
        cycle: bool | None = None,
        step_samples: int | None = None,
        chunk_docs: int = 64,
        group_chunks: int = 32,
        cache_docs: int | None = None,
    ):
        if micro_batch_size < 1:
            raise ConfigError(f"train.micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if num_workers < 0:
            raise ConfigError(f"data.workers must be >= 0, got {num_workers}")
        if on_bad_shard not in ("error", "skip"):
            raise ConfigError(f"data.on_bad_shard must be 'error' or 'skip', got {on_bad_shard!r}")
        if seed < 0:
            raise ConfigError(f"train.seed must be >= 0 for the data stream, got {seed}")
        if chunk_docs < 1 or group_chunks < 1:
            raise ValueError("chunk_docs and group_chunks must be >= 1")
        mixture = data if isinstance(data, list) else [MixSource(data)]
        if not mixture or any(not m.weight > 0 for m in mixture):
            raise ConfigError("data.sources: give at least one source, every weight > 0")
        dirs = [m.path if isinstance(m.path, DataDir) else DataDir(m.path) for m in mixture]
        self.data = dirs[0]
        self.mixture = [
            MixSource(d, m.weight, m.name or d.name) for d, m in zip(dirs, mixture, strict=True)
        ]
        self.split, self.objective, self.num_workers = split, objective, num_workers
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.micro_batch_size = micro_batch_size
        self.cycle = split == "train" if cycle is None else cycle
        self.skipped_shards: list[str] = []
        self._skip_bad = on_bad_shard == "skip"
        cache = max(cache_docs if cache_docs is not None else 2 * chunk_docs * group_chunks, 1)
        sources = []
        for d in dirs:
            good = self._check_shards(d, verify_checksums, on_bad_shard)
            if not good:
                raise ShardError(f"{d.where()}: no usable shard left in split {split!r}")
            sources.append(
                _Source(
                    d,
                    split,
                    good,
                    objective,
                    seed,
                    chunk_docs,
                    group_chunks,
                    cache,
                    2 * micro_batch_size + 8,
                    self.cycle,
                )  # fmt: skip
            )
        weights = [m.weight for m in self.mixture]
        self._core = _Core(
            sources, weights, objective, micro_batch_size, seed, rank, world_size, self.cycle,
            step_samples,
        )  # fmt: skip
        small = self._core.too_small()
        if small is not None:
            where, n = (
                (self.data, self._core.n_units)
                if small < 0
                else (dirs[small], sources[small].n_units)
            )
            raise ConfigError(
                f"split {split!r} of {where.where()} yields {n} {objective.kind} examples, too "
                f"few for a global batch of world_size * train.micro_batch_size = "
                f"{world_size * micro_batch_size}; lower train.micro_batch_size or "
                "data.seq_len, or add data"
            )
        self.epoch, self.batch = 0, 0  # the next batch to hand out
        self._loader: DataLoader | None = None
        self._loader_key: tuple[int, int | None] | None = None

    # --- shards --------------------------------------------------------------------------
    def _check_shards(self, data: DataDir, verify: bool, on_bad: str) -> list[str]:
        """The split's usable shards; bad ones raise or are skipped and counted."""
        good = []
        for entry in data.shards(self.split):
            name = entry["name"]
            problem = self._shard_problem(data, entry, verify)
            if problem is None:
                good.append(name)
                continue
            message = f"{data.where(name)}: {problem}"
            if on_bad == "error":
                raise ShardError(
                    f"{message}; re-run `plm data prepare --force`, or set "
                    "data.on_bad_shard=skip to train without this shard"
                )
            warnings.warn(f"skipping bad shard {message}", stacklevel=3)
            self.skipped_shards.append(name if data is self.data else data.where(name))
        return good

    def _shard_problem(self, data: DataDir, entry: dict[str, Any], verify: bool) -> str | None:
        name = entry["name"]
        size = data.size(name)
        if size is None:
            return "missing"
        if "bytes" in entry and size != entry["bytes"]:
            return f"{size} bytes, the manifest says {entry['bytes']}"
        if verify and self._skip_bad and data.sha256(name) != entry["sha256"]:
            return "sha256 does not match the manifest (corrupted or changed)"
        index = entry.get("index", "")
        if verify and "index_sha256" in entry:
            try:
                if data.sha256(index) != entry["index_sha256"]:
                    return f"its index {Path(index).name} does not match the manifest's sha256"
            except (OSError, ShardError):
                return f"its index {Path(index).name} is missing or unreadable"
        try:
            n_docs = data.n_docs(entry["name"])
        except ShardError as err:
            return str(err)
        if n_docs != entry["n_docs"]:
            return f"index has {n_docs} documents, the manifest says {entry['n_docs']}"
        return None

    @property
    def n_skipped_shards(self) -> int:
        return len(self.skipped_shards)

    # --- sizes and direct access ---------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        return self._core.batches_per_epoch

    @property
    def units_per_epoch(self) -> int:
        return self._core.n_units

    @property
    def docs_read(self) -> int:
        """Documents decoded in this process (not in loader workers)."""
        return self._core.docs_read

    def batch_at(self, epoch: int, index: int) -> dict[str, torch.Tensor]:
        """Batch ``index`` of ``epoch`` for this rank, built directly (no iteration state)."""
        return self._core.batch(epoch, index)

    def document(self, doc_id: int, source: int = 0) -> Document:
        """A document by its global id (the ids in ``Unit.pieces``), through the cache."""
        return self._core.sources[source].read(doc_id)

    def units_at(self, epoch: int, index: int) -> list[Unit]:
        return [unit for _, _, unit, _ in self._core.units(epoch, index)]

    def sources_at(self, epoch: int, index: int) -> list[int]:
        """The mixture source (index into ``mixture``) of each row of a batch."""
        return [k for k, _, _, _ in self._core.units(epoch, index)]

    def source_units(self) -> list[int]:
        """Units of one epoch of each source (its own epoch, not the mixture's)."""
        return self._core.source_units.tolist()

    # --- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        bpe = self.batches_per_epoch
        first = self.epoch * bpe + self.batch if self.cycle else 0
        stop = None if self.cycle else bpe
        source = (
            self._in_process(first, stop)
            if self.num_workers == 0
            else self._from_workers(first, stop)
        )
        for position, batch in source:
            if self.cycle:
                self.epoch, self.batch = divmod(position + 1, bpe)
            yield batch

    def _in_process(self, first: int, stop: int | None):
        position = first
        while stop is None or position < stop:
            yield position, self._core.batch(*divmod(position, self.batches_per_epoch))
            position += 1

    def _from_workers(self, first: int, stop: int | None):
        if self._loader is None or self._loader_key != (first, stop):
            self.close()
            self._loader = DataLoader(
                _WorkerBatches(self._core, first, stop),
                batch_size=None,
                num_workers=self.num_workers,
                persistent_workers=True,
                in_order=False,  # deliver as ready; the re-order below restores the order
            )
            self._loader_key = (first, stop)
        pending: dict[int, dict[str, torch.Tensor]] = {}
        expected = first
        for position, batch in self._loader:  # re-order, whatever order workers deliver
            pending[position] = batch
            while expected in pending:
                yield expected, pending.pop(expected)
                expected += 1

    def close(self) -> None:
        """Stop the loader workers (they are persistent between passes otherwise)."""
        self._loader, self._loader_key = None, None

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "seed": self.seed,
            "objective": self.objective.kind,
            "units_per_epoch": self.units_per_epoch,
            "sources": [
                [m.weight, n] for m, n in zip(self.mixture, self.source_units(), strict=True)
            ],
            "epoch": self.epoch,
            "batch": self.batch,
            # The global sample cursor within the epoch: lets a run resume on another
            # world size or micro-batch size when the cursor falls on a batch boundary.
            "samples": self.batch * self.world_size * self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"the checkpoint's loader state has version {state.get('version')!r}, this plm "
                f"reads version {STATE_VERSION} (the data order changed between them): resume "
                "it with the plm that wrote it, or start a new train.out_dir"
            )
        for key, mine in (
            ("split", self.split),
            ("seed", self.seed),
            ("objective", self.objective.kind),
            ("units_per_epoch", self.units_per_epoch),
            ("sources", self.state_dict()["sources"]),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r}, this stream has "
                    f"{mine!r}: resuming would not continue the same stream (same data, "
                    "train.seed, objective, data.seq_len and data.sources are needed)"
                )
        per_batch = self.world_size * self.micro_batch_size
        if state["samples"] % per_batch:
            raise ValueError(
                f"loader state stopped after {state['samples']} samples of epoch "
                f"{state['epoch']}, not a multiple of world_size * micro_batch_size = {per_batch}"
            )
        self.epoch, self.batch = int(state["epoch"]), state["samples"] // per_batch
        self.close()


def units_per_epoch(data: DataDir, split: str, objective: Objective) -> int:
    """Examples (units) in one epoch of a data dir's split for this objective: what the
    stream computes at start, without checks or a batch size."""
    shards = [entry["name"] for entry in data.shards(split)]
    return _Source(data, split, shards, objective, 0, 64, 32, 1, 1, True).n_units
