"""ELECTRA, DistilBERT and ERNIE: 2 ranks on the CPU through the real `deepspeed` launcher
(gloo, ZeRO-2), each with a falling loss and a bundle of the right shape."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, data: Path, config: str, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
        "--master_port", str(free_port()), "--module", "pipeline.cli",
        "train", str(REPO / "configs/test" / config), f"data.path={data}",
        f"train.out_dir={run_dir}", "deepspeed=configs/deepspeed/zero2.json",
        f"train.max_steps={STEPS}", f"train.save_every={STEPS}", "train.eval_every=0",
        "mlflow.register=false", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "world size 2, ZeRO 2" in proc.stdout
    return run_dir


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_loss"] for r in rows if "step_loss" in r]


def falls(values: list[float]) -> bool:
    return all(v == v for v in values) and sum(values[-3:]) < sum(values[:3]) - 0.1


def teacher_bundle(tmp_path: Path, data: Path) -> Path:
    """A bert-tiny on the data's tokenizer (freshly built: enough for the mechanics)."""
    from pipeline.models import build_model, resolve_model_config
    from pipeline.models.bundle import save_bundle

    meta = json.loads((data / "tokenizer" / "tokenizer_meta.json").read_text())
    cfg = resolve_model_config({"arch": "bert", "preset": "bert-tiny"}, meta["vocab_size"])
    torch.manual_seed(0)
    model = build_model("bert", cfg)
    return save_bundle(tmp_path / "teacher", "bert", cfg, model.state_dict(), data / "tokenizer")


@pytest.mark.parametrize("arch", ["electra", "distilbert", "ernie"])
def test_two_ranks_zero2_loss_falls(tiny_data, tmp_path, arch):
    overrides = []
    if arch == "distilbert":
        overrides.append(f"objective.distill.teacher={teacher_bundle(tmp_path, tiny_data)}")
    run_dir = launch(tmp_path, tiny_data, f"{arch}-tiny.yaml", *overrides)
    values = losses(run_dir)
    assert len(values) == STEPS and falls(values), values
    ckpt = run_dir / "checkpoints" / f"step{STEPS:08d}"
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "trainer_rank1.pt").is_file()
    weights = load_file(run_dir / "bundles" / "final" / "model.safetensors")
    if arch == "electra":  # the bundle keeps both networks
        assert any(k.startswith("generator.") for k in weights)
        assert any(k.startswith("discriminator.") for k in weights)
    if arch == "distilbert":  # only the student: no segment embeddings, no teacher
        assert not any("token_type" in k or "teacher" in k for k in weights)
        assert sum(k.startswith("blocks.") for k in weights) == 12  # one layer of 12 tensors
