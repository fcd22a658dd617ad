"""Quiet by default: no MLflow INFO lines, no per-rank FutureWarnings, no Ray token-auth
notice; `-v` (before or after the subcommand) shows them again."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, plm

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def test_training_is_quiet_by_default_and_chatty_with_v(tiny_data, tmp_path):
    """ZeRO-3 on one rank: DeepSpeed calls torch.distributed's deprecated collectives."""
    args = [BERT, f"data.path={tiny_data}", "train.max_steps=2", "train.eval_every=0",
            "train.log_every=1", "mlflow.register=false",
            "deepspeed=configs/deepspeed/zero3.json"]  # fmt: skip
    quiet = plm("train", *args, f"train.out_dir={tmp_path / 'q'}", cwd=tmp_path)
    out = quiet.stdout + quiet.stderr
    assert "FutureWarning" not in out and " INFO mlflow" not in out, out[-3000:]
    assert "[plm train] step 2: loss" in out and "MLflow run" in out  # our own lines stay
    # progress: where the run is and about how long it has left (not on the last step)
    assert re.search(r"\[plm train\] step 1: loss .*, 1/2, \d+ s left\n", out), out[-3000:]
    assert not re.search(r"step 2: loss .* left", out)
    loud = plm("train", "-v", *args, f"train.out_dir={tmp_path / 'v'}", cwd=tmp_path)
    out = loud.stdout + loud.stderr
    assert "FutureWarning" in out and " INFO mlflow" in out


def test_prepare_is_quiet_about_token_authentication(tmp_path):
    from conftest import synthetic_corpus

    from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text(synthetic_corpus(60))
    train_tokenizer([str(corpus)], TokenizerSpec(kind="wordpiece", vocab_size=200), tmp_path / "t")
    args = ["data", "prepare", "--input", str(corpus), "--tokenizer", str(tmp_path / "t"),
            "--num-cpus", "1"]  # fmt: skip
    quiet = plm(*args, "--output", str(tmp_path / "d1"), cwd=tmp_path)
    assert "Token authentication" not in quiet.stderr, quiet.stderr[-3000:]
    assert "WARNING" not in quiet.stderr, quiet.stderr[-3000:]
    # nor Ray's C++ "E ... core_worker.cc" line (the Ray Data actor version printed it)
    assert "core_worker" not in quiet.stdout + quiet.stderr


def test_v_leaves_rays_notice_alone():
    import logging

    from pipeline import output

    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    saved = notice.level
    try:
        output.configure(1)
        output.quiet_ray_auth_notice()
        assert notice.level == saved
        output.configure(0)
        output.quiet_ray_auth_notice()
        assert notice.level == logging.ERROR
    finally:
        notice.setLevel(saved)
        output.VERBOSE = 0
