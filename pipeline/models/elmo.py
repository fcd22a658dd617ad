"""ELMo (Peters et al., 2018, "Deep contextualized word representations").

    token -> characters -> char CNN -> highway -> projection        (the token encoder)
          -> forward  LM: L-layer LSTM, left to right, residual between layers
          -> backward LM: L-layer LSTM, right to left, its own weights
          -> one softmax shared by both directions

The two LMs share the token encoder and the softmax and nothing else, so the forward
LM at position t has read tokens <= t only and the backward LM tokens >= t only
(tests/unit/test_elmo_w2v.py checks it). The forward LM at t predicts token t+1, the
backward LM at t predicts token t-1 (``fwd_logits`` / ``bwd_logits``; the bilm
objective holds the shifted labels).

Characters. Our shards hold subword ids, so each id's characters come from the
tokenizer's vocabulary: a fixed [padded_vocab, max_chars] table ``char_ids`` (a
persistent buffer: it is saved in checkpoints and in the bundle's model.safetensors,
so a bundle is self-contained). ``build_char_table(tokenizer_dir)`` makes it, a pure
function of tokenizer.json (+ tokenizer_meta.json's special tokens):

    row = [BOW, (marker), utf-8 bytes of the token's text ..., EOW, PAD ...]

Character ids: 0 padding, 1..256 the bytes 0..255, then BOW, EOW and three markers:
SPECIAL (a special token such as [CLS]: its text is not a word), CONTINUE (a WordPiece
``##`` piece that continues a word) and WORD_START (a Unigram ``▁`` piece that starts
a word). Byte-level BPE tokens are mapped back to their bytes (``Ġ`` -> a space byte).
Too long tokens keep their first max_chars - 2 characters (ELMo's own limit is 50).
The bilm objective binds the table when training starts (``bind_data``); a model built
without a tokenizer has a placeholder table that spells each id's decimal digits.

Outputs: ``layers`` [B, L+1, T, 2P]: layer 0 is the token encoding duplicated
([x; x], the paper's convention so all layers have the same width), layer k the
concatenated forward/backward outputs of LSTM layer k; ``hidden_states`` = the top
layer [B,T,2P] (what fine-tuning heads read); ``fwd_logits`` / ``bwd_logits``
[B,T,Vpad] unless ``pretrain_heads=False`` (pipeline/models/base.py). ``ScalarMix``
combines the layers for a task.

Not as in the paper: a full softmax instead of the sampled softmax (the vocabularies
here are small); no LSTM cell/projection clipping (torch's fused LSTM has none);
training windows are independent (no state carried from batch to batch).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from pipeline.models.base import PretrainModel
from pipeline.models.blocks import on_module, padded_vocab_size, vocab_pad_bias, zero_rows

# --------------------------------------------------------------------------- characters

PAD_CHAR = 0
BOW, EOW, SPECIAL, CONTINUE, WORD_START = 257, 258, 259, 260, 261
N_CHARS = 262


class ElmoConfig(BaseModel):
    """The paper's sizes are the defaults (the "original" ELMo, 93.6M parameters)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)  # the tokenizer's; the softmax is padded
    max_chars: int = Field(50, gt=2)  # characters per token, BOW and EOW included
    char_embed_dim: int = Field(16, gt=0)
    # (width, number of filters): 2048 filters in all
    filters: tuple[tuple[int, int], ...] = (
        (1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024),
    )  # fmt: skip
    highway_layers: int = Field(2, ge=0)
    projection_dim: int = Field(512, gt=0)  # token encoding and LSTM projection size
    lstm_dim: int = Field(4096, gt=0)  # LSTM cells
    num_layers: int = Field(2, gt=0)  # LSTM layers per direction
    dropout: float = Field(0.1, ge=0, lt=1)
    vocab_multiple: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _filters_fit(self):
        if not self.filters or any(w <= 0 or n <= 0 for w, n in self.filters):
            raise ValueError("filters must be a non-empty list of [width, count] pairs > 0")
        widest = max(w for w, _ in self.filters)
        if widest > self.max_chars:
            raise ValueError(f"filter width {widest} > max_chars {self.max_chars}")
        return self

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet -> byte: printable Latin-1 bytes stand for themselves,
    the other bytes (controls, space, ...) are shifted to code points 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


