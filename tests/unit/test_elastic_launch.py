"""The elastic launch's checks (launch/elastic_train.py), train.global_batch, and how a
fault between ranks is reported (pipeline/train/faults.py): one line naming the rank and
host, never a traceback; ranks running other software or with a skewed clock refused."""

from __future__ import annotations

import importlib.util
import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO

from pipeline.config import load_config, with_global_batch
from pipeline.errors import ConfigError
from pipeline.train import faults

BERT = str(REPO / "configs/test/bert-tiny.yaml")


def launcher():
    spec = importlib.util.spec_from_file_location("elastic_train", REPO / "launch/elastic_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_global_batch_sets_grad_accum_for_each_world_size():
    cfg = load_config(BERT, ["train.global_batch=48"])  # micro 8
    assert with_global_batch(cfg, 2).train.grad_accum == 3
    assert with_global_batch(cfg, 3).train.grad_accum == 2
    assert with_global_batch(cfg, 6).train.grad_accum == 1
    with pytest.raises(ConfigError, match=r"train.global_batch=48 .* fits 1, 2, 3, 6 ranks"):
        with_global_batch(cfg, 4)
    plain = load_config(BERT, [])
    assert with_global_batch(plain, 4) is plain  # unset: grad_accum as given


def test_the_launch_builds_torchrun_from_its_flags_or_the_operators_env(monkeypatch, capsys):
    launch = launcher()
    args = [BERT, "train.global_batch=48", "--print-only"]
    assert launch.main(["--nnodes", "2:3", "--rdzv-endpoint", "node0:29400", *args]) == 0
    cmd = capsys.readouterr().out
    for part in ("--nnodes=2:3", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400",
                 "keep_alive_interval=3", "-m pipeline.cli train"):  # fmt: skip
        assert part in cmd, cmd
    monkeypatch.setenv("PET_NNODES", "1:4")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "job-worker-0:29400")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    assert launch.main([BERT, "train.global_batch=192", "--print-only"]) == 0
    cmd = capsys.readouterr().out
    assert "--nnodes=1:4" in cmd and "--nproc-per-node=2" in cmd
    assert "job-worker-0:29400" in cmd


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "3:2"], "need 1 <= MIN <= MAX"),
        (["--nnodes", "two"], "expected MIN:MAX"),
        (["--nnodes", "2:3"], "pass train.global_batch=48 (any multiple of 48)"),
        (["--nnodes", "2:3", "train.global_batch=48", "train.resume=never"], "resumes from"),
        (["--nnodes", "2:3", "train.global_batch=48", "train.save_every=0"], "needs checkpoints"),
        (["--nnodes", "2:3", "train.lr=-1"], "train.lr"),
    ],
)
def test_a_launch_that_cannot_work_is_one_plm_line(argv, message, capsys):
    launch = launcher()
    code = launch.main([BERT, "--rdzv-endpoint", "node0:29400", "--print-only", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("plm: elastic_train: ") and message in err, err
    assert "Traceback" not in err


def test_a_broken_peer_connection_is_one_line_naming_rank_host_and_peer():
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[198.18.0.3]:2209: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application."
    )
    fault = faults.peer_fault(gloo, rank=1, step=21, timeout_s=20)
    text = str(fault)
    assert f"rank 1 on {socket.gethostname()} at step 21" in text
    assert "peer 198.18.0.3" in text and "Connection reset by peer" in text
    assert "pair.cc" not in text and "\n" not in text and "typically" not in text
    timeout = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "20000ms for recv operation to complete"
    )
    assert "train.collective_timeout_s=20 s" in str(faults.peer_fault(timeout, 0, 5, 20))
    assert faults.peer_fault(RuntimeError("shape mismatch"), 0, 1, 20) is None
    assert faults.peer_fault(ValueError("gloo"), 0, 1, 20) is None


def _check_peers_rank(rank: int, port: int, fake: str, result) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 1 and fake == "torch":
        real = faults.software
        faults.software = lambda: {**real(), "torch": "0.0.1"}
    if rank == 1 and fake == "clock":
        import time

        real_time = time.time
        time.time = lambda: real_time() + 100.0
    try:
        faults.check_peers(max_clock_skew_s=30)
        result[rank] = "ok"
    except ConfigError as err:
        result[rank] = str(err)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fake", "expected"),
    [
        ("none", None),
        ("torch", "rank 1 on {host} runs torch 0.0.1 (rank 0: "),
        ("clock", "rank 1 on {host} has a clock +10"),
    ],
)
def test_ranks_with_other_software_or_a_skewed_clock_are_refused(fake, expected):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = mp.get_context("spawn").Manager().dict()
    mp.start_processes(
        _check_peers_rank, args=(_free_port(), fake, result), nprocs=2, start_method="spawn"
    )
    if expected is None:
        assert dict(result) == {0: "ok", 1: "ok"}
        return
    want = expected.format(host=socket.gethostname())
    # Every rank sees the same verdict (rank 0 prints it under `plm train`).
    assert result[0] == result[1] and want in result[0], dict(result)


def _silent_peer_rank(rank: int, port: int, result) -> None:
    import time

    import torch

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))  # fmt: skip
    if rank == 1:  # a host gone silent: it never joins the collective
        time.sleep(8)
        result[1] = "slept"
        return
    try:
        dist.all_reduce(torch.ones(4))
        result[0] = "no error"
    except Exception as err:  # what gloo raises, turned into the one line
        fault = faults.peer_fault(err, 0, 7, 2)
        result[0] = str(fault) if fault is not None else f"not recognised: {err}"


@pytest.mark.slow
def test_a_collective_timeout_from_gloo_is_one_line():
    """A real gloo all-reduce whose peer never comes: the error gloo raises after the
    group's timeout becomes the one line naming the rank, its host and the setting."""
    result = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_silent_peer_rank, args=(_free_port(), result), nprocs=2,
                       start_method="spawn")  # fmt: skip
    text = result[0]
    assert text.startswith(f"rank 0 on {socket.gethostname()} at step 7: a collective waited "
                           "train.collective_timeout_s=2 s"), text  # fmt: skip
    assert "\n" not in text and ".cc:" not in text


@pytest.mark.slow
def test_a_rank_that_cannot_reach_the_rendezvous_is_one_line(tmp_path):
    """`plm train` as rank 1 of 2 with nobody at MASTER_ADDR:MASTER_PORT: one `plm:` line
    naming the rank, the host and the address, exit 4, no traceback."""
    import subprocess
    import sys

    port = _free_port()
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", BERT, "train.collective_timeout_s=3",
         f"train.out_dir={tmp_path / 'run'}", "data.path=unused"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"rank 1 on {socket.gethostname()} cannot reach the rendezvous store" in lines[0]
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in lines[0]


@pytest.mark.slow
def test_torchrun_restarts_with_the_agents_shared_store_are_refused(tmp_path):
    """`torchrun --max-restarts N` without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the ranks
    would read a failed round's addresses from the store the agents share; one `plm:`
    line says what to set, exit 2, before any rank waits for another."""
    import subprocess
    import sys

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", BERT, f"train.out_dir={tmp_path / 'r'}",
         "data.path=unused"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0]
    assert "Traceback" not in proc.stderr
