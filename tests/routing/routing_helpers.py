"""Helpers shared by the routing tests (uniquely named module, not a conftest)."""

from __future__ import annotations

import numpy as np

from hybridkv import CacheFullError, HybridKVCache
from hybridkv.routing import GlobalPrefixIndex, KVEventPublisher
from hybridkv.tiers.keys import model_fingerprint


def fingerprint(spec) -> str:
    return model_fingerprint(spec.fingerprint(), "full")


def wire(caches: list[HybridKVCache], bus, **index_kw) -> tuple[list[KVEventPublisher], GlobalPrefixIndex]:
    """One publisher per cache on ``bus`` and an index reading it."""
    spec = caches[0].spec
    fp = fingerprint(spec)
    pubs = []
    for i, c in enumerate(caches):
        p = KVEventPublisher(i, bus, page_size=spec.page_size, fingerprint=fp, warn_interval_s=0.0)
        p.attach(c.tree)
        pubs.append(p)
    index = GlobalPrefixIndex(len(caches), page_size=spec.page_size, window=spec.window, fingerprint=fp,
                              bus=bus, **index_kw)
    return pubs, index


def serve(cache: HybridKVCache, tokens: np.ndarray, namespace: str = "default") -> int:
    """Prefill ``tokens`` on ``cache`` and cache them; returns the window-safe hit it got."""
    req = cache.begin(tokens, namespace)
    hit = req.prefix_len
    try:
        while req.computed < len(tokens):
            n = min(8, len(tokens) - req.computed)
            cache.reserve(req, n)
            cache.commit(req, n)
        cache.finish(req)
    except CacheFullError:
        cache.abort(req)
    return hit


def truth(caches: list[HybridKVCache], tokens: np.ndarray, namespace: str = "default") -> list[int]:
    return [c.match(tokens, namespace).length for c in caches]
