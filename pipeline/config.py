"""Typed experiment configuration: YAML file + dotted ``key=value`` overrides.

Every section forbids unknown keys, so a misspelled key fails at load time with its
full dotted path, before any process or engine starts.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from pipeline.errors import ConfigError
from pipeline.storage import (
    is_uri,
    local_path_refusal,
    redact_uri,
    store_uri_refusal,
    tracking_uri_refusal,
    uri_secret_part,
)

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout, when there is one
# The presets, DeepSpeed JSONs and example configs, shipped in the wheel as package data
# (pipeline/configs; in a checkout a link to the top-level configs/).
PACKAGE_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = PACKAGE_DIR / "configs"


def config_file(path: str | Path) -> Path:
    """``path`` as given (relative to the cwd) when it exists there; else a path that starts
    with ``configs/`` found among the shipped configs, so ``configs/test/bert-tiny.yaml``
    and ``configs/deepspeed/zero2.json`` work from any directory, installed or not."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    shipped = PACKAGE_DIR / p
    return shipped if p.parts[:1] == ("configs",) and shipped.is_file() else p


T = TypeVar("T", bound=BaseModel)


BUNDLE_OR_MLFLOW = "a bundle folder, models:/NAME@ALIAS or runs:/RUN_ID/model"
DEEPSPEED_HINT = "give auto, a DeepSpeed JSON file on this machine, or its keys inline"


def refuse_uri(alternative: str = ""):
    def check(value: Any) -> Any:
        if is_uri(value):
            raise PydanticCustomError(
                "local_path",
                "{value} is a URI",
                {"value": redact_uri(value), "alternative": alternative},
            )
        return value

    check.path_kind = "local"  # type: ignore[attr-defined]  # read by path_kind
    return AfterValidator(check)


def _refuse_secrets(value: Any) -> Any:
    if isinstance(value, str) and uri_secret_part(value):
        ctx = {"value": redact_uri(value)}
        raise PydanticCustomError("store_uri", "{value} carries secrets", ctx)
    return value


_refuse_secrets.path_kind = "store"  # type: ignore[attr-defined]  # read by path_kind


def _refuse_tracking_secrets(value: Any) -> Any:
    if (uri_secret_part(value) or "").startswith("user part"):  # a query is MLflow's own
        raise PydanticCustomError("tracking_uri", "{value} carries a user part",
                                  {"value": redact_uri(value)})  # fmt: skip
    return value


# Config field types: a local path (a URI refused, naming the key), a bundle reference
# (a local folder or an MLflow URI, never a filesystem URI), a local path or a store URI.
LocalPath = Annotated[str, refuse_uri()]
BundleRef = Annotated[str, refuse_uri(f"give {BUNDLE_OR_MLFLOW}")]
StorePath = Annotated[str, AfterValidator(_refuse_secrets)]
TrackingUri = Annotated[str, AfterValidator(_refuse_tracking_secrets)]  # no user:pass@


def local_path_type(alternative: str) -> Any:
    """A LocalPath whose refusal says where a URI is taken instead."""
    return Annotated[str, refuse_uri(alternative)]


def path_kind(field: FieldInfo) -> str | None:
    """The kind of path a key takes: "local" (a LocalPath, or a list of them), "store" (a
    StorePath), or None; a command-line flag setting the key checks it before any work."""
    found, todo = list(field.metadata), [field.annotation]
    while todo:
        t = todo.pop()
        found += getattr(t, "__metadata__", ())  # Annotated[str, AfterValidator(...)]
        todo += typing.get_args(t)
    kinds = {getattr(getattr(v, "func", None), "path_kind", None) for v in found}
    return next((k for k in ("local", "store") if k in kinds), None)


def value_type(field: FieldInfo) -> type | None:
    """The scalar type a key takes (bool, int, float, str; a path is a str), None for a
    list or a union of types, or the section class of a key that holds a section."""
    t = field.annotation
    if typing.get_origin(t) in (Union, UnionType):  # `int | None`: int
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) != 1:
            return None
        t = args[0]
    if typing.get_origin(t) is Annotated:
        t = typing.get_args(t)[0]
    if t in (bool, int, float, str) or (isinstance(t, type) and issubclass(t, BaseModel)):
        return t
    return None


