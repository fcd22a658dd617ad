"""Finished units of `plm data prepare`, kept beside their parts so no unit is done twice.

Once a write task has written its unit's parts, it saves what it returns (the UnitResult,
the trace and the key partitions) as ``units/unit-NNNNNN.npz`` in the output. A write task
that finds its unit's record returns it instead of reading the unit again:

- a task Ray retries after its node died, or re-runs to rebuild outputs that were in that
  node's object store (lineage reconstruction);
- every task of a rerun after the driver died with the head: the driver keeps the records
  of an earlier run of the same job (``units/job.json``: the data dir's fingerprint, the
  units and the dedup partitions) whose parts are all there, and removes everything else
  it wrote, so the rerun redoes only the units without finished parts.

The dedup and fix waves always run again (they are cheap, and read only parts and
records). The finished data dir holds no records: they go once the manifest is written.
A record holds arrays and JSON only (``np.load(allow_pickle=False)``), never a pickle.
"""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from dataclasses import fields
from typing import Any

import numpy as np

from pipeline.data.shards import SPLITS
from pipeline.prepare.store import JOB_FILE, RECORDS_DIR, listing, write_file
from pipeline.prepare.unit import UnitResult

_RECORD = re.compile(r"unit-(\d{6,})\.npz")


def record_path(root: str, unit: int) -> str:
    return f"{root}/{RECORDS_DIR}/unit-{unit:06d}.npz"


def _result_json(result: UnitResult) -> str:
    out: dict[str, Any] = {}
    for f in fields(result):
        value = getattr(result, f.name)
        if isinstance(value, Counter):  # keys may be ints (source index): kept as pairs
            value = {"counter": [[k, n] for k, n in value.items()]}
        out[f.name] = value
    return json.dumps(out)


def _result_of(text: str) -> UnitResult:
    values = json.loads(text)
    for name, value in values.items():
        if isinstance(value, dict) and set(value) == {"counter"}:
            values[name] = Counter({k: n for k, n in value["counter"]})
    values["digests"] = [tuple(d) for d in values.get("digests", [])]
    return UnitResult(**values)


def save(fs, root: str, unit: int, outputs: tuple) -> None:
    """A write task's return value (UnitResult, then arrays) as the unit's record."""
    result, *arrays = outputs
    buf = io.BytesIO()
    named = {f"a{k}": np.asarray(a) for k, a in enumerate(arrays)}
    np.savez(buf, result=np.frombuffer(_result_json(result).encode(), np.uint8), **named)
    write_file(fs, record_path(root, unit), buf.getvalue())


def _open(fs, path: str):
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_file(path) as f:
        return np.load(io.BytesIO(f.read()), allow_pickle=False)


def _result_in(fs, path: str) -> UnitResult:
    """A record's UnitResult alone: the zip's directory and one member, by range reads
    (the arrays, most of the bytes, stay where they are)."""
    with fs.open_input_file(path) as f, np.load(f, allow_pickle=False) as data:
        return _result_of(data["result"].tobytes().decode())


def load(fs, root: str, unit: int) -> tuple | None:
    """The unit's record as the write task returned it, or None when there is none."""
    data = _open(fs, record_path(root, unit))
    if data is None:
        return None
    result = _result_of(data["result"].tobytes().decode())
    result.reused = True
    arrays = [data[f"a{k}"] for k in range(len(data.files) - 1)]
    return (result, *arrays)


def start(fs, root: str, job: dict[str, Any]) -> dict[int, list[str]]:
    """Before the job: the records to keep, {unit: its parts' paths (relative)}, those of
    an earlier run of the same ``job`` whose parts all exist; every other record is
    removed and ``job`` written as this run's."""
    import pyarrow.fs as pafs

    folder = f"{root}/{RECORDS_DIR}"
    kept: dict[int, list[str]] = {}
    try:
        with fs.open_input_stream(f"{folder}/{JOB_FILE}") as f:
            same = json.loads(f.read()) == job
    except (OSError, ValueError):
        same = False
    entries = listing(fs, folder)
    if same:
        present = {
            f"{split}/{e.base_name}" for split in SPLITS for e in listing(fs, f"{root}/{split}")
        }
        for entry in entries:
            m = _RECORD.fullmatch(entry.base_name)
            if not m:
                continue
            result = _result_in(fs, entry.path)
            names = [
                p[k] for parts in result.parts.values() for p in parts for k in ("name", "index")
            ]
            if all(n in present for n in names):
                kept[int(m.group(1))] = names
    for entry in entries:
        m = _RECORD.fullmatch(entry.base_name)
        if entry.type == pafs.FileType.File and not (m and int(m.group(1)) in kept):
            fs.delete_file(entry.path)
    fs.create_dir(folder, recursive=True)
    write_file(fs, f"{folder}/{JOB_FILE}", json.dumps(job).encode())
    return kept


def finish(fs, root: str) -> None:
    """After the manifest: the records are no longer needed."""
    import pyarrow.fs as pafs

    if fs.get_file_info(f"{root}/{RECORDS_DIR}").type == pafs.FileType.Directory:
        fs.delete_dir(f"{root}/{RECORDS_DIR}")
