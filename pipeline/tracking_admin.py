"""The users of an MLflow server with authentication (``mlflow server --app-name
basic-auth``): a job's user and a viewer, made by its admin.

    plm tracking user job --user NAME --experiment EXP [--model MODEL]
        --password-file FILE [--generate] [--permission EDIT|MANAGE] [--tracking-uri URL]
    plm tracking user viewer --user NAME --password-file FILE [--generate]

(``python -m pipeline.tracking_admin job|viewer ...`` is the same without the CLI.)

The admin signs in as any MLflow client does, from the environment: MLFLOW_TRACKING_USERNAME
and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_PASSWORD_FILE). The new user's password
comes from ``--password-file`` (``--generate``: a new random one written there, mode 0600,
when the file does not exist), never from the command line.

- ``job``: the user, the experiment and the registered model (each made when absent, by the
  admin, so no other user can take the name first), and EDIT (or MANAGE) for the user on
  both. Under the server's default permission READ it reads everything else, and writes
  nothing else that exists.
- ``viewer``: the user, with READ on every experiment and registered model (so it reads
  everything whatever the server's default permission); it may not write any that exists.

MLflow's basic-auth app lets every signed-in user create new experiments and registered
models (without workspaces there is no grant for creating): such a user MANAGEs what it
made, and nothing else.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import urllib.parse
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.storage import redact_uri
from pipeline.tracking_auth import WRITE_LEVELS, request, words

MIN_PASSWORD = 12  # MLflow 3.17's password policy (mlflow/server/auth: _validate_password)


class AdminError(ConfigError):
    """A step the server refused; the message names it and what it said."""


def password_from(path: str | Path, generate: bool) -> str:
    """The password in ``path``; with ``generate``, a new one written there (0600) when the
    file does not exist."""
    path = Path(path)
    if generate and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    try:
        password = path.read_text(encoding="utf-8").strip()
    except OSError as err:
        raise AdminError(f"--password-file {path}: {err.strerror or err}") from None
    if len(password) < MIN_PASSWORD:
        raise AdminError(f"--password-file {path}: MLflow needs at least {MIN_PASSWORD} characters")
    return password


def call(uri: str, path: str, step: str, body: dict | None = None, params: dict | None = None,
         ok: tuple[int, ...] = (200,)) -> tuple[int, dict | str]:  # fmt: skip
    status, answer = request(uri, path, params=params, body=body, timeout=30.0)
    if status not in ok:
        said = words(answer) if status else "no answer"
        raise AdminError(f"MLflow at {redact_uri(uri)}: {step} failed (HTTP {status}: {said})")
    return status, answer


def ensure_user(uri: str, user: str, password: str) -> bool:
    """Create ``user`` unless it exists (its password is then left alone); True if made."""
    status, _ = call(uri, "api/2.0/mlflow/users/get", f"reading user {user!r}",
                     params={"username": user}, ok=(200, 404))  # fmt: skip
    if status == 200:
        return False
    call(uri, "api/2.0/mlflow/users/create", f"creating user {user!r}",
         body={"username": user, "password": password})  # fmt: skip
    return True


def ensure_experiment(uri: str, name: str) -> str:
    status, answer = call(uri, "api/2.0/mlflow/experiments/get-by-name",
                          f"reading experiment {name!r}", params={"experiment_name": name},
                          ok=(200, 404))  # fmt: skip
    if status == 200:
        return answer["experiment"]["experiment_id"]
    _, answer = call(uri, "api/2.0/mlflow/experiments/create", f"creating experiment {name!r}",
                     body={"name": name})  # fmt: skip
    return answer["experiment_id"]


def ensure_model(uri: str, name: str) -> None:
    status, _ = call(uri, "api/2.0/mlflow/registered-models/get",
                     f"reading registered model {name!r}", params={"name": name},
                     ok=(200, 404))  # fmt: skip
    if status == 404:
        call(uri, "api/2.0/mlflow/registered-models/create",
             f"creating registered model {name!r}", body={"name": name})  # fmt: skip


def grant(uri: str, user: str, kind: str, resource_id: str, permission: str) -> None:
    """MLflow 3.17's per-user grant (its older experiments/permissions/create is gone); a
    grant that exists is replaced, so running a step again sets the level it names."""
    step = f"granting {user!r} {permission} on {kind} {resource_id!r}"
    body = {"username": user, "resource_type": kind, "resource_id": resource_id}
    path = "api/3.0/mlflow/users/permissions/grant"
    status, answer = call(uri, path, step, body={**body, "permission": permission},
                          ok=(200, 400))  # fmt: skip
    if status == 400 and "already exists" in words(answer):
        call(uri, "api/3.0/mlflow/users/permissions/revoke", step, body=body)
        call(uri, path, step, body={**body, "permission": permission})
    elif status == 400:
        raise AdminError(f"MLflow at {redact_uri(uri)}: {step} failed (HTTP 400: {words(answer)})")


def make_job_user(uri: str, user: str, password: str, experiment: str, model: str,
                  permission: str = "EDIT") -> dict:  # fmt: skip
    """The job's user: ``permission`` on its experiment and registered model, nothing more."""
    if permission not in WRITE_LEVELS:
        raise AdminError(f"--permission {permission}: a job's user needs EDIT or MANAGE")
    made = ensure_user(uri, user, password)
    exp_id = ensure_experiment(uri, experiment)
    ensure_model(uri, model)
    grant(uri, user, "experiment", exp_id, permission)
    grant(uri, user, "registered_model", model, permission)
    return {"user": user, "created": made, "experiment_id": exp_id, "model": model,
            "permission": permission}  # fmt: skip


