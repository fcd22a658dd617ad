"""A new sqlite MLflow store made in one step (pipeline/train/mlflow_store.py) is the store
MLflow's own 68 migrations make: the same tables, indexes, trigger and rows, stamped at
the alembic head, so MLflow opens it, `mlflow db upgrade` finds nothing to do and a later
MLflow's migrations start from the right revision."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from pipeline.train import mlflow_schema, mlflow_store

pytestmark = pytest.mark.slow  # MLflow's own migrations, for the reference store


def contents(path) -> tuple[set, dict, dict]:
    """Every schema object, every table's columns in order and every table's rows. An
    object's SQL is compared as a set of lines: MLflow's own migrations write the
    constraints of the `runs` table in an order that changes with PYTHONHASHSEED (two
    stores MLflow made differ so), and the order of constraints means nothing to SQLite."""
    with sqlite3.connect(path) as c:
        objects = {
            (kind, name, table, tuple(sorted(x.strip().rstrip(",") for x in (sql or "").splitlines())))
            for kind, name, table, sql in c.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")
        }  # fmt: skip
        tables = [name for kind, name, _, _ in objects if kind == "table"]
        columns = {t: c.execute(f'PRAGMA table_xinfo("{t}")').fetchall() for t in tables}
        rows = {t: sorted(c.execute(f'SELECT * FROM "{t}"')) for t in tables}
    return objects, columns, rows


def test_the_one_step_store_is_the_store_mlflow_migrations_make(tmp_path):
    import sqlalchemy
    from mlflow.store.db.utils import _get_latest_schema_revision, _initialize_tables

    fast = tmp_path / "fast.db"
    assert mlflow_store.create_store(fast) is True
    reference = tmp_path / "migrated.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{reference}")
    _initialize_tables(engine)  # what MLflow does to a new store: create_all, then upgrade
    engine.dispose()
    fast_objects, fast_columns, fast_rows = contents(fast)
    ref_objects, ref_columns, ref_rows = contents(reference)
    assert fast_objects == ref_objects
    assert fast_columns == ref_columns
    assert fast_rows == ref_rows
    assert fast_rows["alembic_version"] == [(_get_latest_schema_revision(),)]
    assert mlflow_schema.ALEMBIC_HEAD == _get_latest_schema_revision()


def test_mlflow_opens_the_store_logs_to_it_and_finds_nothing_to_migrate(tmp_path):
    import sqlalchemy
    from mlflow import MlflowClient
    from mlflow.store.db.utils import _get_schema_version, _verify_schema

    db = tmp_path / "sub" / "mlflow.db"  # the parent folder is made too
    uri = f"sqlite:///{db}"
    assert mlflow_store.create_new_store(uri) is True
    engine = sqlalchemy.create_engine(uri)
    _verify_schema(engine)  # what SqlAlchemyStore checks on open: the head revision
    head = _get_schema_version(engine)
    engine.dispose()
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    run = client.create_run(exp)
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    client.log_param(run.info.run_id, "lr", "0.1")
    client.create_registered_model("m")
    client.set_terminated(run.info.run_id)
    got = MlflowClient(uri).get_run(run.info.run_id)
    assert got.data.metrics == {"loss": 1.5} and got.data.params == {"lr": "0.1"}
    assert got.info.status == "FINISHED"
    assert [e.name for e in client.search_experiments()] == ["e", "Default"]
    # `mlflow db upgrade` (what a later MLflow's migrations run through) starts from the
    # stamped revision: nothing to do at this version, and the store is unchanged.
    up = subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", uri],
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert up.returncode == 0, up.stderr[-2000:]
    engine = sqlalchemy.create_engine(uri)
    assert _get_schema_version(engine) == head
    engine.dispose()


def test_an_existing_store_or_another_mlflow_is_left_to_mlflow(tmp_path, monkeypatch):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not ours")
    assert mlflow_store.create_new_store(f"sqlite:///{db}") is False
    assert db.read_bytes() == b"not ours"
    assert mlflow_store.create_new_store("http://127.0.0.1:5000") is False
    assert mlflow_store.create_new_store("sqlite://") is False  # in memory
    # Another MLflow than the schema was taken from: its own migrations make the store.
    monkeypatch.setattr(mlflow_schema, "MLFLOW_VERSION", "0.0.1")
    other = tmp_path / "other.db"
    assert mlflow_store.create_new_store(f"sqlite:///{other}") is False
    assert not other.exists()
    assert list(tmp_path.iterdir()) == [db]  # no temporary file left behind


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_artifacts_a_run_cannot_write_are_one_line_before_any_step(tmp_path):
    """A sqlite:/// store run from a read-only working directory (a bind mount made read-only
    in a mount namespace of its own): MLflow would put a new experiment's artifacts in
    ./mlruns there, so the check refuses before any step, naming the folder. An experiment
    whose artifact location is writable passes from there."""
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    mlflow_store.create_store(db)
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{db}").create_experiment("kept", str(tmp_path / "artifacts"))
    ro = tmp_path / "read-only"
    ro.mkdir()
    code = (
        "import sys\n"
        "from pipeline.config import ConfigError\n"
        "from pipeline.train.tracking import check_local_artifacts\n"
        "for name in sys.argv[2:]:\n"
        "    try:\n"
        "        check_local_artifacts(sys.argv[1], name)\n"
        "        print(name, 'ok')\n"
        "    except ConfigError as err:\n"
        "        print(name, 'refused:', err)\n"
    )
    script = (
        f'mount --bind "{ro}" "{ro}" && mount -o remount,ro,bind "{ro}" && cd "{ro}" && exec "$@"'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-c", code,
         f"sqlite:///{db}", "new-experiment", "kept"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    new, kept = proc.stdout.splitlines()
    assert new.startswith("new-experiment refused: MLflow would keep this run's artifacts"), new
    assert f"in {ro}/mlruns (MLflow's default for a new experiment" in new
    assert f"and {ro} cannot be written here" in new
    assert kept == "kept ok"
