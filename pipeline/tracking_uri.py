"""Which MLflow store a command talks to: the configured URI, else MLFLOW_TRACKING_URI, else
the local store training writes to. Below the models and fine-tuning (bundles fetch
``models:/`` and ``runs:/`` URIs from it) and the tracker (pipeline/train/tracking.py).

A server's credentials never stay in the URI: ``http://user:pass@host`` gives its user and
password to MLflow's variables and is used as ``http://host``, and
MLFLOW_TRACKING_PASSWORD_FILE is read into MLFLOW_TRACKING_PASSWORD
(pipeline/tracking_auth.py), so every stage that resolves its store is signed in alike."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.tracking_auth import prepare_credentials


def default_tracking_uri() -> str:
    """What ``mlflow ui`` run in the same directory shows: sqlite:///mlflow.db in the cwd."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None) -> str:
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    return prepare_credentials(uri)
