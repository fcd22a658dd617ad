"""Pretraining objectives: pure, seeded example builders and their losses (no I/O).

``build_objective(cfg.objective, meta["roles"], meta["vocab_size"], cfg.data.seq_len)``
returns the ``Objective`` the loader (``pipeline.loader.stream.PretrainStream``) drives
and the trainer calls ``loss(outputs, batch)`` on. New kinds (wwm, sop, rtd, plm, bilm)
plug in by adding a class to ``OBJECTIVES``.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.config import ObjectiveSection
from pipeline.errors import ConfigError
from pipeline.objectives.base import (
    IGNORE_INDEX,
    MODEL_INPUT_KEYS,
    Layout,
    Objective,
    Piece,
    Unit,
    WindowLayout,
)
from pipeline.objectives.bilm import BilmObjective
from pipeline.objectives.clm import ClmObjective, RecurrentClmObjective
from pipeline.objectives.distill import DistillObjective
from pipeline.objectives.ernie import ernie_objective
from pipeline.objectives.mlm import MlmObjective
from pipeline.objectives.nsp import MlmNspObjective
from pipeline.objectives.plm import PlmObjective
from pipeline.objectives.rtd import RtdObjective
from pipeline.objectives.sop import MlmSopObjective
from pipeline.objectives.word2vec import Word2vecObjective

__all__ = [
    "IGNORE_INDEX",
    "MODEL_INPUT_KEYS",
    "OBJECTIVES",
    "Layout",
    "Objective",
    "Piece",
    "Unit",
    "WindowLayout",
    "build_objective",
]

# kind -> (class, roles it needs, smallest usable seq_len)
OBJECTIVES: dict[str, tuple[Callable[..., Objective], tuple[str, ...], int]] = {
    "mlm": (MlmObjective, ("pad", "cls", "sep", "mask"), 3),
    "mlm+nsp": (MlmNspObjective, ("pad", "cls", "sep", "mask"), 5),
    "rtd": (RtdObjective, ("pad", "cls", "sep", "mask"), 3),
    "distill": (DistillObjective, ("pad", "cls", "sep", "mask"), 3),
    "ernie": (ernie_objective, ("pad", "cls", "sep", "mask"), 5),
    "mlm+sop": (MlmSopObjective, ("pad", "cls", "sep", "mask"), 5),
    "clm": (ClmObjective, ("eod",), 1),
    "bilm": (BilmObjective, ("pad", "bos", "eos"), 3),
    "word2vec": (Word2vecObjective, ("pad",), 2),
    "clm-recurrent": (RecurrentClmObjective, ("eod",), 1),
    "plm": (PlmObjective, ("cls", "sep", "eod"), 6),
}


def build_objective(
    cfg: ObjectiveSection,
    roles: dict[str, int],
    vocab_size: int,
    seq_len: int,
    special_ids: set[int] | None = None,
) -> Objective:
    """The objective ``cfg.kind`` names. ``roles``/``vocab_size``: from tokenizer_meta.json
    (the real vocabulary, not the model's padded one); ``special_ids``: every special
    token id (default: the role ids), never masked nor drawn as a random replacement."""
    if cfg.kind not in OBJECTIVES:
        raise ConfigError(
            f"objective.kind: unknown objective {cfg.kind!r}; valid kinds: "
            + ", ".join(sorted(OBJECTIVES))
        )
    cls, needed, min_len = OBJECTIVES[cfg.kind]
    missing = [r for r in needed if r not in roles]
    if missing:
        raise ConfigError(
            f"objective.kind={cfg.kind} needs the tokenizer roles {missing}, which "
            "tokenizer_meta.json does not define; retrain the tokenizer with `plm data tokenizer`"
        )
    bad = {r: roles[r] for r in needed if not 0 <= int(roles[r]) < vocab_size}
    if bad:
        raise ConfigError(f"tokenizer roles {bad} lie outside the vocabulary of {vocab_size}")
    if seq_len < min_len:
        raise ConfigError(f"data.seq_len={seq_len} is too short for {cfg.kind} (min {min_len})")
    mlm = cfg.mlm
    if mlm.mask_fraction + mlm.random_fraction > 1:
        raise ConfigError(
            f"objective.mlm.mask_fraction ({mlm.mask_fraction}) + objective.mlm.random_fraction "
            f"({mlm.random_fraction}) must not exceed 1"
        )
    specials = {int(i) for i in roles.values()} | {int(i) for i in (special_ids or ())}
    return cls(cfg, roles, vocab_size, seq_len, specials)
