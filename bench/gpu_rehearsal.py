"""A CPU rehearsal of the GPU bench (bench/gpu_run.sh), here, before a device call:

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/gpu_bundle.py --python 3.11   # the bundle
    python bench/gpu_rehearsal.py                       # gpu_run.sh all, REHEARSE=1, ~5 min

then build the device's bundle again (``python bench/gpu_bundle.py``: wheels for its
Python 3.12) before the device call.

gpu_run.sh runs on the GPU machine with python3 there, a venv that holds that image's
packages (torch, numpy, transformers, ...: gpu_bundle.GPU_HAS) and none of the others
(no DeepSpeed, pydantic, Ray, MLflow, webdataset). This builds a stand-in for it: a venv
of the Debian Python (/usr/bin/python3: a base interpreter with almost nothing in its
site-packages, as the image's) whose site-packages links, from this interpreter's, the
distributions GPU_HAS names and nothing else. Then it runs ``REHEARSE=1 PY=<stand-in>
bash bench/gpu_run.sh all``: the same install stage (the carried wheels, --no-index,
against what the stand-in has), then both benches at tiny sizes on the CPU with Ray and
MLflow unimportable. So an import, a path or a version that would fail there fails
here. What it cannot rehearse: CUDA kernels, the GPU machine's torch (2.11, CUDA; here
this interpreter's) and Python (3.12).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
from gpu_bundle import GPU_HAS
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def machine_packages() -> set[str]:
    """GPU_HAS, and what their versions here need to import (huggingface-hub here may
    want a client the machine's version does not), short of the project's own
    dependencies: those the machine lacks must stay missing."""
    ours = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    keep_out = {canonicalize_name(Requirement(r).name) for r in ours} - GPU_HAS
    keep_out |= {"pydantic-core"}
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    wanted, queue = set(), [n for n in GPU_HAS if n in installed]
    while queue:
        name = queue.pop()
        if name in wanted or name in keep_out or name not in installed:
            continue
        wanted.add(name)
        for line in installed[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                queue.append(canonicalize_name(req.name))
    extra = sorted(wanted - GPU_HAS)
    print(f"linked besides GPU_HAS (their dependencies here): {', '.join(extra) or 'none'}")
    return wanted


def stand_in(root: Path, base: str) -> Path:
    """A venv of ``base`` whose site-packages also sees, through a .pth, a folder of links
    to this interpreter's distributions that the GPU machine has. Returns its python."""
    if root.exists():
        shutil.rmtree(root)
    # without its own pip: pip, setuptools and wheel are the machine's (linked), as there
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    farm = root / "machine-packages"
    farm.mkdir()
    linked = []
    wanted = machine_packages()
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name not in wanted or not dist.files:
            continue
        tops = {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "bin")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (farm / top).exists():
                (farm / top).symlink_to(source)
        linked.append(f"{name} {dist.version}")
    Path(site, "plm-machine-packages.pth").write_text(f"{farm}\n")
    print(f"stand-in {python}: {len(linked)} distributions of the GPU machine's list linked")
    return python


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", default="/tmp/plm-gpu-rehearsal", help="stand-in venv, outputs")
    ap.add_argument("--base", default="/usr/bin/python3",
                    help="base interpreter of the stand-in (this one's Python minor version)")  # fmt: skip
    args = ap.parse_args()
    root = Path(args.root)
    python = stand_in(root / "machine", args.base)
    env = {**os.environ, "REHEARSE": "1", "PY": str(python), "OUT": str(root / "out"),
           "VENV": str(root / "venv"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    # pip as on the GPU machine: none of this machine's pip settings (find-links,
    # extra indexes, constraints) may supply what the bundle lacks
    env = {k: v for k, v in env.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run(["bash", "bench/gpu_run.sh", "all"], cwd=REPO, env=env)
    print(f"gpu_run.sh all (REHEARSE=1) exited {proc.returncode}; outputs in {root / 'out'}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
