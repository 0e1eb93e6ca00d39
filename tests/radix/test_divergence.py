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


def _run(cache, tokens, out=0):
    """A request: the prompt in chunks, then ``out`` decoded tokens one at a time (an
    engine's output); finish caches all of it.  Returns the prompt's hit."""
    req = cache.begin(np.asarray(tokens, dtype=np.int32))
    hit = req.prefix_len
    while req.computed < len(tokens):
        n = min(4 * P, len(tokens) - req.computed)
        cache.reserve(req, n)
        cache.commit(req, n)
    for t in range(out):
        cache.append_tokens(req, [9 * 10**8 + 7919 * len(tokens) + t])
        cache.reserve(req, 1)
        cache.commit(req, 1)
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


def test_the_window_is_placed_from_the_prompts_end_when_the_output_is_cached_too():
    """Engines cache the decoded output with the prompt.  The output's length varies,
    so the distance from the leaf's end to where the next question leaves the
    document varies with it; measured from the prompt's end (``TreeNode.mark``)
    it is the question's length, and the window a live request keeps for it does
    not move as its output grows."""
    cache = _cache()
    system = list(range(SYSTEM))
    rng = np.random.default_rng(0)
    hits = []
    for k in range(40):
        _run(cache, system + _doc(k) + _question(k, 0), int(rng.integers(P, 16 * P)))
        hits.append(_run(cache, system + _doc(k) + _question(k, 1), int(rng.integers(P, 16 * P))))
    assert hits[0] <= SYSTEM
    assert cache.tree.policy.pretail_pages == QUESTION // P
    assert all(h == SYSTEM + DOC for h in hits[-10:]), hits
    cache.tree.check_invariants()


