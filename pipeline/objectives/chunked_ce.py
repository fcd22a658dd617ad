"""Mean cross-entropy over a large vocabulary without an fp32 copy of all the logits.

``F.cross_entropy(logits.float(), target)`` on bf16 logits of N rows x V columns holds
an fp32 copy of the logits, the fp32 log-softmax it saves for backward and, in backward,
an fp32 gradient: at GPT-2 size (8 x 1024 tokens, V = 50304) each is 1.6 GB.
``chunked_cross_entropy`` walks the rows in chunks of ``chunk_rows`` and upcasts one
chunk at a time, so the extra memory is a few fp32 chunks plus, in backward, the
gradient in the logits' own dtype (which autograd hands to the layer below anyway).

Forward keeps per row only the fp32 log-sum-exp; backward walks the chunks again and
writes ``(softmax - onehot) * grad_output / n_valid`` of each chunk, computed in fp32
and rounded once into the logits' dtype, as autograd does after ``.float()``. The
gradient is computed in backward rather than in forward because only then is
``grad_output`` known: under fp16 loss scaling it is the loss scale, and a gradient
stored unscaled in fp16 (entries ~1/(V n_valid)) would be subnormal or zero before being
scaled. The cost is one more read of the logits in backward.

Every op is deterministic (no atomics: the target entries are fixed with gather/scatter
on distinct indices), so a resumed run reproduces the same losses bit for bit.

On a GPU each chunk's arithmetic is one ``torch.compile``d kernel (``fused``): eager, the
upcast, max, exp, sum, log, gather and scatter each read or write the chunk once more,
and the loss took 10 ms forward and 11 ms backward of a 69 ms GPT-2 124M step on an
H200 (BENCHMARKS.md, GPU bench). The fused chunk computes the same formulas.
"""

from __future__ import annotations

import torch

# Elements of one fp32 chunk by default. On a GPU large (2^25, 128 MiB: ~660 rows of a
# 50k vocabulary), so each kernel outlasts its launch; on the CPU small (2^21, 8 MiB: ~40
# rows), where a chunk stays closer to the caches and malloc reuses its buffers instead
# of mapping them afresh (glibc maps blocks over 32 MiB) and faulting in every page:
# 2^25 takes 2-3x the CPU time (bench/bench_chunked_ce.py).
CHUNK_ELEMENTS = {"cuda": 1 << 25, "cpu": 1 << 21}


def default_chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk for ``vocab`` columns on ``device`` (see ``CHUNK_ELEMENTS``)."""
    elements = CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    return max(1, elements // max(vocab, 1))


def _forward_chunk(x, safe, valid, compute: torch.dtype):
    """(log-sum-exp of each row, the chunk's summed loss in fp64) of one chunk of rows."""
    x = x.to(compute)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    return lse, torch.where(valid, lse - picked, 0.0).sum(dtype=torch.float64)


def _backward_chunk(x, lse, safe, valid, scale):
    """The gradient of one chunk, (softmax - onehot) * scale, in the logits' dtype; no
    in-place ops, so that the compiler makes it one kernel."""
    p = (x.to(lse.dtype) - lse[:, None]).exp()
    cols = torch.arange(x.shape[1], device=x.device)
    onehot = (cols[None, :] == safe[:, None]) & valid[:, None]
    return ((p - onehot.to(p.dtype)) * scale[:, None]).to(x.dtype)


_FUSED: dict[str, object] = {}


def _fused(name: str):
    """The compiled chunk function ``name`` (compiled once per process, on first use)."""
    if name not in _FUSED:
        fn = _forward_chunk if name == "forward" else _backward_chunk
        _FUSED[name] = torch.compile(fn, dynamic=False)
    return _FUSED[name]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """logits [N, V] (any float dtype), target [N] int64 -> mean loss over valid rows."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index: int, chunk_rows: int, fused: bool):
        compute = torch.promote_types(logits.dtype, torch.float32)
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)  # gather needs an in-range index everywhere
        n_valid = valid.sum().clamp(min=1)  # a tensor: no host sync on a GPU
        lse = torch.empty(logits.shape[0], dtype=compute, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        chunk = _fused("forward") if fused else _forward_chunk
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            lse[rows], loss = chunk(logits[rows], safe[rows], valid[rows], compute)
            total += loss
        ctx.chunk_rows, ctx.fused = chunk_rows, fused
        ctx.save_for_backward(logits, safe, valid, lse, n_valid)
        return (total / n_valid).to(compute)

    @staticmethod
    def backward(ctx, grad_output):
        logits, safe, valid, lse, n_valid = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        # per-row factor: grad_output / n_valid on valid rows, 0 on ignored ones
        scale = torch.where(valid, grad_output.to(lse.dtype) / n_valid, 0.0)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            if ctx.fused:
                grad[rows] = _fused("backward")(
                    logits[rows], lse[rows], safe[rows], valid[rows], scale[rows]
                )
                continue
            p = (logits[rows].to(lse.dtype) - lse[rows, None]).exp_()  # softmax
            index = safe[rows, None]
            p.scatter_(1, index, p.gather(1, index) - valid[rows, None].to(p.dtype))
            grad[rows] = p.mul_(scale[rows, None])
        return grad, None, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [..., V] against ``target`` [...] (int64) over the
    rows whose target is not ``ignore_index``; equal to
    ``F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1), ignore_index=...)``
    up to rounding, without its fp32 copy of the logits.

    The loss is fp32 (fp64 for fp64 logits) and the gradient has the logits' dtype. Every
    column takes part in the softmax, padded-vocabulary columns included. If every row
    is ignored the loss is 0 (not nan), still attached to the graph, with zero gradient.
    ``chunk_rows``: rows per fp32 chunk; by default ``default_chunk_rows(V, device)``.
    ``fused``: each chunk's arithmetic as one compiled kernel; by default on a GPU only.
    """
    V = logits.shape[-1]
    logits = logits.reshape(-1, V)  # a view when it can be; any strides are fine
    target = target.reshape(-1)
    if target.shape[0] != logits.shape[0]:
        raise ValueError(
            f"chunked_cross_entropy: {logits.shape[0]} rows of logits, {target.shape[0]} targets"
        )
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(V, logits.device)
    if chunk_rows < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    if fused is None:
        fused = logits.device.type == "cuda"
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, chunk_rows, fused)
