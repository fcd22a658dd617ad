"""A cell's files reach a host that does not see the driver's disk (pipeline/eval/ship.py):
the bytes through Ray's object store, once per host, the spec's paths pointed there; a host
that sees the same files (the driver's, a shared disk) reads them in place."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pipeline.eval.cells import CellSpec
from pipeline.eval.ship import CACHE, localize, paths_of, ship, stamp

pytestmark = pytest.mark.slow  # a local Ray


def _driver_files(root: Path) -> CellSpec:
    bundle = root / "work" / "bundles" / "m"
    (bundle / "tokenizer").mkdir(parents=True)
    (bundle / "config.yaml").write_text("arch: bert-tiny\n")
    (bundle / "model.safetensors").write_bytes(os.urandom(3000))
    (bundle / "tokenizer" / "vocab.txt").write_text("[PAD]\nthe\n")
    train, test = root / "tasks" / "train.jsonl", root / "tasks" / "test.jsonl"
    train.parent.mkdir()
    train.write_text('{"text": "a", "label": "x"}\n')
    test.write_text('{"text": "b", "label": "y"}\n')
    scratch = str(root / "work" / "cells" / "000-t-seed0")
    finetune = {"model": {"source": str(bundle), "init": "pretrained"},
                "data": {"train": str(train), "test": str(test), "format": "auto"},
                "train": {"seed": 0, "out_dir": scratch}}  # fmt: skip
    return CellSpec(candidate=0, task="t", seed=0, kind="finetune", bundle=str(bundle),
                    init="pretrained", scratch=scratch, finetune=finetune)  # fmt: skip


def _tree(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_host_without_the_driver_files_gets_them_once(ray_local, tmp_path, monkeypatch):
    driver = tmp_path / "driver"
    spec = _driver_files(driver)
    assert paths_of(spec) == [spec.bundle, *[spec.finetune["data"][k] for k in ("train", "test")]]
    shipped = ship([spec, spec])
    assert sorted(shipped) == sorted(paths_of(spec))
    assert localize(spec, shipped) is spec  # this host sees them: read in place

    # Another host: its own temp dir, and none of the driver's paths.
    before = {p: _tree(Path(p)) for p in paths_of(spec)}
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "other-host-tmp"))
    shutil.move(driver, tmp_path / "away")
    there = localize(spec, shipped)
    cache = tmp_path / "other-host-tmp" / CACHE
    for old, new in [(spec.bundle, there.bundle),
                     (spec.finetune["data"]["train"], there.finetune["data"]["train"]),
                     (spec.finetune["data"]["test"], there.finetune["data"]["test"])]:  # fmt: skip
        assert Path(new).is_relative_to(cache) and Path(new).name == Path(old).name
        assert _tree(Path(new)) == before[old]
    assert there.finetune["model"]["source"] == there.bundle
    assert there.finetune["data"]["format"] == "auto"
    assert there.scratch == there.finetune["train"]["out_dir"]
    assert Path(there.scratch).is_relative_to(cache)  # the driver's work_dir is not here
    written = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    again = localize(spec, shipped)  # a second cell on this host: the copies are reused
    assert again == there
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == written


def test_a_changed_copy_at_the_same_path_is_not_read(ray_local, tmp_path, monkeypatch):
    spec = _driver_files(tmp_path / "driver")
    shipped = ship([spec])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "other-host-tmp"))
    train = Path(spec.finetune["data"]["train"])
    original = train.read_bytes()
    mark = stamp(str(train))
    train.write_text('{"text": "another host, another file", "label": "z"}\n')
    assert stamp(str(train)) != mark
    there = localize(spec, shipped)
    assert there.bundle == spec.bundle  # the same stamp: read in place
    assert Path(there.finetune["data"]["train"]).read_bytes() == original
    assert there.scratch == spec.scratch  # the work_dir is here
