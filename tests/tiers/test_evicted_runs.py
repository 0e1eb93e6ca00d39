"""With lower tiers the L1 tree keeps what it evicts as evicted runs: a prompt's
walk reads the names of the pages L1 gave up off them instead of hashing them,
the names are the ones hashing gives, the cache decides exactly as without the
runs, and the runs stay within what L2 and L3 hold, outliving L2 as L3 entries."""

from __future__ import annotations

import numpy as np
import pytest

import hybridkv.tiers.coordinator as coordinator
from hybridkv import CacheConfig
from hybridkv.eval.model.reference import tiny_spec
from hybridkv.tiers.keys import page_keys
from hybridkv.tiers.tiered import TierConfig, TieredCache


def _cache(spec, l1_pages: int, l2_pages: int, policy: str) -> TieredCache:
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    return TieredCache(spec, CacheConfig(budget_bytes=l1_pages * (fpb + spb), device="meta"),
                       tiers=TierConfig(l2_bytes=l2_pages * (fpb + spb), write_policy=policy))


def _replay(cache: TieredCache, seed: int, steps: int) -> list[tuple[int, int]]:
    """A workload of shared stems, each request a stem's prefix and its own tail;
    every walk's names checked against hashing.  Returns (hit tokens, L1 pages) per request."""
    co = cache.lower_tiers
    spec = cache.spec
    P = spec.page_size
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 500, 200).astype(np.int32) for _ in range(6)]
    out = []
    for _ in range(steps):
        stem = stems[int(rng.integers(0, len(stems)))]
        cut = int(rng.integers(8, len(stem)))
        tokens = np.concatenate([stem[:cut], rng.integers(0, 500, int(rng.integers(1, 30))).astype(np.int32)])
        n = (len(tokens) - 1) // P
        keys = co.walk_prompt(tokens, "default", n)[0]
        assert keys == page_keys(tokens[:n * P], P, namespace="default", fingerprint=co.fingerprint)
        req = cache.begin(tokens)
        out.append((req.computed, cache.tree.full_pages_cached))
        left = len(tokens) - req.computed
        cache.reserve(req, left)
        cache.commit(req, left)
        cache.finish(req)
        cache.check_invariants()
    return out


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_walks_read_evicted_names_and_the_cache_decides_as_without_them(policy, monkeypatch):
    hashed, read = [0], [0]
    walking = [False]
    real = coordinator.page_keys

    def counting(tokens, page_size, **kw):
        if walking[0]:  # the pages a walk hashes (not the names of the pages a request adds)
            hashed[0] += len(tokens) // page_size
        return real(tokens, page_size, **kw)

    monkeypatch.setattr(coordinator, "page_keys", counting)
    results, counts, stats = [], [], []
    for runs in (True, False):
        cache = _cache(tiny_spec(), l1_pages=120, l2_pages=400, policy=policy)
        co = cache.lower_tiers
        walk = co.walk_prompt

        def walk_counted(*args, **kw):
            walking[0] = True
            try:
                return walk(*args, **kw)
            finally:
                walking[0] = False

        monkeypatch.setattr(co, "walk_prompt", walk_counted)
        if not runs:
            cache.tree.runs.enable(False)  # off: every page past L1 is hashed
        co.host.victims_by = None  # L2's own order in both (the runs' order: test_l2_gives_up_the_oldest_runs_first)
        named = cache.tree.runs.names

        def names_counted(*args, **kw):
            got = named(*args, **kw)
            read[0] += len(got)
            return got

        monkeypatch.setattr(cache.tree.runs, "names", names_counted)
        hashed[0] = read[0] = 0
        try:
            results.append(_replay(cache, seed=3, steps=160))
            counts.append((hashed[0], read[0]))
            stats.append({k: v for k, v in cache.stats().items() if not k.startswith(("evicted_run_", "l2_pages_"))})
            if runs:
                assert cache.tree.runs.pages > 0
        finally:
            cache.close()
    assert results[0] == results[1]  # the same hits, the same L1 contents, request by request
    assert stats[0] == stats[1]
    assert sum(h for h, _ in results[0]) > 0
    (hashed_on, read_on), (hashed_off, read_off) = counts
    assert read_off == 0 and read_on > 0.2 * hashed_off, counts
    assert hashed_off - hashed_on == read_on, counts  # every page a run named was not hashed


