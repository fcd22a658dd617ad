"""The cluster paths on one machine: a Ray head, an MLflow server, two training "nodes".

    python launch/all_in_one.py [--workdir runs/all-in-one] [--input builtin:python-docs]
                                [--config configs/test/bert-tiny.yaml] [--steps 6]
                                [--keep] [key=value ...]

What it does, each step the way a real cluster does it:
1. `ray start --head` with token authentication (a fresh token in the head's temp dir),
   its own ports, and 127.0.0.1 for the dashboard;
2. `mlflow server` with a sqlite backend and an artifact folder, bound to 127.0.0.1;
3. `ray job submit` of `plm data tokenizer`, then of `plm data prepare` (the job joins
   the head's cluster through RAY_ADDRESS, as on a real cluster);
4. `plm train` as two "nodes" of one rank each, through the `deepspeed` launcher's
   per-node form (`--no_ssh --node_rank R --master_addr 127.0.0.1`, what a container
   runs), logging to the MLflow server and registering the model;
5. reads the run's metrics and the registered model back through MLflow's REST API.

Everything it starts is stopped at the end, also on Ctrl-C or an error: the Ray
processes by their private temp dir (never `ray stop`, which stops every Ray on the
machine), the MLflow server by its process group. ``--keep`` leaves the head and the
server up until Ctrl-C so the Ray dashboard and the MLflow UI can be browsed.
Outputs and logs go under the workdir; the exit status is 0 when every step worked.
"""

from __future__ import annotations

import argparse
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


class MlflowServer:
    def __init__(self, workdir: Path, logs: Path):
        self.backend = f"sqlite:///{workdir / 'mlflow.db'}"
        self.artifacts = workdir / "mlartifacts"
        self.logs = logs
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 180.0, port: int | None = None) -> None:
        """Start (``port``: again on that port, as a restarted server would be)."""
        port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", self.backend,
            "--serve-artifacts", "--artifacts-destination", str(self.artifacts),
        ]  # fmt: skip
        log = open(self.logs / "mlflow-server.log", "w")  # noqa: SIM115 (lives with the server)
        # MLflow's job execution (the GenAI evaluation and prompt jobs) is off unless asked
        # for: pretraining does not use it, it adds 8 processes to the server, and every
        # start leaves a folder in /dev/shm that MLflow never removes.
        # Its usage telemetry is off too, as in everything plm starts (a user's own
        # MLFLOW_DISABLE_TELEMETRY wins).
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
               **os.environ}  # fmt: skip
        # Own session: the server's workers are stopped as one process group.
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise StepFailed(f"mlflow server exited; see {self.logs / 'mlflow-server.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise StepFailed(f"mlflow server not healthy after {timeout:.0f} s")

    def get(self, path: str, **params: str) -> dict:
        """GET on the REST API (``/api/2.0/mlflow/...``), JSON in, JSON out."""
        url = f"{self.url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
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


def train_step(args: argparse.Namespace, data: Path, tracking_uri: str, work: Path, logs: Path):
    """Two one-rank "nodes" through launch/deepspeed_train.py --no-ssh, as two containers."""
    hostfile = work / "hostfile"
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    (port,) = free_ports(1)
    overrides = [
        f"data.path={data}", f"train.out_dir={work / 'run'}", f"train.max_steps={args.steps}",
        f"train.save_every={args.steps}", "train.eval_every=0", "train.log_every=1",
        *args.overrides,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    env.update(MLFLOW_TRACKING_URI=tracking_uri, PYTHONUNBUFFERED="1")
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
    history = server.get("metrics/get-history", run_id=run_id, metric_key="step_loss")
    model = server.get("registered-models/get", name=name)["registered_model"]
    version = server.get("registered-models/alias", name=name, alias="current")
    return {
        "run_id": run_id,
        "experiment_id": run["info"]["experiment_id"],
        "status": run["info"]["status"],
        "metrics": metrics,
        "step_loss": [m["value"] for m in sorted(history["metrics"], key=lambda m: m["step"])],
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

    name = load_config(args.config, args.overrides).name  # bad overrides fail here, early
    done = False
    try:
        say("starting a Ray head (token auth) and an MLflow server ...")
        head.start()
        server.start()
        say(f"Ray dashboard {head.address}   MLflow UI {server.url}")
        data = data_steps(head, args, work, logs)
        say(f"data ready: {data}")
        run_dir = train_step(args, data, server.url, work, logs)
        result = check_tracking(server, name, run_dir)
        result.update(mlflow_url=server.url, ray_address=head.address, ray_temp_dir=head.temp_dir,
                      ray_gcs_port=head.gcs_port)  # fmt: skip
        (work / "result.json").write_text(json.dumps(result, indent=2))
        say(
            f"run {result['run_id']} {result['status']}: step_loss {result['step_loss']}; "
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
