"""RoBERTa: fairseq positions (pad_token_id + 1), MLM-only outputs, the pad-id check,
FULL-SENTENCES / DOC-SENTENCES packing, and the transformers export (fp32, 1e-4)."""

import json

import numpy as np
import pytest
import torch

from pipeline.config import ObjectiveSection
from pipeline.data.shards import Document
from pipeline.errors import ConfigError
from pipeline.models import build_model, resolve_model_config
from pipeline.models.roberta import roberta_position_ids
from pipeline.objectives import IGNORE_INDEX, build_objective
from pipeline.objectives.packing import StreamLayout
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

ROLES = {"pad": 1, "unk": 3, "cls": 0, "sep": 2, "mask": 4, "bos": 0, "eos": 2, "eod": 5}
SPECIAL = set(ROLES.values())


def tiny(**overrides):
    cfg = resolve_model_config({"arch": "roberta", "preset": "roberta-tiny", **overrides}, 300)
    torch.manual_seed(0)
    return build_model("roberta", cfg).eval()


def test_positions_start_after_the_padding_id_and_skip_padding():
    ids = torch.tensor([[0, 9, 9, 2, 1, 1], [0, 9, 9, 9, 9, 2]])
    assert roberta_position_ids(ids, 1).tolist() == [[2, 3, 4, 5, 1, 1], [2, 3, 4, 5, 6, 7]]


