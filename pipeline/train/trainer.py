"""The training loop: DeepSpeed engine, resumable stream, eval, checkpoints, MLflow.

One code path for a single process, the ``deepspeed`` launcher (any hostfile) and a
torchrun-style environment (Kubernetes): the rank and world size come from the env.
What the run is (global batch, ZeRO stage, the checkpoint it resumes) is resolved once,
``run_plan.resolve_run``; when it checkpoints is the ``Checkpointer``'s.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config import ExperimentConfig
from pipeline.data.shards import DataDir
from pipeline.errors import ConfigError
from pipeline.loader.mixture import open_sources
from pipeline.loader.stream import MixSource
from pipeline.models.blocks import numel
from pipeline.output import DiskFull, disk_full, no_space, rank_line, size_text
from pipeline.tracking_uri import check_access
from pipeline.train import engine as ds_engine
from pipeline.train import faults, heartbeat, parallelize, stragglers
from pipeline.train.batch_stats import flops_model, n_positions

# The step counts the loader's CPU batch through these names of this module, which
# tests/unit/test_host_reads.py wraps to leave those (sync-free) reads out of its count.
from pipeline.train.batch_stats import tokens_by_source as _tokens_by_source
from pipeline.train.batch_stats import work_stats as _work_stats
from pipeline.train.checkpoint import CheckpointManager, uploads_as_checkpoint_errors
from pipeline.train.checkpointer import Checkpointer
from pipeline.train.fingerprint import data_fingerprint, mixture_fingerprint
from pipeline.train.full_weights import full_tensors
from pipeline.train.metrics import device_peak_flops, throughput
from pipeline.train.model_inputs import forward_keys, model_inputs
from pipeline.train.out_store import OutStore
from pipeline.train.plan import (
    check_positions,
    checkpoint_bytes,
    model_config_for,
    open_eval_streams,
)
from pipeline.train.run_plan import ElasticResume, RunPlan, resolve_run
from pipeline.train.runtime import device, peak_resident_gib, seed_everything
from pipeline.train.schedule import scheduler_factory
from pipeline.train.stop import GracefulStop, TrainingStopped
from pipeline.train.tracking import RUN_ID_FILE, SYNCED_FILE, Tracker, code_version


class TrainingDiverged(RuntimeError):
    """Too many non-finite losses in a row; the last good state was checkpointed."""


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    tokens_seen: int
    first_loss: float | None
    final_loss: float | None
    skipped_steps: int
    run_id: str | None
    bundle_dir: Path | None
    model_version: str | None
    losses: dict[int, float] = field(default_factory=dict)
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    # rank 0 of a finished run whose MLflow server did not answer in time: what MLflow
    # lacks and how to sync it (``plm train`` prints it and exits 3)
    tracking_left_behind: str | None = None


@dataclass
class StepRecord:
    """One optimizer step's numbers, still on the device (read at the next ``_flush``):
    ``values`` = [loss, *metrics (sums over micro-batches), tokens per source, samples,
    positions] of this rank; ``grad_norm`` the global norm (the same on every rank)."""

    step: int
    values: torch.Tensor
    grad_norm: torch.Tensor
    lr: float


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The torch seed of micro-batch ``index`` (counted across ranks) of optimizer step
    ``step``: a function of the global position only, never of the rank layout."""
    return int(np.random.SeedSequence([seed % 2**32, step, index]).generate_state(1, np.uint64)[0])


def tokenizer_meta(data: DataDir) -> dict[str, Any]:
    path = data.tokenizer_path.parent / "tokenizer_meta.json"
    return json.loads(path.read_text(encoding="utf-8"))


def build_parts(
    cfg: ExperimentConfig,
    rank: int,
    world_size: int,
    sources: list[MixSource],
    ds_config: dict[str, Any],
):
    """Model (on the config's seed), objective and the train stream: no DeepSpeed engine
    yet, but under ZeRO-3 the model is built partitioned (``engine.partitioned_build``).
    ``sources``: the opened data dirs (``open_sources``; one for data.path)."""
    from pipeline.loader.stream import PretrainStream
    from pipeline.models.registry import build_model
    from pipeline.objectives import build_objective

    data = sources[0].path  # the tokenizer's (shared) and, for word2vec, the counts' source
    meta = tokenizer_meta(data)
    model_cfg = model_config_for(cfg, meta["vocab_size"])  # the heads the objective uses
    check_positions(cfg, model_cfg)
    if ds_engine.zero_stage(ds_config) == 3 and cfg.objective.kind == "distill":
        raise ConfigError(
            "objective.kind=distill keeps its teacher whole on every rank and copies it into "
            "the student: use a ZeRO stage below 3 (deepspeed: zero2 or auto)"
        )
    seed_everything(cfg.train.seed)  # same initial weights on every rank
    with ds_engine.partitioned_build(ds_config):
        model = build_model(cfg.model.arch, model_cfg)
    parallelize.apply(model, cfg.train)  # unpadding, checkpointing, compile
    specials = {int(i) for i in meta.get("special_tokens", {}).values()}
    objective = build_objective(
        cfg.objective, meta["roles"], meta["vocab_size"], cfg.data.seq_len, specials
    )
    objective.total_batches = cfg.train.max_steps * cfg.train.grad_accum  # staged objectives
    objective.attach(model)
    if hasattr(objective, "bind_data"):  # corpus/tokenizer-derived state (ELMo, word2vec)
        objective.bind_data(data, model)

    t = cfg.train

    def stream(split: str, workers: int, source: int | None = None):
        """The split of the whole mixture, or of one source (``source``: its index)."""
        return PretrainStream(
            sources if source is None else [sources[source]],
            split,
            objective,
            micro_batch_size=cfg.train.micro_batch_size,
            seed=cfg.train.seed,
            rank=rank,
            world_size=world_size,
            num_workers=workers,
            verify_checksums=cfg.data.verify_checksums,
            on_bad_shard=cfg.data.on_bad_shard,
            step_samples=t.micro_batch_size * t.grad_accum * world_size
            if split == "train"
            else None,
        )

    return meta, model_cfg, model, objective, stream


def _to_device(batch: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def discard_gradients(engine) -> None:
    """Forget the gradients accumulated in an unfinished window, as DeepSpeed's own
    fp16-overflow path does: param grads, ZeRO-1/2 partition buffers, ZeRO-3 averaged
    gradients, and the micro-step counters (so the next backward copies, not adds)."""
    opt = engine.optimizer
    engine.zero_grad()
    if hasattr(opt, "averaged_gradients"):  # a ZeRO optimizer
        opt.zero_grad(set_to_none=True)
        if hasattr(opt, "_release_preflattened_grad_buffers"):
            opt._release_preflattened_grad_buffers()
        if isinstance(opt.averaged_gradients, dict):
            for k in list(opt.averaged_gradients):
                opt.averaged_gradients[k] = None
                if hasattr(opt, "all_grad_tensors"):
                    opt.all_grad_tensors[k] = None
        if getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False):
            opt.reset_cpu_buffers()
        if hasattr(opt, "micro_step_id"):
            opt.micro_step_id = 0 if engine.zero_optimization_partition_weights() else -1


