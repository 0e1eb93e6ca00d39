"""Layer-by-layer L2 -> L1 loads on SGLang's layer hooks (:mod:`hybridkv_sglang.layer_loads`).

SGLang's own ``LayerDoneCounter`` is registered with the real ``SWAKVPool`` (as the
plugin registers it under ``--enable-hierarchical-cache``); the driver calls
``ready_to_load_host_cache`` and sets the consumer before the "forward", whose
reads go through ``get_key_buffer`` / ``get_value_buffer`` (the pool's wait).
Every hit is checked by the content oracle, at page sizes 1 and 64."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import conftest
from sglang_flow import Driver, Pools, PseudoHitError

conftest.publish_test_server_args()

from sglang.srt.managers.cache_controller import LayerDoneCounter  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from hybridkv.tiers.config import TierConfig  # noqa: E402
from hybridkv_sglang.radix_cache import HybridKVRadixCache  # noqa: E402

W = 128


class _Recorder:
    """Wraps SGLang's counter: records each layer event completed and each wait."""

    def __init__(self, counter: LayerDoneCounter) -> None:
        self.inner = counter
        self.log: list[tuple[str, int]] = []
        for ev in counter.events:
            done = ev.complete
            ev.complete = lambda i, done=done: (self.log.append(("done", i)), done(i))[-1]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait_until(self, layer: int) -> None:
        if self.inner.consumer_index >= 0:
            self.log.append(("wait", layer))
        self.inner.wait_until(layer)


def _setup(page_size: int):
    pools = Pools(full_tokens=6000, swa_tokens=3000, page_size=page_size)
    counter = _Recorder(LayerDoneCounter(pools.kv.layer_num))
    pools.kv.register_layer_transfer_counter(counter)
    tiers = TierConfig(l2_bytes=1 << 22, l2_device="cpu")
    cache = HybridKVRadixCache(pools.init_params(W), tiers=tiers, layer_counter=counter)
    return cache, pools, counter


def _run(cache, pools, prompts):
    drv = Driver(cache, pools, W, chunk=512, max_live=1)
    drv.run([(p, 4, None) for p in prompts])
    cache.sanity_check()
    return drv.stats.hits


def _drop_l1(cache, pools) -> None:
    cache.evict(EvictParams(num_tokens=pools.full_tokens, swa_num_tokens=pools.swa_tokens))
    assert cache.total_size() == 0


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 30000, n).astype(np.int64)


@pytest.mark.parametrize("page_size", (1, 64))
def test_an_l2_hit_loads_layer_by_layer_and_each_layer_waits_for_its_own(page_size):
    cache, pools, counter = _setup(page_size)
    p = _prompt(1, 900)
    assert _run(cache, pools, [p]) == [0]
    loads = cache.coordinator.layer_loads
    assert loads is not None and loads.issued == 0
    _drop_l1(cache, pools)
    counter.log.clear()
    hit = (len(p) - 1) // page_size * page_size
    assert _run(cache, pools, [p]) == [hit]  # the oracle read every loaded page through the pool's wait
    assert loads.issued == 1 and loads.issued_layers == pools.kv.layer_num and loads.flushed == 0
    done = [i for what, i in counter.log if what == "done"]
    assert done == list(range(pools.kv.layer_num))  # model-layer order
    first_wait = next(n for n, (what, _) in enumerate(counter.log) if what == "wait")
    # the forward's reads of layer i wait on layer i's event, recorded before
    waits = {i for what, i in counter.log[first_wait:] if what == "wait"}
    assert waits == set(range(pools.kv.layer_num))
    assert cache.tier_stats()["l2_hit_tokens"] == hit and cache.counters["loaded_tokens"] == hit


@pytest.mark.parametrize("page_size", (1, 64))
def test_loads_are_queued_until_the_batch_runs(page_size):
    """Planted fault: a scheduler that never issues the batch's loads. The loaded
    pages then hold no K/V of the request and the oracle catches it, so the copies
    really wait for ready_to_load_host_cache."""
    cache, pools, _ = _setup(page_size)
    p = _prompt(2, 900)
    _run(cache, pools, [p])
    _drop_l1(cache, pools)
    cache.ready_to_load_host_cache = lambda: -1
    with pytest.raises(PseudoHitError):
        _run(cache, pools, [p])


