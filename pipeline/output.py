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
"""

from __future__ import annotations

import os
import sys
import warnings

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
    (``print`` writes the text and the newline apart)."""
    stream = sys.stderr if err else sys.stdout
    stream.write(msg + "\n")
    stream.flush()
