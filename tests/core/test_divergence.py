"""Predicted branch points (DivergenceModel): a workload that re-asks documents
with another question leaves each document's sequence at the question's length
before its end.  Without a window there, the *first* re-ask of a document hits
only the shared system prompt although the document's full KV is cached; once
the model has learned the distance, new documents keep a window there and
their first re-ask hits the whole document.  A workload whose requests extend
their prompts (a chat) keeps no extra window."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import CacheConfig, HybridKVCache, ModelSpec
from hybridkv.radix.divergence import DivergenceModel

P = 16  # page size
SYSTEM = 4 * P
DOC = 24 * P
QUESTION = 3 * P


def _cache():
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=P)
    # eager: each request frees its SWA out of the window as it goes, as under pressure
    return HybridKVCache(spec, CacheConfig(full_pages=4000, swa_pages=4000, device="meta", retention="eager",
                                           swa_checkpoint=0))


def _run(cache, tokens):
    req = cache.begin(np.asarray(tokens, dtype=np.int32))
    hit = req.prefix_len
    while req.computed < len(tokens):
        n = min(4 * P, len(tokens) - req.computed)
        cache.reserve(req, n)
        cache.commit(req, n)
    cache.finish(req)
    return hit


def _doc(k):
    return list(range(10**6 * (k + 1), 10**6 * (k + 1) + DOC))


def _question(k, j):
    return list(range(5 * 10**8 + 1000 * k + 100 * j, 5 * 10**8 + 1000 * k + 100 * j + QUESTION))


def _ask_twice(cache, system, k):
    """Document ``k`` with question 0, then with question 1: the hit of the re-ask."""
    _run(cache, system + _doc(k) + _question(k, 0))
    return _run(cache, system + _doc(k) + _question(k, 1))


def test_first_reask_of_a_document_hits_the_document_once_learned():
    cache = _cache()
    system = list(range(SYSTEM))
    hits = [_ask_twice(cache, system, k) for k in range(40)]
    # before anything is learned the re-ask hits the system prompt only (its branch point)
    assert hits[0] <= SYSTEM
    policy = cache.tree.policy
    assert policy.pretail_pages == QUESTION // P  # the question's length, learned
    # later documents keep a window where the next question leaves them
    assert all(h == SYSTEM + DOC for h in hits[-10:]), hits
    cache.tree.check_invariants()
    # the window is an anchor on a predicted branch point at the document's end
    node = cache.tree.match(np.asarray(system + _doc(39) + [7] * P, dtype=np.int32)).node
    assert node is not None and node.start + len(node.key) == SYSTEM + DOC
    assert node.ends == 1


def test_a_chat_that_extends_its_prompts_keeps_no_extra_window():
    cache = _cache()
    system = list(range(SYSTEM))
    for k in range(30):
        prompt = system + _doc(k)
        for turn in range(4):
            _run(cache, prompt)
            prompt = prompt + _question(k, turn)
    assert cache.tree.policy.pretail_pages == 0
    assert cache.tree.divergence.decisions == 0  # no request ever left a sequence inside it
    cache.tree.check_invariants()


def test_the_model_keeps_a_window_only_when_it_pays_for_its_bytes():
    """The windows' bytes would hold the leaves evicted last: the window is kept while
    what it gains beats what those leaves' returns would have hit."""
    m = DivergenceModel()
    for _ in range(16):
        m.hit_pages += 100
        due = m.observe(3, 200)  # 16 x 200 = 3,200 pages a window 3 pages early gains
    assert due
    assert m.decide(leaves=10, window_bytes=1.0) == 3  # nothing evicted: bytes cost nothing
    m.evicted(key=1, nbytes=5, pages=5000, cap=100)
    m.evicted(key=2, nbytes=100, pages=9000, cap=100)
    m.ghost_hit(1, remaining=20000)  # 100 bytes were evicted after it: beyond 10 windows' bytes
    assert m.decide(leaves=10, window_bytes=1.0) == 3
    assert m.decide(leaves=200, window_bytes=1.0) == 0  # 200 windows' bytes would have kept it: 5,000 > 3,200
    m.ghost_hit(2, remaining=6000)  # the last leaf evicted: it would have hit 6,000 pages more
    assert m.decide(leaves=10, window_bytes=1.0) == 0
    m.ghost_hit(2, remaining=6000)  # a ghost returns once
    assert len(m.ghosts) == 0
    for k in range(300):
        m.evicted(key=100 + k, nbytes=1, pages=1, cap=50)
    assert len(m.ghosts) == 50 and 399 in m.ghosts and 349 not in m.ghosts  # the oldest go


def test_the_offset_covers_the_distances_that_gain_most():
    m = DivergenceModel()
    for d in [2] * 10 + [3] * 10 + [40] * 2:
        m.observe(d, 100)
    # a window 3 pages before the end serves the 2s (a page early) and the 3s; 40 serves all but loses 37-38
    assert m.decide(leaves=1, window_bytes=1.0) == 3
    with pytest.raises(TypeError):
        m.observe()  # type: ignore[call-arg]


def _predicting_tree(pretail):
    from helpers import RecordingPool

    from hybridkv.radix import TreeConfig, WindowSafeTree
    t = WindowSafeTree(TreeConfig(1, 2, ranking="value"), RecordingPool())
    t.policy.pretail_pages = pretail
    t.divergence.observe = lambda dist, gain: False  # type: ignore[method-assign]  # decision frozen
    return t


def test_evicting_below_a_predicted_window_takes_the_rest_of_that_sequence_next():
    """A leaf split at a predicted window is one sequence in two nodes.  When the part
    below the window frees less than asked, the rest of the same (oldest) sequence
    is next (trimmed as far as needed), as a leaf trimmed back to a checkpoint
    would be; the value ranking's candidates of the call used to go on to another
    sequence (the newer one's tail here) and keep the old one's upper part.  On a
    workload of one-shot prompts that cost `value` 0.3-0.4 points."""
    t = _predicting_tree(2)
    t.insert(list(range(10)), list(range(10)), list(range(100, 110)))        # older one-shot A
    t.insert(list(range(50, 60)), list(range(10, 20)), list(range(110, 120)))  # newer one-shot B
    a = t.match(list(range(8)) + [999]).node  # a request leaving where the window was predicted
    b = t.match(list(range(50, 58)) + [999]).node
    assert a.start + len(a.key) == 8 and b.start + len(b.key) == 8
    assert a.predicted and b.predicted and len(a.children) == len(b.children) == 1  # split 2 pages early
    assert t.evict(full_pages=5)[0] == 5
    assert a.alive and not a.children and a.n_pages == 5   # A: its 2 tail pages, then trimmed by 3
    assert t.match(list(range(10)) + [7]).length == 5
    assert b.alive and len(b.children) == 1                # B untouched, its tail too
    assert t.match(list(range(50, 60)) + [7]).length == 10
    t.check_invariants()
