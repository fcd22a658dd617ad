"""ZeRO-Infinity (configs/deepspeed/zero3-nvme.json) on the CPU accelerator, with the real
DeepSpeed: the swap folder comes from PLM_NVME_PATH; a folder that cannot be written is
one `plm:` line and exit 2. Training with the state swapped to files through DeepSpeed's
async I/O op (libaio), and the memory cap it is for, are in bench/bench_nvme_offload.py:
the op's first build takes 3-23 minutes here, more than the suite can spend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, plm

from pipeline.errors import ConfigError

BERT = str(REPO / "configs/test/bert-tiny.yaml")
NVME = "deepspeed=configs/deepspeed/zero3-nvme.json"


def nvme_config() -> dict:
    return json.loads((REPO / "configs/deepspeed/zero3-nvme.json").read_text())


def test_nvme_path_comes_from_plm_nvme_path(monkeypatch, tmp_path):
    from pipeline.train import ds_ops
    from pipeline.train.engine import validate_ds_config

    monkeypatch.setenv("PLM_NVME_PATH", str(tmp_path / "swap"))
    ds = nvme_config()
    ds_ops.resolve_nvme_paths(ds, "zero3-nvme.json")
    zero = ds["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] == str(tmp_path / "swap")
    assert zero["offload_optimizer"]["nvme_path"] == str(tmp_path / "swap")
    validate_ds_config(ds, "zero3-nvme.json")  # DeepSpeed's own model takes it

    monkeypatch.delenv("PLM_NVME_PATH")
    ds = nvme_config()
    ds_ops.resolve_nvme_paths(ds, "zero3-nvme.json")
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/mnt/local/plm-nvme"

    ds = nvme_config()
    ds["zero_optimization"]["offload_param"]["nvme_path"] = "$PLM_NO_SUCH_VARIABLE/x"
    with pytest.raises(ConfigError, match=r"offload_param.nvme_path .*not set here"):
        ds_ops.resolve_nvme_paths(ds, "zero3-nvme.json")
    ds = nvme_config()
    del ds["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(ConfigError, match=r"offload_optimizer.device is nvme but it has no"):
        ds_ops.resolve_nvme_paths(ds, "zero3-nvme.json")
    # a config without nvme is left alone
    plain = json.loads((REPO / "configs/deepspeed/zero3-offload.json").read_text())
    before = json.dumps(plain)
    ds_ops.resolve_nvme_paths(plain, "zero3-offload.json")
    assert json.dumps(plain) == before


def nvme_train(data: Path, cwd: Path, out: str, swap: Path, *extra: str, check: bool = True):
    return plm("train", BERT, f"data.path={data}", f"train.out_dir={cwd / out}",
               "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
               "train.log_every=1", "mlflow.register=false", *extra, cwd=cwd,
               env={"PLM_NVME_PATH": str(swap), "OMP_NUM_THREADS": "1"}, check=check)  # fmt: skip


@pytest.mark.slow
def test_an_unwritable_swap_folder_is_one_plm_line(tiny_data, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    proc = nvme_train(tiny_data, tmp_path, "run", tmp_path / "a-file" / "swap", NVME,
                      check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert lines[0].startswith(
        f"plm: zero_optimization.offload_param.nvme_path={tmp_path / 'a-file' / 'swap'}: "
        "cannot write swap files there"
    ), lines[0]
    assert "PLM_NVME_PATH" in lines[0]
