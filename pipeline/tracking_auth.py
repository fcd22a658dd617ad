"""Who plm is to an MLflow server with authentication (MLflow's basic-auth app), and
whether that user may do what a stage is about to do, asked before any work.

Credentials come from the environment only, never the command line: MLflow's own
``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (or ``MLFLOW_TRACKING_TOKEN``),
or ``MLFLOW_TRACKING_PASSWORD_FILE`` (a mounted Kubernetes Secret, a 0600 file), read here
into ``MLFLOW_TRACKING_PASSWORD``. A tracking URI with a user part
(``http://user:pass@host``) gives its user and password the same way and is used without
it, so no URI plm shows or logs carries a secret.

``check_access`` is one `plm:` line (a ConfigError, exit 2) for a wrong password (401) or
a missing permission (the user may not write the experiment or the registered model),
naming the user, the experiment and the permission needed. It asks the auth app's own
questions (``users/current``, ``users/permissions/get``): a server without the auth app,
an unreachable one or one that answers 5xx is left to the stage's usual handling
(pipeline/train/tracking.py: ``check_server``, the outage retries).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.storage import redact_uri

USER_VAR = "MLFLOW_TRACKING_USERNAME"
PASSWORD_VAR = "MLFLOW_TRACKING_PASSWORD"
PASSWORD_FILE_VAR = "MLFLOW_TRACKING_PASSWORD_FILE"
TOKEN_VAR = "MLFLOW_TRACKING_TOKEN"
# What MLflow's basic-auth app calls the levels (mlflow/server/auth/permissions.py).
WRITE_LEVELS = ("EDIT", "MANAGE")
CREDENTIALS_HINT = (
    f"{USER_VAR} and {PASSWORD_VAR} (or {PASSWORD_FILE_VAR}, a file holding the password)"
)


class AccessRefused(ConfigError):
    """The server refused this user, or this user lacks a permission the stage needs."""


# --- credentials --------------------------------------------------------------------------


def load_password_file() -> None:
    """``MLFLOW_TRACKING_PASSWORD`` from the file ``MLFLOW_TRACKING_PASSWORD_FILE`` names,
    unless the password is set already (the variable wins, as MLflow's own do)."""
    path = os.environ.get(PASSWORD_FILE_VAR)
    if not path or os.environ.get(PASSWORD_VAR):
        return
    try:
        password = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ConfigError(
            f"{PASSWORD_FILE_VAR}={path}: cannot read the MLflow password file "
            f"({err.strerror or err}); give a readable file or set {PASSWORD_VAR}"
        ) from None
    if not password:
        raise ConfigError(f"{PASSWORD_FILE_VAR}={path}: the MLflow password file is empty")
    os.environ[PASSWORD_VAR] = password


def without_credentials(uri: str) -> str:
    """``uri`` without a user part; an ``http(s)://user:pass@host`` URI's user and password
    go into MLflow's variables (where those are unset), so the requests still carry them."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, host = parts.netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    if user and not os.environ.get(USER_VAR):
        os.environ[USER_VAR] = urllib.parse.unquote(user)
        if sep and not os.environ.get(PASSWORD_VAR):
            os.environ[PASSWORD_VAR] = urllib.parse.unquote(password)
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


def prepare_credentials(uri: str) -> str:
    """The URI to use, credentials moved into the environment (``without_credentials``)
    and the password file read (``load_password_file``)."""
    uri = without_credentials(uri)
    if uri.startswith(("http://", "https://")):  # a local store has no users
        load_password_file()
    return uri


def auth_headers() -> dict[str, str]:
    """What MLflow's client sends from the environment: a token, else user and password."""
    token = os.environ.get(TOKEN_VAR)
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get(USER_VAR), os.environ.get(PASSWORD_VAR)
    if user and password:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}
    return {}


# --- the server's answers -----------------------------------------------------------------


