"""XLNet: two-stream attention, partial prediction over span-permuted factorization orders,
Transformer-XL memory, and the transformers export (same logits, fp32, 1e-4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.config import ObjectiveSection
from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.models import build_model, resolve_model_config
from pipeline.objectives import build_objective
from pipeline.objectives.plm import factorization_targets, permutation_mask, sample_spans

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "eod": 5}
VOCAB = 300
T = 64


def tiny_model(**overrides):
    cfg = resolve_model_config({"arch": "xlnet", "preset": "xlnet-tiny", **overrides}, VOCAB)
    torch.manual_seed(0)
    model = build_model("xlnet", cfg).eval()
    with torch.no_grad():  # random biases / LayerNorms too, so nothing cancels by accident
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if "bias" in name else 1.0, 0.1)
    return model


def objective(seq_len: int = T, **plm):
    cfg = ObjectiveSection(kind="plm", plm=plm)
    return build_objective(cfg, ROLES, VOCAB, seq_len)


def documents(lengths=(50, 70, 30, 90, 120)) -> list[Document]:
    rng = np.random.default_rng(1)
    return [
        Document(
            key=f"d{i}",
            tokens=rng.integers(6, VOCAB, n).astype(np.uint16),
            sents=np.array([n], dtype=np.int32),
            words=np.arange(n, dtype=np.int32),
        )
        for i, n in enumerate(lengths)
    ]


def examples(obj, n: int = 4, seed: int = 0):
    docs = documents()
    lay = obj.layout(np.arange(len(docs)), np.array([d.n_tokens for d in docs]))
    out = []
    for u in range(n):
        unit = lay.unit(u)
        rng = np.random.default_rng([seed, u])
        out.append(obj.make_example(unit, [docs[p.doc] for p in unit.pieces], rng))
    return out


def model_inputs(batch):
    return {k: v for k, v in batch.items() if k != "target_labels"}


def ranks(example) -> np.ndarray:
    """Factorization rank of every position: -1 for context, k for the k-th target."""
    rank = np.full(example["input_ids"].shape[0], -1)
    rank[example["target_mapping"].argmax(1)] = np.arange(example["target_mapping"].shape[0])
    return rank


# ----------------------------------------------------------------------------- objective


@pytest.mark.parametrize("k", [6.0, 7.0])
def test_only_the_last_1_over_k_is_predicted(k):
    obj = objective(k=k)
    for ex in examples(obj, 6):
        P = ex["target_mapping"].shape[0]
        assert P == round((T - 3) / k)  # ~T/K labels, the same in every example
        pos = ex["target_mapping"].argmax(1)
        assert (ex["target_mapping"].sum(1) == 1).all() and len(set(pos.tolist())) == P
        assert (ex["target_labels"] == ex["input_ids"][pos]).all()
        # [SEP] A|B, [SEP], [CLS] are never targets; the last three positions are specials
        assert ex["input_ids"][-1] == ROLES["cls"] and ex["input_ids"][-2] == ROLES["sep"]
        assert not np.isin(pos, np.flatnonzero(np.isin(ex["input_ids"], [2, 3]))).any()
        rank = ranks(ex)
        # the targets are exactly the last P steps of the order (context first)
        assert sorted(rank[rank >= 0].tolist()) == list(range(P))


def test_perm_mask_is_the_factorization_order():
    for ex in examples(objective(), 6):
        rank, mask = ranks(ex), ex["perm_mask"]
        target = rank >= 0
        for i in range(T):
            for j in range(T):
                # i may see j iff j is context or j is a target strictly earlier than i
                visible = (not target[j]) or (target[i] and rank[j] < rank[i])
                assert mask[i, j] == (not visible), (i, j)
        np.testing.assert_array_equal(mask, permutation_mask(rank))


def test_spans_are_predicted_together():
    """Each span's tokens are consecutive steps of the factorization order."""
    rng = np.random.default_rng(0)
    spans = [(0, 3), (7, 8), (10, 15), (20, 22)]
    for _ in range(20):
        order = factorization_targets(rng, spans).tolist()
        for a, b in spans:
            steps = sorted(order.index(i) for i in range(a, b))
            assert steps == list(range(steps[0], steps[0] + b - a))
    # in real examples, multi-token spans occur: neighbouring steps are text neighbours
    neighbours = 0
    for ex in examples(objective(max_span=5), 8):
        pos = ex["target_mapping"].argmax(1)
        neighbours += int((np.abs(np.diff(pos)) == 1).sum())
    assert neighbours >= 8


