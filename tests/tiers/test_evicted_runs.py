"""With lower tiers the L1 tree keeps what it evicts as evicted runs: a prompt's
walk reads the names of the pages L1 gave up off them instead of hashing them,
the names are the ones hashing gives, the cache decides exactly as without the
runs, and the runs stay within what L2 holds."""

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
        named = cache.tree.runs.names

        def names_counted(*args):
            got = named(*args)
            read[0] += len(got)
            return got

        monkeypatch.setattr(cache.tree.runs, "names", names_counted)
        hashed[0] = read[0] = 0
        try:
            results.append(_replay(cache, seed=3, steps=160))
            counts.append((hashed[0], read[0]))
            stats.append({k: v for k, v in cache.stats().items() if not k.startswith("evicted_run_")})
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


def test_runs_are_swept_back_to_what_l2_holds():
    spec = tiny_spec()
    cache = _cache(spec, l1_pages=120, l2_pages=10, policy="write_through")
    runs, co = cache.tree.runs, cache.lower_tiers
    try:
        _replay(cache, seed=8, steps=200)
        assert runs.sweeps >= 1
        bound = max(co.host.num_full_pages, cache.tree.num_nodes)
        assert runs.pages <= 2 * bound + 200 // spec.page_size  # (a walk's sweep, then one request's evictions)
        co._sweep_runs(bound)
        held = 0
        for node in [cache.tree.root("default"), *cache.tree.iter_nodes()]:
            stack = [node.evicted or {}]
            while stack:
                for run in stack.pop().values():
                    assert (co.host.lookup_full(run.names) >= 0).all()
                    held += len(run.names)
                    stack.append(run.below or {})
        assert held == runs.pages <= co.host.num_full_pages
        st = cache.stats()
        assert st["evicted_run_pages"] == held and st["evicted_run_sweeps"] == runs.sweeps
    finally:
        cache.close()


def test_with_l3_runs_keep_what_only_l3_holds_within_their_limit(tmp_path):
    """Pages L2 gave up but L3's record holds keep their runs while the runs stay
    within their limit; past it a sweep keeps only what L2 holds."""
    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    cache = TieredCache(spec, CacheConfig(budget_bytes=120 * (fpb + spb), device="meta"),
                        tiers=TierConfig(l2_bytes=10 * (fpb + spb), l3=f"file://{tmp_path / 'l3'}",
                                         write_policy="write_through"))
    runs, co = cache.tree.runs, cache.lower_tiers
    try:
        _replay(cache, seed=8, steps=120)
        assert cache.flush(30.0)
        in_l2 = in_l3 = 0
        co._sweep_runs(10 ** 6)  # room for all: the sweep keeps what L3 holds too
        for node in [cache.tree.root("default"), *cache.tree.iter_nodes()]:
            stack = [node.evicted or {}]
            while stack:
                for run in stack.pop().values():
                    l2 = co.host.lookup_full(run.names) >= 0
                    l3 = co.l3_record.held(run.names)
                    assert (l2 | l3).all()
                    in_l2 += int(l2.sum())
                    in_l3 += int((l3 & ~l2).sum())
                    stack.append(run.below or {})
        assert in_l3 > 0 and runs.pages == in_l2 + in_l3
        co._sweep_runs(max(1, in_l2 - 1))  # now too many: only L2's pages stay
        assert runs.pages <= in_l2
        cache.check_invariants()
    finally:
        cache.close()
