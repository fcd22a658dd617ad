"""DeepSpeed's environment in plm's processes, and its CPU shared-memory all-reduce op.

**The accelerator.** Without ``DS_ACCELERATOR`` DeepSpeed probes for one when it is
imported and, finding no GPU, warns "Setting accelerator to CPU. If you have GPU or other
accelerator, we were unable to detect it." in every process. On a machine where torch sees
no CUDA device and no other accelerator's torch plugin is installed, plm sets
``DS_ACCELERATOR=cpu`` first (never over the user's own value), so the CPU is chosen
without the warning.

**The op.** DeepSpeed 0.19's TorchBackend (``deepspeed/comm/torch.py``, ``build_shm_op``)
JIT-compiles ``deepspeed_shm_comm`` with the system C++ compiler in
``deepspeed.init_distributed`` on the CPU accelerator, whenever
``deepspeed.ops.__compatible_ops__`` says the op can be built: without a word, the first
time (49 s on this project's 2-core machine under load 3, 2-8 min reported on busier
ones), with g++, ninja and the Python headers needed, and a long traceback without them. The op implements ``deepspeed.comm.inference_all_reduce`` only (AutoTP tensor-parallel
layers, which plm does not use): ZeRO's gradient reductions and plm's own all-reduces go
through ``torch.distributed`` (gloo) with or without it, and with it every rank also maps a
69 MB ``/dev/shm`` buffer. So plm leaves it out unless ``train.cpu_shm_allreduce`` is true,
and always at world size 1 (no peers). When it is asked for (several ranks, CPU):

- it is built into a per-venv cache, ``TORCH_EXTENSIONS_DIR`` (default
  ``<sys.prefix>/var/plm/torch_extensions``, unless the user set the variable; torch's own
  default, ``~/.cache/torch_extensions``, is shared by every venv of the user, which then
  rebuild each other's copy);
- a first build is announced with one ``plm:`` line (what it needs, how long it takes);
- a missing compiler, ninja or Python headers, or a failed build, gives one ``plm:`` line
  and the run goes on with plain gloo (no traceback);
- ``plm setup`` builds it ahead (Dockerfile.cpu runs it), so nothing compiles at run time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

OP_NAME = "deepspeed_shm_comm"
# Torch plugins of other accelerators DeepSpeed probes for (real_accelerator.py): with one
# installed, DeepSpeed's own detection decides.
_OTHER_ACCELERATORS = ("torch_npu", "torch_sdaa", "torch_mlu", "torch_supa", "torch_xmlir",
                       "habana_frameworks", "intel_extension_for_pytorch")  # fmt: skip


def default_extensions_dir() -> Path:
    """This venv's (this Python installation's) cache of JIT-built torch extensions."""
    return Path(sys.prefix) / "var" / "plm" / "torch_extensions"


def extensions_dir() -> Path:
    """Where torch builds and finds the extensions: TORCH_EXTENSIONS_DIR when set."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(configured) if configured else default_extensions_dir()


def _writable(path: Path) -> bool:
    """``path`` exists and is writable, or can be created."""
    for p in (path, *path.parents):
        if p.exists():
            return os.access(p, os.W_OK | os.X_OK) if p.is_dir() else False
    return False


def _cpu_only() -> bool:
    """No CUDA device, nor another accelerator's torch plugin: DeepSpeed would pick the CPU."""
    import torch

    if torch.cuda.is_available():
        return False
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return False
    if torch.backends.mps.is_available():
        return False
    return not any(importlib.util.find_spec(m) is not None for m in _OTHER_ACCELERATORS)


def configure_environment() -> None:
    """Before DeepSpeed is imported: DS_ACCELERATOR=cpu on a CPU-only machine, and the
    per-venv TORCH_EXTENSIONS_DIR. A variable the user set is left as it is; so are both
    when the venv's folder cannot be written (a read-only system Python: torch's per-user
    default stays). Idempotent; the ranks a launcher starts inherit the values."""
    if "DS_ACCELERATOR" not in os.environ and _cpu_only():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if "TORCH_EXTENSIONS_DIR" not in os.environ and _writable(default_extensions_dir()):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(default_extensions_dir())


def missing_build_tools() -> list[str]:
    """What torch's JIT build of a C++ op needs and this machine lacks (empty: nothing)."""
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
    if shutil.which(cxx) is None:
        how = f"CXX={cxx}" if "CXX" in os.environ else "c++ on PATH"
        missing.append(f"a C++ compiler ({how} not found; e.g. apt-get install g++)")
    if not is_ninja_available():
        missing.append("ninja (pip install ninja)")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        missing.append(
            f"the Python headers ({headers} not found; e.g. apt-get install python3-dev)"
        )
    return missing


