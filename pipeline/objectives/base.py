"""What every pretraining objective shares: batch keys, units, layouts, the base class.

An objective turns documents into training examples without doing any I/O itself.
The loader (``pipeline.loader.stream``) owns the I/O and asks the objective three
things, always with the example's own seeded ``numpy.random.Generator``:

1. ``layout(order, n)``: how an epoch's documents (in the epoch's order, with their
   token counts ``n``, known from the shard indexes alone) are cut into *units*, one unit per example. The
   layout maps a unit number to its ``Unit`` (which token ranges of which documents)
   without reading any document, so the loader can seek straight to any batch; it can
   be built over a slice of the epoch (``offset``, ``total``: see ``Layout``).
2. ``needs(unit, rng, pool)``: the global ids of the documents the example reads
   (the unit's own ones, plus e.g. a random partner document for NSP drawn from ``pool``).
3. ``make_example(unit, docs, rng)``: numpy arrays of one example; ``collate`` stacks
   them into the batch of torch tensors the model and ``loss`` consume.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
import torch

from pipeline.data.shards import Document

# What the trainer passes to the model; everything else in a batch is a label.
MODEL_INPUT_KEYS = ("input_ids", "token_type_ids", "attention_mask", "position_ids", "document_ids")
IGNORE_INDEX = -100  # label of positions without a loss (torch's cross_entropy default)


class Piece(NamedTuple):
    """Tokens [start, stop) of one document, optionally followed by the end-of-document token."""

    doc: int  # global document id (row of the loader's document table)
    start: int
    stop: int
    eod: bool = False


class Unit(NamedTuple):
    """The source of one example. ``key`` identifies it independently of the epoch
    (so static masking can seed on it); ``pieces`` are read in order.
    (NamedTuples, not dataclasses: the loader creates one per example.)"""

    key: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def docs(self) -> list[int]:
        return list(dict.fromkeys(p.doc for p in self.pieces))


class Layout(ABC):
    """An epoch's documents cut into units; built from token counts only.

    Each document takes an *extent* on the layout's axis (its number of windows, or its
    tokens plus the separator after it in a joined stream); the epoch is the documents'
    extents end to end, and a unit is a range of that axis. A layout can be built over any
    contiguous slice of the epoch order: ``offset`` is the extent before the slice and
    ``total`` the whole epoch's, so the loader lays out only the shuffle groups a batch
    needs (``pipeline.loader.stream``), and a slice gives the same units as the whole.
    """

    def __init__(self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None):
        self.order = np.asarray(order, dtype=np.int64)
        self.n = np.asarray(n, dtype=np.int64)  # tokens of document order[i]
        if self.n.shape != self.order.shape:
            raise ValueError(f"{self.order.shape[0]} documents but {self.n.shape[0]} lengths")
        self.cum = offset + np.concatenate([[0], np.cumsum(self.extent(self.n))])
        self.n_units = self.count(int(self.cum[-1]) if total is None else total)

    @abstractmethod
    def extent(self, n: np.ndarray) -> np.ndarray:
        """Extent of documents of ``n`` tokens (n > 0)."""

    @abstractmethod
    def count(self, total: int) -> int:
        """Units of an epoch whose documents' extents sum to ``total``."""

    @abstractmethod
    def first_unit(self, offsets: np.ndarray) -> np.ndarray:
        """The first unit that belongs to a document starting at these extent offsets
        (callers clamp it to ``n_units``)."""

    @abstractmethod
    def span(self, u):
        """The extent range [lo, hi) that unit ``u`` reads; ``u`` may be an int or an
        int64 array (then lo and hi are arrays, element by element)."""

    @abstractmethod
    def unit(self, u: int) -> Unit:
        """Unit number ``u`` (0 <= u < n_units) in layout order; its span must lie in
        this layout's slice."""

    def boundary(self, positions: np.ndarray) -> np.ndarray:
        """First unit of the documents at these positions of the slice (non-decreasing)."""
        return np.minimum(self.first_unit(self.cum[positions]), self.n_units)

    def units(self, us: np.ndarray) -> list[Unit]:
        return [self.unit(int(u)) for u in us]


