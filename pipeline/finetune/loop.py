"""`plm finetune`: a pretrained bundle -> a tracked, registered task model.

Same launch paths as pretraining (single process, the ``deepspeed`` launcher, a
torchrun-style env): ``pipeline.train.engine`` builds the DeepSpeed config and the
process group; this loop is the simpler one fine-tuning needs (epochs over an in-memory
example list, evaluation after each epoch or every ``train.eval_every`` steps, early
stopping on ``train.metric``).

Every check on the input (model URI, bundle, columns, labels, task vs architecture)
runs before DeepSpeed starts. Every rank evaluates the whole (small) valid set, so all
ranks agree on early stopping without a gather and ZeRO-3's collective forwards stay
in step.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from pipeline.finetune.config import LOWER_IS_BETTER, FinetuneConfig, FinetuneError
from pipeline.finetune.data import (
    Encoder,
    build_label_map,
    check_columns,
    collate,
    read_rows,
    shard_indices,
)
from pipeline.finetune.heads import (
    FEATURES_ONLY,
    UNSUPPORTED,
    TaskModel,
    backbone_layers,
    features_kwargs,
    param_groups,
)
from pipeline.finetune.infer import row_predictions, run_model, score
from pipeline.finetune.pyfunc import log_finetuned_model
from pipeline.finetune.source import (
    BestWeights,
    build_task_model,
    load_backbone,
    load_finetuned,
    partitioned,
    resolve_source,
    save_finetuned,
)


@dataclass
class FinetuneResult:
    run_dir: Path
    model_dir: Path | None
    steps: int
    best: dict[str, float] | None
    test: dict[str, float] | None
    history: list[dict[str, float]] = field(default_factory=list)
    run_id: str | None = None
    model_version: str | None = None


@dataclass
class Progress:
    """Where fine-tuning stands: optimizer steps, the best valid metrics and the
    evaluations since they improved, every evaluation, the train losses since the last."""

    step: int = 0
    best: dict[str, float] | None = None
    bad: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    stop: bool = False


@dataclass
class TaskData:
    rows: dict[str, list[dict[str, Any]]]
    examples: dict[str, list]
    labels: list[str]


def check_task_fits(arch: str, cfg: FinetuneConfig) -> None:
    reason = UNSUPPORTED.get(arch, {}).get(cfg.task.type)
    if reason:
        raise FinetuneError(f"task.type={cfg.task.type} cannot run on arch {arch!r}: {reason}")
    if arch in FEATURES_ONLY and cfg.train.mode != "features":
        raise FinetuneError(
            f"arch {arch!r} is used feature-based (frozen, scalar mix of its layers): set "
            f"train.mode=features (got {cfg.train.mode!r})"
        )


def load_task_data(cfg: FinetuneConfig, encoder: Encoder) -> TaskData:
    """Read, check and encode every split; all errors surface here, before training."""
    rows, examples = {}, {}
    splits = {"train": cfg.data.train, "valid": cfg.data.valid, "test": cfg.data.test}
    for split, path in splits.items():
        if path is None:
            continue
        rows[split] = read_rows(path, cfg.data.format)
        check_columns(rows[split], cfg.task, path, labelled=True)
    labels = build_label_map(rows["train"], cfg.task, cfg.data.train)
    for split, r in rows.items():
        examples[split] = encoder.encode(r, labels, splits[split], labelled=True)
    return TaskData(rows, examples, labels)


def _device() -> torch.device:
    from pipeline.train.runtime import device

    return device()


@dataclass
class Prepared:
    source: Any
    backbone: torch.nn.Module
    bundle_cfg: dict[str, Any]
    arch: str
    roles: dict[str, int]
    encoder: Encoder
    data: TaskData


def prepare(
    cfg: FinetuneConfig, download_to: Path, ds_config: dict[str, Any] | None = None
) -> Prepared:
    """Resolve the model, check the task fits it, read and encode the data: every input
    error is raised here, before DeepSpeed or MLflow start. Under a ZeRO-3 ``ds_config``
    the backbone is built partitioned and loaded one parameter at a time (collective)."""
    from pipeline.prepare.tokenizer import load_tokenizer

    source = resolve_source(cfg.model.source, cfg.mlflow.tracking_uri, download_to)
    backbone, bundle_cfg = load_backbone(source, ds_config)
    arch = bundle_cfg["arch"]
    check_task_fits(arch, cfg)
    tokenizer, _ = load_tokenizer(source.path)
    roles = bundle_cfg["vocab"]["roles"]
    encoder = Encoder(tokenizer, roles, bool(getattr(backbone, "causal", False)), cfg.task, arch)
    data = load_task_data(cfg, encoder)
    return Prepared(source, backbone, bundle_cfg, arch, roles, encoder, data)


class Finetuner:
    def __init__(self, cfg: FinetuneConfig, track: bool = True):
        """``track``: log an MLflow run (and register); off for the evaluation suite's
        cells, whose scores its own run holds (pipeline/eval)."""
        from pipeline.tracking_uri import check_access
        from pipeline.train import engine as ds_engine
        from pipeline.train.runtime import seed_everything

        self.cfg = cfg
        self.track = track
        ds_engine.init_distributed(cfg.train.cpu_shm_allreduce)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dev = _device()
        self.run_dir = Path(cfg.train.out_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ds_config = ds_engine.build_ds_config(cfg, self.world)  # reads .deepspeed, .train
        # A wrong MLflow password or a missing permission: one plm: line, exit 2, no step.
        registered = cfg.name if cfg.mlflow.register_model else None  # the model's name
        check_access(cfg.mlflow.tracking_uri, cfg.mlflow.experiment or cfg.name, registered,
                     "fine-tuning", write=track)  # fmt: skip
        # every rank resolves (and downloads) on its own: no shared filesystem needed
        p = prepare(cfg, self.run_dir / "source" / f"rank{self.rank}", self.ds_config)
        self.source, self.bundle_cfg, self.arch = p.source, p.bundle_cfg, p.arch
        self.roles, self.encoder, self.data = p.roles, p.encoder, p.data
        backbone = p.backbone
        seed_everything(cfg.train.seed)
        if cfg.model.init == "random":  # same architecture, fresh weights: the baseline
            from pipeline.models.registry import build_model

            with ds_engine.partitioned_build(self.ds_config):
                backbone = build_model(self.arch, backbone.config)
        self.n_feature_layers = self._count_feature_layers(backbone)
        self.model = TaskModel(
            backbone,
            cfg.task.type,
            max(1, len(self.data.labels)),
            mode=cfg.train.mode,
            pooling=cfg.task.pooling,
            crf=cfg.task.crf,
            head_dropout=cfg.task.head_dropout,
            feature_hidden=cfg.task.feature_hidden,
            n_feature_layers=self.n_feature_layers,
        )
        t = cfg.train
        per_step = t.micro_batch_size * t.grad_accum * self.world
        self.steps_per_epoch = max(1, math.ceil(len(self.data.examples["train"]) / per_step))
        self.total_steps = self.steps_per_epoch * t.epochs
        if t.max_steps:
            self.total_steps = min(self.total_steps, t.max_steps)
        self.engine = self._initialize()

    def _count_feature_layers(self, backbone) -> int:
        if self.cfg.train.mode != "features":
            return 0
        ex = self.data.examples["train"][:1]
        batch = collate(ex, self.roles["pad"], self.cfg.task.type)
        input_ids = batch["input_ids"][:, 0]
        if partitioned(self.ds_config):  # its weights are partitions: count on a shape copy
            from pipeline.models.registry import build_model

            with torch.device("meta"):
                backbone = build_model(self.arch, backbone.config)
            input_ids = input_ids.to("meta")
        with torch.no_grad():
            outputs = backbone(input_ids=input_ids, **features_kwargs(backbone))
        return int(backbone_layers(outputs).shape[1])

    def _initialize(self):
        import deepspeed

        from pipeline.train import engine as ds_engine
        from pipeline.train.schedule import scheduler_factory

        t = self.cfg.train
        groups = param_groups(self.model, t.lr, t.head_lr or t.lr, t.layer_lr_decay, t.weight_decay)
        sched = scheduler_factory(
            SimpleNamespace(
                warmup_steps=int(t.warmup_ratio * self.total_steps),
                max_steps=self.total_steps,
                schedule=t.schedule,
                min_lr_ratio=0.0,
            )
        )
        ds_engine.prepare_ops(self.ds_config)
        engine, _, _, _ = deepspeed.initialize(
            model=self.model,
            model_parameters=groups,
            lr_scheduler=sched,
            config=self.ds_config,
            dist_init_required=False,
        )
        return engine

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[plm finetune] {msg}", flush=True)

    def evaluate(self, split: str) -> dict[str, float]:
        self.engine.eval()
        try:
            raw = run_model(
                lambda b: self.engine(b),
                self.data.examples[split],
                self.cfg.task,
                self.roles["pad"],
                self.cfg.train.eval_batch_size,
                self.dev,
                decode_tags=self.model.decode_tags,
            )
        finally:
            self.engine.train()
        preds = row_predictions(
            raw, self.data.examples[split], self.data.rows[split], self.cfg.task, self.data.labels
        )
        return score(preds, self.data.rows[split], self.cfg.task, self.data.labels)

    def _better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value < best if self.cfg.metric in LOWER_IS_BETTER else value > best

    def _meta(self, best: dict[str, float] | None, steps: int) -> dict[str, Any]:
        s = self.source
        return {
            "arch": self.arch,
            "task": self.cfg.task.model_dump(mode="json"),
            "labels": self.data.labels,
            "mode": self.cfg.train.mode,
            "init": self.cfg.model.init,
            "n_feature_layers": self.n_feature_layers,
            "pad_id": int(self.roles["pad"]),
            "metric": self.cfg.metric,
            "best_valid": best,
            "steps": steps,
            "source": {
                "uri": s.uri,
                "run_id": s.run_id,
                "model_name": s.model_name,
                "model_version": s.model_version,
            },
        }

    def run(self) -> FinetuneResult:
        """Train, keep the best weights on disk, save and (rank 0) test and register them."""
        tracker = self.start_tracking()
        t = self.cfg.train
        self.log(
            f"{self.arch} -> {self.cfg.task.type} ({t.mode}, init {self.cfg.model.init}): "
            f"{len(self.data.examples['train'])} train examples, labels "
            f"{self.data.labels or '-'}, world size {self.world}, {self.total_steps} steps"
        )
        # the best weights so far: on disk (rank 0), never a whole copy in memory
        best_weights = BestWeights(self.run_dir / "best", self.bundle_cfg, self.source.path)
        status = "FAILED"
        t0 = time.perf_counter()
        try:
            p = self.train_epochs(tracker, best_weights)
            model_dir, test, version = self.save_best(tracker, best_weights, p)
            dist.barrier()
            status = "FINISHED"
        finally:
            tracker.end(status)
        self.log(f"done in {time.perf_counter() - t0:.1f}s")
        return FinetuneResult(
            self.run_dir, model_dir, p.step, p.best, test, p.history, tracker.run_id, version
        )

    def start_tracking(self):
        """The MLflow run (when tracked): the task, the source model and its run."""
        from pipeline.train.tracking import Tracker, code_version

        cfg, t, s = self.cfg, self.cfg.train, self.source
        tracker = Tracker(self.run_dir, enabled=self.rank == 0 and self.track,
                          upload_timeout_s=cfg.mlflow.upload_timeout_s)  # fmt: skip
        tags = {
            "stage": "finetune",
            "task": cfg.task.type,
            "mode": t.mode,
            "init": cfg.model.init,
            "arch": self.arch,
            "source_uri": s.uri,
            "pretraining_run_id": s.run_id or "",
            "source_model": s.model_name or "",
            "source_model_version": s.model_version or "",
            "code_version": code_version(),
            "world_size": str(self.world),
        }
        if self.track:
            tracker.start(
                tracking_uri=cfg.mlflow.tracking_uri,
                experiment=cfg.mlflow.experiment or cfg.name,
                run_name=cfg.mlflow.run_name or self.run_dir.name,
                params={**cfg.model_dump(mode="json"), "n_labels": len(self.data.labels)},
                tags=tags,
                resume=False,
            )
        return tracker

    def train_epochs(self, tracker, best_weights: BestWeights) -> Progress:
        """Epochs of optimizer steps, evaluated after each epoch (or every
        train.eval_every steps) and at the last step, until train.epochs, train.max_steps
        or early stopping (train.patience)."""
        t = self.cfg.train
        p = Progress()
        self.engine.train()
        for epoch in range(t.epochs):
            micro = self.epoch_batches(epoch)
            for k, idx in enumerate(micro):
                self.micro_step(idx, p)
                if (k + 1) % t.grad_accum:
                    continue
                p.step += 1
                last_of_epoch = k + 1 == len(micro)
                do_eval = (t.eval_every and p.step % t.eval_every == 0) or (
                    not t.eval_every and last_of_epoch
                )
                if do_eval or p.step == self.total_steps:
                    self.evaluate_and_keep(tracker, best_weights, p, epoch)
                if p.stop or p.step >= self.total_steps:
                    p.stop = True
                    break
            if p.stop:
                break
        return p

    def epoch_batches(self, epoch: int) -> list:
        """This rank's micro-batches (example indices) of ``epoch``."""
        t = self.cfg.train
        n = len(self.data.examples["train"])
        order = shard_indices(n, t.micro_batch_size, self.world, self.rank, t.seed, epoch)
        micro = [
            order[i : i + t.micro_batch_size] for i in range(0, len(order), t.micro_batch_size)
        ]
        return micro[: self.steps_per_epoch * t.grad_accum]

    def micro_step(self, idx, p: Progress) -> None:
        """Forward and backward of one micro-batch (DeepSpeed updates at its boundary)."""
        train_ex = self.data.examples["train"]
        batch = collate([train_ex[i] for i in idx], self.roles["pad"], self.cfg.task.type)
        batch = {key: v.to(self.dev) for key, v in batch.items()}
        loss = self.engine(batch)["loss"]
        self.engine.backward(loss)
        self.engine.step()
        p.losses.append(float(loss.detach()))

    def evaluate_and_keep(self, tracker, best_weights: BestWeights, p: Progress, epoch: int):
        """Log the train loss since the last evaluation and the valid metrics; better ones
        replace the best weights (collective), else count toward early stopping."""
        cfg = self.cfg
        m = {"train_loss": sum(p.losses) / len(p.losses), "epoch": epoch + 1}
        p.losses = []
        if "valid" in self.data.examples:
            m |= {f"valid_{k}": v for k, v in self.evaluate("valid").items()}
        tracker.log_metrics(m, p.step)
        p.history.append({"step": p.step, **m})
        self.log(f"step {p.step}: " + " ".join(f"{k} {for_people(v)}" for k, v in m.items()))
        value = m.get(f"valid_{cfg.metric}")
        if value is None or self._better(value, p.best and p.best[cfg.metric]):
            p.best = {k[6:]: v for k, v in m.items() if k.startswith("valid_")} or None
            best_weights.save(self.engine)  # collective
            p.bad = 0
            return
        p.bad += 1
        if cfg.train.patience and p.bad >= cfg.train.patience:
            self.log(f"early stop: no better valid {cfg.metric} for {p.bad} evaluations")
            p.stop = True

    def save_best(self, tracker, best_weights: BestWeights, p: Progress):
        """The best weights (the last ones if never evaluated) as the task model folder;
        rank 0 tests the saved folder itself, logs it and registers it. Returns (folder,
        test metrics, model version); None on the other ranks."""
        cfg = self.cfg
        if not best_weights.saved:  # the same on every rank
            best_weights.save(self.engine)
        model_dir = test = version = None
        if self.rank != 0:
            return model_dir, test, version
        model_dir = save_finetuned(
            self.run_dir / "model", best_weights.folder, self._meta(p.best, p.step)
        )
        value = for_people(p.best[cfg.metric]) if p.best else "-"
        self.log(f"best model (valid {cfg.metric} {value}) saved to {model_dir}")
        if "test" in self.data.examples:
            test = evaluate_saved(model_dir, self.data, cfg, self.dev)
            tracker.log_metrics({f"test_{k}": v for k, v in test.items()}, p.step)
            self.log("test: " + " ".join(f"{k} {for_people(v)}" for k, v in test.items()))
        tracker.log_artifacts(model_dir, "model")
        if cfg.mlflow.register_model and self.track:
            version = self.register(tracker, model_dir, p.best)
        return model_dir, test, version

    def register(self, tracker, model_dir: Path, best: dict[str, float] | None) -> str | None:
        """Rank 0: the task model as a registered MLflow model; returns its version."""
        cfg, s = self.cfg, self.source
        return tracker.register(
            "model",
            cfg.name,
            cfg.mlflow.alias,
            {
                "task": cfg.task.type,
                "arch": self.arch,
                "mode": cfg.train.mode,
                "source_uri": s.uri,
                "pretraining_run_id": s.run_id or "",
                "source_model_version": s.model_version or "",
                f"valid_{cfg.metric}": str(best and best[cfg.metric]),
            },
            bundle_dir=model_dir,  # a LoggedModel whose pyfunc predicts rows
            log_model=log_finetuned_model,
        )


