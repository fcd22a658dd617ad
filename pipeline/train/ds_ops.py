"""DeepSpeed's environment in plm's processes, and the C++ ops DeepSpeed JIT-compiles.

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
time (a build of minutes), with g++, ninja and the Python headers needed, and a long
traceback without them. The op implements ``deepspeed.comm.inference_all_reduce`` only
(AutoTP tensor-parallel layers, which plm does not use): ZeRO's gradient reductions and
plm's own all-reduces go through ``torch.distributed`` (gloo) with or without it, and with
it every rank also maps a 69 MB ``/dev/shm`` buffer. So plm leaves it out unless ``train.cpu_shm_allreduce`` is true,
and always at world size 1 (no peers). When it is asked for (several ranks, CPU):

- it is built into a per-venv cache, ``TORCH_EXTENSIONS_DIR`` (default
  ``<sys.prefix>/var/plm/torch_extensions``, unless the user set the variable; torch's own
  default, ``~/.cache/torch_extensions``, is shared by every venv of the user, which then
  rebuild each other's copy);
- a first build is announced with one ``plm:`` line (what it needs, how long it takes);
- a missing compiler, ninja or Python headers, or a failed build, gives one ``plm:`` line
  and the run goes on with plain gloo (no traceback);
- ``plm setup`` builds it ahead (Dockerfile.cpu runs it), so nothing compiles at run time.

**CPU Adam.** With ``zero_optimization.offload_optimizer`` (configs/deepspeed/zero3-offload.json)
DeepSpeed's optimizer is ``DeepSpeedCPUAdam``, whose op ``cpu_adam`` DeepSpeed JIT-compiles
in ``deepspeed.initialize`` (minutes of CPU).
There is no fallback (ZeRO-Offload refuses other optimizers), so plm builds it itself just
before: into the same per-venv cache, announced with one ``plm:`` line the first time; a
missing compiler or Python headers, or a failed build, is a ConfigError (one ``plm:`` line
with the fix, exit 2), and ``--dry-run`` says the same, or that the run would build it.
``plm setup`` builds it too.

An op already in the cache loads without the build tools: torch's load then only warns that
the compiler is missing, and that warning is kept out.

**The allocator.** glibc's malloc serves a block above its mmap threshold (128 KiB at
first) by mmap, and returns it to the system when it is freed; but each such free raises
the threshold to the block's size (up to 32 MiB), so the many-MiB tensors a rank frees
after that (the whole-size tensors of ZeRO-3's partitioned build, the copies DeepSpeed
flattens) stay in the heap as free space the rank never gives back. plm fixes the
threshold at 64 KiB (``mallopt(M_MMAP_THRESHOLD)``, which also turns the raising off)
where glibc is the allocator, unless the user set ``MALLOC_MMAP_THRESHOLD_``
(docs/training.md has the measurements).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError

# Torch plugins of other accelerators DeepSpeed probes for (real_accelerator.py): with one
# installed, DeepSpeed's own detection decides.
_OTHER_ACCELERATORS = ("torch_npu", "torch_sdaa", "torch_mlu", "torch_supa", "torch_xmlir",
                       "habana_frameworks", "intel_extension_for_pytorch")  # fmt: skip


def default_extensions_dir() -> Path:
    """This venv's (this Python installation's) cache of JIT-built torch extensions."""
    return Path(sys.prefix) / "var" / "plm" / "torch_extensions"


def extensions_dir() -> Path:
    """Where torch builds and finds the extensions: TORCH_EXTENSIONS_DIR when set, else
    this venv's cache (configure_environment sets the variable to it), else, in a venv that
    cannot be written (an image's, for another user), torch's per-user default, as
    ``torch.utils.cpp_extension._get_build_directory`` names it."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    if _writable(default_extensions_dir()):
        return default_extensions_dir()
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


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
    per-venv TORCH_EXTENSIONS_DIR. A variable the user set is left as it is; so is
    TORCH_EXTENSIONS_DIR when the venv's folder cannot be written (a read-only system
    Python: torch's per-user default stays). Idempotent; the ranks a launcher starts
    inherit the values."""
    if "DS_ACCELERATOR" not in os.environ and _cpu_only():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if "TORCH_EXTENSIONS_DIR" not in os.environ and _writable(default_extensions_dir()):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(default_extensions_dir())


M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 * 1024


def configure_allocator() -> bool:
    """Fix glibc's mmap threshold at 64 KiB in this process (the allocator paragraph
    above); every `plm` command does, first. True when set; False where the allocator is
    not glibc's, or the user set MALLOC_MMAP_THRESHOLD_ (glibc read it at start-up)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def import_deepspeed():
    """``import deepspeed``, without letting it import MLflow.

    DeepSpeed's autotuner (imported by ``deepspeed/__init__``) imports ``mlflow`` when it
    can, for its own experiment logging, which plm never runs: most of DeepSpeed's import
    time, spent before the first step. The tracker imports
    MLflow itself, in the background (``tracking.Tracker.prepare``). Only the autotuner's
    ``has_mlflow`` flag sees the difference."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError meanwhile
        try:
            import deepspeed  # noqa: F401
        finally:
            del sys.modules["mlflow"]
    import deepspeed

    return deepspeed


@dataclass(frozen=True)
class Op:
    """A C++ op DeepSpeed JIT-compiles, as plm builds and names it."""

    builder: str  # DeepSpeed's OpBuilder class
    name: str  # the extension's name: its folder in the cache
    what: str  # for the plm: lines
    minutes: str  # how long a first build takes (the announcement)
    cpu_only: bool  # only the CPU accelerator has (and uses) it
    needs: tuple[str, ...] = ()  # other extensions its builder builds and loads first


SHM = Op("ShareMemCommBuilder", "deepspeed_shm_comm",
         "DeepSpeed's CPU shared-memory all-reduce op", "1-8", cpu_only=True)  # fmt: skip
CPU_ADAM = Op("CPUAdamBuilder", "cpu_adam", "DeepSpeed's CPU Adam op", "2-5", cpu_only=False)
# ZeRO-Infinity's swapper (offload to nvme); its builder loads pin_memory (page-locked
# buffers) first. Needs libaio's headers and library (Debian: libaio-dev).
AIO = Op("AsyncIOBuilder", "async_io", "DeepSpeed's async I/O op (libaio)", "3-15",
         cpu_only=False, needs=("pin_memory",))  # fmt: skip
OPS = (CPU_ADAM, SHM, AIO)


class OpUnavailable(Exception):
    """An op that is neither installed nor cached and cannot be built here (the message
    says what is missing), or whose build or load failed."""


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


def _builder(op: Op):
    """DeepSpeed's builder of ``op`` on this accelerator (None: it has none)."""
    from deepspeed.accelerator import get_accelerator

    if op.cpu_only and get_accelerator().device_name() != "cpu":
        return None
    return get_accelerator().create_op_builder(op.builder)


