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

import contextlib
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


def load_backbone(source: ModelSource, ds_config: dict[str, Any] | None = None):
    """(model, bundle config) from a pretrained bundle; clear errors for anything else.

    The weights are read one tensor at a time (the model plus one tensor in memory). Under a
    ZeRO-3 ``ds_config`` (collective: every rank calls it) the model is built partitioned
    (``partitioned_build``) and filled in place, one parameter at a time
    (``load_into_partitions``): no rank ever holds the whole model."""
    from pipeline.models.bundle import (
        BundleError,
        check_names,
        load_bundle,
        own_file,
        read_bundle_config,
    )

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
    own_file(path, "config.yaml")  # a link out of it: refused as itself, before any read
    try:
        if not partitioned(ds_config):
            return load_bundle(path)
        from pipeline.models.registry import ARCHITECTURES, build_model
        from pipeline.train.engine import partitioned_build

        config = read_bundle_config(path)
        config_cls, _ = ARCHITECTURES[config["arch"]]
        model_cfg = config_cls.model_validate(config["model"])
        with partitioned_build(ds_config):
            model = build_model(config["arch"], model_cfg)
        check_names(path, model)
    except BundleError:  # a file outside the bundle: its own line, not "incompatible"
        raise
    except (ValueError, RuntimeError, FileNotFoundError, KeyError, OSError) as err:
        raise FinetuneError(
            f"model source {source.uri!r} is an incompatible bundle: {str(err).splitlines()[0]}"
        ) from None
    load_into_partitions(model, path)
    model.eval()
    return model, config


def partitioned(ds_config: dict[str, Any] | None) -> bool:
    """Whether a DeepSpeed config builds its model partitioned (ZeRO-3)."""
    from pipeline.train.engine import zero_stage

    return ds_config is not None and zero_stage(ds_config) == 3


@torch.no_grad()
def load_into_partitions(model, bundle_dir: Path) -> None:
    """Copy a bundle's weights into a model built under ``deepspeed.zero.Init``, one
    parameter at a time (collective: every rank walks the same names in the same order).
    Each partitioned parameter is gathered alone (``GatheredParameters([p],
    modifier_rank=0)``), rank 0 reads that tensor from the bundle into it, and leaving the
    block re-partitions it from rank 0; buffers (whole on every rank) are read by every
    rank. At most one whole parameter and one tensor in memory."""
    import deepspeed
    import torch.distributed as dist

    from pipeline.models.bundle import BundleTensors

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tensors = BundleTensors(bundle_dir)
    for name, target in model.state_dict(keep_vars=True).items():
        if hasattr(target, "ds_id"):
            with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                if rank0:
                    target.data.copy_(tensors.get(name))
        else:
            target.copy_(tensors.get(name))


# ----------------------------------------------------------------------------- saving


class BestWeights:
    """The best weights so far, kept on disk instead of in memory: ``save(engine)``
    (collective) streams the engine's weights one parameter at a time (``full_tensors``)
    and rank 0 writes them into ``folder`` as they come: the backbone through a
    BundleWriter (``folder/backbone``, replacing the previous best), the small task head
    into ``folder/head.safetensors``. No rank holds a whole copy of the model."""

    def __init__(self, folder: Path, bundle_config: dict[str, Any], tokenizer_dir: Path):
        self.folder, self.bundle_config, self.tokenizer_dir = folder, bundle_config, tokenizer_dir
        self.saved = False

    def save(self, engine) -> None:
        import torch.distributed as dist

        from pipeline.models.bundle import BundleWriter, max_shard_bytes_of
        from pipeline.models.registry import ARCHITECTURES
        from pipeline.train.full_weights import full_tensors

        writer, head = None, {}
        if dist.get_rank() == 0:
            arch = self.bundle_config["arch"]
            config_cls, _ = ARCHITECTURES[arch]
            self.folder.mkdir(parents=True, exist_ok=True)
            writer = BundleWriter(
                self.folder / BACKBONE_DIR,
                arch,
                config_cls.model_validate(self.bundle_config["model"]),
                self.tokenizer_dir,
                {**self.bundle_config.get("meta", {}), "finetuned": True},
                max_shard_bytes=max_shard_bytes_of(self.bundle_config),
            )
        with writer if writer is not None else contextlib.nullcontext():  # closes or aborts
            for name, t in full_tensors(engine):  # every rank, to the end
                if writer is None:
                    continue
                if name.startswith("backbone."):
                    writer.add(name[len("backbone.") :], t)
                else:
                    head[name] = t.contiguous()
        if writer is not None:
            save_file(head, str(self.folder / HEAD_FILE), metadata={"format": "pt"})
        self.saved = True


def save_finetuned(out: Path, best: Path, meta: dict[str, Any]) -> Path:
    """The fine-tuned folder from the best weights on disk (``BestWeights``): they are moved
    (not copied) beside finetune.yaml in a temp folder renamed into place."""
    from pipeline.models.bundle import replace_dir

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.replace(best / BACKBONE_DIR, tmp / BACKBONE_DIR)
        os.replace(best / HEAD_FILE, tmp / HEAD_FILE)
        (tmp / FINETUNE_FILE).write_text(
            yaml.safe_dump({"format_version": FORMAT_VERSION, **meta}, sort_keys=False),
            encoding="utf-8",
        )
        os.chmod(tmp, 0o755)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(best, ignore_errors=True)
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
    from pipeline.models.bundle import bundle_file, load_bundle

    path = Path(path)
    # Its three parts, none a link out of the folder (a model from MLflow, a copy).
    meta_file, head_file, backbone_dir = (
        bundle_file(path, name, FINETUNE_FILE) for name in (FINETUNE_FILE, HEAD_FILE, BACKBONE_DIR)
    )
    if not meta_file.is_file():
        raise FinetuneError(
            f"{path} is not a fine-tuned model (no {FINETUNE_FILE}); `plm finetune` writes one"
        )
    meta = yaml.safe_load(meta_file.read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise FinetuneError(
            f"{meta_file}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    backbone, _ = load_bundle(backbone_dir)
    model = build_task_model(backbone, meta)
    head = load_file(str(head_file))
    missing, unexpected = model.load_state_dict(head, strict=False)
    missing = [k for k in missing if not k.startswith("backbone.")]
    if missing or unexpected:
        raise FinetuneError(
            f"{head_file} does not fit the task: missing {missing}, unexpected {unexpected}"
        )
    model.eval()
    return model, meta, backbone_dir
