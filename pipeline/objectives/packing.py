"""RoBERTa's input packing (Liu et al., 2019, section 4.2): FULL-SENTENCES and DOC-SENTENCES.

FULL-SENTENCES: each input is whole sentences taken contiguously from the epoch's
document stream, crossing document boundaries, with a separator token (``</s>``)
between two documents. DOC-SENTENCES: the same, but an input never crosses a document
(inputs near a document's end are shorter and padded).

A layout must be computable from token counts alone (the loader seeks to any batch
without reading documents), so units are laid out on tokens and snapped to sentences
when the example is built:

- the units are token windows of ``L`` (= seq_len - 2) positions: for FULL-SENTENCES
  windows of the stream ``doc, SEP, doc, SEP, ...`` (``StreamLayout``), for
  DOC-SENTENCES the near-equal windows of each document (``WindowLayout``);
- a sentence belongs to the unit in whose window it *starts*: the example drops the
  tail of the sentence the window opens inside (the previous unit has it) and
  completes the window's last sentence past the window's end;
- the result is cut to ``L`` tokens: a sentence is only cut when it does not fit,
  which happens when the window's last sentence runs on further than the first one
  was dropped by (or a single sentence is longer than ``L``). A window in which no
  sentence starts (inside a sentence longer than ``L``) keeps its raw tokens.

So every sentence of the epoch is in exactly one example, nearly always whole.
"""

from __future__ import annotations

import numpy as np

from pipeline.data.shards import Document
from pipeline.objectives.base import JoinedLayout, Unit

Segment = tuple[Document, int, int]  # tokens [start, stop) of a document


class StreamLayout(JoinedLayout):
    """Windows of ``window`` positions of the stream ``doc SEP doc SEP ...`` of the epoch."""

    def __init__(self, order, n, window: int, offset: int = 0, total: int | None = None):
        self.window = window
        super().__init__(order, n, offset, total)

    def count(self, total: int) -> int:
        return -(-(total - 1) // self.window)  # no separator after the last document

    def first_unit(self, offsets: np.ndarray) -> np.ndarray:
        return offsets // self.window

    def span(self, u):  # u: an int or an array
        return u * self.window, (u + 1) * self.window

    def unit(self, u: int) -> Unit:
        return Unit(key=(u,), pieces=self.pieces(*self.span(u), eod=False))


def sentence_ends(doc: Document) -> np.ndarray:
    """Token offsets where the document's sentences end, the last one at its end."""
    n = doc.n_tokens
    return np.append(doc.sents[doc.sents < n].astype(np.int64), n)


def snap_to_sentences(doc: Document, start: int, stop: int) -> tuple[int, int]:
    """The sentences of ``doc`` that start in [start, stop), as a token range (it may run
    past ``stop``); an empty range when no sentence starts there."""
    ends = sentence_ends(doc)
    starts = np.concatenate([[0], ends[:-1]])
    k = int(np.searchsorted(starts, start, side="left"))  # first start at or after start
    if k == starts.shape[0] or starts[k] >= stop:
        return stop, stop
    return int(starts[k]), int(ends[np.searchsorted(ends, stop, side="left")])


def sentence_segments(unit: Unit, docs: list[Document], length: int) -> list[Segment]:
    """The unit's pieces snapped to whole sentences (see the module docstring), in order,
    at most ``length`` tokens plus one separator between consecutive documents."""
    by_id = dict(zip(unit.docs, docs, strict=True))
    raw = [(by_id[p.doc], p.start, p.stop) for p in unit.pieces]
    snapped = [(doc, *snap_to_sentences(doc, a, b)) for doc, a, b in raw]
    snapped = [s for s in snapped if s[1] < s[2]]
    return fit(snapped or raw, length)


def fit(segments: list[Segment], length: int) -> list[Segment]:
    """Keep segments (each after the first costs one separator) until ``length`` tokens
    are used; the last one kept is cut at the end."""
    out, used = [], 0
    for doc, a, b in segments:
        room = length - used - (1 if out else 0)
        if room <= 0:
            break
        b = min(b, a + room)
        out.append((doc, a, b))
        used += (b - a) + (1 if len(out) > 1 else 0)
    return out
