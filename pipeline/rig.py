"""A rehearsal cluster on one Linux machine: N hosts that share no network stack and no
private disk, for trying a multi-node command before paying for nodes (and for the tests).

    plm rig up --hosts 3 [--name rig] [--subnet 198.18.0.0/24] [--root /var/tmp/plm-rig]
    plm rig exec node1 -- CMD ...        # CMD runs on host node1 (exit status passed on)
    plm rig env                          # the laptop's shell lines: S3 endpoint and keys
    plm rig cp FILE node1:PATH [node2:PATH]   # a file onto hosts (what scp is); HOST:PATH FILE back
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

Every host sees the machine's files otherwise, **read-only**: the installed software (this
checkout, the Python environment), as nodes built from one image do. So hosts share
nothing writable but the bucket and the network, as cloud nodes with local disks and an
object store: what one host writes (its ``/tmp``, ``/mnt/local``, home dirs) no other
host sees, and a file reaches a host the way it would on a cluster: from the bucket, or
copied there (``plm rig cp``, what scp is). ``up --shared`` gives back the old layout: the
machine's files writable and a **shared directory** ``ROOT/NAME/shared`` at the same path
on every host (what NFS or Lustre is on a cluster). Host 0 also runs an **S3 server**
(moto's server mode, from PyPI) on port 9000; ``plm rig exec`` and ``plm rig env`` give the
standard ``AWS_ENDPOINT_URL`` / ``AWS_*`` variables, and each host's ``~/.aws`` holds the
keys, so the project talks to it exactly as to S3 or MinIO.

The root namespace plays the user's laptop: it reaches every host through the bridge's
own address (the subnet's last one). ``down`` stops only what the rig started, by PID:
the processes each namespace lists (``ip netns pids``), then the namespaces, the bridge
and the rig's directory. Needs root, iproute2, util-linux (unshare, nsenter) and, for
ssh, openssh-server, openssh-client and pdsh (`up` names every missing one and the one
``apt-get install`` line).

**Hosts with their own memory.** ``plm rig up --mem-per-host 4.5G`` puts every process of
each host in a memory cgroup of its own with that limit (cgroup v1's memory controller at
/sys/fs/cgroup/memory, else cgroup v2's ``memory.max``; swap capped too where the kernel
accounts it): the namespace holder, sshd, the S3 server on node0, what ``exec`` and ssh/pdsh
sessions start. A process the kernel kills for memory inside a host is reported:

    plm rig exec node1 -- CMD            # a `plm:` line if a host OOM-killed, status passed on
    plm rig exec --peak node1 -- CMD     # and the host's peak memory while CMD ran
    plm rig mem [node1]                  # limit, usage, peak, failcnt, OOM kills per host
    plm rig kill node2                   # SIGKILL the host's processes by PID: a lost host

The Python API (benches, tests), for a rig made by ``up()`` or read back with ``load()``::

    from pipeline import rig
    r = rig.up(2, name="bench", mem_per_host="4.5G")   # or rig.load("bench")
    r.reset_peak("node1")                  # the peak from now on
    r.run("node1", ["python", "train.py"])  # subprocess.run on node1, in its cgroup
    m = r.memory("node1")   # {"limit", "usage", "peak", "failcnt", "oom_kills"}: ints, bytes
    r.kill("node1")         # its processes SIGKILLed by PID (not the holder, sshd, S3)
    r.wipe("node1")         # and its disks emptied: a new host in its place
    r.put("node1", b"...", "/mnt/local/x"); r.get("node1", "/mnt/local/x")   # scp
    rig.down("bench")       # processes, namespaces, bridge, cgroups, folder
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.storage import atomic_write

DEFAULT_ROOT = Path("/var/tmp/plm-rig")
ALLOWED = ipaddress.ip_network("198.18.0.0/24")  # the only addresses the rig ever uses
S3_PORT = 9000
S3_BUCKET = "plm"
SSH_PORT = 22
PRIVATE_HOME_DIRS = (".cache", ".ray", ".ssh", ".aws")  # per host, under the user's home
LOCAL_DISK = "/mnt/local"
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller
MIN_MEM_PER_HOST = 32 << 20  # the holder, sshd and a shell fit; anything real needs more


class RigError(Exception):
    """The rig cannot do what was asked; the message says why and what to do."""


@dataclass
class Host:
    name: str  # hostname inside the host, e.g. node0
    address: str  # its address on the bridge
    netns: str  # network namespace name (ip netns)
    veth: str  # the root-namespace end of its link
    holder: int  # PID of the process holding its mount/UTS namespaces
    cgroup: str | None = None  # its memory cgroup's folder (with --mem-per-host)
    services: list[int] = field(default_factory=list)  # the rig's own: sshd, the S3 server


# ---------------------------------------------------------------------------------------
# Memory cgroups (cgroup v1's memory controller, or cgroup v2)

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """``4.5G``, ``800M``, ``512k``, ``1073741824`` -> bytes (K/M/G/T are powers of 1024,
    as cgroups, docker and Kubernetes' Gi read them)."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SUFFIX else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RigError(f"--mem-per-host {text!r}: give a size such as 4.5G, 800M or 512K")
    return int(value * _SUFFIX[unit])


def format_size(n: int | None) -> str:
    if n is None:
        return "none"
    for unit in ("T", "G", "M", "K"):
        if n >= _SUFFIX[unit]:
            return f"{n / _SUFFIX[unit]:.1f}{unit}".replace(".0" + unit, unit)
    return str(n)


def memory_controller() -> tuple[int, Path] | None:
    """(1, /sys/fs/cgroup/memory) where cgroup v1's memory controller is mounted, else
    (2, the cgroup2 mount) where v2 offers the memory controller, else None."""
    if (CGROUP_V1_MEMORY / "memory.limit_in_bytes").is_file():
        return 1, CGROUP_V1_MEMORY
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            root = Path(fields[1])
            try:
                if "memory" in (root / "cgroup.controllers").read_text().split():
                    return 2, root
            except OSError:
                continue
    return None


_PEAK_FDS: dict[str, int] = {}  # cgroup v2: memory.peak reset per open file (Linux >= 6.12)


class MemoryCgroup:
    """One host's memory cgroup: the same questions asked of v1's or v2's files."""

    def __init__(self, path: str | Path, version: int):
        self.path, self.version = Path(path), version

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    @staticmethod
    def make(path: Path, version: int, limit: int) -> MemoryCgroup:
        """Create it with ``limit`` on memory and on memory plus swap (where accounted);
        on v2 its parent must hand the memory controller down (``enable_memory``)."""
        path.mkdir(exist_ok=True)
        cg = MemoryCgroup(path, version)
        if version == 1:
            cg._write("memory.limit_in_bytes", str(limit))
            if (path / "memory.memsw.limit_in_bytes").is_file():
                cg._write("memory.memsw.limit_in_bytes", str(limit))
        else:
            cg._write("memory.max", str(limit))
            if (path / "memory.swap.max").is_file():
                cg._write("memory.swap.max", "0")
        return cg

    def swap_capped(self) -> bool:
        """Whether swap cannot hide the cap: swap accounted and capped, or no swap at all."""
        name = "memory.memsw.limit_in_bytes" if self.version == 1 else "memory.swap.max"
        if (self.path / name).is_file():
            return True
        try:
            return len(Path("/proc/swaps").read_text().splitlines()) <= 1
        except OSError:
            return False

    @staticmethod
    def enable_memory(folder: Path) -> None:
        """cgroup v2: the memory controller handed down to ``folder``'s children."""
        ctl = folder / "cgroup.subtree_control"
        if "memory" not in ctl.read_text().split():
            ctl.write_text("+memory")

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def stats(self) -> dict[str, int | None]:
        """limit, usage, peak (bytes), failcnt (times the limit was hit), oom_kills."""
        if self.version == 1:
            oom = dict(x.split() for x in self._read("memory.oom_control").splitlines() if x)
            limit = int(self._read("memory.limit_in_bytes"))
            failcnt = int(self._read("memory.failcnt"))  # + memory and swap's limit, hit first
            if (self.path / "memory.memsw.failcnt").is_file():
                failcnt += int(self._read("memory.memsw.failcnt"))
            return {
                "limit": None if limit >= 1 << 62 else limit,
                "usage": int(self._read("memory.usage_in_bytes")),
                "peak": int(self._read("memory.max_usage_in_bytes")),
                "failcnt": failcnt,
                "oom_kills": int(oom.get("oom_kill", 0)),
            }
        events = dict(x.split() for x in self._read("memory.events").splitlines() if x)
        limit = self._read("memory.max").strip()
        fd = _PEAK_FDS.get(str(self.path))
        try:
            peak = int(os.pread(fd, 64, 0)) if fd is not None else int(self._read("memory.peak"))
        except (OSError, ValueError):
            peak = None
        return {
            "limit": None if limit == "max" else int(limit),
            "usage": int(self._read("memory.current")),
            "peak": peak,
            "failcnt": int(events.get("max", 0)),
            "oom_kills": int(events.get("oom_kill", 0)),
        }

    def reset_peak(self) -> bool:
        """The peak from now on: v1 takes 0 in max_usage_in_bytes; v2's memory.peak (Linux
        >= 6.12) resets for the open file it was written through, which this process keeps
        and reads. False where the kernel cannot."""
        if self.version == 1:
            self._write("memory.max_usage_in_bytes", "0")
            return True
        old = _PEAK_FDS.pop(str(self.path), None)
        if old is not None:
            os.close(old)
        try:
            fd = os.open(self.path / "memory.peak", os.O_RDWR)
        except OSError:
            return False
        try:
            os.write(fd, b"reset\n")
        except OSError:
            os.close(fd)
            return False
        _PEAK_FDS[str(self.path)] = fd
        return True

    def remove(self, timeout: float = 10) -> None:
        """rmdir once its last process is gone (the kernel lets go of exited ones shortly)."""
        fd = _PEAK_FDS.pop(str(self.path), None)
        if fd is not None:
            os.close(fd)
        deadline = time.monotonic() + timeout
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError as err:
                if time.monotonic() > deadline:
                    raise RigError(f"cannot remove the cgroup {self.path}: {err} "
                                   f"(processes still in it: {self.pids()})") from None  # fmt: skip
                time.sleep(0.1)


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
    mem_per_host: int | None = None  # bytes, each host's memory cgroup limit
    cgroup_version: int | None = None  # 1 or 2, with mem_per_host
    cgroup_root: str | None = None  # the rig's folder of host cgroups
    shared_dir: bool = True  # `up --shared`: ROOT/NAME/shared on every host, files writable
    # (a rig.json of before this field had it: True); else hosts see the machine read-only

    # -- where things are ---------------------------------------------------------------
    @property
    def shared(self) -> Path:
        """The directory every host sees (``up --shared`` only)."""
        if not self.shared_dir:
            raise RigError(f"rig {self.name} shares no directory (hosts share only the bucket "
                           "and the network): copy files with `plm rig cp`, or bring it up "
                           "with `plm rig up --shared`")  # fmt: skip
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
        """``command`` as it runs on ``host``: inside its network, mount and UTS namespaces,
        and its memory cgroup (joined first, in this mount namespace, which has /sys/fs/cgroup)."""
        h = self.host(host)
        wd = cwd or os.getcwd()
        inside = ["nsenter", "-t", str(h.holder), "-m", "-u", "-n", f"--wd={wd}", "--", *command]
        return _in_cgroup(h.cgroup, inside)

    def host_env(self, host: str, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(self.env())
        env["HOSTNAME"] = host
        env["PDSH_RCMD_TYPE"] = "ssh"  # pdsh between hosts as on a cluster (not rsh)
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

    def put(self, host: str, data: bytes | str | Path, path: str, mode: int = 0o644) -> None:
        """``data`` (bytes, or the laptop's file at that Path) written to ``path`` on
        ``host``, its folders made: what ``scp FILE host:PATH`` does on a cluster. A
        leading ``~/`` is the user's home on the host (its own ``~/.ray``, ``~/.aws``...)."""
        if isinstance(data, Path):
            data = data.read_bytes()
        elif isinstance(data, str):
            data = data.encode()
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1.rig-cp" && chmod "$2" "$1.rig-cp" && mv "$1.rig-cp" "$1"'
        done = self.run(host, ["sh", "-c", script, "sh", _home(path), f"{mode:o}"], cwd="/",
                        input=data, capture_output=True)  # fmt: skip
        if done.returncode != 0:
            raise RigError(f"cannot write {path} on {host}: {done.stderr.decode().strip()}")

    def get(self, host: str, path: str) -> bytes:
        """The bytes of ``path`` on ``host`` (``scp host:PATH .``)."""
        done = self.run(host, ["cat", "--", _home(path)], cwd="/", capture_output=True)
        if done.returncode != 0:
            raise RigError(f"cannot read {path} on {host}: {done.stderr.decode().strip()}")
        return done.stdout

    def pids(self, host: str) -> list[int]:
        """Every process in the host's network namespace or its memory cgroup (the holder,
        sshd, what ran)."""
        h = self.host(host)
        out = _ip("netns", "pids", h.netns, check=False).stdout
        found = [int(p) for p in out.split()]
        if h.cgroup:
            found += self._cgroup(host).pids()
        return list(dict.fromkeys(found))

    def kill(self, host: str, sig: int = signal.SIGKILL, timeout: float = 10) -> list[int]:
        """Every process of ``host`` but the rig's own (the namespace holder, sshd, the S3
        server) sent ``sig``, by PID: a lost host (SIGKILL) or a stopped one (SIGTERM). Waits
        up to ``timeout`` for them to go; the PIDs signalled."""
        h = self.host(host)
        keep = {h.holder, *h.services}
        signalled: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # anew: a dying parent may start another child
            alive = [p for p in self.pids(host) if p not in keep and _alive(p)]
            if not alive:
                break
            for pid in alive:
                if pid not in signalled or sig == signal.SIGKILL:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        continue
                    if pid not in signalled:
                        signalled.append(pid)
            time.sleep(0.1)
        return signalled

    def wipe(self, host: str, keep: tuple[str, ...] = ()) -> list[int]:
        """A new host in its place: every process of ``host`` but the rig's own SIGKILLed
        (``kill``), then its disks emptied: ``/tmp``, ``/mnt/local`` (but the names in
        ``keep`` and the rig's logs), ``~/.cache`` and ``/dev/shm``. What a new node is
        provisioned with stays: ``~/.ssh``, ``~/.aws``, ``~/.ray``. The PIDs killed."""
        killed = self.kill(host)
        own = Path(self.root) / "hosts" / host
        # The software's mount points under /tmp (where it lies there) are not the disk's.
        software = {p.relative_to("/tmp").parts[0] for p in _software()
                    if p.is_relative_to("/tmp")}  # fmt: skip
        spare = {"tmp": software, "local": {*keep, "sshd.log", "s3.log"}, ".cache": set()}
        for sub, names in spare.items():
            for p in (own / sub).iterdir():
                if p.name in names:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        self.run(host, ["find", "/dev/shm", "-mindepth", "1", "-delete"], cwd="/", check=True)
        return killed

    # -- memory (with --mem-per-host) ---------------------------------------------------
    def _cgroup(self, host: str) -> MemoryCgroup:
        h = self.host(host)
        if not h.cgroup:
            raise RigError(f"rig {self.name} has no memory cap: take it down and bring it up "
                           "with `plm rig up --mem-per-host SIZE`")  # fmt: skip
        return MemoryCgroup(h.cgroup, self.cgroup_version or 1)

    def memory(self, host: str) -> dict[str, int | None]:
        """The host's memory cgroup: ``limit``, ``usage``, ``peak`` (bytes; peak since up or
        the last ``reset_peak``), ``failcnt`` (times usage hit the limit) and ``oom_kills``
        (processes the kernel killed for memory in it)."""
        return self._cgroup(host).stats()

    def reset_peak(self, host: str) -> bool:
        """From now on ``memory(host)["peak"]`` is the peak since this call (False where the
        kernel cannot reset it: cgroup v2 before Linux 6.12; then it is the peak since up)."""
        return self._cgroup(host).reset_peak()


# ---------------------------------------------------------------------------------------
# Bringing it up and down


def _run(*argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise RigError(f"`{shlex.join(argv)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", *args, check=check)


def _in_cgroup(cgroup: str | None, argv: list[str]) -> list[str]:
    """``argv`` started in the memory cgroup at ``cgroup`` (the shell writes its own PID to
    cgroup.procs, then execs: the same PID, and every child inherits the cgroup)."""
    if not cgroup:
        return argv
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', f"{cgroup}/cgroup.procs", *argv]


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
    atomic_write(path, (json.dumps(asdict(rig), indent=2) + "\n").encode())


# The programs the rig runs and their Debian packages (`ssh` ones only with sshd per host).
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "mount": "mount"}
SSH_TOOLS = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
             "pdsh": "pdsh"}  # fmt: skip


def missing_tools(ssh: bool = True, path: str | None = None) -> dict[str, str]:
    """The programs the rig needs that ``path`` (default: PATH) lacks -> their packages."""
    need = {**TOOLS, **(SSH_TOOLS if ssh else {})}
    return {tool: pkg for tool, pkg in need.items() if shutil.which(tool, path=path) is None}


def check_prerequisites(ssh: bool = True, path: str | None = None) -> str | None:
    """None when this machine can run a rig, else everything it lacks, at once, with the one
    line that installs it (the cluster tests skip with it)."""
    lacks = []
    if os.geteuid() != 0:
        lacks.append("root, for network and mount namespaces (run it as root, or with sudo)")
    missing = missing_tools(ssh, path)
    if missing:
        lacks.append(", ".join(f"`{tool}` ({pkg})" for tool, pkg in missing.items()))
        packages = " ".join(dict.fromkeys(missing.values()))
        lacks.append(f"install them with: apt-get install -y {packages}")
    if lacks:
        return "the rig needs " + "; ".join(lacks)
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
       root: Path = DEFAULT_ROOT, s3: bool = True, ssh: bool = True,
       mem_per_host: int | str | None = None, shared: bool = False) -> Rig:  # fmt: skip
    """Create the hosts (see the module's text); on any failure, undo what was made.
    ``mem_per_host`` (bytes or "4.5G"): each host's processes in a memory cgroup that size.
    ``shared``: a shared directory on every host and the machine's files writable; by
    default the hosts share nothing writable but the bucket."""
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
    limit, controller = _plan_memory(mem_per_host)
    net, addresses, laptop = _plan_addresses(subnet, n_hosts)
    base = Path(root) / name
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    if shared:
        (base / "shared").mkdir()
    rig = Rig(name=name, root=str(base), subnet=str(net), bridge=f"plm{name}br",
              laptop=laptop, hosts=[], shared_dir=shared)  # fmt: skip
    _save(rig)  # from here on `down` can undo a half-made rig
    try:
        if controller:
            rig.mem_per_host, rig.cgroup_version = limit, controller[0]
            rig.cgroup_root = str(_make_cgroup_root(controller, name))
            _save(rig)
        _ip("link", "add", rig.bridge, "type", "bridge")
        _no_ipv6(rig.bridge)
        _ip("addr", "add", f"{laptop}/{net.prefixlen}", "dev", rig.bridge)
        _ip("link", "set", rig.bridge, "up")
        for i, address in enumerate(addresses):
            h = Host(name=f"node{i}", address=address, netns=f"plm-{name}-node{i}",
                     veth=f"plm{name}v{i}", holder=0)  # fmt: skip
            if rig.cgroup_root:
                h.cgroup = str(Path(rig.cgroup_root) / h.name)
            rig.hosts.append(h)
            _save(rig)
            if h.cgroup:
                MemoryCgroup.make(Path(h.cgroup), rig.cgroup_version, limit)
            _make_network(h, rig.bridge, net.prefixlen)
        (base / "hosts.txt").write_text(_hosts_file(rig.hosts, laptop))
        if ssh:
            _make_ssh_identity(base)
        if s3:
            rig.aws_key, rig.aws_secret = "rig" + secrets.token_hex(6), secrets.token_hex(16)
        for h in rig.hosts:
            h.holder = _make_host(rig, h)
            _save(rig)
        sshds = {}
        if ssh:
            for h in rig.hosts:
                sshds[h.name] = _start_sshd(rig, h)
                h.services.append(sshds[h.name].pid)
            _save(rig)
        if s3:
            rig.s3_endpoint = _start_s3(rig)
        _save(rig)
        for h in rig.hosts if ssh else []:
            _wait_listening(rig, h.name, h.address, SSH_PORT, proc=sshds[h.name])
    except BaseException:
        down(name, root)
        raise
    return rig


