"""The fingerprint of a run's data, as tags, bundles and evaluation records name it."""

from __future__ import annotations

from typing import Any


def data_fingerprint(manifest: dict[str, Any]) -> str:
    """The manifest's fingerprint (sources + data config + tokenizer) when it has one."""
    if manifest.get("fingerprint"):
        return str(manifest["fingerprint"])
    tok = manifest.get("tokenizer", {}).get("fingerprint", "?")
    return f"tok:{tok}/data:{manifest.get('data_config_hash', '?')}"


def mixture_fingerprint(sources) -> str:
    """One source: its data fingerprint; a mixture: name:weight:fingerprint of each."""
    if len(sources) == 1:
        return data_fingerprint(sources[0].path.manifest)
    return ",".join(f"{s.name}:{s.weight:g}:{data_fingerprint(s.path.manifest)}" for s in sources)
