"""The rehearsal cluster itself: hosts that share no network stack, /tmp, /dev/shm or local
disk; by default nothing writable at all but the bucket (the machine's files read-only,
files copied onto a host with `plm rig cp`), with `--shared` one shared directory; ssh and
pdsh between them, an S3 server on node0, a `down` that
stops only what the rig started; hosts with their own memory (a cgroup each: an OOM kill
reported, the peak read) and `plm rig kill HOST`."""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_util import on, small_rig
from conftest import one_plm_line

from pipeline import rig as rigmod

pytestmark = [pytest.mark.cluster]


def test_hosts_have_their_own_network_names_and_disks(rig):
    net = ipaddress.ip_network(rig.subnet)
    for h in rig.hosts:
        assert on(rig, h.name, ["hostname"]).stdout.strip() == h.name
        addrs = json.loads(on(rig, h.name, ["ip", "-j", "addr", "show"]).stdout)
        v4 = {(a["ifname"], i["local"]) for a in addrs for i in a["addr_info"]
              if i["family"] == "inet"}  # fmt: skip
        assert v4 == {("lo", "127.0.0.1"), ("eth0", h.address)}
        assert not any(i["family"] == "inet6" for a in addrs if a["ifname"] == "eth0"
                       for i in a["addr_info"])  # fmt: skip
        # One route: the bridge's subnet, on-link. No default route: nothing leaves.
        routes = json.loads(on(rig, h.name, ["ip", "-j", "route", "show"]).stdout)
        assert [ipaddress.ip_network(r["dst"]) for r in routes] == [net]
        # Names resolve to the rig's addresses on every host (gloo and ssh need it).
        hosts = on(rig, h.name, ["getent", "hosts", "node1"]).stdout.split()
        assert hosts[0] == rig.host("node1").address
    # Private /tmp and local disk.
    on(rig, "node1", ["sh", "-c", "echo one > /tmp/mine && echo one > /mnt/local/mine"])
    for path in ("/tmp/mine", "/mnt/local/mine"):
        assert on(rig, "node2", ["test", "-e", path], check=False).returncode == 1
        assert on(rig, "node1", ["cat", path]).stdout == "one\n"
        assert not os.path.exists(path)  # nor on the laptop
    # The other hosts' private dirs are out of sight.
    hosts_dir = f"{rig.root}/hosts"
    assert on(rig, "node2", ["ls", "-A", hosts_dir]).stdout == ""
    assert sorted(os.listdir(hosts_dir)) == ["node0", "node1", "node2"]


def test_ssh_between_hosts_and_pdsh(rig):
    out = on(rig, "node0", ["ssh", "node2", "hostname; cat /tmp/mine 2>/dev/null || true"])
    assert out.stdout.strip() == "node2"
    # Plain pdsh speaks ssh (PDSH_RCMD_TYPE=ssh on the hosts), in an ssh session too.
    out = on(rig, "node0", ["pdsh", "-w", "node1,node2", "hostname"])
    assert sorted(out.stdout.splitlines()) == ["node1: node1", "node2: node2"]
    out = on(rig, "node0", ["ssh", "node1", "pdsh -w node2 hostname"])
    assert out.stdout.splitlines() == ["node2: node2"]


def test_s3_server_on_node0_reached_with_the_standard_variables(rig):
    """The laptop writes through pyarrow with the AWS_* variables of `plm rig env`; node2
    reads it back with only the rig's ~/.aws keys and AWS_ENDPOINT_URL."""
    assert rig.s3_endpoint == f"http://{rig.hosts[0].address}:{rigmod.S3_PORT}"
    code = (
        "import pyarrow.fs as f, sys; fs, p = f.FileSystem.from_uri(sys.argv[1]); "
        "print(fs.open_input_file(p).read().decode()) if sys.argv[2] == 'r' else "
        "fs.open_output_stream(p).write(b'from the laptop') or None"
    )
    uri = f"s3://{rigmod.S3_BUCKET}/rig-test/hello.txt"
    env = {**os.environ, **rig.env()}
    subprocess.run([sys.executable, "-c", code, uri, "w"], env=env, check=True)
    host_env = {"AWS_ENDPOINT_URL": rig.s3_endpoint}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        host_env[key] = ""  # not from the environment: the host's ~/.aws/credentials
    out = on(rig, "node2", ["env", "-u", "AWS_ACCESS_KEY_ID", "-u", "AWS_SECRET_ACCESS_KEY",
                            sys.executable, "-c", code, uri, "r"])  # fmt: skip
    assert out.stdout.strip() == "from the laptop"