def _plan_memory(mem_per_host: int | str | None) -> tuple[int | None, tuple[int, Path] | None]:
    """The cap in bytes and the memory controller to enforce it (None, None: no cap)."""
    if mem_per_host is None:
        return None, None
    limit = parse_size(mem_per_host)
    if limit < MIN_MEM_PER_HOST:
        raise RigError(f"--mem-per-host {mem_per_host}: at least {format_size(MIN_MEM_PER_HOST)} "
                       "(a host's sshd and shells need some; a Python with torch ~0.5G)")  # fmt: skip
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if limit > total:
        raise RigError(f"--mem-per-host {mem_per_host} is more than this machine's memory "
                       f"({format_size(total)}): give at most that")  # fmt: skip
    controller = memory_controller()
    if controller is None:
        raise RigError("--mem-per-host needs a memory cgroup controller: neither cgroup v1's "
                       f"{CGROUP_V1_MEMORY} nor a cgroup2 mount offering `memory` is here "
                       "(mount one, or leave --mem-per-host out)")  # fmt: skip
    return limit, controller


def _make_cgroup_root(controller: tuple[int, Path], name: str) -> Path:
    """The rig's cgroup folder (its hosts' groups go in it); a stale empty one is reused."""
    version, mount = controller
    folder = mount / f"plm-rig-{name}"
    if version == 2:
        MemoryCgroup.enable_memory(mount)
    for stale in [d for d in folder.iterdir() if d.is_dir()] if folder.is_dir() else []:
        MemoryCgroup(stale, version).remove(timeout=1)  # refuses while processes are in it
    try:
        folder.mkdir(exist_ok=True)
    except OSError as err:
        raise RigError(f"--mem-per-host: cannot make the cgroup {folder}: {err}") from None
    if version == 2:
        MemoryCgroup.enable_memory(folder)
    return folder


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


