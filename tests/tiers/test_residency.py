"""The tier coordinator's residency of a prompt: asking L2 for the SWA of only the
pages the window-safe hit depends on gives the hit (and the window a load copies)
that asking for every page gives."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import CacheConfig
from hybridkv.eval.model.reference import tiny_spec, tiny_two_window_spec
from hybridkv.tiers.config import PageOrigin
from hybridkv.tiers.tiered import TierConfig, TieredCache


def _cache(spec, l1_pages: int, l2_pages: int) -> TieredCache:
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    return TieredCache(spec, CacheConfig(budget_bytes=l1_pages * (fpb + spb), device="meta"),
                       tiers=TierConfig(l2_bytes=l2_pages * fpb + l2_pages // 3 * spb))


@pytest.mark.parametrize("two_windows", [False, True], ids=["one-window", "two-windows"])
def test_the_hit_windows_alone_decide_the_hit_as_every_page_does(two_windows, monkeypatch):
    spec = tiny_two_window_spec() if two_windows else tiny_spec()
    cache = _cache(spec, l1_pages=60, l2_pages=90)  # L2 keeps full KV of more pages than it keeps SWA of
    co = cache.lower_tiers
    wp, P = spec.window_pages, spec.page_size
    asked: list[int] = []
    real = co.host.lookup_swa

    def counting(keys, **kw):
        asked.append(len(keys))
        return real(keys, **kw)

    monkeypatch.setattr(co.host, "lookup_swa", counting)
    rng = np.random.default_rng(5)
    stems = [rng.integers(0, 500, 120).astype(np.int32) for _ in range(4)]
    lazy_asked = eager_asked = 0
    hits = []
    try:
        for _ in range(150):
            stem = stems[int(rng.integers(0, len(stems)))]
            cut = int(rng.integers(8, len(stem)))
            tokens = np.concatenate([stem[:cut], rng.integers(0, 500, int(rng.integers(1, 40))).astype(np.int32)])
            n = (len(tokens) - 1) // P
            keys, path = co.walk_prompt(tokens, "default", n)
            with co.mutex:
                asked.clear()
                eager = co.resident(keys, path)
                eager_asked += sum(asked)
                asked.clear()
                lazy = co.resident(keys, path, every_swa=False)
                lazy_asked += sum(asked)
                hit = co._safe_hit(eager)
                assert co._safe_hit(lazy) == hit
            lo = max(0, hit - wp)
            assert (lazy.swa[lo:hit] == eager.swa[lo:hit]).all() and (lazy.l2_swa[lo:hit] == eager.l2_swa[lo:hit]).all()
            # (the lazy one asks L2 for full KV only up to the first page it lacks)
            assert (lazy.full == eager.full).all() and (lazy.l2_full[:hit] == eager.l2_full[:hit]).all()
            hits.append((hit, int(np.count_nonzero(eager.swa[:hit] == PageOrigin.L2))))
            req = cache.begin(tokens)
            left = len(tokens) - req.computed
            cache.reserve(req, left)
            cache.commit(req, left)
            cache.finish(req)
            cache.check_invariants()
    finally:
        cache.close()
    assert sum(1 for h, from_l2 in hits if h and from_l2) >= 5, hits  # L2's windows took part
    # complete records: both read L2 off the tree and its orphans, L2's index is never asked
    assert lazy_asked == eager_asked == 0, (lazy_asked, eager_asked)


def test_the_read_ahead_takes_the_swa_keys_the_residency_hashed(tmp_path, monkeypatch):
    """An L3 read-ahead reads the SWA keys of the pages L1 / L2 lack off the
    residency where it hashed them for the L2 lookup (no key hashed twice: the
    residency hashes only while L2 holds orphan SWA pages), and those keys are
    the right ones: the windows land in L2 and the next begin hits."""
    import threading

    import hybridkv.tiers.coordinator as coordinator
    import hybridkv.tiers.reads as reads

    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    cache = TieredCache(spec, CacheConfig(budget_bytes=60 * (fpb + spb), device="meta"),
                        tiers=TierConfig(l2_bytes=200 * (fpb + spb), l3=f"file://{tmp_path}"))
    try:
        tokens = np.random.default_rng(3).integers(0, 500, 90).astype(np.int32)
        req = cache.begin(tokens)
        cache.reserve(req, len(tokens) - req.computed)
        cache.commit(req, len(tokens) - req.computed)
        cache.finish(req)
        assert cache.flush()
        tree = cache.tree
        tree.evict(full_pages=tree.evictable_full_pages(), swa_pages=tree.evictable_swa_pages())
        cache.clear_l2()
        # no entry names the pages any more: all of the prompt is past the walk
        tree.runs.keep_within(0)
        hashed: list[bytes] = []
        real, caller = reads.swa_key, threading.get_ident()

        def counting(key: bytes) -> bytes:
            if threading.get_ident() == caller:  # the read-ahead's start, not the read worker
                hashed.append(key)
            return real(key)

        monkeypatch.setattr(reads, "swa_key", counting)
        monkeypatch.setattr(coordinator, "swa_key", counting)
        assert cache.prefetch(tokens).wait(10.0)
        monkeypatch.undo()
        assert hashed and len(hashed) == len(set(hashed)) and cache.host.num_swa_pages > 0
        again = cache.begin(tokens)
        assert again.prefix_len >= spec.window, again.prefix_len
        cache.finish(again, cache=False)
        cache.check_invariants()
    finally:
        cache.close()
