"""Retention regressions (issue 13): each test lost a hit (or raised) before
the RetentionPolicy owned every keep/evict decision."""

import numpy as np
import pytest

from hybridkv import CacheConfig, HybridKVCache
from hybridkv.radix import TreeConfig, WindowSafeTree
from hybridkv.radix.policy import AdaptiveRanking, RetentionPolicy

from helpers import RecordingPool as Pool, run, spec


def test_exact_repeat_of_page_aligned_prompt_hits_under_eager():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0, retention="eager"))
    prompt = np.arange(8, dtype=np.int32)
    assert run(cache, prompt, chunk=2) == 0
    assert run(cache, prompt) == 6  # the hit stops one token short: ends at page 3, not 4


def test_exact_repeat_hits_under_adaptive_once_memory_is_full():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=10, swa_pages=10, swa_checkpoint=0,
                                              retention="adaptive"))
    run(cache, np.arange(100, 112), chunk=2)       # 6 of 10 pages in both pools
    prompt = np.arange(8, dtype=np.int32)
    run(cache, prompt, chunk=2)                    # fills both pools: its last release is not spared
    assert run(cache, prompt) == 6


def test_tail_survives_when_page_size_does_not_divide_window():
    cache = HybridKVCache(spec(page=3, window=4),
                          CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0, retention="eager"))
    first = np.arange(10, dtype=np.int32)
    run(cache, first, chunk=5)
    longer = np.concatenate([first[:9], np.arange(50, 58, dtype=np.int32)])
    assert run(cache, longer) == 9  # the window before the last whole page survived release


def test_new_branch_point_gets_a_window_under_pressure():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0, retention="eager"))
    a = np.arange(16, dtype=np.int32)
    run(cache, a, chunk=4)                           # SWA kept only at a's tail
    b = np.concatenate([a[:10], np.arange(60, 66, dtype=np.int32)])
    assert run(cache, b, chunk=4) == 0               # raw match 10 > hit 0: a divergence point
    # drop every SWA page no anchor covers: the new branch window must not be among them
    t = cache.tree
    unanchored = sum(int(((n.swa >= 0) & (n.anchor == 0)).sum()) for n in t.iter_nodes())
    t.evict(swa_pages=unanchored)
    cache.check_invariants()
    c = np.concatenate([a[:10], np.arange(70, 76, dtype=np.int32)])
    assert run(cache, c) == 10


def test_window_spanning_three_nodes_stays_anchored():
    t = WindowSafeTree(TreeConfig(1, 4, anchor_branch_points=False), Pool())
    ids = iter(range(1000))

    def ins(key):  # fresh ids everywhere: the tree frees the duplicates of what it caches
        n = len(key)
        t.insert(np.asarray(key, dtype=np.int32), np.array([next(ids) for _ in range(n)], dtype=np.int32),
                 np.array([next(ids) for _ in range(n)], dtype=np.int32))

    a = list(range(12))
    ins(a)
    ins(a[:10] + [100])
    ins(a[:9] + [200, 201, 202, 203, 204])
    t.check_invariants()
    unanchored = sum(int(((n.swa >= 0) & (n.anchor == 0)).sum()) for n in t.iter_nodes())
    t.evict(swa_pages=unanchored)
    t.check_invariants()
    assert t.match(np.array(a[:10] + [100, 7], dtype=np.int32)).length == 11
    assert t.match(np.array(a + [7], dtype=np.int32)).length == 12


def test_eviction_trims_a_leaf_back_to_its_last_window():
    pool = Pool()
    t = WindowSafeTree(TreeConfig(2, 4, swa_checkpoint=8), pool)
    key = np.arange(32, dtype=np.int32)
    swa = np.full(16, -1, dtype=np.int32)
    keep = np.array([2, 3, 6, 7, 10, 11, 14, 15])   # checkpoint windows and the tail
    swa[keep] = 100 + keep
    t.insert(key, np.arange(16), swa)
    assert t.evict(full_pages=2) == (4, 2)           # back to the checkpoint at page 12, not all 16
    t.check_invariants()
    assert t.match(np.concatenate([key[:24], [99]])).length == 24
    assert t.full_pages_cached == 12


def test_no_swa_eviction_with_fixed_split_evicts_a_leaf_instead_of_failing():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=32, swa_pages=8, swa_checkpoint=0, retention="none",
                                              swa_eviction="none", anchor_branch_points=False))
    run(cache, np.arange(16), chunk=4)               # the tree holds all 8 SWA pages
    assert run(cache, np.arange(100, 108), chunk=4) == 0   # needs SWA: a leaf must go


