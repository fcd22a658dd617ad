"""Architecture name -> (typed config, model class), and presets in configs/models/.

An experiment's ``model:`` section is ``arch`` + optional ``preset`` + overrides:

    model: {arch: bert, preset: bert-base, num_layers: 6, dropout: 0.0}

The preset file gives every field, the overrides replace some, ``vocab_size`` comes from
the tokenizer; the result is validated by the architecture's config (unknown keys fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from torch import nn

from pipeline.config import CONFIGS_DIR, read_yaml
from pipeline.errors import ConfigError
from pipeline.models.albert import Albert, AlbertConfig
from pipeline.models.bert import Bert, BertConfig
from pipeline.models.distilbert import DistilBert, DistilBertConfig
from pipeline.models.electra import Electra, ElectraConfig
from pipeline.models.elmo import Elmo, ElmoConfig
from pipeline.models.ernie import Ernie, ErnieConfig
from pipeline.models.gpt import GPT, GPTConfig
from pipeline.models.gpt2 import GPT2, GPT2Config
from pipeline.models.roberta import Roberta, RobertaConfig
from pipeline.models.transformer_xl import TransformerXL, TransformerXLConfig
from pipeline.models.word2vec import Word2Vec, Word2VecConfig
from pipeline.models.xlnet import XLNet, XLNetConfig

ARCHITECTURES: dict[str, tuple[type[BaseModel], type[nn.Module]]] = {
    "bert": (BertConfig, Bert),
    "roberta": (RobertaConfig, Roberta),
    "albert": (AlbertConfig, Albert),
    "elmo": (ElmoConfig, Elmo),
    "word2vec": (Word2VecConfig, Word2Vec),
    "electra": (ElectraConfig, Electra),
    "distilbert": (DistilBertConfig, DistilBert),
    "ernie": (ErnieConfig, Ernie),
    "gpt2": (GPT2Config, GPT2),
    "gpt": (GPTConfig, GPT),
    "transformer-xl": (TransformerXLConfig, TransformerXL),
    "xlnet": (XLNetConfig, XLNet),
}

PRESETS_DIR = CONFIGS_DIR / "models"


def available_presets(presets_dir: Path = PRESETS_DIR) -> list[str]:
    return sorted(p.stem for p in presets_dir.glob("*.yaml"))


def _arch_entry(arch: Any) -> tuple[type[BaseModel], type[nn.Module]]:
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"model.arch: unknown architecture {arch!r}; available: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch]


def load_preset(name: str, presets_dir: Path = PRESETS_DIR) -> dict[str, Any]:
    path = presets_dir / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"model.preset: unknown preset {name!r} (no {path}); "
            f"available: {', '.join(available_presets(presets_dir))}"
        )
    return read_yaml(path)


def resolve_model_config(
    model_section: dict[str, Any] | BaseModel, vocab_size: int, presets_dir: Path = PRESETS_DIR
) -> BaseModel:
    """Merge preset + overrides + the tokenizer's vocab_size into the arch's typed config.

    Raises ConfigError naming the offending key as ``model.<key>`` (and the preset file
    when the bad value came from there).
    """
    section = dict(
        model_section.model_dump() if isinstance(model_section, BaseModel) else model_section
    )
    arch = section.pop("arch", None)
    if arch is None:
        raise ConfigError("model.arch: missing; available: " + ", ".join(sorted(ARCHITECTURES)))
    config_cls, _ = _arch_entry(arch)
    preset = section.pop("preset", None)
    if "vocab_size" in section:
        raise ConfigError(
            "model.vocab_size: comes from the tokenizer and cannot be set; remove the key"
        )

    fields: dict[str, Any] = {}
    preset_file = None
    if preset is not None:
        fields = load_preset(preset, presets_dir)
        preset_file = presets_dir / f"{preset}.yaml"
        preset_arch = fields.pop("arch", arch)
        if preset_arch != arch:
            raise ConfigError(
                f"model.preset: preset {preset!r} is for arch {preset_arch!r}, not {arch!r}; "
                f"change model.arch or pick a {arch} preset"
            )
    fields.update(section)
    fields["vocab_size"] = vocab_size

    try:
        return config_cls.model_validate(fields)
    except ValidationError as err:
        lines = [f"invalid model config (arch {arch!r}, preset {preset!r}):"]
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            name = f"model.{key}" if key else "model"
            where = ""
            if preset_file is not None and key and key not in section and key != "vocab_size":
                where = f" (from {preset_file})"
            if e["type"] == "extra_forbidden":
                import difflib

                keys = [k for k in config_cls.model_fields if k != "vocab_size"]
                near = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
                hint = f"; did you mean 'model.{near[0]}'?" if near else ""
                lines.append(f"  unknown key '{name}'{where}{hint}; known keys: {', '.join(keys)}")
            elif e["type"] == "missing":
                lines.append(f"  missing key '{name}'; set it or use a preset")
            else:
                lines.append(f"  key '{name}'{where}: {e['msg']}")
        raise ConfigError("\n".join(lines)) from None


def build_model(arch: str, config: BaseModel | dict[str, Any]) -> nn.Module:
    """Instantiate an architecture from its typed config (or a dict of its fields)."""
    config_cls, model_cls = _arch_entry(arch)
    if not isinstance(config, config_cls):
        config = config_cls.model_validate(
            config.model_dump() if isinstance(config, BaseModel) else config
        )
    return model_cls(config)
