"""XLNet-tiny, permutation LM with memory, 2 ranks on the CPU through the real `deepspeed`
launcher (gloo, ZeRO-2): the loss falls, validation perplexity is reported, and each rank
checkpoints its own recurrent memory."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

XLNET = str(REPO / "configs/test/xlnet-tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, data: Path, steps: int = 10) -> tuple[Path, str]:
    run_dir = tmp_path / "xlnet"
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
        "--master_port", str(free_port()), "--module", "pipeline.cli",
        "train", XLNET, f"data.path={data}", f"train.out_dir={run_dir}",
        "deepspeed=configs/deepspeed/zero2.json", f"train.max_steps={steps}",
        "train.save_every=5", "train.eval_every=5", "train.lr=2.0e-3", "mlflow.register=false",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return run_dir, proc.stdout


def test_xlnet_two_ranks_zero2_loss_falls_and_reports_perplexity(tiny_data, tmp_path):
    run_dir, stdout = launch(tmp_path, tiny_data)
    assert "world size 2, ZeRO 2" in stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["step_loss"] for r in rows if "step_loss" in r]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.1, losses
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