def _library(op: Op) -> Path:
    return extensions_dir() / op.name / f"{op.name}.so"


def _installed(op: Op) -> bool:
    """Compiled into DeepSpeed's own install (``DS_BUILD_*=1 pip install deepspeed``)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(op.name)) and accelerator_name == get_accelerator()._name


def is_built(op: Op = SHM) -> bool:
    """Loadable without compiling: installed with DeepSpeed, or in the extension cache
    (with the extensions it needs)."""
    if _installed(op):
        return True
    return all((extensions_dir() / n / f"{n}.so").is_file() for n in (op.name, *op.needs))


def _say(msg: str, announce: bool) -> None:
    if announce:
        print(f"plm: {msg}", file=sys.stderr, flush=True)


def _load(op: Op, builder, announce: bool, verbose: bool = False) -> float:
    """Load ``op`` in this process, building it into the cache first when needed (announced
    with one plm: line); seconds it took. OpUnavailable: it cannot be built here, or the
    build or load failed. Once loaded, DeepSpeed's own ``load()`` of the op returns it."""
    cached = is_built(op)
    missing = [] if cached else missing_build_tools()
    if op is AIO and not cached and not missing and not builder.is_compatible():
        missing = ["libaio's headers and library (e.g. apt-get install libaio-dev)"]
    if missing:
        raise OpUnavailable(f"missing {'; '.join(missing)}")
    if not cached:
        _say(
            f"building {op.what} ({op.name}) once for this venv (needs g++ and Python "
            f"headers, about {op.minutes} min); it is cached in {extensions_dir()} "
            "(`plm setup` builds it ahead of time)",
            announce,
        )
    # A cached op on a machine without the compiler: torch's load warns about it
    # (ten lines), though nothing is compiled.
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    if cached and not verbose:
        quiet.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        builder.load(verbose=verbose)
    except Exception as err:  # a compile or load error
        first = next((x for x in str(err).splitlines() if x.strip()), type(err).__name__)
        raise OpUnavailable(
            f"its build or load failed ({type(err).__name__}: {first[:300]}); "
            "`plm setup -v` shows the whole build"
        ) from err
    finally:
        quiet.setLevel(level)
    return time.perf_counter() - t0


