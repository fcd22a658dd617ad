"""GPT and Transformer-XL: the properties that define them, whatever the weights.

GPT: post-LN blocks (no final LayerNorm), causal. Transformer-XL: causal, its memory
carries no gradient yet changes the next segment's output, reading a text in segments
with memory gives exactly the logits of reading it at once (relative positions are
consistent across the segment boundary), evaluation keeps a longer memory; and the
clm-recurrent objective that feeds it."""

import json

import pytest
import torch
from conftest import random_ids as ids
from conftest import tiny_model as tiny

from pipeline.config import ObjectiveSection
from pipeline.errors import ConfigError
from pipeline.models import resolve_model_config
from pipeline.models.blocks import PAD_LOGIT
from pipeline.objectives import build_objective

VOCAB = 100  # padded to 128


@pytest.mark.parametrize("arch", ["gpt", "transformer-xl"])
def test_shapes_padded_vocab_and_interface(arch):
    model = tiny(arch).eval()
    out = model(ids(3, 10))
    assert out["logits"].shape == (3, 10, 128)
    assert out["hidden_states"].shape == (3, 10, 64)
    assert (out["logits"][..., VOCAB:] < PAD_LOGIT / 2).all()
    assert model.causal is True
    assert model.flops_per_token(32) > 6 * sum(p.numel() for p in model.parameters()) / 2
    model.set_activation_checkpointing(True)


@pytest.mark.parametrize("arch", ["gpt", "transformer-xl"])
def test_causal_mask_never_looks_ahead(arch):
    model = tiny(arch).eval()
    x = ids(2, 12)
    y = x.clone()
    y[:, 8] = (y[:, 8] + 1) % VOCAB
    a, b = model(x)["logits"], model(y)["logits"]
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_gpt_is_post_ln_without_final_layernorm():
    model = tiny("gpt").eval()
    assert all(not b.pre_ln for b in model.blocks)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.children())
    out = model(ids(2, 8))
    # the last block ends with its LayerNorm (identity affine at init): per-position
    # hidden states are normalised, which a pre-LN stack without ln_f would not give
    h = out["hidden_states"]
    torch.testing.assert_close(h.mean(-1), torch.zeros(2, 8), atol=1e-5, rtol=0)
    torch.testing.assert_close(h.std(-1, unbiased=False), torch.ones(2, 8), atol=1e-3, rtol=0)


def test_txl_memory_has_no_gradient_and_changes_the_next_segment():
    model = tiny("transformer-xl").train()  # dropout 0.1 in the preset: keep it off
    model.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, torch.nn.Dropout) else None)
    x = ids(2, 24)
    captured = []  # layer 0's output for segment 1: what layer 1's memory is made of
    hook = model.layers[0].register_forward_hook(lambda m, i, o: captured.append(o))
    first = model(x[:, :12])
    hook.remove()
    mems = first["mems"]
    assert len(mems) == model.config.num_layers
    assert all(m.shape == (2, 12, 64) for m in mems)
    assert all(not m.requires_grad and m.grad_fn is None for m in mems)
    with_mem = model(x[:, 12:], mems=mems)
    without = model(x[:, 12:])
    assert not torch.allclose(with_mem["logits"], without["logits"], atol=1e-4)
    # the loss of segment 2 backpropagates into the weights, never into segment 1's states
    loss = with_mem["logits"][..., :VOCAB].logsumexp(-1).sum()
    into_first, into_u = torch.autograd.grad(loss, [captured[0], model.u], allow_unused=True)
    assert into_first is None  # no path from segment 2's loss back into segment 1
    assert into_u is not None and into_u.abs().sum() > 0


def test_txl_segments_with_memory_equal_one_long_pass():
    """Relative positions: segment 2 over memory = the same positions read in one go."""
    model = tiny("transformer-xl", mem_len=16, eval_mem_len=16).eval()
    x = ids(2, 16)
    whole = model(x)["logits"]
    a = model(x[:, :6])
    b = model(x[:, 6:11], mems=a["mems"])
    c = model(x[:, 11:], mems=b["mems"])
    got = torch.cat([a["logits"], b["logits"], c["logits"]], dim=1)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)


