"""`plm train`'s end (`pipeline.cli.exit_now`): Python's exit minus its teardown. A fresh
interpreter per case (exit_now ends the process); no torch, so it is cheap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import REPO

# What an ordinary exit of this script leaves, each piece written late: a non-daemon
# thread still working, a thread pool's queued task, an atexit function, a logging file
# handler's buffered record, Python's and C's buffered stdout and stderr; and an object
# freed only by the interpreter's teardown (what exit_now skips).
SCRIPT = textwrap.dedent(
    """
    import atexit, ctypes, logging, logging.handlers, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from pipeline.cli import exit_now

    out = Path(sys.argv[1])


    class FreedAtTeardown:
        def __init__(self, path):
            self.path = path

        def __del__(self):
            self.path.write_text("ran")


    kept = FreedAtTeardown(out / "teardown")
    atexit.register(lambda: (out / "atexit").write_text("ran"))


    def late(name):
        time.sleep(0.5)
        (out / name).write_text("ran")


    threading.Thread(target=late, args=("thread",)).start()  # not a daemon
    pool = ThreadPoolExecutor(1)
    pool.submit(late, "busy")
    pool.submit(late, "queued")  # waits for the first
    log = logging.getLogger("t")
    log.addHandler(logging.handlers.MemoryHandler(100, target=logging.FileHandler(out / "log")))
    log.warning("buffered record")
    print("stdout without a newline", end="")  # a pipe: block-buffered
    print("stderr line", file=sys.stderr)
    ctypes.CDLL(None).printf(b"from C stdio\\n")
    exit_now(int(sys.argv[2]))
    """
)


def run(tmp_path, code: str, how: str):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT if how == "exit_now" else SCRIPT.replace("exit_now(", "sys.exit("))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": ""}
    return subprocess.run([sys.executable, str(script), str(tmp_path), code], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_exit_now_writes_what_an_ordinary_exit_writes_and_skips_the_teardown(tmp_path):
    for code in ("0", "7"):
        proc = run(tmp_path, code, "exit_now")
        assert proc.returncode == int(code), proc.stderr
        assert "stdout without a newline" in proc.stdout and "from C stdio" in proc.stdout
        assert proc.stderr == "stderr line\n"
        for name in ("atexit", "thread", "busy", "queued"):
            assert (tmp_path / name).read_text() == "ran", name
            (tmp_path / name).unlink()
        assert (tmp_path / "log").read_text() == "buffered record\n"
        (tmp_path / "log").unlink()
        # the interpreter's teardown did not run: what makes `plm train` end seconds sooner
        assert not (tmp_path / "teardown").exists()
    # the same script with sys.exit: the teardown runs (so the check above can see it)
    assert run(tmp_path, "0", "sys.exit").returncode == 0
    assert (tmp_path / "teardown").read_text() == "ran"