def test_policy_release_cut_and_divergence():
    p = RetentionPolicy(page_size=3, window=4, checkpoint=0)
    assert p.window_pages == 2
    assert p.release_cut(10) == 1                   # keep pages 1, 2 (window before page 3)
    assert p.release_cut(9) == 0                    # an exact repeat of 9 tokens hits 6: needs pages 0, 1
    mask = p.releasable(0, 6, raw_match=12, hit=0)
    assert mask.tolist() == [True, True, False, False, True, True]


def test_adaptive_ranking_moves_target_toward_ghost_hits():
    r = AdaptiveRanking()
    r.pages[AdaptiveRanking.RECENT] = 10
    r.pages[AdaptiveRanking.REUSED] = 10
    r.remember(AdaptiveRanking.RECENT, 1, 4)
    r.remember(AdaptiveRanking.REUSED, 2, 3)
    assert r.on_miss(1) and r.target == 4           # ratio |B2| / |B1| = 3 / 4 -> 1
    assert r.on_miss(2) and r.target == 1           # B1 is empty now: ratio 1
    assert not r.on_miss(3)
    assert r.evict_from(recent_available=True, reused_available=True) == AdaptiveRanking.RECENT   # 10 > target 1
    assert r.evict_from(recent_available=False, reused_available=True) == AdaptiveRanking.REUSED


def test_a_leaf_left_without_its_window_is_evicted_before_live_data():
    pool = Pool()
    t = WindowSafeTree(TreeConfig(2, 4, ranking="adaptive"), pool)  # its segment order
    ids = iter(range(10_000))

    def ins(key, swa_pages):
        n = len(key) // 2
        swa = np.full(n, -1, dtype=np.int32)
        for i in swa_pages:
            swa[i] = next(ids)
        t.insert(np.asarray(key, dtype=np.int32), np.array([next(ids) for _ in range(n)], dtype=np.int32), swa)

    c = list(range(500, 516))
    a = list(range(16))
    ins(c, [6, 7])
    ins(a, [6, 7])
    ins(a + list(range(100, 108)), [10, 11])      # extends a: a's tail window is no anchor any more
    t.evict(swa_pages=2)                           # ... so it goes first under SWA pressure
    t.match(np.array(c + [1], dtype=np.int32))     # c is used again, then a's prefix (more recent)
    t.match(np.array(a[:8] + [1], dtype=np.int32))
    assert t.evict(full_pages=1)[0] == 4           # the extension (RECENT) goes first ...
    assert t.evict(full_pages=1)[0] == 8           # ... leaving a without a window: dead, before c
    t.check_invariants()
    assert t.match(np.array(c + [1], dtype=np.int32)).length == 16


@pytest.mark.parametrize("ranking", ["value", "adaptive", "arc", "lru"])
def test_every_ranking_keeps_the_invariants_under_churn(ranking):
    rng = np.random.default_rng(7)
    cache = HybridKVCache(spec(), CacheConfig(full_pages=40, swa_pages=16, swa_checkpoint=8,
                                              eviction_ranking=ranking))
    convs = [list(rng.integers(0, 50, 4)) for _ in range(6)]
    hits = 0
    for i in range(150):
        c = convs[rng.integers(0, len(convs))]
        c += list(rng.integers(0, 50, rng.integers(1, 7)))   # the next turn extends the conversation
        if len(c) > 30:
            c[:] = list(rng.integers(0, 50, 4))
        hits += run(cache, c, chunk=4)
    assert hits > 0
    assert cache.tree.ranking.pages[1] + cache.tree.ranking.pages[2] == cache.tree.full_pages_cached


def test_unknown_ranking_is_rejected():
    with pytest.raises(ValueError, match="ranking"):
        TreeConfig(2, 4, ranking="mru")
    from hybridkv import CacheConfig
    # the cache's config names its own arguments, at construction
    with pytest.raises(ValueError, match="eviction_ranking must be one of"):
        CacheConfig(budget_bytes=10**9, eviction_ranking="mru")
    with pytest.raises(ValueError, match="swa_eviction must be one of"):
        CacheConfig(budget_bytes=10**9, swa_eviction="all")
    with pytest.raises(ValueError, match="swa_checkpoint must be an int >= 0"):
        CacheConfig(budget_bytes=10**9, swa_checkpoint=-1)


