"""ERNIE 1.0 (Sun et al., 2019): BERT's architecture, trained with knowledge masking.

What makes ERNIE is its pretraining data, not its network: phrases and named entities are
masked as whole units, in stages (the ``ernie`` objective, pipeline/objectives/ernie.py).
The network is BERT's (transformers' ErnieForPreTraining is BertForPreTraining with an
optional task-type embedding, which ERNIE 1.0 does not use), so this module is Bert under
its own name, with ERNIE 1.0-base's defaults.
"""

from __future__ import annotations

from pipeline.models.bert import Bert, BertConfig


class ErnieConfig(BertConfig):
    """ERNIE 1.0-base: 12 layers, hidden 768, 12 heads (BERT-base's shape)."""


class Ernie(Bert):
    def __init__(self, config: ErnieConfig):
        super().__init__(config)
