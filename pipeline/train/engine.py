"""The DeepSpeed config, built from a base JSON (configs/deepspeed/) and the experiment config.

The JSON files hold the ZeRO settings; batch sizes, optimizer, clipping and precision
come from the experiment's ``train:`` section, so they are set in one place. Every
DeepSpeed default we rely on is written out explicitly (defaults change between
releases, e.g. ``gradient_clipping`` in 0.19.3).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pipeline.config import ExperimentConfig, config_file
from pipeline.errors import ConfigError
from pipeline.train import ds_ops, rendezvous

# Before anything imports DeepSpeed: DS_ACCELERATOR=cpu on a CPU-only machine (no
# "Setting accelerator to CPU" warning) and the per-venv extension cache (ds_ops).
ds_ops.configure_environment()

# Keys the experiment config owns. A base JSON may leave them out or set them to "auto";
# a concrete value that disagrees with the experiment config is an error, not a silent pick.
OWNED_KEYS = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
)
# Defaults we depend on, written out so a DeepSpeed upgrade cannot change them under us.
EXPLICIT_DEFAULTS = {
    "steps_per_print": 1_000_000_000,  # we log ourselves
    "wall_clock_breakdown": False,
    "zero_allow_untested_optimizer": True,
    "dump_state": False,
}


# Every top-level key DeepSpeed 0.19 reads (its config parser, plus the sections other
# modules read: activation checkpointing, AIO, autotuning, the flops profiler). A key
# outside it would be ignored without a word (`zero_optimisation` trains at ZeRO 0), so it
# is refused. tests/unit/test_train_engine.py checks the list against the parser.
DEEPSPEED_KEYS = frozenset(
    """activation_checkpointing aio amp autotuning bf16 bfloat16 checkpoint comet
    comms_logger communication_data_type compile compression_training csv_monitor
    curriculum_learning data_efficiency data_types dataloader_drop_last datastates_ckpt
    disable_allgather disable_python_gc dump_state eigenvalue elasticity expert_parallel
    flops_profiler fp16 gradient_accumulation_steps gradient_allreduce_op gradient_clipping
    gradient_predivide_factor graph_harvesting hybrid_engine log_level
    managed_gradient_accumulation memory_breakdown nebula optimizer pipeline
    prescale_gradients progressive_layer_drop quantize_training scheduler
    seq_parallel_communication_data_type sequence_parallel_size sparse_attention sparse_gradients steps_per_print
    tensor_parallel tensorboard timers torch_autocast train_batch_size
    train_micro_batch_size_per_gpu use_data_before_expert_parallelism vocabulary_size
    wall_clock_breakdown wandb weight_quantization zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer zero_optimization""".split()
)


def check_top_level_keys(base: dict[str, Any], source: str) -> None:
    """A top-level key DeepSpeed does not know: ConfigError naming it (and the nearest
    known one). Keys starting with "_" are comments."""
    import difflib

    for key in base:
        if key.startswith("_") or key in DEEPSPEED_KEYS:
            continue
        near = difflib.get_close_matches(key, sorted(DEEPSPEED_KEYS), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(
            f"{source}: unknown top-level key '{key}', which DeepSpeed would silently ignore; "
            f"{hint}fix its spelling or remove it (keys starting with _ are comments)"
        )


def load_base_config(spec: str | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The experiment's ``deepspeed:`` entry: a JSON path (relative to cwd or repo) or a mapping."""
    if isinstance(spec, dict):
        return copy.deepcopy(spec), "deepspeed (inline)"
    if spec == AUTO:
        raise AssertionError("deepspeed: auto must be resolved first (resolve_auto)")
    path = config_file(spec)
    if not path.is_file():
        raise ConfigError(
            f"key 'deepspeed': file {spec} does not exist (see configs/deepspeed/)",
            machine_wide=True,
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed config {path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"deepspeed config {path} must hold a JSON object")
    return raw, str(path)


# ``deepspeed: auto`` (the default): ZeRO-0 on one rank, ZeRO-2 on more. ZeRO 1-2 shard the
# optimizer state and gradients over the ranks; on one rank there is nothing to shard and
# they only add a second fp32 copy of the weights and their buckets
# (`bench/bench_zero_memory.py --ranks 1 --stages 0,2`).
AUTO = "auto"


def resolve_auto(cfg: Any, world_size: int, saved_stage: int | None = None) -> Any:
    """``cfg`` (any config with a ``deepspeed`` field) with ``deepspeed: auto`` replaced by
    ``configs/deepspeed/zero<N>.json``: ZeRO-0 on one rank, ZeRO-2 on more, or the stage of
    the checkpoint being resumed (``saved_stage``: a checkpoint resumes under its own stage,
    on any number of ranks). Any other value is returned unchanged."""
    if cfg.deepspeed != AUTO:
        return cfg
    if saved_stage is not None:
        stage = int(saved_stage)
    else:
        stage = 0 if world_size == 1 else 2
    return cfg.model_copy(update={"deepspeed": f"configs/deepspeed/zero{stage}.json"})


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device in ("cpu", "nvme")


def build_ds_config(cfg: ExperimentConfig, world_size: int) -> dict[str, Any]:
    """The full DeepSpeed config for ``world_size`` data-parallel ranks (``deepspeed: auto``
    by the world size; the trainer resolves it first when it resumes a checkpoint)."""
    base, source = load_base_config(resolve_auto(cfg, world_size).deepspeed)
    check_top_level_keys(base, source)
    t = cfg.train
    wanted: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
    }
    for key, value in wanted.items():
        if key in base and base[key] not in ("auto", value):
            raise ConfigError(
                f"{source}: '{key}' is {base[key]!r} but the experiment config gives {value!r}; "
                f"remove it from the JSON (train.* sets it)"
            )
    for key in ("optimizer", "scheduler", "fp16", "bf16"):
        if key in base:
            raise ConfigError(
                f"{source}: remove '{key}'; it comes from the experiment's train: section "
                "(train.lr/betas/weight_decay/precision/schedule)"
            )
    base = {k: v for k, v in base.items() if not k.startswith("_")}  # "_comment" keys
    ds = {**EXPLICIT_DEFAULTS, **base, **wanted}
    ds["fp16"] = {"enabled": t.precision == "fp16", "initial_scale_power": 16}
    ds["bf16"] = {"enabled": t.precision == "bf16"}
    params: dict[str, Any] = {
        "lr": t.lr,
        "betas": list(t.betas),
        "eps": t.eps,
        "weight_decay": t.weight_decay,
    }
    if offloads_optimizer(ds):
        # DeepSpeedCPUAdam: a C++ op, built once per venv (prepare_ops, ds_ops.CPU_ADAM).
        params["adam_w_mode"] = True
    else:
        params["torch_adam"] = True
        # One kernel for all parameters, on the GPU and on the CPU (torch's fused CPU AdamW:
        # 0.07 vs 0.29-0.46 CPU s a step for bert-base's parameters on one thread).
        params["fused"] = True
    ds["optimizer"] = {"type": "AdamW", "params": params}
    ds.setdefault("zero_optimization", {"stage": 0})
    if t.precision == "bf16" and zero_stage(ds) == 0:
        # ZeRO-0 keeps the whole model on every rank: fp32 weights under torch autocast,
        # as a plain PyTorch loop does, and torch's fused AdamW steps them directly.
        # DeepSpeed's bf16 wrapper (BF16_Optimizer) walks every parameter in Python on
        # each step: CPU time as long as a small model's whole step (BENCHMARKS.md, GPU
        # bench).
        ds["bf16"] = {"enabled": False}
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    ds_ops.resolve_nvme_paths(ds, source)  # ${PLM_NVME_PATH} (configs/deepspeed/zero3-nvme.json)
    validate_ds_config(ds, source)
    return ds