def _home(path: str) -> str:
    """``~/x`` -> the user's home/x (the same path on every host; its private dirs differ)."""
    return str(Path.home() / path[2:]) if path.startswith("~/") else path


def _disk_mounts() -> list[str]:
    """This machine's mount points of a block device other than ``/`` (outside /proc,
    /sys, /dev), writable: what a host without a shared dir sees read-only."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, target, _fs, options = line.split()[:4]
        target = target.replace("\\040", " ")
        top = target.split("/")[1] if target != "/" else ""
        if (source.startswith("/dev/") and target != "/" and "rw" in options.split(",")
                and top not in ("proc", "sys", "dev")):  # fmt: skip
            found.append(target)
    return found


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
    # Nothing shared: the machine's files read-only in this namespace (the root mount's
    # own flag, not the filesystem's: the laptop still writes), the software too; the
    # host's private mounts below stay writable (each its own mount).
    readonly = [] if rig.shared_dir else [
        "mount -o remount,bind,ro /",
        "mount -o remount,bind,ro /etc/hosts",  # the rig's file, bound: not the host's to edit
        *(f"mount -o remount,bind,ro {p}" for p in keep),
    ]  # fmt: skip
    # and, first, the machine's other mounts of a disk (here /run/netns, a bind)
    others = [] if rig.shared_dir else [
        f"mount -o remount,bind,ro {shlex.quote(m)}" for m in _disk_mounts()
    ]  # fmt: skip
    steps = [
        f"hostname {h.name}",
        *others,
        f"mount --bind {base / 'hosts.txt'} /etc/hosts",
        *(f"mkdir -p {own / 'tmp' / p.relative_to('/tmp')}" for p in keep),
        *(f"mount --bind {p} {own / 'tmp' / p.relative_to('/tmp')}" for p in keep),
        f"mount --rbind {own / 'tmp'} /tmp",
        "mount -t tmpfs -o size=1m,mode=755 plm-rig /mnt",
        f"mkdir {LOCAL_DISK}",
        f"mount --bind {own / 'local'} {LOCAL_DISK}",
        # Its own /dev/shm: what its processes leave there goes with the host.
        "mount -t tmpfs -o mode=1777,nosuid,nodev plm-rig-shm /dev/shm",
        *(f"mount --bind {own / sub} {home / sub}" for sub in PRIVATE_HOME_DIRS),
        # The other hosts' private dirs out of sight (this host's are mounted above).
        f"mount -t tmpfs -o size=1m,mode=700 plm-rig {base / 'hosts'}",
        *readonly,
        "echo ready",
        "exec sleep infinity",
    ]
    # Into the host's cgroup before `ip netns exec`, which mounts a /sys of its own.
    inside = ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--uts",
              "--propagation", "private", "sh", "-ec", "; ".join(steps)]  # fmt: skip
    holder = subprocess.Popen(
        _in_cgroup(h.cgroup, inside),
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


def _start_sshd(rig: Rig, h: Host) -> subprocess.Popen:
    """The host's sshd, in the foreground of a process of its own (its PID is the rig's
    record of it); its log in the host's local disk."""
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
            "SetEnv PDSH_RCMD_TYPE=ssh\n"  # pdsh in an ssh session speaks ssh too
        )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    log = open(Path(rig.root) / "hosts" / h.name / "local" / "sshd.log", "wb")  # noqa: SIM115
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    with log:
        return rig.popen(h.name, [sshd, "-D", "-e", "-f", str(config), "-o",
                                  f"ListenAddress={h.address}:{SSH_PORT}"],  # fmt: skip
                         cwd="/", stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)  # fmt: skip


