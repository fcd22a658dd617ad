"""ELECTRA, DistilBERT and ERNIE: 2 ranks on the CPU through the real `deepspeed` launcher
(gloo, ZeRO-2; the session's ``family_runs``), each with a falling loss and a bundle of
the right shape."""

from __future__ import annotations

import pytest
from conftest import falls, step_losses
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("arch", ["electra", "distilbert", "ernie"])
def test_two_ranks_zero2_loss_falls(family_runs, arch):
    run_dir = family_runs[arch]
    values = step_losses(run_dir)
    assert len(values) == 10 and falls(values), values
    ckpt = run_dir / "checkpoints" / "step00000010"
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "trainer_rank1.pt").is_file()
    weights = load_file(run_dir / "bundles" / "final" / "model.safetensors")
    if arch == "electra":  # the bundle keeps both networks
        assert any(k.startswith("generator.") for k in weights)
        assert any(k.startswith("discriminator.") for k in weights)
    if arch == "distilbert":  # only the student: no segment embeddings, no teacher
        assert not any("token_type" in k or "teacher" in k for k in weights)
        assert sum(k.startswith("blocks.") for k in weights) == 12  # one layer of 12 tensors
