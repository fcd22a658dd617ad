"""ERNIE 1.0's knowledge masking (kind ``ernie``): mask whole phrases and entities, in stages.

BERT masks tokens independently, so it learns collocations of pieces more than units of
meaning. ERNIE selects *masking units* and masks every token of a selected unit; the
units grow over three stages of training (``objective.ernie.stages``):

* ``basic``: the basic language units: a token (a character) for Chinese, a whole word
  for other text (``words.npy``);
* ``phrase``: phrases. For Chinese, jieba's words (``words.npy`` of a Chinese document
  holds jieba word starts, so a multi-character word is one unit); for other text, runs
  of 2..``phrase_max_words`` consecutive words drawn at random inside each sentence (a
  chunker's phrases approximated without a parser; the run lengths come from the
  example's own seeded generator, so they are dynamic like the masking);
* ``entity``: the entity mentions in ``spans.npy`` (written by ``plm data prepare
  --entities FILE``) are units of their own, over the phrase units of the rest of the text.

Each unit is selected with probability ``objective.mlm.probability`` and then all of its
tokens are selected (the 80/10/10 mask/random/keep choice stays per token, as in
whole-word masking), so about the same share of tokens is predicted in every stage. A
unit cut by the example's window keeps its part inside the window.

Stages follow the training progress: stage k runs while the run's optimizer step is below
``until_k * train.max_steps`` (the stream passes each batch's position; see
``Objective.staged``). Evaluation always uses the last stage, so eval losses stay
comparable across stages. The examples are otherwise BERT's ``mlm+nsp`` ones (ERNIE 1.0
kept next-sentence prediction); ``objective.ernie.nsp: false`` gives MLM-only examples.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives.mlm import MlmObjective, Rows, word_starts_in
from pipeline.objectives.nsp import MlmNspObjective

MASKINGS = ("basic", "phrase", "entity")


def is_chinese(doc: Document) -> bool:
    return doc.meta.get("language") == "zh"


def phrase_starts(
    words: np.ndarray, sent_starts: np.ndarray, rng: np.random.Generator, max_words: int
) -> np.ndarray:
    """Starts (token positions) of random runs of 2..max_words words, restarting at every
    sentence start. ``words``: ascending word starts; ``sent_starts``: sentence starts
    (each one a word start too)."""
    sentence = np.searchsorted(sent_starts, words, side="right")  # sentence of every word
    sizes = rng.integers(2, max_words + 1, size=words.shape[0])
    out = []
    k = 0
    while k < words.shape[0]:
        out.append(words[k])
        end = min(k + int(sizes[k]), words.shape[0])
        # a run never crosses into the next sentence
        nxt = k + 1
        while nxt < end and sentence[nxt] == sentence[k]:
            nxt += 1
        k = nxt
    return np.asarray(out, dtype=np.int64)


def entity_spans_in(doc: Document, start: int, stop: int) -> np.ndarray:
    """The doc's entity spans overlapping tokens [start, stop), clipped and made relative."""
    if doc.spans is None or doc.spans.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    spans = doc.spans.astype(np.int64).reshape(-1, 2)
    spans = spans[(spans[:, 1] > start) & (spans[:, 0] < stop)]
    return np.clip(spans, start, stop) - start


def unit_starts(
    doc: Document,
    start: int,
    stop: int,
    masking: str,
    rng: np.random.Generator,
    phrase_max_words: int,
) -> np.ndarray:
    """[stop - start] bool: True where a masking unit of this stage starts."""
    n = stop - start
    starts = np.zeros(n, dtype=bool)
    if n == 0:
        return starts
    zh = is_chinese(doc)
    if masking == "basic" and zh:
        starts[:] = True  # a Chinese basic unit is a character (a token)
        return starts
    words = word_starts_in(doc, start, stop)
    if masking == "basic" or zh:  # English basic: words; Chinese phrase: jieba words
        starts[words] = True
    else:
        sents = doc.sents[(doc.sents > start) & (doc.sents < stop)].astype(np.int64) - start
        starts[phrase_starts(words, np.concatenate([[0], sents]), rng, phrase_max_words)] = True
    if masking == "entity":
        spans = entity_spans_in(doc, start, stop)
        starts[spans[:, 0]] = True
        ends = spans[:, 1][spans[:, 1] < n]
        starts[ends] = True  # the token after an entity starts a new unit
        inside = np.zeros(n + 1, dtype=np.int64)  # +1 at s+1, -1 at e: interiors (s, e)
        np.add.at(inside, spans[:, 0] + 1, 1)
        np.add.at(inside, spans[:, 1], -1)
        starts[np.cumsum(inside)[:n] > 0] = False  # overlapping mentions merge into one unit
    return starts