def test_trim_tells_listeners_which_pages_went():
    t = WindowSafeTree(TreeConfig(2, 4, swa_checkpoint=8), Pool())
    events = []
    t.listeners.append(events.append)
    key = np.arange(32, dtype=np.int32)
    swa = np.full(16, -1, dtype=np.int32)
    keep = np.array([2, 3, 6, 7, 10, 11, 14, 15])
    swa[keep] = 100 + keep
    t.insert(key, np.arange(16), swa)
    t.evict(full_pages=2)
    ev = events[-1]
    assert ev.kind == "remove" and (ev.start, ev.end) == (24, 32)
    assert ev.tokens.tolist() == key.tolist() and ev.swa_valid.tolist() == [False, False, True, True]


def _workload(kind, seed=3):
    """``scan``: three hot prompts come back every 5th request through a flood of
    one-shot prompts larger than the cache.  ``recency``: four conversations
    take turns, each turn extending the previous one (LRU's best case)."""
    rng = np.random.default_rng(seed)
    if kind == "scan":
        hot = [list(rng.integers(0, 1000, 16)) for _ in range(3)]
        for i in range(300):
            if i % 5 == 0:
                yield hot[(i // 5) % 3] + list(rng.integers(0, 1000, 3))
            else:
                yield list(rng.integers(1000, 100000, 16))
    else:
        convs = [list(rng.integers(0, 1000, 6)) for _ in range(4)]
        for i in range(300):
            c = convs[i % 4]
            c += list(rng.integers(0, 1000, 4))
            if len(c) > 40:
                c[:] = list(rng.integers(0, 1000, 6))
            yield list(c)


def _hit_rate(kind, ranking):
    cache = HybridKVCache(spec(), CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0,
                                              eviction_ranking=ranking))
    hits = total = 0
    for prompt in _workload(kind):
        hits += run(cache, prompt, chunk=4)
        total += len(prompt)
    return hits / total


def test_default_ranking_resists_scans_and_keeps_recency():
    """The default is within a small margin of the better fixed rule on a
    scan-heavy and on a recency-friendly workload, with nothing tuned to either."""
    scan = {r: _hit_rate("scan", r) for r in ("adaptive", "arc", "lru")}
    assert scan["lru"] == 0 and scan["adaptive"] >= scan["arc"] - 0.02 and scan["adaptive"] > 0.1, scan
    rec = {r: _hit_rate("recency", r) for r in ("adaptive", "arc", "lru")}
    assert rec["adaptive"] >= max(rec["lru"], rec["arc"]) - 0.05 and rec["adaptive"] >= rec["lru"] - 0.02, rec


def test_next_turn_of_a_reused_sequence_starts_reused():
    def segs(ranking):
        t = WindowSafeTree(TreeConfig(2, 4, ranking=ranking), Pool())
        ids = iter(range(10_000))

        def ins(key):
            n = len(key) // 2
            t.insert(np.asarray(key, dtype=np.int32), np.array([next(ids) for _ in range(n)], dtype=np.int32),
                     np.array([next(ids) for _ in range(n)], dtype=np.int32))
            return t.match(np.asarray(key + [0], dtype=np.int32), touch=False).node

        first = ins(list(range(8)))
        t.match(np.array(list(range(8)) + [0], dtype=np.int32))      # turn 2 hits turn 1: REUSED
        second = ins(list(range(8)) + list(range(50, 54)))           # turn 2 extends the leaf
        branch = ins(list(range(4)) + list(range(80, 86)))           # a fork of the shared prefix
        t.check_invariants()
        return first.seg, second.seg, branch.seg

    R, U = AdaptiveRanking.RECENT, AdaptiveRanking.REUSED
    assert segs("adaptive") == (U, U, R)
    assert segs("arc") == (U, R, R)


def test_ghost_step_uses_arcs_ratio_only_under_adaptive():
    for mode, want in (("adaptive", 12.0), ("arc", 4.0)):
        r = AdaptiveRanking(mode)
        r.pages[AdaptiveRanking.RECENT] = 20
        r.pages[AdaptiveRanking.REUSED] = 20
        r.remember(AdaptiveRanking.RECENT, 1, 4)
        r.remember(AdaptiveRanking.REUSED, 2, 12)
        assert r.on_miss(1) and r.target == want, (mode, r.target)   # 4 pages x max(1, 12 / 4)
