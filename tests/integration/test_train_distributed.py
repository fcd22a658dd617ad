"""2 ranks on the CPU through the real `deepspeed` launcher (gloo), ZeRO 0-3."""

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

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, data: Path, stage: str, steps: int = 12) -> Path:
    run_dir = tmp_path / stage
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
        "--master_port", str(free_port()), "--module", "pipeline.cli",
        "train", BERT, f"data.path={data}", f"train.out_dir={run_dir}",
        f"deepspeed=configs/deepspeed/{stage}.json", f"train.max_steps={steps}",
        "train.save_every=6", "train.eval_every=6", "mlflow.register=false",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "world size 2" in proc.stdout
    return run_dir


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_loss"] for r in rows if "step_loss" in r]


def falls(values: list[float]) -> bool:
    return all(v == v for v in values) and sum(values[-3:]) < sum(values[:3]) - 0.1


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_two_ranks_zero_1_2(tiny_data, tmp_path, stage):
    run_dir = launch(tmp_path, tiny_data, stage)
    values = losses(run_dir)
    assert len(values) == 12 and falls(values), values
    # both ranks wrote their loader/RNG state into every checkpoint
    ckpt = run_dir / "checkpoints" / "step00000012"
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "trainer_rank1.pt").is_file()


def test_zero3_bundle_equals_zero0(tiny_data, tmp_path):
    z0 = launch(tmp_path, tiny_data, "zero0")
    z3 = launch(tmp_path, tiny_data, "zero3")
    l0, l3 = losses(z0), losses(z3)
    assert falls(l3), l3
    assert l3 == pytest.approx(l0, abs=1e-4)
    w0 = load_file(z0 / "bundles" / "final" / "model.safetensors")
    w3 = load_file(z3 / "bundles" / "final" / "model.safetensors")
    assert w0.keys() == w3.keys()
    for k in w0:
        assert torch.allclose(w0[k], w3[k], atol=1e-5, rtol=0), k


def test_torchrun_style_env_two_ranks(tiny_data, tmp_path):
    """What a Kubernetes job sets per pod: RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK."""
    run_dir = tmp_path / "k8s"
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "PYTHONUNBUFFERED": "1",
        }  # fmt: skip
        cmd = [sys.executable, "-m", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
               f"train.out_dir={run_dir}", "train.max_steps=6", "train.save_every=3",
               "train.eval_every=0", "mlflow.register=false",
               "deepspeed=configs/deepspeed/zero2.json"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "world size 2" in outs[0]
    assert len(losses(run_dir)) == 6
    assert (run_dir / "checkpoints" / "step00000006" / "trainer_rank1.pt").is_file()
