"""Model bundles: the self-contained folder a pretraining run hands to fine-tuning/export.

    BUNDLE/config.yaml           format_version, arch, model (the typed config), vocab
                                 (tokenizer kind, size, padded size, roles, sha256), meta
    BUNDLE/tokenizer.json        copied byte for byte from the tokenizer dir
    BUNDLE/tokenizer_meta.json
    BUNDLE/model.safetensors     the state dict; tied weights stored once
    (or, above ``max_shard_bytes``: model-0000K-of-0000N.safetensors and
    model.safetensors.index.json, the layout ``transformers`` writes)

Written tensor by tensor (``BundleWriter``): the file headers are planned from the
model's shapes before any weight arrives, then each tensor's bytes are appended as it
comes, so writing a bundle holds one tensor at a time, never the model (ZeRO-3 gathers
one parameter at a time to rank 0 for it). Read back tensor by tensor as well
(``read_tensors``, ``load_bundle``). Written into a temp folder beside the target and
renamed into place, so a reader never sees a half-written bundle. Same inputs give the
same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import yaml
from pydantic import BaseModel
from torch import Tensor, nn

from pipeline.errors import ConfigError
from pipeline.models.registry import ARCHITECTURES, build_model
from pipeline.storage import is_plain_name

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 1024**3  # per weights file; a larger tensor gets a file of its own
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_meta.json")


def _without_aliases(state_dict: dict[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """Drop the extra names of a tied weight (a wrapper may register it twice): a name the
    model does not expect whose tensor is one it does expect under another name."""
    held = {id(state_dict[n]) for n in expected if n in state_dict}
    return {n: t for n, t in state_dict.items() if n in expected or id(t) not in held}


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


# safetensors' names for torch dtypes (its file format: an 8-byte little-endian header
# length, a JSON header of name -> dtype, shape, data_offsets, then the raw bytes).
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(expected: dict[str, Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The names in model order, cut into files of at most ``max_shard_bytes`` (a tensor
    larger than that alone in its file)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in expected.items():
        if shards[-1] and size + _nbytes(t) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += _nbytes(t)
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [WEIGHTS_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _header(names: list[str], expected: dict[str, Tensor]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = expected[name]
        entries[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + _nbytes(t)],
        }
        offset += _nbytes(t)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


class ShardedWriter:
    """Safetensors weights written one tensor at a time into ``folder``: the headers are
    planned from ``expected`` (name -> a tensor of the right shape and dtype, e.g. on the
    meta device), cut into files of at most ``max_shard_bytes``; ``add`` appends each
    tensor's bytes as it comes, in the order of ``names``; ``close`` adds the index when
    there are several files. One tensor in memory at a time. transformers' layout:
    ``model.safetensors``, or ``model-0000K-of-0000N.safetensors`` with
    ``model.safetensors.index.json``. The folder is the caller's (a temp folder it renames
    into place, or removes on an error)."""

    def __init__(self, folder: Path, expected: dict[str, Tensor], max_shard_bytes: int):
        self.folder, self.expected = Path(folder), expected
        self.names = list(expected)
        self.shards = plan_shards(expected, max_shard_bytes)
        self.files = _shard_names(len(self.shards))
        self._next = 0  # index into names
        self._shard = -1
        self._file: BinaryIO | None = None
        self._left_in_shard = 0

    @property
    def done(self) -> int:
        return self._next

    def add(self, name: str, tensor: Tensor) -> None:
        if self._next >= len(self.names) or name != self.names[self._next]:
            want = self.names[self._next] if self._next < len(self.names) else "nothing more"
            raise ValueError(f"tensors out of order: got {name}, expected {want}")
        want = self.expected[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(
                f"state dict tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(want.shape)}"
            )
        if self._left_in_shard == 0:
            self._open_shard()
        data = tensor.detach().to("cpu", want.dtype).contiguous()
        assert self._file is not None
        self._file.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1
        self._left_in_shard -= 1

    def _open_shard(self) -> None:
        if self._file is not None:
            self._file.close()
        self._shard += 1
        names = self.shards[self._shard]
        self._file = open(self.folder / self.files[self._shard], "wb")  # noqa: SIM115
        self._file.write(_header(names, self.expected))
        self._left_in_shard = len(names)

    def missing(self) -> list[str]:
        return self.names[self._next :]

    def close(self) -> None:
        """Close the last file and write the index (several files); the caller checks
        ``missing()`` first."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if len(self.files) > 1 and not self.missing():
            index = {
                "metadata": {"total_size": sum(_nbytes(t) for t in self.expected.values())},
                "weight_map": {n: self.files[i] for i, s in enumerate(self.shards) for n in s},
            }
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


