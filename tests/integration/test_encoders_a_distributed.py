"""RoBERTa, BERT-wwm and ALBERT: each tiny preset trains for real under the `deepspeed`
launcher, 2 ranks on the CPU (gloo), ZeRO-2 (the session's ``family_runs``), and its
loss falls."""

from __future__ import annotations

import pytest
from conftest import falls, metrics_rows, step_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize(
    "name,extra_metric", [("roberta", None), ("bert-wwm", "nsp_loss"), ("albert", "sop_loss")]
)
def test_tiny_preset_trains_on_two_ranks_zero2(family_runs, name, extra_metric):
    run_dir = family_runs[name]
    losses = step_losses(run_dir)
    assert len(losses) == 10 and falls(losses), losses
    if extra_metric:  # the objective's second head is trained too
        assert any(extra_metric in r for r in metrics_rows(run_dir))
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()
