"""ALBERT: factorized embedding, cross-layer sharing, the SOP objective (swaps ~50%,
one document only), and the transformers export (fp32, 1e-4)."""

import json

import numpy as np
import pytest
import torch

from pipeline.config import ObjectiveSection
from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.models import build_model, resolve_model_config
from pipeline.objectives import IGNORE_INDEX, build_objective
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

ROLES = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "bos": 2, "eos": 3, "eod": 5}


def tiny(vocab=300, **overrides):
    cfg = resolve_model_config({"arch": "albert", "preset": "albert-tiny", **overrides}, vocab)
    torch.manual_seed(0)
    return build_model("albert", cfg)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_factorized_embedding_and_outputs():
    model = tiny().eval()
    cfg = model.config
    assert model.embeddings.word.weight.shape == (cfg.padded_vocab_size, cfg.embedding_size)
    assert model.project.weight.shape == (cfg.hidden_size, cfg.embedding_size)
    out = model(torch.randint(5, 300, (2, 10)))
    assert out["mlm_logits"].shape == (2, 10, cfg.padded_vocab_size)
    assert out["sop_logits"].shape == (2, 2) and out["hidden_states"].shape == (2, 10, 64)


def test_sharing_modes_store_each_shared_sublayer_once():
    counts = {}
    for share in ("all", "attention", "ffn", "none"):
        model = tiny(share=share, num_layers=4)
        counts[share] = n_params(model)
        names = [n for n, _ in model.named_parameters()]
        assert len(names) == len(set(names)) == len(model.state_dict())  # no aliases
        attn, ffn = len(model.attention), len(model.ffn)
        assert (attn, ffn) == {"all": (1, 1), "attention": (1, 4), "ffn": (4, 1), "none": (4, 4)}[
            share
        ]
    assert counts["all"] < min(counts["attention"], counts["ffn"])
    assert max(counts["attention"], counts["ffn"]) < counts["none"]
    # all-shared: the parameter count does not grow with depth, the compute does
    deep = tiny(num_layers=12)
    assert n_params(deep) == n_params(tiny(num_layers=2))
    assert deep.flops_per_token(64) > 5 * tiny(num_layers=2).flops_per_token(64) / 2


def test_albert_base_is_about_12m_parameters():
    cfg = resolve_model_config({"arch": "albert", "preset": "albert-base"}, 30000)
    with torch.device("meta"):
        model = build_model("albert", cfg)
    assert 11.5e6 < n_params(model) < 12.5e6  # BERT-base: 110M


