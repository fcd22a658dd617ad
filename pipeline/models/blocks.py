"""Transformer pieces shared by the architectures: attention masks, self-attention, MLP,
the post-LN (BERT) and pre-LN (GPT-2) blocks, weight init and the padded, tied vocabulary.

Attention always goes through ``F.scaled_dot_product_attention`` so PyTorch picks the
fastest kernel it has for the device (flash / memory-efficient / fused CPU kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

# Logit given to the padded vocabulary rows. Finite (not -inf) so entropy/KL-style losses
# never see inf * 0 = nan, yet so low that exp() underflows to exactly 0 in fp32/bf16/fp16:
# padded rows never win an argmax and get zero probability and zero gradient.
PAD_LOGIT = -1.0e4


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round the tokenizer's vocabulary up so the embedding / logits matmul is well aligned."""
    return math.ceil(vocab_size / multiple) * multiple


class TransformerConfig(BaseModel):
    """The fields every transformer here shares. Each architecture subclasses it, setting its
    paper's defaults and adding its own fields; unknown keys are errors (extra=forbid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)  # the tokenizer's; the model pads it (padded_vocab_size)
    hidden_size: int = Field(768, gt=0)
    num_layers: int = Field(12, gt=0)
    num_heads: int = Field(12, gt=0)
    intermediate_size: int = Field(3072, gt=0)
    max_positions: int = Field(512, gt=0)
    dropout: float = Field(0.1, ge=0, lt=1)  # embeddings and residual branches
    attention_dropout: float = Field(0.1, ge=0, lt=1)
    layer_norm_eps: float = Field(1e-12, gt=0)
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    init_std: float = Field(0.02, gt=0)
    vocab_multiple: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        return self

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)


def vocab_pad_bias(vocab_size: int, padded: int) -> Tensor:
    """[padded] additive logit bias: 0 for real tokens, PAD_LOGIT for the padding rows."""
    bias = torch.zeros(padded)
    bias[vocab_size:] = PAD_LOGIT
    return bias


# ----------------------------------------------------------------------------- attention
#
# A model's forward picks one attention layout for the whole stack and hands it to every
# layer: ``Dense`` keeps the padded [B,T] batch (today's transformers layout), ``Packed``
# computes on the real tokens only, packed into one row [1,N]. Layers are shape-agnostic;
# only ``SelfAttention`` asks the layout to attend.


def padding_mask(attention_mask: Tensor | None) -> Tensor | None:
    """[B,T] 1 real / 0 pad -> [B,1,1,T] bool "may attend" mask for bidirectional attention.

    A row that is all padding would give softmax over nothing (nan); such rows attend to
    everything instead. Their outputs are garbage either way, but finite.
    """
    if attention_mask is None or bool(attention_mask.all()):
        return None  # no padding (one host sync): mask-free SDPA may use its fastest kernel
    return _may_attend(attention_mask)


def _may_attend(attention_mask: Tensor) -> Tensor:
    keep = attention_mask.bool()
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def causal_mask(
    attention_mask: Tensor | None, document_ids: Tensor | None, seq_len: int
) -> tuple[Tensor | None, bool]:
    """Returns (attn_mask, is_causal) for scaled_dot_product_attention.

    Without padding or documents the kernel's own causal path is used (no mask tensor).
    Otherwise a [B,1,T,T] bool mask: key j is visible from query i when j <= i, both are in
    the same document (document_ids) and j is a real token (attention_mask). Every query
    also sees itself, so no row is empty (a left-padded query would otherwise give nan).
    """
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: keep the kernel's own causal path if we can
    return _causal_mask(attention_mask, document_ids, seq_len)


def _causal_mask(
    attention_mask: Tensor | None, document_ids: Tensor | None, seq_len: int
) -> tuple[Tensor | None, bool]:
    """``causal_mask`` with ``attention_mask`` None unless the batch has padding: no host
    read (the caller knows)."""
    if attention_mask is None and document_ids is None:
        return None, True
    device = (document_ids if document_ids is not None else attention_mask).device
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None]
    if document_ids is not None:
        allowed = allowed & (document_ids[:, :, None] == document_ids[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)[None]
    return allowed[:, None, :, :], False


class Dense:
    """Attention over the padded [B,T] batch: SDPA with an optional bool mask or the
    kernel's causal path. Tensors keep their [B,T,...] shape (pack/unpack do nothing).

    ``labelled`` [n]: the flat positions b*T+t of the MLM-labelled tokens, row-major,
    when the layout was built with the labels (on the loader's CPU batch: see
    ``encoder_attention``); None: ``labelled_rows`` finds them with a boolean mask."""

    def __init__(
        self, mask: Tensor | None, is_causal: bool = False, labelled: Tensor | None = None
    ):
        self.mask, self.is_causal, self.labelled = mask, is_causal, labelled

    def to(self, device: torch.device | str) -> Dense:
        """This layout on ``device`` (copies of its index tensors; no host read)."""
        return Dense(_moved(self.mask, device), self.is_causal, _moved(self.labelled, device))

    def pack(self, x: Tensor | None) -> Tensor | None:
        return x

    def unpack(self, x: Tensor) -> Tensor:
        return x

    def positions(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """The position ids in this layout: ``position_ids`` as given, else [1,T] 0..T-1
        (the default of absolute-position models)."""
        if position_ids is not None:
            return position_ids
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None]

    def firsts(self, h: Tensor) -> Tensor:
        """[B,H] each row's first token ([CLS])."""
        return h[:, 0]

    def labelled_rows(self, h: Tensor, labels: Tensor) -> Tensor:
        """[n,H] the states of the positions ``labels`` [B,T] marks (>= 0), row-major."""
        if self.labelled is not None:
            return h.reshape(-1, h.shape[-1]).index_select(0, self.labelled)
        return h[labels >= 0]  # a boolean gather: its size is read to the host

    def attend(self, qkv: Tensor, num_heads: int, dropout_p: float) -> Tensor:
        """[B,T,3C] fused projections -> [B,T,C]."""
        B, T, C3 = qkv.shape
        # [B,T,3C] -> 3 x [B,nh,T,hd]
        q, k, v = qkv.view(B, T, 3, num_heads, C3 // 3 // num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, dropout_p=dropout_p, is_causal=self.is_causal
        )
        return y.transpose(1, 2).reshape(B, T, C3 // 3)


def _moved(x: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if x is None else x.to(device, non_blocking=True)


def labelled_positions(labels: Tensor) -> Tensor:
    """[n] the positions of ``labels`` (any shape, read flat) that are >= 0, in order.
    Meant for the loader's CPU batch, where ``nonzero`` reads nothing from a device."""
    return (labels.reshape(-1) >= 0).nonzero().squeeze(1)


def true_positions(flags: Tensor, n: int, sync_free: bool) -> Tensor:
    """[M] bool -> [n] the positions of its n True entries, in order. ``nonzero`` reads
    its output size to the host (a GPU sync); with n known, a stable sort that puts the
    True entries first gives the same positions without one (``sync_free``)."""
    if sync_free:
        return torch.argsort((~flags).to(torch.uint8), stable=True)[:n]
    return flags.nonzero().squeeze(1)


class Packed:
    """The real tokens of a [B,T] batch packed into one row, [1,N,...]: every layer but
    attention computes on N tokens, never on padding. Attention is confined to each
    *sequence*: the real tokens of a row (``from_mask``, bidirectional encoders) or one
    document of a row (``from_documents``, causal; document ids are contiguous runs).

    ``index`` [N]: flat positions b*T+t of the tokens, in row-major order; ``cu_seqlens``
    [S+1]: where each of the S sequences starts in the packed order; ``min_len`` and
    ``max_len``: the shortest and longest sequence, host ints. Attention runs as varlen
    SDPA through nested jagged tensors on a GPU (flash / memory-efficient varlen kernels,
    causal and dropout included); on the CPU, where PyTorch's nested path loops, it pads
    the sequences into [S, longest] for one batched SDPA call (the FLOPs on padding are
    then in attention's score matmuls only, not in any projection or MLP), which is the
    exact fallback: the same keys, order and scale per query.

    Built from the loader's CPU batch (``from_mask`` / ``from_documents`` there, then
    ``to(device)``), a forward reads nothing from the device: the sizes it needs are host
    ints and every index was computed on the CPU. ``labelled`` [n]: the packed positions
    of the MLM-labelled tokens when built with the labels (``with_labels``).
    """

    kernel: Literal["auto", "nested", "padded"] = "auto"  # auto: nested on a GPU

    def __init__(
        self, index: Tensor, seq: Tensor, offset: Tensor, lengths: Tensor, max_len: int,
        shape: tuple[int, int], causal: bool, min_len: int = 0,
        labelled: Tensor | None = None,
    ):  # fmt: skip
        self.index, self.seq, self.offset = index, seq, offset  # [N] each
        self.lengths, self.labelled = lengths, labelled
        self.shape, self.causal = shape, causal
        self.n_seqs = int(lengths.shape[0])
        self.max_len, self.min_len = max_len, min_len
        self.cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
        self.dense = index.shape[0] == shape[0] * shape[1]  # no padding: views, no gathers
        self.nested = index.is_cuda if self.kernel == "auto" else self.kernel == "nested"
        if not self.nested:  # the padded kernel's layout, once for every layer
            L = self.max_len
            self.slot = seq * L + offset  # [N] place of each token in [S*L]
            self.key_mask = None  # a causal query never sees the padding after it
            if not causal:
                real = torch.arange(L, device=index.device)[None] < lengths[:, None]
                self.key_mask = real[:, None, None]  # [S,1,1,L]

    def to(self, device: torch.device | str) -> Packed:
        """This layout on ``device``: its index tensors copied, the sizes kept (host
        ints), the kernel chosen for ``device``; no host read."""
        moved = (_moved(x, device) for x in (self.index, self.seq, self.offset, self.lengths))
        return Packed(
            *moved, self.max_len, self.shape, self.causal, self.min_len,
            _moved(self.labelled, device),
        )  # fmt: skip

    def with_labels(self, labels: Tensor) -> Packed:
        """Records where the labelled tokens of ``labels`` [B,T] (>= 0) are in the packed
        order (``labelled``), for the MLM heads' gather."""
        self.labelled = labelled_positions(self.pack(labels))
        return self

    @classmethod
    def from_mask(cls, attention_mask: Tensor, lengths: Tensor, host: list[int]) -> Packed:
        """Each row's real tokens (attention_mask 1) form one bidirectional sequence.
        ``lengths`` [B]: real tokens per row; ``host``: the same, read to the host once
        by the caller (the number of tokens and the longest row come from it)."""
        B, T = attention_mask.shape
        keep = attention_mask.bool()
        index = true_positions(keep.flatten(), sum(host), sync_free=keep.is_cuda)
        seq = index // T
        offset = (keep.cumsum(1) - 1).flatten()[index]  # the token's rank within its row
        return cls(
            index, seq, offset, lengths, max(host, default=0), (B, T), causal=False,
            min_len=min(host, default=0),
        )  # fmt: skip

    @classmethod
    def from_documents(cls, document_ids: Tensor) -> Packed:
        """Every document of every row (a run of equal ids) is one causal sequence. One
        host read (the shortest and longest document): none on the loader's CPU batch."""
        B, T = document_ids.shape
        new = torch.ones_like(document_ids, dtype=torch.bool)
        new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        starts = new.flatten()
        seq = starts.cumsum(0) - 1  # [B*T] sequence number of each token
        first = starts.nonzero().squeeze(1)
        lengths = torch.diff(first, append=first.new_tensor([B * T]))
        index = torch.arange(B * T, device=document_ids.device)
        offset = index - first[seq]
        low, high = torch.stack([lengths.min(), lengths.max()]).tolist() if B * T else (0, 0)
        return cls(index, seq, offset, lengths, high, (B, T), causal=True, min_len=low)

    def pack(self, x: Tensor | None) -> Tensor | None:
        """[B,T,...] -> [1,N,...]"""
        if x is None:
            return None
        flat = x.reshape(-1, *x.shape[2:])
        return (flat if self.dense else flat.index_select(0, self.index))[None]

    def unpack(self, x: Tensor) -> Tensor:
        """[1,N,...] -> [B,T,...], zeros at the padding."""
        B, T = self.shape
        if self.dense:
            return x.reshape(B, T, *x.shape[2:])
        out = x.new_zeros(B * T, *x.shape[2:])
        return out.index_copy(0, self.index, x[0]).view(B, T, *x.shape[2:])

    def positions(self, input_ids: Tensor, position_ids: Tensor | None) -> Tensor:
        """[1,N] the given ``position_ids`` ([B,T] or [1,T]) packed, else each token's
        position in its row (what Dense.positions gives it)."""
        if position_ids is not None:
            return self.pack(position_ids.expand_as(input_ids))
        return (self.index % self.shape[1])[None]

    def firsts(self, h: Tensor) -> Tensor:
        """[S,H] each sequence's first token ([CLS]); an empty row gives some other token."""
        return h[0, self.cu_seqlens[:-1].clamp(max=max(h.shape[1] - 1, 0))]

    def labelled_rows(self, h: Tensor, labels: Tensor) -> Tensor:
        """[n,H] the states ``h`` [1,N,H] of the tokens ``labels`` [B,T] marks (>= 0), in
        row-major order."""
        if self.labelled is not None:
            return h[0].index_select(0, self.labelled)
        return h[self.pack(labels) >= 0]  # a boolean gather: its size is read to the host

    def attend(self, qkv: Tensor, num_heads: int, dropout_p: float) -> Tensor:
        """[1,N,3C] fused projections -> [1,N,C], attention within each sequence."""
        N, C = qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv[0].view(N, 3, num_heads, C // num_heads).unbind(1)  # [N,nh,hd]
        if self.nested:
            y = self._attend_nested(q, k, v, dropout_p)
        else:
            y = self._attend_padded(q, k, v, dropout_p)
        return y.reshape(1, N, C)

    def _attend_nested(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        def jagged(x: Tensor) -> Tensor:  # [N,nh,hd] -> [S, nh, (len), hd]
            # the sizes given, so neither the kernel choice nor the kernel reads them
            return torch.nested.nested_tensor_from_jagged(
                x.contiguous(), offsets=self.cu_seqlens, min_seqlen=self.min_len,
                max_seqlen=self.max_len,
            ).transpose(1, 2)  # fmt: skip

        y = F.scaled_dot_product_attention(
            jagged(q), jagged(k), jagged(v), dropout_p=dropout_p, is_causal=self.causal
        )
        return y.transpose(1, 2).values()

    def _attend_padded(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        S, L = self.n_seqs, self.max_len

        def padded(x: Tensor) -> Tensor:  # [N,nh,hd] -> [S,nh,L,hd]
            out = x.new_zeros(S * L, *x.shape[1:]).index_copy(0, self.slot, x)
            return out.view(S, L, *x.shape[1:]).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), attn_mask=self.key_mask, dropout_p=dropout_p,
            is_causal=self.causal,
        )  # fmt: skip
        return y.transpose(1, 2).reshape(S * L, -1).index_select(0, self.slot)


Attention = Dense | Packed


def encoder_attention(
    attention_mask: Tensor | None, unpad: bool, mlm_labels: Tensor | None = None
) -> Attention:
    """The layout of a bidirectional encoder's batch: ``Packed`` when ``unpad`` and the
    batch has padding, else ``Dense`` (no padding: nothing to save, no gathers). With
    ``mlm_labels`` it also records where the labelled tokens are (``labelled``).

    One host read, the rows' lengths: they say whether there is padding, how many real
    tokens there are and the longest row (on a GPU, three syncs otherwise). The trainer
    builds it on the loader's CPU batch, where that read is free, and moves it to the
    device (``to``), so the forward reads nothing; a forward given no layout builds it
    from its own tensors."""
    if attention_mask is None:
        attn: Attention = Dense(None)
    else:
        lengths = attention_mask.sum(1, dtype=torch.int64)
        host = lengths.tolist()
        if min(host, default=attention_mask.shape[1]) == attention_mask.shape[1]:
            attn = Dense(None)  # no padding: mask-free SDPA may use its fastest kernel
        elif unpad:
            attn = Packed.from_mask(attention_mask, lengths, host)
        else:
            attn = Dense(_may_attend(attention_mask))
    if mlm_labels is None:
        return attn
    if isinstance(attn, Packed):
        return attn.with_labels(mlm_labels)
    attn.labelled = labelled_positions(mlm_labels)
    return attn


def decoder_attention(
    attention_mask: Tensor | None, document_ids: Tensor | None, unpad: bool
) -> Attention:
    """The layout of a causal decoder's batch: documents packed in rows (no padding) are
    ``Packed`` causal sequences with ``unpad``, so no [B,T,T] mask is built; otherwise
    ``Dense`` with the kernel's causal path or ``causal_mask``. The host reads it makes
    (is there padding; the documents' lengths) are free on the loader's CPU batch, where
    the trainer builds it (``to`` moves it to the device)."""
    padded = attention_mask is not None and not bool(attention_mask.all())
    if unpad and document_ids is not None and not padded:
        return Packed.from_documents(document_ids)
    if not padded and document_ids is None:
        return Dense(None, is_causal=True)
    T = (document_ids if document_ids is not None else attention_mask).shape[1]
    return Dense(*_causal_mask(attention_mask if padded else None, document_ids, T))


# ----------------------------------------------------------------------------- layers


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection (one GEMM instead of three);
    the layout (``Dense`` or ``Packed``) runs the attention itself."""

    def __init__(self, hidden_size: int, num_heads: int, attention_dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor, attn: Attention) -> Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        return self.proj(attn.attend(self.qkv(x), self.num_heads, dropout))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.fc = nn.Linear(hidden_size, intermediate_size)
        self.proj = nn.Linear(intermediate_size, hidden_size)
        # "gelu": exact erf GELU (BERT); "gelu_tanh": the tanh approximation (GPT-2).
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    """One transformer layer.

    post-LN (BERT):  x = LN(x + drop(attn(x)));       x = LN(x + drop(mlp(x)))
    pre-LN (GPT-2):  x = x + drop(attn(LN(x)));       x = x + drop(mlp(LN(x)))
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        intermediate_size: int,
        dropout: float,
        attention_dropout: float,
        layer_norm_eps: float,
        activation: str,
        pre_ln: bool,
    ):
        super().__init__()
        self.pre_ln = pre_ln
        self.attn = SelfAttention(hidden_size, num_heads, attention_dropout)
        self.ln_1 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size, activation)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, attn: Attention) -> Tensor:
        if self.pre_ln:
            x = x + self.dropout(self.attn(self.ln_1(x), attn))
            return x + self.dropout(self.mlp(self.ln_2(x)))
        x = self.ln_1(x + self.dropout(self.attn(x, attn)))
        return self.ln_2(x + self.dropout(self.mlp(x)))


