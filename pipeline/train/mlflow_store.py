"""A new sqlite MLflow store in one step, instead of MLflow's 68 migrations.

MLflow makes a new sqlite store by creating its first schema and replaying every alembic
migration since (``mlflow.store.db.utils._initialize_tables``), seconds on every new
``mlflow.db``. What those migrations leave for the pinned MLflow is recorded in
pipeline/train/mlflow_schema.sql (SQLite's own dump of a store MLflow made: tables,
indexes, trigger, the ``alembic_version`` stamp and the default workspace row), and
``create_new_store`` writes that in one transaction. The result is the same database, so
``mlflow ui`` / ``mlflow server`` open it (the head revision is what they check) and a
later MLflow's ``mlflow db upgrade`` migrates it from the stamped revision.

Only a store that does not exist yet, and only under the MLflow version the schema was
taken from: anything else is left to MLflow. Regenerate the schema after an MLflow
upgrade with ``python -m pipeline.train.mlflow_store`` (tests/unit/test_tracking_store.py fails until then, and a run meanwhile takes MLflow's migrations).
"""

from __future__ import annotations

import os
import re
import sqlite3
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SCHEMA_MODULE = Path(__file__).with_name("mlflow_schema.py")


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` tracking URI; None for anything else (a server, an
    in-memory database, a URI with query options)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or "?" in uri or len(uri) == len(prefix):
        return None
    return Path(uri[len(prefix) :])


def _installed_mlflow() -> str | None:
    try:
        return version("mlflow")
    except PackageNotFoundError:
        return None


def create_store(path: Path) -> bool:
    """Write the recorded schema to ``path`` if it does not exist; True when this call
    created it. Built in a temporary file beside it and linked into place, so a reader
    never sees half a store and two processes starting at once make one (the other's
    link fails, and it opens the one that is there)."""
    from pipeline.train import mlflow_schema

    if path.exists() or _installed_mlflow() != mlflow_schema.MLFLOW_VERSION:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.executescript(mlflow_schema.schema())
        finally:
            conn.close()
        try:
            os.link(tmp, path)  # fails if the store appeared meanwhile: that one stays
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: MLflow makes the store
            return False
        return True
    finally:
        Path(tmp).unlink(missing_ok=True)


def create_new_store(uri: str) -> bool:
    """``create_store`` for a ``sqlite:///`` URI whose file does not exist yet."""
    path = sqlite_path(uri)
    return path is not None and create_store(path)


def dump_migrated_store() -> tuple[str, str]:
    """(alembic head, SQL dump) of a store made by MLflow's own migrations."""
    import sqlalchemy
    from mlflow.store.db.utils import _get_latest_schema_revision, _initialize_tables

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "mlflow.db"
        engine = sqlalchemy.create_engine(f"sqlite:///{db}")
        _initialize_tables(engine)
        engine.dispose()
        conn = sqlite3.connect(db)
        try:
            dump = "\n".join(conn.iterdump())
        finally:
            conn.close()
    return _get_latest_schema_revision(), dump


def write_schema(module: Path = SCHEMA_MODULE) -> None:
    """The SQL to mlflow_schema.sql, the versions it holds to mlflow_schema.py."""
    head, dump = dump_migrated_store()
    module.with_suffix(".sql").write_text(dump, encoding="utf-8")
    text = module.read_text(encoding="utf-8")
    text = re.sub(r"(?m)^MLFLOW_VERSION = .*$", f"MLFLOW_VERSION = {_installed_mlflow()!r}", text)
    text = re.sub(r"(?m)^ALEMBIC_HEAD = .*$", f"ALEMBIC_HEAD = {head!r}", text)
    module.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    write_schema()
    print(f"wrote {SCHEMA_MODULE.with_suffix('.sql')} for mlflow {_installed_mlflow()}",
          file=sys.stderr)  # fmt: skip
