"""What `plm` prints: quiet by default, more with ``-v``.

By default the libraries' chatter that looks like a failure but is none is kept out:
MLflow's INFO lines (system metrics started/stopped, run links, registry notes) and its
artifact download bars, transformers' progress bars when the output is not a terminal
(`plm export`'s "Writing model shards"), the
FutureWarnings DeepSpeed triggers in torch.distributed on every rank, and Ray's warning
that a local cluster enabled token authentication (it stays on). ``-v`` shows them all
again. The settings are
environment variables where the libraries read them, so the `deepspeed` ranks, Ray
workers and other processes `plm` starts inherit them.

A closed output never stops a command (``guard_streams``): `plm train ... | tee out` whose
`tee` died of the same Ctrl-C still saves its checkpoint and exits 130. A full disk is one
`plm:` line and exit ``EXIT_DISK_FULL`` (``DiskFull``, ``disk_full``), never a traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import warnings
from pathlib import Path

VERBOSE = 0  # plm -v: 1 or more


def configure(verbose: int) -> None:
    """Quiet (``verbose`` 0) or chatty (1 or more) output for this process and its children."""
    global VERBOSE
    VERBOSE = verbose
    if verbose > 0:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO")
        return
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # per download
    if not sys.stderr.isatty():  # transformers' bars ("Writing model shards") into a pipe
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # DeepSpeed 0.19 calls torch.distributed's deprecated all_gather_into_tensor /
    # reduce_scatter_tensor: one FutureWarning per rank and call site, nothing to act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def quiet_ray_auth_notice() -> None:
    """Ray's warning that a local cluster it starts "enabled token authentication" (it
    stays on; the notice is what goes): shown with ``-v`` only."""
    import logging

    if not VERBOSE:
        name = "ray._private.authentication.authentication_token_setup"
        logging.getLogger(name).setLevel(logging.ERROR)


def rank_line(msg: str, *, err: bool = False) -> None:
    """One line from one of several ranks that share a pipe (the `deepspeed` launcher gives a
    node's ranks one stdout): written in one call, so another rank's line cannot land inside it
    (``print`` writes the text and the newline apart). A closed stream drops it."""
    stream = sys.stderr if err else sys.stdout
    try:
        stream.write(msg + "\n")
        stream.flush()
    except (OSError, ValueError):  # not guarded (a caller's own stream) and closed
        pass


# What a write into a stream nobody reads any more raises: BrokenPipeError (the reader of
# a pipe is gone), OSError EIO (the terminal hung up), ENOSPC (a full disk under `> file`),
# ValueError (the stream was closed).
LOST = (OSError, ValueError)


class GuardedStream:
    """``sys.stdout`` / ``sys.stderr`` of a `plm` process: a write or flush that fails
    (``LOST``) is dropped, and so is everything after it. The stream's file descriptor is
    pointed at /dev/null then, so what its buffer still holds, what C code prints there,
    and Python's own flush at exit write into nothing instead of raising again. Anything
    else is the stream's (``isatty``, ``fileno``, ``encoding``, ...)."""

    def __init__(self, stream):
        self._stream = stream
        self.lost: BaseException | None = None  # the error that closed it, once one did

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self._stream.write(text)
            except LOST as err:
                self._lose(err)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except LOST as err:
                self._lose(err)

    def _lose(self, err: BaseException) -> None:
        self.lost = err
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()  # what the buffer held, into /dev/null
        except (*LOST, AttributeError):  # no descriptor (a stream of Python's own)
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` as ``GuardedStream``s, for the whole process (the
    `plm` command line, before anything prints): a reader that is gone, a terminal that
    hung up, must never stop training or a save. Their lines are dropped; the run goes on
    and exits with its own status. Once per process."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, GuardedStream):
            setattr(sys, name, GuardedStream(stream))


# --- a full disk -----------------------------------------------------------------------------

# The exit status of a command whose filesystem was full (or over quota): `plm train`'s
# train.out_dir, `plm data prepare`'s --output (docs/training.md, docs/data.md).
EXIT_DISK_FULL = 5
_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(Exception):
    """A write found its filesystem full: one `plm:` line (the path, what is needed and
    what is free, what to do) and exit ``EXIT_DISK_FULL``."""


def no_space(err: BaseException | None) -> OSError | None:
    """The ENOSPC / EDQUOT error behind ``err``: itself, the cause of a Ray task's error,
    or an exception it was raised from or while handling; None if there is none."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and (
            err.errno in _FULL or "No space left on device" in str(err)  # pyarrow's text
        ):
            return err
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    return None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the filesystem that holds ``path`` (or, not there yet,
    its nearest existing parent); None for a URI or when it cannot be known."""
    text = os.fspath(path)
    if "://" in text:
        return None
    here = Path(text).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def size_text(n: float) -> str:
    """Bytes for a person: 812 B, 3.4 KiB, 1.7 MiB, 12.30 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def disk_full(
    err: OSError, path: str | os.PathLike | None, *, needs: str = "", then: str = ""
) -> DiskFull:
    """The ``DiskFull`` of ``err`` met writing under ``path`` (the file when the error
    names one): "no space left on device writing PATH: NEEDS, M free on its filesystem;
    THEN" (``needs``: what the writes need, when known, e.g. "a checkpoint needs ~1.7
    MiB"). Without a path: "writing a file", and no free space said."""
    reason = "disk quota exceeded" if err.errno == errno.EDQUOT else "no space left on device"
    where = os.fspath(err.filename) if isinstance(err.filename, (str, os.PathLike)) else path
    free = None if where is None else free_bytes(where)
    said = [needs] if needs else []
    if free is not None:
        said.append(f"{size_text(free)} free on its filesystem")
    text = f"{reason} writing {'a file' if where is None else os.fspath(where)}"
    text += f": {', '.join(said)}" if said else ""
    return DiskFull(text + (f"; {then}" if then else ""))