URI_ERRORS = ("local_path", "store_uri", "tracking_uri")  # each said in one line


def uri_error_line(err: ValidationError) -> str | None:
    """The one line of a URI refused by a LocalPath / StorePath / TrackingUri key, or None."""
    for e in err.errors():
        if e["type"] in URI_ERRORS:
            key = ".".join(str(p) for p in e["loc"])
            ctx = e.get("ctx") or {}
            if e["type"] == "local_path":
                return local_path_refusal(key, ctx["value"], ctx.get("alternative", ""))
            if e["type"] == "tracking_uri":
                return tracking_uri_refusal(key, ctx["value"])
            return store_uri_refusal(key, ctx["value"])
    return None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(BaseModel):
    """``arch`` + ``preset`` (a file in configs/models/) + any preset field as an override.

    Extra keys are allowed here and validated against the architecture's own typed
    config when the model is resolved (``pipeline.models.registry``).
    """

    model_config = ConfigDict(extra="allow")
    arch: str
    preset: str | None = None


class MlmConfig(Strict):
    probability: float = Field(0.15, gt=0, lt=1)  # share of tokens selected for prediction
    mask_fraction: float = Field(0.8, ge=0, le=1)  # of the selected: replaced by [MASK]
    random_fraction: float = Field(0.1, ge=0, le=1)  # of the selected: a random token
    static: bool = False  # True: one fixed mask per sample (seeded), as original BERT
    whole_word: bool = False
    # n-gram masking (ALBERT): spans of 1..ngram whole words, P(n) ~ 1/n; 1 = off.
    ngram: int = Field(1, ge=1, le=8)
    # mlm only: window (one doc cut anywhere), full_sentences (RoBERTa: whole sentences
    # packed across documents, </s> between them), doc_sentences (never crossing a document)
    packing: Literal["window", "full_sentences", "doc_sentences"] = "window"


class NspConfig(Strict):
    random_next_probability: float = Field(0.5, ge=0, le=1)
    short_seq_probability: float = Field(0.1, ge=0, le=1)


class SopConfig(Strict):
    swap_probability: float = Field(0.5, ge=0, le=1)  # B before A (label 1)
    short_seq_probability: float = Field(0.1, ge=0, le=1)


class ClmConfig(Strict):
    reset_position_ids: bool = False  # positions restart at each document
    block_cross_document_attention: bool = False  # tokens attend only within their document


class Word2vecConfig(Strict):
    """word2vec's data knobs (mode, window, negatives are the model's: configs/models/)."""

    noise_power: float = Field(0.75, ge=0, le=1)  # negatives ~ unigram count ** noise_power
    subsample: float = Field(0.0, ge=0)  # Mikolov's t (e.g. 1e-4); 0: keep every token
    count_max_tokens: int = Field(100_000_000, gt=0)  # train tokens read to count unigrams


class PlmConfig(Strict):
    """XLNet's permutation LM (see pipeline/objectives/plm.py)."""

    k: float = Field(6.0, gt=1)  # partial prediction: the last 1/K of each order is predicted
    max_span: int = Field(5, ge=1)  # predicted spans of 1..max_span tokens, P(n) ~ 1/n
    reuse_len: int | None = Field(None, gt=0)  # stream stride; None: the model's reuse_len


class RtdConfig(Strict):
    """ELECTRA: loss = generator MLM loss + disc_weight * replaced-token-detection loss."""

    disc_weight: float = Field(50.0, ge=0)  # the paper's lambda


class DistillConfig(Strict):
    """DistilBERT: loss = alpha_ce * soft CE(T) + alpha_mlm * MLM + alpha_cos * cosine."""

    teacher: BundleRef = ""  # bundle dir, runs:/RUN_ID/model or models:/NAME@ALIAS
    tracking_uri: TrackingUri | None = None  # for URIs; None: MLFLOW_TRACKING_URI or local
    temperature: float = Field(2.0, gt=0)
    alpha_ce: float = Field(5.0, ge=0)
    alpha_mlm: float = Field(2.0, ge=0)
    alpha_cos: float = Field(1.0, ge=0)
    layers: list[int] | None = None  # teacher layer per student layer; None: every other one


