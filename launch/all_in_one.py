"""The cluster paths on one machine: a Ray head, an MLflow server, two training "nodes".

    python launch/all_in_one.py [--workdir runs/all-in-one] [--input builtin:python-docs]
                                [--config configs/test/bert-tiny.yaml] [--steps 6]
                                [--keep] [key=value ...]

What it does, each step the way a real cluster does it:
1. `ray start --head` with token authentication (a fresh token in the head's temp dir),
   its own ports, and 127.0.0.1 for the dashboard;
2. `mlflow server --app-name basic-auth` with a sqlite backend and an artifact folder,
   bound to 127.0.0.1: its admin password and Flask secret key are generated into
   WORKDIR/mlflow-auth/ (mode 0600) the first time and read from there after, never put
   on a command line; a job user (EDIT on the run's experiment and model) and a viewer
   (READ) are made through `python -m pipeline.tracking_admin`, their passwords there too;
3. `ray job submit` of `plm data tokenizer`, then of `plm data prepare` (the job joins
   the head's cluster through RAY_ADDRESS, as on a real cluster);
4. `plm train` as two "nodes" of one rank each, through the `deepspeed` launcher's
   per-node form (`--no_ssh --node_rank R --master_addr 127.0.0.1`, what a container
   runs), logging to the MLflow server and registering the model as the job user
   (MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD_FILE);
5. reads the run's metrics and the registered model back through MLflow's REST API, as
   the viewer.

Everything it starts is stopped at the end, also on Ctrl-C or an error: the Ray
processes by their private temp dir (never `ray stop`, which stops every Ray on the
machine), the MLflow server by its process group. ``--keep`` leaves the head and the
server up until Ctrl-C so the Ray dashboard and the MLflow UI can be browsed.
Outputs and logs go under the workdir; the exit status is 0 when every step worked.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH = Path(__file__).resolve().parent
DEFAULT_CONFIG = "configs/test/bert-tiny.yaml"


class StepFailed(Exception):
    """One step did not work; the message names it and the log to read."""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def say(msg: str) -> None:
    print(f"[all-in-one] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Ray head


def has_exited(pid: int) -> bool:
    """Gone, or a zombie (exited, not yet reaped by its parent): nothing left to stop."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone
    return stat.rpartition(")")[2].split()[0] == "Z"  # the state, after "(comm)"


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (our head's private temp dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if marker.encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def program(pid: int) -> str:
    """The file name of the program ``pid`` runs ("raylet", "python3.11"), or ""."""
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name
    except (OSError, UnicodeDecodeError):
        return ""


def stop_pids(find, timeout: float = 15.0) -> list[int]:
    """SIGTERM, then SIGKILL what is left, of the pids ``find()`` returns.

    Returns the pids that outlived SIGTERM for ``timeout`` s and had to be killed."""
    killed: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for pid in find() if not has_exited(pid)]
        if sig == signal.SIGKILL:
            killed = pids
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + timeout
        while any(not has_exited(pid) for pid in find()) and time.time() < deadline:
            time.sleep(0.1)
    return killed


