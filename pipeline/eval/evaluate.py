"""`plm eval SUITE --models SOURCE ...`: every model the sources name, scored on every
task of the suite with every seed, as one Ray task per cell; the table in the terminal,
in files and in MLflow; the best checkpoint as ``@best``. ``--watch RUN``: the same for
each checkpoint of RUN as training writes it.

    resolve   suite + sources -> candidates (bundles found or made) and task plans
    check     every input error before Ray: files, columns, labels, task vs architecture
    run       the cells (Ray, or this process with ``--no-ray``)
    report    the table (CSV, picture, terminal) and MLflow
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.eval.plan import build_cells, check_fits, plan_tasks
from pipeline.eval.results import format_table, plot, select_best, summarize, write_csvs
from pipeline.eval.runner import CellResult, run_in_process, run_on_ray
from pipeline.eval.sources import (
    RANDOM,
    Candidate,
    checkpoint_candidate,
    mirrored_candidate,
    resolve_candidates,
    run_checkpoints,
)
from pipeline.eval.store_run import StoreMirror
from pipeline.eval.suite import EvalError, SuiteConfig
from pipeline.storage import is_uri


@dataclass
class EvalResult:
    candidates: list[Candidate]
    results: list[CellResult]
    table: Path
    best: Candidate | None
    registered: str | None
    run_id: str | None
    skipped: list[str]  # checkpoints gone before their turn (--watch)


def say(msg: str) -> None:
    print(f"[plm eval] {msg}", flush=True)


class Session:
    """One evaluation: its tasks, the candidates scored so far, their cells' results and
    its MLflow run. ``add`` scores more candidates; ``report`` writes the table."""

    def __init__(self, suite: SuiteConfig, address: str | None, use_ray: bool, track: bool):
        self.suite, self.address, self.use_ray, self.track = suite, address, use_ray, track
        self.work_dir = Path(suite.work_dir).resolve()
        self.plans = plan_tasks(suite, self.work_dir)  # every data error, before any model
        self.candidates: list[Candidate] = []
        self.results: list[CellResult] = []
        self.tracking = None
        self.registered: str | None = None
        self.best: int | None = None

    def check(self, new: list[Candidate]) -> None:
        check_fits(self.plans, new)

    def add(self, new: list[Candidate]) -> None:
        """Score ``new`` (checked already) and log them."""
        first = len(self.candidates)
        self.candidates += new
        if self.track and self.tracking is None:
            from pipeline.eval.track import EvalTracking

            self.tracking = EvalTracking(self.suite, self.candidates, self.plans)
            self.tracking.start()
        cells = build_cells(self.suite, self.plans, self.candidates, self.work_dir)
        cells = [c for c in cells if c.candidate >= first]
        say(f"{len(new)} models x {len(self.plans)} tasks: {len(cells)} cells "
            f"({'Ray' if self.use_ray else 'this process'})")  # fmt: skip
        if self.use_ray:
            got = run_on_ray(cells, self.suite.workers, self.address, self._progress)
        else:
            got = run_in_process(cells, self._progress)
        self.results += got
        self.report(set(range(first, len(self.candidates))))

    def _progress(self, r: CellResult) -> None:
        c = self.candidates[r.cell.candidate]
        if r.scores is None:
            what = f"FAILED: {r.error}"
        else:
            what = " ".join(f"{k} {v:.4f}" for k, v in r.scores.items())
        where = f" ({r.host})" if r.host else ""
        say(f"{c.label} {r.cell.task} seed {r.cell.seed}{where}: {what}")

    def report(self, new: set[int]) -> Path:
        rows = summarize(self.results)
        out = self.work_dir / "report"
        table, cells_csv = write_csvs(rows, self.results, self.candidates, out)
        picture = plot(rows, self.candidates, self.plans, out)
        best = select_best(rows, self.plans, self.candidates, self.suite.select.task)
        print(format_table(rows, self.candidates, self.plans), flush=True)
        if self.tracking is not None:
            changed = best != self.best
            reg = self.tracking.log_results(rows, [table, cells_csv, picture],
                                            best if changed else None, new)  # fmt: skip
            self.registered = reg or self.registered
        self.best = best
        if best is not None:
            c = self.candidates[best]
            tail = f" -> {self.registered}" if self.registered else ""
            say(f"best: {c.label} (step {c.step}){tail}")
        say(f"table: {table}  picture: {picture}")
        return table

    def result(self, skipped: list[str]) -> EvalResult:
        best = self.candidates[self.best] if self.best is not None else None
        run_id = self.tracking.run_id if self.tracking else None
        return EvalResult(self.candidates, self.results, self.work_dir / "report" / "table.csv",
                          best, self.registered, run_id, skipped)  # fmt: skip

    def end(self, status: str) -> None:
        if self.tracking is not None:
            self.tracking.end(status)


def evaluate(
    suite: SuiteConfig,
    sources: list[str],
    address: str | None = None,
    use_ray: bool = True,
    track: bool = True,
) -> EvalResult:
    session = Session(suite, address, use_ray, track)
    candidates = resolve_candidates(sources, session.work_dir, suite.mlflow.tracking_uri)
    session.check(candidates)
    status = "FAILED"
    try:
        session.add(candidates)
        status = "FINISHED"
    finally:
        session.end(status)
    return session.result([])


def watch(
    suite: SuiteConfig,
    run_dir: str,
    baselines: list[str],
    address: str | None = None,
    use_ray: bool = True,
    poll_s: float = 30.0,
    done: Callable[[Path], bool] | None = None,
) -> EvalResult:
    """Score each checkpoint of ``run_dir`` once it is complete, as training writes them,
    until training has written its final bundle (``done``) and every checkpoint then
    present is scored. ``baselines`` (``random``, bundles) are scored with the first. A
    checkpoint that ``keep_last`` deleted before its turn is reported and skipped."""
    session = Session(suite, address, use_ray, track=True)
    mirror = StoreMirror(run_dir, session.work_dir) if is_uri(run_dir) else None
    run = mirror.local if mirror else Path(run_dir)  # a store's run: read through its mirror
    if mirror is None and not run.is_dir():  # training may not have started: it makes it
        say(f"waiting for {run} (the run's train.out_dir) to appear")
    done = done or (lambda r: (r / "bundles" / "final" / "config.yaml").is_file())
    seen: set[str] = set()
    skipped: list[str] = []
    status = "FAILED"
    started = _start_ray(session)
    try:
        while True:
            if mirror is not None:
                mirror.sync()  # the final bundle's mark first, then the checkpoints
                skipped += mirror.skipped
                mirror.skipped.clear()
            finished = done(run)  # asked first: a checkpoint listed after it is the last
            new = _new_checkpoints(run, seen, session, skipped, mirror)
            if new and not session.candidates and baselines:
                base = [b for b in baselines if b != RANDOM]
                extra = resolve_candidates(base, session.work_dir, suite.mlflow.tracking_uri)
                if RANDOM in baselines:
                    extra.insert(0, _random_of(new[0]))
                session.check(extra)
                new = extra + new
            if new:
                session.add(new)
            elif finished:
                break
            else:
                time.sleep(poll_s)
        status = "FINISHED"
    except KeyboardInterrupt:
        say("interrupted: the table holds the checkpoints scored so far")
        status = "KILLED"
    finally:
        session.end(status)
        if started:
            import ray

            ray.shutdown()
    return session.result(skipped)


def _start_ray(session: Session) -> bool:
    if not session.use_ray:
        return False
    from pipeline.prepare.job import init_ray

    return init_ray(session.address, None)  # one Ray for every round


def _random_of(c: Candidate) -> Candidate:
    return Candidate(label=RANDOM, bundle=c.bundle, step=0, init=RANDOM, run_id=c.run_id,
                     model_name=c.model_name)  # fmt: skip


def _new_checkpoints(run: Path, seen: set[str], session: Session, skipped: list[str],
                     mirror: StoreMirror | None = None):  # fmt: skip
    """The complete checkpoints not scored yet, as candidates; one that vanishes while its
    bundle is made (pruned by keep_last) is skipped with a line."""
    out = []
    root = run / "checkpoints"
    tags = run_checkpoints(run) if root.is_dir() else []
    for path in tags:
        if path.name in seen:
            continue
        seen.add(path.name)
        try:
            if mirror is not None:
                cand = mirrored_candidate(mirror, path.name, session.work_dir)
            else:
                cand = checkpoint_candidate(path, session.work_dir)
        except (EvalError, FileNotFoundError, KeyError, RuntimeError) as err:
            if (path / "COMPLETE").is_file():
                raise  # still there: a real error, not a pruned checkpoint
            say(f"skipped {path.name}: deleted (train.keep_last) before its turn ({err})")
            skipped.append(path.name)
            continue
        session.check([cand])
        out.append(cand)
    return out


def report_run(run_id: str, tracking_uri: str | None) -> str:
    """`plm eval --report RUN`: the table of an evaluation run (or a pretraining run's
    newest), as the terminal shows it."""
    import csv

    from pipeline.eval.track import table_of_run

    eval_run, path = table_of_run(run_id, tracking_uri)
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(r[k].ljust(widths[k]) for k in range(len(r))) for r in rows]
    return f"evaluation run {eval_run}\n" + "\n".join(lines)
