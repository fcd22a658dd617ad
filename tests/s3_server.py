"""A pytest plugin: a real S3 endpoint on loopback (moto's server mode), for the tests of
data dirs on an object store. Loaded by tests/conftest.py.

``s3_server`` (session): starts ``moto_server`` on a free 127.0.0.1 port, creates the
bucket, stops the server by its PID at the end. ``s3`` (per test): the AWS_* variables
pointed at it (so pyarrow, boto3 and ``plm`` subprocesses use it) and an ``S3`` helper
to upload a local data dir (``pyarrow.fs.copy_files``) under a fresh prefix.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "plm-test"
_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command(port: int) -> list[str]:
    exe = shutil.which("moto_server")
    if exe is None:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return [exe, "-H", "127.0.0.1", "-p", str(port)]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the test process ends, however it
    ends (a pytest killed by a timeout runs no teardown, and the server has a session of its
    own)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def start_moto(port: int, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A moto server on 127.0.0.1:``port``, its output in the file ``log``, once it answers
    (RuntimeError with the log's end if it does not within 60 s)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(_moto_command(port), stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(
                    f"moto_server did not start: {log.read_text()[-2000:]}"
                ) from None
            time.sleep(0.1)


@dataclass
class S3:
    endpoint: str
    bucket: str = BUCKET

    def env(self) -> dict[str, str]:
        return {**_ENV, "AWS_ENDPOINT_URL": self.endpoint}

    def fs(self):
        import pyarrow.fs as pafs

        return pafs.FileSystem.from_uri(f"s3://{self.bucket}")[0]

    def prefix(self, name: str = "data") -> str:
        """A fresh ``s3://bucket/<unique>/name`` URI."""
        return f"s3://{self.bucket}/{uuid.uuid4().hex[:12]}/{name}"

    def upload(self, local: Path, name: str = "data") -> str:
        """A copy of a local folder under a fresh prefix; its URI."""
        import pyarrow.fs as pafs

        uri = self.prefix(name)
        pafs.copy_files(str(local), uri, source_filesystem=pafs.LocalFileSystem())
        return uri

    def put(self, uri: str, data: bytes) -> None:
        with self.fs().open_output_stream(uri[len("s3://") :]) as f:
            f.write(data)

    def get(self, uri: str) -> bytes:
        with self.fs().open_input_file(uri[len("s3://") :]) as f:
            return f.read()

    def delete(self, uri: str) -> None:
        self.fs().delete_file(uri[len("s3://") :])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The endpoint URL of a moto S3 server holding the bucket ``plm-test``."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc = start_moto(port, log)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=_ENV["AWS_DEFAULT_REGION"],
        ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def s3(s3_server, monkeypatch) -> S3:
    """The AWS_* variables of this test pointed at the moto server."""
    server = S3(s3_server)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return server