def token_chars(text: str, kind: str, special: bool, prefix: str = "##") -> list[int]:
    """Character ids of one vocabulary entry, without BOW/EOW (see the module docstring)."""
    if special:
        return [SPECIAL, *(b + 1 for b in text.encode("utf-8"))]
    marker: list[int] = []
    if kind == "wordpiece" and prefix and text.startswith(prefix) and len(text) > len(prefix):
        marker, text = [CONTINUE], text[len(prefix) :]
    elif kind == "unigram" and text.startswith("▁"):
        marker, text = [WORD_START], text[1:]
    if kind == "bpe":
        decode = _byte_level_decoder()
        raw = bytes(decode.get(c, ord("?")) for c in text)
    else:
        raw = text.encode("utf-8")
    return marker + [b + 1 for b in raw]


def char_rows(tokens: list[tuple[str, bool]], kind: str, max_chars: int, prefix: str = "##"):
    """[len(tokens), max_chars] int32 table; tokens[i] = (text of id i, is special)."""
    table = np.zeros((len(tokens), max_chars), dtype=np.int32)
    for i, (text, special) in enumerate(tokens):
        row = [BOW, *token_chars(text, kind, special, prefix)[: max_chars - 2], EOW]
        table[i, : len(row)] = row
    return torch.from_numpy(table)


