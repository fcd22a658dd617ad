"""The suite's results in MLflow, where people look:

- one evaluation run per ``plm eval``: the suite, each task's data set (``log_input``
  with its digest), ``<task>/<metric>`` at each checkpoint's step, the table
  (``eval/table.csv``, ``eval/cells.csv``) and the picture (``eval/scores.png``);
- each checkpoint of a pretraining run as a ``LoggedModel`` of that run (its step, the
  losses at that step, its data fingerprint, where its checkpoint is; the bundle as a
  pyfunc model), its scores linked to it and to the task's data set;
- the pretraining run's ``eval/<task>/<metric>`` at each checkpoint's step (the random
  baseline at step 0), so the UI charts them beside the loss;
- the best checkpoint by the suite's selection rule registered under the pretraining
  model's name with the alias ``mlflow.alias`` (``@best``).

A second ``plm eval`` of the same checkpoint adds its scores to the same LoggedModel
(found by name in the pretraining run's experiment) rather than logging it again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.eval.plan import TaskPlan
from pipeline.eval.results import Row
from pipeline.eval.sources import Candidate
from pipeline.eval.suite import SuiteConfig

MODEL_TYPE = "plm-checkpoint"


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def checkpoint_model_name(c: Candidate) -> str:
    return f"{c.model_name or 'run'}-{c.label}"


def logged_model_of(client, experiment_id: str, c: Candidate) -> str:
    """The LoggedModel id of checkpoint ``c``: the one an earlier evaluation logged, else
    a new one with the bundle as its pyfunc model (uploaded here, not by training)."""
    import mlflow

    from pipeline.models.pyfunc import log_bundle_model
    from pipeline.train.tracking import ipython_absent, upload_timeout

    name = checkpoint_model_name(c)
    for m in client.search_logged_models([experiment_id], filter_string=f"name = '{name}'"):
        if m.source_run_id == c.run_id and str(m.status) in ("READY", "LoggedModelStatus.READY"):
            return m.model_id
    params = {"step": str(c.step), **{k: f"{v:.6g}" for k, v in c.losses.items()}}
    tags = {"plm.step": str(c.step), "plm.checkpoint": c.checkpoint or "",
            "plm.bundle": str(c.bundle), "plm.data_fingerprint": c.data.get("fingerprint", ""),
            "plm.data_uri": c.data.get("uri", "")}  # fmt: skip
    model = mlflow.initialize_logged_model(
        name=name, source_run_id=c.run_id, tags=tags, params=params, model_type=MODEL_TYPE,
        experiment_id=experiment_id,
    )  # fmt: skip
    with ipython_absent(), upload_timeout(600.0):
        log_bundle_model(c.bundle, name, model_id=model.model_id, step=int(c.step or 0))
    return model.model_id


class EvalTracking:
    """The evaluation run and what it links to, through one MlflowClient."""

    def __init__(self, suite: SuiteConfig, candidates: list[Candidate], plans: dict[str, TaskPlan]):
        import mlflow

        from pipeline.tracking_auth import require_write, signed_in
        from pipeline.tracking_uri import resolve_tracking_uri
        from pipeline.train.mlflow_store import create_new_store

        self.suite, self.candidates, self.plans = suite, candidates, plans
        self.uri = resolve_tracking_uri(suite.mlflow.tracking_uri)
        user = signed_in(self.uri, "the evaluation")  # a wrong password: one plm: line
        create_new_store(self.uri)
        mlflow.set_tracking_uri(self.uri)
        self.client = _client(self.uri)
        self.experiment_id = self._experiment()
        if user:  # its run goes there: the user must be allowed to write it
            what = f"experiment id {self.experiment_id}"
            require_write(self.uri, user, "experiment", self.experiment_id, what, "the evaluation")
        self.run_id: str | None = None
        self.model_ids: dict[int, str] = {}

    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        from pipeline.eval.suite import EvalError

        for c in self.candidates:  # every pretraining run named must be in this store
            if not c.run_id:
                continue
            try:
                self.client.get_run(c.run_id)
            except MlflowException:
                raise EvalError(
                    f"{c.checkpoint or c.label} was logged to the MLflow run {c.run_id}, which "
                    f"the store {self.uri} does not have: give the run's store (--tracking-uri, "
                    "mlflow.tracking_uri or MLFLOW_TRACKING_URI)"
                ) from None
        pre = next((c.run_id for c in self.candidates if c.run_id), None)
        if pre and not self.suite.mlflow.experiment:
            return self.client.get_run(pre).info.experiment_id
        name = self.suite.mlflow.experiment or self.suite.name
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def start(self) -> str:
        from pipeline.train.tracking import code_version, flatten

        pre = sorted({c.run_id for c in self.candidates if c.run_id})
        tags = {"stage": "eval", "suite": self.suite.name, "code_version": code_version(),
                "pretraining_run_ids": ",".join(pre),
                "models": ", ".join(c.label for c in self.candidates)}  # fmt: skip
        run = self.client.create_run(
            self.experiment_id, run_name=self.suite.mlflow.run_name or f"eval-{self.suite.name}",
            tags=tags,
        )  # fmt: skip
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [
            Param(k, str(v)[:6000]) for k, v in flatten(self.suite.model_dump(mode="json")).items()
        ]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        from pipeline.train.tracking import log_dataset

        for p in self.plans.values():
            log_dataset(p.files[0], p.name, p.digest, "eval", run_id=self.run_id)
        print(f"MLflow evaluation run {self.run_id} at {self.uri}", flush=True)
        return self.run_id

    def log_results(
        self, rows: list[Row], files: list[Path], best: int | None, new: set[int] | None = None
    ) -> str | None:
        """Everything above for the candidates ``new`` (default: all; the table and the
        picture always whole); ``best``: register it (None: leave the alias as it is).
        Returns the registered ``NAME@alias``, if any."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        eval_metrics: list[Any] = []
        by_run: dict[str, list[Any]] = {}
        for i, c in enumerate(self.candidates):
            mine = [r for r in rows if r.candidate == i and r.values]
            if c.step is None or not mine or (new is not None and i not in new):
                continue
            model_id = None
            if c.init == "pretrained" and c.run_id and c.checkpoint:
                model_id = self.model_ids[i] = logged_model_of(self.client, self.experiment_id, c)
            prefix = "random/" if c.init == "random" else ""
            for r in mine:
                p = self.plans[r.task]
                key = f"{r.task}/{r.metric}"
                eval_metrics.append(Metric(prefix + key, r.mean, now, c.step, model_id=model_id,
                                           dataset_name=p.name, dataset_digest=p.digest[:36]))  # fmt: skip
                eval_metrics.append(Metric(f"{prefix}{key}_std", r.std, now, c.step))
                if c.run_id:
                    by_run.setdefault(c.run_id, []).append(
                        Metric(f"eval/{key}", r.mean, now, c.step)
                    )
            if model_id:  # the losses at that step, linked to the model too
                eval_metrics += [Metric(f"pretraining/{k}", v, now, c.step, model_id=model_id)
                                 for k, v in c.losses.items()]  # fmt: skip
        for i in range(0, len(eval_metrics), 1000):
            self.client.log_batch(self.run_id, metrics=eval_metrics[i : i + 1000])
        for run_id, metrics in by_run.items():  # the pretraining runs: charts beside the loss
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(run_id, metrics=metrics[i : i + 1000])
        for f in files:
            self.client.log_artifact(self.run_id, str(f), "eval")
        self.client.log_text(self.run_id, json.dumps(self.suite.model_dump(mode="json"), indent=2),
                             "eval/suite.json")  # fmt: skip
        return self._register_best(best)

    def _register_best(self, best: int | None) -> str | None:
        from mlflow.exceptions import MlflowException

        if best is None or best not in self.model_ids or not self.suite.mlflow.register_model:
            return None
        c = self.candidates[best]
        name, alias = c.model_name or self.suite.name, self.suite.mlflow.alias
        try:
            self.client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        model_id = self.model_ids[best]
        mv = self.client.create_model_version(
            name, f"models:/{model_id}", run_id=c.run_id, model_id=model_id,
            tags={"step": str(c.step), "checkpoint": c.checkpoint or "",
                  "selected_by": f"plm eval {self.suite.name} (run {self.run_id})"},
        )  # fmt: skip
        self.client.set_registered_model_alias(name, alias, mv.version)
        self.client.set_tag(self.run_id, "best", f"{c.label} (step {c.step})")
        return f"models:/{name}@{alias}"

    def end(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status)


