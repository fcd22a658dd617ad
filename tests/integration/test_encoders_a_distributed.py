"""RoBERTa, BERT-wwm and ALBERT: each tiny preset trains for real under the `deepspeed`
launcher, 2 ranks on the CPU (gloo), ZeRO-2, and its loss falls."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, synthetic_corpus

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> Path:
    """The synthetic corpus with a byte-level BPE tokenizer (RoBERTa's; <pad> = 1)."""
    from pipeline.data.prepare import PrepareConfig, run_prepare
    from pipeline.data.tokenizer import TokenizerSpec, train_tokenizer

    root = tmp_path_factory.mktemp("bpe_data")
    corpus = root / "corpus.txt"
    corpus.write_text(synthetic_corpus(), encoding="utf-8")
    tok = train_tokenizer([str(corpus)], TokenizerSpec(kind="bpe", vocab_size=400), root / "tok")
    cfg = PrepareConfig(
        inputs=[str(corpus)], tokenizer=str(tok), output=str(root / "data"),
        valid_fraction=0.1, shard_docs=40, max_doc_tokens=128, num_cpus=1,
    )  # fmt: skip
    return Path(run_prepare(cfg))


def launch(tmp_path: Path, config: str, data: Path, steps: int = 10) -> Path:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
        "--master_port", str(free_port()), "--module", "pipeline.cli",
        "train", str(REPO / config), f"data.path={data}", f"train.out_dir={run_dir}",
        "deepspeed=configs/deepspeed/zero2.json", f"train.max_steps={steps}",
        "train.save_every=0", "train.eval_every=0", "mlflow.register=false",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "world size 2" in proc.stdout
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "config,extra_metric",
    [
        ("configs/test/roberta-tiny.yaml", None),
        ("configs/test/bert-wwm-tiny.yaml", "nsp_loss"),
        ("configs/test/albert-tiny.yaml", "sop_loss"),
    ],
)
def test_tiny_preset_trains_on_two_ranks_zero2(tmp_path, request, config, extra_metric):
    data = request.getfixturevalue("bpe_data" if "roberta" in config else "tiny_data")
    run_dir = launch(tmp_path, config, data)
    rows = [r for r in metrics(run_dir) if "step_loss" in r]
    losses = [r["step_loss"] for r in rows]
    assert len(losses) == 10 and all(v == v for v in losses), losses
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.1, losses  # the loss falls
    if extra_metric:  # the objective's second head is trained too
        assert any(extra_metric in r for r in metrics(run_dir))
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()