def prepare_shm_op(wanted: bool, world_size: int, announce: bool) -> bool:
    """Before ``deepspeed.init_distributed``: whether DeepSpeed gets its CPU shared-memory
    all-reduce op. False: ``__compatible_ops__`` says it cannot be built, so DeepSpeed
    neither builds nor loads it and all-reduces go through gloo. True: it is built (into
    the per-venv cache, announced the first time) and loaded here, so DeepSpeed's own
    ``build_shm_op`` finds it loaded. ``announce``: this process prints the plm: lines
    (one per machine: local rank 0)."""
    builder = _builder(SHM)
    if builder is None:
        return False
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__  # a module-level dict DeepSpeed reads
    if not wanted or world_size <= 1 or not compatible.get(builder.NAME, False):
        compatible[builder.NAME] = False
        return False
    try:
        _load(SHM, builder, announce)
    except OpUnavailable as err:  # gloo does the same job
        compatible[builder.NAME] = False
        _say(
            f"{SHM.what} (train.cpu_shm_allreduce=true) cannot be built here: {err}. "
            "Training goes on with plain gloo all-reduces; fix that and run `plm setup`, "
            "or set train.cpu_shm_allreduce=false",
            announce,
        )
        return False
    return True


def _cpu_adam_unavailable(reason: OpUnavailable | str) -> ConfigError:
    return ConfigError(
        f"{CPU_ADAM.what} ({CPU_ADAM.name}, the optimizer of ZeRO-Offload: "
        f"zero_optimization.offload_optimizer in the DeepSpeed config) cannot be built "
        f"here: {reason}. Fix that and run `plm setup` (or the run again), or train "
        "without optimizer offload (e.g. deepspeed=configs/deepspeed/zero3.json)",
        machine_wide=True,  # the toolchain: one line per machine, not per rank
    )


def prepare_cpu_adam(announce: bool) -> None:
    """Before ``deepspeed.initialize`` of a config that offloads the optimizer: build (the
    first time, announced) and load DeepSpeed's CPU Adam op, so DeepSpeed finds it loaded.
    ConfigError when it cannot be built here (there is no fallback)."""
    _require(CPU_ADAM, _cpu_adam_unavailable, announce)


def _require(op: Op, unavailable: Callable[[OpUnavailable], ConfigError], announce: bool) -> None:
    """Build (the first time, announced) and load ``op``, which the run cannot go without:
    ``unavailable(reason)`` is the ConfigError raised where it cannot be built here."""
    builder = _builder(op)
    if builder is None:
        return
    try:
        _load(op, builder, announce)
    except OpUnavailable as err:
        raise unavailable(err) from None


