"""launch/deepspeed_train.py keeps MLflow's secrets off the pdsh command line, as it keeps
the AWS keys out of the env file it forwards (the rest of its tests:
tests/integration/test_launch_scripts.py)."""

from __future__ import annotations

import pytest
from conftest import load_launch_script

ds = load_launch_script("deepspeed_train")
CFG = "configs/experiments/bert-base.yaml"
SECRET = "hunter2-hunter2-hunter2"


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """main() in a clean folder and home with a two-host hostfile; the runner (and the dry
    run) recorded, never started."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "hostfile").write_text("worker-1 slots=2\nworker-2 slots=2\n")
    started = []

    class Done:
        returncode = 0

    monkeypatch.setattr(ds.subprocess, "run", lambda cmd, **kw: started.append((cmd, kw)) or Done)

    def run(*extra: str) -> tuple[int, list]:
        code = ds.main(["--hostfile", "hostfile", "--skip-dry-run", *extra, CFG])
        return code, started

    return run


@pytest.mark.parametrize("var", ["MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"])
def test_an_mlflow_secret_stops_a_launch_over_pdsh(launch, monkeypatch, capsys, var):
    monkeypatch.setenv(var, SECRET)
    code, started = launch()
    err = capsys.readouterr().err
    assert code == 2 and started == []
    assert err.count("\n") == 1 and err.startswith(f"plm: {var} set: DeepSpeed's pdsh"), err
    assert "MLFLOW_TRACKING_PASSWORD_FILE" in err and SECRET not in err


def test_a_deepspeed_env_line_or_a_uri_with_a_password_stops_it_too(launch, tmp_path,
                                                                    monkeypatch, capsys):  # fmt: skip
    (tmp_path / ".deepspeed_env").write_text(f"MLFLOW_TRACKING_PASSWORD={SECRET}\n")
    assert launch()[0] == 2
    assert capsys.readouterr().err.startswith("plm: MLFLOW_TRACKING_PASSWORD set")
    (tmp_path / ".deepspeed_env").unlink()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bert-job:{SECRET}@mlflow:5000")
    code, started = launch()
    err = capsys.readouterr().err
    assert code == 2 and started == [] and err.startswith("plm: MLFLOW_TRACKING_URI set")
    assert SECRET not in err


def test_a_password_file_travels_and_the_password_is_fine_without_pdsh(launch, tmp_path,
                                                                      monkeypatch, capsys):  # fmt: skip
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bert-job")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD_FILE", str(tmp_path / "mlflow-password"))
    code, started = launch()
    assert code == 0 and len(started) == 1  # the runner, with the path only
    assert "MLFLOW_TRACKING_PASSWORD" not in started[0][1]["env"]
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    # Each node's own launch (--no-ssh), or one host (DeepSpeed runs it locally): no pdsh.
    no_ssh = ["--no-ssh", "--node-rank", "0", "--master-addr", "worker-1"]
    assert launch(*no_ssh)[0] == 0
    assert launch("--num-nodes", "1")[0] == 0
    assert "plm:" not in capsys.readouterr().err