def validate_ds_config(ds: dict[str, Any], source: str) -> None:
    """Check the ZeRO section with DeepSpeed's own (strict) pydantic model, without starting it."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    stage = zero_stage(ds)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{source}: zero_optimization.stage must be 0-3, got {stage}")
    try:
        DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))
    except Exception as err:  # pydantic ValidationError, with the key in its text
        raise ConfigError(f"{source}: invalid zero_optimization: {err}") from None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, LayerNorm weights and other 1-D tensors."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    """Single process without a launcher: the env a launcher would set (world size 1).

    Under ``deepspeed`` or a torchrun-style env (Kubernetes) the variables exist already.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def init_distributed(cpu_shm_allreduce: bool = False, timeout: timedelta | None = None) -> None:
    """DeepSpeed's process group (a second call finds it in place).

    The group is created first by ``rendezvous.init_process_group``, its store and gloo
    listening on this host's address only (not every interface, as torch's ``env://``
    rendezvous does; one rank: on ``ensure_dist_env``'s loopback address); DeepSpeed then
    finds it in place and wraps it.

    ``cpu_shm_allreduce``: give DeepSpeed its CPU shared-memory all-reduce op when several
    ranks run on the CPU (built once per venv, announced; see ds_ops); otherwise DeepSpeed
    neither builds nor loads it. ``timeout``: how long the ranks wait for one another, at
    the rendezvous and in each collective; by default DeepSpeed's (DEEPSPEED_TIMEOUT
    minutes, 10 when unset)."""
    deepspeed = ds_ops.import_deepspeed()
    from deepspeed.constants import default_pg_timeout

    ensure_dist_env()
    timeout = default_pg_timeout if timeout is None else timeout
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shm = ds_ops.prepare_shm_op(
        cpu_shm_allreduce,
        int(os.environ["WORLD_SIZE"]),
        announce=int(os.environ.get("LOCAL_RANK", "0")) == 0,
    )
    if not torch.distributed.is_initialized():
        rendezvous.init_process_group(backend, timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    if shm or not torch.cuda.is_available():  # (the op may come from elsewhere too)
        _unlink_shm_allreduce_buffer()


def leave_process_group() -> None:
    """The end of a finished run, on every rank: wait for the others, then take the process
    group down. A rank that exits while a peer still works (rank 0 logging to MLflow) and
    leaves it up can abort in gloo's teardown ("terminate called without an active
    exception", exit -6: seen on the rehearsal cluster)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _unlink_shm_allreduce_buffer() -> None:
    """Unlink this rank's /dev/shm buffer of DeepSpeed's CPU all-reduce.

    DeepSpeed (0.19, csrc/cpu/comm/shm.cpp) maps one 69 MB file per rank when all ranks
    share a machine, named after the uid, MASTER_ADDR, MASTER_PORT and rank, and never
    unlinks it: every CPU run left them in RAM-backed /dev/shm (15 GB here after two
    days of test runs). Init returns only once a rank has mapped every rank's file, so
    after a barrier each rank unlinks its own: the mappings stay valid, and the memory
    is freed when the processes exit, even when they are killed.
    """
    import torch.distributed as dist

    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], dist.get_rank()
    )
    dist.barrier()
    (Path("/dev/shm") / name).unlink(missing_ok=True)


def prepare_ops(ds_config: dict[str, Any]) -> None:
    """Before ``deepspeed.initialize``: the checks and C++ ops its config needs. The
    precision must suit the accelerator; an offloaded optimizer gets DeepSpeed's CPU Adam
    op, built once per venv (announced by each machine's local rank 0) or a ConfigError
    saying what is missing, instead of DeepSpeed's silent JIT build or its traceback."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for precision in ("fp16", "bf16"):
        supported = getattr(accelerator, f"is_{precision}_supported")()
        if ds_config.get(precision, {}).get("enabled") and not supported:
            raise ConfigError(
                f"train.precision={precision}: the {accelerator.device_name()} accelerator "
                f"here does not support {precision}; use train.precision=bf16 or fp32"
            )
    announce = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if offloads_optimizer(ds_config):
        ds_ops.prepare_cpu_adam(announce=announce)
    ds_ops.prepare_aio(ds_config, announce=announce)  # offload to a disk: its folder, the op


def partitioned_build(ds_config: dict[str, Any]) -> contextlib.AbstractContextManager:
    """Where the model is built. Under ZeRO-3, ``deepspeed.zero.Init``: each parameter is
    partitioned over the ranks as soon as its module is created (the init of
    pipeline/models/blocks.py sees each module's own parameters whole, one module at a
    time), so no rank ever holds the whole model. Below ZeRO-3 every rank holds it anyway:
    nothing to do."""
    if zero_stage(ds_config) != 3:
        return contextlib.nullcontext()
    # Parameters swapped to a disk are swapped from here on: its folder, DeepSpeed's op.
    ds_ops.prepare_aio(ds_config, announce=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=ds_config)


def initialize(model: torch.nn.Module, ds_config: dict[str, Any], scheduler_factory):
    """``deepspeed.initialize`` with our param groups and LambdaLR; returns the engine."""
    import deepspeed

    prepare_ops(ds_config)
    wd = ds_config["optimizer"]["params"]["weight_decay"]
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, wd),
        lr_scheduler=scheduler_factory,
        config=ds_config,
        dist_init_required=False,
    )
    record_grad_norm(engine)
    return engine


