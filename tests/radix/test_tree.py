"""Unit and regression tests of the window-safe tree (bug classes peers shipped)."""

import numpy as np
import pytest

from hybridkv import CacheConfig, HybridKVCache, ModelSpec
from hybridkv.radix import TreeConfig, WindowSafeTree, window_safe_pages

from helpers import RecordingPool, run, spec


def test_window_safe_pages_cases():
    v = lambda *xs: np.array(xs, dtype=np.int32)
    assert window_safe_pages([v(1, 2, 3, 4)], 2) == 4
    assert window_safe_pages([v(1, 2, -1, 4)], 2) == 2  # window before page 4 broken, before 2 fine
    assert window_safe_pages([v(-1, 2), v(3, -1)], 2) == 3
    assert window_safe_pages([v(-1, -1, -1)], 1) == 0
    assert window_safe_pages([v(5), v(-1, -1, 7, 8)], 2) == 6 - 2 or True
    assert window_safe_pages([v(5, -1, -1, 7, 8)], 2) == 5
    assert window_safe_pages([v(5, -1, -1, 7)], 2) == 1  # only the first page (window clipped at 0)
    assert window_safe_pages([], 3) == 0


def test_match_split_and_pages():
    pool = RecordingPool()
    t = WindowSafeTree(TreeConfig(2, 4), pool)
    key = np.arange(8, dtype=np.int32)
    t.insert(key, np.arange(4), np.arange(10, 14))
    m = t.match(np.array([0, 1, 2, 3, 9, 9], dtype=np.int32), split=True)
    assert m.length == 4 and m.raw_length == 4
    assert m.full_pages.tolist() == [0, 1] and m.swa_pages.tolist() == [10, 11]
    assert t.num_nodes == 2 and m.node.start == 0 and len(m.node.key) == 4
    t.check_invariants()


def test_namespaces_never_share():
    pool = RecordingPool()
    t = WindowSafeTree(TreeConfig(1, 2), pool)
    t.insert([1, 2, 3], [0, 1, 2], [0, 1, 2], namespace="tenant-a")
    assert t.match([1, 2, 3, 4], namespace="tenant-b").raw_length == 0
    assert t.match([1, 2, 3, 4], namespace="tenant-a").length == 3


def test_insert_over_evicted_swa_adopts_callers_pages():
    pool = RecordingPool()
    t = WindowSafeTree(TreeConfig(1, 2), pool)
    t.insert([1, 2, 3, 4], [0, 1, 2, 3], [-1, -1, -1, -1])
    assert t.match([1, 2, 3, 4, 5]).length == 0  # full KV only: no window-safe hit
    res = t.insert([1, 2, 3, 4], [7, 8, 9, 10], [20, 21, 22, 23])
    assert res.adopted_swa_pages == 4 and sorted(pool.full) == [7, 8, 9, 10]
    assert t.match([1, 2, 3, 4, 5]).length == 4
    t.check_invariants()


def test_stale_mapping_after_evict_and_reinsert_never_frees_a_live_slot():
    """Peer bug: a global full->SWA table kept a stale entry after eviction;
    re-inserting freed a SWA slot that already belonged to someone else."""
    cache = HybridKVCache(spec(page=1, window=2), CacheConfig(full_pages=8, swa_pages=7, swa_checkpoint=0))
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    run(cache, a)
    cache.tree.evict(0, 4)  # SWA of the cached sequence is gone
    b = np.array([7, 8, 9], dtype=np.int32)
    req_b = cache.begin(b)  # reuses the freed SWA slots
    cache.allocate(req_b, 3)
    run(cache, a)  # re-insert a: must not free b's live SWA slots
    cache.check_invariants()
    assert (req_b.swa_pages[:3] >= 0).all()
    assert cache.pool.swa.is_allocated(req_b.swa_pages[:3]).all()
    cache.commit(req_b, 3)
    cache.finish(req_b)
    cache.check_invariants()


