"""Where a model comes from: ``models:/NAME@ALIAS``, ``models:/NAME/VERSION``,
``runs:/RUN_ID/PATH`` (downloaded from MLflow) or a local folder; and the fine-tuned
model folder this stage writes.

A fine-tuned model folder::

    OUT/backbone/            a model bundle (pipeline.models.bundle) with the tuned weights
    OUT/head.safetensors     the task head (+ scalar mix / BiLSTM / CRF when used)
    OUT/finetune.yaml        format_version, task config, label map, mode, metrics,
                             where the backbone came from (uri, run id, model version)

``load_finetuned(OUT)`` rebuilds the TaskModel from these three.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file

from pipeline.finetune.config import FinetuneError, TaskSection

FINETUNE_FILE = "finetune.yaml"
HEAD_FILE = "head.safetensors"
BACKBONE_DIR = "backbone"
FORMAT_VERSION = 1


@dataclass
class ModelSource:
    path: Path  # local folder
    uri: str
    run_id: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


def resolve_source(uri: str, tracking_uri: str | None, download_to: Path) -> ModelSource:
    """A local folder for ``uri``; MLflow URIs are downloaded into ``download_to``
    (``fetch_bundle``: MLflow's process-wide tracking URI is left alone).
    Raises FinetuneError naming the URI (and the store) when it does not exist."""
    if uri.startswith(("models:/", "runs:/")):
        from mlflow.exceptions import MlflowException

        from pipeline.models.bundle import BundleNotFound, fetch_bundle, registered_version
        from pipeline.tracking_uri import resolve_tracking_uri

        store = resolve_tracking_uri(tracking_uri)
        if download_to.exists():
            shutil.rmtree(download_to)
        try:
            if uri.startswith("runs:/"):
                run_id = uri[len("runs:/") :].split("/", 1)[0]
                path = fetch_bundle(uri, store, download_to, require=None)
                return ModelSource(path, uri, run_id)
            mv, _ = registered_version(uri, store)
            path = fetch_bundle(uri, store, download_to, require=None)
        except MlflowException as err:
            raise FinetuneError(
                f"model URI {uri!r} does not exist in the MLflow store {store}: "
                f"{err.message.splitlines()[0]}; list models with `mlflow ui` or set "
                "mlflow.tracking_uri / MLFLOW_TRACKING_URI"
            ) from None
        except BundleNotFound as err:
            raise FinetuneError(
                f"model URI {uri!r} does not exist or holds no bundle: {err}"
            ) from None
        return ModelSource(path, uri, mv.run_id, mv.name, str(mv.version), dict(mv.tags or {}))
    path = Path(uri)
    if not path.exists():
        raise FinetuneError(
            f"model source {uri!r} does not exist: give models:/NAME@ALIAS, "
            "runs:/RUN_ID/model or a local bundle folder"
        )
    return ModelSource(path, uri)


def load_backbone(source: ModelSource):
    """(model, bundle config) from a pretrained bundle; clear errors for anything else."""
    from pipeline.models.bundle import load_bundle

    path = source.path
    if (path / FINETUNE_FILE).is_file():
        raise FinetuneError(
            f"model source {source.uri!r} is a fine-tuned task model, not a pretrained bundle; "
            f"fine-tune from its backbone ({path / BACKBONE_DIR}) or use `plm predict` with it"
        )
    if not path.is_dir() or not (path / "config.yaml").is_file():
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else [path.name]
        raise FinetuneError(
            f"model source {source.uri!r} is not a model bundle: no config.yaml (found: "
            f"{', '.join(found) or 'nothing'}); point it at a bundle written by `plm train`"
        )
    try:
        return load_bundle(path)
    except (ValueError, RuntimeError, FileNotFoundError, KeyError, OSError) as err:
        raise FinetuneError(
            f"model source {source.uri!r} is an incompatible bundle: {str(err).splitlines()[0]}"
        ) from None


# ----------------------------------------------------------------------------- saving


def save_finetuned(
    out: Path,
    model,
    state: dict[str, torch.Tensor],
    bundle_config: dict[str, Any],
    tokenizer_dir: Path,
    meta: dict[str, Any],
) -> Path:
    """Write the fine-tuned folder atomically (temp folder + rename)."""
    from pipeline.models.bundle import replace_dir, save_bundle
    from pipeline.models.registry import ARCHITECTURES

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        arch = bundle_config["arch"]
        config_cls, _ = ARCHITECTURES[arch]
        backbone = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
        head = {
            k: v.detach().cpu().contiguous()
            for k, v in state.items()
            if not k.startswith("backbone.")
        }
        save_bundle(
            tmp / BACKBONE_DIR,
            arch,
            config_cls.model_validate(bundle_config["model"]),
            backbone,
            tokenizer_dir,
            {**bundle_config.get("meta", {}), "finetuned": True},
        )
        save_file(head, str(tmp / HEAD_FILE), metadata={"format": "pt"})
        (tmp / FINETUNE_FILE).write_text(
            yaml.safe_dump({"format_version": FORMAT_VERSION, **meta}, sort_keys=False),
            encoding="utf-8",
        )
        os.chmod(tmp, 0o755)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def build_task_model(backbone, meta: dict[str, Any]):
    from pipeline.finetune.heads import TaskModel

    task = TaskSection.model_validate(meta["task"])
    return TaskModel(
        backbone,
        task.type,
        max(1, len(meta.get("labels", []))),
        mode=meta["mode"],
        pooling=task.pooling,
        crf=task.crf,
        head_dropout=task.head_dropout,
        feature_hidden=task.feature_hidden,
        n_feature_layers=int(meta.get("n_feature_layers", 0)),
    )


def load_finetuned(path: str | Path):
    """(TaskModel in eval mode, finetune meta, backbone bundle dir) from a fine-tuned folder."""
    from pipeline.models.bundle import load_bundle

    path = Path(path)
    meta_file = path / FINETUNE_FILE
    if not meta_file.is_file():
        raise FinetuneError(
            f"{path} is not a fine-tuned model (no {FINETUNE_FILE}); `plm finetune` writes one"
        )
    meta = yaml.safe_load(meta_file.read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise FinetuneError(
            f"{meta_file}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    backbone, _ = load_bundle(path / BACKBONE_DIR)
    model = build_task_model(backbone, meta)
    head = load_file(str(path / HEAD_FILE))
    missing, unexpected = model.load_state_dict(head, strict=False)
    missing = [k for k in missing if not k.startswith("backbone.")]
    if missing or unexpected:
        raise FinetuneError(
            f"{path / HEAD_FILE} does not fit the task: missing {missing}, unexpected {unexpected}"
        )
    model.eval()
    return model, meta, path / BACKBONE_DIR
