"""The tier coordinator's parts: composed beside the cache (no pool swapping),
page origins as an IntEnum, the L3 key knowledge, the landing's attribution."""

from __future__ import annotations

import numpy as np

from hybridkv import CacheConfig, ModelSpec
from hybridkv.cache import HybridKVCache
from hybridkv.pools import DualPool, arena_page_bytes
from hybridkv.spec import KVShape
from hybridkv.tiers.config import PageOrigin
from hybridkv.tiers.coordinator import TierCoordinator
from hybridkv.tiers.reads import Landing, leading_true, window_safe
from hybridkv.tiers.tiered import TierConfig, TieredCache
from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.writes import L3WriteQueue

SPEC = ModelSpec("tiny-parts", ("full", "swa", "swa"), 8, KVShape(1, 4, 4), KVShape(2, 4, 4),
                 dtype="float32", page_size=4)
FPB, SPB = arena_page_bytes(SPEC, "full"), arena_page_bytes(SPEC, "swa")


def test_page_origin_values_and_int8_arrays():
    assert [int(o) for o in PageOrigin] == [0, 1, 2, 3, 4]
    origin = np.zeros(3, dtype=np.int8)
    origin[1] = PageOrigin.L2
    origin[2] = PageOrigin.L3_PREEXISTING
    assert origin.dtype == np.int8 and origin.tolist() == [0, 2, 4]
    assert (origin >= PageOrigin.L3).tolist() == [False, False, True]


def test_a_plain_cache_has_no_lower_tiers_and_a_tiered_one_composes_them():
    plain = HybridKVCache(SPEC, CacheConfig(budget_bytes=40 * (FPB + SPB), device="meta"))
    assert plain.lower_tiers is None and "l2_hit_tokens" not in plain.stats()
    cache = TieredCache(SPEC, CacheConfig(budget_bytes=40 * (FPB + SPB), device="meta"),
                        tiers=TierConfig(l2_bytes=100 * (FPB + SPB)))
    try:
        co = cache.lower_tiers
        assert isinstance(co, TierCoordinator)
        assert type(cache.pool) is DualPool and co.pool is cache.pool and co.tree is cache.tree
        assert co.backup.on_l1_free in cache.tree.free_listeners
        assert co.writes.on_l2_freeing in cache.host.free_listeners
        assert cache.tier_counters is co.counters and cache.host is co.host and cache.l3 is None
        req = cache.begin(np.arange(30, dtype=np.int32))
        cache.reserve(req, 30)
        cache.commit(req, 30)
        cache.finish(req)
        assert cache.stats()["l1_to_l2_full_pages"] == 7  # write-through at finish: 29 // 4 pages
        cache.check_invariants()
    finally:
        cache.close()


class _Puts:
    """A TierManager stand-in: takes every write, runs nothing."""

    def __init__(self) -> None:
        self.jobs: list[tuple[list[bytes], object]] = []

    def put_async(self, keys, *, encode, event_keys, swa, done) -> bool:  # noqa: ANN001
        self.jobs.append((list(keys), done))
        return True


def test_write_queue_writes_what_the_record_lacks_and_tells_it_about_failed_puts():
    import threading

    from hybridkv.spec import AttnKind
    from hybridkv.tiers.payload import ScaledPayload

    record, puts = StoreIndex(None), _Puts()
    q = L3WriteQueue(puts, ScaledPayload(SPEC), threading.RLock(), record, {"bytes_l3_written": 0})
    record.stored([b"b"])  # read back earlier: not written again
    q.queue(AttnKind.FULL, [b"a", b"b", b"c"], np.array([0, 1, 2]))
    assert puts.jobs[0][0] == [b"a", b"c"] and record.held([b"a", b"b", b"c", b"d"]).tolist() == [1, 1, 1, 0]
    assert not q.predates(b"a") and q.predates(b"b")  # queued here / older than this cache
    puts.jobs[0][1]([b"c"])  # the put of c failed: out of the record, so written again later
    assert record.held([b"a", b"c"]).tolist() == [True, False]
    q.queue(AttnKind.FULL, [b"a", b"c"], np.array([0, 2]))
    assert puts.jobs[1][0] == [b"c"]


def test_landing_marks_the_first_serve_only():
    landing = Landing(host=None, codec=None, l3=None, record=StoreIndex(None), predates=lambda k: False, counters={})
    landing._landed[b"k1"] = False  # landed from data this cache wrote
    landing._landed[b"k2"] = True   # landed from data older than this cache
    origin = np.array([PageOrigin.L2, PageOrigin.L2, PageOrigin.L1], dtype=np.int8)
    landing.served([b"k1", b"k2", b"k3"], origin, 3)
    assert origin.tolist() == [PageOrigin.L3, PageOrigin.L3_PREEXISTING, PageOrigin.L1]
    again = np.array([PageOrigin.L2, PageOrigin.L2], dtype=np.int8)
    landing.served([b"k1", b"k2"], again, 2)
    assert again.tolist() == [PageOrigin.L2, PageOrigin.L2]


def test_leading_true_and_window_safe():
    assert leading_true(np.array([True, True, False, True])) == 2
    assert leading_true(np.ones(3, bool)) == 3 and leading_true(np.zeros(0, bool)) == 0
    assert window_safe(np.zeros(0, bool), 2) == 0
    assert window_safe(np.array([False, True, True, False]), 2) == 3
