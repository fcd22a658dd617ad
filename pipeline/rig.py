"""A rehearsal cluster on one Linux machine: N hosts that share no network stack and no
private disk, for trying a multi-node command before paying for nodes (and for the tests).

    plm rig up --hosts 3 [--name rig] [--subnet 198.18.0.0/24] [--root /var/tmp/plm-rig]
    plm rig exec node1 -- CMD ...        # CMD runs on host node1 (exit status passed on)
    plm rig env                          # the laptop's shell lines: S3 endpoint and keys
    plm rig down

Each host is
- a **network namespace** with one veth on a bridge of the root namespace, an address of
  its own in 198.18.0.0/24 (RFC 2544's range for test networks) and no route beyond the
  bridge: nothing it sends can leave the machine, and the rig never touches another address;
- a **mount and UTS namespace** (held by a ``sleep`` process) with its own hostname,
  ``/etc/hosts`` (every host by name), a private ``/tmp``, a private local disk at
  ``/mnt/local`` and private ``~/.cache``, ``~/.ray``, ``~/.ssh``, ``~/.aws``; the other
  hosts' private dirs are hidden (a tmpfs over them);
- an **sshd** on its own address (port 22), the rig's key authorised, so ``ssh node1``
  and pdsh work between hosts as on a cluster.

Every host sees the machine's files otherwise: the installed software, as on a cluster
built from one image, and the **shared directory** ``ROOT/NAME/shared`` at the same path on
every host (what NFS or Lustre is on a cluster). Host 0 also runs an **S3 server**
(moto's server mode, from PyPI) on port 9000; ``plm rig exec`` and ``plm rig env`` give the
standard ``AWS_ENDPOINT_URL`` / ``AWS_*`` variables, and each host's ``~/.aws`` holds the
keys, so the project talks to it exactly as to S3 or MinIO.

The root namespace plays the user's laptop: it reaches every host through the bridge's
own address (the subnet's last one). ``down`` stops only what the rig started, by PID:
the processes each namespace lists (``ip netns pids``), then the namespaces, the bridge
and the rig's directory. Needs root, iproute2, util-linux (unshare, nsenter) and, for
ssh, openssh-server.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/var/tmp/plm-rig")
ALLOWED = ipaddress.ip_network("198.18.0.0/24")  # the only addresses the rig ever uses
S3_PORT = 9000
S3_BUCKET = "plm"
SSH_PORT = 22
PRIVATE_HOME_DIRS = (".cache", ".ray", ".ssh", ".aws")  # per host, under the user's home
LOCAL_DISK = "/mnt/local"


class RigError(Exception):
    """The rig cannot do what was asked; the message says why and what to do."""


@dataclass
class Host:
    name: str  # hostname inside the host, e.g. node0
    address: str  # its address on the bridge
    netns: str  # network namespace name (ip netns)
    veth: str  # the root-namespace end of its link
    holder: int  # PID of the process holding its mount/UTS namespaces


@dataclass
class Rig:
    name: str
    root: str  # ROOT/NAME: hosts' private dirs, shared/, ssh/, rig.json
    subnet: str
    bridge: str
    laptop: str  # the root namespace's address on the bridge
    hosts: list[Host]
    s3_endpoint: str | None = None
    aws_key: str | None = None
    aws_secret: str | None = None

    # -- where things are ---------------------------------------------------------------
    @property
    def shared(self) -> Path:
        return Path(self.root) / "shared"

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        names = ", ".join(h.name for h in self.hosts)
        raise RigError(f"rig {self.name} has no host {name!r} (hosts: {names})")

    def env(self) -> dict[str, str]:
        """The variables a client needs, laptop or host: S3 endpoint and keys."""
        if not self.s3_endpoint:
            return {}
        return {
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": self.aws_key or "",
            "AWS_SECRET_ACCESS_KEY": self.aws_secret or "",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }

    # -- running things on a host -------------------------------------------------------
    def argv(self, host: str, command: list[str], cwd: str | None = None) -> list[str]:
        """``command`` as it runs on ``host``: inside its network, mount and UTS namespaces."""
        h = self.host(host)
        wd = cwd or os.getcwd()
        return ["nsenter", "-t", str(h.holder), "-m", "-u", "-n", f"--wd={wd}", "--", *command]

    def host_env(self, host: str, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.env())
        env["HOSTNAME"] = host
        env.pop("TMPDIR", None)  # the host's own /tmp
        return env

    def popen(self, host: str, command: list[str], env: dict[str, str] | None = None,
              cwd: str | None = None, **kwargs) -> subprocess.Popen:  # fmt: skip
        """Start ``command`` on ``host``; ``env`` (default: this process's) gets the rig's."""
        return subprocess.Popen(self.argv(host, command, cwd), env=self.host_env(host, env),
                                **kwargs)  # fmt: skip

    def run(self, host: str, command: list[str], env: dict[str, str] | None = None,
            cwd: str | None = None, **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
        return subprocess.run(self.argv(host, command, cwd), env=self.host_env(host, env),
                              **kwargs)  # fmt: skip

    def pids(self, host: str) -> list[int]:
        """Every process in the host's network namespace (the holder, sshd, what ran)."""
        out = _ip("netns", "pids", self.host(host).netns, check=False).stdout
        return [int(p) for p in out.split()]


# ---------------------------------------------------------------------------------------
# Bringing it up and down


def _run(*argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise RigError(f"`{shlex.join(argv)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", *args, check=check)


def state_file(root: Path, name: str) -> Path:
    return Path(root) / name / "rig.json"


def load(name: str = "rig", root: Path = DEFAULT_ROOT) -> Rig:
    path = state_file(root, name)
    if not path.is_file():
        raise RigError(f"no rig {name!r} is up ({path} does not exist): run `plm rig up`")
    raw = json.loads(path.read_text())
    raw["hosts"] = [Host(**h) for h in raw["hosts"]]
    return Rig(**raw)


def _save(rig: Rig) -> None:
    path = state_file(Path(rig.root).parent, rig.name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rig), indent=2) + "\n")
    tmp.replace(path)


