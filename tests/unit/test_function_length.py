"""No function in pipeline/ runs over 100 lines: an orchestrator longer than that hides
steps that want names of their own (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pipeline"
LIMIT = 100


def long_functions(pkg: Path = PKG, limit: int = LIMIT) -> list[str]:
    found = []
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(pkg.parent)}:{node.lineno} {node.name} "
                                 f"({length} lines)")  # fmt: skip
    return found


def test_no_function_over_the_limit():
    found = long_functions()
    assert not found, f"functions over {LIMIT} lines:\n" + "\n".join(found)


def test_the_check_sees_a_long_function(tmp_path):
    (tmp_path / "long.py").write_text("def f():\n" + "    x = 1\n" * LIMIT)
    assert long_functions(tmp_path) == [f"{tmp_path.name}/long.py:1 f ({LIMIT + 1} lines)"]