def record_grad_norm(engine) -> None:
    """Make ``engine.get_global_grad_norm()`` the step's gradient norm in every setup.

    DeepSpeed's own optimizers (ZeRO 1-3, its fp16 wrappers) record it. Under ZeRO-0 in
    fp32 or bf16 (autocast) the optimizer is torch's, and DeepSpeed clips the gradients
    (``clip_fp32_gradients``) without keeping the norm it computed: the norm read None,
    logged as 0. Here its clipping is replaced by torch's ``clip_grad_norm_`` (the same
    on every rank: ZeRO-0 has all-reduced the gradients), which also keeps the norm, so
    gradients are still clipped exactly once; with
    ``gradient_clipping`` 0 DeepSpeed does not clip, and the norm is computed before the
    update without clipping."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return

    def clip_and_record() -> None:
        # torch's clipping, with foreach kernels and no host read (DeepSpeed's loops over
        # the parameters in Python and reads the norm on the host); no model parallelism
        # here, so the norm over this rank's (all-reduced) gradients is the global one
        engine._global_grad_norm = torch.nn.utils.clip_grad_norm_(
            engine.module.parameters(), engine.gradient_clipping(), foreach=True
        )

    engine.clip_fp32_gradients = clip_and_record
    if engine.gradient_clipping() > 0.0:
        return
    take_model_step = engine._take_model_step

    def record_then_step(*args, **kwargs):
        grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
        engine._global_grad_norm = (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if grads
            else torch.zeros(())
        )
        return take_model_step(*args, **kwargs)

    engine._take_model_step = record_then_step
