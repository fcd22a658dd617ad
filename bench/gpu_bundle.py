"""Build bench/gpu_carry/ on THIS machine: what the lent GPU machine lacks to run the GPU
bench (bench/gpu_run.sh), small enough to travel with the working tree (64 MiB a call).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/gpu_bundle.py      # a few minutes here (3.11+)

then, in a session whose task has a GPU, the device tool's ``run`` with
``command: bash bench/gpu_run.sh all``, ``carry: ["bench/gpu_carry"]``, ``timeout_s: 600``
(bench/gpu_run.sh and BENCHMARKS.md say more). The folder is git-ignored.

What it holds:

- ``wheels/``: the Python packages the bench imports that the GPU machine does not have.
  Found by reading metadata, not listed by hand: from the roots (the project's runtime
  dependencies the GPU machine lacks and the bench imports: DeepSpeed and pydantic),
  every ``Requires-Dist`` of every carried wheel (markers evaluated for CPython 3.12 on
  Linux x86_64, extras skipped) is carried too, unless the GPU machine has it (GPU_HAS,
  the device docs' package list). Versions are the ones installed here, so the GPU runs
  what the tests run. DeepSpeed has no wheel on PyPI (sdist only): it is built here into
  a pure-Python wheel (``DS_BUILD_OPS=0``: its ops JIT-compile where they are used).
  ``requirements.txt`` names the roots for ``pip install --no-index --find-links``.
- ``bert/``: a data dir for bench_train.py, its defaults: the generated corpus (8,000
  documents), a WordPiece tokenizer of 30,522 (``plm data tokenizer``), shards (``plm
  data prepare``).
- ``gpt/``: a data dir for bench_gpt.py: 12,000 documents, byte-level BPE of 50,257.
- ``manifest.json``: versions, sizes and sha256 of the wheels, which requirement the GPU
  machine meets, the data dirs' knobs, the size of what travels.

Before it ends it runs both benches in their tiny CPU mode on the two data dirs, with the
project's dependencies the GPU machine lacks and the bundle does not carry made
unimportable (--deny-import: Ray, MLflow, webdataset, ...), so a bundle that would miss a
package there fails here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import benchlib
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / "bench" / "gpu_carry"
LIMIT = 64 * 2**20  # the working tree plus the carried paths, per call

# The GPU machine's Python packages, as the device docs list them (read on a machine of
# that image on 2026-11-17), and the versions they give for some (2026-11 pip list).
GPU_HAS = frozenset(
    canonicalize_name(n)
    for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)
GPU_VERSIONS = {"torch": "2.11.0", "numpy": "2.5.2", "transformers": "5.17.0",
                "tokenizers": "0.23.2", "safetensors": "0.8.0", "triton": "3.6.0",
                "huggingface-hub": "1.33.0"}  # fmt: skip
# Carried although the GPU machine has a version of it: pydantic-core wants a recent one
# (typing-extensions>=4.14.1) and the docs give none; pip keeps the machine's if it suffices.
ALWAYS_CARRY = frozenset({"typing-extensions"})
ROOTS = ("deepspeed", "pydantic")
# The GPU machine's Python (3.12.3); --python 3.11 builds a bundle for a CPU rehearsal of
# bench/gpu_run.sh with this machine's interpreter (bench/gpu_run.sh says how).
PYTHON = "3.12"
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
# The data dirs: the benches' own defaults (bench_train.py, bench_gpt.py)
DATA = {
    "bert": {"kind": "wordpiece", "docs": 8000, "words": 20000, "vocab_size": 30522},
    "gpt": {"kind": "bpe", "docs": 12000, "words": 60000, "vocab_size": 50257},
}


def pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def fetch_wheel(name: str, version: str, out: Path, tmp: Path, python: str = PYTHON) -> Path:
    """``name==version`` as a wheel for CPython ``python`` (3.12: the GPU machine's) on Linux
    x86_64 into ``out``; DeepSpeed (an sdist only) is built here into a pure-Python wheel."""
    abi = "cp" + python.replace(".", "")
    spec = f"{name}=={version}"
    before = set(out.glob("*.whl"))
    if name == "deepspeed":
        pip("download", "--no-deps", "--no-binary=:all:", "-d", str(tmp), spec)
        (sdist,) = tmp.glob("deepspeed-*.tar.gz")
        pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(sdist),
            env={"DS_BUILD_OPS": "0"})  # fmt: skip
    else:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python,
            "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
            *platforms, "-d", str(out), spec)  # fmt: skip
    (wheel,) = set(out.glob("*.whl")) - before
    if "py3-none-any" not in wheel.name and abi not in wheel.name:
        raise SystemExit(f"{wheel.name}: not a CPython {python} wheel")
    return wheel


def requirements(wheel: Path, python: str = PYTHON) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply on the GPU machine (no extras), or on a
    machine like it with CPython ``python``."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]  # fmt: skip
    target = {**TARGET, "python_version": python}
    if python != PYTHON:
        target["python_full_version"] = f"{python}.0"
    return [r for r in reqs if r.marker is None or r.marker.evaluate(target)]


def build_wheels(out: Path, tmp: Path, python: str = PYTHON) -> dict:
    """Carry the closure of ROOTS over Requires-Dist, less what the GPU machine has.
    Returns {carried: {name: {...}}, met_there: {requirement: version or "listed"}}."""
    carried: dict[str, dict] = {}
    met_there: dict[str, str] = {}
    queue = list(ROOTS)
    while queue:
        name = canonicalize_name(queue.pop(0))
        if name in carried:
            continue
        version = md.version(name)  # what runs here
        wheel = fetch_wheel(name, version, out, tmp, python)
        carried[name] = {"version": version, "wheel": wheel.name, "bytes": wheel.stat().st_size,
                         "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                         "requires": []}  # fmt: skip
        for req in requirements(wheel, python):
            dep = canonicalize_name(req.name)
            carried[name]["requires"].append(str(req))
            if dep in GPU_HAS and dep not in ALWAYS_CARRY:
                there = GPU_VERSIONS.get(dep)
                if there and not req.specifier.contains(Version(there), prereleases=True):
                    raise SystemExit(f"{name} needs {req}; the GPU machine has {dep} {there}")
                met_there[str(req)] = there or "listed"
            elif dep not in carried:
                queue.append(dep)
        print(f"wheel: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    roots = [f"{canonicalize_name(n)}=={carried[canonicalize_name(n)]['version']}" for n in ROOTS]
    (out / "requirements.txt").write_text("\n".join(roots) + "\n")
    return {"carried": carried, "met_there": met_there}


def build_data(name: str, work: Path) -> dict:
    """A bench's data dir through the project's CLI, cached under ``work``, copied in."""
    knobs = DATA[name]
    args = argparse.Namespace(docs=knobs["docs"], max_sentences=15, words=knobs["words"],
                              vocab_size=knobs["vocab_size"], seed=1234, prepare_cpus=1)  # fmt: skip
    data = benchlib.prepare_data(work / name, knobs["kind"], args)
    shutil.copytree(data, CARRY / name)
    return {**knobs, **benchlib.data_info(CARRY / name), "data_dir": f"bench/gpu_carry/{name}"}


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def travelling_tree() -> int:
    """Bytes of what the device tool sends besides the carried paths: tracked files and
    untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout  # fmt: skip
    files = [REPO / f for f in out.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file())


def denied_for_smoke(carried: set[str]) -> list[str]:
    """The import names of the project's dependencies that the GPU machine lacks and the
    bundle does not carry: the smoke runs must pass without them."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = {canonicalize_name(Requirement(r).name) for r in deps}
    missing -= GPU_HAS | carried
    by_dist: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(canonicalize_name(dist), set()).add(module)
    names = {m for d in missing for m in by_dist.get(d, {d.replace("-", "_")})}
    return sorted(m for m in names if re.fullmatch(r"[A-Za-z_]\w*", m))


def smoke(denied: list[str], tmp: Path) -> dict:
    """Both benches' tiny CPU mode on the carried data dirs, as on the GPU machine."""
    deny = [a for m in denied for a in ("--deny-import", m)]
    runs = {
        "bert": ["bench/bench_train.py", "--preset", "bert-tiny", "--batch", "8", "--seq", "64",
                 "--rounds", "2", "--warmup", "1", "--data-dir", str(CARRY / "bert")],
        "gpt": ["bench/bench_gpt.py", "--preset", "gpt2-tiny", "--sides", "ours,baseline",
                "--data-dir", str(CARRY / "gpt")],
    }  # fmt: skip
    out = {}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for name, cmd in runs.items():
        report = tmp / f"{name}.json"
        proc = subprocess.run([sys.executable, *cmd, *deny, "--json", str(report)], cwd=REPO,
                              env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            raise SystemExit(f"smoke {name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        out[name] = json.loads(report.read_text())["info"]["imported"]
        print(f"smoke: {name} ran on the CPU without {', '.join(denied)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "plm-gpu-bundle"),
                    help="corpora, tokenizers and data dirs, reused between runs")  # fmt: skip
    ap.add_argument("--no-smoke", action="store_true", help="skip the CPU smoke runs")
    ap.add_argument("--python", default=PYTHON,
                    help=f"the CPython the wheels are for (default {PYTHON}, the GPU machine's; "
                         "this interpreter's version for a CPU rehearsal of gpu_run.sh)")  # fmt: skip
    args = ap.parse_args()
    if CARRY.exists():
        shutil.rmtree(CARRY)
    (CARRY / "wheels").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="plm-gpu-bundle-") as t:
        tmp = Path(t)
        wheels = build_wheels(CARRY / "wheels", tmp, args.python)
        data = {name: build_data(name, Path(args.work_dir)) for name in DATA}
        denied = denied_for_smoke(set(wheels["carried"]))
        imported = {} if args.no_smoke else smoke(denied, tmp)
    carry, tree = size(CARRY), travelling_tree()
    manifest = {
        "built_with": {"python": sys.version.split()[0], "torch": md.version("torch")},
        "wheels_for_python": args.python,
        "wheels": wheels, "data": data, "smoke_denied_imports": denied,
        "smoke_imported": imported, "carry_bytes": carry, "tree_bytes": tree,
    }  # fmt: skip
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = carry + tree
    print(f"bench/gpu_carry: {carry / 2**20:.1f} MiB (wheels {size(CARRY / 'wheels') / 2**20:.1f},"
          f" bert {size(CARRY / 'bert') / 2**20:.1f}, gpt {size(CARRY / 'gpt') / 2**20:.1f}); "
          f"with the working tree ({tree / 2**20:.1f} MiB): {total / 2**20:.1f} of 64 MiB")  # fmt: skip
    if total > LIMIT:
        raise SystemExit("over the device tool's 64 MiB a call: carry less")
    return 0


if __name__ == "__main__":
    sys.exit(main())
