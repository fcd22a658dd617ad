"""The schema of a new sqlite MLflow store, as MLflow's own migrations leave it: the SQL
in mlflow_schema.sql (package data), the versions it was taken from here. Both are
written by `python -m pipeline.train.mlflow_store`; see mlflow_store.py."""

from pathlib import Path

MLFLOW_VERSION = "3.17.2"
ALEMBIC_HEAD = "dc11669786a5"
SCHEMA_FILE = Path(__file__).with_name("mlflow_schema.sql")


def schema() -> str:
    return SCHEMA_FILE.read_text(encoding="utf-8")
