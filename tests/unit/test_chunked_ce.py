"""chunked_cross_entropy: F.cross_entropy's loss and gradient, one fp32 chunk at a time."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pipeline.objectives import chunked_ce
from pipeline.objectives.chunked_ce import chunked_cross_entropy, default_chunk_rows

N, V = 37, 101  # 37 rows: no chunk size below divides it


def make(n=N, v=V, ignored_every=4, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * scale
    target = torch.randint(0, v, (n,), generator=g)
    target[::ignored_every] = -100
    return logits, target


def loss_and_grad(fn, logits, target, grad_scale=1.0):
    x = logits.clone().requires_grad_()
    loss = fn(x, target)
    (loss * grad_scale).backward()
    return loss.detach(), x.grad


def reference(x, target):
    return F.cross_entropy(x.reshape(-1, x.shape[-1]).float(), target.reshape(-1))


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, N, 100, None])
def test_loss_and_gradient_equal_cross_entropy_in_fp32(chunk_rows):
    logits, target = make()
    loss, grad = loss_and_grad(
        lambda x, t: chunked_cross_entropy(x, t, chunk_rows=chunk_rows), logits, target
    )
    want_loss, want_grad = loss_and_grad(reference, logits, target)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
    assert (grad[target == -100] == 0).all()


def test_leading_dims_non_contiguous_input_and_padded_vocabulary_columns():
    # [T, B, V] transposed to [B, T, V]: reshape must copy; the last 7 columns stand for
    # a padded vocabulary (no label points there) and stay in the softmax.
    logits, target = make(n=6 * 5, v=V + 7)
    target = target.clamp(max=V - 1).where(target >= 0, -100)
    base = logits.reshape(5, 6, V + 7)
    labels = target.reshape(5, 6).T
    loss, grad = loss_and_grad(
        lambda x, t: chunked_cross_entropy(x.transpose(0, 1), t, chunk_rows=4), base, labels
    )
    want_loss, want_grad = loss_and_grad(lambda x, t: reference(x.transpose(0, 1), t), base, labels)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
    assert (grad[..., V:] != 0).any()  # the padded columns get their softmax gradient

    wide = torch.randn(N, V + 9)
    _, target = make()
    narrow = wide[:, :V]  # 2-D, rows strided
    assert not narrow.is_contiguous()
    loss = chunked_cross_entropy(narrow, target, chunk_rows=8)
    torch.testing.assert_close(loss, reference(narrow, target), atol=1e-6, rtol=0)


def test_all_rows_ignored_give_a_zero_loss_with_a_graph_and_zero_gradient():
    logits, _ = make()
    target = torch.full((N,), -100)
    x = logits.clone().requires_grad_()
    loss = chunked_cross_entropy(x, target, chunk_rows=8)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert F.cross_entropy(logits, target).isnan()  # what the plain loss would give


def test_bf16_logits_get_a_bf16_gradient_close_to_the_fp32_reference():
    logits, target = make()
    logits = logits.bfloat16()
    loss, grad = loss_and_grad(
        lambda x, t: chunked_cross_entropy(x, t, chunk_rows=8), logits, target
    )
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    want_loss, want_grad = loss_and_grad(reference, logits.float(), target)  # exact in fp32
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    # the fp32 gradient rounded once to bf16 (8 bits of mantissa)
    torch.testing.assert_close(grad.float(), want_grad, atol=1e-6, rtol=2**-8)


def test_fp16_gradient_under_loss_scaling_does_not_underflow():
    # Under fp16 loss scaling grad_output is the scale. Softmax entries / n_valid (~5e-7
    # here, ~2e-9 for 8k tokens of a 50k vocabulary) are subnormal or zero in fp16; a
    # gradient stored so and scaled afterwards misses 98% of these entries. Scaled first,
    # as autograd does after .float(), it is the reference's to fp16 rounding.
    logits, target = make(n=512, v=4000, ignored_every=1000, scale=1.0)
    logits = logits.half()
    _, grad = loss_and_grad(
        lambda x, t: chunked_cross_entropy(x, t, chunk_rows=64), logits, target, 2.0**16
    )
    _, want = loss_and_grad(reference, logits, target, 2.0**16)
    assert grad.dtype == torch.float16 and (want != 0).float().mean() > 0.99
    torch.testing.assert_close(grad, want, atol=1e-7, rtol=2**-10)


def test_deterministic_and_independent_of_the_chunk_size_to_rounding():
    logits, target = make(n=200, v=300)
    runs = [
        loss_and_grad(lambda x, t: chunked_cross_entropy(x, t, chunk_rows=32), logits, target)
        for _ in range(2)
    ]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    other = loss_and_grad(lambda x, t: chunked_cross_entropy(x, t, chunk_rows=7), logits, target)
    torch.testing.assert_close(other[0], runs[0][0], atol=1e-6, rtol=0)


def test_gradcheck_in_fp64():
    logits, target = make(n=9, v=11, ignored_every=3)
    x = logits.double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: chunked_cross_entropy(z, target, chunk_rows=4), (x,), eps=1e-6, atol=1e-7
    )


def test_saves_no_fp32_tensor_of_the_logits_size():
    # What autograd keeps between forward and backward: the bf16 logits themselves and
    # per-row vectors, never an fp32 [N, V] tensor (the plain loss saves its log-softmax).
    logits, target = make(n=64, v=500)
    logits = logits.bfloat16()

    def saved(fn):
        packed = []

        def pack(t):
            packed.append((t.dtype, t.numel()))
            return t

        x = logits.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(x, target)
        loss.backward()
        return packed

    full_fp32 = (torch.float32, logits.numel())
    assert full_fp32 not in saved(lambda x, t: chunked_cross_entropy(x, t, chunk_rows=8))
    assert (torch.bfloat16, logits.numel()) in saved(chunked_cross_entropy)
    assert full_fp32 in saved(reference)  # the hook sees what the plain loss keeps


def test_no_single_allocation_of_an_fp32_copy_of_the_logits():
    # Every op of forward + backward, as torch.profiler sees its allocations: the largest
    # is the bf16 gradient; the plain loss allocates fp32 [N, V] tensors.
    logits, target = make(n=256, v=1000)
    logits = logits.bfloat16()

    def largest_allocation(fn):
        x = logits.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(x, target).backward()
        return max(e.self_cpu_memory_usage for e in prof.events())

    fp32_bytes = logits.numel() * 4
    chunked = largest_allocation(lambda x, t: chunked_cross_entropy(x, t, chunk_rows=16))
    assert chunked == logits.numel() * 2  # the gradient, in bf16
    assert largest_allocation(reference) >= fp32_bytes


def test_default_chunk_rows_per_device(monkeypatch):
    assert default_chunk_rows(50304, torch.device("cpu")) == 41  # 2^21 elements
    assert default_chunk_rows(50304, torch.device("cuda")) == 667  # 2^25 elements
    assert default_chunk_rows(10**9, torch.device("cpu")) == 1
    monkeypatch.setitem(chunked_ce.CHUNK_ELEMENTS, "cpu", 1000)  # 9 rows of 101
    logits, target = make()
    loss, grad = loss_and_grad(chunked_cross_entropy, logits, target)
    want_loss, want_grad = loss_and_grad(reference, logits, target)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)


def test_shape_and_chunk_errors():
    logits, target = make()
    with pytest.raises(ValueError, match="37 rows of logits, 36 targets"):
        chunked_cross_entropy(logits, target[:-1])
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        chunked_cross_entropy(logits, target, chunk_rows=0)


@pytest.mark.slow
def test_the_fused_chunks_compute_what_the_eager_ones_do(dtype=torch.bfloat16):
    """``fused`` (the GPU's default: each chunk one compiled kernel) gives the eager path's
    loss and gradient, ignored rows and the ragged last chunk included; compiled here for
    the CPU (inductor's C++), on a GPU by Triton."""
    logits, target = make()
    logits = logits.to(dtype)
    eager = loss_and_grad(
        lambda x, t: chunked_cross_entropy(x, t, chunk_rows=8, fused=False), logits, target
    )
    fused = loss_and_grad(
        lambda x, t: chunked_cross_entropy(x, t, chunk_rows=8, fused=True), logits, target
    )
    assert fused[1].dtype == dtype
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    torch.testing.assert_close(fused[0], eager[0], **tol)
    torch.testing.assert_close(fused[1].float(), eager[1].float(), **tol)
    want = loss_and_grad(reference, logits, target)
    torch.testing.assert_close(fused[0], want[0].to(fused[0].dtype), **tol)
