"""MLflow tracking that never kills a training run.

Rank 0 logs; other ranks hold a no-op tracker. Every metric is also appended to
RUN_DIR/metrics.jsonl, so an unreachable server loses nothing: training warns once and
goes on. The run id is kept in RUN_DIR/mlflow_run_id so a resumed job continues the same
MLflow run (one curve).

An outage is not the end of the run's tracking: every ``mlflow.retry_every_s`` the tracker
asks the server again; once it answers, the metrics logged meanwhile are sent from
metrics.jsonl (``log_batch``, with their steps and times) and logging goes on. At the end
of a finished run it waits up to ``mlflow.final_wait_s`` for the server, so the run is
ended and the model logged and registered. RUN_DIR/mlflow_synced counts the rows of
metrics.jsonl that MLflow has, so a resumed job sends what an earlier one could not.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import REPO_ROOT
from pipeline.errors import ConfigError
from pipeline.tracking_uri import resolve_tracking_uri
from pipeline.train.mlflow_store import create_new_store, sqlite_path

RUN_ID_FILE = "mlflow_run_id"
SYNCED_FILE = "mlflow_synced"  # rows of metrics.jsonl that MLflow holds
# MLflow 3's experiment kind (the UI's "GenAI apps & agents" vs "Machine learning"): plm's
# experiments are model training. Set on an experiment that has no kind yet, never over one
# a user chose.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# MLflow's description of a run or an experiment (the UI's "Description"); registered
# models and their versions have a description field of their own.
NOTE_TAG = "mlflow.note.content"
# Metrics MLflow gets in a unit its charts' axes read: (name there, factor). metrics.jsonl
# keeps the name and the value the code computes (what the tests and the evaluation read).
MLFLOW_UNITS = {"flops_per_s_per_device": ("tflop_per_s_per_device", 1e-12)}
# metrics.jsonl only: the last step's loss of a logging window, for comparing runs step by
# step; in MLflow it would chart beside the window's mean `loss`, nearly the same line.
JSONL_ONLY = frozenset({"step_loss"})


def _same_as_loss(metrics: dict[str, float]) -> set[str]:
    """Keys that chart ``loss`` again: an objective's only loss term (MLM's ``mlm_loss``,
    CLM's ``lm_loss``) when it equals the total, and the perplexity of that term; the same
    for ``eval_`` keys. An objective of several terms (NSP, ELECTRA) keeps them all."""
    out: set[str] = set()
    for prefix in ("", "eval_"):
        total = f"{prefix}loss"
        terms = [k for k in metrics if k.startswith("eval_") == bool(prefix)
                 and k.endswith("_loss") and k not in JSONL_ONLY and k != total]  # fmt: skip
        if len(terms) == 1 and metrics.get(total) == metrics[terms[0]]:
            out |= {terms[0], terms[0].removesuffix("loss") + "ppl"}
    return out


def for_mlflow(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics as MLflow gets them: ``MLFLOW_UNITS`` applied (FLOP/s as TFLOP/s), and
    without the charts that repeat ``loss`` (``JSONL_ONLY``, ``_same_as_loss``)."""
    out = {}
    dropped = JSONL_ONLY | _same_as_loss(metrics)
    for key, value in metrics.items():
        if key in dropped:
            continue
        name, factor = MLFLOW_UNITS.get(key, (key, 1.0))
        out[name] = value * factor if factor != 1.0 else value
    return out


def _millis(t: float) -> int:
    """A metrics.jsonl row's time as MLflow's timestamp, alike for every send of it."""
    return int(t * 1000)


def _count(n: Any) -> str:
    try:
        return f"{int(n):,}"
    except (TypeError, ValueError):
        return str(n)


