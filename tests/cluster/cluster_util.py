"""Helpers of the `cluster` tests (the rig fixture is in this folder's conftest.py)."""

from __future__ import annotations

import base64
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline import rig as rigmod

REPO = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    """A console script of this Python environment (ray, mlflow, moto_server)."""
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def on(rig: rigmod.Rig, host: str, argv: list[str], *, env: dict | None = None,
       timeout: float = 600, check: bool = True, cwd: str = "/") -> subprocess.CompletedProcess:  # fmt: skip
    """``argv`` on ``host``, output captured; fails the test with it unless it exits 0."""
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = rig.run(host, argv, env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"on {host}: {' '.join(argv)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return proc


def pids_of(rig: rigmod.Rig, host: str, *markers: bytes) -> list[int]:
    """The processes of ``host`` whose command line (NUL-separated) holds one of ``markers``."""
    found = []
    for pid in rig.pids(host):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:  # gone already
            continue
        if any(m in cmd for m in markers):
            found.append(pid)
    return found


def s3_fs(rig: rigmod.Rig):
    """The rig's S3 server, as the laptop reaches it (pyarrow's S3 filesystem)."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=rig.s3_endpoint, access_key=rig.aws_key,
                             secret_key=rig.aws_secret, region="us-east-1", scheme="http")  # fmt: skip


MLFLOW_PORT = 5000
ADMIN, JOB, VIEWER = "admin", "plm-job", "plm-viewer"  # the users docs/cluster.md makes
AUTH_DIR = "/mnt/local/mlflow-auth"  # on node0: the server's secrets, its users' passwords
# The server's two secrets, made on node0 (0600) unless there: a restart keeps them.
MAKE_SECRETS = (
    'umask 077 && mkdir -p "$1" && for f in admin.password flask_secret_key; do '
    '[ -s "$1/$f" ] || "$2" -c "import secrets; print(secrets.token_urlsafe(32))" > "$1/$f"; '
    "done"
)


@dataclass
class RigMlflow:
    """The rig's `mlflow server --app-name basic-auth` on node0 and where its users'
    credentials are: every password file under ``auth_dir`` on node0, the job's at the
    same path on every host (a job's ranks run anywhere), the laptop's copies of the job's
    and the viewer's in ``laptop_dir``."""

    rig: rigmod.Rig
    url: str  # by name: what the hosts use
    address: str  # by address: what the laptop uses
    port: int
    auth_dir: str
    laptop_dir: Path

    def password_file(self, user: str) -> str:
        """The file of ``user``'s password on the hosts that have it (node0: every user)."""
        return f"{self.auth_dir}/{user}.password"

    def password(self, user: str) -> str:
        return self.rig.get("node0", self.password_file(user)).decode().strip()

    def as_job(self, on_laptop: bool = False) -> dict[str, str]:
        """A plm stage's variables as the job's user: its password from a file."""
        where = self.laptop_dir / f"{JOB}.password" if on_laptop else self.password_file(JOB)
        return {"MLFLOW_TRACKING_URI": self.address if on_laptop else self.url,
                "MLFLOW_TRACKING_USERNAME": JOB, "MLFLOW_TRACKING_PASSWORD_FILE": str(where)}  # fmt: skip

    def as_viewer(self) -> dict[str, str]:
        """A plain MLflow client's variables on the laptop (MLflow reads no password file)."""
        return {"MLFLOW_TRACKING_URI": self.address, "MLFLOW_TRACKING_USERNAME": VIEWER,
                "MLFLOW_TRACKING_PASSWORD": self.password(VIEWER)}  # fmt: skip


def start_mlflow(rig: rigmod.Rig, db: str, artifacts: str, log: str, port: int = MLFLOW_PORT,
                 experiments: tuple[str, ...] = (), auth_dir: str = AUTH_DIR) -> RigMlflow:  # fmt: skip
    """`mlflow server --app-name basic-auth` on node0, as docs/cluster.md starts it: its
    sqlite store ``db`` on node0's own disk, artifacts proxied to ``artifacts`` (an s3://
    URI), no job workers, output appended to ``log`` (a path on the laptop); its secrets
    in ``auth_dir`` on node0, passed by environment. The admin makes the job's user (EDIT
    on each of ``experiments`` and the registered model of that name) and the viewer; the
    job's password goes to every host, the job's and the viewer's to the laptop. Again on
    the same ``auth_dir`` (a restart), the secrets and users are kept."""
    node0 = rig.hosts[0]
    on(rig, "node0", ["sh", "-c", MAKE_SECRETS, "sh", auth_dir, sys.executable])
    ini = f"{auth_dir}/basic_auth.ini"
    rig.put("node0", aio().auth_ini(auth_dir), ini, mode=0o600)
    secret = {f: rig.get("node0", f"{auth_dir}/{f}").decode().strip()
              for f in ("admin.password", "flask_secret_key")}  # fmt: skip
    env = aio().server_env(ini, secret["admin.password"], secret["flask_secret_key"])
    out = open(log, "ab")  # noqa: SIM115  (the server's, for as long as it runs)
    rig.popen("node0", [
        tool("mlflow"), "server", "--app-name", "basic-auth",
        "--host", node0.address, "--port", str(port),
        "--allowed-hosts", f"{node0.address}:{port},node0:{port}",
        "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", artifacts,
        "--workers", "1",
    ], env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    wait_port(node0.address, port)
    server = RigMlflow(rig, f"http://node0:{port}", f"http://{node0.address}:{port}", port,
                       auth_dir, Path(rig.root) / "laptop" / f"mlflow-{port}")  # fmt: skip
    make_users(server, experiments)
    return server


def make_users(server: RigMlflow, experiments: tuple[str, ...]) -> None:
    """docs/cluster.md's `python -m pipeline.tracking_admin` on node0, as the admin; then
    the copies (`plm rig cp`): the job's password onto every host at the same path, the
    job's and the viewer's onto the laptop."""
    admin = {"MLFLOW_TRACKING_URI": server.url, "MLFLOW_TRACKING_USERNAME": ADMIN,
             "MLFLOW_TRACKING_PASSWORD_FILE": server.password_file(ADMIN)}  # fmt: skip
    steps = [["job", "--user", JOB, "--experiment", e] for e in experiments]
    for step in [*steps, ["viewer", "--user", VIEWER]]:
        on(server.rig, "node0", [sys.executable, "-m", "pipeline.tracking_admin", *step,
                                 "--password-file", server.password_file(step[2]),
                                 "--generate"], env=admin, timeout=120)  # fmt: skip
    job = server.rig.get("node0", server.password_file(JOB)) if experiments else None
    for h in server.rig.hosts[1:] if job else []:
        server.rig.put(h.name, job, server.password_file(JOB), mode=0o600)
    server.laptop_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for user in (JOB, VIEWER) if job else (VIEWER,):
        copy = server.laptop_dir / f"{user}.password"
        copy.touch(mode=0o600)
        copy.write_bytes(server.rig.get("node0", server.password_file(user)))


@functools.cache
def aio():
    """launch/all_in_one.py (a script, not a package): its auth config and server env."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("all_in_one", REPO / "launch" / "all_in_one.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stop_mlflow(rig: rigmod.Rig, port: int) -> list[int]:
    """SIGKILL the `mlflow server` listening on ``port`` on node0 and every process of its
    session (start_mlflow starts it in a session of its own): by PID, nothing else."""
    pids = {pid for _, p, _, pid in listeners(rig, "node0") if p == port and pid > 0}
    sessions = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
                for pid in pids}  # fmt: skip
    killed = []
    for pid in rig.pids("node0"):
        try:
            sid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
        except OSError:
            continue
        if sid in sessions:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def wait_port(address: str, port: int, timeout: float = 120) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((address, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def listeners(rig: rigmod.Rig, host: str) -> list[tuple[str, int, str, int]]:
    """Every TCP listener on ``host``: (address, port, process name, pid), from `ss`."""
    out = subprocess.run(["ip", "netns", "exec", rig.host(host).netns, "ss", "-ltnpH"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = []
    for line in out.splitlines():
        fields = line.split()
        local, users = fields[3], " ".join(fields[5:])
        address, _, port = local.rpartition(":")
        name = users.split('"')[1] if '"' in users else "?"
        pid = int(users.split("pid=")[1].split(",")[0]) if "pid=" in users else -1
        found.append((address.strip("[]").removeprefix("::ffff:"), int(port), name, pid))
    return found


def assert_same_shards(s3, root: str, local: Path) -> tuple[dict, dict]:
    """The data dir at ``root`` on the S3 filesystem holds the shards and indexes of the
    local data dir ``local``, byte for byte (at least 8 files); (local, remote) manifests."""
    import json

    from pipeline.data.shards import load_manifest

    ours = load_manifest(local)
    with s3.open_input_file(f"{root}/manifest.json") as f:
        theirs = json.loads(f.read())
    n_files = 0
    for split, info in ours["splits"].items():
        assert [e["sha256"] for e in theirs["splits"][split]["shards"]] == [
            e["sha256"] for e in info["shards"]
        ]
        for entry in info["shards"]:
            for name in (entry["name"], entry["index"]):
                with s3.open_input_file(f"{root}/{name}") as f:
                    assert f.read() == (local / name).read_bytes(), name
                n_files += 1
    assert n_files >= 8
    return ours, theirs


# --- secrets where they should not be (issue 49.3) -----------------------------------------


def secret_forms(value: str) -> set[bytes]:
    """``value`` as it could be written: raw, URL-encoded, and inside any base64 text
    (standard or URL-safe; the characters that depend on it alone, at each of the 3
    alignments, so `Basic base64(user:password)` is found too)."""
    from urllib.parse import quote, quote_plus

    raw = value.encode()
    forms = {raw, quote(value, safe="").encode(), quote_plus(value).encode()}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for pad in range(3):
            text = encode(b"\0" * pad + raw)
            forms.add(text[4 if pad else 0 : 4 * ((pad + len(raw)) // 3)])
    return {f for f in forms if len(f) >= 8}


def find_secrets(roots: list[Path], secrets_: dict[str, str], skip: dict[Path, str],
                 texts: dict[str, str] | None = None,
                 allow: dict[Path, set[str]] | None = None) -> list[str]:  # fmt: skip
    """Every file under ``roots`` (and every text of ``texts``, by name) holding a form of
    a value of ``secrets_`` (name -> value), but the files of ``skip`` (path -> why it
    must hold one) and, in a file of ``allow``, the secrets it names: "WHERE: NAME (FORM)"
    each. GNU grep's fixed-string search (one pass over every byte, all forms at once);
    links not followed, sockets and FIFOs skipped."""
    import tempfile

    needles = {form: name for name, value in secrets_.items() for form in secret_forms(value)}
    hits = []
    for label, text in (texts or {}).items():
        hits += [f"{label}: {name} ({form!r})" for form, name in needles.items()
                 if form in text.encode()]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:  # outside every root searched
        patterns = Path(folder) / "patterns"
        patterns.write_bytes(b"\n".join(needles))
        found = subprocess.run(["grep", "-rlFa", "-D", "skip", "-s", "--null", "-f",
                                str(patterns), *map(str, roots)], capture_output=True)  # fmt: skip
    assert found.returncode in (0, 1), found.stderr[-2000:]
    skipped = {Path(p).resolve() for p in skip}
    allowed = {Path(p).resolve(): names for p, names in (allow or {}).items()}
    for path in sorted({Path(x.decode()) for x in found.stdout.split(b"\0") if x}):
        if path.resolve() in skipped:
            continue
        data, ok = path.read_bytes(), allowed.get(path.resolve(), set())
        hits += [f"{path}: {name} ({form!r})" for form, name in needles.items()
                 if form in data and name not in ok]  # fmt: skip
    return hits


SMALL_SUBNETS = ("198.18.0.240/29", "198.18.0.232/29", "198.18.0.224/29", "198.18.0.248/29",
                 "198.18.0.120/29", "198.18.0.56/29")  # fmt: skip


def small_rig(name: str, n_hosts: int, **kwargs) -> rigmod.Rig:
    """A rig of the test's own beside the session's, on the first small subnet free."""
    import pytest

    why = rigmod.check_prerequisites(ssh=kwargs.get("ssh", True))
    if why:
        pytest.skip(why)
    for subnet in SMALL_SUBNETS:
        try:
            return rigmod.up(n_hosts, name=name, subnet=subnet, **kwargs)
        except rigmod.RigError as err:
            if "overlaps" not in str(err):
                raise
    raise AssertionError("every small test subnet is in use: `plm rig down` the other rigs")


# --- a Ray cluster on the rig (the data job's faults, the evaluation suite) ------------

GCS_PORT, DASHBOARD_PORT, CLIENT_PORT = 6390, 8270, 10101
# Every other port a node opens, away from Ray's defaults (test_ray_cluster.py uses those).
NODE_PORTS = ["--node-manager-port", "6391", "--object-manager-port", "6392",
              "--min-worker-port", "20000", "--max-worker-port", "20999",
              "--dashboard-agent-listen-port", "52470", "--dashboard-agent-grpc-port", "52471",
              "--metrics-export-port", "52472", "--runtime-env-agent-port", "52473"]  # fmt: skip
# The GCS declares a node dead after `failure_threshold` failed health checks, one every
# `period_ms` (Ray's defaults: 5 x 3 s, each waiting up to 10 s). A dead raylet refuses
# the connection at once, so this finds it in about 5 s instead of 15 s; a live one on
# this busy machine still has 5 s to answer each check.
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "5000",
                "RAY_health_check_failure_threshold": "5"}  # fmt: skip
# A process is Ray's when its command line is one of Ray's daemons or workers, or it runs
# in a job's working_dir (the job's driver, `python -m pipeline.cli data prepare`).
RAY_MARKERS = ("ray/core/", "ray/_private/", "ray/dashboard/", "ray/autoscaler/",
               "ray/util/client/")  # fmt: skip


def ray_pids(rig: rigmod.Rig, host: str) -> list[int]:
    """The Ray processes in ``host``'s namespace (never sshd, the S3 server or the holder)."""
    found = []
    for pid in rig.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone already
            continue
        args = [a for a in argv.split("\0") if a]
        if not args:
            continue
        if (
            args[0].startswith("ray::")
            or any(marker in arg for arg in args for marker in RAY_MARKERS)
            or "/runtime_resources/" in cwd
        ):
            found.append(pid)
    return found


def kill_ray(rig: rigmod.Rig, host: str) -> list[int]:
    """SIGKILL every Ray process of ``host`` (a host that dies), and wait until they are gone."""
    pids = ray_pids(rig, host)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 60
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"{host}: Ray processes outlived SIGKILL"
        time.sleep(0.2)
    return pids


def _running(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


class RayCluster:
    """Ray on the rig: the head on node0 (0 CPUs), one-CPU workers on the other hosts."""

    def __init__(self, rig: rigmod.Rig, token: Path):
        self.rig, self.token = rig, token
        self.head = rig.hosts[0].address
        self.address = f"http://{self.head}:{DASHBOARD_PORT}"
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}

    def start_head(self) -> None:
        on(self.rig, "node0", [tool("ray"), "start", "--head", "--node-ip-address", self.head,
                               "--port", str(GCS_PORT), "--num-cpus", "0",
                               "--dashboard-host", self.head, "--dashboard-port",
                               str(DASHBOARD_PORT), "--include-dashboard", "true",
                               "--ray-client-server-port", str(CLIENT_PORT), *NODE_PORTS,
                               "--disable-usage-stats"],
           env={**self.auth, **HEALTH_CHECK}, timeout=180)  # fmt: skip

    def start_worker(self, host: str) -> None:
        on(self.rig, host, [tool("ray"), "start", "--address", f"{self.head}:{GCS_PORT}",
                            "--node-ip-address", self.rig.host(host).address,
                            "--num-cpus", "1", *NODE_PORTS, "--disable-usage-stats"],
           env=self.auth, timeout=180)  # fmt: skip

    def start(self) -> None:
        self.start_head()
        for h in self.rig.hosts[1:]:
            self.start_worker(h.name)

    def stop(self) -> None:
        """The workers first, so none outlives its head and writes on."""
        for h in reversed(self.rig.hosts):
            kill_ray(self.rig, h.name)


@contextmanager
def ray_cluster_on(rig: rigmod.Rig, folder: Path):
    """A RayCluster started on the rig, its token made in ``folder`` (on the laptop) and
    copied onto each host at the same path (each host's own /tmp); at the end every Ray
    process it started is SIGKILLed by PID in the hosts' namespaces (not `ray stop`:
    every Ray process of the machine)."""
    token = folder / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    for h in rig.hosts:
        rig.put(h.name, token, str(token), mode=0o600)
    cluster = RayCluster(rig, token)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        for h in rig.hosts:
            assert ray_pids(rig, h.name) == [], h.name


# --- faults a host can meet without dying (the silent-host tests) ---------------------


class HeldRelay:
    """A TCP relay on the laptop's bridge address in front of a host's port (the S3
    server): it passes bytes through until ``hold(s)``, then keeps every byte that arrives,
    in either direction and on every connection, for ``s`` seconds from the first one (a
    store that stops answering mid-upload), and passes them on afterwards."""

    def __init__(self, listen: str, target: tuple[str, int]):
        import socket
        import threading

        self.server = socket.create_server((listen, 0))
        self.url = f"http://{listen}:{self.server.getsockname()[1]}"
        self.target = target
        self._lock = threading.Lock()
        self._hold_s, self._until = 0.0, 0.0
        self.held_bytes, self.held_since = 0, None  # what the hold kept, from when
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, seconds: float) -> None:
        with self._lock:
            self._hold_s, self.held_bytes, self.held_since = seconds, 0, None

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        try:
            while data := src.recv(65536):
                self._wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def _wait(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self._hold_s and self.held_since is None:  # armed: this byte starts it
                self._until, self.held_since = now + self._hold_s, time.time()
                self._hold_s = 0.0
            wait = self._until - now
            if wait > 0:
                self.held_bytes += n
        if wait > 0:
            time.sleep(wait)


@contextmanager
def cpu_share(pids: list[int], share: float, name: str):
    """``pids`` (and what they start) in a CPU cgroup of their own (cgroup v1's cpu
    controller) limited to ``share`` of one CPU: a host whose CPU another tenant takes.
    They go back to the root group after, and the group is removed."""
    root = Path("/sys/fs/cgroup/cpu")
    group = root / f"plm-starved-{name}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
        for pid in pids:
            try:
                (group / "cgroup.procs").write_text(str(pid))
            except OSError:  # gone already
                pass
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        group.rmdir()