def _run_names(cache: TieredCache) -> list[list[bytes]]:
    out = []
    for node in [cache.tree.root("default"), *cache.tree.iter_nodes()]:
        stack = [node.evicted or {}, *(node.inner or {}).values()]  # at its end and inside it
        while stack:
            for run in stack.pop().values():
                out.append(run.names)
                stack += [run.below or {}, *(run.inner or {}).values()]
    return out


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_runs_name_what_l2_holds_cut_as_l2_lets_pages_go(policy):
    """Without L3 the runs are L2's entries: a run that ends with a page L2 lets
    go is cut back to a page L2 holds at the next walk, so after one every page a
    run names is one L2 holds, recorded where it holds it.  Under write-through L2
    lets pages go leaf first, so the cap (L2's full pages) never drops a run;
    under write-back (L2's plain LRU) a page inside a run may go first, and the cap
    drops a few."""
    spec = tiny_spec()
    cache = _cache(spec, l1_pages=120, l2_pages=40, policy=policy)
    runs, co = cache.tree.runs, cache.lower_tiers
    try:
        _replay(cache, seed=8, steps=200)
        co.walk_prompt(np.arange(9, dtype=np.int32), "default", 2)  # a walk cuts what L2 let go
        assert len(co.l3_record) == 0 and runs.cap == co.host.num_full_pages  # (no L3: L2's alone)
        assert runs.let_go_pages > 0 and 0 < runs.pages <= runs.cap
        assert runs.dropped == 0 if policy == "write_through" else runs.dropped < runs.let_go_pages / 4
        names = [nm for n in _run_names(cache) for nm in n]
        assert len(names) == runs.pages and all(nm in co.host for nm in names)
        slots = co.host.lookup_full(names)
        for run in runs.iter_runs([cache.tree.root("default"), *cache.tree.iter_nodes()]):
            assert (run.host_at[:, 0] == co.host.lookup_full(run.names)).all()  # recorded where L2 holds it
        assert np.unique(slots).size == len(names)
        st = cache.stats()
        assert st["evicted_run_pages"] == runs.pages and st["evicted_run_pages_let_go"] == runs.let_go_pages
        assert st["evicted_run_pages_dropped"] == runs.dropped
        l1 = [nm for nd in cache.tree.iter_nodes() for nm in nd.page_keys or ()]
        assert set(co.host.full_keys()) <= set(l1) | set(names)  # every full page L2 holds: on the tree
    finally:
        cache.close()


def test_with_l3_the_cache_decides_as_without_runs(tmp_path):
    """With an L3 below L2 (a file store) the walks read runs' names too (checked
    against hashing in every walk), and every request's hit, split by tier, is the
    one the cache without runs gives."""
    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    out = []
    for runs in (True, False):
        cache = TieredCache(spec, CacheConfig(budget_bytes=120 * (fpb + spb), device="meta"),
                            tiers=TierConfig(l2_bytes=40 * (fpb + spb), l3=f"file://{tmp_path / str(runs)}",
                                             write_policy="write_through", l3_timeout_s=30.0))
        cache.tree.runs.enable(runs)
        try:
            got = []
            rng = np.random.default_rng(4)
            stems = [rng.integers(0, 500, 200).astype(np.int32) for _ in range(6)]
            for _ in range(80):
                stem = stems[int(rng.integers(0, len(stems)))]
                tokens = np.concatenate([stem[:int(rng.integers(8, len(stem)))], rng.integers(0, 500, 9).astype(np.int32)])
                assert cache.flush(30.0)  # every write landed: the same L3 for both
                req = cache.begin(tokens)
                got.append((req.computed, tuple(sorted(req.extra.get("tiers", {}).items()))))
                left = len(tokens) - req.computed
                cache.reserve(req, left)
                cache.commit(req, left)
                cache.finish(req)
                cache.check_invariants()
            out.append(got)
            if runs:
                assert cache.tree.runs.pages > 0
        finally:
            cache.close()
    assert out[0] == out[1]
    assert sum(1 for _, t in out[0] if dict(t).get("l3_hit_tokens", 0) > 0) > 0, out[0]  # L3 served some


