"""The suite resolved before any cell runs: each task's files, metrics and checks, and the
cells of the table (every candidate x task x seed).

Every input error a user can make shows here, as one ``plm:`` line (EvalError /
FinetuneError), before Ray starts: a missing file or column, a label of a test set that
training never has, a benchmark folder without the task, a task the architecture cannot
do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.eval import intrinsic, zeroshot
from pipeline.eval.cells import CellSpec
from pipeline.eval.sources import Candidate
from pipeline.eval.suite import INTRINSIC, ZERO_SHOT, EvalError, SuiteConfig, SuiteTask
from pipeline.finetune.config import TASK_METRICS, TaskSection


@dataclass
class TaskPlan:
    name: str
    kind: str  # "finetune", a zero-shot kind (suite.ZERO_SHOT) or suite.INTRINSIC
    metric: str  # the score that ranks checkpoints (a key of the cells' scores)
    files: list[str]  # every file the task reads (its digest's input)
    task: dict[str, Any] | None = None  # plm finetune's task section
    data: dict[str, Any] = field(default_factory=dict)  # plm finetune's data section
    evals: dict[str, str] = field(default_factory=dict)  # scored sets (>1: named scores)
    # zero-shot: the rows lm-eval reads, as it reads them; intrinsic: the pairs / questions
    text_file: str | None = None
    max_length: int = 128
    train: dict[str, Any] = field(default_factory=dict)  # the task's fine-tuning keys
    digest: str = ""


def files_digest(paths: list[str]) -> str:
    """sha256 over the files' bytes, in order: the task's data set identity in MLflow."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _check_finetune_data(name: str, task: TaskSection, data: dict[str, Any]) -> None:
    """Files, columns and labels, as plm finetune checks them (without a model)."""
    from pipeline.finetune.data import build_label_map, check_columns, read_rows, row_labels

    fmt = data.get("format", "auto")
    rows = {}
    for split in ("train", "valid", "test"):
        if data.get(split):
            rows[split] = read_rows(data[split], fmt)
            check_columns(rows[split], task, data[split], labelled=True)
    labels = set(build_label_map(rows["train"], task, data["train"]))
    if not labels:
        return
    for split in ("valid", "test"):
        for i, row in enumerate(rows.get(split, [])):
            for lab in row_labels(row, task, f"{data[split]} row {i + 1}"):
                if lab not in labels:
                    raise EvalError(
                        f"{data[split]} row {i + 1}: label {lab!r} does not occur in the "
                        f"training data {data['train']} (tasks.{name}); a model cannot learn it"
                    )


def _benchmark_plan(name: str, t: SuiteTask, suite: SuiteConfig, work_dir: Path) -> TaskPlan:
    from pipeline.eval.benchmarks import benchmark_task

    b = benchmark_task(
        t.kind, t.benchmark_task or "", suite.benchmarks[t.kind], work_dir / "tasks" / name
    )
    task = {"type": b.type, "text_column": b.text_column, "label_column": b.label_column}
    if b.text_pair_column:
        task["text_pair_column"] = b.text_pair_column
    if b.positive_label is not None:
        task["positive_label"] = b.positive_label
    evals = {k: str(v) for k, v in b.evals.items()}
    first = next(iter(evals))
    metric = t.metric or b.metrics[0]
    if len(evals) > 1:
        metric = f"{first}_{metric}"
    data = {"train": str(b.train), "test": evals[first], "format": "jsonl"}
    files = [str(b.train), *evals.values()]
    return TaskPlan(name, "finetune", metric, files, task, data, evals, train=dict(t.train))


def _zero_shot_rows(name: str, t: SuiteTask) -> list[dict[str, Any]]:
    """The rows lm-eval reads: {text}, or {context, choices, label} for choice."""
    from pipeline.finetune.data import check_columns, read_rows

    path = str(t.data.test)
    if path.endswith(".txt"):
        if not Path(path).is_file():
            raise EvalError(f"tasks.{name}: data.test {path} does not exist")
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        rows = [{"text": x} for x in lines if x.strip()]
        if t.kind == "choice" or not rows:
            raise EvalError(f"tasks.{name}: {path} holds no rows for a {t.kind} task "
                            "(a choice task reads jsonl / csv / parquet rows)")  # fmt: skip
        return rows
    columns = t.task or TaskSection(type="multiple_choice")
    rows = read_rows(path, t.data.format)
    if t.kind != "choice":
        check_columns(rows, TaskSection(type="regression", text_column=columns.text_column,
                                        label_column=columns.text_column), path, True)  # fmt: skip
        return [{"text": str(r[columns.text_column])} for r in rows]
    check_columns(rows, TaskSection(type="multiple_choice", text_column=columns.text_column,
                                    choices_column=columns.choices_column,
                                    label_column=columns.label_column), path, True)  # fmt: skip
    out = []
    for i, r in enumerate(rows, 1):
        choices, label = r[columns.choices_column], r[columns.label_column]
        if not isinstance(choices, list) or not str(label).isdigit() or int(label) >= len(choices):
            raise EvalError(f"{path} row {i}: {columns.choices_column} must be a list and "
                            f"{columns.label_column} the index of the right one")  # fmt: skip
        out.append({"context": str(r[columns.text_column]), "choices": [str(c) for c in choices],
                    "label": int(label)})  # fmt: skip
    return out


def _metric_of(name: str, t: SuiteTask, metrics: tuple[str, ...]) -> str:
    """The task's ranking metric: ``t.metric``, one its kind reports (default: the first)."""
    metric = t.metric or metrics[0]
    if metric not in metrics:
        raise EvalError(f"tasks.{name}.metric {metric!r}: a {t.kind} task reports "
                        f"{', '.join(metrics)}")  # fmt: skip
    return metric


