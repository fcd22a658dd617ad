"""Resuming what cannot be resumed into the same out_dir: one `plm:` line naming the
checkpoint and the override that works, exit 2, before DeepSpeed starts."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, build_data_dir, one_plm_line, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def fake_checkpoint(run_dir, **meta):
    """What the trainer leaves: a COMPLETE marker with its meta, and `latest` naming it."""
    ckpt = run_dir / "checkpoints"
    (ckpt / "step00000004").mkdir(parents=True)
    meta = {"step": 4, "world_size": 1, "micro_batch_size": 8, "grad_accum": 1,
            "global_batch": 8, "zero_stage": 2, **meta}  # fmt: skip
    (ckpt / "step00000004" / "COMPLETE").write_text(json.dumps(meta))
    (ckpt / "latest").write_text("step00000004")


def test_another_tokenizer_is_refused_naming_both(tiny_data, tmp_path):
    fake_checkpoint(tmp_path / "run", tokenizer_fingerprint="f" * 64, vocab_size=448)
    proc = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={tmp_path / 'run'}",
               cwd=tmp_path, check=False)  # fmt: skip
    line = one_plm_line(proc)
    assert "another tokenizer (vocab 448, sha256 ffffffffffff)" in line
    assert f"data.path={tiny_data}" in line and "new train.out_dir" in line


def test_another_zero_stage_is_refused_with_the_deepspeed_override(tiny_data, tmp_path):
    """The README's commands in a row: 2 ranks under ZeRO-3, then one rank under an
    explicit ZeRO-2 (`deepspeed: auto` would keep the checkpoint's stage: test_zero_auto)."""
    fake_checkpoint(tmp_path / "run", world_size=2, global_batch=16, zero_stage=3)
    proc = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={tmp_path / 'run'}",
               "deepspeed=configs/deepspeed/zero2.json", cwd=tmp_path, check=False)  # fmt: skip
    line = one_plm_line(proc)
    assert "under ZeRO-3 and this run's deepspeed config is ZeRO-2" in line
    assert "pass deepspeed=configs/deepspeed/zero3.json" in line


def test_a_checkpoint_of_other_shapes_is_one_line(tiny_data, tmp_path_factory, tmp_path):
    """A checkpoint without a tokenizer fingerprint (written before it was recorded) on
    data of a bigger vocabulary: DeepSpeed's `size mismatch` becomes one line."""
    run = tmp_path / "run"
    args = ["train", BERT, f"train.out_dir={run}", "train.max_steps=2", "train.save_every=2",
            "train.eval_every=0", "mlflow.register=false"]  # fmt: skip
    plm(*args, f"data.path={tiny_data}", cwd=tmp_path)
    complete = run / "checkpoints" / "step00000002" / "COMPLETE"
    meta = json.loads(complete.read_text())
    assert meta["tokenizer_fingerprint"] and meta["vocab_size"] > 0
    del meta["tokenizer_fingerprint"]
    complete.write_text(json.dumps(meta))
    bpe = build_data_dir(tmp_path_factory.mktemp("bpe"), kind="bpe")
    proc = plm(*args[:-3], "train.max_steps=4", f"data.path={bpe}", cwd=tmp_path, check=False)
    line = one_plm_line(proc)
    assert "holds tensors of other shapes than this model (size mismatch for" in line