def make_viewer(uri: str, user: str, password: str) -> dict:
    """The viewer: READ on every experiment and registered model."""
    made = ensure_user(uri, user, password)
    for kind in ("experiment", "registered_model"):
        grant(uri, user, kind, "*", "READ")
    return {"user": user, "created": made, "permission": "READ"}


ROLES = {
    "job": "a job's user: EDIT (or MANAGE) on its own experiment and registered model",
    "viewer": "a viewer: READ on every experiment and registered model, writes nothing",
}
NO_PASSWORD_ARG = (
    "passwords never go on the command line (every process list shows it): "
    "give --password-file FILE (--generate: a new one written there)"
)


class _RefusePassword(argparse.Action):
    """``--password X``: refused without echoing X (argparse's own error would print it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {NO_PASSWORD_ARG}")


def add_role_parsers(sub, path_arg=None) -> None:
    """The ``job`` and ``viewer`` commands, on ``sub`` (this module's parser, or `plm
    tracking user`'s, whose ``path_arg`` registers a local-path flag: a URI refused). No
    abbreviations: ``--password`` must not stand for ``--password-file``."""
    path_arg = path_arg or (lambda p, *flags, **kw: p.add_argument(*flags, **kw))
    for role, text in ROLES.items():
        p = sub.add_parser(role, help=text, description=text, allow_abbrev=False)
        p.add_argument("--user", required=True)
        path_arg(p, "--password-file", required=True,
                 help="the new user's password (never on the command line)")  # fmt: skip
        p.add_argument("--generate", action="store_true",
                       help="write a new random password there (0600) if the file is absent")  # fmt: skip
        p.add_argument("--password", nargs="?", action=_RefusePassword, help=argparse.SUPPRESS)
        p.add_argument("--tracking-uri", help="the server (default: MLFLOW_TRACKING_URI)")
        if role == "job":
            p.add_argument("--experiment", required=True)
            p.add_argument("--model", help="the registered model (default: the experiment)")
            p.add_argument("--permission", default="EDIT", choices=WRITE_LEVELS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.tracking_admin",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    add_role_parsers(parser.add_subparsers(dest="role", required=True))
    return parser.parse_args(argv)


def server_uri(given: str | None) -> str:
    """The server to talk to; a ``--tracking-uri`` with a user part is refused (argv is in
    every process list), MLFLOW_TRACKING_URI's is moved into MLflow's variables."""
    from pipeline.tracking_uri import resolve_tracking_uri

    if given and "@" in urllib.parse.urlsplit(given).netloc:
        raise AdminError(f"--tracking-uri={redact_uri(given)}: a URI on the command line may "
                         "not carry a user part (every process list shows it): give it without "
                         "and sign in with MLFLOW_TRACKING_USERNAME and "
                         "MLFLOW_TRACKING_PASSWORD_FILE")  # fmt: skip
    uri = resolve_tracking_uri(given)
    if not uri.startswith(("http://", "https://")):
        raise AdminError(f"{uri}: users live on an MLflow server; give --tracking-uri URL")
    return uri


def run(args: argparse.Namespace) -> int:
    """Make the user ``args`` names; an AdminError (a ConfigError) for what went wrong."""
    uri = server_uri(args.tracking_uri)
    password = password_from(args.password_file, args.generate)
    if args.role == "job":
        done = make_job_user(uri, args.user, password, args.experiment,
                             args.model or args.experiment, args.permission)  # fmt: skip
        print(f"user {done['user']!r} ({'created' if done['created'] else 'existed'}): "
              f"{done['permission']} on experiment {args.experiment!r} (id "
              f"{done['experiment_id']}) and registered model {done['model']!r}")  # fmt: skip
    else:
        done = make_viewer(uri, args.user, password)
        print(f"user {done['user']!r} ({'created' if done['created'] else 'existed'}): "
              "READ on every experiment and registered model")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except ConfigError as err:
        print(f"plm: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
