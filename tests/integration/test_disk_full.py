"""A full disk (issue 52, defect 2): `plm train` with train.out_dir on a full filesystem,
`plm data prepare` onto one, and the dry runs of both. Each is one `plm:` line naming the
path, what is needed (when known) and what is free, exit 5 (``EXIT_DISK_FULL``), no
traceback; `latest` stays on a whole checkpoint, and once there is space the same command
resumes exactly (train) or finishes (prepare). Real small tmpfs mounts (root only: the
tests skip otherwise), real DeepSpeed, MLflow and Ray."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, metrics_rows, one_plm_line, plm, synthetic_corpus

from pipeline.output import EXIT_DISK_FULL

pytestmark = pytest.mark.slow

BERT = str(REPO / "configs/test/bert-tiny.yaml")
SIZE = r"~?[\d.]+ (B|KiB|MiB|GiB)"


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size)``: a new tmpfs of ``size`` (e.g. "3m") under tmp_path, unmounted at
    the end of the test; the test is skipped where one cannot be mounted."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def grow(where: Path, size: str) -> None:
    """More space on the tmpfs: what freeing space on a full disk amounts to."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def fill(where: Path) -> None:
    """No byte left on the filesystem of ``where``."""
    with open(where / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["step_loss"] for r in metrics_rows(run_dir) if "step_loss" in r}


def test_train_on_a_full_out_dir_is_one_line_and_resumes_exactly(tiny_data, tmp_path, tmpfs):
    """3 MiB hold the step-10 checkpoint (~1.7 MiB) and its bundle, not the step-20 one."""
    disk = tmpfs("3m")
    run_dir = disk / "run"
    args = ["train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
            "train.max_steps=20", "train.save_every=10", "train.eval_every=0",
            "train.log_every=1", "mlflow.register=false"]  # fmt: skip
    line = one_plm_line(plm(*args, cwd=tmp_path, check=False), code=EXIT_DISK_FULL)
    ckpt = run_dir / "checkpoints"
    assert line.startswith(f"plm: no space left on device writing {run_dir}"), line
    assert re.search(rf"a checkpoint needs {SIZE} \(weights \+ optimizer state", line), line
    assert re.search(rf"{SIZE} free on its filesystem", line), line
    assert line.endswith(
        f"it resumes from {ckpt / 'step00000010'}, the last complete checkpoint"
    ), line
    assert (ckpt / "latest").read_text() == "step00000010"
    assert (ckpt / "step00000010" / "COMPLETE").is_file()
    assert not (ckpt / "step00000020" / "COMPLETE").exists()
    assert not [p for p in (run_dir / "bundles").iterdir() if p.name.startswith(".")]  # no temp
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"] == "disk_full"
    before = losses(run_dir)
    assert sorted(before) == list(range(1, 21))  # steps 11-20 trained, their checkpoint lost

    grow(disk, "32m")
    proc = plm(*args, cwd=tmp_path)
    assert f"resumed from {ckpt / 'step00000010'} at step 10" in proc.stdout
    after = losses(run_dir)
    assert sorted(after) == list(range(1, 21))
    for step in range(11, 21):  # the resumed steps are the ones the full run trained
        assert after[step] == pytest.approx(before[step], rel=0, abs=1e-6), step
    assert (ckpt / "latest").read_text() == "step00000020"
    assert (run_dir / "bundles" / "final" / "model.safetensors").is_file()
    assert client.get_run(run.info.run_id).info.status == "FINISHED"  # the same run, ended


def test_dry_run_compares_the_free_space_with_a_checkpoint(tiny_data, tmp_path, tmpfs):
    disk = tmpfs("4m")
    args = ["train", BERT, f"data.path={tiny_data}", f"train.out_dir={disk / 'run'}",
            "train.save_every=10", "--dry-run"]  # fmt: skip
    plan = plm(*args, cwd=tmp_path).stdout
    assert re.search(rf"checkpoint every 10; {SIZE} each, 4.0 MiB free\)", plan), plan
    fill(disk)
    line = one_plm_line(plm(*args, cwd=tmp_path, check=False), code=EXIT_DISK_FULL)
    assert re.fullmatch(
        rf"plm: train.out_dir={disk / 'run'}: a checkpoint needs {SIZE} \(weights \+ optimizer "
        r"state\) and its filesystem has 0 B free: free space there or pass "
        r"train.out_dir=DIR on a bigger disk",
        line,
    ), line

    tok = tiny_data.parent / "tok"
    prep = ["data", "prepare", "--input", str(tiny_data.parent / "corpus.txt"), "--tokenizer",
            str(tok), "--output", str(disk / "data"), "--dry-run"]  # fmt: skip
    line = one_plm_line(plm(*prep, cwd=tmp_path, check=False), code=EXIT_DISK_FULL)
    assert line.startswith(f"plm: --output {disk / 'data'}: its filesystem has 0 B free"), line


def test_prepare_onto_a_full_disk_is_one_line_and_the_rerun_finishes(tiny_data, tmp_path, tmpfs):
    """About 2 MB of text into 2 MiB: the shards do not fit. One line, not Ray's traceback."""
    disk = tmpfs("2m")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(synthetic_corpus(n_docs=6000), encoding="utf-8")
    out = disk / "data"
    args = ["data", "prepare", "--input", str(corpus), "--tokenizer",
            str(tiny_data.parent / "tok"), "--output", str(out), "--num-cpus", "1"]  # fmt: skip
    proc = plm(*args, cwd=tmp_path, check=False)
    line = one_plm_line(proc, code=EXIT_DISK_FULL)
    assert "\x1b[" not in proc.stderr and "RayTaskError" not in proc.stderr, proc.stderr[-3000:]
    assert line.startswith(f"plm: no space left on device writing {out}: "), line
    assert re.search(rf"{SIZE} free on its filesystem; free space there or pass --output", line)
    assert not (out / "manifest.json").exists()

    grow(disk, "32m")
    plm(*args, cwd=tmp_path)
    assert (out / "manifest.json").is_file()
    proc = plm("data", "inspect", str(out), "--verify", cwd=tmp_path)
    assert "6,000" in proc.stdout, proc.stdout
