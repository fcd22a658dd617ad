"""A moto S3 server a test can stop and start again (tests/s3_server.py's is shared by
the session): ``outage_s3`` (import ``outage_s3_fixture``) gives the test its own moto server behind an ``Outage`` relay,
with the AWS_* variables pointed at the relay; ``_start_moto`` starts one more."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

import pytest
from s3_server import _free_port, start_moto


def _start_moto(tmp_path, **env):
    port = _free_port()
    return start_moto(port, tmp_path / f"moto-{port}.log", env={**os.environ, **env}), port


class Outage:
    """The S3 endpoint the client sees: a TCP relay to a moto server on its own port.
    ``stop()`` is a stopped server (connections refused, open ones cut, mid-request
    included), ``start()`` the same server answering again on the same address; moto
    behind it keeps its objects (a restarted moto would start empty)."""

    def __init__(self, target_port: int):
        self.port, self.target = _free_port(), target_port
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.start()

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            with self.lock:
                self.conns += [client, upstream]
            self._relay(client, upstream)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        """One connection: bytes pumped both ways (a subclass may watch or hold them)."""
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket, on_data=None) -> None:
        """``a``'s bytes to ``b`` until either closes; ``on_data(chunk)`` before each send."""
        try:
            while data := a.recv(1 << 16):
                if on_data is not None:
                    on_data(data)
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture(name="outage_s3")
def outage_s3_fixture(tmp_path, monkeypatch):
    """A moto server of this test alone behind an ``Outage`` (bucket plm-own); the AWS_*
    variables point at the relay."""
    import boto3

    proc, port = _start_moto(tmp_path)
    relay = Outage(port)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": relay.endpoint}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        boto3.client("s3", endpoint_url=relay.endpoint).create_bucket(Bucket="plm-own")
        yield relay
    finally:
        relay.stop()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
