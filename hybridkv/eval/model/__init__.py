"""A tiny hybrid-SWA reference transformer that keeps its KV only in hybridkv."""

from .reference import ReferenceModel, tiny_spec

__all__ = ["ReferenceModel", "tiny_spec"]
