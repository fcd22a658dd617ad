"""Checks of an MLflow server with authentication (`mlflow server --app-name basic-auth`),
shared by tests/integration/test_mlflow_auth.py (the all-in-one's server) and
tests/cluster/test_train_cluster.py (the rig's): raw calls as a user or anonymously, the
writes issue 49 names, and a `plm` stage refused before its first step."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import urllib.error
import urllib.request

CLIENT_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_PASSWORD_FILE", "MLFLOW_TRACKING_URI")  # fmt: skip
API = "api/2.0/mlflow"


@contextlib.contextmanager
def signed_in(user: str | None, password: str | None = None):
    """MLflow's client variables meanwhile: ``user`` with ``password`` (None: nobody)."""
    saved = {k: os.environ.pop(k) for k in CLIENT_VARS if k in os.environ}
    if user:
        os.environ.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password or "")
    try:
        yield
    finally:
        for k in CLIENT_VARS:
            os.environ.pop(k, None)
        os.environ.update(saved)


def call(url: str, method: str, path: str, body=None,
         auth: tuple[str, str] | None = None) -> tuple[int, bytes]:  # fmt: skip
    """One raw HTTP call to the server at ``url``: (status, body), signed in as
    ``auth`` = (user, password), or anonymous."""
    headers = {}
    if auth:
        pair = f"{auth[0]}:{auth[1]}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    data = None
    if isinstance(body, dict):
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    elif isinstance(body, bytes):
        data = body
    req = urllib.request.Request(f"{url}/{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def writes(w: dict, model: str, exp: str | None = None) -> dict[str, tuple[str, str, object]]:
    """The writes the issue names, on the job's run ``w["run"]`` of experiment ``w["exp"]``
    and its registered ``model`` (or creating a run in experiment ``exp``)."""
    exp = exp or w["exp"]
    return {
        "create run": ("POST", f"{API}/runs/create", {"experiment_id": exp}),
        "log metric": ("POST", f"{API}/runs/log-metric",
                       {"run_id": w["run"], "key": "loss", "value": 0.0,
                        "timestamp": 0, "step": 2}),
        "upload artifact": ("PUT", f"api/2.0/mlflow-artifacts/artifacts/{w['exp']}/{w['run']}/"
                            "artifacts/evil.txt", b"evil"),
        "delete run": ("POST", f"{API}/runs/delete", {"run_id": w["run"]}),
        "move alias": ("POST", f"{API}/registered-models/alias",
                       {"name": model, "alias": "current", "version": w.get("version", "1")}),
    }  # fmt: skip


def assert_refused_everywhere(url: str, w: dict, model: str, auth=None, status: int = 401):
    """Each of ``writes`` answers ``status`` (anonymous: 401; a signed-in reader: 403)."""
    for what, (method, path, body) in writes(w, model).items():
        got, text = call(url, method, path, body, auth)
        assert got == status, (what, got, text[:200])


def refused_before_any_step(proc, *parts: str) -> str:
    """A `plm` stage that stopped before its first step: exit 2, one `plm:` line holding
    each of ``parts``, no traceback, no step printed. The line."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("plm:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert "step 1:" not in proc.stdout
    return lines[0]
