"""One resolution of a run: the experiment config as this world and the checkpoint it
resumes make it (``resolve_run``). ``plm train --dry-run`` prints the plan; the trainer
builds from it. What needs the process group (the universal conversion of a resume on
another world size) is the trainer's.

What it resolves, in order: ``train.global_batch`` into grad_accum for this world;
``deepspeed: auto`` into a ZeRO stage (the checkpoint's when there is one to resume);
the checkpoint ``train.resume: auto`` will load, refused when no conversion bridges it
(``check_checkpoint``), and, written by another number of ranks, the grad_accum that
keeps its global batch; then the DeepSpeed config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import ExperimentConfig, with_global_batch
from pipeline.errors import ConfigError
from pipeline.train import engine as ds_engine


@dataclass(frozen=True)
class ElasticResume:
    """A resume from a checkpoint written by another number of ranks."""

    tag: str
    where: str  # the checkpoint as messages name it (a folder or a URI)
    saved_world: int
    stage: int  # its ZeRO stage, and this run's (check_checkpoint)
    grad_accum: tuple[int, int]  # the checkpoint's -> this run's
    config_grad_accum: int  # what the config gives on this world, before the resume
    global_batch: int  # the checkpoint's, kept
    convert_s: float = 0.0  # the universal conversion's seconds, once the trainer ran it

    @property
    def universal(self) -> bool:
        """ZeRO 1-3 state is partitioned by rank: it loads through a universal conversion."""
        return self.stage > 0


@dataclass(frozen=True)
class RunPlan:
    """What a run is, resolved once (``resolve_run``). ``ds_config`` is shared: a caller
    that changes it copies it first."""

    cfg: ExperimentConfig  # grad_accum for this world and resume, deepspeed a concrete file
    world: int
    ds_config: dict[str, Any]
    deepspeed_auto: bool  # the config said `deepspeed: auto`
    resume_tag: str | None  # the checkpoint train.resume: auto loads; None: a fresh start
    elastic: ElasticResume | None = None

    @property
    def global_batch(self) -> int:
        t = self.cfg.train
        return t.micro_batch_size * t.grad_accum * self.world

    @property
    def zero_stage(self) -> int:
        return ds_engine.zero_stage(self.ds_config)

    def batch_meta(self) -> dict[str, int]:
        """What each checkpoint's COMPLETE records of the batch and the ZeRO stage (what a
        resume on another world size keeps, or refuses)."""
        t = self.cfg.train
        return {"micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum,
                "global_batch": self.global_batch, "zero_stage": self.zero_stage}  # fmt: skip


def resolve_run(cfg: ExperimentConfig, world: int, ckpt, tokenizer: dict[str, Any]) -> RunPlan:
    """The run of ``cfg`` on ``world`` ranks. ``ckpt``: train.out_dir's checkpoints (a
    ``CheckpointManager``: ``latest``, ``meta``, ``where``, ``root``); ``tokenizer``: the
    data's (its manifest's "tokenizer"). ConfigError for what the run would refuse."""
    auto = cfg.deepspeed == ds_engine.AUTO
    cfg = with_global_batch(cfg, world)
    tag = ckpt.latest() if cfg.train.resume == "auto" else None
    meta = ckpt.meta(tag) if tag is not None else None
    saved_stage = meta.get("zero_stage") if meta is not None and auto else None
    cfg = ds_engine.resolve_auto(cfg, world, saved_stage)
    elastic = None
    if tag is not None:
        check_checkpoint(cfg, ckpt, tag, meta, tokenizer)
        cfg, elastic = resolve_elastic(cfg, world, tag, meta, ckpt.where(tag))
    ds_config = ds_engine.build_ds_config(cfg, world)
    return RunPlan(cfg, world, ds_config, auto, tag, elastic)


def resolve_elastic(
    cfg: ExperimentConfig, world: int, tag: str, meta: dict[str, Any], where: str
) -> tuple[ExperimentConfig, ElasticResume | None]:
    """Resuming checkpoint ``tag`` (its COMPLETE ``meta``) written by another number of
    ranks: the config with grad_accum set so the global batch stays the checkpoint's (or a
    ConfigError giving the override to pass). (cfg, None) on the same world size."""
    t = cfg.train
    saved_world = int(meta["world_size"])
    if saved_world == world:
        return cfg, None
    ga_saved = int(meta.get("grad_accum", t.grad_accum))
    micro_saved = int(meta.get("micro_batch_size", t.micro_batch_size))
    global_batch = int(meta.get("global_batch", micro_saved * ga_saved * saved_world))
    ga = t.grad_accum
    if t.micro_batch_size * t.grad_accum * world != global_batch:
        per_step = t.micro_batch_size * world
        if global_batch % per_step:
            raise ConfigError(
                f"train.resume=auto: checkpoint {where} was written by {saved_world} ranks "
                f"with a global batch of {global_batch} ({micro_saved} x {ga_saved} x "
                f"{saved_world}); with {world} ranks and train.micro_batch_size="
                f"{t.micro_batch_size} it cannot be kept by grad_accum alone: "
                + _batch_hint(global_batch, world, micro_saved, t.micro_batch_size)
            )
        ga = global_batch // per_step
    stage = ds_engine.zero_stage(ds_engine.load_base_config(cfg.deepspeed)[0])
    elastic = ElasticResume(tag, where, saved_world, stage, (ga_saved, ga), t.grad_accum,
                            global_batch)  # fmt: skip
    if ga != t.grad_accum:
        cfg = cfg.model_copy(update={"train": t.model_copy(update={"grad_accum": ga})})
    return cfg, elastic


def _batch_hint(global_batch: int, world: int, micro_saved: int, micro: int) -> str:
    """The override that keeps ``global_batch`` on ``world`` ranks, or why none does."""
    if global_batch % world:
        return (f"a global batch of {global_batch} cannot be split over {world} ranks: "
                "resume on a number of ranks that divides it")  # fmt: skip
    per_rank = global_batch // world
    fits = next(m for m in (micro_saved, *range(micro, 0, -1)) if per_rank % m == 0)
    return (f"pass train.micro_batch_size={fits} train.grad_accum={per_rank // fits} (any "
            f"micro_batch_size x grad_accum = {per_rank} will do)")  # fmt: skip


def where_data(cfg: ExperimentConfig) -> str:
    """``data.path=DIR`` or the mixture's dirs, as a user would write them."""
    if cfg.data.sources is None:
        return f"data.path={cfg.data.path}"
    return "data.sources " + ", ".join(s.path for s in cfg.data.sources)


