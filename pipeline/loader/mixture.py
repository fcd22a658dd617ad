"""``data.sources``: several prepared data dirs trained on as one weighted mixture.

The config names the data dirs and their weights; this module opens them, checks that
they can be mixed (one tokenizer), and says what a run will take from each (for
``plm train --dry-run`` and the MLflow run). The mixing itself is the stream's
(``pipeline.loader.stream``: a deterministic interleave by weight, each source cycling
its own shuffled epochs).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import DataSection
from pipeline.data.remote import CacheConfig
from pipeline.data.shards import DataDir, ShardError
from pipeline.errors import ConfigError
from pipeline.loader.stream import MixSource, units_per_epoch
from pipeline.objectives.base import Objective


def open_sources(data: DataSection) -> list[MixSource]:
    """The config's data dirs as ``MixSource``s (one for ``data.path``), tokenizers checked."""
    specs = (
        [(data.path, 1.0)] if data.sources is None else [(s.path, s.weight) for s in data.sources]
    )
    key = "data.path" if data.sources is None else "data.sources"
    cache = CacheConfig.of(data)  # for data dirs on an object store
    sources = []
    for (path, weight), name in zip(specs, data.source_names(), strict=True):
        try:
            sources.append(MixSource(DataDir(path, cache), weight, name))
        except ShardError as err:
            raise ConfigError(f"{key}: {err}") from None
    check_same_tokenizer(sources)
    return sources


def tokenizer_fingerprint(data: DataDir) -> str:
    return str(data.manifest.get("tokenizer", {}).get("fingerprint", ""))


def check_same_tokenizer(sources: list[MixSource]) -> None:
    """Every source must have been prepared with the first one's tokenizer."""
    first = sources[0]
    want = tokenizer_fingerprint(first.path)
    for source in sources[1:]:
        got = tokenizer_fingerprint(source.path)
        if got != want:
            raise ConfigError(
                f"data.sources: source {source.name!r} ({source.path.where()}) was prepared with "
                f"another tokenizer (fingerprint {got[:12] or 'none'}) than {first.name!r} "
                f"({want[:12] or 'none'}); sources of a mixture must share one: re-run "
                f"`plm data prepare --tokenizer {first.path.tokenizer_path.parent}` for it"
            )


@dataclass(frozen=True)
class SourceShare:
    """What a run takes from one source."""

    name: str
    weight: float  # normalised
    tokens: int  # train tokens the source holds
    units: int  # examples in one epoch of the source
    units_taken: float  # examples the run reads from it
    epochs: float  # units_taken / units: > 1 means the source repeats (reshuffled)
    natural: float  # its share of all the sources' examples (weights above it upsample)


def shares(sources: list[MixSource], objective: Objective, total_units: int) -> list[SourceShare]:
    """Each source's share of ``total_units`` examples (the run's global batch x steps)."""
    total_weight = sum(s.weight for s in sources)
    units = [units_per_epoch(s.path, "train", objective) for s in sources]
    out = []
    for s, n in zip(sources, units, strict=True):
        w = s.weight / total_weight
        taken = w * total_units
        tokens = sum(int(e["n_tokens"]) for e in s.path.shards("train"))
        natural = n / max(sum(units), 1)
        out.append(SourceShare(s.name, w, tokens, n, taken, taken / max(n, 1), natural))
    return out


def _sampling(share: SourceShare) -> str:
    if abs(share.weight - share.natural) <= 1e-3 * share.natural:
        return "its natural share"
    how = "upsampled" if share.weight > share.natural else "downsampled"
    return f"{how} {share.weight / max(share.natural, 1e-12):.2f}x its natural share"


def describe(shares_: list[SourceShare]) -> list[str]:
    """One line per source, for the dry-run plan."""
    return [
        f"  {s.name:<14}weight {s.weight:.3f} ({_sampling(s)}), {s.tokens:,} tokens, "
        f"{s.units:,} examples per epoch; the run takes {s.units_taken:,.0f} = {s.epochs:.2f} "
        f"epochs{' (repeats, each reshuffled)' if s.epochs > 1 else ''}"
        for s in shares_
    ]
