"""A closed stdout or stderr drops what is printed and stops nothing
(``pipeline.output.GuardedStream``), and a full disk is found behind whatever error carries
it (``no_space``) and said in one line (``disk_full``). Real pipes and processes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from pipeline.output import GuardedStream, disk_full, no_space, size_text


def closed_pipe() -> int:
    """The write end of a pipe whose reader is gone: a write is EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return w


def test_a_write_into_a_pipe_nobody_reads_is_dropped_and_the_fd_points_at_dev_null():
    raw = os.fdopen(closed_pipe(), "w")
    stream = GuardedStream(raw)
    stream.write("a line\n")
    stream.flush()  # EPIPE: dropped
    assert isinstance(stream.lost, BrokenPipeError)
    assert os.readlink(f"/proc/self/fd/{raw.fileno()}") == os.devnull
    assert stream.write("more\n") == 5  # later lines: dropped, no error
    stream.flush()
    raw.close()  # its buffer went to /dev/null: closing raises nothing either
    with pytest.raises(ValueError):
        raw.write("x")
    stream.write("after close\n")  # a closed stream: dropped too


def test_plm_into_a_closed_pipe_exits_as_it_would_and_says_nothing_on_stderr(tmp_path):
    """`plm data tokenizer --dry-run` prints its plan into a pipe whose reader is gone:
    exit 0 as with a reader, no BrokenPipeError, nothing on stderr."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a line of text\n", encoding="utf-8")
    w = closed_pipe()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "data", "tokenizer", "--input", str(corpus),
         "--kind", "wordpiece", "--vocab-size", "100", "--output", str(tmp_path / "tok"),
         "--dry-run"],
        stdout=w, stderr=subprocess.PIPE, text=True, timeout=120,
    )  # fmt: skip
    os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_a_full_disk_is_found_behind_the_error_that_carries_it():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("the write failed") from err
    except RuntimeError as err:
        assert no_space(err) is full

    class TaskError(Exception):  # what Ray's RayTaskError carries: ``cause``
        cause = full

    assert no_space(TaskError()) is full
    assert no_space(OSError(28, "Error writing bytes. Detail: [errno 28] No space left on device"))
    assert no_space(OSError(errno.EACCES, "Permission denied")) is None
    assert no_space(ValueError("x")) is None


def test_the_line_names_the_path_what_is_needed_and_what_is_free(tmp_path):
    err = OSError(errno.ENOSPC, "No space left on device")
    text = str(disk_full(err, tmp_path / "new" / "run", needs="a checkpoint needs ~1.7 MiB",
                         then="free space there"))  # fmt: skip
    assert text.startswith(f"no space left on device writing {tmp_path / 'new' / 'run'}: a ")
    assert "a checkpoint needs ~1.7 MiB, " in text and " free on its filesystem; " in text
    assert text.endswith("; free space there")
    named = OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "f"))
    assert str(disk_full(named, None)).startswith(f"disk quota exceeded writing {tmp_path / 'f'}")
    assert str(disk_full(err, None)) == "no space left on device writing a file"
    assert [size_text(n) for n in (812, 3482, 1_798_447, 13.2 * 2**30)] == [
        "812 B", "3.4 KiB", "1.7 MiB", "13.20 GiB",
    ]  # fmt: skip
