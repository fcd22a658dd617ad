"""launch/all_in_one.py's MLflow server, without starting it: the basic-auth app, its
secrets generated into 0600 files and given by environment (never argv, never MLflow's old
default), job execution off, and the clients' sign-in variables naming files only."""

from __future__ import annotations

import configparser
import os

from conftest import load_launch_script

aio = load_launch_script("all_in_one")


def server(tmp_path):
    (tmp_path / "logs").mkdir(exist_ok=True)
    return aio.MlflowServer(tmp_path, tmp_path / "logs")


def test_the_server_command_runs_the_auth_app_on_loopback_with_no_secret(tmp_path):
    s = server(tmp_path)
    env = s.env()
    cmd = s.command(5000)
    assert cmd[:4] == ["mlflow", "server", "--app-name", "basic-auth"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    for var in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert env[var] and env[var] not in " ".join(cmd), var


def test_the_secrets_are_generated_once_into_0600_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "true")  # a shell's: overruled
    s = server(tmp_path)
    env = s.env()
    admin = env["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert admin == aio.read_secret(s.auth_dir / "admin.password")
    assert admin != "password1234" and len(admin) >= 12  # MLflow's old default; its policy
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == aio.read_secret(s.auth_dir / "flask_secret_key")
    assert env["MLFLOW_AUTH_ADMIN_USERNAME"] == aio.ADMIN_USER
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert s.auth_dir.stat().st_mode & 0o777 == 0o700
    for name in ("admin.password", "flask_secret_key"):
        assert (s.auth_dir / name).stat().st_mode & 0o777 == 0o600, name
    again = server(tmp_path).env()  # a restart on the same state folder: the same secrets
    assert again["MLFLOW_AUTH_ADMIN_PASSWORD"] == admin
    assert again["MLFLOW_FLASK_SERVER_SECRET_KEY"] == env["MLFLOW_FLASK_SERVER_SECRET_KEY"]


def test_the_auth_config_holds_no_password_and_refuses_anonymous_writes(tmp_path):
    s = server(tmp_path)
    env = s.env()
    ini = configparser.ConfigParser()
    ini.read(env["MLFLOW_AUTH_CONFIG_PATH"])
    auth = ini["mlflow"]
    assert auth["default_permission"] == "READ"  # signed-in users read; writes need a grant
    assert "admin_password" not in auth
    assert auth["database_uri"] == f"sqlite:///{s.auth_dir / 'basic_auth.db'}"
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] not in (s.auth_dir / "basic_auth.ini").read_text()


def test_clients_sign_in_with_a_password_file_not_a_password(tmp_path):
    s = server(tmp_path)
    s.url = "http://127.0.0.1:5000"
    env = s.as_user(aio.JOB_USER)
    assert env["MLFLOW_TRACKING_USERNAME"] == aio.JOB_USER
    path = env["MLFLOW_TRACKING_PASSWORD_FILE"]
    assert "MLFLOW_TRACKING_PASSWORD" not in env
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert aio.read_secret(s.password_file(aio.JOB_USER)) not in " ".join(env.values())