def build_char_table(tokenizer_dir: str | Path, config: ElmoConfig) -> Tensor:
    """The [padded_vocab, max_chars] character table of a tokenizer folder (tokenizer.json
    + tokenizer_meta.json). Deterministic: a pure function of those two files."""
    tokenizer_dir = Path(tokenizer_dir)
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{tokenizer_dir} has no tokenizer.json to take characters from")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data["model"]
    kind = {"WordPiece": "wordpiece", "BPE": "bpe", "Unigram": "unigram"}.get(model["type"])
    if kind is None:
        raise ValueError(f"{path}: tokenizer model {model['type']!r} is not supported by ELMo")
    if kind == "unigram":
        vocab = {piece: i for i, (piece, _) in enumerate(model["vocab"])}
    else:
        vocab = dict(model["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    meta_path = tokenizer_dir / "tokenizer_meta.json"
    if meta_path.is_file():
        specials = set(json.loads(meta_path.read_text(encoding="utf-8"))["special_tokens"])
    else:
        specials = {t["content"] for t in data.get("added_tokens", []) if t.get("special")}
    if max(vocab.values()) >= config.vocab_size:
        raise ValueError(
            f"{path} has ids up to {max(vocab.values())} but the model's vocab_size is "
            f"{config.vocab_size}: build the model from this tokenizer"
        )
    tokens = [("", False)] * config.vocab_size
    for text, i in vocab.items():
        tokens[i] = (text, text in specials)
    table = char_rows(tokens, kind, config.max_chars, model.get("continuing_subword_prefix", "##"))
    out = torch.zeros(config.padded_vocab_size, config.max_chars, dtype=torch.int32)
    out[: config.vocab_size] = table
    return out


def placeholder_char_table(config: ElmoConfig) -> Tensor:
    """Before a tokenizer is bound: each id spelled as its decimal digits (deterministic)."""
    tokens = [(str(i), False) for i in range(config.padded_vocab_size)]
    return char_rows(tokens, "wordpiece", config.max_chars)


# --------------------------------------------------------------------------- modules


class CharCNNEncoder(nn.Module):
    """Characters -> context-independent token vector: char embeddings, one Conv1d per
    filter width max-pooled over the characters, highway layers, linear projection."""

    def __init__(self, cfg: ElmoConfig):
        super().__init__()
        self.char_embed = nn.Embedding(N_CHARS, cfg.char_embed_dim, padding_idx=PAD_CHAR)
        self.convs = nn.ModuleList(nn.Conv1d(cfg.char_embed_dim, n, w) for w, n in cfg.filters)
        n = cfg.n_filters
        # each highway layer: one Linear giving the transform and the gate halves
        self.highways = nn.ModuleList(nn.Linear(n, 2 * n) for _ in range(cfg.highway_layers))
        self.proj = nn.Linear(n, cfg.projection_dim)

    def forward(self, chars: Tensor) -> Tensor:
        """chars [N, C] -> [N, projection_dim]."""
        x = self.char_embed(chars.long()).transpose(1, 2)  # [N, E, C]
        # max over positions, then ReLU (the same as ReLU then max: ReLU is monotone)
        h = torch.relu(torch.cat([conv(x).amax(dim=-1) for conv in self.convs], dim=-1))
        for highway in self.highways:
            transform, gate = highway(h).chunk(2, dim=-1)
            gate = torch.sigmoid(gate)
            h = gate * h + (1 - gate) * torch.relu(transform)  # gate: how much to carry
        return self.proj(h)


def direction_order(attention_mask: Tensor | None, reverse: bool) -> Tensor | None:
    """[B,T] positions in the order an LSTM direction reads them: the real tokens (left to
    right, or right to left) first, then the padding. Padding, wherever it sits, is thus
    read after every real token and never changes a real token's state. None when there
    is no padding (then a direction reads the sequence as is, or flipped)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    B, T = attention_mask.shape
    pos = torch.arange(T, device=attention_mask.device).expand(B, T)
    key = torch.where(attention_mask.bool(), (T - 1 - pos) if reverse else pos, T + pos)
    return key.argsort(dim=1, stable=True)


def _permute(x: Tensor, order: Tensor) -> Tensor:
    return x.gather(1, order[..., None].expand(-1, -1, x.shape[-1]))


def run_direction(
    lm: Callable[[Tensor], list[Tensor]], x: Tensor, attention_mask: Tensor | None, reverse: bool
):
    """One LM over x [B,T,P] in its reading direction; outputs back in position order."""
    order = direction_order(attention_mask, reverse)
    if order is None:
        if not reverse:
            return lm(x)
        return [h.flip(1) for h in lm(x.flip(1))]
    back = order.argsort(dim=1)  # reading order -> positions
    return [_permute(h, back) for h in lm(_permute(x, order))]


class ElmoLM(nn.Module):
    """One direction's language model: num_layers projected LSTMs, a residual connection
    around every layer after the first (as in ELMo), dropout between layers."""

    def __init__(self, cfg: ElmoConfig):
        super().__init__()
        P = cfg.projection_dim
        self.layers = nn.ModuleList(
            nn.LSTM(P, cfg.lstm_dim, proj_size=P, batch_first=True) for _ in range(cfg.num_layers)
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, run_layer: Callable) -> list[Tensor]:
        """x [B,T,P] in reading order -> each layer's output [B,T,P], in reading order.
        ``run_layer``: the model's (PretrainModel.run_layer: checkpointing)."""
        outs = []
        for lstm in self.layers:
            inp = self.dropout(x)
            h = run_layer(lstm, inp)[0]  # (output, (h_n, c_n))
            x = h + x if outs else h  # residual connection between LSTM layers
            outs.append(x)
        return outs


class Elmo(PretrainModel):
    causal = False  # bidirectional features; fine-tuning pools as for an encoder

    def __init__(self, config: ElmoConfig):
        super().__init__()
        self.config = cfg = config
        self.encoder = CharCNNEncoder(cfg)
        self.forward_lm = ElmoLM(cfg)
        self.backward_lm = ElmoLM(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        # the softmax both directions share (the paper's tied Θs)
        self.softmax = nn.Linear(cfg.projection_dim, cfg.padded_vocab_size)
        self.register_buffer("char_ids", placeholder_char_table(cfg), persistent=True)
        self.register_buffer(
            "pad_bias", vocab_pad_bias(cfg.vocab_size, cfg.padded_vocab_size), persistent=False
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torch's defaults for convolutions and LSTMs; the highway gates start with bias
        +1 (they favour carrying their input through, so deep highways train); the
        softmax starts at zero bias and padded rows at zero weight."""
        n = self.config.n_filters
        for highway in self.encoder.highways:
            on_module(highway, lambda m: m.bias[n:].fill_(1.0))

        def softmax(m: nn.Linear) -> None:
            nn.init.normal_(m.weight, std=self.config.projection_dim**-0.5)
            nn.init.zeros_(m.bias)

        on_module(self.softmax, softmax)
        zero_rows(self.softmax, self.config.vocab_size)

    @torch.no_grad()
    def set_char_table(self, table: Tensor) -> None:
        expected = (self.config.padded_vocab_size, self.config.max_chars)
        if tuple(table.shape) != expected:
            raise ValueError(f"character table of shape {tuple(table.shape)}, need {expected}")
        self.char_ids.copy_(table.to(self.char_ids.device))

    def repeated_layers(self) -> list[nn.Module]:
        return [self.encoder, *self.forward_lm.layers, *self.backward_lm.layers]

    def encode_tokens(self, input_ids: Tensor) -> Tensor:
        """[B,T] ids -> [B,T,P] context-independent token vectors (ELMo's layer 0). The
        char CNN runs once per distinct id of the batch, not once per position."""
        unique, inverse = input_ids.unique(return_inverse=True)
        chars = self.char_ids[unique]
        vectors = self.run_layer(self.encoder, chars)
        return vectors[inverse]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        pretrain_heads: bool = True,  # False: no softmax (base.PretrainModel)
    ) -> dict[str, Tensor]:
        x = self.encode_tokens(input_ids)
        fwd = run_direction(
            lambda v: self.forward_lm(v, self.run_layer), x, attention_mask, reverse=False
        )
        bwd = run_direction(
            lambda v: self.backward_lm(v, self.run_layer), x, attention_mask, reverse=True
        )
        layers = [torch.cat([x, x], dim=-1)]
        layers += [torch.cat([f, b], dim=-1) for f, b in zip(fwd, bwd, strict=True)]
        stacked = torch.stack(layers, dim=1)  # [B, L+1, T, 2P]
        if attention_mask is not None:  # padding positions: zeros, not garbage
            stacked = stacked * attention_mask[:, None, :, None].to(stacked.dtype)
        out = {"layers": stacked, "hidden_states": stacked[:, -1]}
        if pretrain_heads:
            bias = self.softmax.bias + self.pad_bias.to(self.softmax.bias.dtype)
            out["fwd_logits"] = F.linear(self.dropout(fwd[-1]), self.softmax.weight, bias)
            out["bwd_logits"] = F.linear(self.dropout(bwd[-1]), self.softmax.weight, bias)
        return out

    def flops_per_token(self, seq_len: float, decoder_fraction: float = 1.0) -> float:
        """Training FLOPs (forward + backward = 3x forward) per token, independent of the
        sequence length (recurrence, no attention). Forward, per token:
          char CNN   2 * sum_w (C - w + 1) * w * E * n_w    (counted for every position,
                                                           though the batch dedups ids)
          highways   2 * F * 2F each;  projection 2 * F * P
          LSTMs      per layer and direction 2 * (4H * P + 4H * P + H * P)
          softmax    2 directions * 2 * P * Vpad
        """
        cfg = self.config
        C, E, F_, P, H = (
            cfg.max_chars, cfg.char_embed_dim, cfg.n_filters, cfg.projection_dim, cfg.lstm_dim,
        )  # fmt: skip
        cnn = sum(2 * (C - w + 1) * w * E * n for w, n in cfg.filters)
        cnn += cfg.highway_layers * 2 * F_ * 2 * F_ + 2 * F_ * P
        lstm = 2 * cfg.num_layers * 2 * (9 * H * P)
        softmax = 2 * 2 * P * cfg.padded_vocab_size
        return 3.0 * (cnn + lstm + softmax)


class ScalarMix(nn.Module):
    """ELMo's task-specific combination of the layers (paper eq. 1):

        ELMo_task = gamma * sum_j softmax(s)_j * h_j

    ``s`` (one weight per layer, softmax-normalised) and the scale ``gamma`` are learned
    by the downstream task. Input: ``layers`` [B, L, T, D] (Elmo's outputs["layers"]) or
    a list of L tensors [B, T, D]; output [B, T, D].
    """

    def __init__(self, num_layers: int = 3, initial_weights: list[float] | None = None):
        super().__init__()
        init = torch.zeros(num_layers) if initial_weights is None else torch.tensor(initial_weights)
        if init.shape != (num_layers,):
            raise ValueError(f"initial_weights needs {num_layers} values, got {init.tolist()}")
        self.weights = nn.Parameter(init.float())
        self.gamma = nn.Parameter(torch.ones(()))

    def forward(self, layers: Tensor | list[Tensor] | tuple[Tensor, ...]) -> Tensor:
        if isinstance(layers, (list, tuple)):
            layers = torch.stack(list(layers), dim=1)
        if layers.shape[1] != self.weights.shape[0]:
            raise ValueError(f"ScalarMix over {self.weights.shape[0]} layers got {layers.shape[1]}")
        w = torch.softmax(self.weights, dim=0).to(layers.dtype)
        return self.gamma.to(layers.dtype) * torch.einsum("l,bltd->btd", w, layers)