def test_with_l3_runs_outlive_l2_as_l3_entries(tmp_path):
    """With an L3, the runs are capped at what L2 and L3 hold as far as the cache
    knows (L2's full pages and the keys of L3's record), so they keep naming pages
    L2 gave up that L3 holds, and later walks read those names off the tree."""
    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    cache = TieredCache(spec, CacheConfig(budget_bytes=60 * (fpb + spb), device="meta"),
                        tiers=TierConfig(l2_bytes=20 * (fpb + spb), l3=f"file://{tmp_path}",
                                         write_policy="write_through", l3_timeout_s=30.0))
    runs, co = cache.tree.runs, cache.lower_tiers
    try:
        _replay(cache, seed=11, steps=120)  # every walk's names checked against hashing
        assert cache.flush(30.0)
        co.walk_prompt(np.arange(9, dtype=np.int32), "default", 2)  # a walk applies the cap
        assert runs.cap == co.host.num_full_pages + len(co.l3_record) and runs.pages <= runs.cap
        assert runs.pages > co.host.num_full_pages  # more than L2 alone would allow
        # pages the runs name that L2 no longer holds but L3's record does: L3 entries
        l3_only = [k for names in _run_names(cache) for k in names
                   if k not in co.host and co.l3_record.state(k) is not None]
        assert len(l3_only) > 0, runs.pages
    finally:
        cache.close()


@pytest.mark.parametrize("order", ["tree", "own"])
def test_l2_gives_up_the_least_recently_used_runs_first(order):
    """``l2_eviction="tree"``: L2 gives up the pages the tree's runs name, the run
    of the least recently used L1 pages first, tail first (HiCache's host
    eviction), whatever L2's own use of its keys says.  Prompt a is used before
    b, both leave L1 as runs, then L2 is touched on a's pages: when L2 must give
    up four full pages, its own order (the contrast) gives up b's, the tree's
    a's, and every record stays checked."""
    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    cache = TieredCache(spec, CacheConfig(budget_bytes=60 * (fpb + spb), device="meta"),
                        tiers=TierConfig(l2_bytes=24 * (fpb + spb), l2_eviction=order))
    co, P = cache.lower_tiers, spec.page_size
    rng = np.random.default_rng(5)
    try:
        prompts = {n: rng.integers(0, 500, 8 * P + 1).astype(np.int32) for n in "abc"}
        keys = {n: page_keys(t[:8 * P], P, namespace="default", fingerprint=co.fingerprint) for n, t in prompts.items()}
        for n in "ab":
            req = cache.begin(prompts[n])
            left = len(prompts[n]) - req.computed
            cache.reserve(req, left)
            cache.commit(req, left)
            cache.finish(req)
        cache.tree.evict(full_pages=cache.tree.full_pages_cached, swa_pages=cache.tree.swa_pages_cached)
        assert cache.tree.runs.pages >= 16 and all(k in co.host for n in "ab" for k in keys[n])
        host = co.host
        host.lookup_full(keys["a"], touch=True)  # L2's own use: a most recently
        room = (host.pool.budget_bytes - host.pool.used_bytes()) // fpb
        got = host.alloc(room + 4, 0, protect_swa=range(host.pool.swa.capacity))  # 4 full pages must go
        assert got is not None
        host.free(*got)
        co.walk_prompt(prompts["c"], "default", 8)  # the runs cut as L2 let pages go
        cache.check_invariants()
        kept = {n: int((co.host.lookup_full(keys[n]) >= 0).sum()) for n in "ab"}
        first = "a" if order == "tree" else "b"
        assert kept[first] == 4 and kept["b" if first == "a" else "a"] == 8, kept
        assert co.host.counters.get("evicted_off_tree_pages", 0) == (4 if order == "tree" else 0)
        lost = [k for k in keys[first] if k not in co.host]
        assert lost == keys[first][-len(lost):]  # tail first
    finally:
        cache.close()


def test_l2_eviction_is_validated():
    spec = tiny_spec()
    with pytest.raises(ValueError, match="l2_eviction"):
        TierConfig(l2_bytes=spec.bytes_per_page("full"), l2_eviction="lfu")
    with pytest.raises(ValueError, match="needs write_policy 'write_through'"):
        TierConfig(l2_bytes=spec.bytes_per_page("full"), l2_eviction="tree", write_policy="write_back")
    assert TierConfig(l2_bytes=spec.bytes_per_page("full"), l2_eviction="tree").l2_eviction == "tree"
