"""DistilBERT's distillation (kind ``distill``): a student learns from a frozen teacher.

The examples are MLM's (``[CLS] window [SEP]``, dynamically masked with ``objective.mlm``;
no NSP, as in the paper). The loss is

    L = alpha_ce * T^2 * CE(softmax(teacher / T), softmax(student / T))   soft targets
      (computed as KL(teacher || student): CE minus the teacher's entropy, same gradients)
      + alpha_mlm * MLM(student, labels)                                  hard targets
      + alpha_cos * mean(1 - cos(student h, teacher h))                   hidden states

the soft cross-entropy and the cosine over every real (non-padding) token, the cosine on
the final hidden states, as the paper's code does; defaults alpha 5 / 2 / 1, T = 2 are the
ones it trained DistilBERT with. T^2 keeps the soft-target gradients' scale independent of T.

The teacher (``objective.distill.teacher``: a bundle folder, ``runs:/RUN_ID/model`` or
``models:/NAME@ALIAS``) is loaded by ``attach``, which also initialises the student from it:
embeddings (the teacher's segment-A embedding folded into the positions, so a one-segment
input embeds exactly as in the teacher), the MLM head, and student layer i from teacher
layer ``layers[i]`` (default every other layer, ending on the last: 1, 3, 5, 7, 9, 11 of
12). The teacher lives in the objective, not in the model: DeepSpeed never sees it, it gets
no gradient, and the bundle holds only the student. It runs in eval mode under no_grad.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError
from pipeline.objectives.mlm import MlmObjective, masked_lm_loss


def default_layers(n_teacher: int, n_student: int) -> list[int]:
    """Every other teacher layer for a half-depth student: student i <- teacher
    round((i + 1) * n_teacher / n_student) - 1, so the last layers match."""
    return [round((i + 1) * n_teacher / n_student) - 1 for i in range(n_student)]


def resolve_bundle(ref: str, tracking_uri: str | None = None) -> Path:
    """A local bundle folder for a folder path, ``runs:/...`` or ``models:/...`` URI."""
    from pipeline.models.bundle import BundleNotFound, fetch_bundle

    try:
        return fetch_bundle(ref, tracking_uri)
    except BundleNotFound as err:
        raise ConfigError(f"objective.distill.teacher: {err}") from None


def load_teacher(ref: str, tracking_uri: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    from pipeline.models.bundle import load_bundle

    model, config = load_bundle(resolve_bundle(ref, tracking_uri))
    for p in model.parameters():
        p.requires_grad_(False)
    model.set_unpad(True)  # its outputs are read at the real tokens only
    return model.eval(), config


def check_same_tokenizer(teacher_vocab: dict[str, Any], student_meta: dict[str, Any], where: str):
    """The student must read the teacher's token ids: same tokenizer file (sha256)."""
    t, s = teacher_vocab.get("sha256"), student_meta.get("sha256")
    if t != s or teacher_vocab.get("vocab_size") != student_meta.get("vocab_size"):
        raise ConfigError(
            f"objective.distill.teacher: the teacher's tokenizer (sha256 {t}, vocab "
            f"{teacher_vocab.get('vocab_size')}) is not the data's tokenizer {where} (sha256 "
            f"{s}, vocab {student_meta.get('vocab_size')}); prepare the data with the "
            "teacher's tokenizer (its bundle holds tokenizer.json)"
        )


@torch.no_grad()
def init_student(student: nn.Module, teacher: nn.Module, layers: list[int]) -> None:
    """Copy the teacher's embeddings, MLM head and the chosen layers into the student."""
    s_cfg, t_cfg = student.config, teacher.config
    for key in ("hidden_size", "num_heads", "intermediate_size", "activation"):
        if getattr(s_cfg, key) != getattr(t_cfg, key):
            raise ConfigError(
                f"model.{key}: the student has {getattr(s_cfg, key)!r}, the teacher "
                f"{getattr(t_cfg, key)!r}; they must match to initialise from the teacher"
            )
    if s_cfg.max_positions > t_cfg.max_positions:
        raise ConfigError(
            f"model.max_positions: {s_cfg.max_positions} > the teacher's {t_cfg.max_positions}"
        )
    if len(layers) != s_cfg.num_layers or not all(0 <= i < t_cfg.num_layers for i in layers):
        raise ConfigError(
            f"objective.distill.layers: {layers} must name {s_cfg.num_layers} teacher layers "
            f"(0..{t_cfg.num_layers - 1}), one per student layer"
        )
    se, te = student.embeddings, teacher.embeddings
    se.word.weight.copy_(te.word.weight)
    P = s_cfg.max_positions
    segment_a = te.token_type.weight[0] if hasattr(te, "token_type") else 0.0
    se.position.weight.copy_(te.position.weight[:P] + segment_a)
    se.ln.load_state_dict(te.ln.state_dict())
    for i, j in enumerate(layers):
        student.blocks[i].load_state_dict(teacher.blocks[j].state_dict())
    student.mlm_head.load_state_dict(teacher.mlm_head.state_dict())


