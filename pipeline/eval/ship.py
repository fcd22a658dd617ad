"""A cell's files on a host that does not see the driver's: bundles and task files through
Ray's object store.

The driver makes the bundles and reads the task files on its own disk; a Ray cluster
need not share one (the rehearsal hosts share only the bucket). So the driver stamps each
distinct path a cell names (sizes and modification times of its files) and puts its bytes
in the object store once. A cell whose host sees the path with the same stamp (the
driver's node, a shared filesystem) reads it in place; elsewhere the bytes are written
once per host into a cache keyed by the stamp, and the cell's spec points there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.eval.cells import CellSpec

CACHE = "plm-eval-files"  # under the host's temp dir; entries are named by their stamp
FINETUNE_DATA = ("train", "valid", "test")


@dataclass(frozen=True)
class Shipped:
    """One path of the driver's, stamped, its bytes in the object store."""

    stamp: str
    ref: Any  # ray.ObjectRef of {relative path: bytes} ("" for a file's own bytes)


def paths_of(spec: CellSpec) -> list[str]:
    """Every driver path ``spec`` reads."""
    found = [spec.bundle, spec.text_file, *spec.extra_evals.values()]
    if spec.finetune:
        found.append(spec.finetune["model"]["source"])
        found += [spec.finetune["data"].get(k) for k in FINETUNE_DATA]
    return [p for p in dict.fromkeys(found) if p]


def _files(path: Path) -> list[tuple[str, Path]]:
    if path.is_file():
        return [("", path)]
    return sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file())


def stamp(path: str) -> str | None:
    """What tells one copy of ``path`` from another without reading it; None: not here."""
    p = Path(path)
    if not p.exists():
        return None
    h = hashlib.sha256(p.name.encode())
    for rel, f in _files(p):
        st = f.stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def ship(cells: list[CellSpec]) -> dict[str, Shipped]:
    """The driver's side: each distinct path of ``cells`` stamped and put once."""
    import ray

    shipped = {}
    for path in dict.fromkeys(p for c in cells for p in paths_of(c)):
        mark = stamp(path)
        if mark is None:  # not a path (plan.check_fits has checked every real one)
            continue
        payload = {rel: f.read_bytes() for rel, f in _files(Path(path))}
        shipped[path] = Shipped(mark, ray.put(payload))
    return shipped


def _materialize(path: str, item: Shipped) -> str:
    """``path``'s bytes in this host's cache (written once, renamed into place whole)."""
    import ray

    entry = Path(tempfile.gettempdir()) / CACHE / item.stamp
    target = entry / Path(path).name
    if not entry.is_dir():
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{item.stamp}-", dir=entry.parent))
        for rel, data in ray.get(item.ref).items():
            out = partial / Path(path).name / rel if rel else partial / Path(path).name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
        try:
            os.rename(partial, entry)
        except OSError:  # another cell of this host was first: its copy is the same
            shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def localize(spec: CellSpec, shipped: dict[str, Shipped]) -> CellSpec:
    """The cell's side: ``spec`` with each path this host does not see as the driver
    does replaced by the cached copy; unchanged on the driver's node or a shared disk."""
    moved = {p: _materialize(p, shipped[p]) for p in paths_of(spec)
             if p in shipped and stamp(p) != shipped[p].stamp}  # fmt: skip
    if not moved:
        return spec
    scratch = spec.scratch
    if not Path(scratch).parents[1].is_dir():  # the driver's work_dir is not on this host
        scratch = str(Path(tempfile.gettempdir()) / CACHE / "cells" / Path(scratch).name)
    finetune = None
    if spec.finetune is not None:
        model = {**spec.finetune["model"], "source": moved.get(spec.finetune["model"]["source"],
                                                               spec.finetune["model"]["source"])}  # fmt: skip
        data = {k: moved.get(v, v) if k in FINETUNE_DATA else v
                for k, v in spec.finetune["data"].items()}  # fmt: skip
        finetune = {**spec.finetune, "model": model, "data": data,
                    "train": {**spec.finetune["train"], "out_dir": scratch}}  # fmt: skip
    return replace(
        spec,
        bundle=moved.get(spec.bundle, spec.bundle),
        text_file=moved.get(spec.text_file, spec.text_file) if spec.text_file else None,
        extra_evals={k: moved.get(v, v) for k, v in spec.extra_evals.items()},
        finetune=finetune,
        scratch=scratch,
    )
