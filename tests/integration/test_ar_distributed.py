"""The autoregressive family under the real `deepspeed` launcher: 2 ranks on the CPU
(gloo), ZeRO-2. Each tiny preset trains with a falling loss and reports validation
perplexity; the GPT run's registered model then generates through its MLflow URIs."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, data: Path, config: str, steps: int = 12) -> Path:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
        "--master_port", str(free_port()), "--module", "pipeline.cli",
        "train", str(REPO / config), f"data.path={data}", f"train.out_dir={run_dir}",
        "deepspeed=configs/deepspeed/zero2.json", f"train.max_steps={steps}",
        "train.save_every=6", "train.eval_every=6", "train.lr=2.0e-3",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "world size 2" in proc.stdout
    return run_dir


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["configs/test/gpt-tiny.yaml",
                                    "configs/test/transformer-xl-tiny.yaml"])  # fmt: skip
def test_two_ranks_zero2_loss_falls_and_reports_perplexity(tiny_data, tmp_path, config):
    run_dir = launch(tmp_path, tiny_data, config)
    metrics = rows(run_dir)
    losses = [r["step_loss"] for r in metrics if "step_loss" in r]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.1, losses
    ppl = [r["eval_lm_ppl"] for r in metrics if "eval_lm_ppl" in r]
    assert len(ppl) == 2 and all(math.isfinite(p) and p > 1 for p in ppl), ppl
    assert ppl[1] < ppl[0]  # validation perplexity falls too
    ckpt = run_dir / "checkpoints" / "step00000012"
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "trainer_rank1.pt").is_file()
    if "transformer-xl" in config:  # each rank checkpoints its own rows' memory
        import torch

        state = torch.load(ckpt / "trainer_rank1.pt", weights_only=False)
        assert len(state["memory"]) == 2 and state["memory"][0].shape == (4, 32, 64)
        return

    # the registered model generates the same text from every way of naming it
    from pipeline.generate import generate_text

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    texts = [
        generate_text(m, "The cat", max_new_tokens=8, temperature=0, tracking_uri=uri)["text"]
        for m in (str(run_dir / "bundles" / "final"), "models:/gpt-tiny@current",
                  f"runs:/{run_id}/model")
    ]  # fmt: skip
    assert texts[0] == texts[1] == texts[2]
    assert texts[0].lower().startswith("the cat") and len(texts[0]) > len("the cat")
