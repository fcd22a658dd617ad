"""`plm data prepare`'s config: every key of the data job, typed and validated before any
work: `plm data prepare [CONFIG] key=value ...` (CONFIG: configs/data/*.yaml), each key
that takes one value also a flag (`--shard-docs N`: shard_docs=N; pipeline/cli.py makes
them from the fields, named by ``flag_name``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.config import ErrorStyle, Key, LocalPath, StorePath, load_as, override_keys
from pipeline.errors import ConfigError
from pipeline.prepare.clean import CleanConfig, clean
from pipeline.prepare.langid import parse_languages
from pipeline.prepare.quality import (
    ALL_LANGUAGES,
    PRESET_LANGUAGES,
    FilterConfig,
    expand_filters,
)
from pipeline.prepare.readers import DEFAULT_MAX_DOC_BYTES, InputError
from pipeline.prepare.tokenizer import tokenizer_folder
from pipeline.storage import redact_uri

# Bump when the code changes what lands in the shards: old outputs stop being "up to date".
PREPARE_VERSION = 2
DEFAULT_SHARD_BYTES = 128 << 20
DEFAULT_SPLIT_BYTES = 32 << 20
DEFAULT_BLOCK_TOKENS = 1 << 19  # 1 MiB of uint16 tokens
MAX_REJECT_EXAMPLES = 5  # per reason, kept in the manifest so a reject can be found
# One of them sets the shard size; one the command line sets replaces the file's other.
SHARD_SIZE_KEYS = ("shard_docs", "shard_bytes")
# The flags not named `--` + the key: the others are (`--shard-docs` sets shard_docs).
FLAG_NAMES = {"inputs": "--input", "near_dedup.enabled": "--near-dedup"}


def flag_name(key: str) -> str | None:
    """The `plm data prepare` flag of a dotted key, or None: a section's key has none (it
    is set by key=value)."""
    if key in FLAG_NAMES or "." in key:
        return FLAG_NAMES.get(key)
    return "--" + key.replace("_", "-")


class NearDedupConfig(BaseModel):
    """MinHash LSH near-dedup (pipeline/prepare/near_dedup.py); the defaults are FineWeb's.
    Two documents whose word ``ngram`` shingles have Jaccard similarity J share a band
    with probability 1 - (1 - J**rows)**bands (about 0.92 at J = 0.8, 0.05 at J = 0.5)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False  # off: exact dedup only (`--near-dedup on|off`)
    ngram: int = Field(5, gt=0, le=64)  # words per shingle
    bands: int = Field(14, gt=0, le=64)
    rows: int = Field(8, gt=0, le=64)  # MinHash values per band

    def spec(self):
        from pipeline.prepare.near_dedup import NearDedupSpec

        return NearDedupSpec(ngram=self.ngram, bands=self.bands, rows=self.rows)