def test_txl_memory_lengths_train_and_eval():
    model = tiny("transformer-xl", mem_len=8, eval_mem_len=20).train()
    mems = None
    for k in range(3):
        mems = model(ids(1, 6, seed=k), mems=mems)["mems"]
    assert mems[0].shape[1] == 8  # training keeps mem_len
    model.eval()
    mems = None
    for k in range(5):
        mems = model(ids(1, 6, seed=k), mems=mems)["mems"]
    assert mems[0].shape[1] == 20  # evaluation keeps the longer eval_mem_len
    assert tiny("transformer-xl", mem_len=0).train()(ids(1, 4))["mems"] is None
    with pytest.raises(ValueError, match="mems"):
        model(ids(2, 4), mems=mems)  # batch size 1 memory for 2 rows


def test_txl_right_padding_does_not_change_real_positions():
    model = tiny("transformer-xl").eval()
    x = ids(1, 10)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 7:] = 0
    padded = model(x, attention_mask=mask)["logits"][:, :7]
    torch.testing.assert_close(padded, model(x[:, :7])["logits"])


def test_txl_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="hidden_size 63 must be even"):
        resolve_model_config(
            {"arch": "transformer-xl", "preset": "transformer-xl-tiny", "hidden_size": 63,
             "num_heads": 1}, VOCAB)  # fmt: skip
    with pytest.raises(ConfigError, match="model.mem_len"):
        resolve_model_config({"arch": "transformer-xl", "mem_len": -1}, VOCAB)


# ----------------------------------------------------------------------------- objective

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}


def test_clm_refuses_a_model_with_memory_and_clm_recurrent_refuses_document_knobs():
    clm = build_objective(ObjectiveSection(kind="clm"), ROLES, VOCAB, 16)
    with pytest.raises(ConfigError, match="clm-recurrent"):
        clm.attach(tiny("transformer-xl"))
    clm.attach(tiny("gpt"))  # no memory: fine
    rec = build_objective(ObjectiveSection(kind="clm-recurrent"), ROLES, VOCAB, 16)
    assert rec.recurrent_rows and not clm.recurrent_rows
    rec.attach(tiny("transformer-xl"))
    bad = ObjectiveSection(kind="clm-recurrent", clm={"reset_position_ids": True})
    with pytest.raises(ConfigError, match="objective.clm.reset_position_ids"):
        build_objective(bad, ROLES, VOCAB, 16)


def test_clm_recurrent_rows_continue_each_other(tiny_data):
    """Row j of batch g+1 starts where row j of batch g ended: its first input is that
    row's last label (the blocks overlap by one token), on every rank."""
    from pipeline.loader.stream import PretrainStream

    meta = json.loads((tiny_data / "tokenizer" / "tokenizer_meta.json").read_text())
    kind = ObjectiveSection(kind="clm-recurrent")
    obj = build_objective(kind, meta["roles"], meta["vocab_size"], 16)
    for rank in (0, 1):
        stream = PretrainStream(tiny_data, "train", obj, micro_batch_size=3, seed=1,
                                rank=rank, world_size=2, num_workers=0)  # fmt: skip
        it = iter(stream)
        batches = [next(it) for _ in range(4)]
        stream.close()
        for prev, nxt in zip(batches, batches[1:], strict=False):
            assert torch.equal(nxt["input_ids"][:, 0], prev["labels"][:, -1])
            assert torch.equal(nxt["input_ids"][:, 1:], nxt["labels"][:, :-1])
        # the rows are different stretches of text, not copies
        assert len({tuple(r) for r in batches[0]["input_ids"].tolist()}) == 3
    assert "attention_mask" not in batches[0]  # packed rows have no padding: no mask (no sync)