class ErnieStage(Strict):
    masking: Literal["basic", "phrase", "entity"]
    until: float = Field(gt=0, le=1)  # this stage ends at this fraction of train.max_steps


class ErnieConfig(Strict):
    """ERNIE 1.0's knowledge masking, in stages (see pipeline/objectives/ernie.py)."""

    stages: list[ErnieStage] = Field(
        default_factory=lambda: [
            ErnieStage(masking="basic", until=0.4),
            ErnieStage(masking="phrase", until=0.7),
            ErnieStage(masking="entity", until=1.0),
        ],
        min_length=1,
    )
    phrase_max_words: int = Field(3, ge=2)  # non-Chinese text: phrases of 2..N words
    nsp: bool = True  # ERNIE 1.0 keeps next-sentence prediction; false: MLM only


class ObjectiveSection(Strict):
    kind: str = "mlm+nsp"  # mlm, mlm+nsp, clm, ... (validated by pipeline.objectives)
    mlm: MlmConfig = MlmConfig()
    nsp: NspConfig = NspConfig()
    sop: SopConfig = SopConfig()
    clm: ClmConfig = ClmConfig()
    rtd: RtdConfig = RtdConfig()
    distill: DistillConfig = DistillConfig()
    ernie: ErnieConfig = ErnieConfig()
    word2vec: Word2vecConfig = Word2vecConfig()
    plm: PlmConfig = PlmConfig()


class SourceSpec(Strict):
    """One prepared data dir of a mixture (``data.sources``)."""

    path: StorePath  # a data dir: a local folder or a URI
    weight: float = Field(1.0, gt=0)  # normalised over the sources
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")  # default: the folder's name


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
               "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1.5g"``, ``"1048576"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes or e.g. 2GiB, 500MB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


_CacheDir = local_path_type(
    "the block cache lives on the node's own disk (data.path takes the data dir's URI)"
)


