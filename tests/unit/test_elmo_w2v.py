"""ELMo and word2vec: the bidirectional LM's information flow, the character table, the
scalar mix, the two objectives, polysemy (static vs contextual vectors), bundles,
`plm neighbors` and word2vec initialisation of a downstream embedding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import plm, synthetic_corpus
from tokenizers import Tokenizer

from pipeline.config import ObjectiveSection
from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.models import build_model, resolve_model_config
from pipeline.models.blocks import PAD_LOGIT
from pipeline.models.bundle import load_bundle, save_bundle
from pipeline.models.elmo import (
    BOW,
    CONTINUE,
    EOW,
    SPECIAL,
    WORD_START,
    ScalarMix,
    build_char_table,
)
from pipeline.models.word2vec_vectors import init_embedding_from_word2vec, load_word2vec_embeddings
from pipeline.objectives import IGNORE_INDEX, Piece, Unit, build_objective

VOCAB = 100


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory) -> Path:
    """Real tokenizers of the three kinds (the project's trainer), on a tiny corpus."""
    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("toks")
    corpus = root / "corpus.txt"
    corpus.write_text(
        synthetic_corpus(60) + "\n\n" + "The river bank. The bank loan. 银行 ñandú. " * 5 + "\n"
    )
    for kind in ("wordpiece", "bpe", "unigram"):
        train_tokenizer([str(corpus)], TokenizerSpec(kind=kind, vocab_size=300), root / kind)
    return root


def meta_of(tok_dir: Path) -> dict:
    return json.loads((tok_dir / "tokenizer_meta.json").read_text())


def elmo(vocab: int = VOCAB, tok_dir: Path | None = None, **overrides):
    cfg = resolve_model_config({"arch": "elmo", "preset": "elmo-tiny", **overrides}, vocab)
    torch.manual_seed(0)
    model = build_model("elmo", cfg)
    if tok_dir is not None:
        model.set_char_table(build_char_table(tok_dir, cfg))
    return model.eval()


def word2vec(vocab: int = VOCAB, **overrides):
    cfg = resolve_model_config({"arch": "word2vec", "preset": "word2vec-tiny", **overrides}, vocab)
    torch.manual_seed(0)
    return build_model("word2vec", cfg)


def ids(B=2, T=12, seed=1):
    return torch.randint(5, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- ELMo model


def test_elmo_outputs_all_layers_and_padded_softmax():
    model = elmo()
    out = model(ids(3, 10))
    assert out["layers"].shape == (3, 3, 10, 64)  # token layer + 2 biLSTM layers, 2 x 32
    assert torch.equal(out["hidden_states"], out["layers"][:, -1])
    x = out["layers"][:, 0]  # layer 0 is the token encoding, the same in both halves
    assert torch.equal(x[..., :32], x[..., 32:])
    for key in ("fwd_logits", "bwd_logits"):
        assert out[key].shape == (3, 10, 128)
        assert (out[key][..., VOCAB:] < PAD_LOGIT / 2).all()
    assert "fwd_logits" not in model(ids(1, 4), pretrain_heads=False)


@pytest.mark.parametrize("padded", [False, True])
def test_backward_lm_sees_only_the_right_context_forward_only_the_left(padded):
    """The defining property of ELMo's biLM: changing token s leaves the backward LM's
    predictions at every t > s and the forward LM's at every t < s unchanged, and does
    change the other side (the test can fail)."""
    model = elmo()
    x = ids(2, 12)
    mask = None
    if padded:  # row 1 right-padded: real tokens 0..8
        mask = torch.ones_like(x)
        mask[1, 9:] = 0
    real = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()

    def logits(inputs):  # padding positions' predictions are never used: zero them
        out = model(inputs, mask)
        return {k: out[k] * real[..., None] for k in ("fwd_logits", "bwd_logits")}

    base = logits(x)
    for s in (0, 4, 8):
        y = x.clone()
        y[:, s] = (y[:, s] + 7) % (VOCAB - 5) + 5
        out = logits(y)
        assert torch.equal(out["bwd_logits"][:, s + 1 :], base["bwd_logits"][:, s + 1 :])
        assert torch.equal(out["fwd_logits"][:, :s], base["fwd_logits"][:, :s])
        assert not torch.allclose(out["bwd_logits"][:, : s + 1], base["bwd_logits"][:, : s + 1])
        assert not torch.allclose(out["fwd_logits"][:, s:], base["fwd_logits"][:, s:])


def test_padding_anywhere_does_not_change_real_positions():
    model = elmo()
    x = ids(2, 9)
    ref = model(x)["layers"]
    pad = torch.zeros(2, 3, dtype=torch.long)
    right = model(torch.cat([x, pad], 1), torch.cat([torch.ones_like(x), pad], 1))["layers"]
    left = model(torch.cat([pad, x], 1), torch.cat([pad, torch.ones_like(x)], 1))["layers"]
    assert torch.allclose(right[:, :, :9], ref, atol=1e-6)
    assert torch.allclose(left[:, :, 3:], ref, atol=1e-6)
    assert (right[:, :, 9:] == 0).all()


def test_activation_checkpointing_same_loss_and_grads():
    x = ids(2, 8)
    grads = []
    for enabled in (False, True):
        model = elmo().train()
        model.set_activation_checkpointing(enabled)
        out = model(x)
        (out["fwd_logits"].logsumexp(-1).mean() + out["bwd_logits"].mean()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name


def test_original_preset_has_the_papers_sizes():
    cfg = resolve_model_config({"arch": "elmo", "preset": "elmo"}, 1000)
    assert (cfg.n_filters, cfg.lstm_dim, cfg.projection_dim, cfg.num_layers) == (2048, 4096, 512, 2)
    with torch.device("meta"):
        model = build_model("elmo", cfg)
    n = sum(p.numel() for n_, p in model.named_parameters() if not n_.startswith("softmax"))
    assert 93.0e6 < n < 94.0e6  # the paper: 93.6M parameters besides the softmax
    assert model.flops_per_token(128) == model.flops_per_token(16) > 6 * n


def test_elmo_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.lstm_dim"):
        resolve_model_config({"arch": "elmo", "preset": "elmo-tiny", "lstm_dim": 0}, VOCAB)
    with pytest.raises(ConfigError, match="filter width 7 > max_chars 5"):
        resolve_model_config({"arch": "elmo", "max_chars": 5}, VOCAB)
    with pytest.raises(ConfigError, match="unknown key 'model.cells'"):
        resolve_model_config({"arch": "elmo", "cells": 5}, VOCAB)


# --------------------------------------------------------------------------- characters


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_char_table_spells_every_token_distinctly_and_deterministically(tokenizers_dir, kind):
    tok_dir = tokenizers_dir / kind
    V = meta_of(tok_dir)["vocab_size"]
    cfg = resolve_model_config({"arch": "elmo", "preset": "elmo-tiny", "max_chars": 24}, V)
    table = build_char_table(tok_dir, cfg)
    assert table.shape == (cfg.padded_vocab_size, 24)
    assert torch.equal(table, build_char_table(tok_dir, cfg))
    assert (table[:V, 0] == BOW).all() and (table[V:] == 0).all()
    rows = {tuple(r) for r in table[:V].tolist()}
    assert len(rows) == V  # no two vocabulary entries look the same to the char CNN
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))

    def chars(token: str) -> list[int]:
        row = table[tok.token_to_id(token)].tolist()
        return row[: row.index(EOW) + 1]

    for special in meta_of(tok_dir)["special_tokens"]:
        assert chars(special)[1] == SPECIAL
    if kind == "wordpiece":
        # get_vocab() order is not stable between runs, and a piece such as "##é" is two
        # UTF-8 bytes: sort, and spell the expected row from the piece's bytes.
        pieces = sorted(t for t in tok.get_vocab() if t.startswith("##") and len(t) == 3)
        for word in (pieces[0], pieces[-1]):
            assert chars(word) == [BOW, CONTINUE, *(b + 1 for b in word[2:].encode()), EOW]
        assert chars("bank") == [BOW, *(b + 1 for b in b"bank"), EOW]
    elif kind == "bpe":  # byte-level: Ġ is the space byte
        assert chars("Ġthe") == [BOW, *(b + 1 for b in b" the"), EOW]
    else:
        piece = sorted(t for t in tok.get_vocab() if t.startswith("▁") and len(t) > 2)[0]
        assert chars(piece) == [BOW, WORD_START, *(b + 1 for b in piece[1:].encode()), EOW]


def test_char_table_of_a_bigger_tokenizer_is_a_clear_error(tokenizers_dir):
    cfg = resolve_model_config({"arch": "elmo", "preset": "elmo-tiny"}, 50)
    with pytest.raises(ValueError, match="vocab_size is 50"):
        build_char_table(tokenizers_dir / "wordpiece", cfg)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        build_char_table(tokenizers_dir, cfg)


# --------------------------------------------------------------------------- scalar mix


def test_scalar_mix_is_a_softmax_weighted_scaled_sum():
    layers = torch.randn(2, 3, 5, 8)
    mix = ScalarMix(3)
    assert torch.allclose(mix(layers), layers.mean(1), atol=1e-6)  # equal weights at start
    with torch.no_grad():
        mix.weights.copy_(torch.tensor([0.0, 1.0, 2.0]))
        mix.gamma.fill_(3.0)
    w = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    expected = 3.0 * (w[0] * layers[:, 0] + w[1] * layers[:, 1] + w[2] * layers[:, 2])
    assert torch.allclose(mix(layers), expected, atol=1e-5)
    assert torch.allclose(mix(list(layers.unbind(1))), expected, atol=1e-5)
    mix(layers).sum().backward()
    assert mix.weights.grad.abs().sum() > 0 and mix.gamma.grad is not None
    with pytest.raises(ValueError, match="over 3 layers got 2"):
        mix(layers[:, :2])


# --------------------------------------------------------------------------- objectives


def doc(tokens) -> Document:
    t = np.asarray(tokens, dtype=np.uint16)
    return Document("d", t, np.array([len(t)], np.int32), np.arange(len(t), dtype=np.int32))


ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 3}


