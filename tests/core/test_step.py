"""The batched step API and the request path's edges (API misuse raises,
never corrupts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv import CacheConfig, CacheFullError, HybridKVCache, KVShape, ModelSpec, StepBatch
from hybridkv.eval.model import ReferenceModel, tiny_spec


def spec(page: int = 4, window: int = 8) -> ModelSpec:
    return ModelSpec("t", ["full", "swa", "swa"], window, KVShape(2, 4, 4), KVShape(2, 4, 4), dtype="float32",
                     page_size=page)


def snapshot(req):  # noqa: ANN001, ANN201
    return (req.n_tokens, req.tokens.tobytes(), req.computed, req.allocated, req.n_pages,
            req.full_pages[:req.n_pages].tobytes(), req.swa_pages[:req.n_pages].tobytes())


def test_batched_decode_matches_single_request_api():
    cfg = CacheConfig(full_pages=400, swa_pages=400, swa_checkpoint=0, retention="eager",
                      decode_release_interval=5)
    a, b = HybridKVCache(spec(), cfg), HybridKVCache(spec(), cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, int(rng.integers(5, 30))).astype(np.int32) for _ in range(6)]
    ra = [a.begin(p) for p in prompts]
    rb = [b.begin(p) for p in prompts]
    # prefill: one chunk per request, all in one step
    batch = b.step(rb)
    assert batch.ok.all() and batch.num_new.tolist() == [len(p) for p in prompts]
    for i, r in enumerate(ra):  # the same order as a step: every allocation, then every commit
        fs, ss = a.allocate(r, len(prompts[i]))
        lo, hi = batch.cu_new[i], batch.cu_new[i + 1]
        assert np.array_equal(fs, batch.full_slots[lo:hi]) and np.array_equal(ss, batch.swa_slots[lo:hi])
    for i, r in enumerate(ra):
        a.commit(r, len(prompts[i]))
    b.commit_step(batch)
    for step in range(40):  # decode: one sampled token per request per step
        toks = rng.integers(0, 50, len(rb))
        batch = b.step(rb, new_tokens=toks)
        assert batch.ok.all() and (batch.num_new == 1).all()
        for i, r in enumerate(ra):
            a.append_tokens(r, [int(toks[i])])
            fs, ss = a.allocate(r, 1)
            assert fs[0] == batch.full_slots[i] and ss[0] == batch.swa_slots[i]
            assert batch.seq_lens[i] == r.computed + 1
        for r in ra:
            a.commit(r, 1)
        b.commit_step(batch)
        for x, y in zip(ra, rb):
            assert snapshot(x) == snapshot(y)
        a.check_invariants()
        b.check_invariants()
    table = b.page_table(rb)
    assert table.shape == (6, max(r.n_pages for r in rb))
    for i, r in enumerate(rb):
        assert np.array_equal(table[i, :r.n_pages], r.full_pages[:r.n_pages])
        assert (table[i, r.n_pages:] == -1).all()
    for x, y in zip(ra, rb):
        a.finish(x)
        b.finish(y)
    assert a.stats() == b.stats()


def test_step_reports_new_pages_for_incremental_block_tables():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=100, swa_pages=100, swa_checkpoint=0))
    reqs = [cache.begin(np.arange(7, dtype=np.int32) + i) for i in range(3)]
    batch = cache.step(reqs)
    cache.commit_step(batch)
    tables = {i: list(r.full_pages[:r.n_pages]) for i, r in enumerate(reqs)}
    for _ in range(9):
        batch = cache.step(reqs, new_tokens=np.array([1, 2, 3]))
        for row, idx, page in zip(batch.new_rows, batch.new_index, batch.new_full):
            assert idx == len(tables[row])
            tables[row].append(int(page))
        cache.commit_step(batch)
    for i, r in enumerate(reqs):
        assert tables[i] == list(r.full_pages[:r.n_pages])


def test_step_failure_is_per_request_and_leaves_it_unchanged():
    s = spec(page=1, window=2)
    cache = HybridKVCache(s, CacheConfig(full_pages=14, swa_pages=14, swa_checkpoint=0, retention="none"))
    small = cache.begin(np.arange(3, dtype=np.int32))
    big = cache.begin(np.arange(100, 120, dtype=np.int32))
    other = cache.begin(np.arange(200, 204, dtype=np.int32))
    before = snapshot(big)
    batch = cache.step([small, big, other])
    assert batch.ok.tolist() == [True, False, True]
    assert isinstance(batch.errors[1], CacheFullError) and set(batch.errors) == {1}
    assert snapshot(big) == before
    assert batch.num_new.tolist() == [3, 0, 4] and batch.cu_new.tolist() == [0, 3, 3, 7]
    cache.commit_step(batch)
    assert small.computed == 3 and other.computed == 4 and big.computed == 0
    # a failing decode row: its appended token is taken back
    before = snapshot(big)
    batch = cache.step([small, big], new_tokens=[7, 8])
    assert batch.ok.tolist() == [True, False] and snapshot(big)[:2] == (20, before[1])
    cache.commit_step(batch)
    cache.check_invariants()
    for r in (small, big, other):
        cache.finish(r)
    cache.check_invariants()


def test_step_bad_rows_and_stale_batches():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=100, swa_pages=100))
    r1, r2 = cache.begin(np.arange(5, dtype=np.int32)), cache.begin(np.arange(9, dtype=np.int32))
    with pytest.raises(ValueError, match="new_tokens"):
        cache.step([r1, r2], new_tokens=np.array([1]))
    with pytest.raises(ValueError, match="num_new"):
        cache.step([r1, r2], num_new=[1.5, 2])
    batch = cache.step([r1, r2], num_new=[3, 100])  # row 1 asks past its tokens
    assert batch.ok.tolist() == [True, False] and isinstance(batch.errors[1], ValueError)
    assert r2.allocated == 0 and r2.n_pages == 0
    cache.commit_step(batch)
    with pytest.raises(ValueError, match="committed already"):
        cache.commit_step(batch)
    stale = cache.step([r1], num_new=1)
    cache.commit(r1, 1)
    with pytest.raises(ValueError, match="stale"):
        cache.commit_step(stale)
    cache.finish(r1)
    batch = cache.step([r1, r2])
    assert batch.ok.tolist() == [False, True] and "not live" in str(batch.errors[0])


def test_a_request_listed_twice_in_a_step_raises_and_changes_nothing():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=100, swa_pages=100))
    r1, r2 = cache.begin(np.arange(5, dtype=np.int32)), cache.begin(np.arange(9, dtype=np.int32))
    before = (snapshot(r1), snapshot(r2), cache.pool.full.num_free, cache.pool.swa.num_free)
    with pytest.raises(ValueError, match=r"requests\[2\] is the same request as requests\[0\]"):
        cache.step([r1, r2, r1], new_tokens=[7, 8, 9])  # two rows would both grow and commit r1
    assert (snapshot(r1), snapshot(r2), cache.pool.full.num_free, cache.pool.swa.num_free) == before
    batch = cache.step([r1, r2])
    cache.commit_step(batch)
    assert (r1.computed, r2.computed) == (5, 9)
    cache.check_invariants()


def test_decode_append_does_not_copy_the_prompt_each_token():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=3000, swa_pages=3000, retention="eager"))
    req = cache.begin(np.arange(1000, dtype=np.int32))
    cache.commit_step(cache.step([req]))
    buffers = set()
    for t in range(5000):
        cache.commit_step(cache.step([req], new_tokens=[t % 50]))
        buffers.add(id(req.token_buffer))
    assert len(buffers) <= 4  # doubling: a handful of reallocations for 5,000 appends
    assert req.n_tokens == 6000 and req.tokens[-1] == 4999 % 50
    with pytest.raises(ValueError):
        req.tokens[0] = 5  # read-only view


def test_commit_cannot_pass_what_was_allocated():
    """commit(3) after allocate(1) was accepted and a later prompt hit positions
    that were never written (a pseudo-hit from the public API)."""
    cache = HybridKVCache(spec(page=2, window=4), CacheConfig(full_pages=50, swa_pages=50))
    r = cache.begin(np.arange(10, dtype=np.int32))
    cache.allocate(r, 1)
    with pytest.raises(ValueError, match="allocated"):
        cache.commit(r, 3)
    assert r.computed == 0
    cache.commit(r, 1)
    cache.finish(r)
    again = cache.begin(np.arange(10, dtype=np.int32))
    assert again.prefix_len == 0
    cache.finish(again)
    cache.check_invariants()


def test_commit_past_the_tokens_is_rejected_and_finish_still_works():
    cache = HybridKVCache(spec(page=4, window=4), CacheConfig(full_pages=50, swa_pages=50))
    r = cache.begin(np.arange(5, dtype=np.int32))
    cache.allocate(r, 5)
    cache.commit(r, 5)
    with pytest.raises(ValueError, match="allocated"):
        cache.commit(r, 3)
    cache.finish(r)
    cache.check_invariants()


def test_misuse_raises_clear_errors():
    cache = HybridKVCache(spec(), CacheConfig(full_pages=50, swa_pages=50))
    r = cache.begin(np.arange(6, dtype=np.int32))
    cache.allocate(r, 2)
    with pytest.raises(TypeError, match="n must be an int"):
        cache.commit(r, True)
    with pytest.raises(TypeError, match="n must be an int"):
        cache.allocate(r, 1.0)
    with pytest.raises(TypeError, match="namespace"):
        cache.begin([1, 2], namespace=5)
    cache.commit(r, 2)
    cache.finish(r)
    for call in (lambda: cache.full_slots(r, 0, 2), lambda: cache.swa_slots(r, 0, 2),
                 lambda: cache.commit(r, 1)):
        with pytest.raises(ValueError, match="not live"):
            call()
    with pytest.raises(ValueError, match="full_pages"):
        CacheConfig(full_pages=0, swa_pages=10)
    with pytest.raises(ValueError, match="needs at least"):
        HybridKVCache(spec(), CacheConfig(full_pages=2, swa_pages=50))
    cache.check_invariants()


def test_device_errors_are_clear():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            HybridKVCache(spec(), CacheConfig(full_pages=50, swa_pages=50, device="cuda"))
    with pytest.raises(ValueError, match="device must be"):
        HybridKVCache(spec(), CacheConfig(full_pages=50, swa_pages=50, device="gpu"))


def test_full_attention_only_model_gets_a_consistent_budget():
    s = ModelSpec("dense", ["full", "full"], 8, KVShape(2, 4, 4), KVShape(2, 4, 4), dtype="float32", page_size=4)
    per_page = s.bytes_per_page("full")
    cache = HybridKVCache(s, CacheConfig(budget_bytes=40 * per_page, device="cpu"))
    assert cache.pool.full.capacity == 40 and cache.pool.tensor_bytes() <= 40 * per_page
    r = cache.begin(np.arange(30, dtype=np.int32))
    cache.allocate(r, 30)
    cache.commit(r, 30)
    cache.finish(r)
    assert cache.begin(np.arange(31, dtype=np.int32)).prefix_len == 28
    with pytest.raises(ValueError, match="needs at least"):
        HybridKVCache(s, CacheConfig(budget_bytes=per_page, device="cpu"))


def test_reference_model_through_the_batched_step():
    """Several requests prefilled and decoded together through step()/commit_step(),
    K/V written and read through the arena's kernel-facing views: logits equal
    the dense forward."""
    sp = tiny_spec()
    model = ReferenceModel(sp, seed=11)
    cache = HybridKVCache(sp, CacheConfig(budget_bytes=60 * 5 * 1792, device="cpu", retention="eager",
                                          swa_checkpoint=0, decode_release_interval=3))
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 64, 20)
    for _ in range(3):
        prompts = [np.concatenate([shared[:int(rng.integers(4, 20))], rng.integers(0, 64, int(rng.integers(2, 9)))])
                   .astype(np.int32) for _ in range(4)]
        reqs = [cache.begin(p) for p in prompts]
        out = [[] for _ in reqs]
        batch = cache.step(reqs)
        for i, r in enumerate(reqs):
            out[i].append(model.forward_step(cache, batch, i))
        cache.commit_step(batch)
        for _ in range(5):
            nxt = np.array([int(o[-1][-1].argmax()) for o in out])
            batch = cache.step(reqs, new_tokens=nxt)
            assert batch.ok.all()
            for i in range(len(reqs)):
                out[i].append(model.forward_step(cache, batch, i))
            cache.commit_step(batch)
        for i, r in enumerate(reqs):
            dense = model.forward_dense(r.tokens)[r.prefix_len:]
            assert float((torch.cat(out[i]) - dense).abs().max()) < 1e-9
            cache.finish(r)
        cache.check_invariants()
    assert isinstance(batch, StepBatch)


def _adaptive_cache() -> HybridKVCache:
    """16 pages of each kind in one arena, ``adaptive`` retention with no spare margin:
    requests keep their out-of-window SWA until another allocation needs it."""
    sp = spec(page=2, window=4)
    budget = 16 * (sp.bytes_per_page("full") + sp.bytes_per_page("swa"))
    return HybridKVCache(sp, CacheConfig(budget_bytes=budget, retention="adaptive", spare_fraction=0.0,
                                         swa_checkpoint=0, device="cpu"))


def test_failed_allocation_leaves_the_request_as_it_was_under_adaptive_retention():
    """Under ``adaptive`` retention a request keeps its out-of-window SWA while memory
    is spare.  An allocation that fails must not release it first (the request is
    unchanged); one that succeeds only by releasing it does release it."""
    cache = _adaptive_cache()
    req = cache.begin(np.arange(1, 61, dtype=np.int32))
    cache.allocate(req, 24)
    cache.commit(req, 24)                      # 12 pages; memory was spare: their SWA is kept
    held = int(np.count_nonzero(req.swa_pages[:req.n_pages] >= 0))
    assert held == 12
    before = (req.swa_pages.copy(), req.full_pages.copy(), req.release_mark, req.n_pages, req.allocated)
    with pytest.raises(CacheFullError):
        cache.allocate(req, 30)                # 15 more pages: not even with its own SWA freed
    assert np.array_equal(req.swa_pages, before[0]) and np.array_equal(req.full_pages, before[1])
    assert (req.release_mark, req.n_pages, req.allocated) == before[2:]
    cache.check_invariants()
    cache.allocate(req, 10)                    # 5 more pages: fits once its spare SWA goes
    assert int(np.count_nonzero(req.swa_pages[:12] >= 0)) < held
    cache.commit(req, 10)
    cache.finish(req)
    cache.check_invariants()


def test_failed_step_rows_stay_as_they_were_while_other_rows_take_spare_swa():
    """A row that fails (bad ``num_new``, or no memory) is left exactly as it was,
    even when another row of the same step needs the spare SWA of live requests."""
    cache = _adaptive_cache()
    a = cache.begin(np.arange(1, 21, dtype=np.int32))
    b = cache.begin(np.arange(100, 140, dtype=np.int32))
    for req, n in ((a, 12), (b, 16)):
        cache.allocate(req, n)
        cache.commit(req, n)                   # memory spare: both keep all their SWA
    assert int(np.count_nonzero(a.swa_pages[:a.n_pages] >= 0)) == 6
    snap = (a.swa_pages.copy(), a.full_pages.copy(), a.n_pages, a.computed, a.n_tokens)
    # row 0 asks past its tokens (ValueError); row 1 needs 3 pages: there once spare SWA goes
    batch = cache.step([a, b], num_new=np.array([50, 6]))
    assert not batch.ok[0] and isinstance(batch.errors[0], ValueError) and batch.ok[1]
    assert np.array_equal(a.swa_pages, snap[0]) and np.array_equal(a.full_pages, snap[1])
    assert (a.n_pages, a.computed, a.n_tokens) == snap[2:]
    assert int(np.count_nonzero(b.swa_pages[:8] >= 0)) < 8   # row 1 gave its own spare SWA
    cache.commit_step(batch)
    cache.check_invariants()