# --- ZeRO-Infinity: offload to the host's local disk ("nvme") ---------------------------------

NVME_ENV = "PLM_NVME_PATH"  # what ${PLM_NVME_PATH} in a config's nvme_path becomes
NVME_DEFAULT = "/mnt/local/plm-nvme"  # when the variable is unset: the rig hosts' local disk
_NVME_SECTIONS = ("offload_param", "offload_optimizer")


def nvme_sections(ds: dict) -> list[tuple[str, dict]]:
    """The ``zero_optimization`` offload sections of ``ds`` that swap to a disk."""
    zero = ds.get("zero_optimization", {})
    return [(k, zero[k]) for k in _NVME_SECTIONS
            if isinstance(zero.get(k), dict) and zero[k].get("device") == "nvme"]  # fmt: skip


def resolve_nvme_paths(ds: dict, source: str) -> None:
    """In place: each nvme section's ``nvme_path`` with ``${PLM_NVME_PATH}`` (or any other
    ``$VAR``) replaced from the environment, ``${PLM_NVME_PATH}`` by /mnt/local/plm-nvme
    when unset. ConfigError: no nvme_path, or a variable that is not set."""
    for key, section in nvme_sections(ds):
        raw = section.get("nvme_path")
        if not raw:
            raise ConfigError(
                f"{source}: zero_optimization.{key}.device is nvme but it has no nvme_path; "
                f'set it to a folder on the host\'s local disk (e.g. "${{{NVME_ENV}}}")'
            )
        text = str(raw).replace(f"${{{NVME_ENV}}}", os.environ.get(NVME_ENV, NVME_DEFAULT))
        path = os.path.expanduser(os.path.expandvars(text))
        if "$" in path:
            raise ConfigError(
                f"{source}: zero_optimization.{key}.nvme_path {raw!r} names an environment "
                f"variable that is not set here; set it or write the folder itself"
            )
        section["nvme_path"] = path


def _nvme_folder(ds: dict) -> None:
    """Each nvme_path exists (created) and this process may write there, with O_DIRECT
    (DeepSpeed's swapper opens its files so; some filesystems refuse it)."""
    for key, section in nvme_sections(ds):
        path = Path(section["nvme_path"])
        what = f"zero_optimization.{key}.nvme_path={path}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".plm-odirect-{os.getpid()}"
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600)
            os.close(fd)
            probe.unlink()
        except OSError as err:
            raise ConfigError(
                f"{what}: cannot write swap files there ({err.strerror or err}); point "
                f"{NVME_ENV} (or nvme_path) at a writable folder on the host's local disk "
                "(DeepSpeed opens its swap files with O_DIRECT)",
                machine_wide=True,
            ) from None


def _aio_unavailable(reason: OpUnavailable | str) -> ConfigError:
    return ConfigError(
        f"{AIO.what} ({AIO.name}, what ZeRO-Infinity swaps with: device nvme in "
        f"zero_optimization.offload_param/offload_optimizer) cannot be built here: {reason}. "
        "Fix that and run `plm setup` (or the run again), or offload to memory instead "
        "(deepspeed=configs/deepspeed/zero3-offload.json)",
        machine_wide=True,
    )


def prepare_aio(ds: dict, announce: bool) -> None:
    """Before ``deepspeed.zero.Init`` / ``deepspeed.initialize`` of a config that offloads
    to a disk: its folders usable, and DeepSpeed's async I/O op built (the first time,
    announced) and loaded, so DeepSpeed's swapper finds it loaded instead of compiling it
    without a word. ConfigError when either is not so (there is no fallback)."""
    if not nvme_sections(ds):
        return
    _nvme_folder(ds)
    _require(AIO, _aio_unavailable, announce)


