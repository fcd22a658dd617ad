"""Stopping a training run on SIGTERM / SIGINT without losing its steps.

Kubernetes and Slurm send SIGTERM before they kill a job; Ctrl-C sends SIGINT (to every
process of the terminal's process group: the `deepspeed` launcher, each rank and its
loader workers). The first of them only raises a flag; the trainer puts the flag into the
all-reduce it makes every micro-batch anyway, so every rank learns of it at the same step,
and at the next step boundary they save a checkpoint together, end the MLflow run as
KILLED and exit (130 for SIGINT, 143 = 128 + SIGTERM for SIGTERM). A rerun of the same
command resumes from that checkpoint.

If the step boundary and the checkpoint are not reached within ``train.stop_grace_s``
seconds (a collective waiting on a rank that is gone, a step slower than the grace), the
process ends the MLflow run as KILLED and exits at once with the same code, keeping the
last complete checkpoint. A second Ctrl-C a second or more after the first stops at once.
Loader workers forked after the handlers were installed inherit them and ignore the signals
(only the process that installed them acts), so they live until the trainer stops them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class TrainingStopped(Exception):
    """Training stopped on a signal at a step boundary, after saving a checkpoint."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 1)


class GracefulStop:
    """The first SIGTERM/SIGINT sets ``signum``; ``on_expiry(signum)`` runs in a timer thread
    if the process is still alive ``grace_s`` seconds later, then the process exits."""

    def __init__(self, grace_s: float, on_expiry: Callable[[int], None] | None = None):
        self.grace_s = grace_s
        self.on_expiry = on_expiry
        self.signum: int | None = None
        self._since = 0.0
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            return  # a forked loader worker: the trainer stops it
        if self.signum is None:
            self.signum, self._since = signum, time.monotonic()
            name = signal.Signals(signum).name
            print(
                f"[plm train] {name}: stopping at the next step boundary with a checkpoint "
                f"(train.stop_grace_s={self.grace_s:g})",
                file=sys.stderr,
                flush=True,
            )
            self._timer = threading.Timer(self.grace_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
        elif signum == signal.SIGINT and time.monotonic() - self._since >= 1.0:
            raise KeyboardInterrupt  # a second Ctrl-C: now, without a checkpoint

    def _expire(self) -> None:
        signum = self.signum or signal.SIGTERM
        print(
            f"plm: no step boundary within train.stop_grace_s={self.grace_s:g} s of "
            f"{signal.Signals(signum).name}: stopped without a new checkpoint; the same "
            "command resumes from the last complete one",
            file=sys.stderr,
            flush=True,
        )
        try:
            if self.on_expiry is not None:
                self.on_expiry(signum)
        finally:
            os._exit(EXIT_CODES.get(signum, 1))
