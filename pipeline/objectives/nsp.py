"""MLM + next-sentence prediction, built the way BERT's create_pretraining_data builds it.

A unit is one window of at most ``seq_len - 3`` tokens of a document (see
``WindowLayout``); its sentences are the window cut at the document's sentence ends
(``sents.npy``), so only the window's first and last sentence may be partial. Per example:

1. target length: ``seq_len - 3``, or with ``short_seq_probability`` a random length
   in [2, seq_len - 3] (BERT's short sequences, so fine-tuning lengths are seen);
2. a chunk: the window's sentences from its start until the target is reached; the
   rest of the window is not used (one example per unit);
3. A: the chunk's sentences up to a random sentence boundary; when the chunk is one
   sentence, A ends at a random token inside it, so B can still be its true
   continuation and the positive rate stays exactly ``1 - random_next_probability``;
4. B: with ``random_next_probability`` (decided before any document is read, since it
   decides whether the loader must read a partner) a run of whole sentences from a random
   position of another document, long enough for the target; else the rest of the chunk;
5. the longer of A and B loses tokens until the pair fits, each token from the front or
   the back with probability 1/2 (BERT's truncate_seq_pair, drawn in closed form);
6. ``[CLS] A [SEP] B [SEP] [PAD]...``, token_type_ids 0 for [CLS] A [SEP] and 1 (0 for a
   model with ``type_vocab_size: 1``) for
   B [SEP], nsp_labels 0 = B is the continuation, 1 = B is random (as in transformers),
   then masked as ``mlm`` masks.

The partner document comes from ``pool``: with dynamic masking the loader passes the
documents of the current shuffle group (already cached, so no extra read), with static
masking the whole split (so a static example is the same in every epoch).
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from pipeline.data.shards import Document
from pipeline.objectives.base import Layout, Objective, Unit, WindowLayout
from pipeline.objectives.mlm import MaskingMixin, Rows, masked_lm_loss

Span = tuple[int, int]  # [start, stop) token range of a document


def draw_partner(rng: np.random.Generator, p: float, doc: int, pool: np.ndarray) -> int | None:
    """A random other document with probability ``p`` (None: B is the true next)."""
    if rng.random() >= p or pool.shape[0] < 2:
        return None
    while True:  # reject the document itself (at most a few tries: pool has >= 2 ids)
        other = int(pool[rng.integers(pool.shape[0])])
        if other != doc:
            return other


def sentence_bounds(sents: np.ndarray, start: int, stop: int) -> np.ndarray:
    """[start, every sentence end strictly inside (start, stop), stop] (sents: sorted ends)."""
    inside = sents[np.searchsorted(sents, start, "right") : np.searchsorted(sents, stop, "left")]
    return np.concatenate([[start], inside, [stop]]).astype(np.int64)


def target_length(rng: np.random.Generator, max_tokens: int, short_seq_probability: float) -> int:
    if rng.random() < short_seq_probability:
        return int(rng.integers(2, max_tokens + 1))
    return max_tokens


def split_chunk(rng: np.random.Generator, bounds: np.ndarray, target: int) -> tuple[int, int]:
    """(end of A, end of the chunk) for a window cut at ``bounds``."""
    start = int(bounds[0])
    last = min(int(np.searchsorted(bounds, start + target)), bounds.shape[0] - 1)
    chunk_end = int(bounds[last])
    if last >= 2:  # two or more sentences: cut at a sentence boundary
        return int(bounds[rng.integers(1, last)]), chunk_end
    if chunk_end - start >= 2:  # one sentence: cut inside it
        return start + int(rng.integers(1, chunk_end - start)), chunk_end
    return chunk_end, chunk_end


def random_segment(rng: np.random.Generator, partner: Document, target: int) -> Span:
    """Whole sentences of ``partner`` from a random sentence start, >= target tokens
    (or to the end of the document)."""
    n = partner.n_tokens
    ends = partner.sents[(partner.sents > 0) & (partner.sents < n)].astype(np.int64)
    starts = np.concatenate([[0], ends])
    start = int(starts[rng.integers(starts.shape[0])])
    later = ends[ends >= start + target]
    return start, int(later[0]) if later.shape[0] else n


def truncate_pair(rng: np.random.Generator, a: Span, b: Span, max_tokens: int) -> tuple[Span, Span]:
    """Trim the longer of A and B (B on ties) one token at a time until both fit, each
    token from the front or the back with probability 1/2. Same distribution as BERT's
    loop: first the longer shrinks to the shorter, then they shrink alternately."""
    la, lb = a[1] - a[0], b[1] - b[0]
    excess = la + lb - max_tokens
    if excess <= 0:
        return a, b
    first = min(excess, abs(la - lb))
    rest = excess - first
    cut_a = (first if la > lb else 0) + rest // 2
    cut_b = (first if la <= lb else 0) + rest - rest // 2

    def trim(span: Span, k: int) -> Span:
        front = int(rng.binomial(k, 0.5)) if k else 0
        return span[0] + front, span[1] - (k - front)

    return trim(a, cut_a), trim(b, cut_b)


class MlmNspObjective(MaskingMixin, Objective):
    kind = "mlm+nsp"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self._init_masking(cfg.mlm, roles, vocab_size, special_ids)
        self.nsp = cfg.nsp
        self.max_tokens = seq_len - 3  # room for [CLS] A [SEP] B [SEP]

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        return WindowLayout(order, n, self.max_tokens, offset, total)

    def needs(self, unit: Unit, rng: np.random.Generator, pool: np.ndarray) -> list[int]:
        (piece,) = unit.pieces
        p = self.nsp.random_next_probability
        if piece.stop - piece.start < 2:
            p = 1.0  # a one-token window has no continuation to offer
        partner = draw_partner(rng, p, piece.doc, pool)
        return [piece.doc] if partner is None else [piece.doc, partner]

    def new_rows(self, batch_size: int) -> Rows:
        rows = super().new_rows(batch_size)
        rows.arrays["nsp_labels"] = np.zeros(batch_size, dtype=np.int64)
        return rows

    def fill(self, rows: Rows, i: int, unit: Unit, docs: list[Document], rng) -> None:
        (piece,), doc = unit.pieces, docs[0]
        bounds = sentence_bounds(doc.sents, piece.start, piece.stop)
        target = target_length(rng, self.max_tokens, self.nsp.short_seq_probability)
        a_end, chunk_end = split_chunk(rng, bounds, target)
        a: Span = (piece.start, a_end)
        if len(docs) == 2:
            b_doc = docs[1]
            b = random_segment(rng, b_doc, max(1, target - (a_end - piece.start)))
        else:
            b_doc, b = doc, (a_end, chunk_end)
        a, b = truncate_pair(rng, a, b, self.max_tokens)
        # [CLS] A [SEP] B [SEP]: token types 0 up to the first [SEP], 1 after it
        na, nb = a[1] - a[0], b[1] - b[0]
        sep_a, sep_b = na + 1, na + nb + 2
        ids = rows.arrays["input_ids"][i]
        ids[0], ids[sep_a], ids[sep_b] = self.cls_id, self.sep_id, self.sep_id
        rows.segment(i, 1, doc, *a)
        rows.segment(i, sep_a + 1, b_doc, *b)
        rows.arrays["token_type_ids"][i, sep_a + 1 : sep_b + 1] = self.segment_b
        rows.arrays["attention_mask"][i, : sep_b + 1] = 1
        rows.arrays["nsp_labels"][i] = len(docs) == 2  # 1: B is a random document

    def loss(self, outputs, batch):
        mlm_loss, mlm_acc = masked_lm_loss(outputs["mlm_logits"], batch["mlm_labels"])
        nsp_logits = outputs["nsp_logits"].float()
        nsp_loss = F.cross_entropy(nsp_logits, batch["nsp_labels"])
        nsp_acc = (nsp_logits.detach().argmax(-1) == batch["nsp_labels"]).float().mean()
        metrics = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_acc": mlm_acc,
            "nsp_loss": nsp_loss.detach(),
            "nsp_acc": nsp_acc,
        }
        return mlm_loss + nsp_loss, metrics