class KnowledgeRows(Rows):
    """Rows whose ``word_start`` marks the current stage's masking units."""

    def __init__(self, batch_size, seq_len, pad_id, masking: str, phrase_max_words: int):
        super().__init__(batch_size, seq_len, pad_id, whole_word=True)
        self.masking, self.phrase_max_words = masking, phrase_max_words
        self.rng: np.random.Generator | None = None  # the example being filled

    def segment(self, i: int, at: int, doc: Document, start: int, stop: int) -> None:
        n = stop - start
        self.arrays["input_ids"][i, at : at + n] = doc.tokens[start:stop]
        self.maskable[i, at : at + n] = True
        self.word_start[i, at : at + n] = unit_starts(
            doc, start, stop, self.masking, self.rng, self.phrase_max_words
        )


class KnowledgeMasking:
    """Stage bookkeeping and unit-wise masking, mixed into the MLM(+NSP) objectives."""

    staged = True
    kind = "ernie"

    def _init_stages(self, cfg) -> None:
        self.ernie = cfg.ernie
        bounds = [s.until for s in self.ernie.stages]
        if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)) or bounds[-1] != 1.0:
            raise ConfigError(
                f"objective.ernie.stages: the 'until' fractions {bounds} must increase and the "
                "last must be 1.0 (the end of training)"
            )
        self.masking = self.ernie.stages[-1].masking  # the stage of the batch being built

    def stage_at(self, position: int | None) -> str:
        """The masking of the stage that micro-batch ``position`` of the run falls in."""
        stages = self.ernie.stages
        if position is None:
            return stages[-1].masking
        if not self.total_batches:
            raise RuntimeError(
                "ernie objective: total_batches is unset (the trainer sets it to "
                "train.max_steps * grad_accum); set it before building staged batches"
            )
        fraction = position / self.total_batches
        for stage in stages:
            if fraction < stage.until:
                return stage.masking
        return stages[-1].masking  # training past max_steps (e.g. raised on resume)

    def new_rows(self, batch_size: int) -> Rows:
        rows = KnowledgeRows(
            batch_size, self.seq_len, self.pad_id, self.masking, self.ernie.phrase_max_words
        )
        if self.ernie.nsp:
            rows.arrays["nsp_labels"] = np.zeros(batch_size, dtype=np.int64)
        return rows

    def fill(self, rows: KnowledgeRows, i: int, unit, docs, rng) -> None:
        rows.rng = rng
        super().fill(rows, i, unit, docs, rng)

    def make_batch(self, units, docs, rngs, position: int | None = None):
        self.masking = self.stage_at(position)
        return {k: torch.from_numpy(v) for k, v in self._arrays(units, docs, rngs).items()}

    def make_example(self, unit, docs, rng, position: int | None = None):
        self.masking = self.stage_at(position)
        return {k: v[0] for k, v in self._arrays([unit], [docs], [rng]).items()}


class ErnieObjective(KnowledgeMasking, MlmNspObjective):
    """Knowledge-masked MLM + NSP (ERNIE 1.0)."""

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(cfg, roles, vocab_size, seq_len, special_ids)
        self._init_stages(cfg)


class ErnieMlmObjective(KnowledgeMasking, MlmObjective):
    """Knowledge-masked MLM alone (``objective.ernie.nsp: false``)."""

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(cfg, roles, vocab_size, seq_len, special_ids)
        self._init_stages(cfg)


def ernie_objective(cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
    cls = ErnieObjective if cfg.ernie.nsp else ErnieMlmObjective
    return cls(cfg, roles, vocab_size, seq_len, special_ids)
