"""2 ranks on the CPU through the real `deepspeed` launcher (gloo), ZeRO 0-3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, deepspeed_launch, falls, free_port, step_losses
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BERT = str(REPO / "configs/test/bert-tiny.yaml")
STAGES = ("zero0", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def zero_runs(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """bert-tiny for 12 steps under each ZeRO stage, same seed, in one 2-rank launch
    (tests/integration/train_many.py runs them one after another in the same ranks)."""
    root = tmp_path_factory.mktemp("zero")
    plan = [
        {"config": BERT, "overrides": [
            f"data.path={tiny_data}", f"train.out_dir={root / stage}",
            f"deepspeed=configs/deepspeed/{stage}.json", "train.max_steps=12",
            "train.save_every=6", "train.eval_every=6", "train.log_every=1",
            "mlflow.register=false"]}
        for stage in STAGES
    ]  # fmt: skip
    (root / "plan.json").write_text(json.dumps(plan))
    driver = REPO / "tests" / "integration" / "train_many.py"
    proc = deepspeed_launch([str(driver), str(root / "plan.json")], cwd=root)
    for stage in STAGES:
        assert f"world size 2, ZeRO {stage[-1]}" in proc.stdout
    return {stage: root / stage for stage in STAGES}


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_two_ranks_zero_1_2(zero_runs, stage):
    run_dir = zero_runs[stage]
    values = step_losses(run_dir)
    assert len(values) == 12 and falls(values), values
    # both ranks wrote their loader/RNG state into every checkpoint
    ckpt = run_dir / "checkpoints" / "step00000012"
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "trainer_rank1.pt").is_file()


def test_zero3_bundle_equals_zero0(zero_runs):
    z0, z3 = zero_runs["zero0"], zero_runs["zero3"]
    l0, l3 = step_losses(z0), step_losses(z3)
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
               "train.eval_every=0", "train.log_every=1", "mlflow.register=false",
               "deepspeed=configs/deepspeed/zero2.json"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "world size 2" in outs[0]
    assert len(step_losses(run_dir)) == 6
    assert (run_dir / "checkpoints" / "step00000006" / "trainer_rank1.pt").is_file()