def make_blocks(cfg: TransformerConfig, pre_ln: bool) -> nn.ModuleList:
    """cfg.num_layers transformer layers, post-LN (BERT) or pre-LN (GPT-2)."""
    return nn.ModuleList(
        Block(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.intermediate_size,
            cfg.dropout,
            cfg.attention_dropout,
            cfg.layer_norm_eps,
            cfg.activation,
            pre_ln=pre_ln,
        )
        for _ in range(cfg.num_layers)
    )


# ----------------------------------------------------------------------------- init


# Initialisation goes through ``Module.apply``, one module at a time. Under DeepSpeed's
# ``zero.Init`` (ZeRO-3 builds a model partitioned as it is created) each function ``apply``
# calls sees that module's own parameters whole: DeepSpeed gathers them around the call and
# partitions them again after it. So no init ever needs the whole model in one place, and
# a model built partitioned gets exactly the weights of one built whole (same seed).


@torch.no_grad()
def init_normal(module: nn.Module, std: float) -> None:
    """BERT / GPT-2 initialisation: N(0, std) weights, zero biases, identity LayerNorm."""

    def one(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    module.apply(one)


@torch.no_grad()
def on_module(module: nn.Module, fn: Callable[[nn.Module], object]) -> None:
    """``fn(module)`` for an init that writes ``module``'s own parameters (padded rows,
    scaled projections, biases held by a container module), called through
    ``module.apply`` so that it sees them whole when the model is built partitioned
    (above). The children are visited and left alone."""
    module.apply(lambda m: fn(m) if m is module else None)


@torch.no_grad()
def zero_rows(table: nn.Module, start: int) -> None:
    """Zero rows ``start:`` of ``table.weight``: the padded vocabulary rows, never looked
    up nor predicted."""
    on_module(table, lambda m: m.weight[start:].zero_())


def numel(p: Tensor) -> int:
    """A parameter's whole size, also when ZeRO-3 holds only a partition of it here
    (DeepSpeed keeps the whole size in ``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def non_embedding_params(model: nn.Module, embeddings: list[nn.Embedding]) -> int:
    skip = {id(e.weight) for e in embeddings}
    return sum(numel(p) for p in model.parameters() if id(p) not in skip)
