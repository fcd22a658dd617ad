"""No import circles in `pipeline/`: each layer imports only the layers below it.

Every module under pipeline/ is parsed with `ast` (nothing is imported); an import at module
level and one inside a function both count, since a lazy import closes a circle as surely
as an eager one. The graph's strongly connected components of more than one module are the
circles; the test lists each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pipeline"


def _module_name(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    files = {_module_name(p, pkg): p for p in sorted(pkg.rglob("*.py"))}
    modules = set(files)

    def known(name: str) -> str | None:
        # `pipeline.data.shards.write_shard` -> `pipeline.data.shards`
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_package, node.level, node.module)
                # `from pipeline.data import shards` imports the submodule
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                if not name.startswith("pipeline"):
                    continue
                dep = known(name)
                if dep and dep != mod:
                    graph[mod].add(dep)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def test_finder_sees_a_circle(tmp_path):
    pkg = tmp_path / "pipeline"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pipeline.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    import pipeline.a\n")
    (pkg / "d.py").write_text("from .a import x\n")
    assert circles(import_graph(pkg)) == [["pipeline.a", "pipeline.sub.b", "pipeline.sub.c"]]


def test_no_import_circles_in_pipeline():
    found = circles(import_graph())
    assert not found, "import circles in pipeline/ (break them by layer):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found
    )


def test_models_import_no_layer_above_them():
    """Architectures and bundles stand below training, fine-tuning and the commands: a
    model file that imported them would tie every model to the CLI (issue 33)."""
    above = ("pipeline.finetune", "pipeline.train", "pipeline.cli", "pipeline.demo",
             "pipeline.neighbors", "pipeline.generate", "pipeline.export")  # fmt: skip
    graph = import_graph()
    wrong = sorted(
        (mod, dep)
        for mod, deps in graph.items()
        if mod.startswith("pipeline.models")
        for dep in deps
        if dep.startswith(above)
    )
    assert not wrong, wrong


# The floors of the house, from the ground up: a module imports its own floor's rooms and
# the floors below, never one above. A new room must be placed here (docs/design.md).
FLOORS = [
    ["pipeline", "pipeline.errors"],
    ["pipeline.storage", "pipeline.output"],
    ["pipeline.config", "pipeline.tracking_auth", "pipeline.tracking_uri"],
    ["pipeline.data"],  # the shard format: the contract between prepare and training
    ["pipeline.prepare"],  # the data job
    ["pipeline.models"],
    ["pipeline.objectives"],
    ["pipeline.loader"],  # the training stream: documents of data/ laid out by objectives/
    ["pipeline.export", "pipeline.neighbors", "pipeline.generate"],
    ["pipeline.train"],
    ["pipeline.finetune"],
    ["pipeline.eval"],
    ["pipeline.tracking_admin", "pipeline.demo", "pipeline.rig", "pipeline.cli"],
]


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def upward_imports(graph: dict[str, set[str]], floors: list[list[str]]) -> list[str]:
    floor = {room: n for n, rooms in enumerate(floors) for room in rooms}
    found = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if floor[_room(dep)] > floor[_room(mod)]:
                found.append(f"{mod} (floor {floor[_room(mod)]}) imports {dep} (floor "
                             f"{floor[_room(dep)]})")  # fmt: skip
    return found


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in import_graph()}
    placed = {room for rooms_ in FLOORS for room in rooms_}
    assert rooms <= placed, f"place these in FLOORS: {sorted(rooms - placed)}"


def test_no_import_runs_up_a_floor():
    found = upward_imports(import_graph(), FLOORS)
    assert not found, "imports from a lower floor to a higher one:\n" + "\n".join(found)


def test_floor_check_sees_an_arrow_up():
    graph = {"pipeline.loader.stream": {"pipeline.objectives.base"},
             "pipeline.objectives.base": {"pipeline.loader.stream"}}  # fmt: skip
    assert upward_imports(graph, FLOORS) == [
        "pipeline.objectives.base (floor 6) imports pipeline.loader.stream (floor 7)"
    ]