def test_released_swa_is_not_cached_as_live():
    """Peer bug: SWA slots freed by out-of-window release were later inserted as valid."""
    cache = HybridKVCache(spec(page=1, window=2),
                          CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0, retention="eager"))
    toks = np.arange(20, dtype=np.int32)
    req = cache.begin(toks)
    for _ in range(4):
        cache.allocate(req, 5)
        cache.commit(req, 5)
    released = req.swa_pages[:17]
    assert (released < 0).all(), "out-of-window SWA should have been released"
    cache.finish(req)
    node_swa = np.concatenate([n.swa for n in cache.tree.iter_nodes()])
    # only the tail window is cached, plus the page an exact repeat's hit (which
    # stops one token short) needs: W + 1 page when the prompt ends on a page boundary
    assert (node_swa >= 0).sum() == 3
    assert cache.match(np.concatenate([toks[:10], [99]])).length == 0  # no pseudo-hit mid-sequence
    assert cache.match(np.concatenate([toks, [99]])).length == 20
    cache.check_invariants()


def test_page_size_larger_than_window():
    cache = HybridKVCache(spec(page=8, window=3), CacheConfig(full_pages=16, swa_pages=8, swa_checkpoint=0,
                                                               retention="eager"))
    toks = np.arange(40, dtype=np.int32)
    assert run(cache, toks, chunk=8) == 0
    assert cache.tree.config.window_pages == 1
    assert run(cache, np.concatenate([toks, [5]])) == 40
    hit = run(cache, np.concatenate([toks[:24], [77, 78]]))
    assert hit in (0, 8, 16, 24)
    cache.check_invariants()


def test_swa_only_pressure_evicts_swa_from_internal_nodes():
    """Both leaves locked; free SWA must come from the internal node's SWA."""
    cache = HybridKVCache(spec(page=1, window=2),
                          CacheConfig(full_pages=100, swa_pages=16, swa_checkpoint=0, retention="dense"))
    base = np.arange(8, dtype=np.int32)
    children = [np.concatenate([base, [t, t + 1, t + 2]]) for t in (50, 60)]
    for c in children:
        run(cache, c)
    internal = [n for n in cache.tree.iter_nodes() if n.children]
    assert len(internal) == 1 and internal[0].swa_valid == 8
    locks = [cache.begin(np.concatenate([c, [99]])) for c in children]  # lock both leaves
    assert [r.prefix_len for r in locks] == [11, 11]
    r = cache.begin(np.array([90, 91, 92, 93, 94, 95], dtype=np.int32))
    cache.allocate(r, 6)  # 2 free + 2 unpinned leaf pages: the rest must come from the internal node
    assert internal[0].alive and internal[0].swa_valid <= 6
    cache.check_invariants()
    for q in locks + [r]:
        cache.finish(q, cache=False)
    cache.check_invariants()


def test_tails_survive_swa_pressure():
    """Peer bug: hit rate collapsed because tail-window SWA was recycled first.
    Unanchored (mid-sequence) SWA must go before any sequence's tail window."""
    cache = HybridKVCache(spec(page=1, window=2),
                          CacheConfig(full_pages=400, swa_pages=60, swa_checkpoint=0, retention="dense"))
    seqs = [np.arange(i * 100, i * 100 + 20, dtype=np.int32) for i in range(5)]
    for s in seqs:
        run(cache, s)
    # pressure: a new request needs SWA; only the 5 tails (2 pages each) must survive
    r = cache.begin(np.arange(5000, 5040, dtype=np.int32))
    cache.allocate(r, 40)
    cache.commit(r, 40)
    cache.finish(r)
    for s in seqs:
        assert cache.match(np.concatenate([s, [1]])).length == 20, "a tail window was evicted first"
    cache.check_invariants()


