"""Typed fine-tuning config: one YAML file (configs/finetune/) + dotted ``key=value`` overrides.

    name: bert-tiny-demo-topic        # MLflow experiment and registered-model name
    model: {source: models:/bert-tiny-demo@current, init: pretrained}
    task:  {type: classification, text_column: text, label_column: label}
    data:  {train: train.jsonl, valid: valid.jsonl, test: test.jsonl}
    train: {mode: full, epochs: 3, micro_batch_size: 16, lr: 1.0e-4, metric: accuracy}
    deepspeed: configs/deepspeed/zero0.json
    mlflow: {tracking_uri: null, register: true, alias: current}

The ``train:`` section uses the pretraining names for what DeepSpeed needs
(micro_batch_size, grad_accum, grad_clip, precision, lr, betas, eps, weight_decay), so
``pipeline.train.engine.build_ds_config`` builds the DeepSpeed config from it unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pipeline.config import (
    DEEPSPEED_HINT,
    BundleRef,
    LocalPath,
    MlflowSection,
    Strict,
    load_as,
    refuse_uri,
    validate_as,
)
from pipeline.errors import ConfigError

TaskType = Literal["classification", "regression", "tagging", "span_qa", "multiple_choice"]

# The metrics each task reports; the first is the default early-stopping metric.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    # mcc: Matthews' correlation (CoLA's metric); f1: the F1 of task.positive_label
    # (MRPC's, QQP's), reported when that is set
    "classification": ("accuracy", "macro_f1", "mcc", "f1"),
    "multiple_choice": ("accuracy", "macro_f1"),
    "regression": ("pearson", "spearman", "mse"),
    "tagging": ("entity_f1", "entity_precision", "entity_recall", "token_accuracy"),
    "span_qa": ("f1", "exact_match"),
}
LOWER_IS_BETTER = {"mse"}


class FinetuneError(ConfigError):
    """Bad fine-tuning input (data, model, task); the message names the file/key and the fix."""


class SourceSection(Strict):
    # models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/model, or a local bundle folder
    source: BundleRef
    # "random": the same architecture and tokenizer, freshly initialised (a baseline that
    # shows what pretraining brings)
    init: Literal["pretrained", "random"] = "pretrained"


class TaskSection(Strict):
    type: TaskType
    text_column: str = "text"  # classification / regression / tagging (words) / mc context
    text_pair_column: str | None = None  # set: sentence-pair input (A [SEP] B)
    label_column: str = "label"  # tagging: one label per word; mc: index of the right choice
    positive_label: str | None = None  # classification: the class whose F1 is reported (f1)
    choices_column: str = "choices"  # multiple_choice: a list of strings per row
    question_column: str = "question"  # span_qa
    context_column: str = "context"  # span_qa
    answers_column: str = "answers"  # span_qa: {"text", "answer_start"} (or lists of them)
    max_length: int = Field(128, ge=8)  # tokens per input, special tokens included
    doc_stride: int = Field(64, gt=0)  # span_qa: tokens between the starts of context windows
    max_answer_tokens: int = Field(30, gt=0)  # span_qa: longest predicted answer
    symmetric_pair: bool = False  # GPT's similarity input: both orders, representations summed
    crf: bool = False  # tagging: a linear-chain CRF over the word emissions
    pooling: Literal["auto", "first", "last", "mean"] = "auto"  # auto: [CLS] / last token
    head_dropout: float = Field(0.1, ge=0, lt=1)
    # train.mode=features: the small task model over the scalar mix of the frozen layers
    feature_hidden: int = Field(64, gt=0)  # BiLSTM hidden size per direction

    @model_validator(mode="after")
    def _consistent(self):
        if self.symmetric_pair and not self.text_pair_column:
            raise ValueError("task.symmetric_pair needs task.text_pair_column (a pair task)")
        if self.crf and self.type != "tagging":
            raise ValueError("task.crf is only for task.type=tagging")
        if self.text_pair_column and self.type not in ("classification", "regression"):
            raise ValueError("task.text_pair_column is for classification / regression")
        if self.positive_label is not None and self.type != "classification":
            raise ValueError("task.positive_label is only for task.type=classification")
        return self


class DataSection(Strict):
    train: LocalPath  # files on this machine (csv / jsonl / parquet)
    valid: LocalPath | None = None  # None: no early stopping, the last model is kept
    test: LocalPath | None = None
    format: Literal["auto", "csv", "jsonl", "parquet"] = "auto"  # auto: by file extension


class FinetuneTrainSection(Strict):
    # full: every weight learns; frozen: the encoder is fixed, only the head learns;
    # features: ELMo's way - frozen model, a learned scalar mix of all its layers and a
    # small BiLSTM task model on top
    mode: Literal["full", "frozen", "features"] = "full"
    epochs: int = Field(3, gt=0)
    max_steps: int | None = Field(None, gt=0)  # a cap on optimizer steps
    micro_batch_size: int = Field(16, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(5.0e-5, gt=0)
    head_lr: float | None = Field(None, gt=0)  # None: train.lr
    layer_lr_decay: float = Field(1.0, gt=0, le=1)  # lr of layer l = lr * decay^(L - l)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    grad_clip: float = Field(1.0, ge=0)
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 1234
    eval_every: int = Field(0, ge=0)  # steps between evaluations; 0: after every epoch
    metric: str | None = None  # early-stopping metric; None: the task's first (TASK_METRICS)
    patience: int = Field(3, ge=0)  # evaluations without improvement before stopping; 0: never
    eval_batch_size: int = Field(64, gt=0)
    cpu_shm_allreduce: bool = False  # as pretraining's train.cpu_shm_allreduce
    out_dir: LocalPath = "runs/finetune"


class FinetuneConfig(Strict):
    name: str
    model: SourceSection
    task: TaskSection
    data: DataSection
    train: FinetuneTrainSection = FinetuneTrainSection()
    deepspeed: Annotated[str | dict[str, Any], refuse_uri(DEEPSPEED_HINT)] = (
        "configs/deepspeed/zero0.json"
    )
    mlflow: MlflowSection = MlflowSection()

    @model_validator(mode="after")
    def _metric_fits_task(self):
        allowed = TASK_METRICS[self.task.type]
        if self.train.metric == "f1" and self.task.type == "classification":
            if self.task.positive_label is None:
                raise ValueError(
                    "train.metric 'f1' is reported for a classification task only with "
                    "task.positive_label (the class it scores)"
                )
        if self.train.metric is not None and self.train.metric not in allowed:
            raise ValueError(
                f"train.metric {self.train.metric!r} is not reported for task.type "
                f"{self.task.type!r}; choose one of {', '.join(allowed)}"
            )
        return self

    @property
    def metric(self) -> str:
        return self.train.metric or TASK_METRICS[self.task.type][0]


def validate_finetune(raw: dict[str, Any], source: str = "<dict>") -> FinetuneConfig:
    return validate_as(FinetuneConfig, raw, source, FinetuneError)


def load_finetune_config(path: str | Path, overrides: list[str] | None = None) -> FinetuneConfig:
    """Load and validate a fine-tuning config; raise FinetuneError naming the bad key (data
    paths are relative to the working directory, as every other path here)."""
    return load_as(FinetuneConfig, path, overrides, FinetuneError)