def test_down_stops_only_what_the_rig_started():
    name = f"d{os.getpid()}"
    small = small_rig(name, 1, s3=False, ssh=False, mem_per_host="64M", shared=True)
    outside = subprocess.Popen(["sleep", "300"])  # the same program, not the rig's
    try:
        # `up --shared`: the shared dir, written on the host, read on the laptop
        on(small, "node0", ["sh", "-c", f"echo shared > {small.shared}/note"])
        assert (small.shared / "note").read_text() == "shared\n"
        inside = small.popen("node0", ["sleep", "300"], cwd="/")
        for _ in range(200):  # until nsenter has entered the namespace (then execs sleep)
            if inside.pid in small.pids("node0"):
                break
            time.sleep(0.05)
        assert inside.pid in small.pids("node0")
        assert outside.pid not in small.pids("node0")
        cgroup = Path(small.host("node0").cgroup)
        assert inside.pid in rigmod.MemoryCgroup(cgroup, small.cgroup_version).pids()
        stopped = rigmod.down(name)
        assert inside.pid in stopped and outside.pid not in stopped
        assert inside.wait(timeout=10) == -15  # SIGTERM
        assert outside.poll() is None
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"plm-{name}-" not in netns
        links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
        assert f"plm{name}br" not in links and not os.path.exists(small.root)
        assert not cgroup.exists() and not cgroup.parent.exists()  # the rig's cgroups too
    finally:
        outside.kill()
        rigmod.down(name)


@pytest.mark.parametrize(
    "subnet, words",
    [("10.0.0.0/24", "only addresses in 198.18.0.0/24"),
     ("198.18.0.0/30", "holds 2 addresses"), ("198.18.1.0/24", "only addresses in")],
)  # fmt: skip
def test_the_rig_refuses_addresses_outside_its_range(subnet, words):
    with pytest.raises(rigmod.RigError, match=words):
        rigmod._plan_addresses(subnet, 3)


def test_the_cli_runs_a_command_on_a_host_and_passes_its_status_on(rig):
    """`plm rig exec NAME HOST -- CMD` as a user types it; `plm rig env` for the laptop."""
    base = [sys.executable, "-m", "pipeline.cli", "rig"]
    where = ["--name", rig.name, "--root", str(Path(rig.root).parent)]
    done = subprocess.run([*base, "exec", *where, "node1", "--", "sh", "-c", "hostname; exit 3"],
                          capture_output=True, text=True, cwd="/")  # fmt: skip
    assert done.returncode == 3 and done.stdout.strip() == "node1", done.stderr
    env = subprocess.run([*base, "env", *where], capture_output=True, text=True, check=True)
    assert f"export AWS_ENDPOINT_URL={rig.s3_endpoint}" in env.stdout.splitlines()
    missing = subprocess.run([*base, "exec", *where, "node9", "--", "true"],
                             capture_output=True, text=True, cwd="/")  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("plm: rig: ") and "node9" in missing.stderr


@pytest.mark.parametrize("name", ["bad-name", "toolongname", ""])
def test_a_rig_name_that_cannot_prefix_interface_names_is_refused(name):
    with pytest.raises(rigmod.RigError, match="letters or digits"):
        rigmod.up(1, name=name)


# --- hosts with their own memory, and a lost host ------------------------------------------

CAP = 256 << 20
ALLOC = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096])"


