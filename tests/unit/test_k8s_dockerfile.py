"""The Dockerfiles' essentials, linted without building (no registry here): a non-root
numeric USER matching the manifests, ENTRYPOINT plm, everything installed at build time,
the CPU variant's torch pinned to pyproject's version from the CPU index."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO

DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (REPO / name).read_text(encoding="utf-8")
    lines = [x for x in text.splitlines() if not x.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def torch_pin() -> str:
    """The `torch==X` of pyproject's dependencies (a regex: tomllib is Python >= 3.11)."""
    m = re.search(r'^\s*"(torch==[^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert m, "pyproject.toml pins no torch"
    return m.group(1)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_essentials(name):
    ins = instructions(name)
    kinds = [k for k, _ in ins]
    assert kinds.count("FROM") == 1 and kinds[0] in ("FROM", "ARG")
    # The last USER is numeric and not root (runAsNonRoot can only verify a numeric uid),
    # and it is the uid the manifests run as.
    user = [a for k, a in ins if k == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    assert int(uid) == 1000
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["plm"]  # exec form
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert 'pip install ".[tracking]"' in runs  # the package (+ the MLflow server's clients)
    # Nothing fetched or installed at run time, nothing fetched outside package indexes.
    assert "pip" not in dict(ins).get("CMD", "") and "pip" not in dict(ins)["ENTRYPOINT"]
    assert not [a for k, a in ins if k == "ADD"], "COPY, not ADD (no remote URLs)"
    assert not re.search(r"\b(curl|wget)\b", runs)
    copied = " ".join(a for k, a in ins if k == "COPY")
    for path in ("pyproject.toml", "pipeline", "configs"):
        assert path in copied


def test_gpu_image_has_a_cuda_base_and_cpu_image_pins_cpu_torch():
    gpu = instructions("Dockerfile")
    base = dict(gpu).get("ARG", "") + dict(gpu)["FROM"]
    assert "nvidia/cuda" in base
    cpu_runs = " ".join(a for k, a in instructions("Dockerfile.cpu") if k == "RUN")
    m = re.search(r"pip install (torch==\S+) --index-url (\S+)", cpu_runs)
    assert m, "Dockerfile.cpu must install a pinned torch from an index"
    assert m.group(1) == torch_pin()
    assert m.group(2).endswith("/whl/cpu")
    # torch comes before the package, so pip keeps the CPU build instead of pulling CUDA.
    assert cpu_runs.index("torch==") < cpu_runs.index('".[tracking]"')


def test_dockerignore_keeps_history_and_outputs_out():
    ignored = {
        x.strip()
        for x in (REPO / ".dockerignore").read_text().splitlines()
        if x.strip() and not x.startswith("#")
    }
    assert {".git", "runs", "mlruns", "mlflow.db", "**/__pycache__"} <= ignored
    assert "pipeline" not in ignored and "configs" not in ignored


@pytest.mark.parametrize(
    "name,cache", [("Dockerfile.cpu", "/usr/local/var/plm"), ("Dockerfile", "/opt/venv/var/plm")]
)
def test_images_prebuild_deepspeeds_cpu_ops_for_their_runtime_user(name, cache):
    """`plm setup` after the package install (nothing compiles in a container), and the
    extension cache it fills (``sys.prefix``/var/plm: the system Python's on the CPU
    image, the venv's on the GPU one) is the runtime user's (torch locks a file there
    to load)."""
    runs = [a for k, a in instructions(name) if k == "RUN"]
    install = next(i for i, a in enumerate(runs) if '".[tracking]"' in a)
    setup = next(i for i, a in enumerate(runs) if a.strip() == "plm setup")
    assert install < setup
    assert any(f"chown -R plm:plm {cache}" in a for a in runs[setup + 1 :])
    assert "build-essential" in " ".join(runs[:setup])  # g++ for the build
    if name == "Dockerfile":  # the venv whose sys.prefix names the cache
        assert any("VIRTUAL_ENV=/opt/venv" in a for k, a in instructions(name) if k == "ENV")