def test_span_sampler_hits_the_goal_without_overlap():
    rng = np.random.default_rng(3)
    for goal in (1, 10, 85):
        spans = sample_spans(rng, 512, goal, 6.0, 5)
        covered = [i for a, b in spans for i in range(a, b)]
        assert len(covered) == len(set(covered)) == goal
        assert all(0 <= a < b <= 512 and b - a <= 5 for a, b in spans)


def test_examples_are_seeded_and_units_continue_each_other():
    obj = objective()
    a, b, c = examples(obj, 3, seed=0), examples(obj, 3, seed=0), examples(obj, 3, seed=1)
    for x, y in zip(a, b, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    assert any((x["perm_mask"] != z["perm_mask"]).any() for x, z in zip(a, c, strict=True))
    # unit u+1 starts reuse_len tokens after unit u (so its reuse part is u's next text)
    R = obj.reuse_len
    docs = documents()
    lay = obj.layout(np.arange(len(docs)), np.array([d.n_tokens for d in docs]))
    from pipeline.objectives.clm import pack_block

    texts = [
        pack_block(lay.unit(u).pieces, [docs[p.doc] for p in lay.unit(u).pieces], 5, T - 3)[0]
        for u in range(3)
    ]
    for u in range(2):
        np.testing.assert_array_equal(texts[u + 1][: T - 3 - R], texts[u][R:])


def test_bad_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="reuse_len=60"):
        objective(reuse_len=60)
    obj = objective(reuse_len=16)
    with pytest.raises(ConfigError, match="differs from model.reuse_len=32"):
        obj.attach(tiny_model())
    bert = build_model("bert", resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, 300))
    with pytest.raises(ConfigError, match="model.arch: xlnet"):
        objective().attach(bert)
    with pytest.raises(ConfigError, match="model.reuse_len: must be set"):
        objective().attach(tiny_model(reuse_len=None))
    obj = objective()
    obj.attach(tiny_model(reuse_len=20))
    assert obj.reuse_len == 20


@pytest.mark.parametrize("hidden,heads", [(9, 3), (66, 4), (63, 7), (66, 6), (60, 4)])
def test_hidden_size_heads_refused_in_config_or_forward_works(hidden, heads):
    """A shape the model cannot run is a ConfigError naming the key, never a crash in
    the forward pass: hidden_size must be a multiple of num_heads and even (sin/cos)."""
    over = {"hidden_size": hidden, "num_heads": heads}
    if hidden % heads or hidden % 2:
        with pytest.raises(ConfigError, match="key .model.: .*hidden_size"):
            resolve_model_config({"arch": "xlnet", "preset": "xlnet-tiny", **over}, VOCAB)
        return
    out = tiny_model(**over)(input_ids=torch.randint(6, VOCAB, (2, 8)))
    assert out["hidden_states"].shape == (2, 8, hidden)


# ----------------------------------------------------------------------------- model


def perturbed(batch, row: int, pos: int):
    x = {k: v.clone() for k, v in batch.items()}
    x["input_ids"][row, pos] = (x["input_ids"][row, pos] + 17) % VOCAB
    return x


@pytest.mark.parametrize("with_memory", [False, True])
@torch.no_grad()
def test_query_stream_sees_only_earlier_steps_never_itself(with_memory):
    """Changing the token at a target position changes no prediction up to and including
    its own (so the query stream never read its content), and every later one."""
    obj = objective()
    model = tiny_model()
    batch = obj.collate(examples(obj, 2))
    mems = model(**model_inputs(batch))["mems"] if with_memory else None
    base = model(**model_inputs(batch), mems=mems)["logits"]
    rank = ranks({k: v[0].numpy() for k, v in batch.items()})
    for pos in np.flatnonzero(rank >= 0):
        out = model(**model_inputs(perturbed(batch, 0, int(pos))), mems=mems)["logits"]
        changed = (out[0] - base[0]).abs().amax(-1) > 1e-5  # per prediction (= rank)
        assert not changed[: rank[pos] + 1].any(), (pos, changed)  # itself and earlier
        assert changed[rank[pos] + 1 :].all(), (pos, changed)  # later steps see it
        assert torch.equal(out[1], base[1])  # rows are independent
    # a context token is visible to every prediction
    ctx = int(np.flatnonzero(rank < 0)[0])
    out = model(**model_inputs(perturbed(batch, 0, ctx)), mems=mems)["logits"]
    assert ((out[0] - base[0]).abs().amax(-1) > 1e-5).all()


