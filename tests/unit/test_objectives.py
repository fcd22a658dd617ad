"""The objectives as pure functions: masking statistics, NSP pairs, CLM packing, losses."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import MlmConfig, ObjectiveSection
from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.objectives import IGNORE_INDEX, Piece, Unit, build_objective
from pipeline.objectives.clm import BlockLayout, reset_positions
from pipeline.objectives.mlm import mask_tokens
from pipeline.objectives.nsp import truncate_pair

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}
SPECIAL = set(ROLES.values())
VOCAB = 1000


def make_doc(rng, n, key="d", sentence_len=12, specials=False):
    tokens = rng.integers(6, VOCAB, n)
    if specials:  # [UNK] and [EOD] can occur in text; they must never be masked
        tokens[rng.random(n) < 0.05] = ROLES["unk"]
        tokens[rng.random(n) < 0.02] = ROLES["eod"]
    ends = np.unique(np.append(rng.integers(1, n, max(1, n // sentence_len)), n))
    words = np.flatnonzero(np.concatenate([[True], rng.random(n - 1) < 0.5]))
    return Document(key, tokens.astype(np.uint16), ends.astype(np.int32), words.astype(np.int32))


def window_unit(doc_id, start, stop):
    return Unit(key=(doc_id, 0), pieces=(Piece(doc_id, start, stop),))


def original_ids(example):
    labels = example["mlm_labels"]
    return np.where(labels != IGNORE_INDEX, labels, example["input_ids"])


def masking_counts(examples, docs_tokens=None):
    selected = maskable = masked = random = kept = 0
    for ex in examples:
        orig, inp = original_ids(ex), ex["input_ids"]
        sel = ex["mlm_labels"] != IGNORE_INDEX
        maskable += int(((ex["attention_mask"] == 1) & ~np.isin(orig, list(SPECIAL))).sum())
        selected += int(sel.sum())
        masked += int((sel & (inp == ROLES["mask"])).sum())
        kept += int((sel & (inp == orig)).sum())
        random += int((sel & (inp != orig) & (inp != ROLES["mask"])).sum())
    return selected / maskable, masked / selected, random / selected, kept / selected


@pytest.mark.parametrize("kind", ["mlm", "mlm+nsp"])
def test_masking_statistics_over_100k_tokens(kind):
    obj = build_objective(ObjectiveSection(kind=kind), ROLES, VOCAB, 128)
    rng = np.random.default_rng(0)
    docs = [make_doc(rng, 600, f"d{i}", specials=True) for i in range(8)]
    examples, n_tokens = [], 0
    for i in range(1200):
        start = int(rng.integers(0, 400))
        unit = window_unit(i % 8, start, start + obj.seq_len - 3)
        ex_rng = np.random.default_rng([7, i])
        needed = obj.needs(unit, ex_rng, np.arange(8))
        ex = obj.make_example(unit, [docs[d] for d in needed], ex_rng)
        examples.append(ex)
        n_tokens += int(ex["attention_mask"].sum())
        # no special token is ever selected, and no random replacement is special
        orig = original_ids(ex)
        assert not np.isin(orig[ex["mlm_labels"] != IGNORE_INDEX], list(SPECIAL)).any()
        changed = (ex["input_ids"] != orig) & (ex["input_ids"] != ROLES["mask"])
        assert not np.isin(ex["input_ids"][changed], list(SPECIAL)).any()
        assert (ex["mlm_labels"][ex["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert n_tokens >= 100_000
    selected, masked, random, kept = masking_counts(examples)
    assert abs(selected - 0.15) < 0.005
    assert abs(masked - 0.80) < 0.01
    assert abs(random - 0.10) < 0.01
    assert abs(kept - 0.10) < 0.01


def test_mask_tokens_is_a_seeded_function_and_honours_the_fractions():
    ids = np.arange(6, 6 + 5000) % VOCAB
    maskable = np.ones(5000, dtype=bool)
    cfg = MlmConfig(probability=0.3, mask_fraction=0.5, random_fraction=0.5)
    reps = np.arange(6, VOCAB)
    a = mask_tokens(ids, maskable, np.random.default_rng(1), cfg, 4, reps)
    b = mask_tokens(ids, maskable, np.random.default_rng(1), cfg, 4, reps)
    c = mask_tokens(ids, maskable, np.random.default_rng(2), cfg, 4, reps)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[1], c[1])
    sel = a[1] != IGNORE_INDEX
    assert abs(sel.mean() - 0.3) < 0.03
    assert ((a[0][sel] == 4) | (a[0][sel] != ids[sel])).mean() > 0.99  # nothing kept


def test_whole_word_masking_selects_whole_words():
    cfg = ObjectiveSection(kind="mlm", mlm={"whole_word": True})
    obj = build_objective(cfg, ROLES, VOCAB, 128)
    rng = np.random.default_rng(3)
    selected = maskable = 0
    for i in range(400):
        doc = make_doc(rng, 126, f"w{i}")
        ex = obj.make_example(window_unit(0, 0, 126), [doc], np.random.default_rng(i))
        sel = ex["mlm_labels"][1:127] != IGNORE_INDEX
        word = np.cumsum(np.isin(np.arange(126), doc.words)) - 1
        for w in np.unique(word):  # a word is selected entirely or not at all
            assert sel[word == w].all() or not sel[word == w].any()
        selected += int(sel.sum())
        maskable += 126
    assert abs(selected / maskable - 0.15) < 0.02


def test_nsp_pairs_positive_rate_layout_and_continuity():
    obj = build_objective(ObjectiveSection(kind="mlm+nsp"), ROLES, VOCAB, 64)
    rng = np.random.default_rng(5)
    docs = [make_doc(rng, int(rng.integers(30, 300)), f"d{i}") for i in range(50)]
    labels = []
    for i in range(10_000):
        d = i % 50
        n = docs[d].n_tokens
        start = int(rng.integers(0, max(1, n - 61)))
        unit = window_unit(d, start, min(n, start + 61))
        ex_rng = np.random.default_rng([11, i])
        needed = obj.needs(unit, ex_rng, np.arange(50))
        ex = obj.make_example(unit, [docs[k] for k in needed], ex_rng)
        label = int(ex["nsp_labels"])
        assert label == (len(needed) == 2)
        labels.append(label)
        ids, types = original_ids(ex), ex["token_type_ids"]
        seps = np.flatnonzero(ids == ROLES["sep"])
        assert ids[0] == ROLES["cls"] and len(seps) == 2
        a, b = ids[1 : seps[0]], ids[seps[0] + 1 : seps[1]]
        assert len(a) >= 1 and len(a) + len(b) <= 61
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 : seps[1] + 1] == 1).all()
        assert ex["attention_mask"].sum() == seps[1] + 1
        if i < 500:  # A is a slice of the window; a true B follows it directly in the doc
            tokens = docs[d].tokens.astype(np.int64)
            a_at = [
                s
                for s in range(start, unit.pieces[0].stop)
                if np.array_equal(tokens[s : s + len(a)], a)
            ]
            assert a_at
            if label == 0 and len(b):
                assert any(
                    np.array_equal(tokens[s + len(a) : s + len(a) + len(b)], b) for s in a_at
                )
            if label == 1:
                other = docs[needed[1]].tokens.astype(np.int64)
                assert any(
                    np.array_equal(other[s : s + len(b)], b)
                    for s in range(other.shape[0] - len(b) + 1)
                )
    assert abs(np.mean(labels) - 0.5) < 0.02  # 1 = random next, like transformers


def test_nsp_short_sequences_appear_with_their_probability():
    cfg = ObjectiveSection(kind="mlm+nsp", nsp={"short_seq_probability": 0.5})
    obj = build_objective(cfg, ROLES, VOCAB, 64)
    rng = np.random.default_rng(2)
    doc = make_doc(rng, 2000, "long", sentence_len=4)
    lengths = []
    for i in range(2000):
        ex_rng = np.random.default_rng([3, i])
        unit = window_unit(0, 61 * (i % 30), 61 * (i % 30 + 1))
        ex = obj.make_example(unit, [doc for _ in obj.needs(unit, ex_rng, np.arange(1))], ex_rng)
        lengths.append(int(ex["attention_mask"].sum()) - 3)
    full = np.mean(np.asarray(lengths) >= 58)  # sentence ends make "full" a little short
    assert 0.4 < full < 0.65


def test_truncate_pair_trims_the_longer_side_from_both_ends():
    rng = np.random.default_rng(0)
    fronts = 0
    for _ in range(2000):
        a, b = truncate_pair(rng, (0, 100), (1000, 1010), 60)
        assert (a[1] - a[0]) + (b[1] - b[0]) == 60
        assert b == (1000, 1010)  # only the longer one shrinks (to 50 >= 10)
        fronts += a[0]
    assert abs(fronts / 2000 - 25) < 1.5  # each token from the front with probability 1/2
    a, b = truncate_pair(rng, (0, 40), (0, 40), 61)  # equal: B first, then alternately
    assert a[1] - a[0] == 31 and b[1] - b[0] == 30  # B lost 10, A 9
    assert truncate_pair(rng, (0, 10), (0, 10), 61) == ((0, 10), (0, 10))


def clm_docs(rng, lengths):
    return [make_doc(rng, n, f"c{i}") for i, n in enumerate(lengths)]


@pytest.mark.parametrize("reset,block_docs", [(False, False), (True, True)])
def test_clm_blocks_pack_documents_with_eod(reset, block_docs):
    cfg = ObjectiveSection(
        kind="clm", clm={"reset_position_ids": reset, "block_cross_document_attention": block_docs}
    )
    L = 32
    obj = build_objective(cfg, ROLES, VOCAB, L)
    rng = np.random.default_rng(4)
    lengths = np.array([10, 50, 3, 70, 25, 9])
    docs = clm_docs(rng, lengths)
    order = np.array([3, 0, 5, 1, 4, 2])
    layout = obj.layout(order, lengths[order])
    stream = np.concatenate(
        [np.append(docs[d].tokens.astype(np.int64), ROLES["eod"]) for d in order]
    )
    assert layout.n_units == (len(stream) - 1) // L
    targets = []
    for u in range(layout.n_units):
        unit = layout.unit(u)
        ex = obj.make_example(unit, [docs[d] for d in obj.needs(unit, None, None)], None)
        ids, labels = ex["input_ids"], ex["labels"]
        assert np.array_equal(ids, stream[u * L : u * L + L])
        assert np.array_equal(labels, stream[u * L + 1 : u * L + L + 1])  # already shifted
        targets.append(labels)
        eods = np.flatnonzero(ids == ROLES["eod"])
        if reset:  # positions restart right after every end-of-document token
            assert ex["position_ids"][0] == 0
            assert all(ex["position_ids"][e + 1] == 0 for e in eods if e + 1 < L)
            assert ex["position_ids"].max() < L
        else:
            assert np.array_equal(ex["position_ids"], np.arange(L))
        if block_docs:  # a new document number right after each eod, eod in its own doc
            doc_ids = ex["document_ids"]
            assert np.array_equal(np.flatnonzero(np.diff(doc_ids)), eods[eods < L - 1])
        else:
            assert "document_ids" not in ex
    covered = np.concatenate(targets)  # every stream token is a target exactly once
    assert np.array_equal(covered, stream[1 : 1 + len(covered)])


def test_block_layout_boundaries_and_reset_positions():
    layout = BlockLayout(np.arange(4), np.array([5, 5, 5, 5]), 4)  # stream of 24
    assert layout.n_units == 5
    assert list(layout.boundary(np.array([0, 1, 2, 3]))) == [0, 1, 3, 4]
    pieces = layout.unit(1).pieces  # stream [4, 9): last token + eod of doc 0, 3 of doc 1
    assert pieces == (Piece(0, 4, 5, eod=True), Piece(1, 0, 3, eod=False))
    assert list(reset_positions(np.array([0, 0, 1, 1, 1, 2]))) == [0, 1, 0, 1, 2, 0]


def test_losses_match_plain_cross_entropy():
    torch.manual_seed(0)
    B, T, V = 3, 16, 1024  # the model pads the vocabulary to a multiple of 64
    logits = torch.randn(B, T, V, requires_grad=True)
    labels = torch.full((B, T), IGNORE_INDEX)
    labels[0, 3], labels[1, 5], labels[2, 0] = 7, 999, int(logits[2, 0].argmax())
    nsp_logits = torch.randn(B, 2)
    batch = {"mlm_labels": labels, "nsp_labels": torch.tensor([0, 1, 1])}
    obj = build_objective(ObjectiveSection(kind="mlm+nsp"), ROLES, VOCAB, T)
    total, m = obj.loss({"mlm_logits": logits, "nsp_logits": nsp_logits}, batch)
    sel = labels != IGNORE_INDEX
    want_mlm = F.cross_entropy(logits[sel], labels[sel])
    want_nsp = F.cross_entropy(nsp_logits, batch["nsp_labels"])
    assert torch.allclose(m["mlm_loss"], want_mlm) and torch.allclose(m["nsp_loss"], want_nsp)
    assert torch.allclose(total, want_mlm + want_nsp)
    assert abs(float(m["mlm_acc"]) - 1 / 3) < 1e-6
    want_acc = (nsp_logits.argmax(-1) == batch["nsp_labels"]).float().mean()
    assert torch.allclose(m["nsp_acc"], want_acc)
    total.backward()
    assert logits.grad is not None
    # a batch without any masked position: zero loss, still differentiable
    mlm = build_objective(ObjectiveSection(kind="mlm"), ROLES, VOCAB, T)
    loss, m = mlm.loss({"mlm_logits": logits}, {"mlm_labels": torch.full((B, T), IGNORE_INDEX)})
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    clm = build_objective(ObjectiveSection(kind="clm"), ROLES, VOCAB, T)
    targets = torch.randint(0, VOCAB, (B, T))
    loss, m = clm.loss({"logits": logits}, {"labels": targets})
    assert torch.allclose(m["lm_loss"], F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)))


def test_build_objective_errors_name_the_key():
    with pytest.raises(
        ConfigError,
        match=r"objective\.kind: unknown objective .*; valid kinds: .*\bclm\b.*\bmlm\+nsp\b",
    ):
        build_objective(ObjectiveSection(kind="sopp"), ROLES, VOCAB, 64)
    bad = ObjectiveSection(kind="mlm", mlm={"mask_fraction": 0.8, "random_fraction": 0.3})
    with pytest.raises(ConfigError, match="objective.mlm.mask_fraction"):
        build_objective(bad, ROLES, VOCAB, 64)
    with pytest.raises(ConfigError, match="mask"):
        build_objective(ObjectiveSection(kind="mlm"), {"pad": 0, "cls": 2, "sep": 3}, VOCAB, 64)
    with pytest.raises(ConfigError, match="eod"):
        build_objective(ObjectiveSection(kind="clm"), {"pad": 0}, VOCAB, 64)


@pytest.mark.parametrize("kind", ["mlm+nsp", "mlm+sop", "ernie"])
def test_pairs_for_a_model_with_one_segment_type_give_segment_b_type_0(kind):
    """A model with type_vocab_size 1 (RoBERTa's way) has no segment-B embedding: the pair
    objectives give B token type 0 for it (type 1 was an IndexError in its embedding),
    and 1 for a model with two types; the model takes the batch."""
    from conftest import tiny_model

    for types, want in ((1, 0), (2, 1)):
        model = tiny_model("bert", vocab_size=VOCAB, type_vocab_size=types)
        obj = build_objective(ObjectiveSection(kind=kind), ROLES, VOCAB, 64)
        obj.total_batches = 10
        obj.attach(model)
        rng = np.random.default_rng(5)
        docs = [make_doc(rng, 200, f"d{i}") for i in range(4)]
        unit = window_unit(0, 0, 61)
        needed = obj.needs(unit, np.random.default_rng(1), np.arange(4))
        ex = obj.make_example(unit, [docs[k] for k in needed], np.random.default_rng(1))
        seps = np.flatnonzero(original_ids(ex) == ROLES["sep"])
        types_b = ex["token_type_ids"][seps[0] + 1 : seps[1] + 1]
        assert (types_b == want).all() and (ex["token_type_ids"][: seps[0] + 1] == 0).all()
        model(torch.as_tensor(ex["input_ids"])[None],
              token_type_ids=torch.as_tensor(ex["token_type_ids"])[None])  # fmt: skip