# -- the object store --------------------------------------------------------------------------


def _start_s3(rig: Rig) -> str:
    h = rig.hosts[0]
    log = open(Path(rig.root) / "hosts" / h.name / "local" / "s3.log", "wb")  # noqa: SIM115
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    with log:
        server = rig.popen(h.name, [exe, "-H", h.address, "-p", str(S3_PORT)], cwd="/",
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           start_new_session=True)  # fmt: skip
    h.services.append(server.pid)
    endpoint = f"http://{h.address}:{S3_PORT}"
    _wait_listening(rig, h.name, h.address, S3_PORT, proc=server)
    import pyarrow.fs as pafs  # a bucket, made the way a client would (S3 API over HTTP)

    fs = pafs.S3FileSystem(endpoint_override=endpoint, access_key=rig.aws_key,
                           secret_key=rig.aws_secret, region="us-east-1", scheme="http",
                           allow_bucket_creation=True)  # fmt: skip
    fs.create_dir(S3_BUCKET)
    return endpoint


def _wait_listening(rig: Rig, host: str, address: str, port: int, timeout: float = 60,
                    proc: subprocess.Popen | None = None) -> None:  # fmt: skip
    """Until a TCP connect from the laptop to ``address:port`` succeeds (or ``proc``, the
    server, exits: its log is in the host's /mnt/local)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=2):
                return
        except OSError as err:
            if proc is not None and proc.poll() is not None:
                raise RigError(f"host {host}: the server for {address}:{port} exited "
                               f"{proc.returncode} before listening (its log: "
                               f"{rig.root}/hosts/{host}/local/)") from None  # fmt: skip
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
    if rig.cgroup_root:  # the rig.json stays if this fails, so `down` again retries
        for h in rig.hosts:
            if h.cgroup:
                MemoryCgroup(h.cgroup, rig.cgroup_version or 1).remove()
        MemoryCgroup(rig.cgroup_root, rig.cgroup_version or 1).remove()
    shutil.rmtree(rig.root, ignore_errors=True)
    return sorted(set(stopped))


def oom_report(rig: Rig) -> dict[str, dict[str, int | None]]:
    """Each capped host's memory stats where it had OOM kills (what `down` prints)."""
    found = {}
    for h in rig.hosts:
        if h.cgroup and Path(h.cgroup).is_dir():
            stats = rig.memory(h.name)
            if stats["oom_kills"]:
                found[h.name] = stats
    return found


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
        rig = up(args.hosts, args.name, args.subnet, root, s3=not args.no_s3, ssh=not args.no_ssh,
                 mem_per_host=args.mem_per_host, shared=args.shared)  # fmt: skip
        for h in rig.hosts:
            print(f"{h.name}  {h.address}  (netns {h.netns})")
        print(f"laptop  {rig.laptop}  (this shell, on bridge {rig.bridge})")
        if rig.shared_dir:
            print(f"shared  {rig.shared}  (the same path on every host)")
        else:
            print(
                "shared  nothing but the bucket: the machine's files read-only on the hosts "
                "(`plm rig cp FILE HOST:PATH` copies one onto a host)"
            )
        if rig.s3_endpoint:
            print(
                f"s3      {rig.s3_endpoint}  bucket s3://{S3_BUCKET}  (`plm rig env` for the keys)"
            )
        if rig.cgroup_root:
            cg = rig._cgroup(rig.hosts[0].name)
            swap = "swap capped too"
            if not cg.swap_capped():
                swap = "NOT swap: this kernel does not account swap; a host may swap past it"
            print(f"memory  {format_size(rig.mem_per_host)} per host (cgroup v{rig.cgroup_version}"
                  f" {rig.cgroup_root}/NODE; {swap}; `plm rig mem`)")  # fmt: skip
        return 0
    rig = load(args.name, root)
    if args.rig_command == "exec":
        command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not command:
            raise RigError("plm rig exec HOST -- CMD: give a command")
        return _exec(rig, args.host, command, peak=args.peak)
    if args.rig_command == "env":
        for key, value in rig.env().items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if args.rig_command == "cp":
        return _cp(rig, args.src, args.dst)
    if args.rig_command == "mem":
        hosts = [rig.host(args.host).name] if args.host else [h.name for h in rig.hosts]
        print(f"{'host':6} {'limit':>8} {'usage':>8} {'peak':>8} {'failcnt':>8} {'oom_kills':>9}")
        for name in hosts:
            m = rig.memory(name)
            print(f"{name:6} {format_size(m['limit']):>8} {format_size(m['usage']):>8} "
                  f"{format_size(m['peak']):>8} {m['failcnt']:>8} {m['oom_kills']:>9}")  # fmt: skip
        return 0
    if args.rig_command == "kill":
        sig = signal.Signals[f"SIG{args.signal.upper().removeprefix('SIG')}"]
        killed = rig.kill(args.host, sig)
        print(f"{args.host}: {sig.name} to {len(killed)} processes"
              f"{': ' + ' '.join(map(str, killed)) if killed else ''} "
              "(its namespace holder and sshd kept: the host can run again)")  # fmt: skip
        return 0
    if args.rig_command == "down":
        ooms = oom_report(rig)
        stopped = down(args.name, root)
        print(f"rig {args.name} down: stopped {len(stopped)} processes, namespaces removed"
              f"{', cgroups removed' if rig.cgroup_root else ''}")  # fmt: skip
        for host, m in ooms.items():
            print(f"  {host} had {m['oom_kills']} OOM kills under its cap of "
                  f"{format_size(m['limit'])} (peak {format_size(m['peak'])})")  # fmt: skip
        return 0
    raise RigError(f"unknown rig command {args.rig_command}")