def test_bilm_example_is_bos_window_eos_with_shifted_labels():
    obj = build_objective(ObjectiveSection(kind="bilm"), ROLES, VOCAB, 10)
    ex = obj.make_example(Unit((0, 0), (Piece(0, 2, 7),)), [doc(range(10, 20))], None)
    assert ex["input_ids"].tolist() == [2, 12, 13, 14, 15, 16, 3, 0, 0, 0]
    assert ex["attention_mask"].tolist() == [1] * 7 + [0] * 3
    assert ex["fwd_labels"].tolist() == [12, 13, 14, 15, 16, 3] + [IGNORE_INDEX] * 4
    assert ex["bwd_labels"].tolist() == [IGNORE_INDEX, 2, 12, 13, 14, 15, 16] + [IGNORE_INDEX] * 3
    # layout: windows of at most seq_len - 2 tokens
    layout = obj.layout(np.array([0]), np.array([17]))
    assert [u.pieces[0].stop - u.pieces[0].start for u in layout.units(np.arange(3))] == [5, 6, 6]
    with pytest.raises(ConfigError, match="model.arch=elmo"):
        obj.attach(word2vec())
    # the loss: mean of both directions; a model predicting the labels perfectly -> ~0
    batch = {k: torch.from_numpy(v)[None] for k, v in ex.items()}
    logits = {k: torch.full((1, 10, 128), -50.0) for k in ("fwd_logits", "bwd_logits")}
    for key, labels in (("fwd_logits", "fwd_labels"), ("bwd_logits", "bwd_labels")):
        for t, y in enumerate(batch[labels][0].tolist()):
            if y != IGNORE_INDEX:
                logits[key][0, t, y] = 50.0
    loss, metrics = obj.loss(logits, batch)
    assert float(loss) < 1e-6 and set(metrics) == {"fwd_loss", "bwd_loss"}


