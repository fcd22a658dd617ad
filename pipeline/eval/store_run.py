"""A pretraining run on a store (``train.out_dir=s3://...``, any pyarrow filesystem URI)
as a local folder that ``plm eval`` reads like any run folder.

``StoreMirror.sync`` brings into ``work_dir/store/<run>-<digest>/`` what the evaluation
needs, and nothing more:

- the run's ``metrics.jsonl`` and MLflow run id (the losses at each step, the run to log to);
- each complete checkpoint's small files (``config.yaml``, its record), ``COMPLETE`` last,
  so the mirror never shows a checkpoint whose files are not all there;
- its bundle, when training wrote one beside it; else its weights, from which the
  evaluation side makes the bundle (``checkpoint_bundle``), then drops them
  (``release``): a host keeps one checkpoint's weights at a time, not the run's;
- the final bundle's ``config.yaml``: the sign that training has ended (``--watch``).

The store's credentials, region and endpoint come from the standard AWS_* variables, as
for every stage. A checkpoint that ``keep_last`` deletes while it is fetched is reported
and skipped.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pipeline.eval.suite import EvalError
from pipeline.storage import is_plain_name, redact_uri

_CHUNK = 8 << 20
_FINAL = "bundles/final/config.yaml"


class StoreMirror:
    def __init__(self, uri: str, work_dir: Path):
        from pipeline.storage import store_fs

        uri = uri.rstrip("/")
        parts = uri.rsplit("/", 2)
        self.only: str | None = None  # one checkpoint's URI: that one alone
        if len(parts) == 3 and parts[1] == "checkpoints":
            uri, self.only = parts[0], parts[2]
        self.uri, self.shown = uri, redact_uri(uri)
        self.fs, base = store_fs(uri, "--models")
        self.base = base.rstrip("/")
        digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
        self.local = work_dir / "store" / f"{uri.rsplit('/', 1)[-1]}-{digest}"
        self.mirrored: set[str] = set()
        self.skipped: list[str] = []
        self._check_bucket()

    def _check_bucket(self) -> None:
        import pyarrow.fs as pafs

        if self.fs.type_name not in ("s3", "gcs"):
            return
        bucket = self.base.split("/", 1)[0]
        try:
            missing = self.fs.get_file_info(bucket).type == pafs.FileType.NotFound
        except OSError as err:
            raise self._fault(err) from None
        if missing:
            raise EvalError(f"--models={self.shown}: the bucket {bucket!r} was not found; check "
                            "the URI and AWS_ENDPOINT_URL")  # fmt: skip

    def where(self, tag: str) -> str:
        return f"{self.shown}/checkpoints/{tag}"

    # --- the store ---------------------------------------------------------------------
    def _fault(self, err: OSError) -> EvalError:
        from pipeline.storage import store_fault

        text = " ".join(str(err).split())[:200]
        return EvalError(store_fault(self.uri, "--models", err)
                         or f"--models {self.shown}: cannot read it ({text})")  # fmt: skip

    def _files(self, rel: str, recursive: bool = True) -> list[tuple[str, bool]]:
        """(path relative to the run, is a folder) under ``rel``; [] when there is none."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(f"{self.base}/{rel}", allow_not_found=True, recursive=recursive)
        try:
            infos = self.fs.get_file_info(sel)
        except OSError as err:
            raise self._fault(err) from None
        n = len(self.base) + 1
        return sorted((i.path[n:], i.type == pafs.FileType.Directory) for i in infos)

    def _exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        try:
            return self.fs.get_file_info(f"{self.base}/{rel}").type == pafs.FileType.File
        except OSError as err:
            raise self._fault(err) from None

    def _get(self, rel: str) -> None:
        """One file into the mirror (FileNotFoundError when it is gone). ``rel`` is a key
        the store listed: any string (``x/../../y``), so plain parts only, or it would be
        written outside the mirror."""
        if not is_plain_name(rel):
            raise EvalError(
                f"--models {self.shown} holds {rel!r}, which is not a plain path inside the "
                f"run; refused, nothing written outside {self.local}: delete that object "
                "from the store"
            )
        dst = self.local / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
        try:
            with self.fs.open_input_stream(f"{self.base}/{rel}") as src, open(tmp, "wb") as f:
                while chunk := src.read(_CHUNK):
                    f.write(chunk)
            os.replace(tmp, dst)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise self._fault(err) from None
        finally:
            tmp.unlink(missing_ok=True)

    # --- what plm eval asks ------------------------------------------------------------
    def sync(self) -> list[str]:
        """The complete checkpoints that are new since the last call, mirrored."""
        from pipeline.train.tracking import RUN_ID_FILE

        for rel in ("metrics.jsonl", RUN_ID_FILE):
            if self._exists(rel):
                self._get(rel)
        if self._exists(_FINAL):
            self._get(_FINAL)
        tags = [p.rsplit("/", 1)[-1] for p, folder in self._files("checkpoints", False) if folder]
        new = []
        for tag in tags:
            if tag in self.mirrored or (self.only and tag != self.only):
                continue
            if not self._exists(f"checkpoints/{tag}/COMPLETE"):
                continue  # being written: its turn comes at a later sync
            try:
                self._mirror(tag)
            except FileNotFoundError:
                self.skipped.append(tag)
                print(f"[plm eval] skipped {tag}: deleted from {self.shown} (train.keep_last) "
                      "before its turn", flush=True)  # fmt: skip
                continue
            self.mirrored.add(tag)
            new.append(tag)
        return new

    def _mirror(self, tag: str) -> None:
        ckpt = [p for p, folder in self._files(f"checkpoints/{tag}") if not folder]
        bundle = [p for p, folder in self._files(f"bundles/{tag}") if not folder]
        has_bundle = {f"bundles/{tag}/config.yaml", f"bundles/{tag}/tokenizer.json"} <= set(bundle)
        small = [p for p in ckpt if not p.endswith(".pt")]
        weights = [] if has_bundle else [
            p for p in ckpt if p.endswith(".pt") and not p.rsplit("/", 1)[-1].startswith("trainer")
        ]  # fmt: skip
        for rel in (bundle if has_bundle else []) + weights + small:
            if not rel.endswith("/COMPLETE"):
                self._get(rel)
        self._get(f"checkpoints/{tag}/COMPLETE")

    def release(self, tag: str) -> None:
        """The mirrored weights of ``tag``, once its bundle is made."""
        for path in (self.local / "checkpoints" / tag).glob("*.pt"):
            path.unlink()
