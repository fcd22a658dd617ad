"""The pooler and the sentence-pair head (BERT's NSP, ERNIE's, ALBERT's SOP) are built only
when the objective trains them: an MLM-only model has exactly transformers' *ForMaskedLM
parameters, and a bundle or state dict saved with the pair head still loads into it."""

import json

import pytest
import torch
from test_export_hf import wordpiece_dir

from pipeline.config import ExperimentConfig
from pipeline.models import build_model, resolve_model_config
from pipeline.models.bundle import load_bundle, save_bundle
from pipeline.train.plan import model_config_for

transformers = pytest.importorskip("transformers")

V = 512  # a multiple of 64: our padded vocabulary is transformers' own


def experiment(arch: str, kind: str, **objective) -> ExperimentConfig:
    return ExperimentConfig(
        name="x",
        model={"arch": arch, "preset": f"{arch}-tiny"},
        objective={"kind": kind, **objective},
        data={"path": "unused"},
    )


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def hf_config(cls, cfg, **extra):
    from pipeline.export.hf_common import encoder_config_fields

    return cls(**encoder_config_fields(cfg, {"pad": 0}), **extra)


@pytest.mark.parametrize(
    "arch,kind,objective,pair",
    [
        ("bert", "mlm", {}, False),
        ("bert", "mlm+nsp", {}, True),
        ("bert", "mlm+sop", {}, True),  # SOP trains BERT's pair head
        ("ernie", "ernie", {}, True),
        ("ernie", "ernie", {"ernie": {"nsp": False}}, False),
        ("albert", "mlm+sop", {}, True),
        ("albert", "mlm", {}, False),
    ],
)
def test_the_objective_decides_the_pair_head(arch, kind, objective, pair):
    cfg = model_config_for(experiment(arch, kind, **objective), V)
    assert cfg.pair_head is pair
    model = build_model(arch, cfg)
    assert hasattr(model, "pooler") is pair
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert ({"pooler", "nsp_head", "sop_head"} & names != set()) is pair


def test_an_explicit_model_pair_head_wins_over_the_objective():
    cfg = experiment("bert", "mlm")
    cfg.model.pair_head = True  # model.pair_head=true on the command line
    assert model_config_for(cfg, V).pair_head is True


def test_bert_mlm_only_has_the_parameters_of_hf_bert_for_masked_lm():
    cfg = model_config_for(experiment("bert", "mlm"), V)
    ours = build_model("bert", cfg)
    theirs = transformers.BertForMaskedLM(hf_config(transformers.BertConfig, cfg))
    assert n_params(ours) == n_params(theirs)
    with_pair = build_model("bert", model_config_for(experiment("bert", "mlm+nsp"), V))
    pretraining = transformers.BertForPreTraining(hf_config(transformers.BertConfig, cfg))
    assert n_params(with_pair) == n_params(pretraining) > n_params(ours)
    out = ours(torch.randint(5, V, (2, 12)))
    assert "nsp_logits" not in out and out["mlm_logits"].shape == (2, 12, V)


def test_albert_mlm_only_has_the_parameters_of_hf_albert_for_masked_lm():
    cfg = model_config_for(experiment("albert", "mlm"), V)
    theirs = transformers.AlbertForMaskedLM(
        hf_config(transformers.AlbertConfig, cfg, embedding_size=cfg.embedding_size)
    )
    assert n_params(build_model("albert", cfg)) == n_params(theirs)


def _randomised(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


@pytest.mark.parametrize("arch", ["bert", "ernie", "albert"])
def test_a_state_dict_with_the_pair_head_loads_into_an_mlm_only_model(arch):
    """Older bundles and checkpoints hold the pooler and pair head: an MLM-only model
    drops those tensors and keeps every other one (strict loading still holds)."""
    old_cfg = resolve_model_config({"arch": arch, "preset": f"{arch}-tiny"}, V)
    assert old_cfg.pair_head is True  # the default: what every older bundle had
    old = _randomised(build_model(arch, old_cfg))
    state = old.state_dict()
    assert any(k.startswith("pooler.") for k in state)
    new = build_model(arch, old_cfg.model_copy(update={"pair_head": False})).eval()
    new.load_state_dict(state, strict=True)
    ids = torch.randint(5, V, (2, 10))
    torch.testing.assert_close(new(ids)["mlm_logits"], old(ids)["mlm_logits"])
    # a tensor that is neither the model's nor the dropped head's is still an error
    with pytest.raises(RuntimeError, match="Unexpected key"):
        new.load_state_dict({**state, "stray.weight": torch.zeros(1)}, strict=True)


def test_an_old_bundle_loads_and_an_mlm_only_bundle_round_trips(tmp_path):
    """A bundle saved before the change (its config.yaml has no pair_head, its weights the
    pooler and NSP head) loads as it was; an MLM-only bundle saves and loads without them."""

    tok = tmp_path / "tok"
    tok.mkdir()
    wordpiece_dir(tok)
    vocab = json.loads((tok / "tokenizer_meta.json").read_text())["vocab_size"]
    old_cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, vocab)
    old = _randomised(build_model("bert", old_cfg))
    bundle = save_bundle(tmp_path / "old", "bert", old_cfg, old.state_dict(), tok)
    text = (bundle / "config.yaml").read_text()
    assert "  pair_head: true\n" in text
    (bundle / "config.yaml").write_text(text.replace("  pair_head: true\n", ""))
    loaded, _ = load_bundle(bundle)
    assert hasattr(loaded, "nsp_head")
    mlm_cfg = old_cfg.model_copy(update={"pair_head": False})
    mlm = build_model("bert", mlm_cfg)
    mlm.load_state_dict(old.state_dict())  # the old weights, without the pair head
    bundle2 = save_bundle(tmp_path / "mlm", "bert", mlm_cfg, mlm.state_dict(), tok)
    again, _ = load_bundle(bundle2)
    assert not hasattr(again, "pooler") and n_params(again) == n_params(mlm)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "ernie", "albert"])
def test_an_mlm_only_bundle_exports_as_for_masked_lm_with_our_logits(tmp_path, arch):
    from pipeline.export.hf import export_to_hf

    tok = tmp_path / "tok"
    tok.mkdir()
    wordpiece_dir(tok)
    vocab = json.loads((tok / "tokenizer_meta.json").read_text())["vocab_size"]
    cfg = resolve_model_config({"arch": arch, "preset": f"{arch}-tiny", "pair_head": False}, vocab)
    model = _randomised(build_model(arch, cfg))
    bundle = save_bundle(tmp_path / "b", arch, cfg, model.state_dict(), tok)
    out = export_to_hf(bundle, tmp_path / "hf")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__.endswith("ForMaskedLM")
    assert not any("pooler" in k or "seq_relationship" in k or "sop" in k for k in hf.state_dict())
    ids = torch.randint(5, vocab, (2, 9))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        ours = model(ids)["mlm_logits"][..., :vocab]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