class BundleWriter:
    """A bundle written one tensor at a time, in the order of ``names`` (the model's
    state-dict order); ``close()`` adds config.yaml and the tokenizer and renames the folder
    into place (an existing bundle is replaced); leaving the ``with`` block on an error
    removes the temp folder. Every tensor is checked against the config's shape before a
    byte of it is written; a missing one fails ``close()``. config.yaml records
    ``weights.max_shard_bytes`` (what the HF export shards by, unless told otherwise).

        with BundleWriter(out, "bert", cfg, tokenizer_dir, meta) as w:
            for name in w.names:
                w.add(name, tensor_of(name))
    """

    def __init__(
        self,
        out_dir: str | Path,
        arch: str,
        model_config: BaseModel,
        tokenizer_dir: str | Path,
        extra_meta: dict[str, Any] | None = None,
        max_shard_bytes: int = MAX_SHARD_BYTES,
    ):
        self.out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unknown arch {arch!r}; available: {', '.join(sorted(ARCHITECTURES))}"
            )
        for name in TOKENIZER_FILES:
            if not (tokenizer_dir / name).is_file():
                raise FileNotFoundError(f"tokenizer dir {tokenizer_dir} has no {name}")
        self.tokenizer_dir = tokenizer_dir
        self.config = {
            "format_version": FORMAT_VERSION,
            "arch": arch,
            "model": model_config.model_dump(mode="json"),
            "vocab": _vocab_info(tokenizer_dir, model_config),
            "meta": extra_meta or {},
            "weights": {"max_shard_bytes": int(max_shard_bytes)},
        }
        self.arch = arch
        self.expected = _expected_state(arch, model_config)
        self.names = list(self.expected)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(
            tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent)
        )
        self.weights = ShardedWriter(self.tmp, self.expected, max_shard_bytes)
        self.shards, self.files = self.weights.shards, self.weights.files

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, name: str, tensor: Tensor) -> None:
        try:
            self.weights.add(name, tensor)
        except ValueError as err:
            raise ValueError(f"bundle {err}") from None

    def close(self) -> Path:
        missing = self.weights.missing()
        try:
            self.weights.close()  # its last flush may find the disk full
            if missing:
                raise ValueError(
                    f"state dict does not match a {self.arch} with this config: "
                    f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
                )
            (self.tmp / CONFIG_FILE).write_text(
                yaml.safe_dump(self.config, sort_keys=True, allow_unicode=True), encoding="utf-8"
            )
            for name in TOKENIZER_FILES:
                shutil.copyfile(self.tokenizer_dir / name, self.tmp / name)
            os.chmod(self.tmp, 0o755)  # mkdtemp makes it 0700
            replace_dir(self.tmp, self.out_dir)
        except BaseException:
            self.abort()
            raise
        return self.out_dir

    def abort(self) -> None:
        """Remove the temp folder, whatever closing its open file says: on a full disk the
        close's flush fails too, and the half-written folder must go all the same (one
        error reaches the caller, the space is free again)."""
        try:
            with contextlib.suppress(OSError):
                self.weights.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def save_bundle(
    out_dir: str | Path,
    arch: str,
    model_config: BaseModel,
    state_dict: dict[str, Tensor],
    tokenizer_dir: str | Path,
    extra_meta: dict[str, Any] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a bundle from a whole state dict (one that fits in memory anyway: fine-tuned
    or small models). Checked against the config before anything is written."""
    writer = BundleWriter(out_dir, arch, model_config, tokenizer_dir, extra_meta, max_shard_bytes)
    with writer:
        state_dict = _without_aliases(state_dict, set(writer.expected))
        _check_against_model(arch, writer.expected, state_dict)
        for name in writer.names:
            writer.add(name, state_dict[name])
    return Path(out_dir)


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
    path = own_file(bundle_dir, CONFIG_FILE)
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


class BundleError(ConfigError):
    """A bundle whose index or files lead outside its folder (``../x``, an absolute path, a
    link to elsewhere): refused before anything there is read. A ConfigError: every
    command prints it as one `plm:` line, exit 2."""

    def __init__(self, message: str):
        super().__init__(message, machine_wide=True)  # about this machine's files


def bundle_file(bundle_dir: Path, name: object, named_by: str) -> Path:
    """File ``name`` of the bundle (``named_by``: the file that names it): a plain file
    name of the folder itself, which resolves inside it."""
    if not is_plain_name(name, parts=1):
        raise BundleError(
            f"{bundle_dir / named_by} names {name!r}, a file outside the bundle {bundle_dir}; "
            "refused, nothing read: use a bundle written by `plm train` or `plm finetune`"
        )
    path = bundle_dir / str(name)
    real, root = path.resolve(), bundle_dir.resolve()
    if real.parent != root:
        raise BundleError(
            f"{path} is a link to {real}, outside the bundle {bundle_dir}; refused, nothing "
            "read: copy the file into the bundle"
        )
    return path


def own_file(bundle_dir: str | Path, name: str) -> Path:
    """File ``name`` of those every bundle has (config.yaml, the tokenizer's), once none
    of them is a link out of the bundle: the one check of every reader of a bundle
    (``read_bundle_config``, ``special_ids``, the tokenizer's readers), so a bundle from
    elsewhere (MLflow, a copy) cannot have ``plm`` read a file outside it."""
    bundle_dir = Path(bundle_dir)
    for own in (CONFIG_FILE, *TOKENIZER_FILES):
        bundle_file(bundle_dir, own, CONFIG_FILE)
    return bundle_dir / name


def weight_files(bundle_dir: str | Path) -> list[Path]:
    """The bundle's weights files: model.safetensors, or the shards its index names, each
    inside the bundle (``bundle_file``)."""
    bundle_dir = Path(bundle_dir)
    index = bundle_dir / INDEX_FILE
    if not index.is_file():
        return [bundle_file(bundle_dir, WEIGHTS_FILE, CONFIG_FILE)]
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BundleError(
            f"{index} is no safetensors index ({type(err).__name__}: {err})"
        ) from None
    return [bundle_file(bundle_dir, f, INDEX_FILE) for f in sorted(names, key=str)]


_DTYPE_OF = {name: dtype for dtype, name in _ST_DTYPES.items()}


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int]:
    """(name -> entry, in file order; where the data starts) of a safetensors file."""
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if entry["dtype"] not in _DTYPE_OF:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, not one of ours")
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    return {k: header[k] for k in order}, 8 + n


def _read_tensor(f: BinaryIO, data_start: int, entry: dict[str, Any]) -> Tensor:
    """One tensor read with plain reads into fresh memory (not through a memory map, whose
    touched pages would stay in the process's resident memory until it is closed)."""
    t = torch.empty(entry["shape"], dtype=_DTYPE_OF[entry["dtype"]])
    begin, end = entry["data_offsets"]
    if end > begin:
        buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        f.seek(data_start + begin)
        got = 0
        while got < len(buf):
            n = f.readinto(buf[got:])
            if not n:
                raise ValueError(f"{f.name}: truncated (tensor at bytes {begin}-{end})")
            got += n
    return t


def tensor_names(bundle_dir: str | Path) -> list[str]:
    """Every tensor name in the bundle, read from the file headers only."""
    names: list[str] = []
    for path in weight_files(bundle_dir):
        with open(path, "rb") as f:
            names.extend(_read_header(f, path)[0])
    return names


def read_tensors(bundle_dir: str | Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor), one at a time, file by file: memory for one tensor, never the
    whole state."""
    for path in weight_files(bundle_dir):
        with open(path, "rb") as f:
            header, start = _read_header(f, path)
            for name, entry in header.items():
                yield name, _read_tensor(f, start, entry)


class BundleTensors:
    """A bundle's tensors by name, each read from its file when asked (one at a time; the
    files stay open, nothing is cached): for readers that need them in another order than
    the files' (the HF export, loading into ZeRO-3 partitions)."""

    def __init__(self, bundle_dir: str | Path):
        self._where: dict[str, tuple[BinaryIO, int, dict[str, Any]]] = {}
        for path in weight_files(bundle_dir):
            f = open(path, "rb")  # noqa: SIM115 (closed with the object)
            header, start = _read_header(f, path)
            self._where.update({name: (f, start, entry) for name, entry in header.items()})

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def get(self, name: str) -> Tensor:
        return _read_tensor(*self._where[name])


def max_shard_bytes_of(config: dict[str, Any]) -> int:
    """The shard size a bundle was written with (config.yaml ``weights``; bundles from
    before it was recorded: the default)."""
    return int((config.get("weights") or {}).get("max_shard_bytes", MAX_SHARD_BYTES))


def check_names(bundle_dir: str | Path, model: nn.Module) -> None:
    """A missing or extra tensor is an error, never silently re-initialised."""
    want, have = set(model.state_dict()), set(tensor_names(bundle_dir))
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise ValueError(
            f"{bundle_dir}: weights do not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


@torch.no_grad()
def copy_tensors(targets: dict[str, Tensor], tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Each (name, tensor) copied into ``targets[name]`` (a model's parameters and buffers)."""
    for name, t in tensors:
        targets[name].copy_(t)


def load_bundle(bundle_dir: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model from config.yaml and copy the weights in tensor by tensor (the
    model plus one tensor in memory; tied weights are one parameter in our models, so
    loading it once ties both uses); the model in eval mode."""
    bundle_dir = Path(bundle_dir)
    config = read_bundle_config(bundle_dir)
    config_cls, _ = ARCHITECTURES[config["arch"]]
    model = build_model(config["arch"], config_cls.model_validate(config["model"]))
    check_names(bundle_dir, model)
    copy_tensors(model.state_dict(keep_vars=True), read_tensors(bundle_dir))
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


def run_or_bundle(path: str | Path) -> Path:
    """The bundle folder ``path`` names: a bundle folder, or a training run's folder
    (``train.out_dir``), whose final bundle (``RUN_DIR/bundles/final``) it means. Raises
    BundleNotFound naming what to give instead (a run without its final bundle: the
    bundles it has, and that the run did not finish)."""
    folder = Path(path)
    if (folder / CONFIG_FILE).is_file():
        return folder
    final = folder / "bundles" / "final"
    if (final / CONFIG_FILE).is_file():
        return final
    if (folder / "checkpoints").is_dir() or (folder / "bundles").is_dir():
        tags = sorted(p.parent.name for p in (folder / "bundles").glob(f"*/{CONFIG_FILE}"))
        have = f"; its bundles: {', '.join(str(folder / 'bundles' / t) for t in tags)}"
        raise BundleNotFound(
            f"{folder} is a training run without its final bundle {final} (the run has not "
            f"finished: resume it with the same `plm train` command){have if tags else ''}"
        )
    raise BundleNotFound(
        f"{folder} is not a model bundle: no {CONFIG_FILE}; give a bundle folder "
        "(RUN_DIR/bundles/final) or a training run's folder (RUN_DIR)"
    )


def bundle_in(folder: Path) -> Path | None:
    """The bundle, or fine-tuned folder, inside a downloaded logged model
    (``artifacts/<its folder name>``)."""
    found = [p.parent for pattern in ("artifacts/*/config.yaml", "artifacts/*/finetune.yaml")
             for p in Path(folder).glob(pattern)]  # fmt: skip
    return found[0] if len(found) == 1 and (Path(folder) / "MLmodel").is_file() else None


def special_ids(bundle: Path) -> set[int]:
    """The ids of a bundle's special tokens (its tokenizer_meta.json)."""
    meta = json.loads(own_file(bundle, "tokenizer_meta.json").read_text(encoding="utf-8"))
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
