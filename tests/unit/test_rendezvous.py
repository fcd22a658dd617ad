"""Rank 0's rendezvous socket (pipeline/train/rendezvous.py) and tests/listeners.py.

Nothing here sends a packet anywhere: binding to an address this host lacks fails locally
(EADDRNOTAVAIL), and every socket that listens is on loopback."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest
from conftest import REPO, one_plm_line, plm
from listeners import WILDCARDS, listeners_of

from pipeline.errors import ConfigError
from pipeline.train import rendezvous

NOT_HERE = "198.18.0.250"  # the rehearsal rig's range; not assigned on this machine


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_an_address_this_host_lacks_is_one_config_error_naming_it():
    with pytest.raises(ConfigError) as err:
        rendezvous.listen(NOT_HERE, 29555)
    text = str(err.value)
    assert f"MASTER_ADDR={NOT_HERE} is not an address of this host" in text
    assert "MASTER_PORT=29555" in text and "set MASTER_ADDR" in text


@pytest.mark.parametrize("holder", ["127.0.0.2", "0.0.0.0"])
def test_a_taken_port_is_one_config_error_naming_it(holder):
    with socket.socket() as taken:
        taken.bind((holder, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            rendezvous.listen("127.0.0.2", port)
    text = str(err.value)
    assert f"MASTER_PORT={port} is taken on MASTER_ADDR=127.0.0.2" in text
    assert "--master_port" in text


@pytest.mark.parametrize("addr", ["127.0.0.2", "localhost", "[::1]"])
def test_rank_0_listens_on_master_addr_only(addr, monkeypatch):
    if "::1" in addr and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", addr)
    monkeypatch.setenv("MASTER_PORT", str(port))
    host, port = rendezvous.master_addr_port()
    with rendezvous.listen(host, port) as sock:
        bound = sock.getsockname()[0]
        assert bound not in WILDCARDS
        assert (bound, port, os.getpid()) in listeners_of([os.getpid()])
    assert rendezvous.local_address(host, port) == bound


def test_unset_or_malformed_master_env_is_a_config_error(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError, match="MASTER_ADDR=\\(unset\\)"):
        rendezvous.master_addr_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(ConfigError, match="MASTER_PORT=70000 is not a TCP port"):
        rendezvous.master_addr_port()


def test_listeners_of_matches_ss():
    """The /proc reading agrees with `ss -ltnpH` on addresses, ports and the pid."""
    pid = os.getpid()
    socks = []
    for family, addr in [(socket.AF_INET, "127.0.0.2"), (socket.AF_INET, "0.0.0.0")] + (
        [(socket.AF_INET6, "::1"), (socket.AF_INET6, "::")] if _has_ipv6_loopback() else []
    ):
        s = socket.socket(family)
        s.bind((addr, 0))
        s.listen()
        socks.append(s)
    try:
        mine = {(a, p) for a, p, q in listeners_of([pid]) if q == pid}
        wanted = {s.getsockname()[:2] for s in socks}
        assert wanted <= mine
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        from_ss = set()
        for line in out.splitlines():
            if f"pid={pid}," not in line:
                continue
            local = line.split()[3]  # 127.0.0.2:PORT, [::1]:PORT, 0.0.0.0:PORT, *:PORT
            host, port = local.rsplit(":", 1)
            from_ss.add((host.strip("[]").replace("*", "::"), int(port)))
        assert wanted <= from_ss
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow  # a `plm` process: imports DeepSpeed (5 s)
def test_plm_train_with_a_master_addr_not_here_prints_one_line(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": NOT_HERE,
           "MASTER_PORT": "29555"}  # fmt: skip
    proc = plm("train", str(REPO / "configs/test/bert-tiny.yaml"), "data.path=/nonexistent",
               f"train.out_dir={tmp_path / 'run'}", cwd=tmp_path, env=env, check=False)  # fmt: skip
    line = one_plm_line(proc)
    assert f"MASTER_ADDR={NOT_HERE} is not an address of this host" in line
