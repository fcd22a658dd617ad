"""The tiny configs (configs/test/*-tiny.yaml) as a person running them by hand wants them
(issue 52, friction: 367 lines for 300 steps): a line every 10 steps, an evaluation and a
checkpoint every 100 and at the end. Tests that read every step say so
(train.log_every=1)."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, plm

from pipeline.config import load_config

TINY = sorted((REPO / "configs" / "test").glob("*-tiny.yaml"))


@pytest.mark.parametrize("config", TINY, ids=[p.stem for p in TINY])
def test_a_tiny_config_logs_every_10_steps_and_saves_and_evaluates_every_100(config):
    t = load_config(config, []).train
    assert (t.log_every, t.eval_every, t.save_every) == (10, 100, 100), config.name


@pytest.mark.slow
def test_300_steps_of_bert_tiny_print_a_screen_not_hundreds_of_lines(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    proc = plm("train", str(REPO / "configs/test/bert-tiny.yaml"), f"data.path={tiny_data}",
               f"train.out_dir={run_dir}", "train.max_steps=300", "mlflow.register=false",
               cwd=tmp_path)  # fmt: skip
    lines = proc.stdout.splitlines()
    steps = [
        int(m.group(1)) for x in lines if (m := re.match(r"\[plm train\] step (\d+): loss", x))
    ]
    assert steps == list(range(10, 301, 10)), steps
    evals = [x for x in lines if re.match(r"\[plm train\] step \d+: eval_loss", x)]
    assert [x.split(":")[0] for x in evals] == [f"[plm train] step {s}" for s in (100, 200, 300)]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert saved == ["step00000200", "step00000300"]  # every 100, keep_last 2
    assert len(lines) < 60, "\n".join(lines)
