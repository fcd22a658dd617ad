"""Model properties that must hold whatever the weights: shapes, masking, tying,
checkpointing equivalence, FLOPs accounting and config errors."""

import pytest
import torch
from conftest import random_ids as ids
from conftest import tiny_model as tiny

from pipeline.errors import ConfigError
from pipeline.models import ARCHITECTURES, build_model, resolve_model_config
from pipeline.models.blocks import PAD_LOGIT

VOCAB = 100  # padded to 128 by the model


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_shapes_and_padded_vocab(arch):
    model = tiny(arch).eval()
    out = model(ids(3, 10))
    key = "mlm_logits" if arch == "bert" else "logits"
    assert model.config.padded_vocab_size == 128
    assert out[key].shape == (3, 10, 128)
    assert out["hidden_states"].shape == (3, 10, 64)
    if arch == "bert":
        assert out["nsp_logits"].shape == (3, 2)
    # the padded rows never win and carry no probability
    assert (out[key][..., VOCAB:] < PAD_LOGIT / 2).all()
    assert (out[key].argmax(-1) < VOCAB).all()
    assert out[key].softmax(-1)[..., VOCAB:].sum() == 0


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_tied_embeddings_are_one_parameter(arch):
    model = tiny(arch)
    emb = model.embeddings.word.weight if arch == "bert" else model.wte.weight
    names = [n for n, p in model.named_parameters() if p is emb]
    assert len(names) == 1
    # a change to the embedding matrix changes the output logits: the head uses it
    x = ids(1, 4)
    key = "mlm_logits" if arch == "bert" else "logits"
    model.eval()
    before = model(x)[key]
    with torch.no_grad():  # not a constant: a LayerNorm's output sums to zero (BERT's head)
        emb[5] += torch.linspace(-1.0, 1.0, emb.shape[1])
    after = model(x)[key]
    assert not torch.allclose(before[..., 5], after[..., 5])
    # and gradients from the head reach the embedding rows of tokens never in the input
    model.zero_grad()
    out = model(torch.zeros(1, 4, dtype=torch.long))[key]
    out[..., 7].sum().backward()
    assert emb.grad[7].abs().sum() > 0


def test_causal_mask_never_looks_ahead():
    model = tiny("gpt2").eval()
    x = ids(2, 12)
    y = x.clone()
    y[:, 8] = (y[:, 8] + 1) % VOCAB
    a, b = model(x)["logits"], model(y)["logits"]
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_document_ids_block_attention_across_documents():
    model = tiny("gpt2").eval()
    x = ids(1, 12)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    pos = torch.tensor([list(range(5)) + list(range(7))])
    packed = model(x, position_ids=pos, document_ids=docs)["logits"]
    # the second document alone gives the same logits as inside the packed row
    alone = model(x[:, 5:])["logits"]
    torch.testing.assert_close(packed[:, 5:], alone, atol=1e-5, rtol=1e-5)
    # changing the first document leaves the second untouched, but not without document_ids
    y = x.clone()
    y[0, 1] = (y[0, 1] + 1) % VOCAB
    torch.testing.assert_close(
        model(y, position_ids=pos, document_ids=docs)["logits"][:, 5:], packed[:, 5:]
    )
    assert not torch.allclose(model(y, position_ids=pos)["logits"][:, 5:], packed[:, 5:])


def test_gpt2_attention_mask_with_left_padding_is_finite_and_exact():
    model = tiny("gpt2").eval()
    x = ids(1, 8)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1)
    mask = torch.tensor([[0] * 3 + [1] * 8])
    pos = torch.tensor([[0] * 3 + list(range(8))])
    out = model(padded, attention_mask=mask, position_ids=pos)["logits"]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 3:], model(x)["logits"], atol=1e-5, rtol=1e-5)


def test_bert_padding_does_not_affect_real_positions():
    model = tiny("bert").eval()
    x = ids(1, 9)
    tt = torch.tensor([[0] * 5 + [1] * 4])
    ref = model(x, token_type_ids=tt)
    padded = torch.cat([x, torch.randint(0, VOCAB, (1, 7))], dim=1)
    tt_p = torch.cat([tt, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 9 + [0] * 7])
    out = model(padded, token_type_ids=tt_p, attention_mask=mask)
    torch.testing.assert_close(out["mlm_logits"][:, :9], ref["mlm_logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["nsp_logits"], ref["nsp_logits"], atol=1e-5, rtol=1e-5)
    # without the mask the padding does leak in: the test above can fail
    leak = model(padded, token_type_ids=tt_p)["mlm_logits"][:, :9]
    assert not torch.allclose(leak, ref["mlm_logits"], atol=1e-5)
    # a row that is all padding stays finite
    all_pad = model(padded, attention_mask=torch.zeros_like(mask))["mlm_logits"]
    assert torch.isfinite(all_pad).all()


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_activation_checkpointing_same_loss_and_grads(arch):
    key = "mlm_logits" if arch == "bert" else "logits"
    x, labels = ids(2, 16, seed=3), ids(2, 16, seed=4)
    results = []
    for ckpt in (False, True):
        model = tiny(arch)  # same seed -> same weights; dropout on (train mode)
        model.set_activation_checkpointing(ckpt)
        torch.manual_seed(7)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out[key].flatten(0, 1), labels.flatten())
        if arch == "bert":
            loss = loss + out["nsp_logits"].logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-6, atol=1e-7, msg=name)


def test_gpt2_residual_projections_scaled_at_init():
    model = tiny("gpt2", num_layers=8, hidden_size=256, num_heads=4, intermediate_size=1024)
    expected = 0.02 / (2 * 8) ** 0.5
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.fc.bias.abs().sum() == 0