@pytest.mark.parametrize("extra", [0, 5])
def test_an_exact_repeat_of_a_prompt_whose_output_was_cached_hits_it_once_learned(extra):
    """Retries and regenerated replies send a prompt again after its output was cached
    behind it.  Eager release frees the prompt's last window while the output is
    decoded, so the repeat hit only the system prompt; the model learns that
    requests end at the prompt's end (``d`` = 0, or 1 when the prompt ends on a
    page boundary: a hit never covers the last token) and later prompts keep that
    window."""
    cache = _cache()
    system = list(range(SYSTEM))
    hits, lengths = [], []
    for k in range(40):
        prompt = system + _doc(k) + _question(k, 0) + list(range(7 * 10**8 + 100 * k, 7 * 10**8 + 100 * k + extra))
        _run(cache, prompt, 5 * P + 3)
        hits.append(_run(cache, prompt, 5 * P + 3))
        lengths.append(len(prompt))
    assert hits[0] <= SYSTEM  # the prompt's own window was released during decode
    assert cache.tree.policy.pretail_pages == (1 if extra == 0 else 0)
    best = [(n - 1) // P * P for n in lengths]  # the longest hit: whole pages short of the last token
    assert hits[-10:] == best[-10:], (hits, best)
    cache.tree.check_invariants()


def test_a_prompt_inserted_before_its_output_is_measured_from_its_end():
    """SGLang's flow: the prompt goes in at the end of prefill, the prompt and its
    output at finish (``insert(..., prompt_len=)``), so the output is a leaf of its
    own under the prompt.  Re-asks are measured from the prompt's end (the
    question's 3 pages), not from the output's (3 to 17 pages), and the predicted
    window is placed before the prompt's end when the prompt goes in."""
    from helpers import RecordingPool

    from hybridkv.radix import TreeConfig, WindowSafeTree
    t = WindowSafeTree(TreeConfig(1, 2, ranking="value"), RecordingPool())
    rng = np.random.default_rng(1)
    ids = iter(range(10**6))
    system = list(range(4))

    def put(tokens, prompt_len=None):
        have = t.match(tokens, touch=False)
        n = have.length  # the hit's pages; the rest are the request's own (duplicates are freed)
        full = list(have.full_pages[:n]) + [next(ids) for _ in range(len(tokens) - n)]
        swa = list(have.swa_pages[:n]) + [next(ids) for _ in range(len(tokens) - n)]
        t.insert(tokens, full, swa, prompt_len=prompt_len)

    def drop_plain_swa():  # as under SWA pressure: only anchored windows stay
        plain = sum(int(np.count_nonzero((n.swa >= 0) & (n.anchor == 0))) for n in t.iter_nodes())
        nodes = t.num_nodes
        t.evict(swa_pages=plain)
        assert t.num_nodes == nodes

    hits = []
    for k in range(40):
        doc = list(range(1000 * (k + 1), 1000 * (k + 1) + 24))
        for j in range(2):
            prompt = system + doc + [10**7 + 100 * k + 10 * j + i for i in range(3)]
            if j:
                drop_plain_swa()
                hits.append(t.match(prompt, max_len=len(prompt) - 1).length)
            put(prompt)  # the end of prefill
            out = [2 * 10**7 + 1000 * k + 100 * j + i for i in range(int(rng.integers(1, 15)))]
            put(prompt + out, prompt_len=len(prompt))  # finish
    assert hits[0] <= len(system)
    assert t.policy.pretail_pages == 3
    assert all(h == len(system) + 24 for h in hits[-10:]), hits
    t.check_invariants()
    with pytest.raises(ValueError, match="prompt_len"):
        t.insert([1, 2], [next(ids), next(ids)], [-1, -1], prompt_len=-1)
    with pytest.raises(TypeError, match="prompt_len"):
        t.insert([1, 2], [next(ids), next(ids)], [-1, -1], prompt_len=1.5)


def test_a_chat_that_extends_its_prompts_keeps_no_extra_window():
    cache = _cache()
    system = list(range(SYSTEM))
    for k in range(30):
        prompt = system + _doc(k)
        for turn in range(4):
            _run(cache, prompt)
            prompt = prompt + _question(k, turn)
    assert cache.tree.policy.pretail_pages == -1
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
    assert m.decide(leaves=200, window_bytes=1.0) == -1  # 200 windows' bytes would have kept it: 5,000 > 3,200
    m.ghost_hit(2, remaining=6000)  # the last leaf evicted: it would have hit 6,000 pages more
    assert m.decide(leaves=10, window_bytes=1.0) == -1
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


def test_a_predicted_window_is_an_anchor_inside_the_leaf():
    """The predicted window is anchored inside the new leaf (no split, no extra node):
    freeing plain SWA keeps it, a request leaving there hits up to it, eviction can
    trim the leaf back to it, and the anchor counts stay exact through splits and
    trims (check_invariants recounts them)."""
    t = _predicting_tree(3)
    t.insert(list(range(10)), list(range(10)), list(range(100, 110)))
    leaf = t.match(list(range(10)) + [7]).node
    assert leaf.points == [7] and t.num_nodes == 1  # the window [5, 7) ends 3 pages before the end
    assert list(leaf.anchor) == [0, 0, 0, 0, 0, 1, 1, 0, 1, 1]  # predicted window + the tail's
    t.check_invariants()
    t.evict(swa_pages=6)  # plain SWA only: pages 0-4 and 7
    assert list(leaf.swa >= 0) == [False] * 5 + [True, True, False, True, True]
    assert t.match(list(range(7)) + [999]).length == 7  # a request leaving at the point hits it
    t.check_invariants()
    t.match(list(range(8)) + [999], split=True)  # a split after the point: it stays with the upper half
    t.check_invariants()
    t.evict(full_pages=2)  # trims the tail back to the predicted window's end
    assert t.match(list(range(10)) + [7]).length == 7
    t.check_invariants()
    t.evict(full_pages=7)
    assert t.num_nodes == 0 and t.full_pages_cached == 0
    t.check_invariants()


def test_predicted_windows_give_way_before_other_sequences_tails():
    """Where the SWA pool is short on its own (an engine that sizes SWA apart from
    full KV, for one window per cached sequence), freeing SWA takes the predicted
    windows before any sequence's tail: a predicted window kept over another
    sequence's tail cost that sequence its next hit (the least recently used
    node's windows used to go together, tail included)."""
    t = _predicting_tree(3)
    a, b = list(range(10)), list(range(100, 110))
    t.insert(a, list(range(10)), list(range(100, 110)))
    t.insert(b, list(range(10, 20)), list(range(110, 120)))
    t.check_invariants()
    # 12 pages of plain SWA (0-4 and 7 of each), then 4 more: two predicted windows' worth
    assert t.evict(swa_pages=16) == (0, 16)
    t.check_invariants()
    for seq in (a, b):
        leaf = t.match(seq + [999]).node
        assert leaf is not None and leaf.points is None  # the predicted windows went
        assert t.match(seq + [999]).length == 10, seq  # both tails stayed: both hit whole
    assert list(leaf.swa >= 0) == [False] * 8 + [True, True]
    assert t.evict(swa_pages=2) == (0, 2)  # then a tail, the least recently used one's
    assert t.match(a + [999]).length == 0 and t.match(b + [999]).length == 10
    t.check_invariants()