def check_prerequisites(ssh: bool = True) -> str | None:
    """None when this machine can run a rig, else why not (the cluster tests skip with it)."""
    if os.geteuid() != 0:
        return "the rig needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"the rig needs `{tool}` (Debian: iproute2 / util-linux)"
    if ssh and not Path("/usr/sbin/sshd").exists():
        return "the rig's ssh needs /usr/sbin/sshd (Debian: openssh-server)"
    probe = _run("unshare", "--net", "--mount", "--uts", "true", check=False)
    if probe.returncode != 0:
        return f"this kernel or container refuses namespaces: {probe.stderr.strip()}"
    return None


def _plan_addresses(subnet: str, n_hosts: int) -> tuple[ipaddress.IPv4Network, list[str], str]:
    try:
        net = ipaddress.ip_network(subnet)
    except ValueError as err:
        raise RigError(f"--subnet {subnet}: {err}") from None
    if not (net.version == 4 and net.subnet_of(ALLOWED)):
        raise RigError(f"--subnet {subnet}: the rig uses only addresses in {ALLOWED}")
    usable = list(net.hosts())
    if len(usable) < n_hosts + 1:
        raise RigError(f"--subnet {subnet} holds {len(usable)} addresses; {n_hosts} hosts "
                       "and the laptop need one each: give a larger subnet")  # fmt: skip
    for other in _routes_into(ALLOWED):
        if other.overlaps(net):
            raise RigError(f"--subnet {subnet} overlaps {other}, in use on this machine (another "
                           "rig?): give another part of 198.18.0.0/24 or `plm rig down` it")  # fmt: skip
    return net, [str(a) for a in usable[:n_hosts]], str(usable[-1])


def _routes_into(space: ipaddress.IPv4Network) -> list[ipaddress.IPv4Network]:
    out = _ip("-j", "route", "show", check=False).stdout or "[]"
    nets = []
    for r in json.loads(out):
        try:
            dst = ipaddress.ip_network(r.get("dst", ""), strict=False)
        except ValueError:
            continue
        if dst.version == 4 and dst.overlaps(space):
            nets.append(dst)
    return nets