class PrepareConfig(BaseModel):
    """Everything `plm data prepare` needs (configs/data/*.yaml; command-line flags override)."""

    model_config = ConfigDict(extra="forbid")

    # A description is its flag's help (`plm data prepare --help`).
    inputs: list[StorePath] = Field(
        min_length=1, description="files, folders, globs, pyarrow URIs or builtin:NAME"
    )
    # either file of the tokenizer means its folder
    tokenizer: StorePath = Field(
        description="folder or URI with tokenizer.json + tokenizer_meta.json"
    )
    output: StorePath = Field(description="the data dir: a folder, or a URI (s3://bucket/prefix)")
    valid_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    shard_docs: int | None = Field(None, gt=0, description="samples per shard, or:")
    shard_bytes: int | None = Field(None, gt=0, description="bytes per shard (default 128 MiB)")
    max_doc_tokens: int = Field(1024, gt=0, description="longer documents are split in pieces")
    max_doc_bytes: int = Field(
        DEFAULT_MAX_DOC_BYTES, gt=0, description='larger documents are rejected ("too_long")'
    )
    text_field: str = Field("text", description="jsonl field / parquet column")
    # ERNIE's entity-level masking: a UTF-8 file, one entity per line; every mention
    # becomes a token span in spans.npy (see pipeline.prepare.segment.entity_pattern).
    entities: LocalPath | None = Field(
        None, description="entity list (one per line) -> spans.npy (ERNIE)"
    )
    clean: CleanConfig = CleanConfig()
    # Language ID and quality filters (docs/data.md "Filters"): off by default. With
    # language_id each document's ISO 639-1 code (py3langid) goes into the shards and the
    # manifest; `languages` keeps only those codes (`all` or `*`: every language);
    # `filters` is a preset name ("web") or a list of filters (a name, or a mapping with
    # `name` and threshold overrides), run in order after cleaning. A preset without
    # `languages` keeps the preset's (web: [en], quality.PRESET_LANGUAGES). Either of the
    # last two turns language_id on.
    language_id: bool = Field(False, description="tag each document's language (py3langid)")
    languages: list[str] | None = Field(
        None,
        min_length=1,
        description="keep only these ISO 639-1 codes, e.g. en,zh (turns language ID on)",
    )
    filters: list[FilterConfig] = Field(
        [], description="a quality filter preset (web); lists and thresholds: data config"
    )
    near_dedup: NearDedupConfig = NearDedupConfig()
    # Input bytes per unit of work (a task): big txt/jsonl files are cut into byte ranges
    # of this size on document boundaries, parquet into runs of row groups, small files
    # grouped. Each unit writes its own shards, so it decides shard boundaries.
    split_bytes: int = Field(
        DEFAULT_SPLIT_BYTES,
        gt=0,
        description="input bytes per task (big files are cut on documents)",
    )
    block_tokens: int = Field(
        DEFAULT_BLOCK_TOKENS, gt=0, lt=1 << 32, description="tokens per block sample of a shard"
    )
    # Execution only (never changes the output bytes):
    ray_address: str | None = Field(
        None, description="a running cluster (else RAY_ADDRESS, else local)"
    )
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the local Ray instance")
    batch_docs: int = Field(256, gt=0, description="documents per encode_batch call")
    force: bool = Field(False, description="rebuild even if up to date (or over another data dir)")

    @model_validator(mode="before")
    @classmethod
    def _preset_languages(cls, data: Any) -> Any:
        """``filters: web`` with no ``languages``: the preset's languages (English)."""
        if isinstance(data, dict) and data.get("languages") is None:
            preset = data.get("filters")
            if isinstance(preset, str) and preset in PRESET_LANGUAGES:
                data = {**data, "languages": list(PRESET_LANGUAGES[preset])}
        return data

    @model_validator(mode="after")
    def _one_shard_size(self) -> PrepareConfig:
        if self.shard_docs is not None and self.shard_bytes is not None:
            raise ValueError(f"set {' or '.join(SHARD_SIZE_KEYS)}, not both")
        if self.filters or self.languages is not None:
            self.language_id = True  # the filters and `languages` judge by the ISO code
        return self

    _filters = field_validator("filters", mode="before")(expand_filters)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_folder(cls, value: str) -> str:
        return tokenizer_folder(value)  # `--tokenizer tok/tokenizer.json`: tok

    @field_validator("languages", mode="before")
    @classmethod
    def _language_codes(cls, value: object) -> object:
        return parse_languages(value)

    @field_validator("languages")
    @classmethod
    def _known_codes(cls, value: list[str] | None) -> list[str] | None:
        from pipeline.prepare.langid import known_languages

        unknown = sorted(set(value or ()) - set(known_languages()) - {ALL_LANGUAGES})
        if unknown:
            raise ValueError(
                f"unknown language code(s) {', '.join(unknown)}: use ISO 639-1 codes such as "
                "en, zh, de (the languages py3langid knows), or all"
            )
        return value

    def kept_languages(self) -> tuple[str, ...] | None:
        """The codes a document must have to be kept; None: every language."""
        if self.languages is None or ALL_LANGUAGES in self.languages:
            return None
        return tuple(self.languages)

    def filter_settings(self) -> dict[str, Any]:
        """Language ID and filters as output_settings adds them (only when on, so a data
        dir prepared without them keeps its config hash)."""
        if not self.language_id:
            return {}
        return {
            "language_id": True,
            "languages": self.languages,
            "filters": [f.model_dump() for f in self.filters],
        }

    def output_settings(self) -> dict[str, Any]:
        """The settings that decide the output bytes (hashed into data_config_hash)."""
        settings = {
            "valid_fraction": self.valid_fraction,
            "shard_docs": self.shard_docs,
            "shard_bytes": self.shard_bytes if self.shard_docs else self.effective_shard_bytes,
            "max_doc_tokens": self.max_doc_tokens,
            "split_bytes": self.split_bytes,
            "block_tokens": self.block_tokens,
            "max_doc_bytes": self.max_doc_bytes,
            "text_field": self.text_field,
            "clean": self.clean.model_dump(),
            # The list's content decides the bytes, not where the file lives.
            "entities_sha256": None
            if self.entities is None
            else _sha256_json(load_entities(self.entities, self.clean)),
            **self.filter_settings(),
        }
        if self.near_dedup.enabled:  # off: the settings (and hash) of before near-dedup
            settings["near_dedup"] = self.near_dedup.model_dump()
        return settings

    @property
    def effective_shard_bytes(self) -> int | None:
        if self.shard_docs is not None:
            return None
        return self.shard_bytes or DEFAULT_SHARD_BYTES


