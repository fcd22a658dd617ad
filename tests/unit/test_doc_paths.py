"""Every path and module of the package that the docs name exists: a move of code that
left a page naming the old room fails here, naming the page and the path."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
_PATH = re.compile(r"(?<![\w/.])(?:pipeline|bench|launch|tests|configs|k8s)/[\w./-]*[\w/]")
IGNORED = ("bench/gpu_carry",)  # built by bench/gpu_bundle.py, never in the repository
_MODULE = re.compile(r"(?<![\w.])pipeline(?:\.[a-z_][a-z0-9_]*)+")


def _module_exists(dotted: str) -> bool:
    """``pipeline.a.b`` names a module or package, or a name defined in the longest of
    them that exists (``pipeline.data.mixture`` is stale once mixture left data/)."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        base = ROOT / Path(*parts[:n])
        source = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if source.is_file():
            rest = parts[n:]
            return not rest or re.search(rf"\b{rest[0]}\b", source.read_text("utf-8")) is not None
    return False


def stale_references(pages=PAGES) -> list[str]:
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for path in sorted(set(_PATH.findall(text))):
            if any(mark in path for mark in ("*", "NAME", "zeroN")) or path.startswith(IGNORED):
                continue
            if not (ROOT / path.rstrip(".")).exists():
                found.append(f"{page.name}: {path}")
        for dotted in sorted(set(_MODULE.findall(text))):
            if not _module_exists(dotted):
                found.append(f"{page.name}: {dotted}")
    return found


def test_every_path_the_docs_name_exists():
    found = stale_references()
    assert not found, "pages name paths or modules that do not exist:\n" + "\n".join(found)


def test_the_check_sees_a_stale_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see `pipeline/data/stream.py` and `pipeline.data.mixture.shares`, "
                    "not `pipeline/loader/stream.py`", encoding="utf-8")  # fmt: skip
    assert [line.split(": ", 1)[1] for line in stale_references([page])] == [
        "pipeline/data/stream.py", "pipeline.data.mixture.shares"]  # fmt: skip
    assert importlib.util.find_spec("pipeline.loader.stream") is not None
