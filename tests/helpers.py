"""Shared test doubles for the core tests: a tiny hybrid model, one request run
through a cache, and a pool that records what the tree frees."""

import numpy as np

from hybridkv import KVShape, ModelSpec


def spec(page=2, window=4, **kw):
    """A two-layer (full + SWA) float32 model with ``page``-token pages."""
    return ModelSpec("t", ["full", "swa"], window, KVShape(1, 2, 2), KVShape(1, 2, 2), dtype="float32",
                     page_size=page, **kw)


def run(cache, tokens, ns="default", chunk=None):
    """Begin, allocate/commit in ``chunk``-token steps, finish; check the cache's
    invariants; return the request's hit length."""
    tokens = np.asarray(tokens, dtype=np.int32)
    req = cache.begin(tokens, ns)
    hit = req.prefix_len
    while req.computed < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - req.computed)
        cache.allocate(req, n)
        cache.commit(req, n)
    cache.finish(req)
    cache.check_invariants()
    return hit


class RecordingPool:
    """A pool double that records frees and rejects double frees."""

    def __init__(self):
        self.full, self.swa = [], []

    def free_full(self, pages):
        assert not set(pages.tolist()) & set(self.full), "double free (full)"
        self.full += pages.tolist()

    def free_swa(self, pages):
        assert not set(pages.tolist()) & set(self.swa), "double free (swa)"
        self.swa += pages.tolist()

    # the rest of hybridkv.radix.PagePool: one sliding window, no ownership to check
    groups = ()
    free_full_trusted = free_full
    free_swa_trusted = free_swa

    def check_taken(self, kind, pages, name):
        pass