def _pass_the_flags(missing: list[str]) -> str:
    flags = ", ".join(flag_name(k) or f"{k}=..." for k in missing)
    return f"(pass {flags} or set the key in the CONFIG file)"


# Each bad key one line, `quoted` (ErrorStyle): an error's one `plm:` line names its key.
PREPARE_ERRORS = ErrorStyle(quote="`", one_line=True, missing=_pass_the_flags)


def _flag_keys(flags: dict[str, Any]) -> list[Key]:
    """The keys the flags set (a section's dict: only the keys it holds), each shown as
    its flag (or key=value, a section's key) with the value typed, a URI's secrets masked."""
    keys: list[Key] = []
    todo = [([key], value) for key, value in flags.items()]
    while todo:
        path, value = todo.pop(0)
        if isinstance(value, dict) and value:
            todo += [([*path, k], v) for k, v in value.items()]
            continue
        values = value if isinstance(value, list) else [value]
        typed = " ".join(redact_uri(v) if isinstance(v, str) else str(v) for v in values)
        keys.append((path, value, f"{flag_name('.'.join(path)) or '.'.join(path)}={typed}"))
    return keys


def load_prepare_config(
    path: str | Path | None,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> PrepareConfig:
    """The data config: the YAML file ``path`` (optional), then the keys its command line's
    flags set (``flags``: key -> value; a section's dict sets the keys it holds), then its
    dotted ``key=value`` ``overrides``. Errors name the key, and where it was set."""
    keys = [*_flag_keys(flags or {}), *override_keys(list(overrides or []))]
    named = {k[0] for k, _, _ in keys}
    for one, other in (SHARD_SIZE_KEYS, SHARD_SIZE_KEYS[::-1]):
        if one in named and other not in named:  # the file's choice is replaced
            keys.append(([other], None, None))
    return load_as(
        PrepareConfig,
        path,
        None,
        ConfigError,
        keys=keys,
        what="data config",
        see="configs/data/",
        style=PREPARE_ERRORS,
    )


def load_entities(path: str | Path, clean_cfg: CleanConfig) -> list[str]:
    """The entity list, cleaned like the documents (so "Ｐａｒｉｓ" matches NFKC'd text);
    blank lines and lines starting with # are skipped. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"entity list {path} does not exist (one entity per line, UTF-8)")
    entities = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(
                    f"entity list {path} line {number} is not valid UTF-8 ({err.reason}); "
                    "save the file as UTF-8"
                ) from None
            entity = clean(line, clean_cfg).strip()
            if entity and not entity.startswith("#"):
                entities.append(entity)
    if not entities:
        raise InputError(f"entity list {path} holds no entity (one per line, # for comments)")
    return sorted(set(entities))


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()
