"""Submit `plm data prepare` (or `plm data tokenizer`, or `plm eval`) to a Ray cluster
as a Ray job, follow its logs, exit with its status.

    python launch/ray_submit.py [--address http://HEAD:8265] [--stage prepare|tokenizer|eval]
                                [--job-id ID] [--no-wait] [--installed] [--env KEY=VALUE]
                                -- ARGS...

Everything after ``--`` goes to `plm data <stage>` (`plm eval` for eval) on the cluster
(paths there are the cluster's: use absolute paths or URIs such as s3://... that every node
can read; `plm eval`'s bundles and task files need only be on the driver's node, the head).
Exit status: 0 the job succeeded (or was submitted, with --no-wait), 1 it failed or was
stopped, or the cluster was lost while it ran (one `plm:` line says what to do), 2 the
cluster refused or could not be reached.

The code travels as the job's ``working_dir`` (this repository, without caches and run
outputs) unless ``--installed`` says the cluster's image already has the package.

Token authentication (Ray >= 2.52): a cluster started with RAY_AUTH_MODE=token (or,
since Ray 2.59, a ``ray start --head`` that finds a token) rejects requests without
the token. The Ray client sends it when RAY_AUTH_MODE=token is set in this process; it
reads the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else
~/.ray/auth_token. This script turns token mode on when such a token exists and
RAY_AUTH_MODE is unset; it never turns authentication off. Without a token a protected
cluster answers 401 and the script says how to provide one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Not shipped with the job: VCS data, caches, run outputs, local data.
EXCLUDES = [
    ".git",
    "**/__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".benchmarks",
    # Anchored at the repository root ("data" alone would also drop pipeline/data).
    "/runs",
    "/mlruns",
    "/mlflow.db",
    "/demo",
    "/data",
    "/.venv",
]
DEFAULT_TOKEN_PATH = Path.home() / ".ray" / "auth_token"
STAGES = ("prepare", "tokenizer", "eval")  # the commands a job can run (eval: `plm eval`)
STATUS_TRIES = 3  # status requests failing in a row (2 s apart): the cluster is lost


def entrypoint_argv(stage: str, installed: bool, stage_args: list[str]) -> list[str]:
    """The job's command: the installed `plm`, or the shipped working_dir's copy of the CLI."""
    head = ["plm"] if installed else ["python", "-m", "pipeline.cli"]
    command = ["eval"] if stage == "eval" else ["data", stage]
    return [*head, *command, *stage_args]


def command_name(stage: str) -> str:
    return "plm eval" if stage == "eval" else f"plm data {stage}"


def token_source() -> str | None:
    """Where the Ray client would find a token, or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        if not Path(path).is_file():
            raise SystemExit(f"ray_submit: RAY_AUTH_TOKEN_PATH={path} does not exist")
        return f"RAY_AUTH_TOKEN_PATH={path}"
    if DEFAULT_TOKEN_PATH.is_file() and DEFAULT_TOKEN_PATH.read_text().strip():
        return str(DEFAULT_TOKEN_PATH)
    return None


def configure_auth() -> str:
    """Decide the client's auth mode before Ray reads it; return a line saying which."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        if mode.lower() == "token" and token_source() is None:
            raise SystemExit(
                "ray_submit: RAY_AUTH_MODE=token but no token found: set RAY_AUTH_TOKEN or "
                f"RAY_AUTH_TOKEN_PATH, or put the cluster's token in {DEFAULT_TOKEN_PATH} "
                "(`ray get-auth-token` on the head prints it)"
            )
        return f"auth: RAY_AUTH_MODE={mode} (as set)"
    found = token_source()
    if found is None:
        return "auth: no token found; requests go without one"
    os.environ["RAY_AUTH_MODE"] = "token"  # must happen before Ray reads its config
    return f"auth: token from {found}"


def git_ignored(root: Path) -> list[str]:
    """What git ignores in the checkout at ``root`` (.gitignore, .git/info/exclude, the
    global excludes), as anchored patterns: folders collapsed (``/mlruns/``). Ray's upload
    reads .gitignore files only, so a run's output named in .git/info/exclude (or a stray
    folder a tool left) would otherwise travel too, past Ray's 100 MiB limit on a package.
    [] where ``root`` is no git checkout or git is missing."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--others", "--ignored", "--exclude-standard",
             "--directory", "-z"],
            capture_output=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return ["/" + p for p in out.stdout.decode(errors="replace").split("\0") if p]


def build_runtime_env(installed: bool, env_vars: dict[str, str] | None = None) -> dict:
    env: dict = {"env_vars": {"PYTHONUNBUFFERED": "1", **(env_vars or {})}}
    if not installed:
        env["working_dir"] = str(REPO_ROOT)
        env["excludes"] = [*EXCLUDES, *(x for x in git_ignored(REPO_ROOT) if x not in EXCLUDES)]
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        own, prepare_args = argv[:cut], argv[cut + 1 :]
    else:
        own, prepare_args = argv, []
    parser = argparse.ArgumentParser(
        prog="launch/ray_submit.py",
        description="Submit `plm data STAGE ARGS` or `plm eval ARGS` (after --) to a Ray cluster "
        "as a job.",
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="the cluster's dashboard address, e.g. http://HEAD:8265 (default: RAY_ADDRESS)",
    )
    parser.add_argument(
        "--stage",
        choices=list(STAGES),
        default="prepare",
        help="which command the job runs: `plm data prepare|tokenizer` or `plm eval` "
        "(default: prepare)",
    )
    parser.add_argument("--job-id", help="submission id (default: plm-<stage>-<time>-<random>)")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the job (repeatable); never put secrets here: "
        "they would show in the job's metadata, give them to the cluster's pods instead",
    )
    parser.add_argument("--no-wait", action="store_true", help="submit and return at once")
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="also show Ray's INFO lines (packaging the working_dir, the log stream's end)",
    )  # fmt: skip
    parser.add_argument(
        "--installed",
        action="store_true",
        help="the cluster has plm-pipeline installed: ship no working_dir",
    )
    parser.add_argument(
        "--entrypoint-num-cpus",
        type=float,
        default=0,
        help="CPUs reserved for the job's driver (default 0: the driver is light)",
    )
    args = parser.parse_args(own)
    if not prepare_args:
        parser.error(f"nothing to run: pass the `{command_name(args.stage)}` arguments after --")
    bad = [item for item in args.env if "=" not in item or item.startswith("=")]
    if bad:
        parser.error(f"--env takes KEY=VALUE, got {bad[0]!r}")
    args.env_vars = dict(item.split("=", 1) for item in args.env)
    if not args.address:
        parser.error("no cluster: pass --address http://HEAD:8265 or set RAY_ADDRESS")
    args.prepare_args = prepare_args
    return args


