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