class WindowLayout(Layout):
    """Each document cut into ``ceil(n / window)`` windows of near-equal length.

    Equal cuts (sizes differ by at most one token, none longer than ``window``) avoid
    the tiny tail window a plain ``[k*window, (k+1)*window)`` cut leaves behind.
    """

    def __init__(self, order, n, window: int, offset: int = 0, total: int | None = None):
        self.window = window
        super().__init__(order, n, offset, total)

    def extent(self, n: np.ndarray) -> np.ndarray:
        return -(-n // self.window)

    def count(self, total: int) -> int:
        return total

    def first_unit(self, offsets: np.ndarray) -> np.ndarray:
        return offsets

    def span(self, u):  # u: an int or an array
        return u, u + 1

    def unit(self, u: int) -> Unit:
        return self.units(np.array([u]))[0]

    def units(self, us: np.ndarray) -> list[Unit]:  # vectorized
        i = np.searchsorted(self.cum, us, side="right") - 1
        k, n = self.cum[i + 1] - self.cum[i], self.n[i]
        w = us - self.cum[i]
        cols = (self.order[i], w, n * w // k, n * (w + 1) // k)
        return [
            Unit(key=(d, x), pieces=(Piece(d, a, b),))
            for d, x, a, b in zip(*(c.tolist() for c in cols), strict=True)
        ]


class JoinedLayout(Layout):
    """Units on the stream ``doc SEP doc SEP ...`` of the epoch (each document's extent:
    its tokens and the separator after it); subclasses choose where units start and end."""

    def extent(self, n: np.ndarray) -> np.ndarray:
        return n + 1

    def pieces(self, lo: int, hi: int, eod: bool) -> tuple[Piece, ...]:
        """The documents' token ranges in stream positions [lo, hi); with ``eod`` a range
        that reaches a document's separator says so (``Piece.eod``), else separators
        are left out."""
        first = int(np.searchsorted(self.cum, lo, side="right")) - 1
        last = int(np.searchsorted(self.cum, hi - 1, side="right")) - 1
        out = []
        for i in range(first, min(last, self.n.shape[0] - 1) + 1):
            start, n = int(self.cum[i]), int(self.n[i])
            a, b = max(lo - start, 0), min(hi - start, n + 1)  # the separator sits at n
            if eod:
                out.append(Piece(int(self.order[i]), a, min(b, n), eod=b > n))
            elif a < min(b, n):  # (a window may open on the separator after a document)
                out.append(Piece(int(self.order[i]), a, min(b, n)))
        return tuple(out)


def special_table(vocab_size: int, special_ids: set[int]) -> np.ndarray:
    """Boolean lookup: is this id a special token (never masked, never a random replacement)?"""
    table = np.zeros(vocab_size, dtype=bool)
    table[sorted(i for i in special_ids if 0 <= i < vocab_size)] = True
    return table


class Objective(ABC):
    """Base of all objectives; see the module docstring for how the loader drives it."""

    kind: str = ""
    static: bool = False  # True: an example's randomness does not depend on the epoch
    # True: batch row j gets consecutive units of the epoch's stream (in layout order,
    # no unit shuffle), so a model with memory (Transformer-XL, XLNet) sees the segment
    # before the current one in its memory. See pipeline.loader.stream._Core.units.
    recurrent_rows: bool = False
    # True: make_batch also takes ``position`` (this rank's micro-batch number in the run,
    # None for evaluation passes) and ``total_batches`` is set by the trainer
    # (train.max_steps * grad_accum), so the examples can follow the training progress
    # (ERNIE's masking stages) while staying a pure function of the stream position.
    staged: bool = False
    total_batches: int | None = None

    def __init__(self, seq_len: int, vocab_size: int):
        self.seq_len = seq_len
        self.vocab_size = vocab_size

    def attach(self, model: torch.nn.Module) -> None:
        """Called once with the freshly built model, before DeepSpeed wraps it: the place
        for objectives that need the model itself (e.g. initialising a distillation
        student from its teacher). Default: nothing."""
        return None

    @abstractmethod
    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout: ...

    def needs(self, unit: Unit, rng: np.random.Generator, pool: np.ndarray) -> list[int]:
        return unit.docs

    @abstractmethod
    def make_example(
        self, unit: Unit, docs: list[Document], rng: np.random.Generator
    ) -> dict[str, np.ndarray]: ...

    def make_batch(
        self, units: list[Unit], docs: list[list[Document]], rngs: list[np.random.Generator]
    ) -> dict[str, torch.Tensor]:
        """The batch of these units; row i equals ``make_example(units[i], docs[i], rngs[i])``
        (objectives may override this to vectorize across the batch)."""
        return self.collate(
            [self.make_example(u, d, r) for u, d, r in zip(units, docs, rngs, strict=True)]
        )

    def collate(self, examples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.stack([e[k] for e in examples])) for k in examples[0]}

    @abstractmethod
    def loss(
        self, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...
