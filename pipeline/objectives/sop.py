"""MLM + sentence-order prediction (ALBERT; Lan et al., 2019, section 3.1).

NSP's negatives come from another document, so a model can solve NSP by topic alone.
SOP's negatives are the *same* two consecutive segments of one document with their
order swapped: only coherence tells them apart. An example never reads a second
document (``needs`` is the unit's own document).

Built like ``mlm+nsp`` (see ``pipeline.objectives.nsp``) from one window of at most
``seq_len - 3`` tokens of a document:

1. target length ``seq_len - 3``, or with ``short_seq_probability`` a random shorter one;
2. the window's sentences up to the target form the chunk; A ends at a random sentence
   boundary inside it (inside the sentence when the chunk is one sentence), B is the
   rest of the chunk: A and B are consecutive segments of the document;
3. the longer of A and B is trimmed until the pair fits (BERT's truncate_seq_pair);
4. with ``swap_probability`` the two change places: ``[CLS] B [SEP] A [SEP]``, label 1;
   else ``[CLS] A [SEP] B [SEP]``, label 0 (transformers' ``sentence_order_label``);
5. masked as ``mlm`` masks (whole-word and n-gram masking included).

The model's ``sop_logits`` are used (ALBERT); a model without an SOP head but with a
binary pair head (BERT's ``nsp_logits``) trains that head on the SOP task instead.
"""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives.base import Layout, Objective, Unit, WindowLayout
from pipeline.objectives.mlm import MaskingMixin, Rows, masked_lm_loss
from pipeline.objectives.nsp import Span, sentence_bounds, split_chunk, target_length, truncate_pair


def sop_pair(
    rng: np.random.Generator, sents: np.ndarray, start: int, stop: int, max_tokens: int, p: float
) -> tuple[Span, Span]:
    """(A, B): consecutive segments of the window [start, stop) of a document with
    sentence ends ``sents``, trimmed to ``max_tokens`` together (steps 1-3 above)."""
    bounds = sentence_bounds(sents, start, stop)
    target = target_length(rng, max_tokens, p)
    a_end, chunk_end = split_chunk(rng, bounds, target)
    a, b = truncate_pair(rng, (start, a_end), (a_end, chunk_end), max_tokens)
    return a, b


class MlmSopObjective(MaskingMixin, Objective):
    kind = "mlm+sop"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(seq_len, vocab_size)
        self._init_masking(cfg.mlm, roles, vocab_size, special_ids)
        self.sop = cfg.sop
        self.max_tokens = seq_len - 3  # room for [CLS] A [SEP] B [SEP]

    def layout(
        self, order: np.ndarray, n: np.ndarray, offset: int = 0, total: int | None = None
    ) -> Layout:
        return WindowLayout(order, n, self.max_tokens, offset, total)

    def new_rows(self, batch_size: int) -> Rows:
        rows = super().new_rows(batch_size)
        rows.arrays["sop_labels"] = np.zeros(batch_size, dtype=np.int64)
        return rows

    def fill(self, rows: Rows, i: int, unit: Unit, docs: list[Document], rng) -> None:
        (piece,), (doc,) = unit.pieces, docs
        a, b = sop_pair(
            rng, doc.sents, piece.start, piece.stop, self.max_tokens,
            self.sop.short_seq_probability,
        )  # fmt: skip
        swapped = bool(rng.random() < self.sop.swap_probability)
        first, second = (b, a) if swapped else (a, b)
        n1, n2 = first[1] - first[0], second[1] - second[0]
        sep_1, sep_2 = n1 + 1, n1 + n2 + 2
        ids = rows.arrays["input_ids"][i]
        ids[0], ids[sep_1], ids[sep_2] = self.cls_id, self.sep_id, self.sep_id
        rows.segment(i, 1, doc, *first)
        rows.segment(i, sep_1 + 1, doc, *second)
        rows.arrays["token_type_ids"][i, sep_1 + 1 : sep_2 + 1] = self.segment_b
        rows.arrays["attention_mask"][i, : sep_2 + 1] = 1
        rows.arrays["sop_labels"][i] = swapped

    def loss(self, outputs, batch):
        mlm_loss, mlm_acc = masked_lm_loss(outputs["mlm_logits"], batch["mlm_labels"])
        logits = outputs.get("sop_logits", outputs.get("nsp_logits"))
        if logits is None:
            raise ConfigError(
                "objective.kind=mlm+sop needs a model with a sentence-order head "
                f"(outputs 'sop_logits' or 'nsp_logits'); this model returns {sorted(outputs)}"
            )
        logits = logits.float()
        sop_loss = F.cross_entropy(logits, batch["sop_labels"])
        sop_acc = (logits.detach().argmax(-1) == batch["sop_labels"]).float().mean()
        metrics = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_acc": mlm_acc,
            "sop_loss": sop_loss.detach(),
            "sop_acc": sop_acc,
        }
        return mlm_loss + sop_loss, metrics
