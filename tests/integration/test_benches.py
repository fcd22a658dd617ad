"""The training benches run end to end in their tiny mode (bench/bench_train.py: BERT vs
Hugging Face; bench/bench_gpt.py: GPT-2 vs the nanoGPT-style baseline), in a fresh process
as bench/gpu_run.sh runs them on the GPU machine: with MLflow made unimportable (that
machine has none; DeepSpeed imports it only when it is installed), and without importing
Ray (a prepared data dir needs no data stage). On the CPU always; on CUDA (bf16) where
there is a GPU, which is where MFU and peak memory are reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
pytestmark = pytest.mark.slow


def bench(script: str, data: Path, device: str, out: Path, *args: str) -> dict:
    precision = "bf16" if device == "cuda" else "fp32"
    cmd = [sys.executable, f"bench/{script}", "--data-dir", str(data), "--device", device,
           "--precision", precision, "--deny-import", "mlflow", "--json", str(out), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    imported = report["info"]["imported"]
    assert "ray" not in imported and "mlflow" not in imported, imported
    assert {"torch", "deepspeed", "pipeline"} <= set(imported)
    assert report["info"]["device"] == device
    return report


def check_side(side: dict, device: str, ours: bool) -> None:
    assert side["real_tokens_per_s_wall"] > 0 and side["cost_per_1k_real_tokens"] > 0
    assert side["model_flops_per_s"] > 0
    assert side["loss_first"] == side["loss_first"] and side["loss_last"] == side["loss_last"]
    if device == "cpu":  # no peak FLOP/s, no GPU memory: the fields are there, null
        assert side["mfu"] is None and side["peak_memory_bytes"] is None
    else:
        assert 0 < side["mfu"] < 1 and side["peak_memory_bytes"] > 0
    # ours pays its loader (in the bench's process); its step alone is reported too
    assert ("step_only" in side) == ours
    if ours:
        alone = side["step_only"]
        assert alone["real_tokens_per_s_wall"] >= side["real_tokens_per_s_wall"] > 0
        assert (alone["mfu"] is None) == (device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_bench_train_tiny(tiny_data, tmp_path, device):
    report = bench("bench_train.py", tiny_data, device, tmp_path / "bert.json", "--preset",
                   "bert-tiny", "--batch", "8", "--seq", "64", "--rounds", "2", "--warmup", "1")  # fmt: skip
    (res,) = report["results"]
    assert set(res["sides"]) == {"ours unpad", "ours padded", "hf"}
    assert len(res["real_tokens_per_round"]) == 2 and 0 < res["padding_fraction"] < 1
    for name, side in res["sides"].items():
        check_side(side, device, ours=name != "hf")
        if name != "hf":
            assert side["hf_over_ours"] > 0 and len(side["hf_over_ours_rounds"]) == 2
            assert side["hf_over_ours_step_only"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_bench_gpt_tiny(tiny_bpe_data, tmp_path, device):
    report = bench("bench_gpt.py", tiny_bpe_data, device, tmp_path / "gpt.json", "--preset",
                   "gpt2-tiny", "--sides", "ours,baseline", "--rounds", "2")  # fmt: skip
    res = report["result"]
    assert set(res["sides"]) == {"ours", "baseline"}
    assert res["params"]["ours"] == res["params"]["baseline"]  # the same model, twice
    assert res["real_tokens_per_round"] == [4 * 64] * 2 and res["flops_per_token"] > 0
    for name, side in res["sides"].items():
        check_side(side, device, ours=name == "ours")
    over = res["sides"]["ours"]["over"]["baseline"]
    assert over["ratio"] > 0 and len(over["rounds"]) == 2 and over["ratio_step_only"] > 0


def test_bench_checkpoint_tiny(tiny_data, tmp_path):
    """bench/bench_checkpoint.py (issue 30) on bert-tiny, one rank, a synchronous then an
    asynchronous save side by side: every part of ``Trainer.save`` it wraps is still
    called (a DeepSpeed or trainer change that renames one shows as a missing part), and
    the checkpoint it measures is complete; the asynchronous one completes only after the
    writes (COMPLETE and `latest` are not part of its save)."""
    out = tmp_path / "ckpt.json"
    cmd = [sys.executable, "bench/bench_checkpoint.py", "--data-dir", str(tiny_data),
           "--preset", "bert-tiny", "--ranks", "1", "--saves", "2", "--steps-between", "1",
           "--warmup", "0", "--seq", "64", "--out-dir", str(tmp_path / "out"), "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sync, background = json.loads(out.read_text())["summary"]
    assert (sync["async"], background["async"]) == ("off", "on")
    for res in (sync, background):
        assert res["world"] == 1 and res["bytes"] > 0 and res["step_s"] > 0
        assert 0 < res["blocked_s"] and res["ratio"] > 0 and res["with_bundle_s"] > res["blocked_s"]
        assert "COMPLETE" in res["raw"]["rank0_files"]
        for s in res["raw"]["saves"]:
            assert {"DeepSpeed save_checkpoint", "our trainer state (loader, RNG; fsync'd)",
                    "config.yaml + ds_config.json"} <= set(s["parts"])  # fmt: skip
            assert any("optim_states" in k or "ZeRO optimizer" in k for k in s["parts"])
            assert sum(v for k, v in s["parts"].items() if not k.startswith(" ")) <= s["blocked_s"]
    assert [s["tag"] for s in sync["raw"]["saves"]] == ["step00000001", "step00000002"]
    # COMPLETE and latest are written when every rank's writes are confirmed, at a later
    # step boundary (on the store's thread), not inside the save
    for s in sync["raw"]["saves"]:
        assert {"barriers (3, CheckpointManager.save)", "prune (keep_last)"} <= set(s["parts"])
    # Asynchronous: a step is trained while the files are written, then the save completes.
    assert [s["tag"] for s in background["raw"]["saves"]] == ["step00000001", "step00000003"]
    for s in background["raw"]["saves"]:
        assert "COMPLETE" not in s["parts"] and "latest pointer" not in s["parts"]
        assert len(s["writing_steps_s"]) == 1 and s["finish_wait_s"] >= 0


def test_bench_finetune_vs_hf_tiny(tmp_path):
    """bench/bench_finetune_vs_hf.py (issue 48) in its tiny mode: `plm finetune`'s loop and
    transformers' Trainer both trained the same examples from the same token ids, each
    timed over its own loop, HF single-process (no DDP wrap from our process group), and
    the JSON line printed last is the one written to --json."""
    out = tmp_path / "ft.json"
    cmd = [sys.executable, "bench/bench_finetune_vs_hf.py", "--tiny", "--work-dir",
           str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == res
    assert res["tiny"] and res["threads"] == 1 and res["epochs"] == 2
    (pair,) = res["pairs"]
    ours, hf = pair["ours"], pair["hf"]
    assert pair["same_token_ids"] is True
    assert ours["examples"] == hf["examples"] == res["epochs"] * res["train_rows"] > 0
    for side in (ours, hf):
        assert side["steps"] * res["batch"] == side["examples"]
        assert side["loop_cpu_s"] > 0 and side["loop_wall_s"] > 0
        assert side["cpu_s_per_example"] > 0 and side["wall_s_per_example"] > 0
        assert side["call_wall_s"] > side["loop_wall_s"]  # set-up and test outside the loop
        assert side["threads"] == 1
        assert len(side["epoch_loss"]) == res["epochs"]
        assert all(0 < loss < 10 for loss in side["epoch_loss"]), side["epoch_loss"]
        assert 0 <= side["test_accuracy"] <= 1
    assert hf["train_runtime"] > 0 and hf["train_samples_per_second"] > 0
    assert hf["model_wrapped"] == "BertForSequenceClassification", hf["model_wrapped"]
    assert hf["parallel_mode"] == "ParallelMode.NOT_PARALLEL"
    assert pair["ratio_cpu"] > 0 and res["median"]["ratio_cpu"] == pair["ratio_cpu"]
