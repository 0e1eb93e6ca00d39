"""hybridkv.cache keeps its public names while its parts live in their own modules."""

from __future__ import annotations

import hybridkv.cache as cache_mod
from hybridkv import ModelSpec
from hybridkv.allocation import CacheFullError, RequestPages
from hybridkv.cache_config import CacheConfig
from hybridkv.eval.replay import _make_cache
from hybridkv.request import Request
from hybridkv.step import StepBatch


def test_public_names_are_the_same_objects():
    assert set(cache_mod.__all__) == {"CacheConfig", "CacheFullError", "HybridKVCache", "Request", "StepBatch"}
    assert cache_mod.CacheConfig is CacheConfig
    assert cache_mod.CacheFullError is CacheFullError
    assert cache_mod.StepBatch is StepBatch
    assert cache_mod.Request is Request
    # page growth is a collaborator the cache owns, not a base class
    assert not issubclass(cache_mod.HybridKVCache, RequestPages)
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    cache = cache_mod.HybridKVCache(spec, CacheConfig(budget_bytes=10**9))
    assert isinstance(cache.pages, RequestPages) and cache.pages.counters is cache.counters


def test_replay_builds_the_cache():
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    cache = _make_cache("hybridkv", spec, 10**9, 16384, None)
    assert isinstance(cache, cache_mod.HybridKVCache) and cache.lower_tiers is None