class RayHead:
    """A one-node Ray cluster with token auth; every process it starts carries temp_dir."""

    def __init__(self, num_cpus: int, logs: Path):
        # Short path: Ray's unix sockets live under it (107-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="plmray-", dir="/tmp")
        self.token_path = Path(self.temp_dir) / "auth_token"
        self.num_cpus = num_cpus
        self.logs = logs
        self.address = ""
        self.gcs_port = 0

    def auth_env(self) -> dict[str, str]:
        """What every client of this cluster needs: token mode and where the token is, and
        loopback only: Ray's switch for a one-machine cluster makes the node IP 127.0.0.1
        (``--node-ip-address 127.0.0.1`` alone is turned back into the machine's address),
        so the GCS, raylet, agents and Ray client server listen on loopback only."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # fmt: skip

    def start(self) -> None:
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        gcs, dash, client, nm, om, agent, agent_grpc, rt, metrics = free_ports(9)
        self.gcs_port = gcs
        cmd = [
            "ray", "start", "--head", "--num-cpus", str(self.num_cpus),
            "--temp-dir", self.temp_dir, "--port", str(gcs),
            "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
            "--node-manager-port", str(nm), "--object-manager-port", str(om),
            "--dashboard-agent-listen-port", str(agent),
            "--dashboard-agent-grpc-port", str(agent_grpc),
            "--runtime-env-agent-port", str(rt), "--metrics-export-port", str(metrics),
            "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats",
            "--node-ip-address", "127.0.0.1",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(self.auth_env())
        log = self.logs / "ray-start.log"
        with open(log, "w") as out:
            proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
        if proc.returncode != 0:
            raise StepFailed(f"`ray start --head` exited {proc.returncode}; see {log}")
        self.address = f"http://127.0.0.1:{dash}"

    def stop(self) -> list[int]:
        """Stop every process of this head; returns those that needed SIGKILL."""
        # The Ray client server's command line does not name the temp dir, only the GCS.
        killed = stop_ray_head(self.temp_dir, f"--address=127.0.0.1:{self.gcs_port} ")
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # session logs and the token
        return killed


def stop_ray_head(temp_dir: str, *also: str) -> list[int]:
    """Stop the Ray processes whose command line names ``temp_dir`` (or any of ``also``);
    returns the pids that needed SIGKILL.

    In `ray stop`'s order: the raylet first, then its agents and workers, the GCS last.
    Sent SIGTERM all at once, the raylet, the GCS and the autoscaler's monitor were still
    running 15-20 s later here, and had to be killed; in this order all exit within ~1 s."""
    ours = lambda: sorted({p for m in (temp_dir, *also) for p in processes_with(m)})  # noqa: E731
    killed = stop_pids(lambda: [p for p in ours() if program(p) == "raylet"])
    killed += stop_pids(lambda: [p for p in ours() if program(p) not in ("raylet", "gcs_server")])
    killed += stop_pids(lambda: [p for p in ours() if program(p) == "gcs_server"])
    return killed


# ---------------------------------------------------------------------------
# MLflow server


ADMIN_USER = "admin"
JOB_USER = "plm-job"
VIEWER_USER = "plm-viewer"


def secret_file(path: Path, nbytes: int = 32) -> Path:
    """``path``, holding a random secret: written (mode 0600, in a 0700 folder) if absent,
    else kept, so a restarted server and its auth database agree."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(nbytes) + "\n")
    return path


