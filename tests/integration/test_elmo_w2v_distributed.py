"""ELMo and word2vec: 2 ranks on the CPU through the real `deepspeed` launcher (ZeRO-2),
a falling loss, validation perplexity in the metrics, a bundle, `plm neighbors` on the
run's MLflow artifact."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, plm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, data: Path, config: str, steps: int = 10) -> Path:
    run_dir = tmp_path / config
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
        "--master_port", str(free_port()), "--module", "pipeline.cli",
        "train", str(REPO / f"configs/test/{config}.yaml"), f"data.path={data}",
        f"train.out_dir={run_dir}", "deepspeed=configs/deepspeed/zero2.json",
        f"train.max_steps={steps}", "train.save_every=0", "train.eval_every=5",
        "mlflow.register=false",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "world size 2" in proc.stdout and "ZeRO 2" in proc.stdout
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["elmo-tiny", "word2vec-tiny"])
def test_two_ranks_zero2_loss_falls_and_reports_validation(tiny_data, tmp_path, config):
    run_dir = launch(tmp_path, tiny_data, config)
    rows = metrics(run_dir)
    losses = [r["step_loss"] for r in rows if "step_loss" in r]
    assert len(losses) == 10 and all(v == v for v in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.1, losses
    evals = [r for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    bundle = run_dir / "bundles" / "final"
    assert (bundle / "model.safetensors").is_file()
    if config == "elmo-tiny":  # both directions' perplexities, from the shared softmax
        assert {"eval_fwd_ppl", "eval_bwd_ppl", "eval_ppl"} <= set(evals[1])
        assert evals[1]["eval_ppl"] < 300  # the vocabulary has 300 tokens
        import torch

        from pipeline.data.shards import DataDir
        from pipeline.models.bundle import load_bundle
        from pipeline.models.elmo import build_char_table

        model, _ = load_bundle(bundle)  # the table built from the data's tokenizer
        table = build_char_table(DataDir(tiny_data).tokenizer_path.parent, model.config)
        assert torch.equal(model.char_ids, table)
    else:  # the model served from MLflow: nearest words by cosine
        run_id = (run_dir / "mlflow_run_id").read_text().strip()
        proc = plm("neighbors", f"runs:/{run_id}/model", "cat", "--k", "5", cwd=tmp_path)
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 5 and all(len(line.split()) == 3 for line in lines)
