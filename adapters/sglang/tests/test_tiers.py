"""hybridkv's L2/L3 tiers under ``--radix-cache-backend hybridkv``, through SGLang's real
pools, ``Req`` and admission helpers on CPU (:mod:`sglang_flow`).

Every hit, including every one loaded from L2 or L3, is checked by the content
oracle (the K/V tags behind the hit's full slots and its SWA window are the
request's own); the pool accounting is checked after every step.  The flows run at
page sizes 1 and 64."""

from __future__ import annotations

import os

import numpy as np
import pytest

import conftest
from sglang_flow import Driver, Pools

conftest.publish_test_server_args()

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from hybridkv.tiers.config import TierConfig  # noqa: E402
from hybridkv.tiers.payload import swa_key  # noqa: E402
from hybridkv.spec import AttnKind  # noqa: E402
from hybridkv_sglang.radix_cache import HybridKVRadixCache  # noqa: E402
from hybridkv_sglang.tiers import SGLangTierPool, spec_from_pools, tiers_from_env  # noqa: E402

W = 128
PAGE_SIZES = (1, 64)


def _cache(page_size: int, tiers: TierConfig | None, full: int = 6000, swa: int = 3000, **kw):
    pools = Pools(full_tokens=full, swa_tokens=swa, page_size=page_size)
    cache = HybridKVRadixCache(pools.init_params(W), tiers=tiers, **kw)
    return cache, pools


def _tiers(tmp_path=None, l2_bytes: int = 1 << 22, **kw) -> TierConfig:
    l3 = f"file://{tmp_path}/l3" if tmp_path is not None else None
    return TierConfig(l2_bytes=l2_bytes, l3=l3, l2_device="cpu", **kw)


def _hit_of(n: int, page_size: int) -> int:
    """A full hit of an ``n``-token prompt: its last token is computed."""
    return (n - 1) // page_size * page_size


def _drop_l1(cache: HybridKVRadixCache, pools: Pools) -> None:
    cache.evict(EvictParams(num_tokens=pools.full_tokens, swa_num_tokens=pools.swa_tokens))
    assert cache.total_size() == 0


def _run(cache, pools, prompts, n_out: int = 4):
    """Run ``prompts`` one at a time; returns each request's hit."""
    drv = Driver(cache, pools, W, chunk=512, max_live=1)
    drv.run([(p, n_out, None) for p in prompts])
    cache.sanity_check()
    return drv.stats.hits


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 30000, n).astype(np.int64)


# ------------------------------------------------------------------ (a) L2
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prompt_evicted_from_l1_hits_from_l2_with_its_own_content(page_size):
    cache, pools = _cache(page_size, _tiers())
    p = _prompt(1, 900)
    assert _run(cache, pools, [p]) == [0]
    _drop_l1(cache, pools)
    assert _run(cache, pools, [p]) == [_hit_of(len(p), page_size)]  # the oracle checked its K/V
    st = cache.tier_stats()
    assert st["l2_hit_tokens"] == _hit_of(len(p), page_size) and st["tier_errors"] == 0
    assert st["l2_to_l1_full_pages"] == _hit_of(len(p), page_size) // page_size
    assert cache.counters["loaded_tokens"] == _hit_of(len(p), page_size)