def plan_lines(offload: bool, cpu_shm_allreduce: bool, world_size: int,
               nvme: bool = False) -> list[str]:  # fmt: skip
    """``--dry-run``: the C++ ops the run would load, and whether it would build them
    (ConfigError where it could not: the run would stop there)."""
    lines = []
    wanted = []
    if offload:
        wanted.append(CPU_ADAM)
    if nvme:
        wanted.append(AIO)
    if cpu_shm_allreduce and world_size > 1:
        wanted.append(SHM)
    for op in wanted:
        if _builder(op) is None:
            continue
        if is_built(op):
            lines.append(f"{op.name}: cached ({_where(op)})")
            continue
        missing = missing_build_tools()
        if op is AIO and not missing and not _builder(op).is_compatible():
            missing = ["libaio's headers and library (e.g. apt-get install libaio-dev)"]
        if missing and op is CPU_ADAM:
            raise _cpu_adam_unavailable(f"missing {'; '.join(missing)}")
        if missing and op is AIO:
            raise _aio_unavailable(f"missing {'; '.join(missing)}")
        if missing:
            lines.append(f"{op.name}: cannot be built here (missing {'; '.join(missing)}); "
                         "the run goes on with plain gloo all-reduces")  # fmt: skip
            continue
        lines.append(f"{op.name}: the run builds it first, once for this venv (about "
                     f"{op.minutes} min; `plm setup` builds it now) into {extensions_dir()}")  # fmt: skip
    return lines


def _where(op: Op) -> str:
    return "installed with DeepSpeed" if _installed(op) else str(_library(op))


def setup(verbose: bool = False, nvme: bool = False) -> int:
    """``plm setup``: build the C++ ops plm may JIT-compile (DeepSpeed's CPU Adam and, on
    the CPU accelerator, its shared-memory all-reduce; with ``nvme``, ``plm setup --nvme``,
    its async I/O op too) into this venv's cache now (at install or image build time), so
    no run compiles; exit 0 when all are built. Without ``nvme`` a missing async I/O op
    is named, not built (23 min on the 2-core VM; only offload to a disk needs it)."""
    configure_environment()
    where = extensions_dir()
    if where != default_extensions_dir() and "TORCH_EXTENSIONS_DIR" in os.environ:
        print(f"plm setup: extension cache {where} (TORCH_EXTENSIONS_DIR)")
    else:
        print(f"plm setup: extension cache {where} (this venv's)")
    ops = [(op, b) for op in OPS if (b := _builder(op)) is not None]
    if not nvme:
        ops = [(op, b) for op, b in ops if op is not AIO]
        if not is_built(AIO):
            print(f"plm setup: {AIO.what} ({AIO.name}) not built: only offload to a local "
                  "disk (zero3-nvme.json) needs it; `plm setup --nvme` builds it")  # fmt: skip
    todo = [op.name for op, _ in ops if not is_built(op)]
    missing = missing_build_tools() if todo else []
    if missing:  # one line for all of them
        print(f"plm: setup: cannot build DeepSpeed's C++ ops ({', '.join(todo)}): missing "
              f"{'; '.join(missing)}", file=sys.stderr)  # fmt: skip
        return 2
    for op, builder in ops:
        already = is_built(op)
        if op is AIO and not already and not builder.is_compatible():
            print(f"plm: setup: {op.what} ({op.name}): libaio's headers and library are "
                  "not installed (e.g. apt-get install libaio-dev)", file=sys.stderr)  # fmt: skip
            return 2
        try:
            seconds = _load(op, builder, announce=not verbose, verbose=verbose)
        except OpUnavailable as err:
            print(f"plm: setup: {op.what} ({op.name}): {err.__cause__ or err}", file=sys.stderr)
            return 2
        state = "up to date" if already else f"built in {seconds:.0f} s"
        print(f"plm setup: {op.what} ({op.name}) {state}: {_where(op)}")
    return 0