class DistillObjective(MlmObjective):
    kind = "distill"

    def __init__(self, cfg, roles: dict, vocab_size: int, seq_len: int, special_ids: set[int]):
        super().__init__(cfg, roles, vocab_size, seq_len, special_ids)
        self.distill = cfg.distill
        if not self.distill.teacher:
            raise ConfigError(
                "objective.distill.teacher: missing; give the teacher's bundle folder, "
                "runs:/RUN_ID/model or models:/NAME@ALIAS"
            )
        self.roles = dict(roles)
        self.teacher: nn.Module | None = None
        self.teacher_config: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers build examples only: never ship the teacher to them.
        return {**self.__dict__, "teacher": None}

    def attach(self, model: nn.Module) -> None:
        if not hasattr(model, "mlm_head") or hasattr(model.embeddings, "token_type"):
            raise ConfigError(
                "objective.kind=distill trains a DistilBERT student: set model.arch: distilbert"
            )
        self.teacher, self.teacher_config = load_teacher(
            self.distill.teacher, self.distill.tracking_uri
        )
        vocab = self.teacher_config["vocab"]
        teacher_roles = {k: int(v) for k, v in vocab.get("roles", {}).items()}
        if vocab["vocab_size"] != self.vocab_size or teacher_roles != self.roles:
            raise ConfigError(
                f"objective.distill.teacher: the teacher's tokenizer (sha256 "
                f"{vocab.get('sha256')}, vocab {vocab['vocab_size']}) differs from the data's "
                f"(vocab {self.vocab_size}); prepare the data with the teacher's tokenizer"
            )
        if not all(hasattr(self.teacher, a) for a in ("embeddings", "blocks", "mlm_head")):
            raise ConfigError(
                f"objective.distill.teacher: a {self.teacher_config['arch']} bundle cannot "
                "teach a DistilBERT; use a BERT-like teacher (bert, ernie)"
            )
        layers = self.distill.layers or default_layers(
            self.teacher.config.num_layers, model.config.num_layers
        )
        init_student(model, self.teacher, layers)

    def bind_data(self, data, model: nn.Module) -> None:
        """Called by the trainer with the data dir: same tokenizer file as the teacher's."""
        meta_path = Path(data.tokenizer_path).parent / "tokenizer_meta.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        check_same_tokenizer(self.teacher_config["vocab"], meta, f"({meta_path})")

    @torch.no_grad()
    def teacher_outputs(self, batch: dict[str, torch.Tensor], like: torch.Tensor):
        if self.teacher is None:
            raise RuntimeError("DistillObjective.loss before attach(): no teacher loaded")
        p = next(self.teacher.parameters())
        if p.device != like.device or p.dtype != like.dtype:  # follow the engine's device/dtype
            self.teacher.to(device=like.device, dtype=like.dtype)
        return self.teacher(
            input_ids=batch["input_ids"],
            token_type_ids=batch.get("token_type_ids"),
            attention_mask=batch.get("attention_mask"),
        )

    def loss(self, outputs, batch):
        V, T = self.vocab_size, self.distill.temperature
        teacher = self.teacher_outputs(batch, outputs["hidden_states"])
        real = batch["attention_mask"] > 0
        # only the real vocabulary: the padded columns of either model carry no information
        s_logits = outputs["mlm_logits"][real][:, :V].float()
        t_logits = teacher["mlm_logits"][real][:, :V].float()
        # KL(teacher || student) = soft cross-entropy - the teacher's entropy: the same
        # gradients, and 0 when the student matches the teacher (the paper's code does so too)
        t_log = F.log_softmax(t_logits / T, -1)
        s_log = F.log_softmax(s_logits / T, -1)
        ce_loss = (t_log.exp() * (t_log - s_log)).sum(-1).mean() * T * T
        mlm_loss, mlm_acc = masked_lm_loss(outputs["mlm_logits"], batch["mlm_labels"])
        s_h = outputs["hidden_states"][real].float()
        t_h = teacher["hidden_states"][real].float()
        cos_loss = (1.0 - F.cosine_similarity(s_h, t_h, dim=-1)).mean()
        d = self.distill
        loss = d.alpha_ce * ce_loss + d.alpha_mlm * mlm_loss + d.alpha_cos * cos_loss
        metrics = {
            "ce_loss": ce_loss.detach(),
            "mlm_loss": mlm_loss.detach(),
            "mlm_acc": mlm_acc,
            "cos_loss": cos_loss.detach(),
        }
        return loss, metrics
