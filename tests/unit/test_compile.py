"""train.compile: torch.compile of each repeated layer (regional), applied from one place
(pipeline.train.parallelize), on the CPU: the same losses as eager within 1e-5."""

import pytest
import torch
from conftest import tiny_model

from pipeline.config import TrainSection
from pipeline.objectives.mlm import masked_lm_loss
from pipeline.train import parallelize

pytestmark = pytest.mark.slow  # inductor compiles C++ for the CPU: about a minute


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (4, 24), generator=g)
    lengths = torch.randint(3, 25, (4,), generator=g)
    mask = (torch.arange(24)[None] < lengths[:, None]).long()
    labels = torch.where((torch.rand(4, 24, generator=g) < 0.3) & mask.bool(), ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "mlm_labels": labels}


def train_losses(compile_: bool, steps: int = 3) -> tuple[list[float], torch.nn.Module]:
    model = tiny_model("bert", dropout=0.0, attention_dropout=0.0)
    parallelize.apply(model, TrainSection(compile=compile_, unpad=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):  # a different number of real tokens in every batch
        b = batch(step)
        loss, _ = masked_lm_loss(model(**b)["mlm_logits"], b["mlm_labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_compiled_layers_train_like_eager():
    eager, _ = train_losses(False)
    compiled, model = train_losses(True)
    assert all(layer._compiled_call_impl is not None for layer in model.repeated_layers())
    assert not any(
        m._compiled_call_impl is not None for m in (model.embeddings, model.mlm_head)
    )  # regional: only the repeated layers
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert len(set(eager)) == len(eager)  # the steps did train on different batches


def test_unpad_defaults_to_the_cpu_only(monkeypatch):
    """Unset, train.unpad packs encoders on the CPU and keeps them padded on a GPU (where
    the nested-jagged path was measured slower); set, it wins either way."""
    assert parallelize.unpad_wanted(TrainSection()) is True  # this machine: no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parallelize.unpad_wanted(TrainSection()) is False
    assert parallelize.unpad_wanted(TrainSection(unpad=True)) is True
    assert parallelize.unpad_wanted(TrainSection(unpad=False)) is False