def w2v_objective(mode="skipgram", window=2, negatives=3, seq_len=12, **knobs):
    section = ObjectiveSection(kind="word2vec", word2vec=knobs)
    obj = build_objective(section, ROLES, VOCAB, seq_len)
    obj.attach(word2vec(mode=mode, window=window, negatives=negatives))
    counts = np.zeros(VOCAB, dtype=np.int64)
    counts[5:] = 1
    counts[10] = 10_000  # one very frequent token
    counts[1] = 50_000  # [UNK]: special, never a noise word
    obj.set_counts(counts)
    return obj


def test_word2vec_contexts_lie_in_the_dynamic_window():
    obj = w2v_objective(window=2)
    unit = Unit((0, 0), (Piece(0, 0, 8),))
    ex = obj.make_example(unit, [doc(range(20, 28))], np.random.default_rng(0))
    assert ex["input_ids"][:8].tolist() == list(range(20, 28))
    assert ex["context_ids"].shape == (12, 4) and ex["negative_ids"].shape == (12, 4, 3)
    for t in range(8):
        ctx = ex["context_ids"][t]
        offsets = [-2, -1, 1, 2]
        got = {o for o, c in zip(offsets, ctx.tolist(), strict=True) if c != IGNORE_INDEX}
        assert got, t  # reach >= 1: a neighbour exists on at least one side
        for o in got:
            assert ex["context_ids"][t][offsets.index(o)] == 20 + t + o
            assert 0 <= t + o < 8
        reach = max(abs(o) for o in got)
        assert all(abs(o) > reach or not 0 <= t + o < 8 or o in got for o in offsets)
    assert (ex["context_ids"][8:] == IGNORE_INDEX).all()
    cbow = w2v_objective(mode="cbow").make_example(
        unit, [doc(range(20, 28))], np.random.default_rng(0)
    )
    assert cbow["negative_ids"].shape == (12, 3)


