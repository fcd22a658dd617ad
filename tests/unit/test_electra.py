"""ELECTRA: the discriminator's labels are exactly (corrupted != original), the generator
only fills masked positions, embeddings are shared, the RTD loss is L_mlm + lambda L_disc."""

import numpy as np
import pytest
import torch

from pipeline.config import ObjectiveSection
from pipeline.errors import ConfigError
from pipeline.models import build_model, resolve_model_config
from pipeline.models.electra import Electra, ElectraConfig
from pipeline.objectives import build_objective

V = 12  # a tiny vocabulary, so the generator often samples the original token back


def tiny(vocab=V, **kw) -> Electra:
    cfg = ElectraConfig(
        vocab_size=vocab, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
        embedding_size=16, max_positions=64, dropout=0.0, attention_dropout=0.0, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return Electra(cfg)


def masked_batch(rng: np.random.Generator, B=16, T=32, mask_id=4):
    original = torch.from_numpy(rng.integers(5, V, (B, T)))
    selected = torch.from_numpy(rng.random((B, T)) < 0.3)
    labels = torch.where(selected, original, torch.full_like(original, -100))
    # the objective's 80/10/10: [MASK], a random token or the original itself
    action = torch.from_numpy(rng.random((B, T)))
    inputs = torch.where(selected & (action < 0.8), mask_id, original)
    rand = torch.from_numpy(rng.integers(5, V, (B, T)))
    inputs = torch.where(selected & (action >= 0.8) & (action < 0.9), rand, inputs)
    return original, inputs, labels, selected


def test_rtd_labels_are_exactly_corrupted_differs_from_original():
    model = tiny().eval()
    rng = np.random.default_rng(0)
    counts = {"replaced": 0, "sampled_back": 0}
    for _ in range(20):
        original, inputs, labels, selected = masked_batch(rng)
        with torch.no_grad():
            out = model(inputs, mlm_labels=labels)
        corrupted = out["corrupted_ids"]
        assert torch.equal(out["rtd_labels"], (corrupted != original).long())
        # the generator only writes the masked positions, and only real vocabulary ids
        assert torch.equal(corrupted[~selected], inputs[~selected])
        assert int(corrupted.max()) < V
        assert out["mlm_logits"].shape == (int(selected.sum()), model.config.padded_vocab_size)
        counts["replaced"] += int(out["rtd_labels"][selected].sum())
        counts["sampled_back"] += int((out["rtd_labels"][selected] == 0).sum())
    # both cases really happen: a sample equal to the original is labelled "original"
    assert counts["replaced"] > 100 and counts["sampled_back"] > 20, counts


def test_sampling_uses_torch_rng():
    model = tiny().eval()
    original, inputs, labels, _ = masked_batch(np.random.default_rng(1))
    torch.manual_seed(7)
    a = model(inputs, mlm_labels=labels)["corrupted_ids"]
    torch.manual_seed(7)
    b = model(inputs, mlm_labels=labels)["corrupted_ids"]
    c = model(inputs, mlm_labels=labels)["corrupted_ids"]
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_shared_embeddings_and_no_gradient_through_samples():
    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    assert sum("word" in n for n in names) == 1  # one embedding table for both networks
    original, inputs, labels, _ = masked_batch(np.random.default_rng(2))
    out = model(inputs, mlm_labels=labels)
    disc_only = out["rtd_logits"].sum()
    disc_only.backward()
    # the discriminator's loss never reaches the generator (samples are discrete)
    assert all(p.grad is None for p in model.generator.parameters())
    assert model.embeddings.word.weight.grad is not None


def test_generator_is_a_fraction_of_the_discriminator():
    cfg = resolve_model_config({"arch": "electra", "preset": "electra-small"}, 1000)
    g = cfg.generator_config()
    assert (g.hidden_size, g.num_heads, g.intermediate_size) == (64, 1, 256)
    assert g.num_layers == cfg.num_layers
    with pytest.raises(ConfigError, match="generator"):
        resolve_model_config(
            {"arch": "electra", "preset": "electra-small", "generator_size": 0.7}, 1000
        )


def test_rtd_loss_weights_the_discriminator_by_lambda():
    roles = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    cfg = ObjectiveSection(kind="rtd", rtd={"disc_weight": 50.0})
    objective = build_objective(cfg, roles, V, 32)
    model = build_model("electra", tiny().config)
    original, inputs, labels, _ = masked_batch(np.random.default_rng(3))
    batch = {"input_ids": inputs, "mlm_labels": labels, "attention_mask": torch.ones_like(inputs)}
    out = model(inputs, attention_mask=batch["attention_mask"], mlm_labels=labels)
    loss, metrics = objective.loss(out, batch)
    expected = metrics["mlm_loss"] + 50.0 * metrics["rtd_loss"]
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert 0 < float(metrics["replaced"]) <= 1
