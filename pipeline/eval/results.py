"""The suite's table: per model and task, each metric's mean and spread over the seeds,
as a CSV, a picture (score against pretraining step, the random-init baseline dashed) and
a terminal table; and the selection rule that names the best checkpoint.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.eval.plan import TaskPlan
from pipeline.eval.runner import CellResult
from pipeline.eval.sources import Candidate
from pipeline.eval.suite import lower_is_better

SUMMARY_COLUMNS = ("model", "step", "init", "task", "metric", "mean", "std", "n", "failed",
                   "seeds")  # fmt: skip
CELL_COLUMNS = ("model", "step", "init", "task", "seed", "metric", "value", "error", "seconds",
                "host")  # fmt: skip


@dataclass
class Row:
    """One (model, task, metric): its scores over the seeds."""

    candidate: int
    task: str
    metric: str
    values: list[float]
    seeds: list[int]
    failed: int  # seeds whose cell failed

    @property
    def mean(self) -> float:
        return float(np.mean(self.values)) if self.values else math.nan

    @property
    def std(self) -> float:
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else 0.0


def summarize(results: list[CellResult]) -> list[Row]:
    """Rows in the order of the cells (model, then task), each metric of a cell once."""
    rows: dict[tuple[int, str, str], Row] = {}
    failed: dict[tuple[int, str], int] = {}
    order: list[tuple[int, str]] = []
    for r in results:
        key = (r.cell.candidate, r.cell.task)
        if key not in failed:
            failed[key] = 0
            order.append(key)
        if r.scores is None:
            failed[key] += 1
            continue
        for metric, value in r.scores.items():
            row = rows.setdefault((*key, metric), Row(*key, metric, [], [], 0))
            row.values.append(float(value))
            row.seeds.append(r.cell.seed)
    out = []
    for key in order:
        mine = [row for k, row in rows.items() if k[:2] == key]
        for row in mine:
            row.failed = failed[key]
        if not mine:  # every seed failed: the cell shows as failed
            out.append(Row(*key, "-", [], [], failed[key]))
        out += mine
    return out


def write_csvs(
    rows: list[Row], results: list[CellResult], candidates: list[Candidate], out: Path
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    table, cells = out / "table.csv", out / "cells.csv"
    with open(table, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(SUMMARY_COLUMNS)
        for r in rows:
            c = candidates[r.candidate]
            w.writerow([c.label, "" if c.step is None else c.step, c.init, r.task, r.metric,
                        _num(r.mean), _num(r.std), len(r.values), r.failed,
                        " ".join(map(str, r.seeds))])  # fmt: skip
    with open(cells, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CELL_COLUMNS)
        for res in results:
            c, s = candidates[res.cell.candidate], res.cell
            base = [c.label, "" if c.step is None else c.step, c.init, s.task, s.seed]
            if res.scores is None:
                w.writerow([*base, "", "", res.error, "", res.host])
            for metric, value in (res.scores or {}).items():
                w.writerow([*base, metric, _num(value), "", f"{res.seconds:.2f}", res.host])
    return table, cells


def _num(x: float) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.6g}"


def main_rows(rows: list[Row], plans: dict[str, TaskPlan]) -> dict[tuple[int, str], Row]:
    """(candidate, task) -> the row of the task's ranking metric."""
    return {(r.candidate, r.task): r for r in rows if r.metric == plans[r.task].metric}


def select_best(
    rows: list[Row], plans: dict[str, TaskPlan], candidates: list[Candidate], task: str | None
) -> int | None:
    """The best pretrained candidate by the selection rule: the mean of ``task``'s
    metric over its seeds; without a task, the mean rank over every task (1 = best), so
    that accuracies and perplexities are never averaged together. None: nothing scored."""
    main = main_rows(rows, plans)
    pool = [i for i, c in enumerate(candidates) if c.init == "pretrained"]
    tasks = [task] if task else list(plans)
    ranks: dict[int, list[float]] = {i: [] for i in pool}
    for t in tasks:
        scored = [(main[(i, t)].mean, i) for i in pool if (i, t) in main and main[(i, t)].values]
        sign = 1.0 if lower_is_better(plans[t].metric) else -1.0
        for value, i in scored:  # 1 + the candidates strictly better: ties share a rank
            ranks[i].append(1 + sum(sign * v < sign * value for v, _ in scored))
    # ties go to the later checkpoint: as good, and trained longer
    ranked = [(float(np.mean(r)), -(candidates[i].step or 0), i)
              for i, r in ranks.items() if len(r) == len(tasks)]  # fmt: skip
    return min(ranked)[2] if ranked else None


def format_table(rows: list[Row], candidates: list[Candidate], plans: dict[str, TaskPlan]) -> str:
    """The terminal table: a line per model, a column per task (its ranking metric's mean
    +- spread over seeds, failed seeds marked)."""
    main = main_rows(rows, plans)
    tasks = list(plans)
    head = ["model", "step"] + [f"{t} ({plans[t].metric})" for t in tasks]
    lines = [head]
    for i, c in enumerate(candidates):
        cols = [c.label, "" if c.step is None else str(c.step)]
        for t in tasks:
            r = main.get((i, t))
            failed = next((x.failed for x in rows if x.candidate == i and x.task == t), 0)
            if r is None or not r.values:
                cols.append(f"failed ({failed})" if failed else "-")
                continue
            cell = f"{r.mean:.4f} ± {r.std:.4f} (n={len(r.values)})"
            cols.append(cell + (f" {failed} failed" if failed else ""))
        lines.append(cols)
    widths = [max(len(x[k]) for x in lines) for k in range(len(head))]
    return "\n".join("  ".join(x[k].ljust(widths[k]) for k in range(len(head))) for x in lines)


def plot(rows: list[Row], candidates: list[Candidate], plans: dict[str, TaskPlan], out: Path):
    """scores.png: one panel per task, its ranking metric (mean, spread as error bars)
    against the pretraining step; the random-init baseline as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = main_rows(rows, plans)
    tasks = list(plans)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, t in zip(axes[0], tasks, strict=True):
        pts = sorted(
            (candidates[i].step, r.mean, r.std)
            for (i, task), r in main.items()
            if task == t and r.values and candidates[i].init == "pretrained"
            and candidates[i].step is not None
        )  # fmt: skip
        if pts:
            x, y, e = zip(*pts, strict=True)
            ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label="pretrained")
        for (i, task), r in main.items():
            if task == t and candidates[i].init == "random" and r.values:
                ax.axhline(r.mean, linestyle="--", color="gray", label="random init")
        ax.set_title(t)
        ax.set_xlabel("pretraining step")
        ax.set_ylabel(plans[t].metric)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "scores.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
