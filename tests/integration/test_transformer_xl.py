"""Transformer-XL training resumes exactly: the memory each rank carries from batch to
batch is checkpointed with the loader state, so 10 steps + resume + 10 steps give the
losses of 20 uninterrupted steps (which they would not if the memory restarted empty)."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from test_train import step_losses, train_in_process

pytestmark = pytest.mark.slow

TXL = str(REPO / "configs/test/transformer-xl-tiny.yaml")


def test_exact_resume_with_recurrent_memory(tiny_data, tmp_path):
    common = [f"data.path={tiny_data}", "train.max_steps=20", "train.save_every=10",
              "train.eval_every=10", "train.log_every=1", "mlflow.register=false",
              "data.workers=0"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    train_in_process(tmp_path, TXL, None, *common, f"train.out_dir={a}")
    train_in_process(tmp_path, TXL, 10, *common, f"train.out_dir={b}")
    state = torch.load(b / "checkpoints" / "step00000010" / "trainer_rank0.pt", weights_only=False)
    assert [m.shape for m in state["memory"]] == [(4, 32, 64)] * 2  # mem_len 32 per layer
    proc = train_in_process(tmp_path, TXL, None, *common, f"train.out_dir={b}")
    assert "resumed from" in proc.stdout and "step00000010" in proc.stdout
    la, lb = step_losses(a), step_losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, 21))
    for s in range(1, 21):
        assert lb[s] == pytest.approx(la[s], rel=0, abs=1e-6), (s, la[s], lb[s])