def test_outputs_padding_invariance_and_position_limit():
    model = tiny(dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(ids)
    assert set(out) == {"mlm_logits", "hidden_states"}  # no NSP, no pooler
    assert out["mlm_logits"].shape == (2, 12, model.config.padded_vocab_size)
    # right padding changes nothing at the real positions (positions and attention both)
    padded = torch.cat([ids, torch.ones(2, 4, dtype=torch.long)], dim=1)
    mask = (padded != 1).long()
    again = model(padded, attention_mask=mask)["mlm_logits"][:, :12]
    torch.testing.assert_close(again, out["mlm_logits"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.full((1, 257), 7))  # 257 tokens need positions up to 258 (table: 258)
    model(torch.full((1, 256), 7))


def test_objective_refuses_a_tokenizer_that_pads_with_another_id():
    wordpiece_roles = {**ROLES, "pad": 0, "cls": 2, "sep": 3}
    obj = build_objective(ObjectiveSection(kind="mlm"), wordpiece_roles, 300, 64)
    with pytest.raises(ConfigError, match=r"model.pad_token_id=1.*pads with id 0"):
        obj.attach(tiny())
    obj.attach(tiny(pad_token_id=0))  # the fix the message names
    build_objective(ObjectiveSection(kind="mlm"), ROLES, 300, 64).attach(tiny())


# ----------------------------------------------------------------------------- packing


def make_docs(rng, n_docs, vocab=5000):
    """Documents whose token ids say which document and position they are (id = base + t)."""
    docs, base = [], 10
    for d in range(n_docs):
        n = int(rng.integers(5, 90))
        ends = np.unique(np.append(rng.integers(1, n, max(1, n // 9)), n)).astype(np.int32)
        tokens = np.arange(base, base + n) % vocab
        docs.append(Document(f"d{d}", tokens.astype(np.uint16), ends, np.arange(n, dtype=np.int32)))
        base += n
    return docs


def packed_examples(packing, docs, seq_len=48):
    cfg = ObjectiveSection(kind="mlm", mlm={"packing": packing, "probability": 0.01})
    obj = build_objective(cfg, ROLES, 6000, seq_len)
    order = np.arange(len(docs))
    layout = obj.layout(order, np.array([d.n_tokens for d in docs]))
    out = []
    for u in range(layout.n_units):
        unit = layout.unit(u)
        ex = obj.make_example(unit, [docs[i] for i in unit.docs], np.random.default_rng(u))
        labels = ex["mlm_labels"]
        out.append(
            np.where(labels != IGNORE_INDEX, labels, ex["input_ids"])[ex["attention_mask"] == 1]
        )
    return out


def split_on_sep(row):
    """The token runs between <s>/</s> of one example."""
    assert row[0] == ROLES["cls"] and row[-1] == ROLES["sep"]
    runs, cur = [], []
    for t in row[1:]:
        if t == ROLES["sep"]:
            runs.append(cur)
            cur = []
        else:
            cur.append(int(t))
    return runs


@pytest.mark.parametrize("packing", ["full_sentences", "doc_sentences"])
def test_packing_gives_whole_sentences_once_each(packing):
    rng = np.random.default_rng(0)
    docs = make_docs(rng, 60)
    where = {}  # token id -> (doc, position)
    for d, doc in enumerate(docs):
        for t, tok in enumerate(doc.tokens.tolist()):
            where[tok] = (d, t)
    seen, n_runs, crossing, cut = [], 0, 0, 0
    for row in packed_examples(packing, docs):
        assert len(row) <= 48
        runs = split_on_sep(row)
        crossing += len(runs) > 1
        for k, run in enumerate(runs):
            n_runs += 1
            (d, t0), (_, t1) = where[run[0]], where[run[-1]]
            doc = docs[d]
            # one run = contiguous tokens of ONE document ...
            assert [where[x] for x in run] == [(d, t) for t in range(t0, t0 + len(run))]
            # ... starting at a sentence start
            starts = np.concatenate([[0], doc.sents[:-1]])
            assert t0 in starts
            if (t1 + 1) not in doc.sents:  # a sentence is cut only where the example is full
                assert k == len(runs) - 1 and len(row) == 48
                cut += 1
            seen.extend(run)
    assert sorted(seen) == sorted(set(seen))  # no token twice
    total = sum(d.n_tokens for d in docs)
    assert len(seen) > 0.85 * total  # almost nothing is lost to cutting
    assert cut < 0.3 * n_runs
    if packing == "full_sentences":
        assert crossing > 0  # examples cross documents, with </s> between them
    else:
        assert crossing == 0


def test_packing_is_refused_for_pair_objectives():
    cfg = ObjectiveSection(kind="mlm+nsp", mlm={"packing": "full_sentences"})
    with pytest.raises(ConfigError, match=r"objective.mlm.packing=full_sentences.*kind=mlm only"):
        build_objective(cfg, ROLES, 300, 64)


def test_static_masking_means_the_same_examples_every_epoch():
    """Static masks are seeded on the unit key. FULL-SENTENCES re-packs the shuffled
    stream every epoch (its key is a stream position), so static masking cannot give the
    same masks: refused, naming both keys. Window / DOC-SENTENCES units are keyed on
    (document, window): the same key has the same content whatever the epoch's order."""
    cfg = ObjectiveSection(kind="mlm", mlm={"packing": "full_sentences", "static": True})
    with pytest.raises(ConfigError, match=r"objective.mlm.static=true.*packing=full_sentences"):
        build_objective(cfg, ROLES, 300, 64)
    lengths = np.array([50, 130, 7, 90, 64])
    for packing in ("window", "doc_sentences"):
        obj = build_objective(
            ObjectiveSection(kind="mlm", mlm={"packing": packing, "static": True}), ROLES, 300, 64
        )
        by_key = []
        for seed in (1, 2):  # two epochs: two shuffles of the same documents
            order = np.random.default_rng(seed).permutation(len(lengths))
            layout = obj.layout(order, lengths[order])
            by_key.append({u.key: u for u in layout.units(np.arange(layout.n_units))})
        assert by_key[0] == by_key[1]


def test_stream_layout_covers_the_stream_once():
    lengths = np.array([5, 0 + 1, 30, 7, 12])
    layout = StreamLayout(np.arange(5), lengths, 8)
    covered = []
    for u in range(layout.n_units):
        for p in layout.unit(u).pieces:
            covered.extend((p.doc, t) for t in range(p.start, p.stop))
    assert covered == [(d, t) for d in range(5) for t in range(lengths[d])]
    assert layout.n_units == -(-(lengths.sum() + 4) // 8)


# ----------------------------------------------------------------------------- export


@pytest.mark.slow  # importing transformers' model code takes ~6 s of CPU
def test_export_to_transformers_matches_logits_and_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from pipeline.export.hf import export_to_hf
    from pipeline.models.bundle import save_bundle

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"The model {i} reads byte level pairs and merges them." for i in range(50))
    )
    tok_dir = train_tokenizer(
        [str(corpus)], TokenizerSpec(kind="bpe", vocab_size=300), tmp_path / "tok"
    )
    meta = json.loads((tok_dir / "tokenizer_meta.json").read_text())
    assert meta["roles"]["pad"] == 1  # RoBERTa's convention, so the preset needs no override
    V = meta["vocab_size"]
    cfg = resolve_model_config({"arch": "roberta", "preset": "roberta-tiny"}, V)
    assert cfg.padded_vocab_size > V
    torch.manual_seed(0)
    model = build_model("roberta", cfg).eval()
    with torch.no_grad():  # random biases and LayerNorms, so a mixed-up mapping shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    bundle = save_bundle(tmp_path / "bundle", "roberta", cfg, model.state_dict(), tok_dir)
    out = export_to_hf(bundle, tmp_path / "hf")

    hf = transformers.RobertaForMaskedLM.from_pretrained(out).eval()
    assert hf.config.vocab_size == V and hf.config.pad_token_id == 1
    x = torch.randint(5, V, (3, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[1, 14:] = 0
    mask[2, 5:] = 0
    x[mask == 0] = 1  # padding is the pad id: both sides derive positions from it
    ours = model(x, attention_mask=mask)["mlm_logits"][..., :V]
    with torch.no_grad():
        theirs = hf(input_ids=x, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(theirs[real], ours[real], atol=1e-4, rtol=1e-4)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    a, b = tok("The model reads", add_special_tokens=False)["input_ids"], tok("pairs")["input_ids"]
    enc = tok("The model reads", "pairs")["input_ids"]
    bos, eos = meta["roles"]["cls"], meta["roles"]["sep"]
    assert b[0] == bos and b[-1] == eos
    assert enc == [bos, *a, eos, eos, *b[1:-1], eos]
    assert (tok.pad_token_id, tok.mask_token_id) == (1, meta["roles"]["mask"])
    # Truncation builds the longest input the model takes: positions run from pad + 1 to
    # max_positions - 1, so max_positions - pad - 1 tokens (514 -> 512 for roberta-base).
    assert tok.model_max_length == cfg.max_positions - cfg.pad_token_id - 1
    long = tok(" ".join(["The model reads byte level pairs."] * 300), truncation=True,
               return_tensors="pt")  # fmt: skip
    assert long["input_ids"].shape[1] == tok.model_max_length
    with torch.no_grad():
        hf(**long)  # every position of the longest input has a row in the position table
    assert model(long["input_ids"])["mlm_logits"].shape[1] == tok.model_max_length


def test_roberta_base_size_and_flops():
    cfg = resolve_model_config({"arch": "roberta", "preset": "roberta-base"}, 50265)
    with torch.device("meta"):
        model = build_model("roberta", cfg)
    n_params = sum(p.numel() for p in model.parameters())
    assert 124e6 < n_params < 126e6  # the paper's 125M
    n_pos = (cfg.max_positions + cfg.type_vocab_size) * cfg.hidden_size
    flops_t1 = model.flops_per_token(1) - 12 * cfg.num_layers * cfg.hidden_size
    assert flops_t1 == pytest.approx(6 * (n_params - n_pos))
