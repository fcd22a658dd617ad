"""launch/deepspeed_train.py and launch/ray_submit.py, in-process: hostfile checks, the
environment the remote ranks get, the exact launcher command lines, the job entrypoints."""

from __future__ import annotations

import pytest
from conftest import REPO, load_launch_script

ds = load_launch_script("deepspeed_train")
ray_submit = load_launch_script("ray_submit")


def test_hostfile_is_parsed_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "hostfile"
    good.write_text("# two nodes\nworker-1 slots=8\n\nworker-2 slots=4\n")
    assert ds.parse_hostfile(good) == {"worker-1": 8, "worker-2": 4}
    assert ds.world_size({"worker-1": 8, "worker-2": 4}, None, None) == 12
    assert ds.world_size({"worker-1": 8, "worker-2": 4}, 2, None) == 4  # --num-gpus caps
    assert ds.world_size({"worker-1": 8, "worker-2": 4}, None, 1) == 8  # --num-nodes
    bad = tmp_path / "bad"
    bad.write_text("worker-1 slots=8\nworker-2 gpus=8\n")
    with pytest.raises(ds.LaunchError, match=r"bad:2: expected `HOST slots=N`"):
        ds.parse_hostfile(bad)
    bad.write_text("worker-1 slots=8\nworker-1 slots=8\n")
    with pytest.raises(ds.LaunchError, match="listed twice"):
        ds.parse_hostfile(bad)
    with pytest.raises(ds.LaunchError, match="does not exist"):
        ds.parse_hostfile(tmp_path / "missing")


def test_exported_env_keeps_secrets_out():
    env = {
        "DS_ACCELERATOR": "cpu", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PLM_X": "1",
        "AWS_SECRET_ACCESS_KEY": "s", "PLM_API_TOKEN": "t", "HOME": "/root", "PLM_KEY": "k",
    }  # fmt: skip
    out = ds.exported_env(env, list(ds.DEFAULT_EXPORTS))
    assert out == {"DS_ACCELERATOR": "cpu", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PLM_X": "1"}


def test_env_file_keeps_the_users_lines_first(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5\n")
    (cwd / ".deepspeed_env").write_text("OMP_NUM_THREADS=4\n")
    out = ds.write_env_file(tmp_path / "env", cwd, {"OMP_NUM_THREADS": "8", "PLM_A": "b"})
    lines = out.read_text().splitlines()
    # Every line is KEY=VALUE (DeepSpeed's runner splits each line at the first "=").
    assert lines == ["NCCL_IB_HCA=mlx5", "OMP_NUM_THREADS=4", "PLM_A=b"]


def test_print_only_gives_the_deepspeed_command_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("worker-1 slots=8\nworker-2 slots=8\n")
    cfg = "configs/experiments/bert-base.yaml"
    assert ds.main(["--hostfile", "hostfile", "--print-only", cfg, "train.max_steps=10"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == (
        "deepspeed --hostfile hostfile --master_port 29500 --module pipeline.cli train "
        f"{cfg} train.max_steps=10"
    )
    assert "environment for the remote ranks" in out.err
    argv = ["--hostfile", "hostfile", "--no-ssh", "--node-rank", "1", "--master-addr", "10.0.0.1",
            "--print-only", cfg]  # fmt: skip
    assert ds.main(argv) == 0
    assert capsys.readouterr().out.strip() == (
        "deepspeed --hostfile hostfile --master_port 29500 --master_addr 10.0.0.1 --no_ssh "
        f"--node_rank 1 --module pipeline.cli train {cfg}"
    )
    assert ds.main([*argv[:4], "2", *argv[5:]]) == 2  # node rank outside the hostfile
    assert "outside the hostfile's 2 hosts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ds.main(["--no-ssh", "--hostfile", "hostfile", cfg])  # needs --node-rank, --master-addr


def test_a_bad_config_stops_the_launch_before_deepspeed(tmp_path, capsys):
    argv = ["--num-gpus", "2", str(REPO / "configs/test/bert-tiny.yaml"), "train.max_stepz=3"]
    assert ds.main(argv) == 2
    err = capsys.readouterr().err
    assert "plm train --dry-run` refused the run" in err and "max_stepz" in err


def test_ray_submit_entrypoints():
    assert ray_submit.entrypoint_argv("tokenizer", True, ["--input", "x"]) == [
        "plm", "data", "tokenizer", "--input", "x"
    ]  # fmt: skip
    shipped = ["python", "-m", "pipeline.cli", "data", "prepare"]  # the working_dir's code
    assert ray_submit.entrypoint_argv("prepare", False, []) == shipped
    env = ray_submit.build_runtime_env(False, {"A": "1"})
    assert env["env_vars"] == {"PYTHONUNBUFFERED": "1", "A": "1"}
    assert "/runs" in env["excludes"] and env["working_dir"] == str(REPO)
    args = ray_submit.parse_args(["--address", "http://h:8265", "--stage", "tokenizer", "--env",
                                  "X=1=2", "--", "--kind", "bpe"])  # fmt: skip
    assert args.stage == "tokenizer" and args.env_vars == {"X": "1=2"}
    with pytest.raises(SystemExit):
        ray_submit.parse_args(["--address", "http://h:8265", "--env", "NOEQUALS", "--", "x"])


def test_ray_submit_leaves_out_what_git_ignores(tmp_path):
    """A folder git ignores through .git/info/exclude (Ray reads .gitignore only) is not
    shipped in the working_dir; tracked code is."""
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "x.py").write_text("")
    (tmp_path / "Stray" / "deep").mkdir(parents=True)
    (tmp_path / "Stray" / "deep" / "big.bin").write_bytes(b"x")
    (tmp_path / ".git" / "info" / "exclude").write_text("/Stray/\n")
    assert ray_submit.git_ignored(tmp_path) == ["/Stray/"]
    assert ray_submit.git_ignored(tmp_path / "pipeline" / "nowhere") == []
    env = ray_submit.build_runtime_env(False)
    assert set(ray_submit.EXCLUDES) <= set(env["excludes"])


def test_data_dry_runs_validate_and_start_nothing(tiny_data, tmp_path, capsys):
    from pipeline.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("One document here.\n\nAnother one there.\n")
    tok_args = ["data", "tokenizer", "--input", str(corpus), "--kind", "bpe",
                "--vocab-size", "300", "--output", str(tmp_path / "tok"), "--dry-run"]  # fmt: skip
    assert main(tok_args) == 0
    assert "nothing started" in capsys.readouterr().out and not (tmp_path / "tok").exists()
    prep = ["data", "prepare", "--input", str(corpus), "--tokenizer", str(tiny_data / "tokenizer"),
            "--output", str(tmp_path / "out"), "--shard-docs", "10", "--dry-run"]  # fmt: skip
    assert main(prep) == 0
    out = capsys.readouterr().out
    assert "10 documents per shard" in out and "local Ray" in out
    assert not (tmp_path / "out").exists()
    # The errors the real run would give, before any Ray starts.
    assert main([*prep[:5], str(tmp_path / "no-tok"), *prep[6:]]) == 2
    assert "no-tok does not exist" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert main(prep) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert main([*tok_args[:3], str(tmp_path / "missing.txt"), *tok_args[4:]]) == 2
    assert "missing.txt" in capsys.readouterr().err