def _zero_shot_plan(name: str, t: SuiteTask, work_dir: Path) -> TaskPlan:
    import json

    rows = _zero_shot_rows(name, t)
    out = work_dir / "tasks" / name / "test.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    metric = _metric_of(name, t, zeroshot.KINDS[t.kind][1])
    return TaskPlan(name, t.kind, metric, [str(t.data.test)], text_file=str(out),
                    max_length=t.max_length)  # fmt: skip


def _intrinsic_plan(name: str, t: SuiteTask, work_dir: Path) -> TaskPlan:
    path = str(t.data.test)
    if t.kind == "similarity":
        rows = intrinsic.read_similarity(path, t.score_field, name)
    else:
        rows = intrinsic.read_analogies(path, name)
    out = intrinsic.write_rows(rows, work_dir / "tasks" / name / "test.jsonl")
    metric = _metric_of(name, t, intrinsic.METRICS[t.kind])
    return TaskPlan(name, t.kind, metric, [path], text_file=out)


def plan_task(name: str, t: SuiteTask, suite: SuiteConfig, work_dir: Path) -> TaskPlan:
    if t.kind in ("glue", "clue"):
        plan = _benchmark_plan(name, t, suite, work_dir)
    elif t.kind in ZERO_SHOT:
        plan = _zero_shot_plan(name, t, work_dir)
    elif t.kind in INTRINSIC:
        plan = _intrinsic_plan(name, t, work_dir)
    else:
        assert t.task is not None
        data = t.data.model_dump(mode="json", exclude_none=True)
        files = [data[s] for s in ("train", "valid", "test") if data.get(s)]
        metric = t.metric or TASK_METRICS[t.task.type][0]
        plan = TaskPlan(name, "finetune", metric, files, t.task.model_dump(mode="json"), data,
                        {"test": data["test"]}, train=dict(t.train))  # fmt: skip
    if plan.kind == "finetune":
        assert plan.task is not None
        _check_finetune_data(name, TaskSection.model_validate(plan.task), plan.data)
    plan.digest = files_digest(plan.files)
    return plan


def plan_tasks(suite: SuiteConfig, work_dir: Path) -> dict[str, TaskPlan]:
    return {name: plan_task(name, t, suite, work_dir) for name, t in suite.tasks.items()}


def check_fits(plans: dict[str, TaskPlan], candidates: list[Candidate]) -> None:
    """Every task runs on every candidate's architecture, or one line says which not."""
    from pipeline.finetune.config import validate_finetune
    from pipeline.finetune.loop import check_task_fits

    for c in candidates:
        arch = c.arch
        for p in plans.values():
            if p.kind in ZERO_SHOT and arch not in zeroshot.ZERO_SHOT_ARCHS:
                raise EvalError(
                    f"tasks.{p.name} ({p.kind}, zero-shot) cannot run on {c.label} (arch "
                    f"{arch!r}): lm-evaluation-harness scores {', '.join(zeroshot.ZERO_SHOT_ARCHS)} "
                    "through their transformers export (docs/evaluation.md)"
                )
            if p.kind in INTRINSIC:
                if arch not in intrinsic.INTRINSIC_ARCHS:
                    raise EvalError(
                        f"tasks.{p.name} ({p.kind}, intrinsic) cannot run on {c.label} (arch "
                        f"{arch!r}): it scores the static word vectors of "
                        f"{', '.join(intrinsic.INTRINSIC_ARCHS)}; fine-tune a task instead"
                    )
                intrinsic.check_coverage(p.kind, p.name, p.text_file or "", c.bundle)
            if p.kind != "finetune":
                continue
            raw = _finetune_raw(p, c, 0, "check", {})
            check_task_fits(arch, validate_finetune(raw, f"tasks.{p.name}"))


def _finetune_raw(
    p: TaskPlan, c: Candidate, seed: int, out_dir: str, budget: dict[str, Any]
) -> dict[str, Any]:
    train = {**budget, **p.train, "seed": seed, "out_dir": out_dir}
    return {
        "name": f"eval-{p.name}",
        "model": {"source": str(c.bundle), "init": c.init},
        "task": p.task,
        "data": p.data,
        "train": train,
        "mlflow": {"register": False},
    }


def build_cells(
    suite: SuiteConfig, plans: dict[str, TaskPlan], candidates: list[Candidate], work_dir: Path
) -> list[CellSpec]:
    """Every (candidate, task, seed), the fine-tuning configs validated here."""
    from pipeline.finetune.config import validate_finetune

    cells = []
    for i, c in enumerate(candidates):
        for name, p in plans.items():
            for seed in suite.seeds_of(name):
                scratch = str(work_dir / "cells" / f"{i:03d}-{name}-seed{seed}")
                finetune = None
                if p.kind == "finetune":
                    finetune = _finetune_raw(p, c, seed, scratch, suite.budget)
                    validate_finetune(finetune, f"tasks.{name}")  # every cell's, before Ray
                cells.append(
                    CellSpec(
                        candidate=i,
                        task=name,
                        seed=seed,
                        kind=p.kind,
                        bundle=str(c.bundle),
                        init=c.init,
                        scratch=scratch,
                        finetune=finetune,
                        extra_evals=p.evals if len(p.evals) > 1 else {},
                        text_file=p.text_file,
                        max_length=p.max_length,
                        threads=suite.workers.threads,
                    )  # fmt: skip
                )
    return cells