# ------------------------------------------------------------------ (b) L3
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_with_l2_cleared_the_prompt_hits_from_l3_with_its_own_content(page_size, tmp_path):
    cache, pools = _cache(page_size, _tiers(tmp_path))
    p = _prompt(2, 900)
    _run(cache, pools, [p])
    assert cache.coordinator.flush(30)
    assert cache.tier_stats()["l3_write_pages_ok"] > 0
    _drop_l1(cache, pools)
    assert cache.coordinator.clear_l2() > 0
    assert _run(cache, pools, [p]) == [_hit_of(len(p), page_size)]  # oracle-checked
    st = cache.tier_stats()
    assert st["l3_hit_tokens"] == _hit_of(len(p), page_size) and st["tier_errors"] == 0
    assert st["l3_to_l2_full_pages"] > 0
    cache.close()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_new_cache_over_the_same_l3_hits_preexisting_data(page_size, tmp_path):
    """A restart: fresh L1 and L2 (a new cache, new pools), the same L3 directory."""
    a, pools_a = _cache(page_size, _tiers(tmp_path))
    p = _prompt(3, 700)
    _run(a, pools_a, [p])
    assert a.coordinator.flush(30)
    a.close()
    b, pools_b = _cache(page_size, _tiers(tmp_path))
    assert _run(b, pools_b, [p]) == [_hit_of(len(p), page_size)]
    assert b.tier_stats()["l3_preexisting_hit_tokens"] == _hit_of(len(p), page_size)
    b.close()


# ------------------------------------------------------------------ (c) repairs
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_repair_2_host_swa_completes_the_device_window(page_size):
    cache, pools = _cache(page_size, _tiers())
    p = _prompt(4, 900)
    _run(cache, pools, [p])
    cache.tree.evict(swa_pages=cache.tree.evictable_swa_pages())  # full KV stays in L1
    assert cache.tree.swa_pages_cached == 0 and cache.tree.full_pages_cached > 0
    assert _run(cache, pools, [p]) == [_hit_of(len(p), page_size)]
    st = cache.tier_stats()
    wp = -(-W // page_size)
    assert st["repair_swa_h2d_pages"] >= wp and st["l2_to_l1_full_pages"] == 0
    assert st["l1_hit_tokens"] == _hit_of(len(p), page_size)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_repair_1_device_swa_the_host_lacks_is_backed_up(page_size):
    """Write-back: L2 holds a prefix's full KV but not its SWA; the next
    checkpoint of a request reading that prefix copies the device's SWA down."""
    cache, pools = _cache(page_size, _tiers(write_policy="write_back"))
    p = _prompt(5, 640)
    _run(cache, pools, [p])
    co = cache.coordinator
    n = len(p) // page_size
    keys = co.page_keys(p.astype(np.int32), "None/None", n)
    node = max(cache.tree.iter_nodes(), key=lambda nd: nd.start + len(nd.key))
    full, _ = cache._path_pages(node)
    co.backup.store_l2(AttnKind.FULL, full[:n], keys, None)
    assert (co.host.lookup_swa([swa_key(k) for k in keys]) < 0).all()
    q = np.concatenate([p, _prompt(6, 300)])
    _run(cache, pools, [q])
    assert cache.tier_stats()["repair_swa_d2h_pages"] > 0
    wp = -(-W // page_size)
    hit = _hit_of(len(p), page_size) // page_size  # q's hit ends where p's tree path does
    assert (co.host.lookup_swa([swa_key(k) for k in keys[hit - wp:hit]]) >= 0).all()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_repairs_3_and_4_hits_touch_l3_and_anchor_their_window(page_size, tmp_path):
    cache, pools = _cache(page_size, _tiers(tmp_path, touch_interval_s=0.0))
    shared = _prompt(7, 640)
    a = np.concatenate([shared, _prompt(8, 200)])
    b = np.concatenate([shared, _prompt(9, 200)])
    _run(cache, pools, [a])
    assert cache.coordinator.flush(30)
    before = cache.tier_stats()
    hits = _run(cache, pools, [b])
    h = len(shared) // page_size  # the hit ends where a and b diverge
    assert hits == [h * page_size]
    assert cache.coordinator.flush(30)
    st = cache.tier_stats()
    assert st["l3_touches"] > before["l3_touches"]  # repair 3: the L1 hit's keys touched in L3
    co = cache.coordinator
    wp = -(-W // page_size)
    keys = co.page_keys(b.astype(np.int32), "None/None", h)
    window = [swa_key(k) for k in keys[h - wp:h]]
    assert all(k in co.host._anchor for k in window)  # repair 4: the hit's window is anchored in L2
    cache.close()
