"""The rehearsal cluster itself: hosts that share no network stack, /tmp or local disk,
one shared directory, ssh between them, an S3 server on node0, and a `down` that stops
only what the rig started."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_util import on

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
    # Private /tmp and local disk; one shared directory at the same path.
    on(rig, "node1", ["sh", "-c", "echo one > /tmp/mine && echo one > /mnt/local/mine"])
    on(rig, "node1", ["sh", "-c", f"echo shared > {rig.shared}/note"])
    for path in ("/tmp/mine", "/mnt/local/mine"):
        assert on(rig, "node2", ["test", "-e", path], check=False).returncode == 1
        assert on(rig, "node1", ["cat", path]).stdout == "one\n"
        assert not os.path.exists(path)  # nor on the laptop
    assert on(rig, "node2", ["cat", f"{rig.shared}/note"]).stdout == "shared\n"
    # The other hosts' private dirs are out of sight.
    hosts_dir = f"{rig.root}/hosts"
    assert on(rig, "node2", ["ls", "-A", hosts_dir]).stdout == ""
    assert sorted(os.listdir(hosts_dir)) == ["node0", "node1", "node2"]


def test_ssh_between_hosts_and_pdsh(rig):
    out = on(rig, "node0", ["ssh", "node2", "hostname; cat /tmp/mine 2>/dev/null || true"])
    assert out.stdout.strip() == "node2"
    out = on(rig, "node0", ["pdsh", "-R", "ssh", "-w", "node1,node2", "hostname"])
    assert sorted(out.stdout.splitlines()) == ["node1: node1", "node2: node2"]


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


def test_down_stops_only_what_the_rig_started(tmp_path):
    why = rigmod.check_prerequisites(ssh=False)
    if why:
        pytest.skip(why)
    name = f"d{os.getpid()}"
    small = None
    for subnet in ("198.18.0.240/29", "198.18.0.232/29", "198.18.0.224/29"):
        try:
            small = rigmod.up(1, name=name, subnet=subnet, s3=False, ssh=False)
            break
        except rigmod.RigError as err:
            if "overlaps" not in str(err):
                raise
    assert small is not None
    outside = subprocess.Popen(["sleep", "300"])  # the same program, not the rig's
    try:
        inside = small.popen("node0", ["sleep", "300"], cwd="/")
        for _ in range(200):  # until nsenter has entered the namespace (then execs sleep)
            if inside.pid in small.pids("node0"):
                break
            time.sleep(0.05)
        assert inside.pid in small.pids("node0")
        assert outside.pid not in small.pids("node0")
        stopped = rigmod.down(name)
        assert inside.pid in stopped and outside.pid not in stopped
        assert inside.wait(timeout=10) == -15  # SIGTERM
        assert outside.poll() is None
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"plm-{name}-" not in netns
        links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
        assert f"plm{name}br" not in links and not os.path.exists(small.root)
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