class DataSection(Strict):
    path: StorePath | None = None  # one data dir (a local folder or a URI), or:
    sources: list[SourceSpec] | None = None  # a weighted mixture of data dirs (path: null)
    seq_len: int = Field(128, gt=8)
    workers: int = Field(2, ge=0)
    verify_checksums: bool = True
    on_bad_shard: Literal["error", "skip"] = "error"
    # A data dir on an object store (data.path=s3://bucket/prefix, any pyarrow URI): its
    # blocks are fetched by range reads into a node-local cache (pipeline/data/remote.py).
    # cache_dir null: $XDG_CACHE_HOME/plm/blocks if XDG_CACHE_HOME is set, else
    # $TMPDIR/plm-cache-<uid> (/tmp/plm-cache-<uid>). cache_bytes bounds the cached blocks
    # (bytes, or a size such as 2GiB / 500MB; 0: none kept); prefetch_blocks: blocks
    # fetched in the background at once ahead of the reader (0: none).
    cache_dir: _CacheDir | None = None
    cache_bytes: int = Field(2 << 30, ge=0)
    prefetch_blocks: int = Field(4, ge=0, le=64)

    @field_validator("cache_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("cache_dir")
    @classmethod
    def _local_dir(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("an empty folder name: the block cache lives on the node's own disk")
        return value

    @model_validator(mode="after")
    def _one_kind_of_data(self) -> DataSection:
        if (self.path is None) == (self.sources is None):
            raise ValueError(
                "give data.path (one data dir) or data.sources (a mixture), not both: with "
                "data.sources set data.path=null"
            )
        if self.sources is not None:
            if not self.sources:
                raise ValueError("data.sources is empty: list at least one {path, weight}")
            names = self.source_names()
            if len(set(names)) != len(names):
                raise ValueError(
                    f"data.sources names {names} repeat: give each source a distinct `name`"
                )
        return self

    def source_names(self) -> list[str]:
        """The metric name of each source (``eval_loss/<name>``)."""
        if self.sources is None:
            return [Path(self.path or ".").name or "data"]
        return [s.name or Path(s.path).name for s in self.sources]


class TrainSection(Strict):
    max_steps: int = Field(1000, gt=0)
    micro_batch_size: int = Field(32, gt=0)
    grad_accum: int = Field(1, gt=0)
    # Samples per optimizer step over all ranks. Set, it fixes grad_accum on any number of
    # ranks (global_batch / (micro_batch_size x ranks)), which an elastic run needs: the
    # same batch whichever hosts are up. Unset: micro_batch_size x grad_accum x ranks.
    global_batch: int | None = Field(None, gt=0)
    lr: float = Field(1.0e-4, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    grad_clip: float = Field(1.0, ge=0)
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    activation_checkpointing: bool = False
    # Encoders compute on real tokens only (their padding packed away; causal models with
    # block_cross_document_attention attend per document without a [B,T,T] mask). Same
    # examples and loss as the padded path; false keeps the padded path. None: on the CPU
    # only (on a GPU the nested-jagged path is slower than the padded one: BENCHMARKS.md,
    # GPU bench).
    unpad: bool | None = None
    # torch.compile of each repeated layer (regional: one graph reused by every layer)
    compile: bool = False
    log_every: int = Field(10, gt=0)
    eval_every: int = Field(200, ge=0)
    eval_batches: int = Field(20, gt=0)
    save_every: int = Field(200, ge=0)
    # Checkpoints kept (the older ones are deleted), and model bundles (bundles/<tag>):
    # one beside every `bundle_every`-th checkpoint (0: none), deleted with its checkpoint;
    # every `keep_bundle_every`-th checkpoint's bundle (0: none) is kept for good and logged
    # to MLflow as bundles/<tag>. The final bundle (bundles/final, MLflow `model`) always.
    keep_last: int = Field(3, gt=0)
    bundle_every: int = Field(1, ge=0)
    keep_bundle_every: int = Field(0, ge=0)
    # A bundle's weights files hold at most this much each (model-0000K-of-0000N.safetensors
    # with an index above it, as transformers shards); the bundle is written one tensor at a
    # time whatever the size.
    bundle_shard_mb: int = Field(2048, gt=0)
    max_nonfinite_in_row: int = Field(5, gt=0)
    resume: Literal["auto", "never"] = "auto"
    # SIGTERM / SIGINT: checkpoint at the next step boundary within this many seconds, else
    # stop without one (keep it below the platform's kill delay: Kubernetes' default 30 s,
    # the `deepspeed` launcher's 30 s)
    stop_grace_s: float = Field(25.0, gt=0)
    # How long a rank waits for the others: at the rendezvous and in every collective.
    # A host that dies or whose link is cut is noticed after at most this long (a killed
    # process is noticed at once: its peers' connections close); the elastic agent then
    # restarts the survivors (docs/elastic.md). Longer than the longest pause one rank
    # makes alone (rank 0 writing a bundle and uploading it to MLflow).
    collective_timeout_s: float = Field(300.0, gt=0)
    # Every rank beats once a second in the rendezvous store, from a thread the training
    # loop cannot block, and watches the others' beats: a rank silent this long (its host
    # frozen, its link cut), or the store itself, ends the others at once with a `plm:`
    # line naming it, and the elastic agent restarts the survivors (train/heartbeat.py).
    # A rank slow in a save or an upload still beats. 0: off (collective_timeout_s only).
    heartbeat_timeout_s: float = Field(10.0, ge=0)
    # A rank that beats but makes no progress while the others go on (a deadlock, a
    # stalled filesystem) for the larger of this and 10x its median step (30 minutes
    # before its first step, around saves, evaluations and bundles) writes its threads'
    # stacks and ends with exit 6, named by the others; the agent restarts the round.
    # 0: not watched.
    stuck_timeout_s: float = Field(60.0, ge=0)
    # Every this many steps, the rank the others wait for at the step's all-reduce (a
    # fifth of their steps or more: it is 1.25x slower) is named in one `plm:` line and
    # MLflow's straggler/* metrics (train/stragglers.py). 0: not watched.
    straggler_every: int = Field(100, ge=0)
    # Checkpoints written in the background: a save copies nothing; the next optimizer
    # update waits until the files are written; the checkpoint is complete (COMPLETE,
    # `latest`) once every rank's files are, noticed at a step boundary. Tensors not in
    # host memory (on a GPU) go to the disk through one reused host buffer of
    # save_buffer_mb (pipeline/train/snapshot_writer.py).
    async_save: bool = True
    save_buffer_mb: int = Field(64, gt=0)
    # Ranks whose clocks differ from rank 0's by more than this refuse to start (0: not
    # checked); so do ranks running other software (Python, torch, DeepSpeed, plm source).
    max_clock_skew_s: float = Field(30.0, ge=0)
    # DeepSpeed's CPU shared-memory all-reduce op (JIT-built C++, once per venv, announced;
    # `plm setup` builds it ahead). Off: it serves only DeepSpeed's inference all-reduce
    # (AutoTP), which training does not call, so gloo does every all-reduce either way.
    # Used with several ranks on the CPU only (pipeline/train/ds_ops.py).
    cpu_shm_allreduce: bool = False
    # Where checkpoints, bundles and metrics.jsonl live: a local folder every host sees, or
    # a URI of any pyarrow filesystem (s3://bucket/prefix, gs://...; credentials from the
    # AWS_* variables or the node's role, never in the URI). With a URI each node writes
    # into local_dir (null: $XDG_CACHE_HOME/plm/out/<name>-<digest> or
    # $TMPDIR/plm-out-<uid>/...) and uploads in the background; `latest` moves on the store
    # once every rank's upload is confirmed; an upload the store refuses is retried for
    # upload_retry_s, then the run stops (pipeline/train/out_store.py).
    out_dir: StorePath = "runs/default"
    local_dir: LocalPath | None = None
    upload_retry_s: float = Field(900.0, gt=0)

    @field_validator("out_dir")
    @classmethod
    def _out_dir(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("an empty path: give a folder or a URI (s3://bucket/prefix)")
        if not is_uri(value):
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", value):  # s3:/b/x: a folder "s3:"
                raise ValueError(
                    f"{value!r} is neither a folder nor a URI: a URI is scheme://bucket/prefix"
                )
            return value
        scheme, rest = value.split("://", 1)
        if scheme.lower() not in _OUT_SCHEMES:
            raise ValueError(
                f"{redact_uri(value)}: the scheme {scheme}:// is not a filesystem plm writes "
                f"to: give a folder or a URI of {', '.join(s + '://' for s in _OUT_SCHEMES)}"
            )
        if scheme.lower() != "file" and not rest.split("/", 1)[0]:
            raise ValueError(f"{redact_uri(value)} names no bucket: give scheme://bucket/prefix")
        return value


# The filesystems train.out_dir may name (pyarrow's FileSystem.from_uri).
_OUT_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file")


def with_global_batch(cfg: ExperimentConfig, world: int) -> ExperimentConfig:
    """``cfg`` with grad_accum set from ``train.global_batch`` for ``world`` ranks (the
    same config when it is unset), or a ConfigError naming the sizes that fit."""
    t = cfg.train
    if t.global_batch is None:
        return cfg
    per_step = t.micro_batch_size * world
    if t.global_batch % per_step:
        fits = [
            n
            for n in range(1, t.global_batch + 1)
            if t.global_batch % (t.micro_batch_size * n) == 0
        ]
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch_size="
            f"{t.micro_batch_size} x {world} ranks: with this micro batch it fits "
            f"{', '.join(map(str, fits[:12]))} ranks; change train.global_batch or "
            "train.micro_batch_size"
        )
    accum = t.global_batch // per_step
    if accum == t.grad_accum:
        return cfg
    return cfg.model_copy(update={"train": t.model_copy(update={"grad_accum": accum})})


class MlflowSection(Strict):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)
    tracking_uri: TrackingUri | None = None  # None: MLFLOW_TRACKING_URI or the local store
    # The MLflow experiment of the run (None: the config's `name`, which stays the
    # registered model's name) and the run's name (None: the name of train.out_dir).
    experiment: str | None = None
    run_name: str | None = None
    # `register` in YAML; renamed in Python because BaseModel has a `register` attribute.
    register_model: bool = Field(True, alias="register")
    alias: str = "current"
    # A server that stops answering: asked again every retry_every_s, the metrics logged
    # meanwhile sent from metrics.jsonl once it answers; a finished run waits up to
    # final_wait_s for it, to end the run and log and register the model.
    retry_every_s: float = Field(30.0, gt=0)
    final_wait_s: float = Field(60.0, ge=0)
    # How long one artifact request (the bundle's files, the registered model) may wait for
    # the server's answer: a server proxying artifacts answers once it has stored the file.
    # The other calls wait 5 s (MLFLOW_HTTP_REQUEST_TIMEOUT, when set, is used for all).
    upload_timeout_s: float = Field(600.0, gt=0)


class ExperimentConfig(Strict):
    name: str
    model: ModelSection
    objective: ObjectiveSection = ObjectiveSection()
    data: DataSection
    train: TrainSection = TrainSection()
    # "auto": ZeRO-0 on one rank, ZeRO-2 on more (pipeline/train/engine.py resolve_auto)
    deepspeed: Annotated[str | dict[str, Any], refuse_uri(DEEPSPEED_HINT)] = "auto"
    mlflow: MlflowSection = MlflowSection()


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML so 1e-4, true, [1,2] work)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


# A key the command line sets: its dotted path, its value, and what was typed (shown in an
# error about it; None: a key the command line implies, never named as its).
Key = tuple[list[str], Any, str | None]


def override_keys(overrides: list[str]) -> list[Key]:
    """The keys of dotted ``key=value`` items."""
    return [(*parse_override(item), item) for item in overrides]


def set_keys(raw: dict[str, Any], keys: list[Key]) -> dict[str, Any]:
    """``raw`` with each key set in turn (a later one wins); a section is made where none is."""
    for path, value, item in keys:
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    return set_keys(raw, override_keys(overrides))


def _section_keys(root: type[BaseModel], path: tuple) -> list[str]:
    """The keys the section at ``path`` (a pydantic error's loc without its last part)
    takes, following the config models from ``root``; [] where the path leaves them."""
    cls: Any = root
    for part in path:
        field = cls.model_fields.get(str(part)) if isinstance(part, str) else None
        if field is None:
            return []
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        cls = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if cls is None:
            return []
    return list(cls.model_fields)


def _nearest_key(root: type[BaseModel] | None, loc: tuple, quote: str = "'") -> str:
    """ " did you mean 'train.max_steps'?" for a misspelled key, or ""."""
    import difflib

    if root is None or not loc:
        return ""
    keys = _section_keys(root, tuple(loc[:-1]))
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if not near:
        return ""
    return f" did you mean {quote}" + ".".join([*(str(p) for p in loc[:-1]), near[0]]) + f"{quote}?"


def _given_as(loc: tuple, given: dict[tuple[str, ...], str]) -> str | None:
    """The command line's ``key=value`` that set the key at ``loc`` (or a section above
    it, or made the section ``loc`` names: ``trian.lr=1``), or None: it is the file's."""
    parts = tuple(str(p) for p in loc)
    found = next((given[parts[:n]] for n in range(len(parts), 0, -1) if parts[:n] in given),
                 None)  # fmt: skip
    if found is None:
        found = next((item for key, item in given.items() if key[: len(parts)] == parts), None)
    if found is None:
        return None
    key, _, value = found.partition("=")  # shown in a message: a URI's secrets masked
    return f"{key}={redact_uri(value.strip())}"


@dataclass(frozen=True)
class ErrorStyle:
    """What differs in how stages word a bad config; the rest of the text is shared.

    The default is the experiment's (and fine-tuning's, evaluation's): a header line, then
    one indented line per error, keys in 'quotes'. ``one_line``: each error is one line
    that says where it was set (`plm data prepare`: one bad key, one `plm:` line).
    ``missing``: a last line for the missing keys (their dotted names), e.g. the flags
    that set them."""

    quote: str = "'"
    one_line: bool = False
    missing: Callable[[list[str]], str] | None = None


def _error_line(e: dict, item: str | None, root: type[BaseModel] | None, q: str) -> str:
    key = ".".join(str(p) for p in e["loc"])
    cli = f" in `{item}` on the command line" if item else ""
    if e["type"] == "extra_forbidden":
        hint = _nearest_key(root, tuple(e["loc"]), q) or " see configs/ for valid keys"
        return f"unknown key {q}{key}{q}{cli} (check its spelling;{hint})"
    if e["type"] == "missing":
        return f"missing key {q}{key}{q}"
    return f"key {q}{key}{q}{cli}: {e['msg']}"


def _format_validation_error(
    err: ValidationError,
    source: str,
    root: type[BaseModel] | None = None,
    given: dict[tuple[str, ...], str] | None = None,
    style: ErrorStyle | None = None,
) -> str:
    """``root``: the model validated, so a misspelled key gets the nearest valid one.
    ``given``: the keys the command line set (``key=value``), each with its item: an error
    in one of those says it came from the command line, not from ``source`` (the file;
    "": none). ``style``: the stage's wording (ErrorStyle)."""
    style = style or ErrorStyle()
    given = given or {}
    uri_line = uri_error_line(err)
    if uri_line is not None:  # a URI where a local path is taken: one line
        item = next((_given_as(e["loc"], given) for e in err.errors()
                     if e["type"] in URI_ERRORS), None)  # fmt: skip
        where = f"given on the command line: {item}" if item else source
        return f"{uri_line} ({where})" if where else uri_line
    errors = err.errors()
    items = [_given_as(e["loc"], given) for e in errors]
    if all(items):
        head = "invalid key=value on the command line" + (f" (config {source})" if source else "")
    else:
        head = f"invalid config {source}" if source else "invalid config"
    lines = [] if style.one_line else [f"{head}:"]
    for e, item in zip(errors, items, strict=True):
        text = _error_line(e, item, root, style.quote)
        if not style.one_line:
            lines.append(f"  {text}")
        else:  # a key the command line set says so itself; the file's names the file
            lines.append(text if item or not source else f"invalid config {source}: {text}")
    missing = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "missing"]
    if missing and style.missing is not None:
        lines.append(style.missing(missing))
    return "\n".join(lines)