def describe_run(
    params: dict[str, Any],
    tags: dict[str, str],
    tokens_seen: int | None = None,
    steps: int | None = None,
) -> str | None:
    """What a run is, for MLflow's description: the architecture (preset, layers, width),
    the objective or task, the data and the tokens (planned at the start: steps x global
    batch x sequence length; at the end: those seen). None for a run this cannot tell."""
    model, train, data = (params.get(k) or {} for k in ("model", "train", "data"))
    name = params.get("name", "?")
    if tags.get("stage") == "finetune":
        task = (params.get("task") or {}).get("type", "?")
        source = model.get("source", "?")
        init = (
            f"random weights in the architecture of {source}"
            if model.get("init") == "random"
            else f"from {source}"
        )
        files = ", ".join(f"{k} {data[k]}" for k in ("train", "valid", "test") if data.get(k))
        return (
            f"Fine-tuning of {tags.get('arch', '?')} for {task} ({train.get('mode', 'full')}, "
            f"{init}): {_count(params.get('n_labels', '?'))} labels, {files}, "
            f"{_count(train.get('epochs', '?'))} epochs. `plm finetune`, config {name}."
        )
    if "arch" not in model or "kind" not in (params.get("objective") or {}):
        return None
    resolved = params.get("model_resolved") or {}
    shape = ", ".join(
        f"{label} {resolved[key]}"
        for key, label in (("num_layers", "layers"), ("hidden_size", "hidden"))
        if key in resolved
    )
    preset = model.get("preset")
    what = model["arch"] + (
        f" ({', '.join(x for x in (preset, shape) if x)})" if preset or shape else ""
    )
    world = int(tags.get("world_size") or 1)
    batch = int(train.get("micro_batch_size", 1)) * int(train.get("grad_accum", 1)) * world
    seq = data.get("seq_len", "?")
    if tokens_seen is not None:
        tokens = f"{tokens_seen:,} tokens seen in {_count(steps)} steps"
    else:
        max_steps = int(train.get("max_steps", 0))
        planned = f" = {max_steps * batch * seq:,} positions" if isinstance(seq, int) else ""
        tokens = f"{max_steps:,} steps of {batch} x {seq} tokens{planned} at most"
    source = params.get("data_mixture") or data.get("path") or "?"
    return (
        f"Pretraining of {what} with {params['objective']['kind']} on {source}: {tokens}; "
        f"{world} rank{'s' if world > 1 else ''}, ZeRO {tags.get('zero_stage', '?')}. "
        f"`plm train`, config {name}."
    )


def describe_model(params: dict[str, Any], tags: dict[str, str], alias: str) -> str:
    """A registered model's description: what its versions are."""
    if tags.get("stage") == "finetune":
        task = (params.get("task") or {}).get("type", "?")
        return (
            f"{tags.get('arch', '?')} fine-tuned for {task} by `plm finetune` (config "
            f"{params.get('name', '?')}). Each version is the best model of one run (its "
            f"description: task, data, source); @{alias} is the latest."
        )
    arch = (params.get("model") or {}).get("arch", tags.get("arch", "?"))
    objective = (params.get("objective") or {}).get("kind", tags.get("objective", "?"))
    return (
        f"{arch} pretrained with {objective} by `plm train` (config {params.get('name', '?')}). "
        f"Each version is the final bundle of one run (its description: architecture, data, "
        f"tokens seen); @{alias} is the latest."
    )


def describe_experiment(params: dict[str, Any], tags: dict[str, str]) -> str:
    """An experiment's description, from the run that created it."""
    command = "plm finetune" if tags.get("stage") == "finetune" else "plm train"
    return (
        f"plm runs, the first by `{command}` (config {params.get('name', '?')}). Each run's "
        "description says what it is: the architecture, the objective or task, the data and "
        "the tokens."
    )


def ui_link(base_url: str, experiment_id: str) -> str:
    """An experiment's page in the MLflow UI's model-training view. MLflow 3.17's UI opens
    its GenAI view unless the URL asks for another (or the browser remembers the sidebar
    switch): the experiment's kind tag does not choose it, and the server has no setting
    for it (README section 4)."""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def how_to_view(uri: str, experiment_id: str) -> str:
    """Where a person sees the run: the server's UI page of the experiment, or for a local
    store the `mlflow ui` command that serves it, then that page."""
    if uri.startswith(("http://", "https://")):
        return ui_link(uri, experiment_id)
    return f"mlflow ui --backend-store-uri {uri}, then {ui_link('http://127.0.0.1:5000', experiment_id)}"


def code_version() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "plm-pipeline " + version("plm-pipeline")
    except PackageNotFoundError:
        return "unknown"


TIMEOUT_VAR = "MLFLOW_HTTP_REQUEST_TIMEOUT"
SHORT_TIMEOUT_S = "5"
_timeout_is_ours = False  # TIMEOUT_VAR set here, not by the user


