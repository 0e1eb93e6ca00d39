"""hybridkv: KV-cache management for hybrid sliding-window-attention LLMs.

Quick start::

    from hybridkv import HybridKVCache, CacheConfig, ModelSpec
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    cache = HybridKVCache(spec, CacheConfig(budget_bytes=80 * 2**30))
    req = cache.begin(prompt_tokens)          # window-safe prefix hit, locked
    full_slots, swa_slots = cache.allocate(req, len(prompt_tokens) - req.computed)
    cache.commit(req, len(prompt_tokens) - req.computed)
    cache.finish(req)
"""

from .cache import CacheConfig, CacheFullError, HybridKVCache, Request, StepBatch
from .modes import EvictionRanking, SwaEviction, SwaRelease
from .pools import DualPool
from .radix import TreeConfig, WindowSafeTree
from .spec import AttnKind, KVShape, ModelSpec, PRESETS, preset_names

__version__ = "0.1.0"

__all__ = ["AttnKind", "CacheConfig", "CacheFullError", "DualPool", "EvictionRanking", "HybridKVCache", "KVShape",
           "ModelSpec", "PRESETS", "Request", "StepBatch", "SwaEviction", "SwaRelease", "TreeConfig", "WindowSafeTree",
           "preset_names", "__version__"]
