"""Which MLflow store a command talks to: the configured URI, else MLFLOW_TRACKING_URI, else
the local store training writes to. Below the models and fine-tuning (bundles fetch
``models:/`` and ``runs:/`` URIs from it) and the tracker (pipeline/train/tracking.py).

A server's credentials never stay in the URI: ``http://user:pass@host`` gives its user and
password to MLflow's variables and is used as ``http://host``, and
MLFLOW_TRACKING_PASSWORD_FILE is read into MLFLOW_TRACKING_PASSWORD
(pipeline/tracking_auth.py), so every stage that resolves its store is signed in alike;
``check_access`` asks the server, before any work, whether that user may do what the stage
will."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.tracking_auth import (
    experiment_id,
    model_exists,
    prepare_credentials,
    require_write,
    signed_in,
)


def default_tracking_uri() -> str:
    """What ``mlflow ui`` run in the same directory shows: sqlite:///mlflow.db in the cwd."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None) -> str:
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    return prepare_credentials(uri)


def check_access(
    tracking_uri: str | None,
    experiment: str | None = None,
    model: str | None = None,
    stage: str = "training",
    write: bool = True,
) -> None:
    """Before any work: the server knows this user (else 401: AccessRefused), and, when the
    stage will ``write``, the user holds EDIT or MANAGE on ``experiment`` and ``model`` (the
    registered model), each that exists: one that does not exist yet any signed-in user may
    create, and then MANAGEs. Nothing for a local store, a server without the auth app, or
    one that does not answer."""
    uri = resolve_tracking_uri(tracking_uri)
    user = signed_in(uri, stage, experiment)
    if user is None or not write:
        return
    if experiment and (exp_id := experiment_id(uri, experiment)):
        what = f"experiment {experiment!r} (id {exp_id})"
        require_write(uri, user, "experiment", exp_id, what, stage)
    if model and model_exists(uri, model):
        what = f"registered model {model!r} (of experiment {experiment!r})"
        require_write(uri, user, "registered_model", model, what, stage)
