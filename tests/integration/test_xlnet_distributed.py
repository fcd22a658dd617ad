"""XLNet-tiny, permutation LM with memory, 2 ranks on the CPU through the real `deepspeed`
launcher (gloo, ZeRO-2; the session's ``family_runs``): the loss falls, validation perplexity is reported, and each rank
checkpoints its own recurrent memory."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import falls, metrics_rows, step_losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_xlnet_two_ranks_zero2_loss_falls_and_reports_perplexity(tiny_data, family_runs):
    run_dir = family_runs["xlnet"]
    rows = metrics_rows(run_dir)
    losses = step_losses(run_dir)
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), losses
    assert falls(losses), losses
    evals = [r for r in rows if "eval_plm_ppl" in r]
    assert [r["step"] for r in evals] == [5, 10]
    # perplexity over the predicted tokens: finite, below a uniform guess, and improving
    vocab = json.loads((tiny_data / "tokenizer" / "tokenizer_meta.json").read_text())["vocab_size"]
    ppl = [r["eval_plm_ppl"] for r in evals]
    assert all(1 < p < vocab for p in ppl) and ppl[1] < ppl[0], ppl
    # each rank carried and checkpointed its own memory: [layers, rows, mem_len, hidden]
    ckpt = run_dir / "checkpoints" / "step00000010"
    mems = [torch.load(ckpt / f"trainer_rank{r}.pt", weights_only=False)["memory"] for r in (0, 1)]
    assert all(m is not None and tuple(m.shape) == (2, 8, 48, 64) for m in mems)
    assert not torch.equal(mems[0], mems[1])  # different rows of the stream
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()