@torch.no_grad()
def test_query_stream_is_blind_to_itself_even_if_perm_mask_allows_it():
    """One layer: with a mask that lets everyone see everyone, deeper layers would read the
    target through other positions' content streams, which is legal; the direct read is not."""
    obj = objective()
    model = tiny_model(num_layers=1)
    batch = obj.collate(examples(obj, 1))
    batch["perm_mask"][:] = False  # a careless mask: everyone may see everyone
    pos = int(batch["target_mapping"][0, 0].float().argmax())
    a = model(**model_inputs(batch))["logits"][0, 0]
    b = model(**model_inputs(perturbed(batch, 0, pos)))["logits"][0, 0]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@torch.no_grad()
def test_memory_is_the_reused_part_detached_and_checked():
    obj = objective()
    model = tiny_model()
    cfg = model.config
    batch = obj.collate(examples(obj, 2))
    out = model(**model_inputs(batch))
    assert out["mems"].shape == (cfg.num_layers, 2, cfg.reuse_len, cfg.hidden_size)
    out2 = model(**model_inputs(batch), mems=out["mems"])
    assert out2["mems"].shape[2] == cfg.mem_len  # cat(old 32, new 32)[-48:]
    torch.testing.assert_close(out2["mems"][:, :, :16], out["mems"][:, :, 16:])
    assert not torch.allclose(out2["logits"], out["logits"])  # the memory is read
    with pytest.raises(ValueError, match="do not fit"):
        model(**model_inputs(batch), mems=out["mems"][:, :1])


def test_memory_has_no_gradient_and_checkpointing_gives_the_same_grads():
    obj = objective()
    batch = obj.collate(examples(obj, 2))
    grads = []
    for ckpt in (False, True):
        model = tiny_model()
        model.set_activation_checkpointing(ckpt)
        out = model(**model_inputs(batch))
        assert not out["mems"].requires_grad
        obj.loss(out, batch)[0].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


