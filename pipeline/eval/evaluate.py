"""`plm eval SUITE --models SOURCE ...`: every model the sources name, scored on every
task of the suite with every seed, as one Ray task per cell; the table in the terminal,
in files and in MLflow; the best checkpoint as ``@best``.

    resolve   suite + sources -> candidates (bundles found or made) and task plans
    check     every input error before Ray: files, columns, labels, task vs architecture
    run       the cells (Ray, or this process with ``--no-ray``)
    report    the table (CSV, picture, terminal) and MLflow
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.eval.plan import build_cells, check_fits, plan_tasks
from pipeline.eval.results import format_table, plot, select_best, summarize, write_csvs
from pipeline.eval.runner import CellResult, run_in_process, run_on_ray
from pipeline.eval.sources import Candidate, resolve_candidates
from pipeline.eval.suite import SuiteConfig


@dataclass
class EvalResult:
    candidates: list[Candidate]
    results: list[CellResult]
    table: Path
    best: Candidate | None
    registered: str | None
    run_id: str | None


def _say(msg: str) -> None:
    print(f"[plm eval] {msg}", flush=True)


def evaluate(
    suite: SuiteConfig,
    sources: list[str],
    address: str | None = None,
    use_ray: bool = True,
    track: bool = True,
) -> EvalResult:
    work_dir = Path(suite.work_dir).resolve()
    plans = plan_tasks(suite, work_dir)
    candidates = resolve_candidates(sources, work_dir, suite.mlflow.tracking_uri)
    check_fits(plans, candidates)
    cells = build_cells(suite, plans, candidates, work_dir)
    _say(
        f"{len(candidates)} models x {len(plans)} tasks: {len(cells)} cells "
        f"({'Ray' if use_ray else 'this process'})"
    )

    def report(r: CellResult) -> None:
        c = candidates[r.cell.candidate]
        what = (
            " ".join(f"{k} {v:.4f}" for k, v in (r.scores or {}).items())
            if r.scores is not None
            else f"FAILED: {r.error}"
        )
        _say(f"{c.label} {r.cell.task} seed {r.cell.seed}: {what}")

    tracking = None
    if track:
        from pipeline.eval.track import EvalTracking

        tracking = EvalTracking(suite, candidates, plans)
        tracking.start()
    status = "FAILED"
    try:
        if use_ray:
            results = run_on_ray(cells, suite.workers, address, report)
        else:
            results = run_in_process(cells, report)
        rows = summarize(results)
        out = work_dir / "report"
        table, cells_csv = write_csvs(rows, results, candidates, out)
        picture = plot(rows, candidates, plans, out)
        best = select_best(rows, plans, candidates, suite.select.task)
        print(format_table(rows, candidates, plans), flush=True)
        registered = None
        if tracking is not None:
            registered = tracking.log_results(rows, [table, cells_csv, picture], best)
        if best is not None:
            c = candidates[best]
            _say(f"best: {c.label} (step {c.step})" + (f" -> {registered}" if registered else ""))
        _say(f"table: {table}  picture: {picture}")
        status = "FINISHED"
    finally:
        if tracking is not None:
            tracking.end(status)
    return EvalResult(
        candidates, results, table, candidates[best] if best is not None else None, registered,
        tracking.run_id if tracking else None,
    )  # fmt: skip


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