class Trainer:
    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        # train.out_dir: a folder, or a URI whose store is asked first (credentials, bucket:
        # one plm: line before anything starts); self.run_dir is where this node writes.
        self.out = OutStore.open(
            cfg.train.out_dir, cfg.train.local_dir, retry_s=cfg.train.upload_retry_s
        )
        self.out.check()
        self.join_world(cfg)
        self.start_records(cfg)
        self.ckpt = CheckpointManager(
            self.out, cfg.train.keep_last, self.rank, self.world, cfg.train.async_save,
            bundles="bundles", save_buffer_mb=cfg.train.save_buffer_mb,
        )  # fmt: skip
        self.sources = open_sources(cfg.data)  # one for data.path; tokenizers checked
        self.data = self.sources[0].path  # the tokenizer every source shares
        # Before anything is built from the config: on another number of ranks the global
        # batch is kept (grad_accum adjusted) and ZeRO 1-3 state converted (plan_run).
        self.plan = self.plan_run(cfg)
        self.cfg, self.elastic = self.plan.cfg, self.plan.elastic
        self.ds_config = copy.deepcopy(self.plan.ds_config)  # this run's to change
        self.build(self.cfg)
        self.checkpointer = self.make_checkpointer()
        self.tokens_by_source = [0] * len(self.sources)
        self.step = 0
        self.tokens_seen = 0
        self.skipped = 0
        self.resumed_from: str | None = None
        self.stopper = GracefulStop(self.cfg.train.stop_grace_s, self._killed_by_timer)
        self.stop_agreed = False  # every rank saw a stop signal's flag in the same all-reduce
        self.membership: dict[str, Any] | None = None  # a change to log after the next step
        self.writes_done = False  # every rank wrote the pending checkpoint (the all-reduce)
        self.reset_metrics()

    def join_world(self, cfg: ExperimentConfig) -> None:
        """The process group, this rank's device, and what watches its peers: a silent
        peer ends this rank in seconds, wherever it waits (train/heartbeat.py), and a
        straggler is named."""
        if not torch.cuda.is_available():
            parallelize.set_cpu_threads()
        ds_engine.init_distributed(
            cfg.train.cpu_shm_allreduce, timedelta(seconds=cfg.train.collective_timeout_s)
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        faults.check_peers(cfg.train.max_clock_skew_s)
        self.dev = device()
        self.run_dir = self.out.local
        self.heartbeat = heartbeat.start_for_rank(
            self.rank, self.world, cfg.train.heartbeat_timeout_s, self._on_silent,
            cfg.train.stuck_timeout_s, self._checkpoint_writes_busy,
        )  # fmt: skip
        self.stragglers = stragglers.StragglerWatch(
            cfg.train.straggler_every, self.rank, self.world,
            self.heartbeat.address if self.heartbeat is not None else "",
        )  # fmt: skip

    def start_records(self, cfg: ExperimentConfig) -> None:
        """metrics.jsonl and the MLflow run id (rank 0: they travel with the checkpoints,
        restored from the store) and the tracker that writes them."""
        if self.rank == 0:
            self.out.mirror(["metrics.jsonl", RUN_ID_FILE, SYNCED_FILE])
            self.out.restore_mirrored()
        self.tracker = Tracker(
            self.run_dir, self.rank == 0, cfg.mlflow.retry_every_s, cfg.mlflow.final_wait_s,
            every_row={"world_size": self.world},  # every row of metrics.jsonl says it
            upload_timeout_s=cfg.mlflow.upload_timeout_s,
        )  # fmt: skip
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def build(self, cfg: ExperimentConfig) -> None:
        """Model, objective, DeepSpeed engine and the streams, from the resolved ``cfg``."""
        self.meta, self.model_cfg, model, self.objective, self.make_stream = build_parts(
            cfg, self.rank, self.world, self.sources, self.ds_config
        )
        self.model_flops = flops_model(model, cfg.data.seq_len)  # before ZeRO partitions it
        self.input_keys = forward_keys(model)
        # Models with segment-level recurrence (Transformer-XL, XLNet) take ``mems`` and
        # return the next ones in outputs["mems"]; the trainer carries them from batch to
        # batch (per rank: each rank's rows are its own streams) and checkpoints them.
        self.uses_memory = "mems" in self.input_keys
        self.memory: Any = None
        self.eval_memory: Any = None
        self.n_params = sum(numel(p) for p in model.parameters())
        # the bundle being written (``disk_full``'s path; a checkpoint: the Checkpointer's)
        self.writing: Path | None = None
        universal = self.elastic is not None and self.elastic.universal
        if universal:
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        self.engine = ds_engine.initialize(model, self.ds_config, scheduler_factory(cfg.train))
        if universal:
            # Only this run's first load reads the universal folder; later saves are ours.
            self.ds_config["checkpoint"].pop("load_universal")
            if not self.ds_config["checkpoint"]:
                self.ds_config.pop("checkpoint")
        self.stream = self.make_stream("train", cfg.data.workers)
        # Per source: evaluation reads each alone. Opened now: a valid split too small for
        # the eval batch is refused before step 1, not at the first evaluation.
        self.valid_streams: dict[int, Any] = open_eval_streams(
            cfg, lambda k: self.make_stream("valid", 0, k), len(self.sources)
        )

    def make_checkpointer(self) -> Checkpointer:
        """What every checkpoint records besides the trainer's state: the config, the
        DeepSpeed config and (in COMPLETE) the batch, the ZeRO stage and the tokenizer."""
        batch_meta = {
            **self.plan.batch_meta(),
            "tokenizer_fingerprint": self.data.manifest.get("tokenizer", {}).get("fingerprint"),
            "vocab_size": self.meta["vocab_size"],
        }
        files = (self.cfg.model_dump(mode="json"), self.ds_config, batch_meta)
        return Checkpointer(self.ckpt, self.cfg.train, self.engine, self.checkpoint_state,
                            self.bundle, files, self.log, self._long_phase)  # fmt: skip

    def reset_metrics(self) -> None:
        self.metric_names: list[str] | None = None  # the objective's, fixed at the first step
        # Steps not yet read from the device (the logging window), and the ones read but
        # not yet logged (a checkpoint reads them: its token counts must be complete).
        self.window: list[StepRecord] = []
        self.read: list[dict[str, float]] = []
        self.losses: dict[int, float] = {}  # step -> mean loss, this process's steps

    # --- setup ---------------------------------------------------------------------------
    def plan_run(self, cfg: ExperimentConfig) -> RunPlan:
        """This run's plan (``resolve_run`` for this world and train.out_dir), its resume
        on another world size prepared (``prepare_resume``)."""
        plan = resolve_run(cfg, self.world, self.ckpt, self.data.manifest.get("tokenizer", {}))
        return dataclasses.replace(plan, elastic=self.prepare_resume(plan.elastic))

    def plan_elastic_resume(
        self, cfg: ExperimentConfig
    ) -> tuple[ExperimentConfig, ElasticResume | None]:
        """(config, elastic resume) of ``plan_run``: the config with grad_accum set so the
        global batch stays the checkpoint's, and the ZeRO 1-3 state converted."""
        plan = self.plan_run(cfg)
        return plan.cfg, plan.elastic

    def prepare_resume(self, elastic: ElasticResume | None) -> ElasticResume | None:
        """What a resume on another world size needs of the process group: the
        checkpoint's ZeRO 1-3 state converted to a universal checkpoint (collective).
        Says what changed; returns ``elastic`` with the conversion's seconds."""
        if elastic is None:
            return None
        ga = elastic.grad_accum[1]
        if ga != elastic.config_grad_accum:
            self.log(
                f"checkpoint {elastic.where} was written by {elastic.saved_world} ranks: "
                f"train.grad_accum {elastic.config_grad_accum} -> {ga} on {self.world} ranks "
                f"keeps the global batch of {elastic.global_batch}"
            )
        if not elastic.universal:
            return elastic
        elastic = dataclasses.replace(elastic, convert_s=self.ckpt.to_universal(elastic.tag))
        peak = peak_resident_gib()  # before anything is built: the conversion's
        by = f"by {self.world} ranks" if elastic.stage == 3 else "on rank 0"
        done = (
            f"in {elastic.convert_s:.1f} s {by}, rank 0's peak resident memory {peak:.2f} GiB"
            if elastic.convert_s
            else "(converted before)"
        )
        self.log(
            f"converted {elastic.where} (ZeRO-{elastic.stage}, {elastic.saved_world} ranks) "
            f"to a universal checkpoint {done}"
        )
        return elastic

    def resume_if_asked(self) -> None:
        """Load the checkpoint the plan resumes (``train.resume: auto``), once."""
        tag = self.plan.resume_tag
        if tag is None or self.resumed_from is not None:
            return
        universal = self.elastic is not None and self.elastic.universal
        state = self.ckpt.load(self.engine, tag, universal=universal)  # raises if it cannot
        self.stream.load_state_dict(state["loader"])
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.tokens_by_source = state.get("tokens_by_source", [self.tokens_seen])
        self.memory = state.get("memory")
        self.skipped = state["skipped"]
        self.checkpointer.count = state["n_checkpoints"]
        self.resumed_from = tag
        names, nbytes = getattr(self.ckpt, "fetched", ([], 0))
        if names:  # a store: what this rank fetched, said by every rank
            listed = ": " + ", ".join(names) if len(names) <= 8 else ""
            rank_line(
                f"[plm train] rank {self.rank}: fetched {len(names)} files ({nbytes / 2**20:.2f} "
                f"MiB) of {self.ckpt.where(tag)} into {self.ckpt.root / tag}{listed}"
            )
        extra = ""
        if "resumed_world_size" in state:
            extra = f" (written by {state['resumed_world_size']} ranks, now {self.world})"
        self.log(f"resumed from {self.ckpt.where(tag)} at step {self.step}{extra}")

    def start_tracking(self) -> None:
        cfg = self.cfg
        m = self.data.manifest
        tags: dict[str, str] = {
            "arch": cfg.model.arch,
            "objective": cfg.objective.kind,
            "data_fingerprint": mixture_fingerprint(self.sources),
            "tokenizer_fingerprint": str(m.get("tokenizer", {}).get("fingerprint", "")),
            "code_version": code_version(),
            "world_size": str(self.world),
            "zero_stage": str(ds_engine.zero_stage(self.ds_config)),
        }
        if self.elastic:
            tags["elastic_resume"] = elastic_resume_tag(self.elastic, self.world)
        params = {**cfg.model_dump(mode="json"), "model_resolved": self.model_cfg.model_dump()}
        if len(self.sources) > 1:  # the mixture at a glance: data.mixture = en:0.7, zh:0.3
            total = sum(x.weight for x in self.sources)
            params["data_mixture"] = ", ".join(
                f"{x.name}:{x.weight / total:.3f}" for x in self.sources
            )
            for x in self.sources:
                tags[f"data_fingerprint/{x.name}"] = data_fingerprint(x.path.manifest)
        # A wrong MLflow password or a missing permission: one plm: line, exit 2, no step.
        registered = cfg.name if cfg.mlflow.register_model else None  # the model's name
        check_access(cfg.mlflow.tracking_uri, cfg.mlflow.experiment or cfg.name, registered)
        self.tracker.start(
            tracking_uri=cfg.mlflow.tracking_uri,
            experiment=cfg.mlflow.experiment or cfg.name,
            run_name=cfg.mlflow.run_name or self.out.name,
            params=params,
            tags=tags,
            resume=self.resumed_from is not None,
            defer=True,  # MLflow's start-up after the first step (the row that starts it)
        )
        if self.resumed_from is None:
            for x in self.sources:  # the UI's "Datasets": each data dir, by its fingerprint
                name = x.name if len(self.sources) > 1 else Path(x.path.uri).name or x.path.uri
                self.tracker.log_dataset(
                    x.path.uri, name, data_fingerprint(x.path.manifest), "training"
                )
            self.tracker.log_dict(cfg.model_dump(mode="json"), "config/experiment.json")
            self.tracker.log_dict(self.ds_config, "config/deepspeed.json")
            self.tracker.log_artifacts(self.data.tokenizer_path.parent, "tokenizer")

    def log(self, msg: str) -> None:
        if self.rank == 0:  # a closed stdout drops it (output.GuardedStream, rank_line)
            rank_line(f"[plm train] {msg}")

    # --- one optimizer step ---------------------------------------------------------------
    def train_step(self, it) -> StepRecord | None:
        """grad_accum micro-batches and one update; None when the step was skipped.

        Metrics stay on the device: the step's record holds them as one tensor, read and
        reduced over the ranks only when a logging window closes (``_read_window``). The one
        host read per step is a 2-number all-reduce before the update: did any rank get
        a stop signal or a non-finite loss? (Every rank must agree on skipping.)
        """
        ga = self.cfg.train.grad_accum
        values: torch.Tensor | None = None  # [loss, *metrics] summed over micro-batches
        nonfinite = torch.zeros((), device=self.dev)
        # tokens per source, samples, positions, sum of squared lengths, decoded tokens
        host = [0.0] * (len(self.sources) + 4)
        for micro in range(ga):
            batch = next(it)
            self._count_on_host(batch, host)
            loss, row = self._micro_batch_loss(batch, micro)
            values = row if values is None else values + row
            nonfinite = nonfinite + (~torch.isfinite(loss.detach())).float()
            last = micro == ga - 1
            if last:
                # The step's one host read. A stop signal rides on it too: every rank
                # learns of a signal any rank got, at the same step; and so does whether
                # every rank has written its part of a pending checkpoint.
                flags = torch.stack(
                    [
                        nonfinite,
                        nonfinite.new_tensor(float(self.stopper.requested)),
                        nonfinite.new_tensor(float(self.ckpt.writes_busy())),
                    ]
                )
                with self.stragglers.sync(flags):  # where a rank early waits for the others
                    dist.all_reduce(flags)
                bad, stop, writing = (float(x) > 0 for x in flags.tolist())
                self.stop_agreed = self.stop_agreed or stop
                self.writes_done = self.ckpt.pending is not None and not writing
                if bad:
                    # the window's earlier backward passes may hold non-finite gradients
                    discard_gradients(self.engine)
                    return None
            self.engine.set_gradient_accumulation_boundary(last)
            self.engine.backward(loss)
            if last:  # the lr this update uses: engine.step() steps the scheduler after it
                lr = float(self.engine.get_lr()[0])
            self.engine.step()
        norm = self._grad_norm()
        assert values is not None
        return StepRecord(
            step=self.step + 1,
            values=torch.cat(
                [values.double(), torch.tensor(host, dtype=torch.float64).to(self.dev)]
            ),
            grad_norm=norm.to(self.dev, torch.float64),
            lr=lr,
        )

    def _count_on_host(self, batch: dict[str, Any], host: list[float]) -> None:
        """Add the loader's CPU batch to the step's counts (``host``: tokens per source,
        samples, positions, sum of squared lengths, decoded tokens): no device sync."""
        n_sources = len(self.sources)
        for k, n in enumerate(_tokens_by_source(batch, n_sources)):
            host[k] += n
        host[n_sources] += len(batch["input_ids"])
        host[n_sources + 1] += n_positions(batch)
        squares, decoded = _work_stats(batch)
        host[n_sources + 2] += squares
        host[n_sources + 3] += decoded

    def _micro_batch_loss(
        self, batch: dict[str, Any], micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, [loss, *metrics] detached) of micro-batch ``micro`` of the step."""
        batch = self.device_batch(batch)
        # Dropout (and any other torch randomness of the step) is drawn from a seed of
        # the global micro-batch: the same samples get the same draws whatever the
        # world size and grad_accum (rank r's micro-batch m holds the step's samples
        # [(m * W + r) * B, ...)), so a resume on another world size continues the run.
        torch.manual_seed(
            micro_batch_seed(self.cfg.train.seed, self.step, micro * self.world + self.rank)
        )
        outputs = self.forward(batch, train=True)
        loss, metrics = self.objective.loss(outputs, batch)
        if self.metric_names is None:
            self.metric_names = sorted(metrics)
        row = torch.stack(
            [loss.detach().float(), *(metrics[k].detach().float() for k in self.metric_names)]
        )
        return loss, row

    def _grad_norm(self) -> torch.Tensor:
        """The update's global gradient norm, a 0-d tensor: recorded in every setup
        (engine.record_grad_norm); NaN, never a made-up 0, if not."""
        norm = self.engine.get_global_grad_norm()
        if torch.is_tensor(norm):
            return norm.detach().float().reshape(())
        return torch.tensor(float("nan") if norm is None else float(norm))

    def _read_window(self) -> None:
        """Read the steps still on the device: one all-reduce over the ranks and one host
        read for the whole window. Adds their tokens to the run's counts and their mean
        loss to ``losses``; the per-step numbers wait in ``self.read`` for the log."""
        if not self.window:
            return
        table = torch.stack([r.values for r in self.window])  # [steps, 1 + metrics + counts]
        dist.all_reduce(table)
        norms = torch.stack([r.grad_norm for r in self.window]).tolist()  # same on all ranks
        names = ["loss", *(self.metric_names or [])]
        scale = self.world * self.cfg.train.grad_accum
        n_sources = len(self.sources)
        for r, row, norm in zip(self.window, table.tolist(), norms, strict=True):
            d = {k: v / scale for k, v in zip(names, row, strict=False)}
            by_source = row[len(names) : len(names) + n_sources]
            samples, positions, squares, decoded = row[len(names) + n_sources :]
            d.update(grad_norm=norm, lr=r.lr, _tokens=sum(by_source))
            d.update(_samples=samples, _positions=positions, _squares=squares, _decoded=decoded)
            self.read.append(d)
            self.losses[r.step] = d["loss"]
            self.tokens_seen += int(sum(by_source))
            for k, v in enumerate(by_source):
                self.tokens_by_source[k] += int(v)
        self.window = []

    def device_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The loader's CPU batch on the device. For a model whose forward takes a
        ``layout``, the attention layout (which tokens to pack, sequence boundaries, the
        labelled positions) is built here on the CPU tensors and moved with them: the
        sizes it reads cost no device sync, and the forward then reads none."""
        layout = None
        if "layout" in self.input_keys:
            layout = self.engine.module.attention_layout(batch)
        batch = _to_device(batch, self.dev)
        if layout is not None:
            batch["layout"] = layout.to(self.dev)
        return batch

    def forward(self, batch: dict[str, Any], train: bool) -> dict[str, Any]:
        inputs = model_inputs(batch, self.input_keys)
        if not self.uses_memory:
            return self.engine(**inputs)
        outputs = self.engine(**inputs, mems=self.memory if train else self.eval_memory)
        new = outputs.get("mems")  # the model detaches them: no gradient flows back
        if train:
            self.memory = new
        else:
            self.eval_memory = new
        return outputs

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Eval metrics on the valid split; with a mixture, each source's valid split is
        evaluated alone (``eval_loss/<name>``, ...) and the unsuffixed metrics are their
        means weighted by the mixture's weights."""
        if len(self.sources) == 1:
            return self._evaluate_source(0)
        total = sum(s.weight for s in self.sources)
        out: dict[str, float] = {}
        for k, source in enumerate(self.sources):
            for name, value in self._evaluate_source(k).items():
                out[f"{name}/{source.name}"] = value
                if not name.endswith("_ppl"):
                    out[name] = out.get(name, 0.0) + value * source.weight / total
        for name in [n for n in out if "/" not in n and n.endswith("_loss") and "nsp" not in n]:
            out[name.replace("loss", "ppl")] = math.exp(min(out[name], 50.0))
        return out

    def _evaluate_source(self, k: int) -> dict[str, float]:
        self.engine.eval()
        self.eval_memory = None  # every evaluation reads the same fixed pass from the start
        total: torch.Tensor | None = None  # summed on the device, read once at the end
        names: list[str] = []
        n = 0
        if k not in self.valid_streams:  # one fixed pass: the same batches at every evaluation
            self.valid_streams[k] = self.make_stream("valid", 0, k)
        for i, batch in enumerate(self.valid_streams[k]):
            if i >= self.cfg.train.eval_batches:
                break
            batch = self.device_batch(batch)
            loss, metrics = self.objective.loss(self.forward(batch, train=False), batch)
            names = sorted(metrics)
            row = torch.stack([loss.float(), *(metrics[m].float() for m in names)]).double()
            total = row if total is None else total + row
            n += 1
        self.engine.train()
        if total is None:
            return {}
        dist.all_reduce(total)
        red = (total / self.world / n).tolist()
        out = {f"eval_{k}": v for k, v in zip(["loss", *names], red, strict=True)}
        for k in list(out):
            if (k.endswith("_loss") or k == "eval_loss") and "nsp" not in k:
                out[k.replace("loss", "ppl")] = math.exp(min(out[k], 50.0))
        return out

    # --- checkpoints and bundles ---------------------------------------------------------
    def checkpoint_state(self, n: int) -> dict[str, Any]:
        """This rank's trainer state for the run's ``n``-th checkpoint."""
        self._read_window()  # the token counts it stores must include every step
        return {
            "loader": self.stream.state_dict(),
            "tokens_seen": self.tokens_seen,
            "tokens_by_source": self.tokens_by_source,
            "skipped": self.skipped,
            "n_checkpoints": n,
            "memory": self.memory,  # this rank's recurrent memory (None for most models)
        }

    def save(self) -> str:
        """Collective: checkpoint this step now (``Checkpointer.save``)."""
        return self.checkpointer.save(self.step)

    def log_save_cost(self) -> None:
        """What this run's saves held training up on rank 0: the save calls, and the
        optimizer updates that waited for an asynchronous save's writes."""
        self.log(self.checkpointer.cost_line())

    def save_complete(self) -> str:
        """Collective: a complete checkpoint of this step (what the end of a run, a stop
        and a divergence leave), a pending save's writes waited for first."""
        return self.checkpointer.save_complete(self.step)

    def bundle(self, name: str, kept: bool = False) -> Path | None:
        """Write a model bundle (collective): every rank walks the weights one parameter at
        a time (``full_tensors``), rank 0 streams each into the bundle's files as it
        arrives, so no rank holds the whole model. ``kept``: marked so that pruning leaves
        it (CheckpointManager.prune_bundles)."""
        from pipeline.models.bundle import BundleWriter

        out = self.run_dir / "bundles" / name
        self.writing = out  # what a full disk stops (``disk_full``)
        writer = None
        if self.rank == 0:
            extra = {
                "objective": self.cfg.objective.kind,
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "data_fingerprint": mixture_fingerprint(self.sources),
                "experiment": self.cfg.name,
            }
            if kept:
                extra["kept"] = True
            writer = BundleWriter(
                out, self.cfg.model.arch, self.model_cfg, self.data.tokenizer_path.parent, extra,
                max_shard_bytes=self.cfg.train.bundle_shard_mb * 2**20,
            )  # fmt: skip
        with writer if writer is not None else contextlib.nullcontext():  # closes or aborts
            for tensor_name, t in full_tensors(self.engine):
                if writer is not None:
                    writer.add(tensor_name, t)
        self.writing = None
        if self.rank == 0:
            self.out.upload_tree(f"bundles/{name}")  # to a store, in the background
        dist.barrier()
        return out if self.rank == 0 else None

    # --- the loop ------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> RunResult:
        """Train to train.max_steps; ``stop_after``: checkpoint and return at that step
        instead (an interruption on purpose, used to test resuming)."""
        it, t0 = self.start_run()
        status = "FAILED"
        bundle_dir = version = None
        try:
            self.train_loop(it, t0, stop_after)
            self._long_phase()  # the run's end: the last save, evaluation, bundle, MLflow
            self.save_complete()
            if self.step < self.cfg.train.max_steps:  # stopped early on purpose
                status = "KILLED"
                return self._result(None, None)
            bundle_dir, version = self.finish_run()
            status = "FINISHED"
        except BaseException as err:
            status, instead = self.failed(err)
            if instead is not None:
                raise instead from None
            raise
        finally:
            self.close_run(status)
        result = self._result(bundle_dir, version)
        result.tracking_left_behind = self.tracker.left_behind()
        # The last line of a finished run: where its model is (what export, finetune take)
        self.log(f"final bundle: {self.out.where('bundles/final')}")
        return result

    def start_run(self) -> tuple[Any, float]:
        """Before the first step: stop signals caught, the resume, the MLflow run, the
        run's first line. Returns (the train stream's iterator, the logging window's start)."""
        t = self.cfg.train
        self.stopper.install()  # before the loader forks its workers: they inherit it
        self.resume_if_asked()
        self.membership = self.membership_change()
        self.silent_note = heartbeat.take_note(self.run_dir) if self.rank == 0 else None
        self.start_tracking()
        self.peak_flops = device_peak_flops(t.precision)
        self.log(
            f"world size {self.world}, ZeRO {ds_engine.zero_stage(self.ds_config)}, "
            f"{self.n_params / 1e6:.2f}M params, global batch "
            f"{t.micro_batch_size * t.grad_accum * self.world}, steps {self.step}->{t.max_steps}"
        )
        t0 = time.perf_counter()
        it = iter(self.stream)
        if self.stream.n_skipped_shards:
            self.log(
                f"skipped {self.stream.n_skipped_shards} bad shards: {self.stream.skipped_shards}"
            )
            self.tracker.log_metrics({"skipped_shards": self.stream.n_skipped_shards}, self.step)
        return it, t0

    def train_loop(self, it, t0: float, stop_after: int | None) -> None:
        """Steps to train.max_steps (or ``stop_after``). A stop signal checkpoints and
        raises TrainingStopped at the next step boundary; too many non-finite losses in a
        row, TrainingDiverged."""
        t = self.cfg.train
        bad_in_row = 0
        while self.step < t.max_steps:
            if stop_after is not None and self.step >= stop_after:
                break
            if self.stop_agreed:  # a step boundary after SIGTERM / SIGINT
                self._long_phase()
                self._log_window(time.perf_counter() - t0, self.peak_flops)
                self.stop_on_signal()
            out = self.watched_step(it)
            if out is None:
                bad_in_row += 1
                self.skipped_step(bad_in_row)
                continue
            bad_in_row = 0
            self.window.append(out)
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                if self.heartbeat is not None:  # rank 0's MLflow may be slow to answer
                    self.heartbeat.long_phase()
                self._log_window(time.perf_counter() - t0, self.peak_flops)
                t0 = time.perf_counter()
            if self.membership is not None:
                self.log_membership_change()
            self.after_step()

    def watched_step(self, it) -> StepRecord | None:
        """``train_step``, seen by the heartbeat and the straggler watch."""
        if self.heartbeat is not None:
            self.heartbeat.begin_step(self.step + 1)
        self.stragglers.begin_step(self.step + 1)
        out = self.train_step(it)
        self.step += 1
        self.stragglers.end_step()
        if self.heartbeat is not None:
            self.heartbeat.end_step(self.step)
        self.name_straggler()
        return out

    def skipped_step(self, bad_in_row: int) -> None:
        """A step skipped on a non-finite loss: said and counted; the
        train.max_nonfinite_in_row-th in a row checkpoints and raises TrainingDiverged."""
        t = self.cfg.train
        self.skipped += 1
        self.log(f"step {self.step}: non-finite loss, update skipped ({bad_in_row} in a row)")
        # Logged at once: a run that stops on a diverging tail has no later
        # logging window that would report these skips.
        self.tracker.log_metrics({"skipped_steps": self.skipped}, self.step)
        if bad_in_row >= t.max_nonfinite_in_row:
            tag = self.save_complete()
            raise TrainingDiverged(
                f"{bad_in_row} non-finite losses in a row at step {self.step} "
                f"(train.max_nonfinite_in_row={t.max_nonfinite_in_row}); weights of "
                f"the last good update saved in {self.ckpt.where(tag)}. Lower "
                "train.lr, raise train.warmup_steps or use precision fp32/bf16."
            )

    def after_step(self) -> None:
        """After a trained step: what the checkpointer does (a completion, the checkpoint
        and bundle due), then the evaluation due. The checkpoint is written and completed
        before the evaluation: an evaluation that fails loses no training
        (docs/training.md). The run's last step has its own (``run``, ``finish_run``)."""
        writes_done, self.writes_done = self.writes_done, False
        saved = self.checkpointer.step_done(self.step, writes_done)
        if saved.kept and saved.bundle is not None:  # MLflow gets the kept ones only
            self.tracker.log_artifacts(saved.bundle, f"bundles/{saved.tag}")
        t = self.cfg.train
        if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
            self._long_phase()
            self.ckpt.finish()  # a pending checkpoint (this step's): complete first
            self.log_evaluation(self.evaluate())

    def log_evaluation(self, ev: dict[str, float]) -> None:
        self.tracker.log_metrics(ev, self.step)
        self.log(f"step {self.step}: " + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))

    def finish_run(self) -> tuple[Path | None, str | None]:
        """A run at train.max_steps, its last checkpoint complete: the last evaluation,
        the final bundle, what the run cost, and (rank 0) the model in MLflow. Returns
        (the bundle on rank 0, the registered model version)."""
        final_eval = self.evaluate() if self.cfg.train.eval_every else {}
        if final_eval:
            self.log_evaluation(final_eval)
        bundle_dir = self.bundle("final")
        self.log_save_cost()
        self.log_host_memory()
        version = None
        if self.rank == 0:
            self.tracker.await_server()  # after an outage: the model is logged if it can
            self.tracker.log_artifacts(bundle_dir, "model")
            if self.cfg.mlflow.register_model:
                version = self.register_model(bundle_dir)
        with uploads_as_checkpoint_errors():
            self.out.wait()  # on a store: the final bundle and the checkpoints are there
        return bundle_dir, version

    def register_model(self, bundle_dir: Path | None) -> str | None:
        """Rank 0: the final bundle as a registered MLflow model; returns its version."""
        from pipeline.models.pyfunc import log_bundle_model  # imports MLflow

        cfg = self.cfg
        return self.tracker.register(
            "model",
            cfg.name,
            cfg.mlflow.alias,
            {
                "arch": cfg.model.arch,
                "objective": cfg.objective.kind,
                "tokens_seen": str(self.tokens_seen),
                "data_fingerprint": mixture_fingerprint(self.sources),
            },
            bundle_dir=bundle_dir,
            # the LoggedModel at its step (the UI's "Step"; MLflow's default is 0)
            log_model=functools.partial(log_bundle_model, step=self.step),
        )

    def failed(self, err: BaseException) -> tuple[str, BaseException | None]:
        """The MLflow run told why ``err`` ended the run. Returns (the status it ends
        with, what to raise instead of ``err``: a DiskFull or a peer's fault, or None)."""
        full = no_space(err)
        if full is not None:  # train.out_dir's filesystem: one line, exit 5, no traceback
            self.tracker.set_tags(
                {"failure_reason": "disk_full", "failure_step": self.step,
                 "failure_message": f"{type(full).__name__}: {full}"}
            )  # fmt: skip
            return "FAILED", self.disk_full(full)
        fault = faults.peer_fault(err, self.rank, self.step, self.cfg.train.collective_timeout_s)
        if fault is not None and self.heartbeat is not None and self.heartbeat.settle():
            time.sleep(60)  # a silent peer is named: the heartbeat thread ends us
        if fault is not None:
            self.tracker.set_tags({"elastic/last_fault": str(fault)})
            # An elastic agent with restarts left starts the ranks again: the MLflow
            # run goes on (stays RUNNING) rather than ending here.
            return ("RUNNING" if elastic_restarts_left() else "FAILED"), fault
        # The MLflow run says why it failed, not only that it did.
        status = "FAILED"
        reason = "diverged" if isinstance(err, TrainingDiverged) else type(err).__name__
        if isinstance(err, KeyboardInterrupt):
            status, reason = "KILLED", "interrupted"
        if isinstance(err, TrainingStopped):
            status, reason = "KILLED", signal.Signals(err.signum).name
        self.tracker.set_tags(
            {"failure_reason": reason, "failure_step": self.step,
             "failure_message": f"{type(err).__name__}: {err}"}
        )  # fmt: skip
        return status, None

    def close_run(self, status: str) -> None:
        """However the run ended: the heartbeat, signals, MLflow run, loader, store."""
        if self.heartbeat is not None:  # this rank ends on its own: not a silent peer
            self.heartbeat.stop()
        self.stopper.restore()
        self.tracker.end(status)
        self.stream.close()
        self.close_out(status)

    def disk_full(self, err: OSError) -> DiskFull:
        """The ``DiskFull`` of a write under train.out_dir that found its filesystem full
        (a checkpoint, a bundle, metrics.jsonl): the path, what a checkpoint and a bundle
        need, what is free, and where the same command resumes.
        One rank alone first completes a checkpoint whose files were all written (its
        writes finished before a bundle or a log line failed); ``latest`` only ever
        names a complete one."""
        pending = self.ckpt.pending  # an asynchronous save's files: the write that failed?
        if self.world == 1 and pending is not None:
            with contextlib.suppress(Exception):  # another full write: latest stays
                self.ckpt.finish()
            if self.ckpt.pending is None:  # completed: it was not what failed
                pending = None
        stage = ds_engine.zero_stage(self.ds_config)
        ckpt = checkpoint_bytes(self.n_params, stage, self.cfg.train.precision)
        needs = (
            f"a checkpoint needs ~{size_text(ckpt)} (weights + optimizer state; "
            f"train.keep_last={self.cfg.train.keep_last} of them are kept, plus the one "
            f"being written), a bundle ~{size_text(4 * self.n_params)} (the weights)"
        )
        try:
            latest = self.ckpt.latest()
        except Exception:  # noqa: BLE001  (the message is what matters here)
            latest = None
        out = self.cfg.train.out_dir
        if latest is None:
            then = "free space there or pass train.out_dir=DIR on a bigger disk (no checkpoint "
            then += "of this run is complete yet)"
        elif self.cfg.train.resume != "auto":
            then = "free space there or pass train.out_dir=DIR on a bigger disk (the last "
            then += f"complete checkpoint is {self.ckpt.where(latest)})"
        else:
            then = (
                f"free space there (or move {out} to a bigger disk and pass train.out_dir="
                f"its new path) and run the same command again: it resumes from "
                f"{self.ckpt.where(latest)}, the last complete checkpoint"
            )
        path = self.writing or self.checkpointer.writing
        path = path or (self.ckpt.where(pending[0]) if pending else out)
        return disk_full(err, path, needs=needs, then=then)

    def close_out(self, status: str) -> None:
        """The run's last files to the store (rank 0's metrics.jsonl and MLflow run id,
        as the ended run left them); a run that did not finish waits train.stop_grace_s
        for them at most and says what it could not send."""
        timeout = None if status == "FINISHED" else self.cfg.train.stop_grace_s
        try:
            self.out.close(timeout=timeout)
        except Exception as err:
            if status == "FINISHED":
                raise
            rank_line(f"[plm train] rank {self.rank}: {err}", err=True)

    def log_host_memory(self) -> None:
        """Collective: each rank's peak resident memory (the process's high-water mark: what
        the host had to hold for it, the page cache not counted), in the log and as MLflow
        metrics ``system/rank<r>_peak_resident_gib`` (MLflow's system metrics tab)."""
        mine = torch.tensor([peak_resident_gib()], dtype=torch.float64, device=self.dev)
        peaks = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(peaks, mine)
        gib = [float(x) for x in peaks]
        self.tracker.log_metrics(
            {f"system/rank{r}_peak_resident_gib": g for r, g in enumerate(gib)}, self.step
        )
        self.log("peak resident memory per rank: " + ", ".join(f"{g:.2f} GiB" for g in gib))

    def membership_change(self) -> dict[str, Any] | None:
        """After a resume by the elastic agent or on another world size: what changed, and
        (rank 0) the last step metrics.jsonl logged before, for ``log_membership_change``."""
        if self.resumed_from is None:
            return None
        meta = self.ckpt.meta(self.resumed_from)
        saved = int(meta["world_size"])
        if saved == self.world and "TORCHELASTIC_RUN_ID" not in os.environ:
            return None
        last_step, last_time, changes = self.step, None, 0
        rows = self.run_dir / "metrics.jsonl"
        if self.rank == 0 and rows.is_file():
            for line in rows.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                if "step_loss" in row:
                    last_step, last_time = max(last_step, int(row["step"])), row["time"]
                changes = max(changes, int(row.get("elastic/changes", 0)))
        ga = (int(meta.get("grad_accum", self.cfg.train.grad_accum)), self.cfg.train.grad_accum)
        return {
            "old_world": saved, "step": self.step, "last_step": last_step,
            "last_time": last_time, "changes": changes + 1, "grad_accum": ga,
        }  # fmt: skip

    def name_straggler(self) -> None:
        """Every train.straggler_every steps (a collective): the slowest rank, if it holds
        the others back, in one `plm:` line and MLflow metrics (rank 0)."""
        found = self.stragglers.check(self.step)
        if found is None:
            return
        rank_line(found.line(), err=True)
        self.tracker.log_metrics({"straggler/rank": found.rank,
                                  "straggler/slowdown": round(found.slowdown, 3),
                                  "straggler/others_waited": round(found.waited, 3)},
                                 self.step)  # fmt: skip
        self.tracker.set_tags({"straggler/last": f"rank {found.rank} on {found.host} "
                               f"({found.address}), steps {found.first_step}-{found.last_step}"})  # fmt: skip

    def _checkpoint_writes_busy(self) -> bool:
        """From the heartbeat thread: the next update may wait for the files."""
        ckpt = getattr(self, "ckpt", None)  # the heartbeat starts before the manager exists
        return ckpt is not None and ckpt.writes_busy()

    def _long_phase(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.long_phase()

    def _on_silent(self, found: heartbeat.Silent, store: str) -> None:
        """The heartbeat thread found a silent peer: leave a note for the next round's
        rank 0 (a survivor: this host's run folder), then end this process."""
        note = {"line": found.line(store), "host": found.host, "address": found.address,
                "rank": found.rank, "silent_s": found.silent_s, "step": found.step,
                "written": time.time()}  # fmt: skip
        try:
            (self.run_dir / heartbeat.NOTE_FILE).write_text(json.dumps(note), encoding="utf-8")
        except OSError:  # the note is a convenience; leaving is not
            pass
        heartbeat.leave(found, store)

    def log_membership_change(self) -> None:
        """The first step after a membership change is done: log it (rank 0) as metrics
        and a tag of the MLflow run, and as a row of metrics.jsonl."""
        c, self.membership = self.membership, None
        if self.rank != 0 or c is None:
            return
        import psutil

        now = time.time()
        lost = now - c["last_time"] if c["last_time"] is not None else 0.0
        recomputed = max(0, c["last_step"] - c["step"])
        self.tracker.log_metrics(
            {
                "elastic/changes": c["changes"],
                "elastic/old_world_size": c["old_world"],
                "elastic/world_size": self.world,
                "elastic/seconds_lost": lost,
                # Of it, from this process's start (after detection and the rendezvous)
                # to the end of its first step: imports, DeepSpeed, the resume, one step.
                "elastic/startup_s": now - psutil.Process().create_time(),
                "elastic/steps_recomputed": recomputed,
            },
            self.step,
        )
        text = (
            f"at step {c['step']}: {c['old_world']} -> {self.world} ranks (grad_accum "
            f"{c['grad_accum'][0]} -> {c['grad_accum'][1]}); first step {lost:.1f} s after "
            f"the last one logged before (step {c['last_step']}); {recomputed} steps recomputed"
        )
        tags = {f"elastic/change_{c['changes']}": text}
        note, self.silent_note = self.silent_note, None
        # A survivor's note of this change (not one a later rank 0 finds on its host from
        # a change long past): written after the last step logged before the change.
        if note is not None and note.get("written", 0) >= (
            c["last_time"] or 0
        ):  # the round before ended on a silent peer: who, found how fast
            tags[f"elastic/silent_{c['changes']}"] = note["line"]
            self.tracker.log_metrics({"elastic/silent_detect_s": note["silent_s"]}, self.step)
        self.tracker.set_tags(tags)
        self.log(f"membership change {c['changes']} {text}")

    def stop_on_signal(self) -> None:
        """Every rank, at the same step boundary: checkpoint, then TrainingStopped."""
        tag = self.save_complete()
        name = signal.Signals(self.stopper.signum or signal.SIGTERM).name
        where = self.ckpt.where(tag) if tag else "none yet"
        raise TrainingStopped(
            self.stopper.signum or signal.SIGTERM,
            f"stopped by {name} at step {self.step} of {self.cfg.train.max_steps}; checkpoint "
            f"{where}; the same command resumes from it",
        )

    def _killed_by_timer(self, signum: int) -> None:
        """The grace time ran out (a timer thread): the MLflow run ends KILLED anyway."""
        self.tracker.terminate(
            "KILLED", {"failure_reason": signal.Signals(signum).name,
                       "failure_message": "no step boundary within train.stop_grace_s"}
        )  # fmt: skip

    def _result(self, bundle_dir, version) -> RunResult:
        self._read_window()
        losses = self.losses
        first_loss = losses[min(losses)] if losses else None
        final_loss = losses[max(losses)] if losses else None
        return RunResult(
            run_dir=self.run_dir,
            steps=self.step,
            tokens_seen=self.tokens_seen,
            first_loss=first_loss,
            final_loss=final_loss,
            skipped_steps=self.skipped,
            run_id=self.tracker.run_id,
            bundle_dir=bundle_dir,
            model_version=version,
            losses=losses,
            tokens_by_source={
                x.name: n for x, n in zip(self.sources, self.tokens_by_source, strict=True)
            },
        )

    def _log_window(self, seconds: float, peak) -> None:
        """Read the window (``_read_window``) and log its means, throughput, MFU and the
        share of padding in the batches' positions."""
        self._read_window()
        window, self.read = self.read, []
        if not window:
            return
        keys = [k for k in window[-1] if not k.startswith("_")]
        m = {k: sum(w[k] for w in window) / len(window) for k in keys if k not in ("lr",)}
        m["lr"] = window[-1]["lr"]
        tokens = int(sum(w["_tokens"] for w in window))
        # FLOPs of what the model computes on the real tokens: attention at each
        # sequence's real length (the mean over tokens of their sequence's length) and
        # the vocabulary decoder on the positions it scores
        attended = sum(w["_squares"] for w in window) / max(tokens, 1)
        decoded = sum(w["_decoded"] for w in window) / max(tokens, 1)
        m.update(
            throughput(
                tokens=tokens,
                samples=int(sum(w["_samples"] for w in window)),
                seconds=seconds,
                flops_per_token=self.model_flops(attended, min(decoded, 1.0)),
                world_size=self.world,
                peak_flops=peak,
            )
        )
        positions = sum(w["_positions"] for w in window)
        m["padding_fraction"] = 1.0 - tokens / positions if positions else 0.0
        m["skipped_steps"] = self.skipped
        m["world_size"] = self.world  # changes when an elastic run loses or gains a host
        m["tokens_seen"] = self.tokens_seen
        if len(self.sources) > 1:
            for source, n in zip(self.sources, self.tokens_by_source, strict=True):
                m[f"tokens_seen/{source.name}"] = n
        # Per-step loss too, so a resumed run can be compared step by step.
        m["step_loss"] = window[-1]["loss"]
        total = self.cfg.train.max_steps
        left = total - self.step  # at this window's pace, for a person watching
        eta = f", {self.step}/{total}, {_duration(left * seconds / len(window))} left"
        self.log(
            f"step {self.step}: loss {m['loss']:.4f} lr {m['lr']:.3g} grad_norm "
            f"{m['grad_norm']:.3f} tok/s {m['tokens_per_s']:.0f} skipped {self.skipped}"
            + (eta if left > 0 else "")
        )
        self.tracker.log_metrics(m, self.step)  # the first row starts the MLflow run


def elastic_resume_tag(elastic: ElasticResume, world: int) -> str:
    """The ``elastic_resume`` tag of a run resumed on another world size: the checkpoint,
    the world sizes, grad_accum (the checkpoint's -> this run's) and the conversion."""
    conversion = f"{elastic.convert_s:.1f} s" if elastic.universal else "none (ZeRO-0)"
    return (
        f"{elastic.tag}: {elastic.saved_world} -> {world} ranks, grad_accum "
        f"{elastic.grad_accum[0]} -> {elastic.grad_accum[1]}, universal conversion {conversion}"
    )


def _duration(seconds: float) -> str:
    """About how long, for a person: "40 s", "3 min 05 s", "2 h 07 min"."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def elastic_restarts_left() -> bool:
    """Under torch's elastic agent with restarts left: a failed rank will be started again."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return count is not None and most is not None and int(count) < int(most)


def train(cfg: ExperimentConfig, stop_after: int | None = None) -> RunResult:
    """Entry point of ``plm train`` on every rank. A full train.out_dir raises DiskFull
    (one `plm:` line, exit 5)."""
    try:
        trainer = Trainer(cfg)
    except OSError as err:
        full = no_space(err)
        if full is None:
            raise
        raise disk_full(full, cfg.train.out_dir, then="free space there or pass "
                        "train.out_dir=DIR on a bigger disk") from None  # fmt: skip
    except RuntimeError as err:  # the process group or DeepSpeed's groups could not form
        rank = int(os.environ.get("RANK", "0"))
        fault = faults.peer_fault(err, rank, 0, cfg.train.collective_timeout_s)
        if fault is None:
            raise
        raise fault from None
    return trainer.run(stop_after=stop_after)