def _hosts_file(rig_hosts: list[Host], laptop: str) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{h.address} {h.name}" for h in rig_hosts]
    lines.append(f"{laptop} laptop")
    return "\n".join(lines) + "\n"


def up(n_hosts: int = 3, name: str = "rig", subnet: str = "198.18.0.0/24",
       root: Path = DEFAULT_ROOT, s3: bool = True, ssh: bool = True) -> Rig:  # fmt: skip
    """Create the hosts (see the module's text); on any failure, undo what was made."""
    if not name.isalnum() or len(name) > 8:  # interface names: 15 bytes at most
        raise RigError(f"--name {name!r}: 1-8 letters or digits (it prefixes interface names)")
    if n_hosts < 1:
        raise RigError("--hosts must be at least 1")
    why = check_prerequisites(ssh)
    if why:
        raise RigError(why)
    if state_file(root, name).exists():
        raise RigError(f"rig {name!r} is already up ({state_file(root, name)}): "
                       f"`plm rig down --name {name}` first")  # fmt: skip
    net, addresses, laptop = _plan_addresses(subnet, n_hosts)
    base = Path(root) / name
    if base.exists():
        shutil.rmtree(base)
    (base / "shared").mkdir(parents=True)
    rig = Rig(name=name, root=str(base), subnet=str(net), bridge=f"plm{name}br",
              laptop=laptop, hosts=[])  # fmt: skip
    _save(rig)  # from here on `down` can undo a half-made rig
    try:
        _ip("link", "add", rig.bridge, "type", "bridge")
        _no_ipv6(rig.bridge)
        _ip("addr", "add", f"{laptop}/{net.prefixlen}", "dev", rig.bridge)
        _ip("link", "set", rig.bridge, "up")
        for i, address in enumerate(addresses):
            h = Host(name=f"node{i}", address=address, netns=f"plm-{name}-node{i}",
                     veth=f"plm{name}v{i}", holder=0)  # fmt: skip
            rig.hosts.append(h)
            _save(rig)
            _make_network(h, rig.bridge, net.prefixlen)
        (base / "hosts.txt").write_text(_hosts_file(rig.hosts, laptop))
        if ssh:
            _make_ssh_identity(base)
        if s3:
            rig.aws_key, rig.aws_secret = "rig" + secrets.token_hex(6), secrets.token_hex(16)
        for h in rig.hosts:
            h.holder = _make_host(rig, h)
            _save(rig)
        if ssh:
            for h in rig.hosts:
                _start_sshd(rig, h)
        if s3:
            rig.s3_endpoint = _start_s3(rig)
        _save(rig)
        for h in rig.hosts if ssh else []:
            _wait_listening(rig, h.name, h.address, SSH_PORT)
    except BaseException:
        down(name, root)
        raise
    return rig


def _make_network(h: Host, bridge: str, prefixlen: int) -> None:
    _ip("netns", "add", h.netns)
    _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
    _no_ipv6(h.veth)
    _run("ip", "netns", "exec", h.netns, "sh", "-c",
         "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6")  # fmt: skip
    _ip("link", "set", h.veth, "master", bridge)
    _ip("link", "set", h.veth, "up")
    _ip("-n", h.netns, "addr", "add", f"{h.address}/{prefixlen}", "dev", "eth0")
    _ip("-n", h.netns, "link", "set", "eth0", "up")
    _ip("-n", h.netns, "link", "set", "lo", "up")
    # Only the on-link route of the subnet exists: no default route, nothing leaves.


def _no_ipv6(link: str) -> None:
    """No IPv6 on the rig's links: no link-local address, no neighbour discovery; the
    hosts speak IPv4 in 198.18.0.0/24 only (loopback keeps ::1)."""
    Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").write_text("1")


def _software() -> list[Path]:
    """Where this code and its Python live."""
    return [Path(__file__).resolve().parents[1], Path(sys.prefix).resolve()]