def test_word2vec_noise_follows_unigram_to_the_075_and_subsampling_drops_frequent_words():
    obj = w2v_objective(negatives=5, seq_len=64, subsample=1e-3)
    noise = obj._draw_noise(np.random.default_rng(1), (200_000,))
    assert not np.isin(noise, [0, 1, 2, 3, 4]).any()  # specials never drawn
    share = (noise == 10).mean()
    expected = 10_000**0.75 / (10_000**0.75 + (VOCAB - 6) * 1.0)
    assert share == pytest.approx(expected, rel=0.03)
    tokens = [10] * 32 + list(range(20, 52))
    ex = obj.make_example(Unit((0, 0), (Piece(0, 0, 64),)), [doc(tokens)], np.random.default_rng(2))
    kept = ex["input_ids"][ex["attention_mask"] == 1]
    assert set(range(20, 52)) <= set(kept.tolist())  # rare words are kept
    assert (kept == 10).sum() < 10  # the frequent one mostly dropped
    with pytest.raises(ConfigError, match="no ordinary tokens"):
        obj.set_counts(np.zeros(VOCAB, dtype=np.int64))


@pytest.mark.parametrize("mode", ["skipgram", "cbow"])
def test_word2vec_loss_falls_and_pulls_context_words_together(mode):
    """Two words that always co-occur end up closer than two that never do."""
    obj = w2v_objective(mode=mode, window=1, negatives=3, seq_len=16)
    model = word2vec(mode=mode, window=1, negatives=3)
    obj.attach(model)
    counts = np.ones(VOCAB, dtype=np.int64)
    counts[[20, 21, 30, 31]] = 1000  # the other pair is a frequent noise word
    obj.set_counts(counts)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    docs = [doc([20, 21] * 8), doc([30, 31] * 8)]
    losses = []
    for _ in range(60):
        exs = [
            obj.make_example(Unit((i, 0), (Piece(i, 0, 16),)), [d], rng) for i, d in enumerate(docs)
        ]
        batch = obj.collate(exs)
        out = model(
            batch["input_ids"], batch["attention_mask"], batch["context_ids"], batch["negative_ids"]
        )
        loss, _ = obj.loss(out, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5
    # 20 and 21 are each other's only context; 31 never meets 20
    v = torch.nn.functional.normalize(model.vectors.detach(), dim=-1)
    u = torch.nn.functional.normalize(model.output_embeddings.weight.detach(), dim=-1)
    assert (v[20] @ u[21]) > (v[20] @ u[31]) + 0.5


# --------------------------------------------------------------------------- polysemy


def test_polysemy_word2vec_one_vector_elmo_one_per_context(tokenizers_dir):
    """The seed documents' point: a static embedding gives 'bank' the same vector in
    'the river bank' and 'the bank loan'; ELMo's contextual layers do not (its layer 0,
    the token encoding, is static too)."""
    tok_dir = tokenizers_dir / "wordpiece"
    V = meta_of(tok_dir)["vocab_size"]
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    a = tok.encode("The river bank", add_special_tokens=False).ids
    b = tok.encode("The bank loan", add_special_tokens=False).ids
    bank = tok.token_to_id("bank")
    assert bank in a and bank in b
    ia, ib = a.index(bank), b.index(bank)
    w2v = word2vec(V)
    va = w2v(torch.tensor([a]))["hidden_states"][0, ia]
    vb = w2v(torch.tensor([b]))["hidden_states"][0, ib]
    assert torch.equal(va, vb)
    model = elmo(V, tok_dir)
    la = model(torch.tensor([a]), pretrain_heads=False)["layers"][0, :, ia]
    lb = model(torch.tensor([b]), pretrain_heads=False)["layers"][0, :, ib]
    assert torch.equal(la[0], lb[0])  # layer 0: characters only
    for k in (1, 2):
        cos = torch.nn.functional.cosine_similarity(la[k], lb[k], dim=0)
        assert cos < 0.999, (k, float(cos))
    mix = ScalarMix(3)
    assert not torch.allclose(mix(la[None, :, None]), mix(lb[None, :, None]))


# --------------------------------------------------------------------------- bundles, CLI


@pytest.fixture(scope="module")
def w2v_bundle(tokenizers_dir, tmp_path_factory) -> Path:
    """A word2vec bundle whose 'dog' vector sits right next to 'cat'."""
    tok_dir = tokenizers_dir / "wordpiece"
    V = meta_of(tok_dir)["vocab_size"]
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    model = word2vec(V)
    cat, dog = tok.token_to_id("cat"), tok.token_to_id("dog")
    with torch.no_grad():
        model.input_embeddings.weight.normal_()
        model.input_embeddings.weight[dog] = model.input_embeddings.weight[cat] + 0.01
        model.counts[:V] = 1.0
    out = tmp_path_factory.mktemp("w2v") / "bundle"
    return save_bundle(out, "word2vec", model.config, model.state_dict(), tok_dir)


@pytest.mark.slow  # two `plm` subprocesses
def test_neighbors_cli_finds_the_nearest_word(w2v_bundle, tmp_path):
    proc = plm("neighbors", str(w2v_bundle), "cat", "--k", "3", cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[0].split()[-1] == "dog"
    assert "cat" not in [line.split()[-1] for line in lines]
    bad = plm("neighbors", str(tmp_path), "cat", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "not a model bundle" in bad.stderr


def test_elmo_bundle_round_trip_keeps_the_char_table(tokenizers_dir, tmp_path):
    tok_dir = tokenizers_dir / "bpe"
    model = elmo(meta_of(tok_dir)["vocab_size"], tok_dir)
    out = save_bundle(tmp_path / "b", "elmo", model.config, model.state_dict(), tok_dir)
    loaded, config = load_bundle(out)
    assert config["arch"] == "elmo"
    assert torch.equal(loaded.char_ids, model.char_ids)
    x = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(loaded(x)["layers"], model(x)["layers"])


def test_word2vec_vectors_initialise_a_downstream_embedding(w2v_bundle, tokenizers_dir):
    tok_dir = tokenizers_dir / "wordpiece"
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    source, _ = load_bundle(w2v_bundle)
    vectors, found = load_word2vec_embeddings(w2v_bundle, tok_dir)  # the same vocabulary
    specials = set(meta_of(tok_dir)["special_tokens"].values())
    assert vectors.shape == (tok.get_vocab_size(), 32)
    assert found.tolist() == [i not in specials for i in range(len(found))]
    assert torch.equal(vectors[found], source.vectors[found])
    # another vocabulary: exact tokens, split words averaged, unknown ones not found
    other, found2 = load_word2vec_embeddings(w2v_bundle, ["[PAD]", "cat", "catdog", ""])
    assert found2.tolist() == [False, True, True, False]
    pieces = tok.encode("catdog", add_special_tokens=False).ids
    assert torch.allclose(other[2], source.vectors[pieces].mean(0))
    emb = torch.nn.Embedding(4, 32)
    before = emb.weight.detach().clone()
    n = init_embedding_from_word2vec(emb, w2v_bundle, ["[PAD]", "cat", "catdog", ""], freeze=True)
    assert n == 2 and not emb.weight.requires_grad
    assert torch.equal(emb.weight[1], other[1]) and torch.equal(emb.weight[0], before[0])
    with pytest.raises(ValueError, match="32 dimensions, the embedding 16"):
        init_embedding_from_word2vec(torch.nn.Embedding(4, 16), w2v_bundle, ["cat"])