def _builder():
    """DeepSpeed's builder of the op on this accelerator (None: it has none)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return None
    return get_accelerator().create_op_builder("ShareMemCommBuilder")


def _library(name: str) -> Path:
    return extensions_dir() / name / f"{name}.so"


def is_built() -> bool:
    return _library(OP_NAME).is_file()


def _say(msg: str, announce: bool) -> None:
    if announce:
        print(f"plm: {msg}", file=sys.stderr, flush=True)


def _build(builder, announce: bool) -> float:
    """Build (or load the cached build of) the op in this process; seconds it took."""
    if not is_built():
        _say(
            "building DeepSpeed's CPU shared-memory all-reduce op once for this venv (needs "
            "g++ and Python headers, about 1-8 min); it is cached in "
            f"{extensions_dir()} (`plm setup` builds it ahead of time)",
            announce,
        )
    t0 = time.perf_counter()
    builder.load(verbose=False)
    return time.perf_counter() - t0


def prepare_shm_op(wanted: bool, world_size: int, announce: bool) -> bool:
    """Before ``deepspeed.init_distributed``: whether DeepSpeed gets its CPU shared-memory
    all-reduce op. False: ``__compatible_ops__`` says it cannot be built, so DeepSpeed
    neither builds nor loads it and all-reduces go through gloo. True: it is built (into
    the per-venv cache, announced the first time) and loaded here, so DeepSpeed's own
    ``build_shm_op`` finds it loaded. ``announce``: this process prints the plm: lines
    (one per machine: local rank 0)."""
    builder = _builder()
    if builder is None:
        return False
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__  # a module-level dict DeepSpeed reads
    if not wanted or world_size <= 1 or not compatible.get(builder.NAME, False):
        compatible[builder.NAME] = False
        return False
    missing = missing_build_tools()
    if missing:  # torch's load checks the compiler even when the op is built
        compatible[builder.NAME] = False
        _say(
            "DeepSpeed's CPU shared-memory all-reduce op (train.cpu_shm_allreduce=true) "
            f"cannot be built here: missing {'; '.join(missing)}. Training goes on with "
            "plain gloo all-reduces; install them and run `plm setup`, or set "
            "train.cpu_shm_allreduce=false",
            announce,
        )
        return False
    try:
        _build(builder, announce)
    except Exception as err:  # a compile or load error: gloo does the same job
        compatible[builder.NAME] = False
        first = next((x for x in str(err).splitlines() if x.strip()), type(err).__name__)
        _say(
            f"DeepSpeed's CPU shared-memory all-reduce op could not be built or loaded "
            f"({type(err).__name__}: {first[:300]}); training goes on with plain gloo "
            f"all-reduces. `plm setup` shows the whole build error",
            announce,
        )
        return False
    return True


def setup(verbose: bool = False) -> int:
    """``plm setup``: build DeepSpeed's CPU ops that plm may JIT-compile into this venv's
    cache now (at install or image build time), so no run compiles; exit 0 when built."""
    configure_environment()
    builder = _builder()
    where = extensions_dir()
    if builder is None:
        print("plm setup: nothing to build: DeepSpeed's accelerator here is not the CPU "
              "(the shared-memory all-reduce op is a CPU op)")  # fmt: skip
        return 0
    if where != default_extensions_dir() and "TORCH_EXTENSIONS_DIR" in os.environ:
        print(f"plm setup: extension cache {where} (TORCH_EXTENSIONS_DIR)")
    else:
        print(f"plm setup: extension cache {where} (this venv's)")
    missing = missing_build_tools()
    if missing:  # torch's load checks the compiler even when the op is built
        print(f"plm: setup: cannot build DeepSpeed's CPU shared-memory all-reduce op: missing "
              f"{'; '.join(missing)}", file=sys.stderr)  # fmt: skip
        return 2
    already = is_built()
    try:
        if verbose:
            builder.load(verbose=True)
            seconds = 0.0
        else:
            seconds = _build(builder, announce=True)
    except Exception as err:
        print(f"plm: setup: building DeepSpeed's CPU shared-memory all-reduce op failed: "
              f"{type(err).__name__}: {err}", file=sys.stderr)  # fmt: skip
        return 2
    state = "up to date" if already else f"built in {seconds:.0f} s"
    print(f"plm setup: DeepSpeed's CPU shared-memory all-reduce op ({OP_NAME}) {state}: "
          f"{_library(OP_NAME)}")  # fmt: skip
    return 0