@pytest.mark.parametrize(
    "arch,preset,vocab", [("bert", "bert-base", 30522), ("gpt2", "gpt2", 50257)]
)
def test_flops_per_token_matches_param_count(arch, preset, vocab):
    cfg = resolve_model_config({"arch": arch, "preset": preset}, vocab)
    with torch.device("meta"):
        model = build_model(arch, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert 109e6 < n_params < 111e6 if arch == "bert" else 124e6 < n_params < 125e6
    # no attention: 6 * all parameters minus the position/segment tables (the word table
    # is counted once, as the tied output matmul)
    n_pos = cfg.max_positions * cfg.hidden_size + (
        cfg.type_vocab_size * cfg.hidden_size if arch == "bert" else 0
    )
    flops_t1 = model.flops_per_token(1) - 12 * cfg.num_layers * cfg.hidden_size
    assert flops_t1 == pytest.approx(6 * (n_params - n_pos))
    # the attention term grows linearly with the sequence length: 12 * L * H per token
    delta = model.flops_per_token(1024) - model.flops_per_token(512)
    assert delta == pytest.approx(12 * cfg.num_layers * cfg.hidden_size * 512)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown key 'model.num_layer'"):
        resolve_model_config({"arch": "bert", "preset": "bert-tiny", "num_layer": 3}, VOCAB)
    with pytest.raises(ConfigError, match=r"model.dropout"):
        resolve_model_config({"arch": "gpt2", "preset": "gpt2-tiny", "dropout": 1.5}, VOCAB)
    with pytest.raises(
        ConfigError, match=r"unknown architecture 'bret'; available: .*\bbert\b.*\bgpt2\b"
    ):
        resolve_model_config({"arch": "bret"}, VOCAB)
    with pytest.raises(ConfigError, match=r"unknown preset 'bert-huge'.*bert-base"):
        resolve_model_config({"arch": "bert", "preset": "bert-huge"}, VOCAB)
    with pytest.raises(ConfigError, match=r"preset 'gpt2-tiny' is for arch 'gpt2'"):
        resolve_model_config({"arch": "bert", "preset": "gpt2-tiny"}, VOCAB)
    with pytest.raises(ConfigError, match=r"model.vocab_size"):
        resolve_model_config({"arch": "bert", "preset": "bert-tiny", "vocab_size": 5}, VOCAB)
    with pytest.raises(ConfigError, match=r"not divisible by num_heads"):
        resolve_model_config({"arch": "bert", "preset": "bert-tiny", "num_heads": 3}, VOCAB)
    with pytest.raises(ConfigError, match=r"key 'model.hidden_size'.*integer"):
        resolve_model_config({"arch": "gpt2", "hidden_size": "big"}, VOCAB)
    # without a preset the paper's base sizes are the defaults
    assert resolve_model_config({"arch": "gpt2"}, VOCAB).num_layers == 12


def test_overrides_replace_preset_values_and_every_preset_resolves():
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-base", "num_layers": 6}, 30522)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (6, 768, 30522)
    assert cfg.padded_vocab_size == 30528
    from pipeline.models.registry import available_presets, load_preset

    presets = available_presets()
    assert {"bert-base", "bert-large", "bert-tiny", "gpt2", "gpt2-medium", "gpt2-tiny"} <= set(
        presets
    )
    for name in presets:
        arch = load_preset(name)["arch"]
        assert arch in ARCHITECTURES
        resolve_model_config({"arch": arch, "preset": name}, 1000)


def test_sequence_longer_than_positions_is_a_clear_error():
    model = tiny("gpt2", max_positions=16)
    with pytest.raises(ValueError, match="max_positions"):
        model(ids(1, 17))


@pytest.mark.parametrize("arch", ["bert", "roberta", "albert", "ernie"])
def test_mlm_labels_restrict_the_decoder_to_labelled_positions(arch):
    """Given mlm_labels, the MLM head decodes only the labelled positions: the rows equal
    those of the full [B,T,Vpad] logits, and the loss and its gradients are the same."""
    from pipeline.objectives.mlm import masked_lm_loss

    model = tiny(arch).eval()  # no dropout: the passes must be comparable
    x = ids(B=3, T=12)
    labels = torch.full_like(x, -100)
    labels[0, 3], labels[1, 0], labels[1, 7], labels[2, 11] = 5, 6, 7, 8
    full = model(input_ids=x)["mlm_logits"]
    picked = model(input_ids=x, mlm_labels=labels)["mlm_logits"]
    assert picked.shape == (4, full.shape[-1])
    torch.testing.assert_close(picked, full[labels != -100])
    grads = []
    for kwargs in ({}, {"mlm_labels": labels}):
        model.zero_grad()
        loss, _ = masked_lm_loss(model(input_ids=x, **kwargs)["mlm_logits"], labels)
        loss.backward()
        grads.append(model.embeddings.word.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("arch", ["bert", "albert", "electra", "roberta"])
def test_one_segment_type_takes_segment_b_ids_as_segment_a(arch):
    """type_vocab_size 1: a pair's segment-B ids (1, from a two-type tokenizer) were an
    IndexError; the model reads every token as segment A (RoBERTa's way)."""
    model = tiny(arch, type_vocab_size=1).eval()
    x = ids()
    tt = torch.zeros_like(x)
    tt[:, 8:] = 1
    with torch.no_grad():
        got, want = model(x, token_type_ids=tt), model(x, token_type_ids=torch.zeros_like(x))
    for key in want:
        if torch.is_tensor(want[key]):
            torch.testing.assert_close(got[key], want[key])