def check_checkpoint(
    cfg: ExperimentConfig, ckpt, tag: str, meta: dict[str, Any], tokenizer: dict[str, Any]
) -> None:
    """What no conversion can bridge, refused before anything is built (and by
    ``--dry-run``): a checkpoint of another tokenizer (its embeddings have another shape
    or meaning) or of another ZeRO stage. ConfigError naming the checkpoint and the
    override that resumes it. ``tokenizer``: the data's (the manifest's "tokenizer")."""
    where = ckpt.root / tag
    fresh = "or pass a new train.out_dir to start a new run"
    saved_tok = meta.get("tokenizer_fingerprint")
    tok = tokenizer
    if saved_tok and tok.get("fingerprint") and saved_tok != tok["fingerprint"]:
        raise ConfigError(
            f"train.resume=auto: checkpoint {where} was trained on data of another "
            f"tokenizer (vocab {meta.get('vocab_size', '?')}, sha256 {saved_tok[:12]}) than "
            f"{where_data(cfg)} (vocab {tok.get('vocab_size', '?')}, sha256 "
            f"{tok['fingerprint'][:12]}): point data.path at data prepared with the "
            f"checkpoint's tokenizer, {fresh}"
        )
    saved_stage = meta.get("zero_stage")
    stage = ds_engine.zero_stage(ds_engine.load_base_config(cfg.deepspeed)[0])
    if saved_stage is not None and int(saved_stage) != stage:
        raise ConfigError(
            f"train.resume=auto: checkpoint {where} was written under ZeRO-{saved_stage} "
            f"and this run's deepspeed config is ZeRO-{stage}; a checkpoint resumes under "
            f"its own stage (on any number of ranks): pass "
            f"deepspeed=configs/deepspeed/zero{saved_stage}.json, {fresh}"
        )
