"""What a run records agrees with what it did: the `lr` of each step is the one that step
ran at (warmup, decay, the last step, and after a resume), and every row of metrics.jsonl
carries `world_size` (steps, evaluations, the membership-change row of docs/elastic.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, metrics_rows

from pipeline.config import load_config
from pipeline.train.schedule import lr_multiplier

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def train_in_process(cwd, stop_after, overrides, env=None):
    code = (
        "import sys; from pipeline.config import load_config; "
        "from pipeline.train.trainer import train; "
        "train(load_config(sys.argv[1], sys.argv[3:]), "
        "stop_after=None if sys.argv[2] == 'none' else int(sys.argv[2]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, BERT, str(stop_after).lower(), *overrides],
        cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_the_logged_lr_is_the_steps_own_and_every_row_has_the_world_size(tiny_data, tmp_path):
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    db = tmp_path / "mlflow.db"
    overrides = [f"data.path={tiny_data}", f"train.out_dir={run_dir}", "train.max_steps=4",
                 "train.warmup_steps=2", "train.schedule=linear", "train.log_every=1",
                 "train.eval_every=2", "train.save_every=2", f"mlflow.tracking_uri=sqlite:///{db}"]  # fmt: skip
    train_in_process(tmp_path, 2, overrides)  # steps 1-2, a checkpoint at 2
    # The resume as an elastic agent's restart makes it: it logs a membership-change row.
    train_in_process(tmp_path, None, overrides, env={"TORCHELASTIC_RUN_ID": "t"})

    t = load_config(BERT, overrides).train
    want = {
        s: t.lr * lr_multiplier(s - 1, warmup_steps=2, max_steps=4, schedule="linear",
                                min_lr_ratio=t.min_lr_ratio)
        for s in range(1, 5)
    }  # fmt: skip
    # warmup 2: step 1 ran at half the lr; the linear decay's last step did not run at 0
    assert want[1] == pytest.approx(t.lr / 2) and want[4] > 0
    rows = metrics_rows(run_dir)
    got = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert got == pytest.approx(want)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    history = MlflowClient(f"sqlite:///{db}").get_metric_history(run_id, "lr")
    assert {m.step: m.value for m in history} == pytest.approx(want)

    assert any("eval_loss" in r for r in rows) and any("elastic/changes" in r for r in rows)
    assert [r for r in rows if r.get("world_size") != 1] == []
