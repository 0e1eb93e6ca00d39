"""ReuseModel (online return hazard per reuse class) and the "value" eviction ranking."""

import math

import numpy as np
import pytest

from hybridkv import CacheConfig, HybridKVCache
from hybridkv.radix.reuse import ReuseModel, age_bucket, next_gap, reuse_class

from helpers import run, spec


def _feed(model, cls, ages, censor, start=0):
    """Periods of class ``cls`` starting at ``start + i``: a return at ``ages[i]`` unless
    ``censor[i]`` comes first (then they end without one)."""
    for i, (a, c) in enumerate(zip(ages, censor)):
        since = start + i
        model.start(cls, since)
        if a <= c:
            model.end(cls, since, since + int(a), returned=True)
        else:
            model.end(cls, since, since + int(c), returned=False)


def test_age_buckets_are_half_octaves():
    assert [age_bucket(a) for a in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7]
    assert age_bucket(2 ** 20) == 40 and age_bucket(3 * 2 ** 19) == 41


def test_reuse_classes_pair_return_count_with_cadence():
    assert reuse_class(0, 5.0) == 0 and reuse_class(3, -1.0) == 0
    assert reuse_class(1, 0.0) != reuse_class(2, 0.0)             # once vs. twice or more
    assert reuse_class(2, 1.0) != reuse_class(2, 7.0)             # < 4 ticks vs. >= 64
    assert len({reuse_class(r, g) for r in (1, 2, 5) for g in range(0, 20)}) == ReuseModel.CLASSES - 1
    assert next_gap(-1.0, 15) == 4.0 and next_gap(4.0, 0) == 2.0


def test_hazard_of_censored_exponential_returns_is_recovered():
    rng = np.random.default_rng(0)
    rate = 0.02
    model = ReuseModel()
    n = 20_000
    _feed(model, 0, rng.exponential(1 / rate, n), rng.uniform(0, 150, n))
    model._refresh(n + 1000)
    for age in (8, 24, 48, 96):
        assert model.hazard(0, age) == pytest.approx(rate, rel=0.2), age
    # dropping the censored periods (time at risk they did accrue) would overstate it
    naive = ReuseModel()
    ages = rng.exponential(1 / rate, n)
    keep = ages <= rng.uniform(0, 150, n)
    _feed(naive, 0, ages[keep], np.full(keep.sum(), np.inf))
    naive._refresh(n + 1000)
    assert naive.hazard(0, 96) > 1.5 * rate


def test_periods_still_at_risk_count_up_to_their_age():
    finished_only, with_running = ReuseModel(), ReuseModel()
    for model in (finished_only, with_running):
        _feed(model, 0, [10] * 100, [math.inf] * 100)
    for i in range(900):
        with_running.start(0, 1000 + i)
    assert with_running.open_periods() == 900
    for model in (finished_only, with_running):
        model._refresh(3000)
    assert 0 < with_running.hazard(0, 10) < finished_only.hazard(0, 10) / 5


def test_density_is_highest_before_returns_come():
    """Returns only around age 100 (think time): a leaf at age 60 is worth more than a
    fresh one, and one long past 100 is worth least."""
    rng = np.random.default_rng(1)
    model = ReuseModel()
    n = 5000
    _feed(model, 3, rng.normal(100, 10, n).clip(1), np.full(n, 400.0))
    model._refresh(10_000)
    assert model.density(3, 60) > model.density(3, 0) > model.density(3, 300)
    assert ReuseModel().density(3, 60) == 0.0   # nothing learned: all equal (LRU order)


def _cyclic(ranking, n=6, cap=40, turns=200):
    """``n`` prompts come back in turn; the cache holds about four: LRU always evicts
    the next one needed."""
    cache = HybridKVCache(spec(), CacheConfig(full_pages=cap, swa_pages=cap, swa_checkpoint=0,
                                              eviction_ranking=ranking))
    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(0, 1000, 16)) for _ in range(n)]
    hits = total = 0
    for i in range(turns):
        prompt = seqs[i % n] + [int(rng.integers(0, 1000))]
        hits += run(cache, prompt, chunk=4)
        total += len(prompt)
        if i % 50 == 0:
            cache.tree.check_invariants()
    return hits / total


def test_value_ranking_learns_a_cycle_that_lru_thrashes():
    assert _cyclic("lru") == 0
    assert _cyclic("value") > 0.5