def request(uri: str, path: str, params: dict | None = None, body: dict | None = None,
            timeout: float = 5.0) -> tuple[int, dict | str]:  # fmt: skip
    """(status, JSON or text) of one call to the server's REST API, with the environment's
    credentials. Status 0: no answer (refused, timed out, unresolvable)."""
    url = f"{uri.rstrip('/')}/{path.lstrip('/')}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    headers = auth_headers()
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read(4000).decode("utf-8", "replace")
    except (OSError, ValueError):
        return 0, ""
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def words(answer: dict | str) -> str:
    """The server's message, on one short line."""
    text = answer.get("message", json.dumps(answer)) if isinstance(answer, dict) else answer
    return " ".join(str(text).split())[:200] or "(no text)"


def current_user(uri: str) -> tuple[int, dict | str]:
    """The auth app's answer to "who am I": 200 with the user, 401, or 404 (no auth app)."""
    return request(uri, "api/2.0/mlflow/users/current")


def permission_of(uri: str, user: str, kind: str, resource_id: str) -> str | None:
    """The user's effective level on one resource (``experiment`` by id, ``registered_model``
    by name), as the server's own authorization check resolves it; None if it cannot say."""
    status, answer = request(
        uri, "api/3.0/mlflow/users/permissions/get",
        {"username": user, "resource_type": kind, "resource_id": resource_id},
    )  # fmt: skip
    return answer.get("permission") if status == 200 and isinstance(answer, dict) else None


def experiment_id(uri: str, name: str) -> str | None:
    status, answer = request(uri, "api/2.0/mlflow/experiments/get-by-name",
                             {"experiment_name": name})  # fmt: skip
    if status == 200 and isinstance(answer, dict):
        return answer["experiment"]["experiment_id"]
    return None  # none yet: any signed-in user may create one (and MANAGEs it)


def model_exists(uri: str, name: str) -> bool:
    status, _ = request(uri, "api/2.0/mlflow/registered-models/get", {"name": name})
    return status == 200


# --- the check ----------------------------------------------------------------------------


def unauthenticated(shown: str, answer: dict | str, experiment: str | None, stage: str) -> str:
    user = os.environ.get(USER_VAR)
    who = f"user {user!r}" if user and not os.environ.get(TOKEN_VAR) else (
        "plm's token" if os.environ.get(TOKEN_VAR) else "an anonymous request")  # fmt: skip
    why = ("the user name or password is wrong" if user or os.environ.get(TOKEN_VAR)
           else f"plm sent no credentials ({USER_VAR} is not set)")  # fmt: skip
    need = f" of a user with EDIT on experiment {experiment!r}" if experiment else ""
    said = words(answer).split(". ")[0].rstrip(".")  # "You are not authenticated"
    return (f"MLflow at {shown} refused {who} with HTTP 401 \"{said}\": {why}, so "
            f"{stage} does not start: give {CREDENTIALS_HINT}{need} (docs/tracking.md)")  # fmt: skip


def lacking(shown: str, user: str, have: str, what: str, stage: str) -> str:
    return (f"MLflow at {shown} gives user {user!r} {have} on {what}, and {stage} needs "
            f"EDIT there (HTTP 403 otherwise), so it does not start: run it as the job's "
            f"own user, or have an admin grant it: plm tracking user job "
            f"--user {user} ... (docs/tracking.md)")  # fmt: skip


def signed_in(uri: str, stage: str, experiment: str | None = None) -> str | None:
    """The user the server's auth app knows plm as; None when there is nothing to check
    (a local store, no auth app, no answer, an admin). A 401 is AccessRefused."""
    if not uri.startswith(("http://", "https://")):
        return None
    status, me = current_user(uri)
    if status == 401:
        raise AccessRefused(unauthenticated(redact_uri(uri), me, experiment, stage))
    if status != 200 or not isinstance(me, dict) or not isinstance(me.get("user"), dict):
        return None  # no auth app (404), an outage, or another refusal check_server explains
    return None if me["user"].get("is_admin") else me["user"].get("username") or None


def require_write(uri: str, user: str, kind: str, resource_id: str, what: str, stage: str):
    """AccessRefused unless ``user`` holds EDIT or MANAGE on the resource."""
    have = permission_of(uri, user, kind, resource_id)
    if have is not None and have not in WRITE_LEVELS:
        raise AccessRefused(lacking(redact_uri(uri), user, have, what, stage))