@pytest.fixture(scope="module")
def capped():
    """2 hosts of 256M each, with sshd, no S3 server: one rig for the module's memory tests."""
    name = f"m{os.getpid()}"
    made = small_rig(name, 2, s3=False, mem_per_host="256M")
    try:
        yield made
    finally:
        rigmod.down(name)


def cli(rig: rigmod.Rig, *args: str) -> subprocess.CompletedProcess:
    """`plm rig CMD --name NAME --root ROOT ARGS...` as a user types it."""
    cmd, *rest = args
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "rig", cmd, "--name", rig.name,
                           "--root", str(Path(rig.root).parent), *rest],
                          capture_output=True, text=True, cwd="/", timeout=120)  # fmt: skip


def test_every_process_of_a_capped_host_is_in_its_cgroup(capped):
    for h in capped.hosts:
        cg = rigmod.MemoryCgroup(h.cgroup, capped.cgroup_version)
        assert capped.memory(h.name)["limit"] == CAP
        # The holder and sshd, and nothing of the host outside the cgroup (a process that
        # exits between the two listings is not an outsider: read both again, a few times).
        assert {h.holder, *h.services} <= set(cg.pids())
        for _ in range(10):
            netns = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True,
                                   text=True, check=True).stdout.split()  # fmt: skip
            outside = {int(p) for p in netns} - set(cg.pids())
            if not outside:
                break
            time.sleep(0.3)
        assert not outside, [Path(f"/proc/{p}/cmdline").read_bytes() for p in outside
                             if Path(f"/proc/{p}").exists()]  # fmt: skip
    # What exec and an ssh session start (sshd's children) are in the host's cgroup.
    want = f"{Path(capped.cgroup_root).name}/node1"
    mine = on(capped, "node1", ["cat", "/proc/self/cgroup"]).stdout
    remote = on(capped, "node0", ["ssh", "node1", "cat /proc/self/cgroup"]).stdout
    assert want in mine and want in remote


def test_over_the_cap_is_killed_and_reported_under_it_passes_with_its_peak(capped):
    before = capped.memory("node1")["oom_kills"]
    over = cli(capped, "exec", "node1", "--", sys.executable, "-c", ALLOC, "400")
    assert over.returncode == 137  # SIGKILL, passed on as a shell does
    line = one_plm_line(over, 137)
    assert "node1" in line and "256M" in line and "killed for memory" in line
    assert "bytearray" in line and "exit 137" in line
    assert capped.memory("node1")["oom_kills"] == before + 1
    # A kill on another host, from an ssh session of a command on node0: named too.
    remote = cli(capped, "exec", "node0", "--", "ssh", "node1", sys.executable, "-c",
                 shlex.quote(ALLOC), "400")  # fmt: skip
    assert remote.returncode != 0
    line = one_plm_line(remote, remote.returncode)
    assert "on node1" in line and "ran on node0" in line
    # Under the cap: it passes, no plm: line, and the peak is the host's while it ran.
    under = cli(capped, "exec", "--peak", "node1", "--", sys.executable, "-c", ALLOC, "100")
    assert under.returncode == 0 and "plm:" not in under.stderr, under.stderr
    peak = [x for x in under.stderr.splitlines() if x.startswith("rig: node1 peak memory")]
    assert len(peak) == 1 and "of its 256M cap" in peak[0], under.stderr
    # The API: the peak since reset_peak, within the cap and above what was touched.
    assert capped.reset_peak("node1")
    reset = capped.memory("node1")["peak"]
    assert reset < CAP  # it was the cap, from the kills above
    on(capped, "node1", [sys.executable, "-c", ALLOC, "120"])
    m = capped.memory("node1")
    assert max(reset, 120 << 20) <= m["peak"] <= CAP and m["usage"] < m["peak"]


