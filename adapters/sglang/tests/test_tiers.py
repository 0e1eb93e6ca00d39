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
from hybridkv.tiers.keys import page_keys  # noqa: E402
from hybridkv_sglang.radix_cache import HybridKVRadixCache, namespace_of  # noqa: E402
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
def test_what_l1_evicts_stays_named_past_l2_as_l3_entries(page_size, tmp_path):
    """The radix cache runs the core's tree and tiers: what L1 evicts stays in the tree as
    evicted runs, and with L2 emptied the runs stay as L3 entries (their cap counts L3's
    record): the repeat's walk reads every page's name off them, the names hashing gives,
    and L3 serves the repeat with its own content."""
    cache, pools = _cache(page_size, _tiers(tmp_path))
    co, runs = cache.coordinator, cache.tree.runs
    p = _prompt(4, 900)
    _run(cache, pools, [p])
    assert co.flush(30)
    _drop_l1(cache, pools)
    assert co.clear_l2() > 0 and co.host.num_full_pages == 0
    hit = _hit_of(len(p), page_size)
    ns = namespace_of(None, None)
    keys, walk = co.walk_prompt(p.astype(np.int32), ns, hit // page_size)  # on the engine's thread: the cap applies
    assert runs.cap == len(co.l3_record) > 0 and runs.pages >= hit // page_size
    assert not walk.path and sum(k for _, k in walk.runs) == hit // page_size  # every name off the runs
    assert keys == page_keys(p[:hit], page_size, namespace=ns, fingerprint=co.fingerprint)
    assert _run(cache, pools, [p]) == [hit]  # oracle-checked
    assert cache.tier_stats()["l3_hit_tokens"] == hit
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


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("l3_swa", ["anchored", "all"])
def test_repair_4_only_checkpoint_and_tail_windows_reach_l3(page_size, l3_swa, tmp_path):
    """Repair case 4, the L3 half: L2 holds every SWA page of the prompt (no pressure), but
    L3 receives only the anchored ones (tail and checkpoint windows): the checkpoint
    windows ``[128, 256)`` and ``[640, 768)`` reach L3, the SWA of ``[0, 128)`` (in no
    window a hit can end at) stays in L2 only.  With the selection off (``l3_swa="all"``)
    L3 receives every SWA page L2 does."""
    cache, pools = _cache(page_size, _tiers(tmp_path, l3_swa=l3_swa), swa_checkpoint=256)
    p = _prompt(12, 900)
    _run(cache, pools, [p])
    co = cache.coordinator
    assert co.flush(30)
    n = len(p) // page_size
    keys = [swa_key(k) for k in co.page_keys(p.astype(np.int32), "None/None", n)]
    in_l2 = co.host.lookup_swa(keys) >= 0
    in_l3 = np.array(co.l3.backend.exists(keys), dtype=bool)
    first = np.arange(128 // page_size)
    windows = np.r_[128 // page_size:256 // page_size, 640 // page_size:768 // page_size]
    assert in_l2.all() and in_l3[windows].all()
    assert (not in_l3[first].any()) == (l3_swa == "anchored") and in_l3.all() == (l3_swa == "all")
    st = cache.tier_stats()
    assert (st["l3_write_pages_ok"] < 2 * n) == (l3_swa == "anchored") and st["tier_errors"] == 0
    cache.close()


# ------------------------------------------------------------------ (d) faults
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_corrupt_l3_files_degrade_to_a_miss_never_a_wrong_hit(page_size, tmp_path):
    cache, pools = _cache(page_size, _tiers(tmp_path))
    p = _prompt(10, 700)
    _run(cache, pools, [p])
    assert cache.coordinator.flush(30)
    files = [f for f in (tmp_path / "l3").rglob("*") if f.is_file()]
    assert files
    for f in files:  # same length, every byte flipped
        f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))
    _drop_l1(cache, pools)
    cache.coordinator.clear_l2()
    assert _run(cache, pools, [p]) == [0]
    st = cache.tier_stats()
    assert st["l3_hit_tokens"] == 0 and st["l3_backend_corrupt"] > 0
    cache.close()


class _RaisingBackend:
    """An L3 backend whose every call raises (a dead store)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.failing = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _maybe(self, name, *a):
        if self.failing:
            raise ConnectionError(f"{name}: store down")
        return getattr(self.inner, name)(*a)

    def exists(self, keys):
        return self._maybe("exists", keys)

    def get(self, keys):
        return self._maybe("get", keys)

    def put(self, keys, values):
        return self._maybe("put", keys, values)

    def touch(self, keys):
        return self._maybe("touch", keys)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_raising_l3_backend_is_a_miss(page_size, tmp_path):
    from hybridkv.tiers.storage import open_backend

    backend = _RaisingBackend(open_backend(f"file://{tmp_path}/l3"))
    cache, pools = _cache(page_size, TierConfig(l2_bytes=1 << 22, l3=backend, l2_device="cpu", l3_timeout_s=2.0))
    p = _prompt(11, 700)
    _run(cache, pools, [p])
    assert cache.coordinator.flush(30)
    backend.failing = True
    _drop_l1(cache, pools)
    cache.coordinator.clear_l2()
    assert _run(cache, pools, [p]) == [0]
    assert _run(cache, pools, [_prompt(12, 300)]) == [0]  # new writes fail quietly
    cache.close()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_failing_h2d_copy_leaves_the_l1_answer_and_no_leak(page_size):
    cache, pools = _cache(page_size, _tiers())
    p = _prompt(13, 700)
    _run(cache, pools, [p])
    _drop_l1(cache, pools)
    co = cache.coordinator
    real = co.copy

    def broken(kind, src, sp, dst, dp):
        if src is co.host.pool:
            raise RuntimeError("H2D failed")
        return real(kind, src, sp, dst, dp)

    co.copy = broken
    assert _run(cache, pools, [p]) == [0]
    assert co.counters["tier_errors"] >= 1
    co.copy = real
    assert _run(cache, pools, [p]) == [_hit_of(len(p), page_size)]
    cache.sanity_check()
    _drop_l1(cache, pools)
    a = pools.allocator
    assert (a.full_available_size(), a.swa_available_size()) == (pools.full_tokens, pools.swa_tokens)


# ------------------------------------------------------------------ (e) arguments
def test_bad_tier_arguments_raise_naming_them(monkeypatch):
    pools = Pools(full_tokens=1000, swa_tokens=500)
    with pytest.raises(TypeError, match="tiers"):
        HybridKVRadixCache(pools.init_params(W), tiers={"l2_bytes": 1 << 20})
    with pytest.raises(ValueError, match="l2_bytes"):
        TierConfig(l2_bytes=0)
    with pytest.raises(ValueError, match="l2_device"):
        HybridKVRadixCache(pools.init_params(W), tiers=TierConfig(l2_bytes=1 << 20, l2_device="meta"))
    with pytest.raises(TypeError, match="kv_pool"):
        spec_from_pools(object(), 1, W)
    monkeypatch.setenv("HYBRIDKV_L2_BYTES", "lots")
    with pytest.raises(ValueError, match="HYBRIDKV_L2_BYTES"):
        tiers_from_env()
    monkeypatch.delenv("HYBRIDKV_L2_BYTES")
    monkeypatch.setenv("HYBRIDKV_L3", "file:///nowhere")
    with pytest.raises(ValueError, match="HYBRIDKV_L2_BYTES"):
        tiers_from_env()
    monkeypatch.setenv("HYBRIDKV_L3", "nosuch://x")
    monkeypatch.setenv("HYBRIDKV_L2_BYTES", str(1 << 20))
    with pytest.raises(ValueError, match="scheme|nosuch"):
        HybridKVRadixCache(pools.init_params(W))
    monkeypatch.setenv("HYBRIDKV_L2_EVICTION", "lfu")
    with pytest.raises(ValueError, match="HYBRIDKV_L2_EVICTION"):
        tiers_from_env()


def test_env_selects_the_tiers(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDKV_L2_BYTES", str(1 << 20))
    monkeypatch.setenv("HYBRIDKV_L3", f"file://{tmp_path}/l3")
    monkeypatch.setenv("HYBRIDKV_WRITE_POLICY", "write_back")
    cache, _ = _cache(1, None)
    assert cache.coordinator is not None and cache.coordinator.l3 is not None
    assert cache.tier_config.l2_bytes == 1 << 20 and cache.tier_config.write_policy.value == "write_back"
    assert cache.tier_config.l2_eviction == "own" and cache.coordinator.host.victims_by is None
    cache.close()
    monkeypatch.setenv("HYBRIDKV_WRITE_POLICY", "write_through")
    monkeypatch.setenv("HYBRIDKV_L2_EVICTION", "tree")  # L2 evicts in the tree's order
    cache, _ = _cache(1, None)
    assert cache.tier_config.l2_eviction == "tree"
    assert cache.coordinator.host.victims_by == cache.coordinator.tree.runs.oldest_pages
    cache.close()
    monkeypatch.delenv("HYBRIDKV_L2_EVICTION")
    monkeypatch.delenv("HYBRIDKV_L2_BYTES")
    monkeypatch.delenv("HYBRIDKV_L3")
    assert _cache(1, None)[0].coordinator is None


# ------------------------------------------------------------------ plugin
def _ctx(pools, hicache: bool, **args):
    from types import SimpleNamespace

    from sglang.srt.mem_cache import registry

    server_args = SimpleNamespace(**{"hicache_size": 0, "hicache_ratio": None, "hicache_write_policy": "write_through",
                                     "hicache_storage_backend": None, **args})
    return registry.TreeCacheBuildContext(
        server_args=server_args, params=pools.init_params(W), is_hybrid_swa=True, is_hybrid_ssm=False,
        enable_hierarchical_cache=hicache, disable_radix_cache=False, tp_worker=None, model_config=None,
        tp_size=1, tp_rank=0, tp_group=None)


def test_plugin_enable_hierarchical_cache_turns_on_hybridkv_l2(monkeypatch):
    from hybridkv_sglang.plugin import create_hybridkv_radix_cache

    for var in ("HYBRIDKV_L2_BYTES", "HYBRIDKV_L3", "HYBRIDKV_WRITE_POLICY", "HYBRIDKV_L2_EVICTION"):
        monkeypatch.delenv(var, raising=False)
    pools = Pools(full_tokens=2000, swa_tokens=1000)
    assert create_hybridkv_radix_cache(_ctx(pools, False)).coordinator is None
    cache = create_hybridkv_radix_cache(_ctx(pools, True, hicache_ratio=0.5, hicache_write_policy="write_back"))
    device = sum(pools.kv.get_kv_size_bytes())
    assert cache.tier_config.l2_bytes == int(device * 0.5) and cache.tier_config.write_policy.value == "write_back"
    assert cache.ready_to_load_host_cache() == -1 and cache.ongoing_load_back == {} and cache.cache_controller is None
    host = cache.token_to_kv_pool_host  # what SGLang's HiCache metrics read
    assert host.logical_size > 0 and host.available_size() == host.logical_size
    cache = create_hybridkv_radix_cache(_ctx(pools, True, hicache_size=0.001))
    assert cache.tier_config.l2_bytes == int(0.001 * (1 << 30))
    with pytest.raises(ValueError, match="hicache-storage-backend.*HYBRIDKV_L3"):
        create_hybridkv_radix_cache(_ctx(pools, True, hicache_storage_backend="file"))
    with pytest.raises(ValueError, match="hicache-ratio"):
        create_hybridkv_radix_cache(_ctx(pools, True, hicache_ratio=-1.0))


def test_plugin_scopes_page_keys_per_rank_and_refuses_l3_at_tp_above_1(monkeypatch, tmp_path):
    from hybridkv_sglang.plugin import create_hybridkv_radix_cache

    pools = Pools(full_tokens=2000, swa_tokens=1000)
    ctx = _ctx(pools, True, hicache_ratio=0.5)
    a = create_hybridkv_radix_cache(ctx)
    ctx.tp_rank, ctx.tp_size = 1, 2
    b = create_hybridkv_radix_cache(ctx)
    assert "tp1/2" in b.tier_scope and a.coordinator.fingerprint != b.coordinator.fingerprint
    monkeypatch.setenv("HYBRIDKV_L3", f"file://{tmp_path}/l3")
    with pytest.raises(ValueError, match="HYBRIDKV_L3 with --tp > 1"):
        create_hybridkv_radix_cache(ctx)


# ------------------------------------------------------------------ mixed flow
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_flow_under_l1_pressure_every_tier_hit_is_the_requests_own(page_size, policy, tmp_path):
    """Shared prefixes, three requests at a time, an L1 too small for the working
    set, a small L2 over L3: hits come from all three tiers, the oracle checks
    each, the pools are conserved after every step, the tree, the mapping and the
    key registry agree every few steps."""
    cache, pools = _cache(page_size, _tiers(tmp_path, l2_bytes=1 << 17, write_policy=policy),
                          full=5000, swa=2500)
    rng = np.random.default_rng(21)
    bases = [_prompt(100 + i, 640) for i in range(4)]
    prompts = []
    for _ in range(24):
        b = bases[int(rng.integers(0, len(bases)))]
        cut = int(rng.integers(200, len(b)))
        prompts.append(np.concatenate([b[:cut], _prompt(int(rng.integers(1 << 30)), int(rng.integers(50, 600)))]))
    drv = Driver(cache, pools, W, chunk=256, max_live=3)
    steps = [0]

    def check(d):
        steps[0] += 1
        if steps[0] % 7 == 0:
            cache.sanity_check()

    drv.after_step = check
    stats = drv.run([(p, 8, None) for p in prompts])
    cache.sanity_check()
    st = cache.tier_stats()
    assert stats.rejected == 0 and st["tier_errors"] == 0
    assert stats.loaded_tokens > 0 and st["l2_hit_tokens"] + st["l3_hit_tokens"] > 0
    assert st["l1_hit_tokens"] + st["l2_hit_tokens"] + st["l3_hit_tokens"] == sum(stats.hits)
    cache.close()


# ------------------------------------------------------------------ host spec (benchmarks)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_host_spec_with_extra_layers_prices_pages_and_keeps_content(page_size):
    """L2 laid out by a larger spec (6 SWA layers per pool layer, as the tier benchmark
    prices pages like the model): the same L2 hit, content checked, and an SWA page
    costs six full ones of L2's budget."""
    from hybridkv.spec import ModelSpec

    pools = Pools(full_tokens=6000, swa_tokens=3000, page_size=page_size)
    base = spec_from_pools(pools.allocator.get_kvcache(), page_size, W)
    kinds = tuple(k for kind in base.layer_kinds for k in ((kind,) if kind is AttnKind.FULL else (kind,) * 6))
    spec = ModelSpec(name="priced", layer_kinds=kinds, window=W, full=base.full, swa=base.swa,
                     dtype=base.dtype, page_size=page_size)
    cache = HybridKVRadixCache(pools.init_params(W), tiers=_tiers(), tier_spec=spec)
    assert cache.coordinator.spec.bytes_per_page(AttnKind.SWA) == 6 * cache.coordinator.spec.bytes_per_page(AttnKind.FULL)
    p = _prompt(11, 900)
    _run(cache, pools, [p])
    _drop_l1(cache, pools)
    assert _run(cache, pools, [p]) == [_hit_of(len(p), page_size)]  # the oracle checked its K/V
    assert cache.tier_stats()["l2_hit_tokens"] == _hit_of(len(p), page_size)


def test_a_host_spec_that_cannot_hold_the_pools_pages_is_refused():
    from hybridkv.spec import KVShape, ModelSpec

    pools = Pools(full_tokens=6000, swa_tokens=3000, page_size=64)
    base = spec_from_pools(pools.allocator.get_kvcache(), 64, W)
    other = ModelSpec(name="x", layer_kinds=base.layer_kinds, window=W, full=KVShape(2, 2, 2), swa=base.swa,
                      dtype=base.dtype, page_size=64)
    with pytest.raises(ValueError, match="host_spec"):
        HybridKVRadixCache(pools.init_params(W), tiers=_tiers(), tier_spec=other)
    fewer = ModelSpec(name="y", layer_kinds=(AttnKind.FULL,), window=W, full=base.full, swa=base.swa,
                      dtype=base.dtype, page_size=64)
    with pytest.raises(ValueError, match="host_spec"):
        HybridKVRadixCache(pools.init_params(W), tiers=_tiers(), tier_spec=fewer)
    with pytest.raises(TypeError, match="host_spec"):
        HybridKVRadixCache(pools.init_params(W), tiers=_tiers(), tier_spec="big")
