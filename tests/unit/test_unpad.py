"""Unpadded encoders (train.unpad): the same outputs, loss and gradients as the padded
path, computed on the real tokens only; documents of a causal model attended per
document without a [B,T,T] mask."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from pipeline.models.blocks import Dense, Packed, true_positions
from pipeline.objectives.mlm import labelled_targets, masked_lm_loss
from pipeline.objectives.rtd import generator_loss, rtd_loss
from pipeline.train.model_inputs import forward_keys

ENCODERS = ["bert", "ernie", "roberta", "albert", "electra", "distilbert"]
NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}


def padded_batch(arch: str, B: int = 4, T: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of 24, 17, 5 and 11 real tokens, then padding (RoBERTa pads with id 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([[24], [17], [5], [11]])).long()
    pad_id = 1 if arch == "roberta" else 0
    ids = torch.where(mask.bool(), ids, pad_id)
    types = (torch.arange(T)[None] >= 3).long().expand(B, T) * mask
    labels = torch.where((torch.rand(B, T, generator=g) < 0.3) & mask.bool(), ids, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "mlm_labels": labels}
    if arch != "distilbert":
        batch["token_type_ids"] = types if arch != "roberta" else torch.zeros_like(types)
    return batch


def loss_of(arch: str, out: dict, batch: dict) -> torch.Tensor:
    """The objectives' own loss functions on this architecture's outputs."""
    labels = batch["mlm_labels"]
    if arch == "electra":
        g, _ = generator_loss(out["mlm_logits"], labels[labels >= 0])
        d, _ = rtd_loss(out["rtd_logits"], out["rtd_labels"], batch["attention_mask"])
        return g + 50 * d
    loss, _ = masked_lm_loss(out["mlm_logits"], labels)
    for head in ("nsp_logits", "sop_logits"):
        if head in out:
            loss = loss + F.cross_entropy(out[head].float(), torch.tensor([0, 1, 1, 0]))
    return loss


def run(arch: str, unpad: bool, batch: dict, train: bool):
    model = tiny_model(arch, **NO_DROPOUT)  # seeded: the same weights for both paths
    model.set_unpad(unpad)
    model.train(train)
    seen = []  # what the first feed-forward layer computes on
    mlp = model.repeated_layers()[-1 if arch == "albert" else 0]
    mlp = mlp.mlp.fc if hasattr(mlp, "mlp") else mlp
    mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1].numel()))
    torch.manual_seed(5)  # ELECTRA samples its replacements
    out = model(**{k: v for k, v in batch.items() if k in forward_keys(model)})
    loss = loss_of(arch, out, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, loss.detach(), grads, seen[0]


@pytest.mark.parametrize("kernel", ["padded", "nested"])
@pytest.mark.parametrize("arch", ENCODERS)
def test_unpadded_encoder_equals_padded(arch, kernel, monkeypatch):
    monkeypatch.setattr(Packed, "kernel", kernel)
    batch = padded_batch(arch)
    real = batch["attention_mask"].bool()
    ref, ref_loss, ref_grads, ref_seen = run(arch, False, batch, train=True)
    out, loss, grads, seen = run(arch, True, batch, train=True)
    assert ref_seen == real.numel() and seen == int(real.sum())  # no FLOPs on padding
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for key, value in ref.items():
        if key == "hidden_states" or value.dim() >= 2 and value.shape[:2] == real.shape:
            value, other = value[real], out[key][real]  # padded positions are not compared
        else:
            other = out[key]
        torch.testing.assert_close(other.float(), value.float(), atol=1e-5, rtol=1e-5, msg=key)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ENCODERS)
def test_unpadded_eval_logits_equal_padded(arch):
    """Without labels (fine-tuning, export): every real position's outputs match."""
    batch = padded_batch(arch, seed=1)
    batch.pop("mlm_labels")
    real = batch["attention_mask"].bool()
    outs = []
    for unpad in (False, True):
        model = tiny_model(arch).eval()
        model.set_unpad(unpad)
        with torch.no_grad():
            outs.append(model(**batch))
    for key, value in outs[0].items():
        if value.dim() >= 2 and value.shape[:2] == real.shape:
            torch.testing.assert_close(outs[1][key][real], value[real], atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(outs[1][key], value, atol=1e-5, rtol=1e-5)


def test_full_rows_keep_the_dense_path():
    """No padding in the batch: nothing to pack, the dense layout runs (no gathers)."""
    model = tiny_model("bert")
    model.set_unpad(True)
    seen = []
    model.blocks[0].mlp.fc.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    model(torch.randint(5, 100, (2, 8)), attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert seen == [torch.Size([2, 8, model.config.hidden_size])]


def test_sync_free_positions_equal_nonzero():
    """What a GPU forward packs with (no host read of nonzero's size) is nonzero's
    answer, for masks with empty, full and ragged rows."""
    gen = torch.Generator().manual_seed(0)
    for p in (0.0, 0.3, 0.9, 1.0):
        keep = torch.rand(6, 37, generator=gen) < p
        keep[0] = False
        flags = keep.flatten()
        n = int(flags.sum())
        assert torch.equal(true_positions(flags, n, sync_free=True), flags.nonzero().squeeze(1))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# PyTorch's nested-tensor SDPA takes is_causal only in its GPU kernels (flash and
# memory-efficient), which is where Packed uses it.
@pytest.mark.parametrize(
    "kernel", ["padded", pytest.param("nested", marks=[pytest.mark.gpu, CUDA])]
)
def test_documents_attend_per_document_without_a_dense_mask(kernel, monkeypatch):
    """GPT-2 with document_ids: causal attention within each document, the same logits
    and gradients as the [B,1,T,T] mask path, and no such mask built."""
    monkeypatch.setattr(Packed, "kernel", kernel)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    pos = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None].repeat(2, 1)
    pos[1] = torch.arange(16)
    dev = "cuda" if kernel == "nested" else "cpu"
    ids, docs, pos = ids.to(dev), docs.to(dev), pos.to(dev)
    results = []
    for unpad in (False, True):
        model = tiny_model("gpt2", **NO_DROPOUT).to(dev)
        model.set_unpad(unpad)
        masks: list = []
        model.blocks[0].attn.register_forward_hook(
            lambda m, args, out, masks=masks: masks.append(getattr(args[1], "mask", None))
        )
        logits = model(ids, position_ids=pos, document_ids=docs)["logits"]
        F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logits.detach(), grads, masks[0]))
    (ref, ref_grads, ref_mask), (out, grads, mask) = results
    assert ref_mask is not None and ref_mask.shape == (2, 1, 16, 16)
    assert mask is None  # Packed: no dense mask
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("unpad", [True, False])
@pytest.mark.parametrize("arch", ENCODERS)
def test_a_layout_built_on_the_cpu_batch_gives_the_same_step(arch, unpad):
    """What the trainer runs (``attention_layout`` on the loader's CPU batch, moved with
    ``to``) is bit for bit the forward that builds its layout from its own tensors:
    outputs, loss and gradients."""
    batch = padded_batch(arch)
    results = []
    for with_layout in (False, True):
        model = tiny_model(arch, **NO_DROPOUT)
        model.set_unpad(unpad)
        inputs = {k: v for k, v in batch.items() if k in forward_keys(model)}
        if with_layout:
            layout = model.attention_layout(batch).to("cpu")
            assert isinstance(layout, Packed if unpad else Dense)
            if "mlm_labels" in inputs:  # the labelled positions come with it
                assert layout.labelled is not None
            inputs["layout"] = layout
        torch.manual_seed(5)  # ELECTRA samples its replacements
        out = model(**inputs)
        loss = loss_of(arch, out, batch)
        loss.backward()
        results.append((out, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_loss, ref_grads), (out, loss, grads) = results
    assert torch.equal(loss, ref_loss)
    for key, value in ref.items():
        assert torch.equal(out[key], value), key
    for name, g in ref_grads.items():
        assert (g is None and grads[name] is None) or torch.equal(grads[name], g), name


def test_labelled_targets_equal_the_boolean_gather():
    """The MLM loss's targets, found by a stable sort of known size (no host read), are
    what ``labels[labels != -100]`` gives: none, some and all positions labelled."""
    gen = torch.Generator().manual_seed(0)
    for p in (0.0, 0.15, 0.5, 1.0):
        labels = torch.randint(0, 100, (5, 19), generator=gen)
        labels[torch.rand(5, 19, generator=gen) >= p] = -100
        expected = labels[labels != -100]
        assert torch.equal(labelled_targets(labels, expected.numel()), expected)


def test_rtd_loss_equals_the_mean_over_the_real_tokens():
    """ELECTRA's discriminator loss without a boolean gather: the same mean BCE and
    accuracy over the real tokens as gathering them first."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 24, generator=gen)
    labels = (torch.rand(4, 24, generator=gen) < 0.2).long()
    mask = padded_batch("electra")["attention_mask"]
    real = mask.bool()
    loss, acc = rtd_loss(logits, labels, mask)
    expected = F.binary_cross_entropy_with_logits(logits[real], labels[real].float())
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    assert acc == ((logits[real] > 0).long() == labels[real]).float().mean()
    full, _ = rtd_loss(logits, labels, None)
    torch.testing.assert_close(
        full, F.binary_cross_entropy_with_logits(logits, labels.float()), atol=1e-6, rtol=1e-6
    )


# Documents (runs of increasing ids, as the CLM loader numbers them) of every shape:
# one-token documents, a document filling its row, many short ones.
DOCUMENTS = [
    [[0] * 5 + [1] * 7 + [2] * 4, [0] * 16],
    [[0, 1, 2, 3] + [4] * 12, [0] * 15 + [1]],
    [[i // 2 for i in range(16)], [3] * 8 + [4] * 8],
]


@pytest.mark.parametrize("docs", DOCUMENTS)
def test_packed_causal_fallback_and_cpu_layout_equal_the_dense_mask(docs):
    """The CPU kernel of packed causal documents (``Packed`` padded per document: the
    exact fallback of the GPU's varlen kernel) against the [B,1,T,T] mask path, and the
    layout the trainer builds on the CPU batch against the one the forward builds."""
    g = torch.Generator().manual_seed(4)
    document_ids = torch.tensor(docs)
    ids = torch.randint(0, 100, document_ids.shape, generator=g)
    outputs = []
    for unpad, with_layout in ((False, False), (True, False), (True, True)):
        model = tiny_model("gpt2", **NO_DROPOUT)
        model.set_unpad(unpad)
        batch = {"input_ids": ids, "document_ids": document_ids}
        if with_layout:
            batch["layout"] = model.attention_layout(batch).to("cpu")
        logits = model(**batch)["logits"]
        F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        outputs.append((logits.detach(), grads))
    (dense, dense_grads), (packed, packed_grads), (shipped, shipped_grads) = outputs
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert torch.equal(shipped, packed)
    assert all(torch.equal(shipped_grads[n], g) for n, g in packed_grads.items())