async def _follow(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)


class ClusterLost(Exception):
    """The cluster stopped answering while the job ran (its head is down)."""


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What the job SDK raises when the head is gone: the log stream's RuntimeError (closed
    abnormally) or aiohttp's errors, and requests' ConnectionError (an OSError)."""
    import aiohttp

    return (OSError, RuntimeError, aiohttp.ClientError, asyncio.TimeoutError)


def _wait(client, job_id: str):
    """Follow the job's logs, then its status until it ends; the final JobInfo. A broken
    log stream alone is not the end (the status is asked next); ClusterLost when the
    status cannot be had either."""
    from ray.job_submission import JobStatus

    errors = _connection_errors()
    try:
        asyncio.run(_follow(client, job_id))
    except errors:
        pass  # the status below says whether the cluster is still there
    ended = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    failures = 0
    while True:
        try:
            info = client.get_job_info(job_id)
        except errors as err:
            failures += 1
            if failures >= STATUS_TRIES:  # a blip passes; a head that is down does not
                raise ClusterLost(_reason(err)) from None
            time.sleep(2)
            continue
        failures = 0
        if info.status in ended:
            return info
        time.sleep(1)


def _reason(err: BaseException) -> str:
    """A few words for why the status request failed (requests' own text is a page)."""
    text = str(err).lower()
    for words, reason in (
        ("refused", "connection refused"),
        ("timed out", "timed out"),
        ("name or service", "unknown host"),
        ("unreachable", "network unreachable"),
    ):
        if words in text:
            return reason
    return type(err).__name__


def lost_cluster_line(address: str, job_id: str, stage: str, reason: str) -> str:
    """The one line for a head lost mid-job: what happened and what to do."""
    kept = {
        "prepare": "units the job finished are kept in the output and not redone",
        "tokenizer": "the tokenizer is trained again from the start",
        "eval": "the suite is scored again from the start",
    }[stage]
    return (
        f"plm: lost the Ray cluster at {address} while job {job_id} ran (its dashboard: "
        f"{reason}); its head, and the job's driver with it, is down: start a head "
        f"(ray start --head) and its workers again, then rerun this same command: {kept}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(configure_auth(), file=sys.stderr)
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobStatus, JobSubmissionClient

    if not args.verbose:
        # Ray's own lines about zipping and uploading the code and closing the log stream
        # (INFO, and a WARNING that .git is left out, which EXCLUDES does anyway): its
        # handler on the "ray" logger shows errors only; the job's fate is printed below.
        for handler in logging.getLogger("ray").handlers:
            handler.setLevel(logging.ERROR)

    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    job_id = args.job_id or f"plm-{args.stage}-{stamp}"
    entrypoint = shlex.join(entrypoint_argv(args.stage, args.installed, args.prepare_args))
    try:
        client = JobSubmissionClient(args.address)
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=job_id,
            runtime_env=build_runtime_env(args.installed, args.env_vars),
            entrypoint_num_cpus=args.entrypoint_num_cpus,
            metadata={"tool": "plm-pipeline", "stage": command_name(args.stage)[4:]},
        )
    except AuthenticationError as err:
        print(
            f"ray_submit: {args.address} refused the request: {err}\n"
            "The cluster requires its token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to "
            f"a file holding it, or copy it to {DEFAULT_TOKEN_PATH} (`ray get-auth-token` on "
            "the head prints it).",
            file=sys.stderr,
        )
        return 2
    except (RuntimeError, ConnectionError, ValueError) as err:
        text = str(err)
        if "401" in text or "403" in text:
            text += (
                "\nThe cluster requires its token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to "
                f"a file holding it, or copy it to {DEFAULT_TOKEN_PATH} (`ray get-auth-token` on "
                "the head prints it)."
            )
        print(f"ray_submit: cannot submit to {args.address}: {text}", file=sys.stderr)
        return 2
    print(f"submitted job {job_id} to {args.address}: {entrypoint}", file=sys.stderr)
    if args.no_wait:
        print(job_id)
        return 0
    try:
        info = _wait(client, job_id)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on (ray job stop {job_id})", file=sys.stderr)
        return 130
    except ClusterLost as err:
        print(lost_cluster_line(args.address, job_id, args.stage, str(err)), file=sys.stderr)
        return 1
    print(f"job {job_id}: {info.status.value}", file=sys.stderr)
    if info.status != JobStatus.SUCCEEDED:
        if info.message:
            print(f"job {job_id}: {info.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
