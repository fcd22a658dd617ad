"""Model bundles: the self-contained folder a pretraining run hands to fine-tuning/export.

    BUNDLE/config.yaml           format_version, arch, model (the typed config), vocab
                                 (tokenizer kind, size, padded size, roles, sha256), meta
    BUNDLE/tokenizer.json        copied byte for byte from the tokenizer dir
    BUNDLE/tokenizer_meta.json
    BUNDLE/model.safetensors     the state dict; tied weights stored once

Written into a temp folder beside the target and renamed into place, so a reader never
sees a half-written bundle. Same inputs give the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pipeline.models.registry import ARCHITECTURES, build_model

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_meta.json")


def _dedupe_shared(state_dict: dict[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share memory (tied weights held under two names):
    keep the name the model expects, drop the aliases. Our models reference the tied
    matrix under one name only, so for them this is a no-op; it protects against state
    dicts from wrappers that register the tied parameter twice."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out: dict[str, Tensor] = {}
    for name in sorted(state_dict, key=lambda n: (n not in expected, n)):
        t = state_dict[name]
        if t.device.type != "meta" and t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:
                continue
            seen[key] = name
        # detach + cpu + contiguous + clone: a standalone tensor safetensors can write
        out[name] = t.detach().to("cpu").contiguous().clone()
    return out


def _expected_state(arch: str, config: BaseModel) -> dict[str, Tensor]:
    with torch.device("meta"):  # shapes only, no memory, no init cost
        return build_model(arch, config).state_dict()


def _check_against_model(arch: str, expected: dict[str, Tensor], state: dict[str, Tensor]) -> None:
    """Fail before writing anything if the state dict does not fit the config."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match a {arch} with this config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(
                f"state dict tensor {name} has shape {tuple(state[name].shape)}, "
                f"the config needs {tuple(t.shape)}"
            )


def _vocab_info(tokenizer_dir: Path, config: BaseModel) -> dict[str, Any]:
    meta = json.loads((tokenizer_dir / "tokenizer_meta.json").read_text(encoding="utf-8"))
    if meta["vocab_size"] != config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_dir} has vocab_size {meta['vocab_size']} but the model "
            f"config has {config.vocab_size}; build the model from this tokenizer"
        )
    return {
        "kind": meta.get("kind"),
        "vocab_size": meta["vocab_size"],
        "padded_vocab_size": config.padded_vocab_size,
        "roles": meta.get("roles", {}),
        "sha256": meta.get("sha256"),
    }


def save_bundle(
    out_dir: str | Path,
    arch: str,
    model_config: BaseModel,
    state_dict: dict[str, Tensor],
    tokenizer_dir: str | Path,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write a bundle atomically (temp folder + rename; an existing bundle is replaced)."""
    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir)
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; available: {', '.join(sorted(ARCHITECTURES))}")
    for name in TOKENIZER_FILES:
        if not (tokenizer_dir / name).is_file():
            raise FileNotFoundError(f"tokenizer dir {tokenizer_dir} has no {name}")
    expected = _expected_state(arch, model_config)
    state = _dedupe_shared(state_dict, set(expected))
    _check_against_model(arch, expected, state)

    config = {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "model": model_config.model_dump(mode="json"),
        "vocab": _vocab_info(tokenizer_dir, model_config),
        "meta": extra_meta or {},
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / CONFIG_FILE).write_text(
            yaml.safe_dump(config, sort_keys=True, allow_unicode=True), encoding="utf-8"
        )
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, tmp / name)
        save_file(
            state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"}
        )  # one key: the map order is random
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing target is moved aside first, then deleted."""
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "bundle")
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)


def read_bundle_config(bundle_dir: str | Path) -> dict[str, Any]:
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{bundle_dir} is not a model bundle: no {CONFIG_FILE}")
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {config.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    if config.get("arch") not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unknown arch {config.get('arch')!r}; "
            f"available: {', '.join(sorted(ARCHITECTURES))}"
        )
    return config