def read_secret(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def auth_ini(auth_dir: str | Path) -> str:
    """The basic-auth app's config for a server whose state folder is ``auth_dir`` (on the
    host that runs it): its user database there, signed-in users read everything (READ),
    anonymous requests get 401. No password in it: the admin's comes through
    MLFLOW_AUTH_ADMIN_PASSWORD."""
    return (
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{Path(auth_dir) / 'basic_auth.db'}\n"
        f"admin_username = {ADMIN_USER}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )


def auth_config(auth_dir: Path) -> Path:
    """``auth_ini`` written into the state folder (MLFLOW_AUTH_CONFIG_PATH)."""
    auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ini = auth_dir / "basic_auth.ini"
    ini.write_text(auth_ini(auth_dir))
    return ini


def server_env(config: str | Path, admin_password: str, secret_key: str) -> dict[str, str]:
    """The auth server's environment (on top of this process's): the secrets by
    environment, never argv."""
    # MLflow's job execution (the GenAI evaluation and prompt jobs; an unauthenticated
    # job API was CVE-2026-0545) is off: pretraining does not use it, it adds 8
    # processes to the server, and every start leaves a folder in /dev/shm that MLflow
    # never removes. Its usage telemetry is off too, as in everything plm starts (a
    # user's own MLFLOW_DISABLE_TELEMETRY wins).
    env = {"MLFLOW_DISABLE_TELEMETRY": "true", **os.environ,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # fmt: skip
    env.update(
        MLFLOW_AUTH_CONFIG_PATH=str(config),
        MLFLOW_AUTH_ADMIN_USERNAME=ADMIN_USER,
        MLFLOW_AUTH_ADMIN_PASSWORD=admin_password,
        # The basic-auth app's CSRF key; a fixed one, so a restart keeps sessions valid.
        MLFLOW_FLASK_SERVER_SECRET_KEY=secret_key,
    )
    return env


class MlflowServer:
    def __init__(self, workdir: Path, logs: Path):
        self.backend = f"sqlite:///{workdir / 'mlflow.db'}"
        self.artifacts = workdir / "mlartifacts"
        self.auth_dir = workdir / "mlflow-auth"  # the server's secrets and its users'
        self.logs = logs
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.reader: tuple[str, Path] | None = None  # who `get` signs in as

    def password_file(self, user: str) -> Path:
        return secret_file(self.auth_dir / f"{user}.password")

    def command(self, port: int) -> list[str]:
        return [
            "mlflow", "server", "--app-name", "basic-auth",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", self.backend,
            "--serve-artifacts", "--artifacts-destination", str(self.artifacts),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        """The server's environment: secrets from the state folder's files, never argv."""
        return server_env(auth_config(self.auth_dir),
                          read_secret(self.password_file(ADMIN_USER)),
                          read_secret(secret_file(self.auth_dir / "flask_secret_key")))  # fmt: skip

    def start(self, timeout: float = 180.0, port: int | None = None) -> None:
        """Start (``port``: again on that port, as a restarted server would be)."""
        port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{port}"
        log = open(self.logs / "mlflow-server.log", "w")  # noqa: SIM115 (lives with the server)
        # Own session: the server's workers are stopped as one process group.
        self.proc = subprocess.Popen(
            self.command(port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=self.env(),
        )  # fmt: skip
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise StepFailed(f"mlflow server exited; see {self.logs / 'mlflow-server.log'}")
            try:  # /health needs no sign-in
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise StepFailed(f"mlflow server not healthy after {timeout:.0f} s")

    def as_user(self, user: str) -> dict[str, str]:
        """The variables a client of this server signs in with: the user and the file that
        holds its password (the password itself is in no environment or argv)."""
        return {"MLFLOW_TRACKING_URI": self.url, "MLFLOW_TRACKING_USERNAME": user,
                "MLFLOW_TRACKING_PASSWORD_FILE": str(self.password_file(user))}  # fmt: skip

    def make_users(self, experiment: str, model: str) -> None:
        """The job's user (EDIT on ``experiment`` and ``model``) and the viewer, by the admin."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")}  # fmt: skip
        env.update(self.as_user(ADMIN_USER))
        steps = [
            ["job", "--user", JOB_USER, "--experiment", experiment, "--model", model],
            ["viewer", "--user", VIEWER_USER],
        ]
        with open(self.logs / "mlflow-users.log", "w") as out:
            for step in steps:
                user = step[2]
                cmd = [sys.executable, "-m", "pipeline.tracking_admin", *step,
                       "--password-file", str(self.password_file(user))]  # fmt: skip
                proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=120)  # fmt: skip
                if proc.returncode != 0:
                    raise StepFailed(f"making the MLflow user {user} failed; see {out.name}")
        self.reader = (VIEWER_USER, self.password_file(VIEWER_USER))

    def get(self, path: str, **params: str) -> dict:
        """GET on the REST API (``/api/2.0/mlflow/...``), JSON in, JSON out."""
        url = f"{self.url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(params)}"
        headers = {}
        if self.reader:
            user, password_file = self.reader
            pair = f"{user}:{read_secret(password_file)}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> list[int]:
        """Stop the server's process group; returns the pids that needed SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        pgid = self.proc.pid
        killed = stop_pids(lambda: processes_in_group(pgid))
        self.proc.wait(timeout=10)
        return killed


def processes_in_group(pgid: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getpgid(int(proc.name)) == pgid:
                    pids.append(int(proc.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


# ---------------------------------------------------------------------------
# The steps


def ray_job_submit(head: RayHead, job_id: str, argv: list[str], log: Path) -> None:
    """`ray job submit` (the CLI), waiting for the job and streaming its logs to ``log``."""
    runtime_env = {"env_vars": {"PYTHONUNBUFFERED": "1"}}
    cmd = [
        "ray", "job", "submit", "--address", head.address, "--submission-id", job_id,
        "--runtime-env-json", json.dumps(runtime_env), "--entrypoint-num-cpus", "0",
        "--", *argv,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(head.auth_env())
    say(f"ray job submit ... -- {shlex.join(argv)}")
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        raise StepFailed(f"Ray job {job_id} failed (exit {proc.returncode}); see {log}")


def data_steps(head: RayHead, args: argparse.Namespace, work: Path, logs: Path) -> Path:
    tok, data = work / "tokenizer", work / "data"
    ray_job_submit(
        head,
        f"plm-tokenizer-{secrets.token_hex(3)}",
        ["plm", "data", "tokenizer", "--input", *args.input, "--kind", "wordpiece",
         "--vocab-size", str(args.vocab_size), "--output", str(tok)],
        logs / "job-tokenizer.log",
    )  # fmt: skip
    ray_job_submit(
        head,
        f"plm-prepare-{secrets.token_hex(3)}",
        ["plm", "data", "prepare", "--input", *args.input, "--tokenizer", str(tok),
         "--output", str(data), "--valid-fraction", "0.05", "--max-doc-tokens", "256"],
        logs / "job-prepare.log",
    )  # fmt: skip
    return data


def train_step(args: argparse.Namespace, data: Path, tracking: dict[str, str], work: Path,
               logs: Path):  # fmt: skip
    """Two one-rank "nodes" through launch/deepspeed_train.py --no-ssh, as two containers."""
    hostfile = work / "hostfile"
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    (port,) = free_ports(1)
    overrides = [
        f"data.path={data}", f"train.out_dir={work / 'run'}", f"train.max_steps={args.steps}",
        f"train.save_every={args.steps}", "train.eval_every=0", "train.log_every=1",
        *args.overrides,
    ]  # fmt: skip
    # The job's user, its password from its file (a password of the shell's would win).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")}  # fmt: skip
    env.update(DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONUNBUFFERED="1")
    env.update(tracking)
    procs = []
    for rank in (0, 1):
        cmd = [
            sys.executable, str(LAUNCH / "deepspeed_train.py"), "--hostfile", str(hostfile),
            "--no-ssh", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
            "--master-port", str(port), *(["--skip-dry-run"] if rank else []),
            args.config, *overrides,
        ]  # fmt: skip
        if rank == 0:
            say(f"node {rank}: {shlex.join(cmd[1:])}")
        out = open(logs / f"train-node{rank}.log", "w")  # noqa: SIM115
        procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    try:
        codes = [p.wait(timeout=1800) for p, _ in procs]
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
            out.close()
    if codes != [0, 0]:
        raise StepFailed(f"training exited {codes}; see {logs}/train-node*.log")
    return work / "run"


def check_tracking(server: MlflowServer, name: str, run_dir: Path) -> dict:
    """The run's metrics and the registered model, read back through the REST API."""
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = server.get("runs/get", run_id=run_id)["run"]
    metrics = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
    history = server.get("metrics/get-history", run_id=run_id, metric_key="loss")
    model = server.get("registered-models/get", name=name)["registered_model"]
    version = server.get("registered-models/alias", name=name, alias="current")
    return {
        "run_id": run_id,
        "experiment_id": run["info"]["experiment_id"],
        "status": run["info"]["status"],
        "metrics": metrics,
        "loss": [m["value"] for m in sorted(history["metrics"], key=lambda m: m["step"])],
        "model": model["name"],
        "version": version["model_version"]["version"],
        "model_source": version["model_version"]["source"],
    }


# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/all_in_one.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workdir", default="runs/all-in-one")
    parser.add_argument("--input", nargs="+", default=["builtin:python-docs"])
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the Ray head")
    parser.add_argument("--keep", action="store_true", help="keep Ray + MLflow up until Ctrl-C")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="for `plm train`")
    args = parser.parse_args(argv)
    config = Path(args.config)
    if not config.is_file() and (REPO_ROOT / config).is_file():
        config = REPO_ROOT / config
    if not config.is_file():
        parser.error(f"--config {args.config} does not exist")
    args.config = str(config.resolve())
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # so the finally blocks stop what we started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    head, server = RayHead(args.num_cpus, logs), MlflowServer(work, logs)
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)  # bad overrides fail here, early
    name, experiment = cfg.name, cfg.mlflow.experiment or cfg.name
    done = False
    try:
        say("starting a Ray head (token auth) and an MLflow server ...")
        head.start()
        server.start()
        server.make_users(experiment, name)
        say(f"Ray dashboard {head.address}   MLflow UI {server.url} (sign in as {VIEWER_USER} "
            f"or {ADMIN_USER}: passwords in {server.auth_dir})")  # fmt: skip
        data = data_steps(head, args, work, logs)
        say(f"data ready: {data}")
        run_dir = train_step(args, data, server.as_user(JOB_USER), work, logs)
        result = check_tracking(server, name, run_dir)
        result.update(mlflow_url=server.url, ray_address=head.address, ray_temp_dir=head.temp_dir,
                      ray_gcs_port=head.gcs_port)  # fmt: skip
        (work / "result.json").write_text(json.dumps(result, indent=2))
        say(
            f"run {result['run_id']} {result['status']}: loss {result['loss']}; "
            f"registered models:/{result['model']}@current = version {result['version']}"
        )
        from pipeline.train.tracking import ui_link

        say(f"MLflow UI, model-training view: {ui_link(server.url, result['experiment_id'])}")
        done = True
        if args.keep:
            say("--keep: Ray and MLflow stay up; Ctrl-C stops them")
            while True:
                time.sleep(3600)
    except StepFailed as err:
        say(f"FAILED: {err}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 0 if done else 130
    finally:
        say("stopping the MLflow server and the Ray head ...")
        killed = server.stop() + head.stop()
        # A clean stop needs no SIGKILL; one that did is worth a look (and took 15 s longer).
        say(f"stopped (SIGKILL needed for pids {killed})" if killed else "stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
