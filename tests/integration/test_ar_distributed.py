"""The autoregressive family under the real `deepspeed` launcher: 2 ranks on the CPU
(gloo), ZeRO-2 (the session's ``family_runs``). Each tiny preset trains with a falling loss and reports validation
perplexity; the GPT run's registered model then generates through its MLflow URIs."""

from __future__ import annotations

import math

import pytest
from conftest import falls, metrics_rows, step_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("name", ["gpt", "transformer-xl"])
def test_two_ranks_zero2_loss_falls_and_reports_perplexity(family_runs, name):
    run_dir = family_runs[name]
    metrics = metrics_rows(run_dir)
    losses = step_losses(run_dir)
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert falls(losses), losses
    ppl = [r["eval_lm_ppl"] for r in metrics if "eval_lm_ppl" in r]
    assert len(ppl) == 2 and all(math.isfinite(p) and p > 1 for p in ppl), ppl
    assert ppl[1] < ppl[0]  # validation perplexity falls too
    ckpt = run_dir / "checkpoints" / "step00000012"
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "trainer_rank1.pt").is_file()
    if name == "transformer-xl":  # each rank checkpoints its own rows' memory
        import torch

        state = torch.load(ckpt / "trainer_rank1.pt", weights_only=False)
        assert len(state["memory"]) == 2 and state["memory"][0].shape == (4, 32, 64)
        return

    # the registered model generates the same text from every way of naming it
    from pipeline.generate import generate_text

    uri = f"sqlite:///{run_dir.parent / 'mlflow.db'}"  # the launch's working directory
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    texts = [
        generate_text(m, "The cat", max_new_tokens=8, temperature=0, tracking_uri=uri)["text"]
        for m in (str(run_dir / "bundles" / "final"), "models:/gpt-tiny@current",
                  f"runs:/{run_id}/model")
    ]  # fmt: skip
    assert texts[0] == texts[1] == texts[2]
    assert texts[0].lower().startswith("the cat") and len(texts[0]) > len("the cat")