def _cp(rig: Rig, src: str, dst: list[str]) -> int:
    """``cp FILE HOST:PATH [HOST:PATH ...]`` (onto hosts) or ``cp HOST:PATH FILE`` (back)."""

    def split(arg: str) -> tuple[str | None, str]:
        host, sep, path = arg.partition(":")
        return (host, path) if sep and host in {h.name for h in rig.hosts} else (None, arg)

    where, path = split(src)
    if where is not None:
        if len(dst) != 1 or split(dst[0])[0] is not None:
            raise RigError("plm rig cp HOST:PATH FILE: one local file to write")
        Path(dst[0]).write_bytes(rig.get(where, path))
        return 0
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise RigError(f"cp: cannot read {path}: {err.strerror}") from None
    targets = [split(d) for d in dst]
    if not targets or any(h is None or not p for h, p in targets):
        names = ", ".join(h.name for h in rig.hosts)
        raise RigError(f"plm rig cp FILE HOST:PATH [HOST:PATH ...]: HOST one of {names}")
    mode = os.stat(path).st_mode & 0o777
    for host, p in targets:
        rig.put(host, data, p, mode=mode)
    return 0


def _exec(rig: Rig, host: str, command: list[str], peak: bool = False) -> int:
    """``command`` on ``host``, its exit status passed on (a signal's as 128+N, as shells
    do); one `plm:` line if a host of the rig OOM-killed a process meanwhile."""
    rig.host(host)
    capped = [h.name for h in rig.hosts if h.cgroup]
    if peak and host not in capped:
        rig._cgroup(host)  # raises: no cap, nothing to measure
    before = {name: rig.memory(name)["oom_kills"] for name in capped}
    if peak:
        rig.reset_peak(host)
    code = subprocess.call(rig.argv(host, command), env=rig.host_env(host))
    status = 128 - code if code < 0 else code
    shown = shlex.join(command)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    if peak:
        m = rig.memory(host)
        print(f"rig: {host} peak memory {format_size(m['peak'])} of its {format_size(m['limit'])}"
              f" cap while `{shown}` ran (every process of the host)", file=sys.stderr)  # fmt: skip
    killed = {}
    for name in capped:
        m = rig.memory(name)
        if m["oom_kills"] > before[name]:
            killed[name] = (m, m["oom_kills"] - before[name])
    if killed:
        where = ", ".join(f"{name} (cap {format_size(m['limit'])}, {n} OOM kill{'s' * (n > 1)})"
                          for name, (m, n) in killed.items())  # fmt: skip
        if code == -signal.SIGKILL and host in killed:
            what = f"`{shown}` on {host} was killed for memory: {where}"
        else:
            what = f"killed for memory on {where} while `{shown}` ran on {host}"
        print(f"plm: rig: {what}; exit {status} (`plm rig mem` for the counts; a larger "
              "--mem-per-host or a smaller job)", file=sys.stderr)  # fmt: skip
    return status
