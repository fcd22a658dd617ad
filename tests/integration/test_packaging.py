"""The wheel carries configs/ (presets, DeepSpeed JSONs, experiments), and an installed
`plm` finds them from any directory, without the repository checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip wheel` of this checkout, installed (without dependencies: they are this
    environment's) into a folder of its own."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(root / "dist"), str(REPO)], check=True, timeout=600)  # fmt: skip
    [wheel] = (root / "dist").glob("plm_pipeline-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(root / "site"), str(wheel)], check=True, timeout=600)  # fmt: skip
    return wheel, root / "site"


def test_the_wheel_holds_every_config(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"pipeline/{p.relative_to(REPO).as_posix()}"
               for p in (REPO / "configs").rglob("*") if p.suffix in (".yaml", ".json")}  # fmt: skip
    assert len(shipped) > 50
    assert shipped <= names, sorted(shipped - names)


def test_an_installed_plm_finds_presets_and_deepspeed_json_anywhere(installed, tiny_data,
                                                                    tmp_path):  # fmt: skip
    """From an empty directory, with the installed package first on the path: the
    experiment YAML, its preset and its DeepSpeed JSON all come from the wheel."""
    _, site = installed
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import pipeline.config as c; print(c.CONFIGS_DIR)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert where == str(site / "pipeline" / "configs")
    assert not (site / "pipeline" / "configs").is_symlink()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", "configs/test/bert-tiny.yaml",
         f"data.path={tiny_data}", "deepspeed=configs/deepspeed/zero3.json", "--dry-run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ZeRO-3" in proc.stdout and "bert-tiny" in proc.stdout


def test_the_readmes_output_folders_are_ignored():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = ["demo/x", "runs/x", "mlflow.db", "mlruns/x", "gen/tok/x", "data/corpus/x",
               "hf/roberta/x", "hf-gpt/x", "tok/x", "tok-bpe/x", "tok-unigram/x",
               "preds.jsonl", "rows.predictions.jsonl"]  # fmt: skip
    proc = subprocess.run(["git", "check-ignore", *outputs], cwd=REPO, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.stdout.split() == outputs
    tracked = subprocess.run(["git", "check-ignore", "pipeline/prepare/readers.py",
                              "configs/data/default.yaml"], cwd=REPO, capture_output=True,
                             text=True)  # fmt: skip
    assert tracked.stdout == ""