def _make_host(rig: Rig, h: Host) -> int:
    """The process that holds the host's mount and UTS namespaces, set up; its PID."""
    base = Path(rig.root)
    own = base / "hosts" / h.name
    home = Path.home()
    for sub in ("tmp", "local", *PRIVATE_HOME_DIRS):
        (own / sub).mkdir(parents=True, exist_ok=True)
    (own / "tmp").chmod(0o1777)
    if rig.aws_key:
        (own / ".aws" / "credentials").write_text(
            f"[default]\naws_access_key_id = {rig.aws_key}\n"
            f"aws_secret_access_key = {rig.aws_secret}\n"
        )
        (own / ".aws" / "config").write_text("[default]\nregion = us-east-1\n")
    if (base / "ssh").is_dir():
        for f in (base / "ssh").iterdir():
            if f.is_file() and not f.name.startswith("host_"):
                shutil.copy2(f, own / ".ssh" / f.name)
    for sub in PRIVATE_HOME_DIRS:
        (home / sub).mkdir(exist_ok=True)  # a mount point; the host's own dir goes over it
    # The software (this checkout, the Python environment) stays at its path on every
    # host, as on nodes built from one image, even where it lies under /tmp.
    keep = [p for p in _software() if p.is_relative_to("/tmp")]
    steps = [
        f"hostname {h.name}",
        f"mount --bind {base / 'hosts.txt'} /etc/hosts",
        *(f"mkdir -p {own / 'tmp' / p.relative_to('/tmp')}" for p in keep),
        *(f"mount --bind {p} {own / 'tmp' / p.relative_to('/tmp')}" for p in keep),
        f"mount --rbind {own / 'tmp'} /tmp",
        "mount -t tmpfs -o size=1m,mode=755 plm-rig /mnt",
        f"mkdir {LOCAL_DISK}",
        f"mount --bind {own / 'local'} {LOCAL_DISK}",
        *(f"mount --bind {own / sub} {home / sub}" for sub in PRIVATE_HOME_DIRS),
        # The other hosts' private dirs out of sight (this host's are mounted above).
        f"mount -t tmpfs -o size=1m,mode=700 plm-rig {base / 'hosts'}",
        "echo ready",
        "exec sleep infinity",
    ]
    holder = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            h.netns,
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-ec",
            "; ".join(steps),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,  # fmt: skip
    )
    line = holder.stdout.readline()
    if line.strip() != "ready":
        holder.kill()
        raise RigError(f"host {h.name}: namespace set-up failed: {holder.stderr.read().strip()}")
    holder.stdout.close()
    holder.stderr.close()
    return holder.pid


# -- ssh -------------------------------------------------------------------------------------


def _make_ssh_identity(base: Path) -> None:
    """One user key and one host key for the rig; config and known_hosts that use them."""
    d = base / "ssh"
    d.mkdir(mode=0o700)
    _run(
        "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "plm-rig", "-f", str(d / "id_ed25519")
    )
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "plm-rig-host",
         "-f", str(d / "host_ed25519_key"))  # fmt: skip
    shutil.copy2(d / "id_ed25519.pub", d / "authorized_keys")
    (d / "config").write_text(
        "Host *\n  IdentityFile ~/.ssh/id_ed25519\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking yes\n  UserKnownHostsFile ~/.ssh/known_hosts\n"
        "  BatchMode yes\n  ConnectTimeout 10\n  LogLevel ERROR\n"
    )


def _start_sshd(rig: Rig, h: Host) -> None:
    d = Path(rig.root) / "ssh"
    host_pub = (d / "host_ed25519_key.pub").read_text().split()[:2]
    known = "".join(f"{x.name},{x.address} {' '.join(host_pub)}\n" for x in rig.hosts)
    (Path(rig.root) / "hosts" / h.name / ".ssh" / "known_hosts").write_text(known)
    config = d / "sshd_config"
    if not config.exists():
        config.write_text(
            f"HostKey {d / 'host_ed25519_key'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nAuthorizedKeysFile .ssh/authorized_keys\n"
            f"PidFile none\nAcceptEnv LANG LC_*\nSubsystem sftp internal-sftp\n"
        )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    proc = rig.run(h.name, ["/usr/sbin/sshd", "-f", str(config), "-o",
                            f"ListenAddress={h.address}:{SSH_PORT}"],  # fmt: skip
                   capture_output=True, text=True, cwd="/")  # fmt: skip
    if proc.returncode != 0:
        raise RigError(f"host {h.name}: sshd did not start: {proc.stderr.strip()}")