def load_bundle(bundle_dir: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model from config.yaml, load the weights strictly; model in eval mode."""
    bundle_dir = Path(bundle_dir)
    config = read_bundle_config(bundle_dir)
    config_cls, _ = ARCHITECTURES[config["arch"]]
    model = build_model(config["arch"], config_cls.model_validate(config["model"]))
    state = load_file(str(bundle_dir / WEIGHTS_FILE))
    # strict: a missing or extra tensor is an error, never silently re-initialised. Tied
    # weights are one parameter in our models, so loading it once ties both uses.
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, config


MLFLOW_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/")


class BundleNotFound(FileNotFoundError):
    """A model reference that names no bundle (missing folder, unknown MLflow model/run)."""


def fetch_bundle(
    ref: str | Path,
    tracking_uri: str | None = None,
    dst: str | Path | None = None,
    require: str | None = CONFIG_FILE,
) -> Path:
    """A local bundle folder for ``ref``: a bundle folder, ``models:/NAME@ALIAS`` (or
    ``/VERSION``) or ``runs:/RUN_ID/PATH``. MLflow URIs are downloaded (into ``dst``,
    else a temp folder) from ``tracking_uri``, else MLFLOW_TRACKING_URI, else the local
    store training writes to, without changing MLflow's process-wide tracking URI (which
    would also set MLFLOW_TRACKING_URI for every subprocess started later).
    ``require``: the file the folder must hold (None: any folder, e.g. a fine-tuned
    model, whose loader checks it). Raises BundleNotFound naming the reference and store."""
    text = str(ref)
    if not text.startswith(MLFLOW_SCHEMES):
        if require is not None and not (Path(text) / require).is_file():
            raise BundleNotFound(
                f"{text!r} is not a model bundle (no {CONFIG_FILE}); give a bundle folder "
                "(e.g. RUN_DIR/bundles/final), models:/NAME@ALIAS or runs:/RUN_ID/model"
            )
        return Path(text)
    import mlflow
    from mlflow.exceptions import MlflowException

    from pipeline.tracking_uri import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    dst = Path(dst or tempfile.mkdtemp(prefix="plm-bundle-"))
    try:
        source = _registered_version_uri(text, uri) if text.startswith("models:/") else text
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=source, dst_path=str(dst), tracking_uri=uri
        )
    except (MlflowException, OSError) as err:
        raise BundleNotFound(
            f"cannot fetch {text!r} from MLflow at {uri} ({type(err).__name__}: "
            f"{str(err)[:300]}); check the name/alias or run id and the tracking URI"
        ) from None
    if not (Path(local) / CONFIG_FILE).is_file():
        local = bundle_in(Path(local)) or local  # an MLflow model: its artifact "bundle"
    if require is not None and not (Path(local) / require).is_file():
        raise BundleNotFound(f"{text!r} downloaded to {local}, which holds no model bundle")
    return Path(local)


def bundle_in(folder: Path) -> Path | None:
    """The bundle, or fine-tuned folder, inside a downloaded logged model
    (``artifacts/<its folder name>``)."""
    found = [p.parent for pattern in ("artifacts/*/config.yaml", "artifacts/*/finetune.yaml")
             for p in Path(folder).glob(pattern)]  # fmt: skip
    return found[0] if len(found) == 1 and (Path(folder) / "MLmodel").is_file() else None


def special_ids(bundle: Path) -> set[int]:
    """The ids of a bundle's special tokens (its tokenizer_meta.json)."""
    meta = json.loads((bundle / "tokenizer_meta.json").read_text(encoding="utf-8"))
    return {int(i) for i in meta.get("special_tokens", {}).values()}


def registered_version(ref: str, uri: str):
    """(the ModelVersion that ``models:/NAME@ALIAS[/PATH]`` or ``models:/NAME/VERSION[/PATH]``
    names, PATH) asked of the registry at ``uri``; MlflowException if there is none."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    parts = ref[len("models:/") :].split("/")
    if "@" in parts[0]:
        name, alias = parts[0].split("@", 1)
        return client.get_model_version_by_alias(name, alias), "/".join(parts[1:])
    if len(parts) < 2:
        raise BundleNotFound(f"{ref!r}: give models:/NAME@ALIAS or models:/NAME/VERSION")
    return client.get_model_version(parts[0], parts[1]), "/".join(parts[2:])


def _registered_version_uri(ref: str, uri: str) -> str:
    """Where the artifacts of a ``models:/`` reference live, asked of the registry at
    ``uri``. (MLflow's own models:/ resolver reads the process-wide registry URI whatever
    registry_uri it is given.)"""
    from mlflow import MlflowClient

    version, rest = registered_version(ref, uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    base = client.get_model_version_download_uri(version.name, version.version).rstrip("/")
    return f"{base}/{rest}" if rest else base
