"""DeepSpeed's C++ ops (pipeline/train/ds_ops.py), with the real DeepSpeed. The CPU
shared-memory all-reduce op: never built or loaded at world size 1, a per-venv extension
cache, and a machine without a compiler gets one `plm:` line and trains on plain gloo.
The CPU Adam op of ZeRO-Offload: built for real once (announced, then cached; `--dry-run`
says which), and without a compiler one `plm:` line and exit 2, in the run and the dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, deepspeed_launch, free_port, plm

BERT = str(REPO / "configs/test/bert-tiny.yaml")
LINE = "plm: DeepSpeed's CPU shared-memory all-reduce op"
ADAM_BUILD = "plm: building DeepSpeed's CPU Adam op"
OFFLOAD = "deepspeed=configs/deepspeed/zero3-offload.json"


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_the_extension_cache_is_per_venv_unless_the_user_set_one(monkeypatch, tmp_path):
    from pipeline.train import ds_ops

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    ds_ops.configure_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "var/plm/torch_extensions")
    assert ds_ops.extensions_dir() == Path(sys.prefix) / "var/plm/torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    ds_ops.configure_environment()
    assert ds_ops.extensions_dir() == tmp_path / "mine"

    # A venv that cannot be written (under a file here; an image's venv for its runtime
    # user): the variable stays unset and plm looks where torch builds, its per-user cache.
    from torch.utils.cpp_extension import _get_build_directory

    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "a-file" / "venv"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    ds_ops.configure_environment()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    probe = Path(_get_build_directory("plm_probe", False))  # torch's own answer (it mkdirs)
    probe.rmdir()
    assert ds_ops.extensions_dir() == probe.parent


def test_ds_accelerator_is_cpu_without_a_gpu_unless_the_user_set_it(monkeypatch):
    import torch

    from pipeline.train import ds_ops

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    ds_ops.configure_environment()
    if torch.cuda.is_available():
        assert "DS_ACCELERATOR" not in os.environ  # DeepSpeed detects CUDA itself
    else:
        assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    ds_ops.configure_environment()
    assert os.environ["DS_ACCELERATOR"] == "cuda"


@pytest.mark.slow
def test_world_size_1_neither_builds_nor_loads_the_op(tiny_data, tmp_path):
    """Even asked for (train.cpu_shm_allreduce=true), one rank has no peer: DeepSpeed is
    told the op cannot be built, so the (empty) extension cache stays empty. And plm's
    process sets DS_ACCELERATOR itself: no "Setting accelerator to CPU" warning."""
    ext = tmp_path / "ext"
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = (
        "from pipeline.train import engine; engine.init_distributed(True); "
        "import deepspeed.ops; print('COMPATIBLE', deepspeed.ops.__compatible_ops__"
        "['deepspeed_shm_comm'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**env, "TORCH_EXTENSIONS_DIR": str(ext)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "COMPATIBLE False" in proc.stdout

    os.environ.pop("DS_ACCELERATOR", None)  # (the autouse fixture restores it)
    run = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={tmp_path / 'run'}",
              "train.max_steps=3", "train.eval_every=0", "train.save_every=0",
              "train.cpu_shm_allreduce=true", "mlflow.register=false", cwd=tmp_path,
              env={"TORCH_EXTENSIONS_DIR": str(ext)})  # fmt: skip
    assert not files_under(ext)
    out = run.stdout + run.stderr
    assert "built successfully" not in out and LINE not in out
    assert "Setting accelerator to CPU" not in out


@pytest.mark.slow
@pytest.mark.distributed
def test_no_compiler_one_plm_line_and_training_on_gloo(tiny_data, tmp_path, monkeypatch):
    """2 ranks asking for the op on a machine whose compiler is missing (CXX points
    nowhere): one plm: line (local rank 0), no traceback, nothing built, the run finishes;
    `plm setup` says the same and exits 2."""
    ext = tmp_path / "ext"
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    run_dir = tmp_path / "run"
    proc = deepspeed_launch(
        ["--module", "pipeline.cli", "train", BERT, f"data.path={tiny_data}",
         f"train.out_dir={run_dir}", "train.max_steps=3", "train.eval_every=0",
         "train.save_every=0", "train.cpu_shm_allreduce=true", "mlflow.register=false"],
        cwd=tmp_path,
    )  # fmt: skip
    lines = [x for x in proc.stderr.splitlines() if x.startswith(LINE)]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "cannot be built here" in lines[0] and "CXX=/nonexistent/g++" in lines[0]
    assert "plain gloo" in lines[0]
    assert "Traceback" not in proc.stderr
    assert "world size 2" in proc.stdout and (run_dir / "checkpoints" / "latest").exists()
    assert not files_under(ext)

    setup = plm("setup", cwd=tmp_path, check=False)
    assert setup.returncode == 2, setup.stdout + setup.stderr
    assert "Traceback" not in setup.stderr
    assert [x for x in setup.stderr.splitlines() if x.startswith("plm:")] == [
        x for x in setup.stderr.splitlines() if "C++ compiler" in x
    ]
    assert not files_under(ext)


def offload_train(data: Path, cwd: Path, out: str, *extra: str, env: dict, check: bool = True):
    """2 steps of the tiny BERT under ZeRO-3 with the optimizer offloaded (DeepSpeedCPUAdam)."""
    return plm("train", BERT, f"data.path={data}", f"train.out_dir={cwd / out}", OFFLOAD,
               "train.max_steps=2", "train.eval_every=0", "train.save_every=0",
               "mlflow.register=false", *extra, cwd=cwd, env=env, check=check)  # fmt: skip


@pytest.mark.slow
def test_cpu_adam_is_built_once_announced_then_cached(tiny_data, tmp_path):
    """A real build of the op into an empty cache: `--dry-run` says the run would build it,
    the run says so in one plm: line and trains; then the dry run says cached, a second run
    says nothing and builds nothing, and `plm setup` finds it up to date (and builds the
    shm op, announced)."""
    ext = tmp_path / "ext"
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    dry = offload_train(tiny_data, tmp_path, "dry", "--dry-run", env=env)
    assert "c++ ops         cpu_adam: the run builds it first, once for this venv" in dry.stdout
    assert not files_under(ext)

    first = offload_train(tiny_data, tmp_path, "first", env=env)
    built = [x for x in first.stderr.splitlines() if x.startswith("plm:")]
    assert len(built) == 1 and built[0].startswith(ADAM_BUILD), first.stderr[-4000:]
    assert "needs g++ and Python headers" in built[0] and str(ext) in built[0]
    assert "Traceback" not in first.stderr
    library = ext / "cpu_adam" / "cpu_adam.so"
    assert library.is_file() and (tmp_path / "first" / "checkpoints" / "latest").exists()
    built_at = library.stat().st_mtime_ns

    dry = offload_train(tiny_data, tmp_path, "dry", "--dry-run", env=env)
    assert f"c++ ops         cpu_adam: cached ({library})" in dry.stdout
    again = offload_train(tiny_data, tmp_path, "again", env=env)
    assert "plm:" not in again.stderr and "Traceback" not in again.stderr
    assert library.stat().st_mtime_ns == built_at

    setup = plm("setup", cwd=tmp_path, env=env)
    assert f"(cpu_adam) up to date: {library}" in setup.stdout
    assert "(deepspeed_shm_comm) built in" in setup.stdout
    assert (ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()


@pytest.mark.slow
def test_cpu_adam_without_a_compiler_is_one_plm_line_and_exit_2(tiny_data, tmp_path):
    """ZeRO-Offload on a machine whose compiler is missing (CXX points nowhere) and whose
    cache lacks the op: the dry run and the run stop with the same plm: line (what is
    missing, `plm setup`, a config without offload), no traceback, nothing built."""
    ext = tmp_path / "ext"
    env = {"TORCH_EXTENSIONS_DIR": str(ext), "CXX": "/nonexistent/g++"}
    said = []
    for extra in (["--dry-run"], []):
        proc = offload_train(tiny_data, tmp_path, "run", *extra, env=env, check=False)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "Traceback" not in proc.stderr
        lines = [x for x in proc.stderr.splitlines() if x.startswith("plm:")]
        assert len(lines) == 1, proc.stderr[-4000:]
        said.append(lines[0])
    assert said[0] == said[1]
    assert said[0].startswith("plm: DeepSpeed's CPU Adam op (cpu_adam, the optimizer of ZeRO")
    assert "cannot be built here: missing a C++ compiler (CXX=/nonexistent/g++" in said[0]
    assert "`plm setup`" in said[0] and "deepspeed=configs/deepspeed/zero3.json" in said[0]
    assert not files_under(ext)

    # 2 ranks on the machine: the same line once (local rank 0), not once per rank
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", str(free_port()), "--module", "pipeline.cli", "train", BERT,
           f"data.path={tiny_data}", f"train.out_dir={tmp_path / 'two'}", OFFLOAD,
           "train.max_steps=2", "mlflow.register=false"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert [x for x in out.splitlines() if x.startswith("plm:")] == [said[0]], out[-4000:]
    assert "Traceback" not in out and not files_under(ext)
