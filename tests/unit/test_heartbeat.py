"""tests/heartbeat.py in a real pytest run: `-q` prints a line while a test runs long, and
nothing while tests are quick."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO


def run_pytest(tmp_path, body: str) -> str:
    (tmp_path / "test_inner.py").write_text(f"import time\n\n\n{body}\n")
    env = {**os.environ, "PLM_TEST_HEARTBEAT_S": "1", "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "heartbeat", "-p", "no:cacheprovider",
         "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow  # over 5 s: out of the fast tier
def test_a_long_test_gets_a_still_running_line(tmp_path):
    out = run_pytest(tmp_path, "def test_slow():\n    time.sleep(3.5)")
    lines = [x for x in out.splitlines() if x.startswith("[still running after ")]
    assert lines and all(x.endswith(" s: test_inner.py::test_slow]") for x in lines), out
    assert "1 passed" in out


def test_quick_tests_get_none(tmp_path):
    out = run_pytest(tmp_path, "def test_a():\n    pass\n\n\ndef test_b():\n    pass")
    assert "still running" not in out and "2 passed" in out
