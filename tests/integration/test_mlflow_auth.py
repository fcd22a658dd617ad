"""MLflow with authentication (issue 49.1): a real `mlflow server --app-name basic-auth`
on 127.0.0.1, started the way launch/all_in_one.py starts it (its admin password and
Flask secret key generated into 0600 files, job execution off), with the all-in-one's job
user (EDIT on bert-tiny's experiment and model) and viewer (READ), and a second job user
with an experiment of its own.

- an anonymous client is refused (401) creating a run, logging a metric, uploading an
  artifact, deleting a run and moving an alias; the viewer is refused (403) on each and
  reads the run, its metrics, its artifact and the alias; a job's user writes its own
  experiment and not another's;
- `plm train` with a wrong password, and as the viewer, stops before its first step with
  one `plm:` line naming the user, the experiment and the permission, exit 2; with the job
  user's password (from MLFLOW_TRACKING_PASSWORD_FILE) it logs its metrics and registers
  its model; no password is ever printed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlflow_auth_util as auth_util
import pytest
from conftest import REPO, load_launch_script, plm
from mlflow_auth_util import CLIENT_VARS, signed_in

from pipeline import tracking_admin
from pipeline.tracking_auth import AccessRefused
from pipeline.tracking_uri import check_access

pytestmark = pytest.mark.slow

aio = load_launch_script("all_in_one")
BERT = str(REPO / "configs/test/bert-tiny.yaml")
EXP = "bert-tiny"  # the tiny config's name: its experiment and its registered model
OTHER, OTHER_USER = "someone-else", "other-job"


def password(server, user: str) -> str:
    return aio.read_secret(server.password_file(user))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("mlflow-auth")
    (work / "logs").mkdir()
    s = aio.MlflowServer(work, work / "logs")
    t0 = time.monotonic()
    s.start()
    s.make_users(EXP, EXP)  # the all-in-one's job user and viewer
    with signed_in(aio.ADMIN_USER, password(s, aio.ADMIN_USER)):
        tracking_admin.make_job_user(s.url, OTHER_USER, password(s, OTHER_USER), OTHER, OTHER)
    print(f"server up and users made in {time.monotonic() - t0:.1f} s")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def written(server) -> dict:
    """What the job user wrote: a run with a metric and an artifact, a model version of it
    with the alias current; and the other job's experiment."""
    from mlflow import MlflowClient

    with signed_in(aio.JOB_USER, password(server, aio.JOB_USER)):
        client = MlflowClient(server.url)
        exp_id = client.get_experiment_by_name(EXP).experiment_id
        run = client.create_run(exp_id)
        run_id = run.info.run_id
        client.log_metric(run_id, "loss", 1.0, step=1)
        note = Path(server.auth_dir.parent / "note.txt")
        note.write_text("hello\n")
        client.log_artifact(run_id, str(note))
        version = client.create_model_version(EXP, f"runs:/{run_id}/note.txt", run_id).version
        client.set_registered_model_alias(EXP, "current", version)
    with signed_in(OTHER_USER, password(server, OTHER_USER)):
        other_exp = MlflowClient(server.url).get_experiment_by_name(OTHER).experiment_id
    return {"exp": exp_id, "run": run_id, "version": version, "other_exp": other_exp}


def call(server, method: str, path: str, body=None, user: str | None = None,
         secret: str | None = None) -> tuple[int, bytes]:  # fmt: skip
    """One raw HTTP call: (status, body), as ``user`` (None: anonymous)."""
    auth = (user, secret if secret is not None else password(server, user)) if user else None
    return auth_util.call(server.url, method, path, body, auth)


def writes(w: dict, exp: str | None = None) -> dict[str, tuple[str, str, object]]:
    return auth_util.writes(w, EXP, exp)


def test_the_server_keeps_its_secrets_in_0600_files_and_off_its_command_line(server):
    files = sorted(server.auth_dir.iterdir())
    names = {f.name for f in files}
    assert {"admin.password", "flask_secret_key", "basic_auth.ini"} <= names, names
    for f in files:
        if f.suffix == ".password" or f.name == "flask_secret_key":
            assert f.stat().st_mode & 0o777 == 0o600, f
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
    env = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    admin = password(server, aio.ADMIN_USER)
    assert admin not in cmdline and "password1234" != admin
    key = aio.read_secret(server.auth_dir / "flask_secret_key")
    assert f"MLFLOW_FLASK_SERVER_SECRET_KEY={key}".encode() in env
    assert b"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in env
    assert call(server, "GET", "health")[0] == 200  # the probe needs no sign-in