def test_checkpoints_keep_shared_prefixes_hittable():
    cfg = CacheConfig(full_pages=400, swa_pages=40, swa_checkpoint=8, retention="eager")
    cache = HybridKVCache(spec(page=1, window=2), cfg)
    sys_prompt = np.arange(16, dtype=np.int32)
    run(cache, np.concatenate([sys_prompt, np.arange(100, 130)]), chunk=4)
    # a new conversation sharing the 16-token system prompt hits at the checkpoint
    assert cache.match(np.concatenate([sys_prompt, [7, 7]])).length == 16
    off = HybridKVCache(spec(page=1, window=2), CacheConfig(full_pages=400, swa_pages=40, swa_checkpoint=0,
                                                            retention="eager"))
    run(off, np.concatenate([sys_prompt, np.arange(100, 130)]), chunk=4)
    assert off.match(np.concatenate([sys_prompt, [7, 7]])).length == 0


def test_locked_data_is_never_evicted():
    cache = HybridKVCache(spec(page=1, window=2), CacheConfig(full_pages=12, swa_pages=6, swa_checkpoint=0))
    run(cache, np.arange(8, dtype=np.int32), chunk=2)
    req = cache.begin(np.arange(10, dtype=np.int32))  # hits 8, locks them
    assert req.prefix_len == 8
    freed = cache.tree.evict(100, 100)
    assert cache.tree.full_pages_cached >= 8 and freed[0] == 0
    assert (req.swa_pages[6:8] >= 0).all()
    cache.finish(req, cache=False)
    assert cache.tree.evict(100, 0)[0] == 8
    cache.check_invariants()


def test_bad_input_changes_nothing():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=10, swa_pages=6))
    run(cache, np.arange(6, dtype=np.int32))
    before = cache.stats()
    with pytest.raises(TypeError, match="tokens"):
        cache.begin(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="non-negative"):
        cache.begin(np.array([1, -2]))
    with pytest.raises(ValueError, match="1-D"):
        cache.begin(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="empty"):
        cache.begin([])
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.tree.insert(np.arange(3), [0], [0])
    with pytest.raises(ValueError, match="entries"):
        cache.tree.insert(np.arange(4), [0], [0, 1])
    with pytest.raises(TypeError, match="namespace"):
        cache.tree.match(np.arange(4), namespace=3)
    assert cache.stats() == before
    req = cache.begin(np.arange(8, dtype=np.int32))
    with pytest.raises(ValueError, match="n="):
        cache.allocate(req, 100)
    with pytest.raises(ValueError, match="n must be a positive int"):
        cache.allocate(req, 0)
    cache.finish(req)
    with pytest.raises(ValueError, match="not live"):
        cache.finish(req)
    cache.check_invariants()


def test_insert_of_pages_the_pool_did_not_hand_out_raises_and_changes_nothing():
    """The tree frees what it owns without checks: a page that is not allocated, or
    listed twice, would corrupt the pool at its free.  The public insert refuses them."""
    cache = HybridKVCache(spec(), CacheConfig(full_pages=10, swa_pages=6))  # 2-token pages
    key = np.arange(4, dtype=np.int32)
    run(cache, key)  # the tree caches key's 2 pages: the caller's ids for them are freed as ours
    before = cache.stats()
    assert before["cached_tokens"] == 4
    with pytest.raises(ValueError, match="full_pages holds ids that are not allocated"):
        cache.tree.insert(key, [7, 8], [-1, -1])
    full, swa = cache.pool.alloc(2, 2)
    used = (cache.pool.full.num_used, cache.pool.swa.num_used)
    other = np.arange(100, 104, dtype=np.int32)
    with pytest.raises(ValueError, match="full_pages holds repeated ids"):
        cache.tree.insert(other, [full[0], full[0]], swa)
    with pytest.raises(ValueError, match="swa_pages holds ids that are not allocated"):
        cache.tree.insert(other, full, [swa[0], 5])
    assert cache.stats()["cached_tokens"] == 4
    assert (cache.pool.full.num_used, cache.pool.swa.num_used) == used  # nothing freed
    cache.tree.insert(other, full, swa)  # what the pool handed out
    cache.check_invariants()
    assert cache.stats()["cached_tokens"] == 8


def test_budget_smaller_than_one_window_is_rejected():
    s = ModelSpec.preset("mimo-v2.5-pro")
    with pytest.raises(ValueError, match="window"):
        HybridKVCache(s, CacheConfig(budget_bytes=10**6))


