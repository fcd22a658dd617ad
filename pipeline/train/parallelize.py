"""Everything the trainer applies to a model from outside its file, in one place (as
torchtitan's parallelize step): unpadded encoders, activation checkpointing, regional
``torch.compile``, and the CPU threads of each rank. Model files hold the math only;
what these act on is the model's ``repeated_layers()`` (pipeline/models/base.py)."""

from __future__ import annotations

import os

import torch

from pipeline.config import TrainSection
from pipeline.errors import ConfigError
from pipeline.models.base import PretrainModel


def apply(model: PretrainModel, train: TrainSection) -> None:
    """Set the model's switches from ``train:`` and compile its layers if asked."""
    model.set_unpad(unpad_wanted(train))
    model.set_activation_checkpointing(train.activation_checkpointing)
    if train.compile:
        check_compile(train)
        compile_layers(model)


def unpad_wanted(train: TrainSection) -> bool:
    """``train.unpad``, or where it is not set, whether the run is on the CPU: on a GPU
    the unpadded (nested-jagged) encoder is slower than the padded one (BENCHMARKS.md)."""
    return train.unpad if train.unpad is not None else not torch.cuda.is_available()


def check_compile(train: TrainSection) -> None:
    """``train.compile`` without a GPU needs a C++ compiler (inductor generates C++ for the
    CPU): a ConfigError now, not a traceback at the first step."""
    if not train.compile or torch.cuda.is_available():
        return
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler: none of the candidates runs
        raise ConfigError(
            f"train.compile=true: torch.compile on the CPU builds C++ and found no working "
            f"compiler ({str(err).splitlines()[0]}); install g++ (or set CXX to one) or set "
            "train.compile=false"
        ) from None


def compile_layers(model: PretrainModel) -> int:
    """``torch.compile`` each repeated layer in place (regional compilation: the layers
    share one code object, so one graph serves them all and compile time does not grow
    with depth; parameter names and checkpoints are unchanged). Returns how many."""
    layers = model.repeated_layers()
    for layer in layers:
        layer.compile(dynamic=None)  # sizes that change (unpadded N) become dynamic
    return len(layers)


def local_world_size() -> int:
    """Ranks on this machine: the `deepspeed` launcher's LOCAL_SIZE, torchrun's
    LOCAL_WORLD_SIZE, else 1."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(key, "").isdigit():
            return max(1, int(os.environ[key]))
    return 1


def set_cpu_threads() -> int | None:
    """Half the machine's CPUs, shared among its ranks: torch threads = CPUs // (2 x local
    ranks), at least one, unless the user set OMP_NUM_THREADS. A rank's OpenMP threads
    meet at a barrier in every op, so when other work takes the cores one descheduled
    thread stalls the others: one rank at torch's default (a thread per CPU) beside busy
    processes runs many times slower than with few threads, which give up little when
    the machine is idle (BENCHMARKS.md, "CPU threads"). On a machine with two hardware
    threads per core, half its CPUs is its cores, torch's own default there.
    Returns the thread count set, None when left as the user chose."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cpus or 1) // (2 * local_world_size()))
    torch.set_num_threads(threads)
    return threads
