"""A pytest plugin: a line while one test runs long, so `pytest -q tests` is never silent for
minutes. Its first tests start real Ray clusters, `deepspeed` launches and MLflow servers
(one builds the shared tiny data dir first), and with -q a dot only comes when a test ends.

Every ``PLM_TEST_HEARTBEAT_S`` seconds (default 60) without output it writes
``[still running after 2 min: tests/...::test_name]``. Loaded by tests/conftest.py."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

EVERY_S = float(os.environ.get("PLM_TEST_HEARTBEAT_S", "60"))


def _elapsed(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class Heartbeat:
    def __init__(self, out_fd: int) -> None:
        self.out_fd = out_fd  # the terminal: a test's own output is captured meanwhile
        self.lock = threading.Lock()
        self.test: tuple[str, float] | None = None  # (node id, when it started)
        self.quiet_since = time.monotonic()  # the last line: a test's start, end or ours
        self.newline = ""
        self.done = threading.Event()
        threading.Thread(target=self._watch, name="plm-test-heartbeat", daemon=True).start()

    def start(self, nodeid: str) -> None:
        with self.lock:
            self.test = (nodeid, time.monotonic())
            self.quiet_since = time.monotonic()
            self.newline = "\n"  # off pytest's line of dots, once per test

    def finish(self) -> None:
        with self.lock:
            self.test = None

    def _watch(self) -> None:
        while not self.done.wait(min(EVERY_S / 6, 5.0)):
            with self.lock:
                now = time.monotonic()
                if self.test is None or now - self.quiet_since < EVERY_S:
                    continue
                nodeid, started = self.test
                self.quiet_since = now
                newline, self.newline = self.newline, ""
            line = f"{newline}[still running after {_elapsed(now - started)}: {nodeid}]\n"
            os.write(self.out_fd, line.encode())


_beat: Heartbeat | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Between captures (as pytest's faulthandler plugin does): stdout is the terminal."""
    global _beat
    if EVERY_S > 0 and not config.option.collectonly:
        _beat = Heartbeat(os.dup(sys.stdout.fileno()))


def pytest_runtest_logstart(nodeid: str) -> None:
    if _beat is not None:
        _beat.start(nodeid)


def pytest_runtest_logfinish(nodeid: str) -> None:
    if _beat is not None:
        _beat.finish()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _beat is not None:
        _beat.done.set()
        os.close(_beat.out_fd)