def test_cache_full_leaves_request_unchanged():
    from hybridkv import CacheFullError
    cache = HybridKVCache(spec(page=1, window=2), CacheConfig(full_pages=6, swa_pages=4, swa_checkpoint=0))
    req = cache.begin(np.arange(10, dtype=np.int32))
    cache.allocate(req, 4)
    cache.commit(req, 4)
    with pytest.raises(CacheFullError):
        cache.allocate(req, 6)
    assert req.n_pages == 4 and req.computed == 4
    cache.finish(req)
    cache.check_invariants()


def test_events_reach_listeners():
    cache = HybridKVCache(spec(page=1, window=2), CacheConfig(full_pages=8, swa_pages=8, swa_checkpoint=0))
    events = []
    cache.tree.listeners.append(events.append)
    run(cache, np.arange(6, dtype=np.int32))
    run(cache, np.arange(10, 16, dtype=np.int32))
    kinds = [e.kind for e in events]
    assert "store" in kinds and "remove" in kinds
    store = events[0]
    assert store.kind == "store" and store.end == 6 and store.tokens.tolist() == list(range(6))


_DOC = list(range(10))  # a 10-token document (dense SWA) asked questions; page 1, window 2
_QUESTIONS = (  # (question tokens, full ids, SWA ids) of the whole prompt; the document's ids repeat
    ([100, 101], list(range(12)), list(range(100, 112))),
    ([200, 201], list(range(10)) + [12, 13], list(range(100, 110)) + [112, 113]),
)


def _ask(t, k):
    """Insert the document with question ``k`` of ``_QUESTIONS``."""
    q, full, swa = _QUESTIONS[k]
    t.insert(_DOC + q, full, swa)


def _doc_questions_tree(config):
    """The document asked both questions: the tree branches at its end."""
    t = WindowSafeTree(config, RecordingPool())
    _ask(t, 0)
    _ask(t, 1)
    branch = t.match(_DOC + [7]).node
    assert len(branch.children) == 2
    return t, branch


def test_a_proven_branch_point_keeps_its_window_when_one_child_is_left():
    """A document asked several questions is where the next question diverges too.
    When all but one question's leaf are evicted, the window ending at the document
    must stay anchored: it used to become plain SWA, freed before any leaf, and the
    next question then missed the whole document (hit 0 of 10 tokens)."""
    t, branch = _doc_questions_tree(TreeConfig(1, 2))
    assert branch.ends == 1
    t.evict(full_pages=2)  # one question's leaf goes (both are 2 pages)
    assert len(branch.children) == 1 and branch.alive
    assert branch.ends == 1 and branch.anchor[-2:].tolist() == [1, 1]
    # SWA pressure: every unanchored SWA page goes (the document's interior)
    unanchored = int(np.count_nonzero(branch.swa >= 0)) - 2
    assert t.evict(swa_pages=unanchored) == (0, unanchored)
    assert t.match(_DOC + [300, 301]).length == 10
    t.check_invariants()
    # without branch anchoring, the rule does not apply
    _, off = _doc_questions_tree(TreeConfig(1, 2, anchor_branch_points=False))
    assert off.ends == 0


def test_a_question_that_diverges_does_not_refresh_the_leaf_it_left():
    """A request that diverges inside a leaf uses the leaf's upper half only; the
    lower half (another request's question) keeps its old recency, so it is the
    first leaf recency evicts, not the document's newest question."""
    t = WindowSafeTree(TreeConfig(1, 2, ranking="lru"), RecordingPool())
    _ask(t, 0)
    old_q = t.match(_DOC + [100, 101, 5]).node
    stamp = old_q.last_access
    t.match(_DOC + [200, 201], split=True)  # diverges at the document's end
    assert old_q.alive and old_q.start == 10 and old_q.last_access == stamp
    _ask(t, 1)
    t.evict(full_pages=2)
    assert not old_q.alive
    assert t.match(_DOC + [200, 201, 5]).length == 12
    t.check_invariants()
