"""Which MLflow store a command talks to: the configured URI, else MLFLOW_TRACKING_URI, else
the local store training writes to. Below the models and fine-tuning (bundles fetch
``models:/`` and ``runs:/`` URIs from it) and the tracker (pipeline/train/tracking.py)."""

from __future__ import annotations

import os
from pathlib import Path


def default_tracking_uri() -> str:
    """What ``mlflow ui`` run in the same directory shows: sqlite:///mlflow.db in the cwd."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