def _short_http_timeouts() -> None:
    """Short timeouts and few retries: an unreachable server must cost seconds, not minutes
    (a user's own settings win)."""
    global _timeout_is_ours
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    _timeout_is_ours = TIMEOUT_VAR not in os.environ or (
        _timeout_is_ours and os.environ[TIMEOUT_VAR] == SHORT_TIMEOUT_S
    )
    os.environ.setdefault(TIMEOUT_VAR, SHORT_TIMEOUT_S)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


@contextlib.contextmanager
def upload_timeout(seconds: float):
    """MLflow's HTTP timeout at ``seconds`` meanwhile, unless the user set their own. A
    server that proxies artifacts stores the whole file (or completes a multipart upload
    of it on its object store) before it answers: for a large bundle, longer than the
    short timeout of the other calls (docs/training.md, memory of the MLflow upload)."""
    if not (_timeout_is_ours and os.environ.get(TIMEOUT_VAR) == SHORT_TIMEOUT_S):
        yield
        return
    os.environ[TIMEOUT_VAR] = f"{seconds:g}"
    try:
        yield
    finally:
        os.environ[TIMEOUT_VAR] = SHORT_TIMEOUT_S


@contextlib.contextmanager
def ipython_absent():
    """``import IPython`` fails meanwhile, unless IPython is loaded already. MLflow's
    ``start_run`` asks whether it runs in a notebook or a Databricks job by importing
    IPython and calling ``get_ipython()``, a noticeable part of a short run's start. With
    IPython not loaded there is no IPython shell in this process, and the ImportError
    gives MLflow the same answer (it treats it as "not in IPython")."""
    if "IPython" in sys.modules:
        yield
        return
    sys.modules["IPython"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "IPython" in sys.modules and sys.modules["IPython"] is None:
            del sys.modules["IPython"]


# Answers a later try may change: a timeout, too many requests, a server error.
_TRANSIENT = {408, 425, 429}
_INVALID_HOST = "Invalid Host header"  # MLflow 3.17's server, mlflow/server/security_utils.py


def _auth_headers() -> dict[str, str]:
    """The credentials MLflow's own client sends from the environment."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = (os.environ.get(f"MLFLOW_TRACKING_{k}") for k in ("USERNAME", "PASSWORD"))
    if user and password:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}
    return {}


def _server_words(body: str) -> str:
    """What the server said: an MLflow error's message, else the body's first line."""
    try:
        words = str(json.loads(body).get("message", body))
    except (ValueError, AttributeError):
        words = body
    return " ".join(words.split())[:300] or "(no text)"


def refusal(uri: str, status: int, words: str, experiment: str) -> str:
    """The `plm:` line for an answer retrying cannot change: the URL, the status, the
    server's words and the fix."""
    host = urllib.parse.urlsplit(uri).netloc.rpartition("@")[2]  # the Host header sent
    head = (f"MLflow at {uri} refused plm's request with HTTP {status} \"{words}\"; no "
            "retry can change that answer, so training does not start")  # fmt: skip
    if _INVALID_HOST in words:
        fix = (f"the server does not accept the Host header {host}: restart it with "
               f"--allowed-hosts {host} (comma-separated, every name and port it is reached "
               "by), or set mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to an address it "
               "accepts")  # fmt: skip
    elif status in (401, 403):
        fix = ("give plm credentials the server accepts: MLFLOW_TRACKING_USERNAME and "
               "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) of a user allowed to "
               f"write to experiment {experiment!r}")  # fmt: skip
    else:
        fix = ("check mlflow.tracking_uri (or MLFLOW_TRACKING_URI): it must be the base URL "
               "of an MLflow tracking server")  # fmt: skip
    return f"{head}: {fix}"


def check_server(uri: str, experiment: str) -> None:
    """Before the first step: ask an http(s) tracking server what logging asks first (the
    experiment, by name). An answer no retry can change (401, 403, another 4xx) is a
    ConfigError: `refusal`. No answer, or a server error, is an outage: training goes on
    and the tracker asks again later. The question is a plain HTTP request (MLflow's
    import comes after the first step); a refusal is confirmed through MLflow's client,
    so credentials only MLflow knows how to send (a plugin's) are not refused."""
    if not uri.startswith(("http://", "https://")):
        return
    query = urllib.parse.urlencode({"experiment_name": experiment})
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}"
    timeout = min(5.0, float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_auth_headers()),
                                    timeout=timeout):  # fmt: skip
            return
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read(4000).decode("utf-8", "replace")
    except (OSError, ValueError):  # refused, timed out, unresolvable: an outage
        return
    if status >= 500 or status < 400 or status in _TRANSIENT:
        return
    if status == 404 and "RESOURCE_DOES_NOT_EXIST" in body:  # MLflow answered: no such
        return  # experiment yet
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(uri).get_experiment_by_name(experiment)
    except MlflowException as err:
        code = re.search(r"error code (\d{3})", str(err))
        if code and int(code.group(1)) == status:
            raise ConfigError(refusal(uri, status, _server_words(body), experiment)) from None
    except Exception:  # anything else: the tracker's own start deals with it
        return


