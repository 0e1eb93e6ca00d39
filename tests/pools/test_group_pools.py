"""One page allocator per KV group under one arena and one byte budget.

A model with two sliding windows (:func:`tiny_two_window_spec`: windows 8 and
16 tokens, pages of 4) keeps one SWA page id per page of a sequence; the lead
group (the largest window) owns the ids, the smaller window's group holds its
own pages per id and gives them back as soon as no hit can use them.  Checked
here: the pool's byte and block accounting per group, what a finished request
leaves each group, the window rule asking every group, and the tiers copying
only pages every group holds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import CacheConfig, HybridKVCache
from hybridkv.eval.model.reference import tiny_spec, tiny_two_window_spec
from hybridkv.pools import DualPool
from hybridkv.window import group_keeps

PROMPT = np.arange(100, dtype=np.int32) % 7 + 1  # 25 pages of 4 tokens


def _cache(spec=None, **cfg) -> HybridKVCache:  # noqa: ANN001
    cfg = {"budget_bytes": 10**7, "device": "cpu", "swa_checkpoint": 0, "retention": "eager", **cfg}
    return HybridKVCache(spec or tiny_two_window_spec(), CacheConfig(**cfg))


def _run(cache: HybridKVCache, tokens: np.ndarray, chunk: int = 12) -> None:
    req = cache.begin(tokens)
    while req.computed < len(tokens):
        n = min(chunk, len(tokens) - req.computed)
        cache.allocate(req, n)
        cache.commit(req, n)
    cache.finish(req)


def test_pool_accounts_each_group_under_one_budget() -> None:
    spec = tiny_two_window_spec()
    pool = DualPool(spec, budget_bytes=10**6, device="cpu")
    assert [g.group.name for g in pool.groups] == ["swa-8"]  # the lead (swa-16) owns the ids
    small = pool.groups[0]
    lay = pool.layout
    cols = lay.swa.group_columns
    assert [c for _, c in cols] and sum(c for _, c in cols) == lay.swa.blocks_per_page
    assert small.page_bytes + pool.lead_page_bytes == pool.swa_page_bytes
    full, swa = pool.alloc(2, 3)
    assert small.used == 3 and pool.used_bytes() == 2 * pool.full_page_bytes + 3 * pool.swa_page_bytes
    blocks = pool.buffers.blocks.num_used
    assert pool.release_group(small, swa[:2]) == 2
    assert pool.release_group(small, swa[:2]) == 0  # given back already: skipped
    assert small.used == 1 and pool.used_bytes() == (2 * pool.full_page_bytes + 3 * pool.swa_page_bytes
                                                     - 2 * small.page_bytes)
    assert pool.buffers.blocks.num_used == blocks - 2 * cols[0][1]
    assert pool.held_by_all(np.r_[swa, -1]).tolist() == [False, False, True, False]
    pool.check_invariants()
    pool.free_swa(swa)
    pool.free_full(full)
    assert small.used == 0 and pool.used_bytes() == 0 and pool.buffers.blocks.num_used == 0
    pool.check_invariants()


def test_a_freed_group_page_cannot_be_read() -> None:
    """Reading a layer whose group gave the page back raises: never garbage."""
    spec = tiny_two_window_spec()
    pool = DualPool(spec, budget_bytes=10**6, device="cpu")
    _, swa = pool.alloc(1, 1)
    pool.release_group(pool.groups[0], swa)
    small_layer = spec.groups[1].layers[0]  # swa-8
    large_layer = spec.groups[2].layers[0]  # swa-16
    kb = pool.buffers.swa
    kb.read(kb.local(large_layer), np.array([swa[0] * spec.page_size]))
    with pytest.raises(RuntimeError, match="no KV block"):
        kb.read(kb.local(small_layer), np.array([swa[0] * spec.page_size]))


def test_a_finished_request_leaves_each_group_its_own_window() -> None:
    cache = _cache()
    _run(cache, PROMPT)
    cache.check_invariants()
    small = cache.pool.groups[0]
    # the lead keeps its 16-token window (and the partial page), the 8-token group half of it
    assert cache.pool.swa.used == 5 and small.used == 3
    assert cache.counters["released_group_pages"] == 2
    assert cache.stats()["group_tokens"] == {"swa-8": 3 * 4}
    assert cache.match(np.r_[PROMPT, 5]).length == 100


def test_one_window_models_have_no_group_beside_the_lead() -> None:
    cache = _cache(tiny_spec())
    assert cache.pool.groups == () and cache.pool.lead_page_bytes == cache.pool.swa_page_bytes
    _run(cache, PROMPT)
    assert "released_group_pages" not in cache.counters


def test_a_hit_needs_every_groups_window() -> None:
    """Take the small group's page of the tail window away (from its owner, the
    node, and from the pool): the lead still holds its window, but the hit may
    not end there any more."""
    cache = _cache()
    _run(cache, PROMPT)
    probe = np.r_[PROMPT, 5]
    node = cache.match(probe).node
    last = int(np.flatnonzero(node.side[0] >= 0)[-1])
    assert cache.match(probe).length == 100
    gone = node.side[0][last:last + 1].copy()
    node.side[0] = np.where(np.arange(node.n_pages) == last, -1, node.side[0]).astype(np.int32)
    cache.pool.release_group(cache.pool.groups[0], gone)
    got = cache.match(probe)
    assert got.raw_length == 100 and got.length < 100
    cache.check_invariants()


def test_nodes_and_requests_hold_a_page_id_per_group() -> None:
    """The side group's page ids live in the tree's nodes and the requests (its
    id is the lead's where it holds the page, -1 where it gave it back); the
    pool holds storage for exactly those ids, and a release behind the owner's
    back is caught by the invariants."""
    cache = _cache()
    req = cache.begin(PROMPT)
    cache.allocate(req, 100)
    cache.commit(req, 100)
    small = cache.pool.groups[0]
    side = req.side_pages[0][:req.n_pages]
    assert ((side == -1) | (side == req.swa_pages[:req.n_pages])).all()
    assert np.count_nonzero(side >= 0) == small.used <= np.count_nonzero(req.swa_pages[:req.n_pages] >= 0)
    cache.finish(req)
    nodes = list(cache.tree.iter_nodes())
    in_tree = np.concatenate([n.side[0] for n in nodes])
    assert np.count_nonzero(in_tree >= 0) == small.used
    hit = cache.match(np.r_[PROMPT, 5])
    assert hit.side_pages is not None and len(hit.side_pages[0]) == len(hit.swa_pages)
    cache.check_invariants()
    cache.pool.release_group(small, in_tree[in_tree >= 0][-1:])  # the owner still lists it
    with pytest.raises(AssertionError, match="side group ownership"):
        cache.check_invariants()


def test_dense_retention_keeps_every_group() -> None:
    cache = _cache(retention="dense")
    _run(cache, PROMPT)
    assert cache.pool.groups[0].used == cache.pool.swa.used == 25
    assert cache.match(np.r_[PROMPT[:48], 9]).length == 48


@pytest.mark.parametrize("retention", ["eager", "adaptive"])
def test_smaller_window_saves_memory_and_hits_as_much(retention: str) -> None:
    """Same workload, same budget: the two-window model's pool ends holding fewer
    bytes than the same model with both windows at 16 would (the group gave its
    pages back) and serves the same hits.  Adaptive retention with memory to
    spare keeps SWA densely, every group alike: the same bytes."""
    two, one = tiny_two_window_spec(), tiny_spec(window=16)
    rng = np.random.default_rng(1)
    prompts = [np.r_[PROMPT[:rng.integers(20, 90)], rng.integers(1, 7, rng.integers(5, 40))].astype(np.int32)
               for _ in range(12)]
    caches = [_cache(s, retention=retention, budget_bytes=10**7) for s in (two, one)]
    hits = []
    for cache in caches:
        got = 0
        for p in prompts:
            got += cache.match(p).length
            _run(cache, p)
        cache.check_invariants()
        hits.append(got)
    assert hits[0] == hits[1] > 0
    if retention == "eager":
        assert caches[0].pool.used_bytes() < caches[1].pool.used_bytes()
    else:
        assert caches[0].pool.used_bytes() == caches[1].pool.used_bytes()


def test_release_group_refuses_bad_input_and_changes_nothing() -> None:
    spec = tiny_two_window_spec()
    pool = DualPool(spec, budget_bytes=10**6, device="cpu")
    other = DualPool(spec, budget_bytes=10**6, device="cpu")
    _, swa = pool.alloc(1, 2)
    before = (pool.used_bytes(), pool.groups[0].used, pool.buffers.blocks.num_used)
    with pytest.raises(TypeError, match="group must be one of this pool's groups"):
        pool.release_group(other.groups[0], swa)
    with pytest.raises(ValueError, match="pages must be allocated SWA page ids"):
        pool.release_group(pool.groups[0], np.r_[swa, 99])
    with pytest.raises(TypeError, match="pages must be a 1-D integer array"):
        pool.release_group(pool.groups[0], "0,1")
    assert (pool.used_bytes(), pool.groups[0].used, pool.buffers.blocks.num_used) == before
    pool.check_invariants()


def test_eviction_by_bytes_counts_the_groups_an_swa_page_still_holds() -> None:
    """Three sequences, each with 4 unanchored SWA pages held by both groups:
    asking for 4 pages' bytes frees one sequence's 4 pages, not 8 (counting only
    the lead group's bytes per page evicted twice what was needed)."""
    cache = _cache(retention="dense")
    for first in (1, 2, 3):
        _run(cache, np.r_[first, np.arange(31) % 5 + 1].astype(np.int32))
    assert cache.pool.swa.used == cache.pool.groups[0].used == 24
    assert cache.tree.evict(0, 0, 4 * cache.pool.swa_page_bytes) == (0, 4)
    assert cache.pool.swa.used == 20
    cache.check_invariants()


@settings(max_examples=300, deadline=None)
@given(held=st.lists(st.booleans(), min_size=1, max_size=40), lead=st.integers(1, 6), group=st.integers(1, 6),
       lo=st.integers(0, 40), span=st.integers(0, 40))
def test_group_keeps_is_the_rule_page_by_page(held, lead, group, lo, span) -> None:  # noqa: ANN001
    """window.group_keeps against its definition, brute force, on random lead masks."""
    group = min(group, lead)
    hi = min(lo + span, len(held) - group + 1)
    lo = min(lo, max(hi, 0))
    mask = np.array(held, dtype=bool)
    base = max(0, lo + 1 - lead)
    got = group_keeps(mask[base:], lo, hi, lead, group, base)
    want = [any(mask[max(0, end - lead):end].all() for end in range(i + 1, i + group + 1)) for i in range(lo, hi)]
    assert got.tolist() == want


def test_three_windows_give_each_side_group_its_own_page_ids() -> None:
    """Two groups beside the lead (windows 4 and 8 tokens, lead 16): each keeps its
    own ids in the nodes and requests, gives back more the smaller its window, and
    a hit needs each one's window (taking one page of either group's tail window
    away from its owner ends the hit earlier)."""
    from hybridkv import KVShape, ModelSpec

    spec = ModelSpec("tiny-three-window", ["full", "swa", "swa", "swa"], 16, full=KVShape(2, 8, 6),
                     swa=KVShape(4, 8, 6), dtype="float64", page_size=4, layer_windows=(0, 4, 8, 16))
    probe = np.r_[PROMPT, 5]
    for g in (0, 1):
        cache = _cache(spec)
        assert [x.window_pages for x in cache.pool.groups] == [1, 2]
        _run(cache, PROMPT)
        cache.check_invariants()
        tiny, small = cache.pool.groups
        assert 0 < tiny.used < small.used < cache.pool.swa.used
        node = cache.match(probe).node
        assert cache.match(probe).length == 100
        last = int(np.flatnonzero(node.side[g] >= 0)[-1])
        gone = node.side[g][last:last + 1].copy()
        node.side[g] = np.where(np.arange(node.n_pages) == last, -1, node.side[g]).astype(np.int32)
        cache.pool.release_group(cache.pool.groups[g], gone)
        assert cache.match(probe).length < 100
        cache.check_invariants()
