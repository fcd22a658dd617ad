"""Multi-node `plm train` through the `deepspeed` launcher: validate, propagate env, launch.

    # every node from one place, over ssh (pdsh), a hostfile with lines `worker-1 slots=8`:
    python launch/deepspeed_train.py --hostfile hostfile CONFIG [key=value ...]
    # one call per node, no ssh (containers, Kubernetes, Slurm steps):
    python launch/deepspeed_train.py --hostfile hostfile --no-ssh --node-rank R \\
        --master-addr NODE0_ADDR CONFIG [key=value ...]
    # one node:
    python launch/deepspeed_train.py --num-gpus 8 CONFIG [key=value ...]

Before anything starts it checks the hostfile (each line `HOST slots=N`) and runs
`plm train CONFIG --dry-run` with the world size the launch will have, so a bad config
key or a missing data dir fails here, not on 64 GPUs.

Environment: over ssh the remote ranks do not inherit this shell. DeepSpeed forwards
variables starting with NCCL (GPU), PYTHON and MLFLOW, plus the KEY=VALUE lines of
``.deepspeed_env`` in the home and the current folder. This script adds a generated env
file (``DS_ENV_FILE``) holding those lines plus the variables named by ``--export``
(defaults: DS_ACCELERATOR, OMP_NUM_THREADS, TORCH_*, GLOO_*, CUDA_DEVICE_MAX_CONNECTIONS,
HF_HOME, PLM_*, MALLOC_*, and the object store's AWS_ENDPOINT_URL*, AWS_REGION, AWS_DEFAULT_REGION,
AWS_PROFILE). Names that look like secrets (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) are
never written to the file; give those to the nodes another way (~/.aws/credentials). With ``--no-ssh`` each node's own environment is used as is.

MLflow's secrets follow the AWS keys: they never travel. DeepSpeed itself forwards every
MLFLOW* variable on the pdsh command line, so a launch over ssh with
``MLFLOW_TRACKING_PASSWORD`` or ``MLFLOW_TRACKING_TOKEN`` set (in the environment or a
.deepspeed_env) stops before anything starts, with one ``plm:`` line: give every host the
password as a file at the same path, ``MLFLOW_TRACKING_PASSWORD_FILE`` (only the path travels).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_PORT = 29500
DEFAULT_EXPORTS = (
    "DS_ACCELERATOR",
    "OMP_NUM_THREADS",
    "TORCH_*",
    "GLOO_*",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "HF_HOME",
    "PLM_*",
    # glibc's allocator settings (MALLOC_MMAP_THRESHOLD_: docs/training.md, a model that
    # does not fit one host)
    "MALLOC_*",
    # Where the object store is (data.path=s3://...); the keys are secrets and stay out:
    # each node has its own (~/.aws/credentials, an instance role, a pod's service account).
    "AWS_ENDPOINT_URL*",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)
# Written to a file on disk and put on the pdsh command line: keep credentials out.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_)", re.I)
CREDENTIALS_IN_URI = re.compile(r"://[^/@\s]*:[^/@\s]*@")  # http://user:pass@host
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")
ENV_FILE_NAME = ".deepspeed_env"


class LaunchError(Exception):
    """A launch that cannot work as given; the message says what to change."""

    prefix = "deepspeed_train"


class SecretOnCommandLine(LaunchError):
    """An MLflow secret that DeepSpeed's pdsh launcher would put on every host's command line."""

    prefix = "plm"  # what a sign-in problem of plm train says too (pipeline/tracking_auth.py)


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order; the format DeepSpeed's runner accepts, checked per line."""
    path = Path(path)
    if not path.is_file():
        raise LaunchError(f"hostfile {path} does not exist")
    hosts: dict[str, int] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = HOSTFILE_LINE.match(line)
        if not m:
            raise LaunchError(f"{path}:{n}: expected `HOST slots=N` (e.g. `worker-1 slots=8`)")
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:
            raise LaunchError(f"{path}:{n}: host {host} is listed twice")
        if slots < 1:
            raise LaunchError(f"{path}:{n}: slots must be at least 1")
        hosts[host] = slots
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no host")
    return hosts


def world_size(hosts: dict[str, int] | None, num_gpus: int | None, num_nodes: int | None) -> int:
    """Ranks the launch starts: slots per host, capped by --num-gpus, over --num-nodes hosts."""
    if hosts is None:
        if not num_gpus:
            raise LaunchError("pass --hostfile, or --num-gpus N for one node")
        return num_gpus
    slots = list(hosts.values())[: num_nodes or None]
    return sum(min(s, num_gpus) if num_gpus else s for s in slots)


def exported_env(env: dict[str, str], patterns: list[str]) -> dict[str, str]:
    """The variables of ``env`` matching ``patterns`` (NAME or PREFIX*), secrets left out."""
    out = {}
    for name, value in sorted(env.items()):
        wanted = any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)
        if wanted and not SECRET_NAME.search(name) and "\n" not in value:
            out[name] = value
    return out


def existing_env_lines(cwd: Path) -> list[str]:
    """KEY=VALUE lines of the .deepspeed_env files DeepSpeed itself would read."""
    lines = []
    for folder in (Path.home(), cwd):
        f = folder / ENV_FILE_NAME
        if f.is_file():
            lines += [x for x in f.read_text().splitlines() if "=" in x]
    return lines


def write_env_file(path: Path, cwd: Path, extra: dict[str, str]) -> Path:
    """The users' .deepspeed_env lines, then ours for names they did not set."""
    lines = existing_env_lines(cwd)
    taken = {x.split("=", 1)[0].strip() for x in lines}
    lines += [f"{k}={v}" for k, v in extra.items() if k not in taken]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    return path


