"""Exporters from model bundles to other ecosystems (transformers: pipeline.export.hf)."""