def _cadence(ranking, cap=48, turns=400):
    """Three prompts come back every 6th request, twelve every 24th; memory holds few."""
    cache = HybridKVCache(spec(), CacheConfig(full_pages=cap, swa_pages=cap, swa_checkpoint=0,
                                              eviction_ranking=ranking))
    rng = np.random.default_rng(2)
    fast = [list(rng.integers(0, 1000, 16)) for _ in range(3)]
    slow = [list(rng.integers(0, 1000, 16)) for _ in range(12)]
    hits = total = 0
    for i in range(turns):
        prompt = (fast[i % 3] if i % 2 == 0 else slow[(i // 2) % 12]) + [int(rng.integers(0, 1000))]
        hits += run(cache, prompt, chunk=4)
        total += len(prompt)
    return hits / total


def test_value_ranking_keeps_the_fast_cadence():
    assert _cadence("value") > _cadence("lru") + 0.05


def test_reuse_state_stays_bounded_and_consistent_under_churn():
    rng = np.random.default_rng(5)
    cache = HybridKVCache(spec(), CacheConfig(full_pages=40, swa_pages=16, swa_checkpoint=8,
                                              eviction_ranking="value"))
    convs = [list(rng.integers(0, 50, 4)) for _ in range(8)]
    for i in range(400):
        c = convs[rng.integers(0, len(convs))]
        c += list(rng.integers(0, 50, rng.integers(1, 7)))
        if len(c) > 30:
            c[:] = list(rng.integers(0, 50, 4))
        run(cache, c, chunk=4)
        if i % 40 == 0:
            cache.tree.check_invariants()   # includes: one open period per filed leaf or ghost
    tree = cache.tree
    assert tree.reuse.ghost_count() <= 4 * tree.num_nodes + 1024 and tree.reuse.observed > 0
    assert len(tree.ranking._ghost_returns) <= 4097


def _leaf(cache, tokens):
    """The tree node whose key ends ``tokens`` (a cached sequence's tail)."""
    tree = cache.tree
    for node in tree.iter_nodes():
        end = node.start + len(node.key)
        if end == len(tokens) and np.array_equal(node.key, np.asarray(tokens[node.start:end], np.int32)):
            return node
    raise AssertionError("not cached")


def test_a_diverging_request_does_not_credit_the_tail_it_left():
    """A continuation or an exact repeat brings the cached sequence back and adds to
    its history.  A request that diverges inside the last node (another question on
    a cached document) is a return for the statistics, but the tail past the
    divergence did not come back: its history stays as it was."""
    cache = HybridKVCache(spec(), CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0,
                                              eviction_ranking="value"))
    doc = list(range(100, 124))                      # 12 pages
    run(cache, doc)
    tail = _leaf(cache, doc)
    assert tail.returns == 0 and tail.vcls >= 0
    since, observed = tail.since, cache.tree.reuse.observed
    # diverges after 8 of the 12 pages
    run(cache, doc[:16] + [7, 7, 7, 7, 7, 7, 7, 7, 7])
    assert tail.alive and not tail.children and tail.returns == 0 and tail.vcls == 0
    # its class saw a return, but the tail was not used: its period still counts
    # from its last use (and its recency is unchanged)
    assert tail.since == since and cache.tree.reuse.observed == observed + 1
    # an exact repeat reaches the end of what can hit (the last token is never a hit)
    run(cache, doc)
    assert tail.returns == 1 and cache.tree.reuse.observed == observed + 2
    # a continuation too: the new tail inherits the history
    run(cache, doc + [9, 9, 9, 9, 9])
    assert _leaf(cache, doc + [9, 9, 9, 9]).returns == 2


def test_the_node_a_request_branches_off_is_credited_and_keeps_it_as_a_leaf():
    """Two questions on one cached document: the document (the node the second
    request branches off) came back, its first question's tail did not.  Once its
    children are evicted, the document is a leaf of a returning class."""
    cache = HybridKVCache(spec(), CacheConfig(full_pages=64, swa_pages=64, swa_checkpoint=0,
                                              eviction_ranking="value"))
    doc = list(range(100, 116))                          # 8 pages
    first, second = doc + [1] * 8, doc + [2] * 8
    run(cache, first)
    run(cache, second)                                   # diverges after the document
    tree = cache.tree
    branch = _leaf(cache, doc)
    assert len(branch.children) == 2 and branch.returns == 1 and branch.gap >= 0
    assert _leaf(cache, first[:-1] if len(first) % 2 else first).returns == 0
    # evict both questions: the document becomes a leaf filed under its own history
    tree.evict(full_pages=8)
    assert branch.alive and not branch.children
    assert branch.vcls == reuse_class(1, branch.gap) != 0
    tree.check_invariants()
