"""``plm train CONFIG --dry-run``: validate everything and print the plan, start nothing.

Checks the model config through the registry, the data dir manifest and tokenizer, the
valid split against the eval batch (as the run's start does), and the DeepSpeed JSON
(with DeepSpeed's own ZeRO config model), then prints world size,
global batch, steps, tokens, parameters and a per-rank memory estimate for the ZeRO stage;
a local train.out_dir without the free space of one checkpoint is refused (exit 5).
The run itself (world size, global batch, ZeRO stage, the checkpoint to resume) is
resolved by ``run_plan.resolve_run``, as the trainer resolves it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config import ExperimentConfig
from pipeline.data.shards import DataDir
from pipeline.errors import ConfigError
from pipeline.train import ds_ops, parallelize
from pipeline.train import engine as ds_engine
from pipeline.train.run_plan import RunPlan, resolve_run

GiB = 1024**3


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


def model_state_bytes(
    n_params: int, stage: int, world: int, precision: str, offload: bool
) -> tuple[float, float, float]:
    """Per-rank bytes of (params, grads, optimizer states) under ZeRO ``stage``.

    fp32: 4 B weights, 4 B grads, 8 B Adam moments, plus under ZeRO 1-3 a 4 B fp32 master:
    DeepSpeed's ZeRO optimizers clone the weight partition even when it is fp32 (20 B in
    all at ZeRO-3: docs/training.md). bf16/fp16 (mixed): 2 B weights, 2 B
    grads, 12 B fp32 master weights + moments; but bf16 at ZeRO-0 is fp32 weights under
    torch autocast (engine.build_ds_config), so it counts as fp32. Stage 1 partitions the optimizer states, 2
    also the grads, 3 also the weights; offload moves optimizer (and, for stage 3,
    weights) to host memory, shown here as 0 on the device.
    """
    whole_fp32 = precision == "fp32" or (precision == "bf16" and stage == 0)  # autocast
    wb = 4 if whole_fp32 else 2
    params, grads = float(n_params * wb), float(n_params * wb)
    optim = float(n_params * (8 if whole_fp32 and stage == 0 else 12))
    if stage >= 1:
        optim /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        params /= world
    if offload:
        optim = 0.0
        if stage >= 3:
            params = 0.0
    return params, grads, optim


def checkpoint_bytes(n_params: int, stage: int, precision: str) -> float:
    """Bytes of one checkpoint on train.out_dir, all ranks together: the weights and the
    optimizer state (``model_state_bytes`` of one rank of one: nothing partitioned away;
    an offloaded optimizer is saved too). The trainer's own files (loader state, RNG)
    are a few KiB more."""
    params, _, optim = model_state_bytes(n_params, stage, 1, precision, offload=False)
    return params + optim


def check_out_dir_space(cfg: ExperimentConfig, n_params: int, stage: int) -> str:
    """A local train.out_dir whose filesystem has less free space than one checkpoint: a
    DiskFull (exit 5) now, not after the first train.save_every steps. Returns the plan's
    words on the space ("" for a URI)."""
    from pipeline.output import DiskFull, free_bytes, size_text

    t = cfg.train
    need = checkpoint_bytes(n_params, stage, t.precision)
    free = free_bytes(t.out_dir)
    if free is None:
        return ""
    if free < need:
        raise DiskFull(
            f"train.out_dir={t.out_dir}: a checkpoint needs ~{size_text(need)} (weights + "
            f"optimizer state) and its filesystem has {size_text(free)} free: free space "
            "there or pass train.out_dir=DIR on a bigger disk"
        )
    return f"; ~{size_text(need)} each, {size_text(free)} free"


def activation_bytes(cfg: ExperimentConfig, model_cfg) -> float:
    """Rough transformer activation memory of one micro-batch (Korthikanti et al. 2022).

    Per layer ~ s*b*h*(34 + 5*a*s/h) bytes in 16-bit; doubled for fp32; with activation
    checkpointing only each layer's input (2*s*b*h) is kept.
    """
    h = getattr(model_cfg, "hidden_size", 0)
    a = getattr(model_cfg, "num_heads", 1)
    layers = getattr(model_cfg, "num_layers", 0)
    s, b = cfg.data.seq_len, cfg.train.micro_batch_size
    scale = 2.0 if cfg.train.precision == "fp32" else 1.0
    per_layer = s * b * h * (34 + 5 * a * s / max(h, 1)) * scale
    if cfg.train.activation_checkpointing:
        per_layer = 2 * s * b * h * scale
    return per_layer * layers


def uses_pair_head(objective) -> bool:
    """Whether the objective trains the sentence-pair head (the pooler + BERT's NSP head
    or ALBERT's SOP head): mlm+nsp, mlm+sop, and ernie unless objective.ernie.nsp is
    false. Every other objective reads no pair logits."""
    kind = objective.kind
    return kind in ("mlm+nsp", "mlm+sop") or (kind == "ernie" and objective.ernie.nsp)


def model_config_for(cfg: ExperimentConfig, vocab_size: int):
    """The model's typed config for this experiment (``resolve_model_config``), with
    ``pair_head`` set from the objective for the architectures that have one (BERT,
    ERNIE, ALBERT): an MLM-only model carries no pooler or pair head, whose parameters
    would get no gradient. ``model.pair_head`` in the experiment config wins."""
    from pipeline.models.registry import ARCHITECTURES, resolve_model_config

    section = cfg.model.model_dump()
    config_cls = ARCHITECTURES.get(section.get("arch"), (None,))[0]
    if config_cls is not None and "pair_head" in config_cls.model_fields:
        section.setdefault("pair_head", uses_pair_head(cfg.objective))
    return resolve_model_config(section, vocab_size)


# Architectures without a table of absolute positions: data.seq_len is not bounded by
# model.max_positions (Transformer-XL: relative positions; ELMo, word2vec: none).
NO_POSITION_TABLE = ("transformer-xl", "elmo", "word2vec")


def check_positions(cfg: ExperimentConfig, model_cfg) -> None:
    """data.seq_len must fit the model's position table (RoBERTa's starts after its
    padding id): a ConfigError now instead of a ValueError in the first forward pass."""
    limit = getattr(model_cfg, "max_positions", None)
    if limit is None or cfg.model.arch in NO_POSITION_TABLE:
        return
    offset = model_cfg.pad_token_id + 1 if cfg.model.arch == "roberta" else 0
    need = cfg.data.seq_len + offset
    if need > limit:
        why = f" (positions start at model.pad_token_id + 1 = {offset})" if offset else ""
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} needs {need} positions but model.max_positions is "
            f"{limit}{why} (preset {cfg.model.preset}): pass data.seq_len={limit - offset} or "
            f"less, or model.max_positions={need} (a bigger table, trained from scratch)"
        )


def open_eval_streams(cfg: ExperimentConfig, make_stream, n_sources: int) -> dict[int, Any]:
    """The valid stream of each source (``make_stream(k)``), opened now: at the start of
    a run and by ``--dry-run``, not at the first evaluation after steps were trained. A
    valid split too small for the eval batch (or with a bad shard) is one ConfigError
    naming the split, its examples, the batch and the keys that fix it. Nothing without
    evaluation (train.eval_every=0)."""
    if not cfg.train.eval_every:
        return {}
    streams = {}
    for k in range(n_sources):
        try:
            streams[k] = make_stream(k)
        except ConfigError as err:
            raise ConfigError(
                f"evaluation (every train.eval_every={cfg.train.eval_every} steps) reads the "
                f"valid split with the eval batch: {err}; or re-prepare the data with a "
                "larger --valid-fraction, or pass train.eval_every=0 to train without "
                "evaluation"
            ) from None
    return streams


def check_objective(cfg: ExperimentConfig, objective, model, data: DataDir, meta: dict) -> None:
    """The checks the real run makes when the objective meets the model and the data:
    padding id (RoBERTa's positions), the architecture the objective trains, and a
    distillation teacher (loaded on the CPU: same tokenizer as the data)."""
    import warnings

    with warnings.catch_warnings():  # a teacher's weights copied into a meta-device student
        warnings.simplefilter("ignore", UserWarning)
        objective.attach(model)
    teacher = getattr(objective, "teacher_config", None)
    if teacher:
        from pipeline.objectives.distill import check_same_tokenizer

        where = f"({data.tokenizer_path.parent / 'tokenizer_meta.json'})"
        check_same_tokenizer(teacher["vocab"], meta, where)


def check_eval_split(cfg: ExperimentConfig, sources, objective, world: int) -> None:
    """What the run's start checks of evaluation (``open_eval_streams``), for rank 0 of
    ``world`` ranks: each source's valid split against world * train.micro_batch_size."""
    from pipeline.loader.stream import PretrainStream

    def make(k: int):
        return PretrainStream(
            [sources[k]], "valid", objective, micro_batch_size=cfg.train.micro_batch_size,
            seed=cfg.train.seed, rank=0, world_size=world, num_workers=0,
            verify_checksums=cfg.data.verify_checksums, on_bad_shard=cfg.data.on_bad_shard,
        )  # fmt: skip

    for stream in open_eval_streams(cfg, make, len(sources)).values():
        stream.close()


@dataclass(frozen=True)
class ModelFacts:
    """What the dry run learns of the model by building it on the meta device."""

    model_cfg: Any
    n_params: int
    flops_per_token: float
    objective: Any


def open_data(cfg: ExperimentConfig) -> tuple[list, dict[str, Any]]:
    """The data dirs (``open_sources``: tokenizers checked) and the tokenizer's meta; a
    ConfigError for a missing meta file or a source without train or valid shards."""
    from pipeline.loader.mixture import open_sources

    key = "data.path" if cfg.data.sources is None else "data.sources"
    sources = open_sources(cfg.data)
    meta_path = sources[0].path.tokenizer_path.parent / "tokenizer_meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"{key}: {meta_path} is missing (re-run `plm data prepare`)")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    for source in sources:
        for split in ("train", "valid"):
            if not source.path.manifest["splits"].get(split, {}).get("shards"):
                raise ConfigError(f"{key}: {source.path.where()} has no {split} shards")
    return sources, meta


def check_model(cfg: ExperimentConfig, sources, meta: dict[str, Any], world: int) -> ModelFacts:
    """The model, the objective and the evaluation as the run's start checks them, the
    model built on the meta device (its parameters counted, none allocated)."""
    from pipeline.models.registry import build_model
    from pipeline.objectives import build_objective

    model_cfg = model_config_for(cfg, meta["vocab_size"])
    check_positions(cfg, model_cfg)
    parallelize.check_compile(cfg.train)
    with torch.device("meta"):
        model = build_model(cfg.model.arch, model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = float(model.flops_per_token(cfg.data.seq_len))
    specials = {int(i) for i in meta.get("special_tokens", {}).values()}
    objective = build_objective(
        cfg.objective, meta["roles"], meta["vocab_size"], cfg.data.seq_len, specials
    )
    check_objective(cfg, objective, model, sources[0].path, meta)
    check_eval_split(cfg, sources, objective, world)
    return ModelFacts(model_cfg, n_params, flops_per_token, objective)


def plan_lines(plan: RunPlan, meta: dict[str, Any], sources, model: ModelFacts) -> list[str]:
    """The dry run's table of ``plan`` (a local train.out_dir too small for one
    checkpoint raises DiskFull here)."""
    from pipeline.loader.mixture import describe, shares

    cfg, world, ds = plan.cfg, plan.world, plan.ds_config
    stage, offload = plan.zero_stage, ds_engine.offloads_optimizer(ds)
    ops = ds_ops.plan_lines(
        offload, cfg.train.cpu_shm_allreduce, world, nvme=bool(ds_ops.nvme_sections(ds))
    )
    t = cfg.train
    global_batch = plan.global_batch
    tokens = global_batch * cfg.data.seq_len * t.max_steps
    data_tokens = sum(int(x.path.manifest["splits"]["train"]["n_tokens"]) for x in sources)
    if len(sources) == 1:
        data_line = f"{cfg.data.path}: {data_tokens:,} train tokens"
    else:
        mix = describe(shares(sources, model.objective, global_batch * t.max_steps))
        data_line = "\n".join([f"mixture of {len(sources)} sources:", *mix])
    n_params, flops_per_token = model.n_params, model.flops_per_token
    p, g, o = model_state_bytes(n_params, stage, world, t.precision, offload)
    space = check_out_dir_space(cfg, n_params, stage)
    mem = MemoryEstimate(p, g, o, activation_bytes(cfg, model.model_cfg))
    return [
        f"experiment      {cfg.name}  ({cfg.model.arch}, objective {cfg.objective.kind})",
        f"tokenizer       {meta['kind']} vocab {meta['vocab_size']:,}",
        f"data            {data_line}",
        f"world size      {world} (WORLD_SIZE; the launcher sets it)",
        f"global batch    {global_batch} = micro {t.micro_batch_size} x accum {t.grad_accum} "
        f"x ranks {world}  ({global_batch * cfg.data.seq_len:,} tokens at seq_len {cfg.data.seq_len})",
        f"steps           {t.max_steps:,}  (warmup {t.warmup_steps}, {t.schedule} decay, lr {t.lr:g})",
        f"tokens          {tokens:,}  (~{tokens / max(data_tokens, 1):.2f} passes over the data, "
        "upper bound: padding not counted)",
        f"parameters      {n_params:,}  ({flops_per_token / 1e6:.1f} MFLOP per token, "
        f"{flops_per_token * tokens:.3g} FLOP in total)",
        f"deepspeed       ZeRO-{stage}{' + CPU offload' if offload else ''}"
        f"{' (deepspeed: auto)' if plan.deepspeed_auto else ''}, precision "
        f"{t.precision}, clip {t.grad_clip}, activation checkpointing "
        f"{t.activation_checkpointing}",
        f"memory / rank   {mem.total / GiB:.3f} GiB = params {mem.params / GiB:.3f} + grads "
        f"{mem.grads / GiB:.3f} + optimizer {mem.optimizer / GiB:.3f} + activations ~"
        f"{mem.activations / GiB:.3f} (estimate; framework buffers not counted)",
        f"run dir         {t.out_dir}  (resume: {t.resume}; checkpoint every {t.save_every}"
        f"{space})",
        *(f"{'c++ ops' if i == 0 else '':<16}{x}" for i, x in enumerate(ops)),
    ]


def print_plan(cfg: ExperimentConfig) -> int:
    """``plm train --dry-run``: what the run's start checks, checked; its plan printed
    (``resolve_run``, on WORLD_SIZE ranks, the same resolution the trainer builds from)."""
    from pipeline.train.checkpoint import CheckpointManager

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sources, meta = open_data(cfg)
    ckpt = CheckpointManager(cfg.train.out_dir, 1, 0, world)
    plan = resolve_run(cfg, world, ckpt, sources[0].path.manifest.get("tokenizer", {}))
    model = check_model(plan.cfg, sources, meta, world)
    print("\n".join(plan_lines(plan, meta, sources, model)))
    print("dry run: config valid, nothing started")
    return 0