def test_an_anonymous_client_is_refused_everything(server, written):
    for what, (method, path, body) in writes(written).items():
        status, text = call(server, method, path, body)
        assert status == 401, (what, status, text[:200])
    status, _ = call(server, "GET", f"api/2.0/mlflow/runs/get?run_id={written['run']}")
    assert status == 401  # reading too


def test_the_viewer_reads_everything_and_writes_nothing(server, written):
    viewer = aio.VIEWER_USER
    for what, (method, path, body) in writes(written).items():
        status, text = call(server, method, path, body, user=viewer)
        assert status == 403, (what, status, text[:200])
    run = json.loads(call(server, "GET", f"api/2.0/mlflow/runs/get?run_id={written['run']}",
                          user=viewer)[1])["run"]  # fmt: skip
    assert run["info"]["lifecycle_stage"] == "active"  # not deleted
    assert [m["value"] for m in run["data"]["metrics"]] == [1.0]  # nothing logged
    status, text = call(server, "GET", f"api/2.0/mlflow-artifacts/artifacts/{written['exp']}/"
                        f"{written['run']}/artifacts/note.txt", user=viewer)  # fmt: skip
    assert (status, text) == (200, b"hello\n")
    status, text = call(server, "GET", f"api/2.0/mlflow/registered-models/alias?name={EXP}"
                        "&alias=current", user=viewer)  # fmt: skip
    assert status == 200 and json.loads(text)["model_version"]["version"] == written["version"]
    status, _ = call(server, "GET", f"api/2.0/mlflow/experiments/get?experiment_id="
                     f"{written['other_exp']}", user=viewer)  # fmt: skip
    assert status == 200  # every experiment


def test_a_job_user_writes_its_own_experiment_and_not_anothers(server, written):
    job = aio.JOB_USER
    status, text = call(server, *writes(written)["create run"], user=job)
    assert status == 200, text[:200]
    status, text = call(server, *writes(written)["log metric"], user=job)
    assert status == 200, text[:200]
    status, text = call(server, *writes(written, written["other_exp"])["create run"], user=job)
    assert status == 403, text[:200]
    status, text = call(server, "POST", "api/2.0/mlflow/registered-models/alias",
                        {"name": OTHER, "alias": "current", "version": "1"}, user=job)  # fmt: skip
    assert status == 403, text[:200]
    status, _ = call(server, *writes(written)["create run"], user=job, secret="not-the-password")
    assert status == 401


def test_check_access_names_the_user_the_resource_and_the_level(server, written):
    with signed_in(aio.JOB_USER, password(server, aio.JOB_USER)):
        check_access(server.url, EXP, EXP)  # its own: fine
        with pytest.raises(AccessRefused, match=rf"'{aio.JOB_USER}' READ on experiment '{OTHER}'"):
            check_access(server.url, OTHER, OTHER)
        with pytest.raises(AccessRefused, match=rf"READ on registered model '{OTHER}'"):
            check_access(server.url, EXP, OTHER)
    with signed_in(aio.VIEWER_USER, password(server, aio.VIEWER_USER)):
        with pytest.raises(AccessRefused, match="needs EDIT") as refused:
            check_access(server.url, EXP, EXP)
        assert f"user '{aio.VIEWER_USER}' READ on experiment '{EXP}'" in str(refused.value)
        check_access(server.url, stage="plm predict", write=False)  # reading is allowed
    with signed_in(None):
        with pytest.raises(AccessRefused, match="anonymous request with HTTP 401"):
            check_access(server.url, EXP)
    # credentials in the URI: used, and gone from it (and from the message)
    secret = "wrong-password-42"
    with signed_in(None):
        url = server.url.replace("http://", f"http://{aio.JOB_USER}:{secret}@")
        with pytest.raises(AccessRefused) as refused:
            check_access(url, EXP)
    assert f"user '{aio.JOB_USER}' with HTTP 401" in str(refused.value)
    assert secret not in str(refused.value) and "@" not in str(refused.value).split(" refused")[0]