# -- the object store --------------------------------------------------------------------------


def _start_s3(rig: Rig) -> str:
    h = rig.hosts[0]
    log = open(Path(rig.root) / "hosts" / h.name / "local" / "s3.log", "wb")  # noqa: SIM115
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    rig.popen(h.name, [exe, "-H", h.address, "-p", str(S3_PORT)], cwd="/",
              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
              start_new_session=True)  # fmt: skip
    endpoint = f"http://{h.address}:{S3_PORT}"
    _wait_listening(rig, h.name, h.address, S3_PORT)
    import pyarrow.fs as pafs  # a bucket, made the way a client would (S3 API over HTTP)

    fs = pafs.S3FileSystem(endpoint_override=endpoint, access_key=rig.aws_key,
                           secret_key=rig.aws_secret, region="us-east-1", scheme="http",
                           allow_bucket_creation=True)  # fmt: skip
    fs.create_dir(S3_BUCKET)
    return endpoint


def _wait_listening(rig: Rig, host: str, address: str, port: int, timeout: float = 60) -> None:
    """Until a TCP connect from the laptop to ``address:port`` succeeds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=2):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise RigError(
                    f"host {host}: nothing listens on {address}:{port} ({err})"
                ) from None
            time.sleep(0.2)


def down(name: str = "rig", root: Path = DEFAULT_ROOT) -> list[int]:
    """Stop every process of the rig's namespaces (by PID), remove them; the PIDs stopped."""
    path = state_file(root, name)
    if not path.is_file():
        return []
    rig = load(name, root)
    stopped: list[int] = []
    pids = [p for h in rig.hosts for p in rig.pids(h.name)]
    pids += [h.holder for h in rig.hosts if h.holder]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in dict.fromkeys(pids) if _alive(p)]
        for pid in alive:
            try:
                os.kill(pid, sig)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Processes started in a namespace after the listing (a respawn) are listed anew.
        pids = [p for h in rig.hosts for p in rig.pids(h.name)]
    for h in rig.hosts:
        _ip("link", "del", h.veth, check=False)
        _ip("netns", "del", h.netns, check=False)
    _ip("link", "del", rig.bridge, check=False)
    shutil.rmtree(rig.root, ignore_errors=True)
    return sorted(set(stopped))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------------------------
# Command line (`plm rig ...` maps here)


def main(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if args.rig_command == "up":
        rig = up(args.hosts, args.name, args.subnet, root, s3=not args.no_s3, ssh=not args.no_ssh)
        for h in rig.hosts:
            print(f"{h.name}  {h.address}  (netns {h.netns})")
        print(f"laptop  {rig.laptop}  (this shell, on bridge {rig.bridge})")
        print(f"shared  {rig.shared}  (the same path on every host)")
        if rig.s3_endpoint:
            print(
                f"s3      {rig.s3_endpoint}  bucket s3://{S3_BUCKET}  (`plm rig env` for the keys)"
            )
        return 0
    rig = load(args.name, root)
    if args.rig_command == "exec":
        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not command:
            raise RigError("plm rig exec HOST -- CMD: give a command")
        return subprocess.call(rig.argv(args.host, command), env=rig.host_env(args.host))
    if args.rig_command == "env":
        for key, value in rig.env().items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if args.rig_command == "down":
        stopped = down(args.name, root)
        print(f"rig {args.name} down: stopped {len(stopped)} processes, namespaces removed")
        return 0
    raise RigError(f"unknown rig command {args.rig_command}")