def test_activation_checkpointing_same_loss_and_grads():
    x = torch.randint(5, 300, (2, 16))
    grads = []
    for ckpt in (False, True):
        model = tiny(share="ffn")
        model.set_activation_checkpointing(ckpt)
        out = model(x)
        (out["mlm_logits"].float().pow(2).mean() + out["sop_logits"].sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- SOP


def make_docs(rng, n_docs):
    """Token ids say which document and position they are (id = base + t)."""
    docs, base = [], 10
    for d in range(n_docs):
        n = int(rng.integers(3, 140))
        ends = np.unique(np.append(rng.integers(1, n, max(1, n // 10)), n)).astype(np.int32)
        docs.append(
            Document(f"d{d}", np.arange(base, base + n).astype(np.uint16), ends,
                     np.arange(n, dtype=np.int32))
        )  # fmt: skip
        base += n
    return docs


def test_sop_swaps_half_the_time_and_never_mixes_documents():
    rng = np.random.default_rng(0)
    docs = make_docs(rng, 80)
    where = {int(t): (d, i) for d, doc in enumerate(docs) for i, t in enumerate(doc.tokens)}
    obj = build_objective(ObjectiveSection(kind="mlm+sop"), ROLES, 9000, 64)
    layout = obj.layout(np.arange(80), np.array([d.n_tokens for d in docs]))
    labels, n = [], 0
    for epoch in range(12):
        for u in range(layout.n_units):
            unit = layout.unit(u)
            ex_rng = np.random.default_rng([epoch, u])
            needed = obj.needs(unit, ex_rng, np.arange(80))
            assert needed == [unit.pieces[0].doc]  # never a second document
            ex = obj.make_example(unit, [docs[i] for i in needed], ex_rng)
            ids = np.where(ex["mlm_labels"] != IGNORE_INDEX, ex["mlm_labels"], ex["input_ids"])
            ids = ids[ex["attention_mask"] == 1]
            seps = np.flatnonzero(ids == ROLES["sep"])
            assert ids[0] == ROLES["cls"] and len(seps) == 2 and seps[1] == len(ids) - 1
            first, second = ids[1 : seps[0]], ids[seps[0] + 1 : seps[1]]
            tt = ex["token_type_ids"][ex["attention_mask"] == 1]
            assert (tt[: seps[0] + 1] == 0).all() and (tt[seps[0] + 1 :] == 1).all()
            if len(first) == 0 or len(second) == 0:
                continue  # a one-token window has nothing to order
            pos1 = [where[int(t)] for t in first]
            pos2 = [where[int(t)] for t in second]
            doc = {d for d, _ in pos1 + pos2}
            assert doc == {unit.pieces[0].doc}  # both segments: the unit's own document
            # each segment is contiguous; label 0: first comes before second, 1: after
            for seg in (pos1, pos2):
                assert [i for _, i in seg] == list(range(seg[0][1], seg[0][1] + len(seg)))
            label = int(ex["sop_labels"])
            assert (pos1[-1][1] < pos2[0][1]) == (label == 0)
            assert (pos2[-1][1] < pos1[0][1]) == (label == 1)
            labels.append(label)
            n += 1
    assert n > 1500
    assert abs(np.mean(labels) - 0.5) < 0.04, np.mean(labels)


def test_sop_loss_uses_the_sop_head_or_names_what_is_missing():
    obj = build_objective(ObjectiveSection(kind="mlm+sop"), ROLES, 300, 32)
    batch = {"mlm_labels": torch.full((2, 8), IGNORE_INDEX), "sop_labels": torch.tensor([0, 1])}
    batch["mlm_labels"][0, 1] = 7
    out = {"mlm_logits": torch.zeros(2, 8, 320), "sop_logits": torch.tensor([[4.0, 0], [0, 4.0]])}
    loss, metrics = obj.loss(out, batch)
    assert float(metrics["sop_acc"]) == 1.0 and float(metrics["sop_loss"]) < 0.02
    with pytest.raises(ConfigError, match="sentence-order head"):
        obj.loss({"mlm_logits": out["mlm_logits"]}, batch)


# ----------------------------------------------------------------------------- export


@pytest.mark.slow  # importing transformers' model code takes ~6 s of CPU
@pytest.mark.parametrize("share", ["all", "none"])
def test_export_to_transformers_matches_logits(tmp_path, share):
    transformers = pytest.importorskip("transformers")
    from pipeline.export.hf import export_to_hf
    from pipeline.models.bundle import save_bundle

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Albert {i} shares its layers and orders sentences." for i in range(40))
    )
    spec = TokenizerSpec(kind="wordpiece", vocab_size=200)
    tok_dir = train_tokenizer([str(corpus)], spec, tmp_path / "tok")
    V = json.loads((tok_dir / "tokenizer_meta.json").read_text())["vocab_size"]
    model = tiny(V, share=share, num_layers=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    bundle = save_bundle(tmp_path / "bundle", "albert", model.config, model.state_dict(), tok_dir)
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.AlbertForPreTraining.from_pretrained(out).eval()
    assert hf.config.num_hidden_groups == (1 if share == "all" else 3)
    assert (
        hf.predictions.decoder.weight.data_ptr()
        == hf.albert.embeddings.word_embeddings.weight.data_ptr()
    )

    x = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(5))
    tt = torch.zeros_like(x)
    tt[:, 9:] = 1
    mask = torch.ones_like(x)
    mask[1, 14:] = 0
    mask[2, 5:] = 0
    ours = model(x, token_type_ids=tt, attention_mask=mask)
    with torch.no_grad():
        theirs = hf(input_ids=x, token_type_ids=tt, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(
        theirs.prediction_logits[real], ours["mlm_logits"][..., :V][real], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(theirs.sop_logits, ours["sop_logits"], atol=1e-4, rtol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert "token_type_ids" in tok("a b", "c")  # [CLS] A [SEP] B [SEP] with segment ids


def test_partial_sharing_cannot_be_exported_and_says_why(tmp_path):
    from pipeline.export.hf_albert import albert_to_hf_state

    model = tiny(share="attention")
    with pytest.raises(ValueError, match="model.share='attention'.*whole layers"):
        albert_to_hf_state(model.state_dict(), model.config)