def table_of_run(run_id: str, tracking_uri: str | None) -> tuple[str, Path]:
    """(the evaluation run's id, its table.csv downloaded): ``run_id`` an evaluation run,
    or a pretraining run (its newest evaluation run)."""
    import tempfile

    import mlflow

    from pipeline.eval.suite import EvalError
    from pipeline.tracking_auth import signed_in
    from pipeline.tracking_uri import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    signed_in(uri, "plm eval --report")  # a wrong password: one plm: line, not "no such run"
    client = _client(uri)
    try:
        run = client.get_run(run_id)
    except Exception:
        raise EvalError(f"--report {run_id}: no such run in the MLflow store {uri}") from None
    if run.data.tags.get("stage") != "eval":
        found = client.search_runs(
            [run.info.experiment_id],
            filter_string=f"tags.stage = 'eval' and tags.pretraining_run_ids LIKE '%{run_id}%'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )  # fmt: skip
        if not found:
            raise EvalError(f"--report {run_id}: no evaluation run of this run yet (plm eval)")
        run = found[0]
    out = Path(tempfile.mkdtemp(prefix="plm-eval-report-"))
    path = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="eval/table.csv", dst_path=str(out),
        tracking_uri=uri,
    )  # fmt: skip
    return run.info.run_id, Path(path)
