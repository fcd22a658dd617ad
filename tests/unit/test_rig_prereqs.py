"""What `plm rig up` checks before it makes anything (no root, namespaces or cgroups needed):
every missing program named at once with the one `apt-get install` line; --mem-per-host's
sizes; a cgroup v2 host's files read as v1's are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_plm_line

from pipeline import rig as rigmod

APT = "apt-get install -y iproute2 util-linux mount openssh-server openssh-client pdsh"


def test_every_missing_program_is_named_at_once_with_one_apt_line(tmp_path):
    why = rigmod.check_prerequisites(ssh=True, path=str(tmp_path))  # a PATH with nothing
    for tool in ("`ip`", "`unshare`", "`nsenter`", "`sshd`", "`ssh`", "`pdsh`"):
        assert tool in why
    assert why.count("apt-get") == 1 and why.endswith(APT)
    # Without ssh the hosts need no sshd, ssh client or pdsh.
    for tool in ("ip", "unshare", "nsenter", "mount"):
        (tmp_path / tool).symlink_to("/bin/true")
    assert rigmod.missing_tools(ssh=False, path=str(tmp_path)) == {}
    assert set(rigmod.missing_tools(ssh=True, path=str(tmp_path))) == {
        "sshd", "ssh", "ssh-keygen", "pdsh"}  # fmt: skip


def test_plm_rig_up_without_the_programs_is_one_plm_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "rig", "up", "--root",
                           str(tmp_path / "rigs")], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    line = one_plm_line(proc)
    assert line.startswith("plm: rig: the rig needs") and line.endswith(APT)
    assert "`pdsh` (pdsh)" in line and "`ssh` (openssh-client)" in line
    assert not (tmp_path / "rigs").exists()  # nothing made


@pytest.mark.parametrize(
    "text, size",
    [("4.5G", 4608 << 20), ("800M", 800 << 20), ("512k", 512 << 10), ("2Gi", 2 << 30),
     ("1GB", 1 << 30), ("1048576", 1 << 20)],
)  # fmt: skip
def test_mem_per_host_sizes(text, size):
    assert rigmod.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "4.5X", "G", "-1G", "0"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(rigmod.RigError, match="give a size such as 4.5G"):
        rigmod.parse_size(text)


def test_a_cap_below_the_minimum_is_refused():
    with pytest.raises(rigmod.RigError, match="at least 32M"):
        rigmod._plan_memory("8M")


def test_cgroup_v2_files_read_as_v1s(tmp_path):
    """A v2 host's cgroup (memory.max, .current, .peak, .events), written as the kernel
    writes them: the same five numbers as on v1; ``max`` is no limit."""
    files = {"memory.max": "268435456\n", "memory.current": "1314816\n",
             "memory.peak": "268435456\n",
             "memory.events": "low 0\nhigh 0\nmax 41\noom 2\noom_kill 2\noom_group_kill 0\n"}  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cg = rigmod.MemoryCgroup(tmp_path, 2)
    assert cg.stats() == {"limit": 256 << 20, "usage": 1314816, "peak": 256 << 20,
                          "failcnt": 41, "oom_kills": 2}  # fmt: skip
    (tmp_path / "memory.max").write_text("max\n")
    assert cg.stats()["limit"] is None