def validate_as(
    cls: type[T],
    raw: dict[str, Any],
    source: str,
    error: type[ConfigError] = ConfigError,
    given: dict[tuple[str, ...], str] | None = None,
    style: ErrorStyle | None = None,
) -> T:
    """``raw`` as the config ``cls``; ``error`` (one ``plm:`` message) names each bad key,
    and says which came from the command line (``given``: see ``load_as``). Every stage's
    config goes through here: one grammar, one error text (``style``: its wording)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise error(_format_validation_error(err, source, cls, given, style)) from None


def load_as(
    cls: type[T],
    path: str | Path | None,
    overrides: list[str] | None,
    error: type[ConfigError],
    *,
    keys: list[Key] | None = None,
    what: str = "config file",
    see: str = "",
    style: ErrorStyle | None = None,
) -> T:
    """A YAML file (None: none) + the command line's keys, validated as ``cls``: first
    ``keys`` (what its flags set), then the dotted ``key=value`` ``overrides``. A bad key
    the command line set is reported as the command line's, not the file's. ``what`` and
    ``see``: the file's name in a message (read_yaml); ``style``: see ErrorStyle."""
    raw = read_yaml(path, what, see) if path else {}
    keys = [*(keys or []), *override_keys(list(overrides or []))]
    set_keys(raw, keys)
    given = {tuple(k): item for k, _, item in keys if item is not None}
    return validate_as(cls, raw, str(path or ""), error, given, style)


def validate_dict(raw: dict[str, Any], source: str = "<dict>") -> ExperimentConfig:
    return validate_as(ExperimentConfig, raw, source)


def read_yaml(path: str | Path, what: str = "config file", see: str = "") -> dict[str, Any]:
    """The mapping a YAML file holds; ``what``: the file in a message (a "data config"),
    ``see``: where such files are (its missing file's hint)."""
    path = config_file(path)
    if not path.is_file():
        hint = f" (see {see})" if see else ""
        raise ConfigError(f"{what} {path} does not exist{hint}", machine_wide=True)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {path} is not valid YAML: {err}") from None
    raw = {} if raw is None else raw  # an empty file (or only comments) sets no key
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must hold a mapping at the top level")
    return raw


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load and validate an experiment config; raise ConfigError naming the bad key."""
    return load_as(ExperimentConfig, path, overrides, ConfigError)
