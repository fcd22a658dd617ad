"""``deepspeed: auto`` (the default and the presets'): ZeRO-0 on one rank, where ZeRO 1-2
shard nothing and only cost memory, ZeRO-2 on more ranks, and a resumed run keeps its
checkpoint's stage instead of being refused."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, plm
from test_resume_refusals import fake_checkpoint

from pipeline.config import ExperimentConfig, load_config, read_yaml, validate_dict
from pipeline.train import engine as ds_engine

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def stage_line(out: str) -> str:
    return re.search(r"^deepspeed +(.*)$", out, re.M).group(1)


def test_resolve_auto_by_world_size_and_checkpoint():
    cfg = load_config(BERT, ["data.path=/nowhere", "deepspeed=auto"])
    assert isinstance(cfg, ExperimentConfig)
    assert ds_engine.resolve_auto(cfg, 1).deepspeed == "configs/deepspeed/zero0.json"
    assert ds_engine.resolve_auto(cfg, 8).deepspeed == "configs/deepspeed/zero2.json"
    assert ds_engine.resolve_auto(cfg, 1, saved_stage=3).deepspeed == "configs/deepspeed/zero3.json"
    explicit = cfg.model_copy(update={"deepspeed": "configs/deepspeed/zero1.json"})
    assert ds_engine.resolve_auto(explicit, 1) is explicit
    raw = {k: v for k, v in read_yaml(BERT).items() if k != "deepspeed"}
    assert validate_dict(raw).deepspeed == "auto"  # the default


def test_presets_and_tiny_configs_default_to_auto():
    """Every config a user copies follows `deepspeed: auto` (the tiny ones pinned zero2.json
    or zero1.json: issue 34); tests that need a stage pass deepspeed=... themselves."""
    configs = [*(REPO / "configs/experiments").glob("*.yaml"),
               *(REPO / "configs/test").glob("*.yaml"), *(REPO / "k8s").rglob("experiment.yaml")]  # fmt: skip
    assert len(configs) > 20
    for preset in sorted(configs):
        assert load_config(preset).deepspeed == "auto", preset


@pytest.mark.slow
def test_dry_run_and_real_run_pick_the_stage(tiny_data, tmp_path):
    run = tmp_path / "run"
    args = ["train", BERT, f"data.path={tiny_data}", "deepspeed=auto", f"train.out_dir={run}"]
    one = plm(*args, "--dry-run", cwd=tmp_path).stdout
    assert stage_line(one).startswith("ZeRO-0 (deepspeed: auto)")
    assert "grads 0.000" not in one  # ZeRO-0 keeps full gradients on the one rank
    two = plm(*args, "--dry-run", cwd=tmp_path, env={"WORLD_SIZE": "2"}).stdout
    assert stage_line(two).startswith("ZeRO-2 (deepspeed: auto)")
    # The real run on one rank trains under ZeRO-0 and records it in its checkpoint.
    real = plm(*args, "train.max_steps=2", "train.save_every=2", "train.eval_every=0",
               cwd=tmp_path)  # fmt: skip
    assert "world size 1, ZeRO 0" in real.stdout + real.stderr
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert '"zero_stage": 0' in (run / "checkpoints" / latest / "COMPLETE").read_text()


@pytest.mark.slow
def test_a_resumed_run_keeps_its_checkpoints_stage(tiny_data, tmp_path):
    """Written by 2 ranks under ZeRO-3; `auto` on one rank resumes it under ZeRO-3 (an
    explicit other stage is refused: test_resume_refusals)."""
    fake_checkpoint(tmp_path / "run", world_size=2, global_batch=16, zero_stage=3)
    out = plm("train", BERT, f"data.path={tiny_data}", "deepspeed=auto",
              f"train.out_dir={tmp_path / 'run'}", "--dry-run", cwd=tmp_path).stdout  # fmt: skip
    assert stage_line(out).startswith("ZeRO-3 (deepspeed: auto)")