def test_kill_stops_a_hosts_processes_by_pid_and_keeps_the_host(capped):
    outside = subprocess.Popen(["sleep", "300"])  # the same program, not the host's
    try:
        inside = capped.popen("node1", ["sleep", "300"], cwd="/")
        on(capped, "node0", ["ssh", "-f", "node1", "sleep 301 >/dev/null 2>&1 &"])
        for _ in range(200):
            if inside.pid in capped.pids("node1"):
                break
            time.sleep(0.05)
        h = capped.host("node1")
        theirs = set(capped.pids("node1")) - {h.holder, *h.services}
        assert inside.pid in theirs and len(theirs) >= 2  # and the ssh session's sleep
        done = cli(capped, "kill", "node1")
        assert done.returncode == 0, done.stderr
        assert inside.wait(timeout=10) == -9
        assert set(capped.pids("node1")) == {h.holder, *h.services}
        assert outside.poll() is None and capped.pids("node0")
        # The host runs again: ssh to it, a command on it.
        assert on(capped, "node0", ["ssh", "node1", "hostname"]).stdout.strip() == "node1"
    finally:
        outside.kill()


@pytest.mark.slow  # over 5 s: out of the fast tier
def test_without_a_shared_dir_hosts_share_nothing_writable(capped, tmp_path):
    """The default rig: the machine's files (the software too) read-only on every host,
    only its own /tmp, /mnt/local, home dirs and /dev/shm writable; a file reaches a host
    by `plm rig cp` (what scp is) and comes back the same way."""
    assert not capped.shared_dir
    with pytest.raises(rigmod.RigError, match="shares no directory"):
        capped.shared  # noqa: B018
    repo = Path(__file__).resolve().parents[2]
    for path in (repo / "rig-probe", Path(capped.root) / "probe", "/etc/hosts", "/probe",
                 "/run/netns/probe"):  # fmt: skip
        out = on(capped, "node1", ["sh", "-c", f"echo x >> {path}"], check=False)
        assert out.returncode != 0 and "Read-only file system" in out.stderr, (path, out.stderr)
        assert not Path(path).name == "probe" or not Path(path).exists()
    mine = "/tmp/p /mnt/local/p /root/.cache/p /dev/shm/p".replace("/root", str(Path.home()))
    on(capped, "node1", ["sh", "-c", f"for f in {mine}; do echo one > $f; done"])
    on(capped, "node0", ["sh", "-c", f"for f in {mine}; do test ! -e $f; done"])
    # The software runs (read-only) on the host.
    on(capped, "node1", [sys.executable, "-c", "import pipeline.cli, torch"])
    src = tmp_path / "token"
    src.write_bytes(b"secret-ish\n")
    src.chmod(0o600)
    done = cli(capped, "cp", str(src), "node0:~/.ray/token", "node1:/mnt/local/deep/token")
    assert done.returncode == 0, done.stderr
    assert on(capped, "node0", ["stat", "-c", "%a", f"{Path.home()}/.ray/token"]).stdout == "600\n"
    assert capped.get("node1", "/mnt/local/deep/token") == b"secret-ish\n"
    back = tmp_path / "back"
    assert cli(capped, "cp", "node1:/mnt/local/deep/token", str(back)).returncode == 0
    assert back.read_bytes() == b"secret-ish\n"
    bad = cli(capped, "cp", str(src), "node7:/x")
    assert "node0, node1" in one_plm_line(bad)
    # The laptop's /tmp (where tmp_path is) is not a host's: the host never saw the file.
    assert on(capped, "node1", ["test", "-e", str(src)], check=False).returncode == 1


def test_each_host_has_its_own_dev_shm(rig):
    """What a host's processes leave in /dev/shm stays on the host and goes with it."""
    leftover = f"plm-rig-test-{os.getpid()}"
    try:
        on(rig, "node1", ["sh", "-c", f"echo x > /dev/shm/{leftover}"])
        assert on(rig, "node1", ["cat", f"/dev/shm/{leftover}"]).stdout == "x\n"
        assert not os.path.exists(f"/dev/shm/{leftover}")  # not the laptop's
        assert on(rig, "node0", ["test", "-e", f"/dev/shm/{leftover}"], check=False).returncode == 1
    finally:
        Path(f"/dev/shm/{leftover}").unlink(missing_ok=True)  # before the fix: the machine's