def for_people(value: Any) -> str:
    """A number as a printed line shows it: a whole number as an integer (``epoch 1``, not
    ``1.0000``), any other to 4 significant digits (``0.6746``, not ``0.6746031746031746``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    value = float(value)
    return str(int(value)) if value.is_integer() else f"{value:.4g}"


def evaluate_saved(
    model_dir: Path, data: TaskData, cfg: FinetuneConfig, dev: torch.device
) -> dict[str, float]:
    """Test metrics of the saved folder itself (so the artifact is what was measured)."""
    model, meta, _ = load_finetuned(model_dir)
    model.to(dev)
    raw = run_model(
        lambda b: model(b),
        data.examples["test"],
        cfg.task,
        int(meta["pad_id"]),
        cfg.train.eval_batch_size,
        dev,
        decode_tags=model.decode_tags,
    )
    preds = row_predictions(raw, data.examples["test"], data.rows["test"], cfg.task, data.labels)
    return score(preds, data.rows["test"], cfg.task, data.labels)


def finetune(cfg: FinetuneConfig, track: bool = True) -> FinetuneResult:
    """Entry point of ``plm finetune`` on every rank (``track``: as Finetuner's)."""
    return Finetuner(cfg, track).run()


__all__ = ["FinetuneResult", "finetune", "build_task_model", "load_finetuned"]
