"""Bounded memory over time: replaying a trace again and again (fresh token
ids each pass) through one cache must not grow its heap or any index after
the first passes.  Every lazy heap of the tree, the anchor heap included, is
rebuilt at the same limit; one left out grows without bound (+100% from pass 2
to 4 here)."""

from __future__ import annotations

from hybridkv import ModelSpec
from hybridkv.eval.soak import growth, index_sizes, lazy_heaps, soak
from hybridkv.eval.traces import bundled_sample, load_trace


def test_soak_heap_and_indexes_stop_growing():
    reqs = load_trace(bundled_sample(), limit=500)
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    records = soak(reqs, spec, 59 * 10**9, passes=4)
    assert all(r["hit_tokens"] > 0 for r in records)  # the passes really exercise the cache
    g = growth(records, after=2)
    assert g["heap_bytes"] < 0.15, (g["heap_bytes"], [r["heap_bytes"] for r in records])
    last = records[-1]["indexes"]
    for name, frac in g.items():
        if name == "heap_bytes" or frac < 0.15:
            continue
        if name.startswith("tree.") and name.endswith("_heap"):
            # lazy heaps: a saw-tooth between rebuilds at 4x the nodes + 4096
            assert lazy_heaps(records)[name]["max"] <= max(r["heap_limit"] for r in records), name
            continue
        if name.startswith("tree.divergence."):
            # the divergence model: 256 events, 2,048 ghost returns, ghosts capped like
            # the reuse model's (4x the cached nodes + 1024)
            nodes = max(r["tree_nodes"] for r in records)
            assert last[name] <= max(2048, 4 * nodes + 1024), (name, last[name], nodes)
            continue
        if name in ("tree.reuse._ghosts", "tree.reuse._running"):
            # the reuse model's ghosts fill up to their cap, 4x the cached nodes + 1024;
            # open periods are one per leaf or ghost
            nodes = max(r["tree_nodes"] for r in records)
            assert last[name] <= 5 * nodes + 1024, (name, last[name], nodes)
            continue
        # allocator arrays grow by doubling up to the pool's capacity, never past it
        assert name.startswith("pool.") and last[name] <= 2 * 59 * 10**9 // spec.bytes_per_page("full"), \
            (name, frac, last[name])


def test_index_sizes_sees_the_tree_heaps():
    from hybridkv import CacheConfig, HybridKVCache
    cache = HybridKVCache(ModelSpec.preset("mimo-v2.5-pro", page_size=64), CacheConfig(budget_bytes=10**11))
    sizes = index_sizes(cache)
    assert any(k.startswith("tree.") and "heap" in k for k in sizes), sizes
    assert "_live" in sizes and "pool.full._allocated" in sizes


def test_lazy_heaps_stay_within_their_rebuild_limit():
    from hybridkv import CacheConfig, HybridKVCache
    from hybridkv.eval.replay import ReplayStats, run_request
    from hybridkv.eval.traces import TokenMaterializer
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    cache = HybridKVCache(spec, CacheConfig(budget_bytes=20 * 10**9))
    tree, mat, stats = cache.tree, TokenMaterializer(), ReplayStats("hybridkv", cache=cache)
    worst = 0
    for r in load_trace(bundled_sample(), limit=400):
        run_request(cache, mat.tokens(r), r.namespace, 8192, stats)
        limit = tree.heap_limit()
        assert limit == 4 * tree.num_nodes + 4096
        sizes = tree.heap_sizes()
        for heap in ("swa", "anchor"):
            worst = max(worst, sizes[heap] / limit)
    assert tree.evicted_full_pages > 0  # eviction popped and refreshed heap entries
    # the next push past the limit rebuilds; between pushes, evicted nodes lower the
    # limit (4 entries each) while their stale entries wait: O(nodes) all the same
    assert worst <= 1.5, worst


def test_a_tiered_soak_holds_its_l2_index_and_evicted_runs_bounded():
    """With an L2 below L1 the L1 tree keeps what it evicts as evicted runs: replaying
    new traffic again and again, the runs stay within the full pages L2 holds and no
    index (L2's, the runs' order) nor the heap keeps growing."""
    reqs = load_trace(bundled_sample(), limit=300)
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    records = soak(reqs, spec, 20 * 10**9, passes=4, l2_bytes=60 * 10**9)
    assert all(r["hit_tokens"] > 0 for r in records)
    idx = records[-1]["indexes"]
    assert idx["tree.runs._order"] > 0  # the runs took part
    assert idx["tree.runs._order"] <= 2 * idx["lower_tiers.host._full"] + 64
    g = growth(records, after=2)
    assert g["heap_bytes"] < 0.15, (g["heap_bytes"], [r["heap_bytes"] for r in records])
    for name in ("tree.runs._order", "lower_tiers.host._full", "lower_tiers.host._parent", "lower_tiers.host._l1"):
        assert g[name] < 0.15, (name, [r["indexes"][name] for r in records])