def train(server, tiny_data, tmp_path, env: dict[str, str], steps: int = 3):
    run_dir = tmp_path / "run"
    base = {k: "" for k in CLIENT_VARS}  # nothing of this shell's
    proc = plm("train", BERT, f"data.path={tiny_data}", f"train.out_dir={run_dir}",
               f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
               "train.save_every=0", f"mlflow.tracking_uri={server.url}",
               "mlflow.final_wait_s=5", cwd=tmp_path, env={**base, **env}, check=False,
               timeout=300)  # fmt: skip
    return proc, run_dir


def refused_before_any_step(proc, run_dir, *parts: str) -> str:
    line = auth_util.refused_before_any_step(proc, *parts)
    assert not (run_dir / "metrics.jsonl").exists()
    return line


def test_plm_train_with_a_wrong_password_stops_before_its_first_step(server, tiny_data, tmp_path):
    secret = "not-the-job-password"
    proc, run_dir = train(server, tiny_data, tmp_path,
                          {"MLFLOW_TRACKING_USERNAME": aio.JOB_USER,
                           "MLFLOW_TRACKING_PASSWORD": secret})  # fmt: skip
    refused_before_any_step(proc, run_dir, f"user '{aio.JOB_USER}'", "HTTP 401",
                            f"EDIT on experiment '{EXP}'", "MLFLOW_TRACKING_PASSWORD")  # fmt: skip
    assert secret not in proc.stdout + proc.stderr


def test_plm_train_as_the_viewer_stops_before_its_first_step(server, tiny_data, tmp_path):
    proc, run_dir = train(server, tiny_data, tmp_path,
                          {"MLFLOW_TRACKING_USERNAME": aio.VIEWER_USER,
                           "MLFLOW_TRACKING_PASSWORD_FILE":
                               str(server.password_file(aio.VIEWER_USER))})  # fmt: skip
    refused_before_any_step(proc, run_dir, f"user '{aio.VIEWER_USER}' READ on experiment "
                            f"'{EXP}'", "needs EDIT")  # fmt: skip


def test_plm_train_as_the_job_user_logs_and_registers(server, tiny_data, tmp_path, written):
    from mlflow import MlflowClient

    proc, run_dir = train(server, tiny_data, tmp_path,
                          {"MLFLOW_TRACKING_USERNAME": aio.JOB_USER,
                           "MLFLOW_TRACKING_PASSWORD_FILE":
                               str(server.password_file(aio.JOB_USER))})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for user in (aio.JOB_USER, aio.VIEWER_USER, aio.ADMIN_USER):
        assert password(server, user) not in proc.stdout + proc.stderr
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    with signed_in(aio.VIEWER_USER, password(server, aio.VIEWER_USER)):  # read back
        client = MlflowClient(server.url)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.experiment_id == written["exp"]
        steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
        assert steps == [1, 2, 3]
        version = client.get_model_version_by_alias(EXP, "current")
        assert version.run_id == run_id


# --- credentials from the environment, no server needed ------------------------------------


def test_a_uris_user_part_moves_into_mlflows_variables(monkeypatch):
    from pipeline.tracking_uri import resolve_tracking_uri

    for k in CLIENT_VARS:
        monkeypatch.delenv(k, raising=False)
    uri = resolve_tracking_uri("http://job%40a:p%3Aw%40rd-123@mlflow.internal:5000/x")
    assert uri == "http://mlflow.internal:5000/x"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "job@a"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "p:w@rd-123"
    # variables set already win; the URI is cleaned all the same
    assert resolve_tracking_uri("https://other:x@h") == "https://h"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "job@a"
    assert resolve_tracking_uri("sqlite:///tmp/u:p@x.db") == "sqlite:///tmp/u:p@x.db"


def test_the_password_file_is_read_for_a_server_only(tmp_path, monkeypatch):
    from pipeline.errors import ConfigError
    from pipeline.tracking_uri import resolve_tracking_uri

    for k in CLIENT_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD_FILE", str(tmp_path / "missing"))
    resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # a local store: no users
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_PASSWORD_FILE=.*missing: cannot read"):
        resolve_tracking_uri("http://127.0.0.1:1")
    (tmp_path / "pw").write_text("s3cret-from-a-file\n")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD_FILE", str(tmp_path / "pw"))
    resolve_tracking_uri("http://127.0.0.1:1")
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret-from-a-file"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "the-variable")  # it wins, as MLflow's do
    resolve_tracking_uri("http://127.0.0.1:1")
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "the-variable"
