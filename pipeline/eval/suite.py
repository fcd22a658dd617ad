"""The evaluation suite: one YAML (configs/eval/) + dotted ``key=value`` overrides, the
grammar of every other stage.

    name: bert-tiny-suite                 # the evaluation run's name
    seeds: [0, 1, 2]                      # each fine-tuning task, once per seed
    budget: {epochs: 5, lr: 1.0e-4}       # fine-tuning defaults (plm finetune's train:)
    benchmarks: {glue: /data/glue_data}   # the folders of the benchmarks you hold
    tasks:
      topic:                              # a fine-tuning task, as `plm finetune` runs it
        kind: finetune
        task: {type: classification}
        data: {train: topic/train.jsonl, test: topic/test.jsonl}
      sst2: {kind: glue, benchmark_task: SST-2}
      heldout: {kind: perplexity, data: {test: heldout.txt}}   # causal models, zero-shot
    select: {task: topic}                 # which checkpoint is @best (default: all tasks)

Tasks are a mapping, so ``tasks.topic.seeds=[0]`` overrides one of them. Every check that
needs no model runs in ``load_suite``; those that need the architecture (a task it cannot
do) run in ``plm eval`` before any Ray task starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config import (
    LocalPath,
    MlflowSection,
    Strict,
    load_as,
    validate_as,
)
from pipeline.finetune.config import (
    LOWER_IS_BETTER,
    TASK_METRICS,
    FinetuneError,
    FinetuneTrainSection,
    TaskSection,
)

# finetune, glue, clue: fine-tuned per seed; perplexity, last_word, choice: zero-shot
# (causal models, scored by lm-evaluation-harness: pipeline/eval/zeroshot.py);
# similarity, analogy: intrinsic (static word vectors: pipeline/eval/intrinsic.py)
Kind = Literal[
    "finetune", "glue", "clue", "perplexity", "last_word", "choice", "similarity", "analogy"
]
ZERO_SHOT = ("perplexity", "last_word", "choice")
INTRINSIC = ("similarity", "analogy")


class EvalError(FinetuneError):
    """Bad suite input: one ``plm:`` line naming the file, key or task, and the fix."""


class TaskData(Strict):
    train: LocalPath | None = None  # fine-tuning: csv / jsonl / parquet
    valid: LocalPath | None = None  # fine-tuning: early stopping (None: a fixed budget)
    # what is scored; zero-shot: a .txt (a document a line) or rows (task.text_column;
    # choice: task.text_column, .choices_column, .label_column as multiple_choice's)
    test: LocalPath | None = None
    format: Literal["auto", "csv", "jsonl", "parquet"] = "auto"


class SuiteTask(Strict):
    kind: Kind = "finetune"
    task: TaskSection | None = None  # finetune: plm finetune's task; zero-shot: its columns
    data: TaskData = TaskData()
    benchmark_task: str | None = None  # kind glue / clue: the task's official name
    metric: str | None = None  # the score that ranks checkpoints (None: the task's first)
    seeds: list[int] | None = None  # None: the suite's seeds
    train: dict[str, Any] = Field(default_factory=dict)  # over the suite's budget
    max_length: int = Field(128, ge=8)  # zero-shot: tokens a window holds
    score_field: int = Field(2, ge=0)  # similarity: the 0-based field of the human score

    @model_validator(mode="after")
    def _complete(self):
        if self.kind == "finetune":
            if self.task is None or self.data.train is None or self.data.test is None:
                raise ValueError("a finetune task needs task.type, data.train and data.test")
        elif self.kind in ("glue", "clue"):
            if not self.benchmark_task:
                raise ValueError(f"a {self.kind} task needs benchmark_task (its name)")
        elif self.data.test is None:
            raise ValueError(f"a {self.kind} task needs data.test (the text it scores)")
        return self


class SelectSection(Strict):
    # the task (and its metric) whose mean over seeds ranks the checkpoints; None: the
    # mean of every task's main metric (perplexity and mse counted as lower-is-better)
    task: str | None = None


class WorkersSection(Strict):
    cpus: float = Field(1.0, gt=0)  # a Ray task's CPUs (one fine-tuning cell)
    gpus: float = Field(0.0, ge=0)  # and GPUs: set 1 on a GPU cluster
    max_retries: int = Field(2, ge=0)  # a cell whose worker died runs again elsewhere
    threads: int = Field(1, gt=0)  # torch threads per cell (one per CPU asked)


class EvalMlflowSection(MlflowSection):
    alias: str = "best"  # what the best checkpoint's version is called


class SuiteConfig(Strict):
    name: str
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    budget: dict[str, Any] = Field(default_factory=dict)  # plm finetune's train: keys
    benchmarks: dict[Literal["glue", "clue"], LocalPath] = Field(default_factory=dict)
    tasks: dict[str, SuiteTask] = Field(min_length=1)
    select: SelectSection = SelectSection()
    workers: WorkersSection = WorkersSection()
    work_dir: LocalPath = "runs/eval"  # bundles made from checkpoints, cells' scratch
    # where the evaluation run goes (default experiment: the pretraining run's); the best
    # checkpoint gets mlflow.alias (default "best") on the pretraining model's name
    mlflow: EvalMlflowSection = EvalMlflowSection()

    @model_validator(mode="after")
    def _consistent(self):
        for name, t in self.tasks.items():
            if t.kind in ("glue", "clue") and t.kind not in self.benchmarks:
                raise ValueError(
                    f"tasks.{name} is a {t.kind} task: set benchmarks.{t.kind} to the folder "
                    "that holds it"
                )
            if t.kind == "finetune" and t.metric is not None:
                allowed = TASK_METRICS[t.task.type]
                if t.metric not in allowed:
                    raise ValueError(
                        f"tasks.{name}.metric {t.metric!r} is not reported for task.type "
                        f"{t.task.type!r}; choose one of {', '.join(allowed)}"
                    )
            bad = sorted(set(t.train) - set(FinetuneTrainSection.model_fields))
            bad += sorted(set(self.budget) - set(FinetuneTrainSection.model_fields))
            if bad:
                raise ValueError(
                    f"unknown fine-tuning key(s) {', '.join(bad)} in tasks.{name}.train or "
                    f"budget; keys: {', '.join(FinetuneTrainSection.model_fields)}"
                )
        if self.select.task is not None and self.select.task not in self.tasks:
            raise ValueError(
                f"select.task {self.select.task!r} is not a task of the suite "
                f"({', '.join(self.tasks)})"
            )
        return self

    def seeds_of(self, name: str) -> list[int]:
        task = self.tasks[name]
        if task.kind in ZERO_SHOT or task.kind in INTRINSIC:
            return [0]  # nothing trained, nothing drawn: one cell
        return list(task.seeds if task.seeds is not None else self.seeds)


def lower_is_better(metric: str) -> bool:
    from pipeline.eval.zeroshot import LOWER_IS_BETTER as ZERO_SHOT_LOWER

    return metric in LOWER_IS_BETTER or metric in ZERO_SHOT_LOWER


def validate_suite(raw: dict[str, Any], source: str = "<dict>") -> SuiteConfig:
    return validate_as(SuiteConfig, raw, source, EvalError)


def load_suite(path: str | Path, overrides: list[str] | None = None) -> SuiteConfig:
    """Load and validate a suite; raise EvalError naming the bad key."""
    return load_as(SuiteConfig, path, overrides, EvalError)
