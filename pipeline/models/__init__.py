"""Model architectures (one readable file each), shared blocks, registry and bundles."""

from pipeline.models.registry import ARCHITECTURES, build_model, resolve_model_config

__all__ = ["ARCHITECTURES", "build_model", "resolve_model_config"]
