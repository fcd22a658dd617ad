"""The output store of `plm data prepare`: a data dir's folder on any pyarrow filesystem
(a local path or a URI: ``s3://``, ``gs://``, ``file://``...).

What the driver (prepare.py) does to the folder, and nothing else: open it
(``output_fs``), list it, tell its own files from foreign ones (``foreign_files``: a run
refuses a folder that holds files it did not write, and ``--force`` leaves them in place),
clear its own files before a rebuild (the manifest first), write a file atomically (temp
file, then a move), name the workers' parts ``SPLIT/shard-NNNNNN`` (renames side by
side: on an object store each is a server-side copy), and after a refused run put the
folder back as it was found (``snapshot`` / ``restore``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.data.shards import (
    MANIFEST,
    SPLITS,
    TOKENIZER_DIR,
    brace_pattern,
    index_name,
    shard_name,
)
from pipeline.errors import ConfigError
from pipeline.prepare.tokenizer import META_FILE, TOKENIZER_FILE
from pipeline.storage import atomic_write, check_store, is_uri, without_temp


class PrepareError(ConfigError):
    """The output folder or the inputs cannot be used as they are; the message says why."""


RECORDS_DIR = "units"  # finished units' records while the job runs (data/records.py)
JOB_FILE = "job.json"
_OWN_TOP = {
    MANIFEST,
    *SPLITS,
    TOKENIZER_DIR,
    RECORDS_DIR,
}  # names matched without_temp (a NAME.tmp matches too)
_OWN_RECORD = re.compile(r"(unit-\d{6,}\.npz|job\.json)(\.tmp)?")
_OWN_SHARD = re.compile(r"(shard-\d{6,}|(part|fix)-\d{6,}-\d{3,})(\.tar|\.idx\.npy)(\.tmp)?")
_OWN_TOKENIZER = {TOKENIZER_FILE, META_FILE}


def output_fs(output: str, what: str = "--output"):
    """(pyarrow filesystem, path in it) of a local path or a filesystem URI; a URI's store
    is checked first (bucket, credentials, endpoint: a StoreError naming it)."""
    import pyarrow.fs as pafs

    if is_uri(output):
        return check_store(output, what)
    return pafs.LocalFileSystem(), str(Path(output).resolve())


def listing(fs, path: str):
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type != pafs.FileType.Directory:
        return []
    return sorted(fs.get_file_info(pafs.FileSelector(path)), key=lambda i: i.base_name)


def foreign_files(fs, root: str) -> list[str]:
    """Paths in ``root`` that `plm data prepare` did not write (relative, sorted)."""
    import pyarrow.fs as pafs

    found = []
    for entry in listing(fs, root):
        name = entry.base_name
        if without_temp(name) not in _OWN_TOP:
            found.append(name)
        elif name in SPLITS or name in (TOKENIZER_DIR, RECORDS_DIR):
            if entry.type != pafs.FileType.Directory:
                found.append(name)
                continue
            own = {TOKENIZER_DIR: None, RECORDS_DIR: _OWN_RECORD}.get(name, _OWN_SHARD)
            for sub in listing(fs, entry.path):
                base = without_temp(sub.base_name)
                ok = base in _OWN_TOKENIZER if own is None else bool(own.fullmatch(base))
                if not ok or sub.type != pafs.FileType.File:
                    found.append(f"{name}/{sub.base_name}")
    return found


def clear_own_files(fs, root: str, keep: frozenset[str] = frozenset()) -> None:
    """Remove the manifest first (the folder stops being 'finished'), then our files but
    ``keep`` (paths relative to ``root``: the parts of units a rerun does not redo)."""
    import pyarrow.fs as pafs

    if fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.File:
        fs.delete_file(f"{root}/{MANIFEST}")
    for f in listing(fs, root):  # a manifest's temporary left by a killed run
        if f.base_name != MANIFEST and without_temp(f.base_name) == MANIFEST:
            fs.delete_file(f.path)
    for sub in (*SPLITS, TOKENIZER_DIR):
        for f in listing(fs, f"{root}/{sub}"):
            if f"{sub}/{f.base_name}" in keep:
                continue
            if f.type == pafs.FileType.File and (
                _OWN_SHARD.fullmatch(without_temp(f.base_name))
                or without_temp(f.base_name) in _OWN_TOKENIZER
            ):
                fs.delete_file(f.path)


def snapshot(fs, root: str) -> frozenset[str] | None:
    """Every path under ``root`` (relative), or None when there is no folder: what
    ``restore`` brings the output back to after a refused run."""
    import pyarrow.fs as pafs

    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return None
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return frozenset(_relative(root, f.path) for f in found)


def restore(fs, root: str, before: frozenset[str] | None) -> None:
    """Remove what a run added under ``root`` since ``snapshot``: the whole folder when
    there was none, else every path that was not there (a refused run leaves nothing:
    no empty split folders, no records). What it removed or replaced before the refusal
    (an older data dir under --force) stays gone."""
    import pyarrow.fs as pafs

    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return
    if before is None:
        fs.delete_dir(root)
        return
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    gone: list[str] = []  # new folders removed whole, with all they hold
    for f in sorted(found, key=lambda f: f.path):
        rel = _relative(root, f.path)
        if rel in before or any(rel.startswith(g + "/") for g in gone):
            continue
        if f.type == pafs.FileType.Directory:
            fs.delete_dir(f.path)
            gone.append(rel)
        else:
            fs.delete_file(f.path)


def _relative(root: str, path: str) -> str:
    return path[len(root.rstrip("/")) + 1 :]


def write_file(fs, path: str, data: bytes) -> None:
    atomic_write(path, data, fs)


def existing_manifest(fs, root: str) -> dict[str, Any] | None:
    import pyarrow.fs as pafs

    path = f"{root}/{MANIFEST}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    try:
        with fs.open_input_stream(path) as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError):
        return {}  # unreadable: treat it as another data dir
    return manifest if isinstance(manifest, dict) else {}


_MOVERS = 32  # concurrent renames: on an object store a rename is a server-side copy


def name_shards(fs, root: str, results) -> dict[str, Any]:
    """Move every unit's parts to ``SPLIT/shard-NNNNNN`` in unit order, then remove the
    parts no entry names (those a fix task replaced); the split entries. The renames run
    side by side: on S3 each is a copy of the object (no byte passes through the driver,
    but one after another they would take hours for a TB of shards)."""
    from concurrent.futures import ThreadPoolExecutor

    splits, moves = {}, []
    for split in SPLITS:
        entries = []
        for result in results:
            for part in result.parts[split]:
                name = shard_name(split, len(entries))
                moves.append((part["name"], name))
                moves.append((part["index"], index_name(name)))
                entries.append({**part, "name": name, "index": index_name(name)})
        splits[split] = {
            "shards": entries,
            "n_docs": sum(e["n_docs"] for e in entries),
            "n_tokens": sum(e["n_tokens"] for e in entries),
            "pattern": brace_pattern(split, len(entries)) if entries else "",
        }
    with ThreadPoolExecutor(_MOVERS) as pool:
        # list(): the first failed rename raises here.
        list(pool.map(lambda m: fs.move(f"{root}/{m[0]}", f"{root}/{m[1]}"), moves))
        stale = [
            f.path
            for split in SPLITS
            for f in listing(fs, f"{root}/{split}")
            if not f.base_name.startswith("shard-") and _OWN_SHARD.fullmatch(f.base_name)
        ]
        list(pool.map(fs.delete_file, stale))
    return splits