def over_pdsh(args: argparse.Namespace, hosts: dict[str, int] | None) -> bool:
    """Whether DeepSpeed's runner starts the ranks through pdsh: more than one active host
    and ssh (its ``multi_node_exec``); one host runs locally, in this environment."""
    return bool(hosts) and not args.no_ssh and len(list(hosts)[: args.num_nodes or None]) > 1


def refuse_mlflow_secrets(env: dict[str, str], cwd: Path) -> None:
    """SecretOnCommandLine if an MLflow password or token would be exported over pdsh:
    DeepSpeed forwards every MLFLOW* variable and .deepspeed_env line as ``export K=V;`` on
    the pdsh command line, seen in the process lists of this host and every host's sshd.
    A *_FILE variable names a path and may travel; a URI may not carry ``user:pass@``."""
    lines = dict(x.split("=", 1) for x in existing_env_lines(cwd))
    mlflow = {k.strip(): v for k, v in {**lines, **env}.items() if k.strip().startswith("MLFLOW")}
    found = sorted(k for k, v in mlflow.items()
                   if (SECRET_NAME.search(k) and not k.endswith("_FILE"))
                   or CREDENTIALS_IN_URI.search(v))  # fmt: skip
    if not found:
        return
    raise SecretOnCommandLine(
        f"{', '.join(found)} set: DeepSpeed's pdsh launcher would put its value on the ssh "
        "command line of every host (their process lists and this one's), so the launch "
        "does not start: unset it and sign in with MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD_FILE, a file holding the password at the same path on "
        "every host (mode 0600; only its path travels), or launch each node with --no-ssh "
        "(docs/tracking.md)"
    )


def deepspeed_argv(args: argparse.Namespace) -> list[str]:
    """The `deepspeed` launcher command (as `python -m deepspeed.launcher.runner`)."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if args.hostfile:
        cmd += ["--hostfile", str(args.hostfile)]
    if args.num_nodes:
        cmd += ["--num_nodes", str(args.num_nodes)]
    if args.num_gpus:
        cmd += ["--num_gpus", str(args.num_gpus)]
    cmd += ["--master_port", str(args.master_port)]
    if args.master_addr:
        cmd += ["--master_addr", args.master_addr]
    if args.no_ssh:
        cmd += ["--no_ssh", "--node_rank", str(args.node_rank)]
    cmd += ["--module", "pipeline.cli", "train", args.config, *args.overrides]
    return cmd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/deepspeed_train.py",
        description="`plm train` on one or many nodes through the deepspeed launcher.",
    )
    parser.add_argument("config", help="experiment YAML (the same path on every node)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--hostfile", help="lines `HOST slots=N`; without it: this node only")
    parser.add_argument("--num-gpus", type=int, help="ranks per node (default: all slots)")
    parser.add_argument("--num-nodes", type=int, help="use the first N hosts of the hostfile")
    parser.add_argument("--master-addr", help="address of the first host (required: --no-ssh)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--no-ssh", action="store_true", help="launch only this node's ranks (run on every node)"
    )
    parser.add_argument("--node-rank", type=int, help="this node's index in the hostfile")
    parser.add_argument(
        "--export",
        action="append",
        default=list(DEFAULT_EXPORTS),
        metavar="NAME|PREFIX*",
        help="also forward these variables to the ranks over ssh (repeatable)",
    )
    parser.add_argument(
        "--skip-dry-run", action="store_true", help="do not run `plm train --dry-run` first"
    )
    parser.add_argument(
        "--print-only", action="store_true", help="print the launcher command, start nothing"
    )
    args = parser.parse_args(argv)
    if args.no_ssh:
        if not args.hostfile:
            parser.error("--no-ssh needs --hostfile (every node's slots make up the world)")
        if args.node_rank is None or not args.master_addr:
            parser.error("--no-ssh needs --node-rank and --master-addr (the first node's address)")
    elif args.node_rank is not None:
        parser.error("--node-rank only goes with --no-ssh")
    return args


def dry_run(args: argparse.Namespace, world: int) -> None:
    """`plm train --dry-run` in this environment, with the launch's world size."""
    env = {**os.environ, "WORLD_SIZE": str(world)}
    cmd = [sys.executable, "-m", "pipeline.cli", "train", args.config, *args.overrides]
    proc = subprocess.run([*cmd, "--dry-run"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"`plm train --dry-run` refused the run:\n{proc.stderr.strip()}")
    print(proc.stdout, end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        hosts = parse_hostfile(args.hostfile) if args.hostfile else None
        if hosts and args.no_ssh and not 0 <= args.node_rank < len(hosts):
            raise LaunchError(
                f"--node-rank {args.node_rank} is outside the hostfile's {len(hosts)} hosts"
            )
        world = world_size(hosts, args.num_gpus, args.num_nodes)
        cmd = deepspeed_argv(args)
        env = dict(os.environ)
        if over_pdsh(args, hosts):
            refuse_mlflow_secrets(env, Path.cwd())
        if hosts and not args.no_ssh:
            # Only this process reads it (pdsh puts the exports on the remote command line).
            env_file = Path(tempfile.mkdtemp(prefix="plm-dsenv-")) / ENV_FILE_NAME
            write_env_file(env_file, Path.cwd(), exported_env(env, args.export))
            env["DS_ENV_FILE"] = str(env_file)  # absolute: replaces ~/ and ./.deepspeed_env
            print(f"environment for the remote ranks: {env_file}", file=sys.stderr)
        shown = shlex.join(["deepspeed", *cmd[3:]])
        if args.print_only:
            print(shown)
            return 0
        if not args.skip_dry_run:
            dry_run(args, world)
    except LaunchError as err:
        print(f"{err.prefix}: {err}", file=sys.stderr)
        return 2
    print(f"world size {world}: {shown}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
