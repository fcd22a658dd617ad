"""Task heads on any backbone of the family, built only on the model contract:
``outputs["hidden_states"]`` ([B,T,H], final layer) and the class attribute ``causal``.
The backbone runs with ``pretrain_heads=False`` (``features_kwargs``): its pretraining
heads (the vocabulary projection above all) are never computed, since no task reads them.

- classification / regression: pool each view ([CLS] for encoders, the last real token,
  GPT's extract token, for causal models), sum the views (GPT's symmetric similarity),
  dropout, linear.
- multiple choice: pool each view (one per choice), linear -> one score per choice.
- tagging: the hidden state of each word's first sub-token, linear -> emissions per word;
  cross-entropy, or a linear-chain CRF (negative log-likelihood, Viterbi decoding).
- span QA: linear -> start / end logits over the tokens.
- train.mode=features (ELMo): the backbone is frozen; all its layers are mixed with a
  learned scalar mix (softmax weights s_j and a scale gamma) and a small BiLSTM task model
  reads the mix; the heads above sit on the BiLSTM.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE = -100


# ----------------------------------------------------------------------------- pieces


class ScalarMix(nn.Module):
    """ELMo's task-specific layer combination, gamma * sum_j softmax(s)_j * h_j, for models
    whose module has none of its own. Input [B, L, T, D] (as ELMo's outputs["layers"])."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(num_layers))
        self.gamma = nn.Parameter(torch.ones(()))

    def forward(self, layers: Tensor) -> Tensor:
        w = torch.softmax(self.weights, dim=0).to(layers.dtype)
        return self.gamma.to(layers.dtype) * torch.einsum("l,bltd->btd", w, layers)


class CRF(nn.Module):
    """Linear-chain CRF over word emissions [B,W,L] with a word mask [B,W] (prefix of True)."""

    def __init__(self, n_labels: int):
        super().__init__()
        self.start = nn.Parameter(torch.zeros(n_labels))
        self.end = nn.Parameter(torch.zeros(n_labels))
        self.trans = nn.Parameter(torch.zeros(n_labels, n_labels))  # [from, to]

    def nll(self, emissions: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        """Mean over the batch of -log p(tags | emissions)."""
        tags = tags.clamp(min=0)
        B, W, _ = emissions.shape
        mask = mask.clone()
        mask[:, 0] = True  # an example with no word still has a well-defined (empty) path
        ar = torch.arange(B, device=emissions.device)
        score = self.start[tags[:, 0]] + emissions[ar, 0, tags[:, 0]]
        alpha = self.start + emissions[:, 0]  # [B,L]
        for w in range(1, W):
            m = mask[:, w]
            step = self.trans[tags[:, w - 1], tags[:, w]] + emissions[ar, w, tags[:, w]]
            score = score + step * m
            nxt = torch.logsumexp(alpha[:, :, None] + self.trans + emissions[:, w, None, :], dim=1)
            alpha = torch.where(m[:, None], nxt, alpha)
        last = tags.gather(1, (mask.sum(1) - 1)[:, None]).squeeze(1)
        score = score + self.end[last]
        log_z = torch.logsumexp(alpha + self.end, dim=1)
        return (log_z - score).mean()

    @torch.no_grad()
    def decode(self, emissions: Tensor, mask: Tensor) -> list[list[int]]:
        B, W, _ = emissions.shape
        score = self.start + emissions[:, 0]
        history = []
        for w in range(1, W):
            best, idx = (score[:, :, None] + self.trans).max(dim=1)
            nxt = best + emissions[:, w]
            history.append(idx)
            score = torch.where(mask[:, w, None], nxt, score)
        score = score + self.end
        paths = []
        for b in range(B):
            n = int(mask[b].sum())
            if n == 0:
                paths.append([])
                continue
            tag = int(score[b].argmax())
            path = [tag]
            for w in range(n - 1, 0, -1):
                tag = int(history[w - 1][b, tag])
                path.append(tag)
            paths.append(path[::-1])
        return paths


def pool(h: Tensor, mask: Tensor, how: str) -> Tensor:
    """[N,T,H] -> [N,H]: first token, last real token, or mean over real tokens."""
    if how == "first":
        return h[:, 0]
    if how == "last":
        last = (mask.sum(1) - 1).clamp(min=0)
        return h[torch.arange(h.shape[0], device=h.device), last]
    m = mask.to(h.dtype)[..., None]
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


def layer_depth(name: str, n_layers: int) -> int:
    """0 for the embeddings, l+1 for a parameter of layer l, n_layers+1 above the layers
    (a final LayerNorm, pretraining heads): the layer-wise lr decay exponent is its inverse."""
    m = re.search(r"(?:^|\.)(?:blocks|layers|layer|h)\.(\d+)\.", name)
    if m:
        return int(m.group(1)) + 1
    if re.search(r"emb|wte|wpe|word|position|token_type", name):
        return 0
    return n_layers + 1


def count_layers(backbone: nn.Module) -> int:
    idx = {
        int(m.group(1))
        for n, _ in backbone.named_parameters()
        if (m := re.search(r"(?:^|\.)(?:blocks|layers|layer|h)\.(\d+)\.", n))
    }
    return max(idx) + 1 if idx else 0


# ----------------------------------------------------------------------------- the model

# Tasks an architecture cannot do, with the reason (checked before training starts).
UNSUPPORTED: dict[str, dict[str, str]] = {
    "elmo": {
        "span_qa": "ELMo is used feature-based (a frozen biLM under a task model); span QA "
        "needs a reading-comprehension model (BiDAF) on top, which this pipeline does not have",
    },
    "word2vec": {
        "span_qa": "word2vec vectors carry no context, so start/end positions cannot be learned",
    },
}
# Architectures whose papers use them only as frozen feature extractors.
FEATURES_ONLY = {"elmo", "word2vec"}


def backbone_layers(outputs: dict[str, Any]) -> Tensor:
    """[B, L, T, D]: every layer for the scalar mix. ``outputs["layers"]`` when the model
    returns them (ELMo: the token layer + each biLSTM layer), else the final layer alone
    (word2vec's vectors; BERT / GPT used feature-based from their top layer)."""
    layers = outputs.get("layers")
    if layers is None:
        return outputs["hidden_states"][:, None]
    return torch.stack(list(layers), dim=1) if isinstance(layers, list | tuple) else layers


def features_kwargs(backbone: nn.Module) -> dict[str, bool]:
    """``{"pretrain_heads": False}`` for a backbone whose forward takes it (every
    architecture of the registry: pipeline/models/base.py), else nothing."""
    return {"pretrain_heads": False} if "pretrain_heads" in _forward_names(backbone) else {}


def hidden_size(backbone: nn.Module) -> int:
    """The width of hidden_states: the config's hidden_size, else one tiny forward."""
    size = getattr(backbone.config, "hidden_size", None)
    if size is not None:
        return int(size)
    with torch.no_grad():
        ids = torch.zeros(1, 2, dtype=torch.long)
        out = backbone(input_ids=ids, **features_kwargs(backbone))
    return int(out["hidden_states"].shape[-1])


class TaskModel(nn.Module):
    """backbone + (scalar mix + BiLSTM in features mode) + one task head."""

    def __init__(
        self,
        backbone: nn.Module,
        task_type: str,
        n_labels: int,
        mode: str = "full",
        pooling: str = "auto",
        crf: bool = False,
        head_dropout: float = 0.1,
        feature_hidden: int = 64,
        n_feature_layers: int = 0,
    ):
        super().__init__()
        self.backbone = backbone
        self.task_type = task_type
        self.mode = mode
        causal = bool(getattr(backbone, "causal", False))
        if pooling == "auto":
            pooling = getattr(backbone, "pool_position", "last" if causal else "first")
        self.pooling = pooling
        H = hidden_size(backbone)
        self.mix = None
        self.lstm = None
        if mode == "features":
            mix_cls = getattr(_module_of(backbone), "ScalarMix", ScalarMix)
            self.mix = mix_cls(n_feature_layers)
            self.lstm = nn.LSTM(H, feature_hidden, batch_first=True, bidirectional=True)
            H = 2 * feature_hidden
            self.pooling = "mean"  # the BiLSTM sees the whole input in both directions
        if mode in ("frozen", "features"):
            backbone.requires_grad_(False)
        self.dropout = nn.Dropout(head_dropout)
        out = {"classification": n_labels, "regression": 1, "multiple_choice": 1}
        out |= {"tagging": n_labels, "span_qa": 2}
        self.head = nn.Linear(H, out[task_type])
        self.crf = CRF(n_labels) if crf else None
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    @property
    def frozen(self) -> bool:
        return self.mode in ("frozen", "features")

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:  # a fixed feature extractor: no dropout in it, ever
            self.backbone.eval()
        return self

    def head_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not n.startswith("backbone.")]

    def encode(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[N,T] -> [N,T,H] task features."""
        kwargs = {"input_ids": input_ids, **features_kwargs(self.backbone)}
        names = _forward_names(self.backbone)
        # segment B ids only for models with a segment-B embedding (RoBERTa has one type)
        if "token_type_ids" in names and getattr(self.backbone.config, "type_vocab_size", 2) > 1:
            kwargs["token_type_ids"] = token_type_ids
        if "attention_mask" in names:
            kwargs["attention_mask"] = attention_mask
        if self.frozen:
            with torch.no_grad():
                outputs = self.backbone(**kwargs)
        else:
            outputs = self.backbone(**kwargs)
        if self.mix is None:
            return outputs["hidden_states"]
        mixed = self.mix(backbone_layers(outputs))
        lengths = attention_mask.sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            mixed, lengths, batch_first=True, enforce_sorted=False
        )
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=mixed.shape[1])
        return h

    def forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        ids = batch["input_ids"]
        B, V, T = ids.shape
        mask = batch["attention_mask"].reshape(B * V, T)
        h = self.encode(ids.reshape(B * V, T), batch["token_type_ids"].reshape(B * V, T), mask)
        out: dict[str, Tensor] = {}
        t = self.task_type
        if t in ("classification", "regression", "multiple_choice"):
            pooled = pool(h, mask, self.pooling).reshape(B, V, -1)
            vm = batch["view_mask"]
            if t == "multiple_choice":
                scores = self.head(self.dropout(pooled)).squeeze(-1)  # [B,V]
                out["logits"] = scores.masked_fill(~vm, -1e4)
            else:  # views summed: GPT's similarity input (both orders), else one view
                summed = (pooled * vm[..., None].to(pooled.dtype)).sum(1)
                logits = self.head(self.dropout(summed))
                out["logits"] = logits.squeeze(-1) if t == "regression" else logits
        elif t == "tagging":
            starts = batch["word_starts"]
            words = h.gather(1, starts[..., None].expand(-1, -1, h.shape[-1]))
            out["logits"] = self.head(self.dropout(words))  # [B,W,L]
        else:  # span_qa
            logits = self.head(self.dropout(h))  # [B,T,2]
            out["start_logits"], out["end_logits"] = logits[..., 0], logits[..., 1]
        if "labels" in batch or "start_positions" in batch:
            out["loss"] = self.loss(out, batch)
        return out

    def loss(self, out: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor:
        t = self.task_type
        if t == "regression":
            return F.mse_loss(out["logits"].float(), batch["labels"].float())
        if t == "span_qa":
            s = F.cross_entropy(out["start_logits"].float(), batch["start_positions"])
            e = F.cross_entropy(out["end_logits"].float(), batch["end_positions"])
            return (s + e) / 2
        if t == "tagging" and self.crf is not None:
            return self.crf.nll(out["logits"].float(), batch["labels"], batch["word_mask"])
        logits = out["logits"].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))

    @torch.no_grad()
    def decode_tags(self, out: dict[str, Tensor], word_mask: Tensor) -> list[list[int]]:
        if self.crf is not None:
            return self.crf.decode(out["logits"].float(), word_mask)
        pred = out["logits"].argmax(-1)
        return [pred[b, : int(word_mask[b].sum())].tolist() for b in range(pred.shape[0])]


def _module_of(model: nn.Module):
    import sys

    return sys.modules.get(type(model).__module__)


def _forward_names(model: nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def param_groups(model: TaskModel, lr: float, head_lr: float, decay: float, weight_decay: float):
    """AdamW groups: layer-wise lr decay over the backbone (lr * decay^(L+1-depth)), the
    head at head_lr; no weight decay on biases / LayerNorms / other 1-D tensors."""
    n_layers = count_layers(model.backbone)
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("backbone."):
            depth = layer_depth(name[len("backbone.") :], n_layers)
            group_lr = lr * decay ** (n_layers + 1 - depth)
        else:
            group_lr = head_lr
        wd = (
            0.0 if p.ndim < 2 or "norm" in name.lower() or name.startswith("crf.") else weight_decay
        )
        groups.setdefault((group_lr, wd), []).append(p)
    return [{"params": ps, "lr": g_lr, "weight_decay": wd} for (g_lr, wd), ps in groups.items()]