def test_a_device_read_runs_queued_loads_first():
    """A device -> host copy (a backup) of a page whose load is queued reads it only
    after the load: here the loaded pages are copied back over their own L2 pages
    before the batch runs; without the flush L2 would get what the device pages held
    before, and the next L2 hit of the prompt would fail the oracle."""
    from hybridkv.spec import AttnKind
    from hybridkv_sglang.radix_cache import namespace_of

    cache, pools, _ = _setup(64)
    co = cache.coordinator
    p = _prompt(3, 900)
    _run(cache, pools, [p])
    _drop_l1(cache, pools)
    ext, ns = np.append(p, 0).astype(np.int32), namespace_of(None, None)
    real = cache.ready_to_load_host_cache
    copied = []

    def backup_then_issue():
        assert len(co.layer_loads) > 0  # init_load_back queued the load
        slots = cache.path_device_indices(cache.lifecycle.match(ext[:-1], ns, touch=False)[2]).numpy()
        dev = slots[::64] // 64
        host = co.host.lookup_full(co.page_keys(ext, ns, len(dev)))
        assert (host >= 0).all()
        co.copy(AttnKind.FULL, co.pool, dev, co.host.pool, host)
        copied.append(len(dev))
        return real()

    cache.ready_to_load_host_cache = backup_then_issue
    hit = (len(p) - 1) // 64 * 64
    assert _run(cache, pools, [p]) == [hit]
    assert copied == [hit // 64] and co.layer_loads.flushed == 2 and co.layer_loads.issued == 0
    cache.ready_to_load_host_cache = real
    _drop_l1(cache, pools)
    assert _run(cache, pools, [p]) == [hit]  # L2's pages were rewritten with the loaded K/V
    assert co.layer_loads.issued == 1


def test_the_plugin_registers_sglang_s_counter_with_the_pool_and_the_worker(monkeypatch):
    from sglang.srt.mem_cache import registry

    from hybridkv_sglang.plugin import create_hybridkv_radix_cache

    for var in ("HYBRIDKV_L2_BYTES", "HYBRIDKV_L3", "HYBRIDKV_WRITE_POLICY", "HYBRIDKV_L2_EVICTION"):
        monkeypatch.delenv(var, raising=False)
    registered = []
    worker = SimpleNamespace(register_hicache_layer_transfer_counter=registered.append)

    def ctx(pools, hicache):
        args = SimpleNamespace(hicache_size=0, hicache_ratio=1.0, hicache_write_policy="write_through",
                               hicache_storage_backend=None)
        return registry.TreeCacheBuildContext(
            server_args=args, params=pools.init_params(W), is_hybrid_swa=True, is_hybrid_ssm=False,
            enable_hierarchical_cache=hicache, disable_radix_cache=False, tp_worker=worker, model_config=None,
            tp_size=1, tp_rank=0, tp_group=None)

    pools = Pools(full_tokens=2000, swa_tokens=1000, page_size=64)
    cache = create_hybridkv_radix_cache(ctx(pools, True))
    assert isinstance(cache.layer_counter, LayerDoneCounter) and registered == [cache.layer_counter]
    assert pools.kv.layer_transfer_counter is cache.layer_counter
    assert cache.coordinator.layer_loads.counter is cache.layer_counter
    assert cache.ready_to_load_host_cache() == -1  # nothing queued
    pools = Pools(full_tokens=2000, swa_tokens=1000, page_size=64)
    cache = create_hybridkv_radix_cache(ctx(pools, False))  # no tiers, no hooks
    assert cache.layer_counter is None and pools.kv.layer_transfer_counter is None and len(registered) == 1


@pytest.mark.parametrize("page_size", (1, 64))
def test_a_load_failing_half_way_drops_what_it_queued(page_size):
    """The full pages' copy is queued, then the SWA copy fails: the load's pages go
    back to the allocator and their queued copies with them (none is issued into
    pages another request may now hold)."""
    from hybridkv.spec import AttnKind

    cache, pools, _ = _setup(page_size)
    co = cache.coordinator
    p = _prompt(4, 900)
    _run(cache, pools, [p])
    _drop_l1(cache, pools)
    real, queued = co.copy, []

    def swa_fails(kind, src, sp, dst, dp):
        if src is co.host.pool and kind is AttnKind.SWA:
            queued.append(len(co.layer_loads))
            raise RuntimeError("H2D failed")
        return real(kind, src, sp, dst, dp)

    co.copy = swa_fails
    assert _run(cache, pools, [p]) == [0]
    loads = co.layer_loads
    assert queued == [1] and len(loads) == 0 and loads.issued == 0 and loads.flushed == 0
    assert co.counters["tier_errors"] >= 1
    co.copy = real
    assert _run(cache, pools, [p]) == [(len(p) - 1) // page_size * page_size]
    _drop_l1(cache, pools)
    a = pools.allocator
    assert (a.full_available_size(), a.swa_available_size()) == (pools.full_tokens, pools.swa_tokens)