def check_local_artifacts(uri: str, experiment: str) -> None:
    """Before the first step, for a ``sqlite:///`` store: the folder MLflow will write this
    run's artifacts to (the experiment's artifact location; for a new experiment MLflow's
    default, ./mlruns in the working directory) can be written. A ConfigError otherwise:
    the run would train, then fail every artifact upload as if the store were away."""
    db = sqlite_path(uri)
    if db is None:
        return
    location = None
    if db.is_file():
        with (
            contextlib.suppress(sqlite3.Error),
            contextlib.closing(
                sqlite3.connect(f"file:{urllib.parse.quote(str(db))}?mode=ro", uri=True)
            ) as conn,
        ):
            row = conn.execute(
                "select artifact_location from experiments where name = ?", (experiment,)
            ).fetchone()
            location = row[0] if row else None
    if location is None:
        where = Path.cwd() / "mlruns"
        why = "MLflow's default for a new experiment in a sqlite:/// store: ./mlruns in the working directory"
    elif "://" not in location or location.startswith("file://"):
        where = Path(urllib.parse.urlparse(location).path if "://" in location else location)
        why = f"experiment {experiment!r}'s artifact location"
    else:
        return  # an object store or a server: not a folder of this host
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if os.access(probe, os.W_OK):
        return
    raise ConfigError(
        f"MLflow would keep this run's artifacts (its model, the bundles) in {where} ({why}), "
        f"and {probe} cannot be written here: run plm from a writable directory, or set "
        "mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to an MLflow server"
    )


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def mark_model_training(experiment_id: str, description: str | None = None) -> None:
    """Tag the experiment as model training (``mlflow.experimentKind``), unless it has a
    kind already (the UI's selector, or a user's tag); give it ``description`` unless it
    has one."""
    from mlflow import MlflowClient

    client = MlflowClient()
    tags = client.get_experiment(experiment_id).tags
    if EXPERIMENT_KIND_TAG not in tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    if description and not tags.get(NOTE_TAG):
        client.set_experiment_tag(experiment_id, NOTE_TAG, description)


def dataset(uri: str, name: str, digest: str):
    """An MLflow data set that names files by their URI (a local path or ``s3://...``)
    and identifies them by ``digest``: nothing is read, the fingerprint says it all."""
    import warnings

    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    with warnings.catch_warnings():  # MLflow warns that it guessed the source's kind
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(uri)
    return MetaDataset(source, name=name, digest=digest[:36])