def test_loss_falls_when_fitting_one_batch():
    obj = objective(seq_len=32)
    model = tiny_model(dropout=0.0, attention_dropout=0.0).train()
    batch = obj.collate(examples(obj, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss, metrics = obj.loss(model(**model_inputs(batch)), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert set(metrics) == {"plm_loss", "plm_acc"}
    assert losses[-1] < losses[0] - 1.0, losses
    assert model.flops_per_token(T) > 0


# ----------------------------------------------------------------------------- export


def unigram_tokenizer(out):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]", "<eod>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    text = ["permutation language models predict tokens in a random order"] * 20
    tok.train_from_iterator(
        text, trainers.UnigramTrainer(vocab_size=120, special_tokens=specials, unk_token="<unk>")
    )
    tok.save(str(out / "tokenizer.json"))
    names = {"pad": "<pad>", "unk": "<unk>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]",
             "bos": "[CLS]", "eos": "[SEP]", "eod": "<eod>"}  # fmt: skip
    meta = {
        "kind": "unigram",
        "vocab_size": tok.get_vocab_size(),
        "lowercase": False,
        "special_tokens": {s: tok.token_to_id(s) for s in specials},
        "roles": {r: tok.token_to_id(s) for r, s in names.items()},
        "sha256": "0",
        "spec": {},
    }
    (out / "tokenizer_meta.json").write_text(json.dumps(meta, sort_keys=True))
    return meta


@pytest.mark.slow  # importing transformers' model code takes seconds of CPU
def test_hf_export_gives_our_logits_with_and_without_memory(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, hf, V = exported(tmp_path)
    meta = json.loads((tmp_path / "tok" / "tokenizer_meta.json").read_text())
    out = tmp_path / "hf"
    assert hf.config.vocab_size == V
    assert hf.lm_loss.weight.data_ptr() == hf.transformer.word_embedding.weight.data_ptr()

    roles = {**ROLES, **meta["roles"]}
    obj = build_objective(ObjectiveSection(kind="plm"), roles, V, T)
    exs = examples(obj, 2)
    for ex in exs:
        ex["input_ids"] = ex["input_ids"] % V
    batch = obj.collate(exs)
    hf_inputs = {
        "input_ids": batch["input_ids"],
        "token_type_ids": batch["token_type_ids"],
        "perm_mask": batch["perm_mask"].float(),
        "target_mapping": batch["target_mapping"].float(),
    }
    with torch.no_grad():
        ours = model(**model_inputs(batch))
        theirs = hf(**hf_inputs)
        torch.testing.assert_close(theirs.logits, ours["logits"][..., :V], atol=1e-4, rtol=1e-4)
        # again with the memory of that segment, and the memory both return next
        ours2 = model(**model_inputs(batch), mems=ours["mems"])
        theirs2 = hf(**hf_inputs, mems=list(ours["mems"].transpose(1, 2)), use_mems=True)
        torch.testing.assert_close(theirs2.logits, ours2["logits"][..., :V], atol=1e-4, rtol=1e-4)
        for hf_mem, our_mem in zip(theirs2.mems, ours2["mems"], strict=True):
            torch.testing.assert_close(hf_mem.transpose(0, 1), our_mem, atol=1e-4, rtol=1e-4)
        # plain encoder use (fine-tuning): content stream logits at every position
        plain = model(batch["input_ids"], token_type_ids=batch["token_type_ids"])["logits"]
        hf_plain = hf(batch["input_ids"], token_type_ids=batch["token_type_ids"]).logits
        torch.testing.assert_close(hf_plain, plain[..., :V], atol=1e-4, rtol=1e-4)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok("random order", "language models")
    cls, sep = meta["roles"]["cls"], meta["roles"]["sep"]
    assert enc["input_ids"][-1] == cls and enc["input_ids"].count(sep) == 2
    assert enc["token_type_ids"][-1] == 2 and set(enc["token_type_ids"][:-1]) == {0, 1}


def exported(tmp_path, **overrides):
    """(our model with random 1-D params, its transformers export, vocab size)."""
    transformers = pytest.importorskip("transformers")
    from pipeline.export.hf import export_to_hf
    from pipeline.models.bundle import save_bundle

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    V = unigram_tokenizer(tok_dir)["vocab_size"]
    cfg = resolve_model_config({"arch": "xlnet", "preset": "xlnet-tiny", **overrides}, V)
    torch.manual_seed(0)
    model = build_model("xlnet", cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if "bias" in name else 1.0, 0.1)
    bundle = save_bundle(tmp_path / "bundle", "xlnet", cfg, model.state_dict(), tok_dir)
    hf = transformers.XLNetLMHeadModel.from_pretrained(export_to_hf(bundle, tmp_path / "hf"))
    return model, hf.eval(), V


@pytest.mark.slow
def test_hf_export_memory_of_padded_rows_matches(tmp_path):
    """A padded position attends to itself, as in transformers (its mask's diagonal is
    always open), so the memory cached from padded rows - and the next segment that
    reads it - equal transformers'."""
    model, hf, V = exported(tmp_path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(6, V, (2, 40), generator=g)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 10:] = 0  # row 1 ends early: padding inside the reused (cached) positions
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        theirs = hf(ids, attention_mask=mask, use_mems=True)
        for hf_mem, our_mem in zip(theirs.mems, ours["mems"], strict=True):
            torch.testing.assert_close(hf_mem.transpose(0, 1), our_mem, atol=1e-4, rtol=1e-4)
        nxt = torch.randint(6, V, (2, 40), generator=g)
        ours2 = model(nxt, mems=ours["mems"])
        theirs2 = hf(nxt, mems=list(ours["mems"].transpose(1, 2)), use_mems=True)
        torch.testing.assert_close(theirs2.logits, ours2["logits"][..., :V], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_hf_export_without_memory_keeps_none(tmp_path):
    """model.mem_len: 0 means no memory: the export says so (use_mems_eval/train false),
    so transformers returns no mems either."""
    model, hf, V = exported(tmp_path, mem_len=0)
    assert hf.config.use_mems_eval is False and hf.config.use_mems_train is False
    ids = torch.randint(6, V, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids)
    assert ours["mems"] is None and theirs.mems is None
    torch.testing.assert_close(theirs.logits, ours["logits"][..., :V], atol=1e-4, rtol=1e-4)
    hf.train()
    assert hf(ids).mems is None
