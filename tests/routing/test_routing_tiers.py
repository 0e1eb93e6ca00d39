"""L2/L3 tier events -> GlobalPrefixIndex: per-tier predictions equal what a
worker's tiers can actually serve, and evictions remove entries."""

from __future__ import annotations

import numpy as np
import pytest
from routing_helpers import serve

from hybridkv import CacheConfig, ModelSpec
from hybridkv.eval.tier_verify import flush_l2
from hybridkv.pools import arena_page_bytes
from hybridkv.radix import window_safe_pages
from hybridkv.radix.node import NO_PAGE
from hybridkv.routing import GlobalPrefixIndex, KVEventPublisher
from hybridkv.routing.bus import MemoryBus
from hybridkv.tiers.payload import swa_key
from hybridkv.tiers.tiered import TierConfig, TieredCache

SPEC = ModelSpec.preset("mimo-v2.5", page_size=16)
FPB, SPB = arena_page_bytes(SPEC, "full"), arena_page_bytes(SPEC, "swa")


def _safe_tokens(full_ok: np.ndarray, swa_ok: np.ndarray) -> int:
    """Window-safe hit (tokens) from per-page availability in one tier."""
    bad = np.flatnonzero(~full_ok)
    n = int(bad[0]) if bad.size else full_ok.size
    if n == 0:
        return 0
    ids = np.where(swa_ok[:n], 0, NO_PAGE).astype(np.int32)
    return window_safe_pages([ids], SPEC.window_pages) * SPEC.page_size


def _served(cache: TieredCache, tokens: np.ndarray) -> tuple[int, int]:
    """(L2, L3) window-safe lengths computed from the tiers' real state."""
    n = (len(tokens) - 1) // SPEC.page_size
    keys = cache._page_keys(tokens, "default", n)
    if not keys:
        return 0, 0
    sk = [swa_key(k) for k in keys]
    l2 = _safe_tokens(cache.host.lookup_full(keys) >= 0, cache.host.lookup_swa(sk) >= 0)
    be = cache._backend
    l3 = _safe_tokens(np.array(be.exists(keys)), np.array(be.exists(sk)))
    return l2, l3


def _prompts(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Sessions that grow (extensions) and branch off shared system prompts."""
    systems = [rng.integers(0, 30000, 300) for _ in range(3)]
    out, live = [], []
    for _ in range(n):
        if live and rng.random() < 0.6:
            i = int(rng.integers(len(live)))
            live[i] = np.concatenate([live[i], rng.integers(0, 30000, int(rng.integers(20, 200)))])
            out.append(live[i])
        else:
            s = systems[int(rng.integers(len(systems)))]
            live.append(np.concatenate([s, rng.integers(0, 30000, int(rng.integers(10, 300)))]))
            out.append(live[-1])
    return out


# L2 sized so that each policy evicts from L2 but keeps some whole prefixes.
@pytest.mark.parametrize(("policy", "l2_pages"), [("write_through", 380), ("write_back", 350)])
def test_tier_events_predict_what_l2_and_l3_serve(tmp_path, policy, l2_pages):
    l1 = CacheConfig(budget_bytes=60 * (FPB + SPB), device="meta", swa_checkpoint=128)
    cache = TieredCache(SPEC, l1, tiers=TierConfig(l2_bytes=l2_pages * (FPB + SPB), l3=f"file://{tmp_path / 'l3'}",
                                                   write_policy=policy))
    bus = MemoryBus()
    pub = KVEventPublisher(0, bus, page_size=SPEC.page_size, fingerprint=cache.key_fingerprint,
                           warn_interval_s=0.0)
    pub.attach(cache.tree)
    pub.attach_tiers(cache)
    index = GlobalPrefixIndex(1, page_size=SPEC.page_size, window=SPEC.window,
                              fingerprint=cache.key_fingerprint, bus=bus)
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, 40)
    for p in prompts:
        serve(cache, p)
    assert cache.flush(10)  # L3 store events come from the worker once writes land
    pub.flush()
    index.poll()
    st = cache.stats()
    assert st["l2_evicted_full_pages"] > 0, {k: v for k, v in st.items() if k.startswith(("l1_", "l2_", "l3_w", "hit", "req"))}
    assert st["l3_write_pages_ok"] > 0 and st["tier_errors"] == 0
    l2_any = l3_any = 0
    for p in prompts + [p[: len(p) // 2] for p in prompts]:
        pred = index.hits(p)
        l2, l3 = _served(cache, p)
        assert int(pred.tokens["L2"][0]) == l2
        assert int(pred.tokens["L3"][0]) == l3
        l2_any += l2 > 0
        l3_any += l3 > 0
    assert l2_any and l3_any, (l2_any, l3_any)  # the comparison is not all zeros
    # The index's L2 entries are exactly the host's full pages.
    assert index.pages(0, "L2")[0] == cache.host.num_full_pages
    # An L2 eviction removes its entry: evict one full page (the LRU leaf) by hand.
    before = set(cache.host.full_keys())
    assert cache.host._evict("full", set(), set(), limit=1) == 1
    (victim,) = before - set(cache.host.full_keys())
    pub.flush()
    index.poll()
    assert victim not in index._full["L2"] and index.pages(0, "L2")[0] == cache.host.num_full_pages
    # Emptying L2 empties its index entries, L3 stays.
    flush_l2(cache)
    pub.flush()
    index.poll()
    assert index.pages(0, "L2") == (0, 0) and index.pages(0, "L3")[0] > 0
    for p in prompts[:10]:
        assert int(index.hits(p).tokens["L2"][0]) == 0
    cache.close()


def test_attach_tiers_rejects_other_key_fingerprint(tmp_path):
    cache = TieredCache(SPEC, CacheConfig(budget_bytes=10 * (FPB + SPB), device="meta"),
                        tiers=TierConfig(l2_bytes=10 * (FPB + SPB)))
    pub = KVEventPublisher(0, MemoryBus(), page_size=SPEC.page_size, fingerprint="something-else")
    with pytest.raises(ValueError, match="fingerprint"):
        pub.attach_tiers(cache)
    assert cache.host.listeners == []
    cache.close()