def log_dataset(uri: str, name: str, digest: str, context: str, run_id: str | None = None) -> None:
    """``dataset(uri, name, digest)`` as an input of ``run_id`` (default: the active run)."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import DatasetInput, InputTag

    run_id = run_id or mlflow.active_run().info.run_id
    entity = dataset(uri, name, digest)._to_mlflow_entity()
    tags = [InputTag(key="mlflow.data.context", value=context)]
    MlflowClient().log_inputs(run_id, datasets=[DatasetInput(entity, tags)])


class Tracker:
    """MLflow on rank 0, a jsonl file always; each MLflow call guarded."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        retry_every_s: float = 30.0,
        final_wait_s: float = 60.0,
        every_row: dict[str, float] | None = None,
        upload_timeout_s: float = 600.0,
    ):
        self.run_dir = Path(run_dir)
        # fields every metrics row carries unless it has its own (training: world_size)
        self.every_row = dict(every_row or {})
        self.enabled = enabled  # rank 0
        self.mlflow_ok = False
        self.run_id: str | None = None
        self.uri: str | None = None
        self.warnings: list[str] = []
        self.retry_every_s = retry_every_s
        self.final_wait_s = final_wait_s
        self.upload_timeout_s = upload_timeout_s  # an artifact request's (upload_timeout)
        self.backfilled = 0  # rows sent from metrics.jsonl after outages
        self._jsonl = self.run_dir / "metrics.jsonl"
        self._rows = 0  # rows of metrics.jsonl
        self._sent = 0  # of them, in MLflow
        self._start_args: dict[str, Any] | None = None
        self._next_try = 0.0
        self._waited = False
        self._deferred: list[Any] | None = None  # calls made before the run started
        self._note: str | None = None  # the run description this job set (describe_run)
        self._tokens_seen: int | None = None  # the last metrics row's, for the final one
        self._step: int | None = None

    def _catch_up(self) -> None:
        """Start the deferred run (``start``), then make the calls that came meanwhile."""
        if self._deferred is None:
            return
        calls, self._deferred = self._deferred, None
        self._start_now()
        for call in calls:
            call()

    def _fail(self, what: str, err: BaseException) -> None:
        msg = (
            f"MLflow {what} failed ({type(err).__name__}: {str(err)[:300]}); training goes on, "
            f"metrics stay in {self._jsonl} and are sent when the server answers again "
            f"(asked every {self.retry_every_s:g} s)"
        )
        if self.mlflow_ok:
            warnings.warn(msg, stacklevel=3)
            print(f"WARNING: {msg}", flush=True)
        self.warnings.append(msg)
        self.mlflow_ok = False
        self._next_try = time.monotonic() + self.retry_every_s
        self._save_synced()

    def _save_synced(self) -> None:
        # After every row MLflow took, not only after an outage: the file travels with each
        # checkpoint, and a stale count made the next job send rows MLflow had (twice in
        # its history). Replaced whole, so a process killed mid-write leaves the old count.
        # A failed write (a full disk) is left to the checkpoint's write to report, with its path:
        # the old count stays, and a row sent again is one point (its own time).
        tmp = self.run_dir / f".{SYNCED_FILE}.{os.getpid()}"
        try:
            tmp.write_text(str(self._sent))
            os.replace(tmp, self.run_dir / SYNCED_FILE)
        except OSError:
            tmp.unlink(missing_ok=True)

    def reconnect(self, wait_s: float = 0.0) -> bool:
        """True when MLflow takes calls (again). Asks the server at most every
        retry_every_s (``wait_s``: keep asking that long); once it answers, starts the run
        if it never started and sends the metrics.jsonl rows it lacks."""
        if not self.enabled or self._start_args is None:
            return False
        deadline = time.monotonic() + wait_s
        while not self.mlflow_ok:
            now = time.monotonic()
            if now >= self._next_try:  # time to ask again
                self._next_try = now + self.retry_every_s
                self._try_reconnect()
            elif self._next_try <= deadline:  # waiting: sleep until the next question
                time.sleep(self._next_try - now)
            else:
                break
        return self.mlflow_ok

    def _try_reconnect(self) -> None:
        import mlflow
        from mlflow import MlflowClient

        try:
            if self.run_id is None:  # the start itself failed: start now
                self._start_now()
                if not self.mlflow_ok:
                    return
            else:
                MlflowClient(self.uri).get_run(self.run_id)  # does it answer?
                if mlflow.active_run() is None:
                    with ipython_absent():
                        mlflow.start_run(run_id=self.run_id, log_system_metrics=True)
            n = self._backfill()
            self.mlflow_ok = True
            print(f"MLflow answers again at {self.uri}: sent {n} metric rows logged meanwhile",
                  flush=True)  # fmt: skip
        except Exception as err:
            self.mlflow_ok = False
            self.warnings.append(f"MLflow still unreachable ({type(err).__name__})")

    def _backfill(self) -> int:
        """Send the rows of metrics.jsonl after the first ``_sent``; returns how many."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        lines = (
            self._jsonl.read_text(encoding="utf-8").splitlines() if self._jsonl.is_file() else []
        )
        rows = [json.loads(x) for x in lines[self._sent :]]
        metrics = []
        for row in rows:
            t = _millis(float(row.get("time", time.time())))
            values = {k: v for k, v in row.items()
                      if k not in ("step", "time") and isinstance(v, (int, float))}  # fmt: skip
            metrics += [
                Metric(k, float(v), t, int(row["step"])) for k, v in for_mlflow(values).items()
            ]
        client = MlflowClient(self.uri)
        for i in range(0, len(metrics), 1000):  # the REST API's batch limit
            client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self._sent = self._rows = len(lines)
        self.backfilled += len(rows)
        self._save_synced()
        return len(rows)

    def start(
        self,
        *,
        tracking_uri: str | None,
        experiment: str,
        run_name: str,
        params: dict[str, Any],
        tags: dict[str, str],
        resume: bool,
        defer: bool = False,
    ) -> None:
        """The MLflow run: started now, or (``defer``) by the first metrics row or the
        first call that needs the run, so that MLflow's (slow) import comes after
        the first step, not before it. Before it, only a plain HTTP question to a tracking
        server (``check_server``: a refusal ends the run there)."""
        _short_http_timeouts()
        # Every rank asks (each exits 2 alike; rank 0 prints the line), before any step.
        uri = resolve_tracking_uri(tracking_uri)
        check_server(uri, experiment)
        if not self.enabled:
            return
        check_local_artifacts(uri, experiment)  # rank 0's
        self._start_args = dict(tracking_uri=tracking_uri, experiment=experiment,
                                run_name=run_name, params=params, tags=tags, resume=resume)  # fmt: skip
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._jsonl.is_file() and not self._rows:  # a resumed job: what MLflow has
            self._rows = len(self._jsonl.read_text(encoding="utf-8").splitlines())
            synced = self.run_dir / SYNCED_FILE
            self._sent = int(synced.read_text()) if synced.is_file() else self._rows
        self.uri = uri
        if defer:
            self._deferred = []  # the calls made meanwhile, made once the run started
        else:
            self._start_now()

    def _start_now(self) -> None:
        import mlflow

        args = self._start_args or {}
        uri, resume = self.uri, args["resume"]
        experiment, run_name = args["experiment"], args["run_name"]
        params, tags = args["params"], args["tags"]
        id_file = self.run_dir / RUN_ID_FILE
        try:
            # A new sqlite store at its current schema in one step, not MLflow's 68
            # migrations: pipeline/train/mlflow_store.py.
            create_new_store(uri)
            mlflow.set_tracking_uri(uri)
            previous = id_file.read_text().strip() if resume and id_file.is_file() else None
            with ipython_absent():  # MLflow's run context, without importing IPython
                if previous:
                    run = mlflow.start_run(run_id=previous, log_system_metrics=True)
                else:
                    mlflow.set_experiment(experiment)
                    run = mlflow.start_run(run_name=run_name, log_system_metrics=True)
                    id_file.write_text(run.info.run_id)
            self.run_id = run.info.run_id
            self.mlflow_ok = True
            mark_model_training(run.info.experiment_id, describe_experiment(params, tags))
            if not previous:
                items = [(k, str(v)[:6000]) for k, v in flatten(params).items()]
                for i in range(0, len(items), 100):
                    mlflow.log_params(dict(items[i : i + 100]))
            note = describe_run(params, tags)
            if note and not run.data.tags.get(NOTE_TAG):  # never over a user's description
                tags = {**tags, NOTE_TAG: note}
                self._note = note
            mlflow.set_tags(tags)
            print(f"MLflow run {self.run_id} at {uri}", flush=True)
            print(f"  see it: {how_to_view(uri, run.info.experiment_id)}", flush=True)
            if self._sent < self._rows:  # an earlier job's outage: send what MLflow lacks
                self._backfill()
        except Exception as err:  # network, server, store: never fatal
            self.mlflow_ok = not self.warnings  # so _fail warns, once
            self._fail(f"start at {uri}", err)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        metrics = {**metrics, **{k: v for k, v in self.every_row.items() if k not in metrics}}
        if "tokens_seen" in metrics:  # for the run's final description
            self._tokens_seen, self._step = int(metrics["tokens_seen"]), step
        now = round(time.time(), 3)
        with open(self._jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics, "time": now}) + "\n")
        self._rows += 1
        if self._deferred is not None:  # the run starts now; its start sends this row
            self._catch_up()
            return
        if not self.mlflow_ok:
            self.reconnect()  # sends this row too when the server answers again
            return
        import mlflow

        try:
            # The row's own time, as a backfill sends it: a row sent twice (a call that
            # timed out after the server stored it) is then one point, not two.
            mlflow.log_metrics(for_mlflow(metrics), step=step, timestamp=_millis(now))
            self._sent = self._rows
            self._save_synced()
        except Exception as err:
            self._fail("log_metrics", err)

    def _later(self, call) -> bool:
        """Before the deferred run started: keep ``call`` for then (True)."""
        if self._deferred is not None:
            self._deferred.append(call)
            return True
        return False

    def log_artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        if self._later(lambda: self.log_artifacts(local_dir, artifact_path)):
            return
        if self.enabled and self.mlflow_ok:
            import mlflow

            try:
                with upload_timeout(self.upload_timeout_s):
                    mlflow.log_artifacts(str(local_dir), artifact_path)
            except Exception as err:
                self._fail(f"log_artifacts {artifact_path}", err)

    def log_dict(self, obj: dict[str, Any], name: str) -> None:
        if self._later(lambda: self.log_dict(obj, name)):
            return
        if self.enabled and self.mlflow_ok:
            import mlflow

            try:
                mlflow.log_dict(obj, name)
            except Exception as err:
                self._fail(f"log_dict {name}", err)

    def log_dataset(self, uri: str, name: str, digest: str, context: str) -> None:
        """The data set ``uri`` as an input of the run (the UI's "Datasets" column), with
        ``digest`` (the data dir's fingerprint) and ``context`` (training / eval)."""
        if self._later(lambda: self.log_dataset(uri, name, digest, context)):
            return
        if self.enabled and self.mlflow_ok:
            try:
                log_dataset(uri, name, digest, context)
            except Exception as err:
                self._fail(f"log_input {uri}", err)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._later(lambda: self.set_tags(tags)):
            return
        if self.enabled and self.mlflow_ok:
            import mlflow

            try:
                mlflow.set_tags({k: str(v)[:4000] for k, v in tags.items()})
            except Exception as err:
                self._fail("set_tags", err)

    def register(
        self,
        artifact_path: str,
        name: str,
        alias: str,
        tags: dict[str, str],
        bundle_dir: Path | None = None,
        log_model: Callable[[Path, str], Any] | None = None,
    ) -> str | None:
        """A new version of ``name`` with ``alias`` and ``tags``: the folder ``bundle_dir``
        as an MLflow model when it is given, logged by ``log_model`` (default: a pretrained
        bundle's, pipeline.models.pyfunc; fine-tuning passes its own), else (or if MLflow
        refuses that) runs:/RUN/artifact_path, the plain folder."""
        self._catch_up()
        if not (self.enabled and self.mlflow_ok):
            return None
        import mlflow
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        args = self._start_args or {}
        params, run_tags = args.get("params") or {}, args.get("tags") or {}
        try:
            client = MlflowClient()
            about = describe_model(params, run_tags, alias)
            try:
                client.create_registered_model(name, description=about)
            except MlflowException as err:
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                if not client.get_registered_model(name).description:  # never over a user's
                    client.update_registered_model(name, description=about)
            version_note = self._version_note(tags)
            mv = None
            if bundle_dir is not None:  # an MLflow model (LoggedModel, pyfunc flavour)
                with upload_timeout(self.upload_timeout_s):
                    mv = self._register_logged_model(
                        bundle_dir, name, tags, log_model, version_note
                    )
            if mv is None:
                # The plain artifact folder (our bundle): registered by its artifact URI so
                # the version points at exactly those files.
                source = mlflow.get_artifact_uri(artifact_path)
                mv = client.create_model_version(
                    name, source, run_id=self.run_id, tags=tags, description=version_note
                )
            client.set_registered_model_alias(name, alias, mv.version)
            print(f"registered model {name} version {mv.version} alias @{alias}", flush=True)
            return str(mv.version)
        except Exception as err:
            self._fail(f"register_model {name}", err)
            return None

    def _final_note(self) -> str | None:
        """The run's description at its end: with the tokens seen where metrics said so."""
        args = self._start_args or {}
        params, tags = args.get("params") or {}, args.get("tags") or {}
        return describe_run(params, tags, self._tokens_seen, self._step)

    def _version_note(self, tags: dict[str, str]) -> str | None:
        """A model version's description: its run's final one, the run id and the best
        valid metric of a fine-tuning (its ``valid_*`` tag)."""
        note = self._final_note()
        if note is None:
            return None
        best = "".join(
            f" Best valid {k[len('valid_') :]} {v}."
            for k, v in tags.items()
            if k.startswith("valid_")
        )
        return f"{note}{best} Run {self.run_id}."

    def _register_logged_model(
        self,
        bundle_dir: Path,
        name: str,
        tags: dict[str, str],
        log_model,
        description: str | None = None,
    ):
        """Log the bundle (or fine-tuned folder) as a LoggedModel with a pyfunc flavour (the
        UI's "Logged models", ``mlflow.pyfunc.load_model``) and register that; None (with a
        warning) if MLflow refuses, so the plain artifact folder is registered instead."""
        from mlflow import MlflowClient

        from pipeline.models.pyfunc import log_bundle_model

        try:
            # Named after the registered model, not "model": MLflow 3 resolves runs:/RUN/NAME
            # to a logged model of that name first, and runs:/RUN/model is the bundle folder.
            with ipython_absent():  # the LoggedModel's run context, as start_run's
                info = (log_model or log_bundle_model)(bundle_dir, name)
            return MlflowClient().create_model_version(
                name, f"models:/{info.model_id}", run_id=self.run_id, tags=tags,
                model_id=info.model_id, description=description,
            )  # fmt: skip
        except Exception as err:
            msg = f"MLflow pyfunc model of {bundle_dir} not logged ({type(err).__name__}: {err})"
            self.warnings.append(msg)
            print(f"WARNING: {msg}; registering the bundle folder instead", flush=True)
            return None

    def terminate(self, status: str, tags: dict[str, str]) -> None:
        """End the run from another thread (the fluent API's active run is the main
        thread's): tags, then the status, through a client of the run's tracking URI."""
        self._catch_up()
        if not (self.enabled and self.mlflow_ok and self.run_id):
            return
        from mlflow import MlflowClient

        try:
            client = MlflowClient(self.uri)
            for k, v in tags.items():
                client.set_tag(self.run_id, k, str(v)[:4000])
            client.set_terminated(self.run_id, status)
        except Exception as err:
            self._fail("set_terminated", err)

    def await_server(self) -> bool:
        """Before the end of a finished run: wait up to final_wait_s (once per job) for a
        server that answered earlier in this job, so the run can be ended and the model
        logged and registered; one question when it never answered."""
        self._catch_up()
        if not self.enabled or self.mlflow_ok:
            return self.mlflow_ok
        wait = self.final_wait_s if self.run_id is not None and not self._waited else 0.0
        self._waited = True
        if wait:
            print(f"MLflow unreachable: waiting up to {wait:g} s (mlflow.final_wait_s) to end "
                  "the run and log the model", flush=True)  # fmt: skip
        return self.reconnect(wait)

    def left_behind(self) -> str | None:
        """After ``end``: what a finished job left out of MLflow (the server did not answer
        within final_wait_s), as one sentence for the ``plm:`` line; None when MLflow has
        it all (or this rank does not track)."""
        self._catch_up()
        if not self.enabled or self.mlflow_ok:
            return None
        rows = self._rows - self._sent
        if self.run_id is None:
            what = f"the run never started there; {rows} metric rows of {self._jsonl} are unsent"
        else:
            what = (
                f"run {self.run_id} stays RUNNING there, {rows} metric rows of {self._jsonl} "
                "are unsent and the final model is not logged"
            )
        return (
            f"training finished, but MLflow at {self.uri} did not answer within "
            f"mlflow.final_wait_s={self.final_wait_s:g} s: {what}. Re-run the same command "
            "once the server answers: it resumes the finished run and syncs them (the "
            "metrics, the run's end and the model); nothing is trained again"
        )

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status``; "RUNNING": send what is unsent and leave the run
        open (an elastic agent starts the ranks again, and they resume it)."""
        self._catch_up()
        if status == "RUNNING":
            return
        if self.enabled and not self.mlflow_ok:
            if status == "FINISHED":
                self.await_server()
            else:
                self.reconnect()
        if self.enabled and self.mlflow_ok:
            import mlflow

            try:
                if status == "FINISHED":
                    self._set_final_note()
                mlflow.end_run(status=status)
                self._save_synced()
            except Exception as err:
                self._fail("end_run", err)

    def _set_final_note(self) -> None:
        """The run's description with the tokens seen, over the one this job set at the
        start (not over one a user wrote meanwhile)."""
        final = self._final_note()
        if self._note is None or final is None or final == self._note:
            return
        from mlflow import MlflowClient

        client = MlflowClient(self.uri)
        if client.get_run(self.run_id).data.tags.get(NOTE_TAG) == self._note:
            client.set_tag(self.run_id, NOTE_TAG, final)
            self._note = final
