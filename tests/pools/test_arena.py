"""The KV arena: every tensor the cache allocates fits the budget, and memory
flows between full and SWA pages inside one allocation."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch

from hybridkv import CacheConfig, DualPool, HybridKVCache, ModelSpec
from hybridkv.eval.model import ReferenceModel, tiny_spec
from hybridkv.pools import ArenaLayout, arena_page_bytes
from hybridkv.tiers.tiered import TierConfig, TieredCache


def _storages() -> dict[int, int]:
    """data_ptr -> bytes of the storage of every live CPU tensor."""
    out = {}
    with warnings.catch_warnings():  # isinstance() on some lazy module objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu":
            st = obj.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def _new_tensor_bytes(build):  # noqa: ANN001, ANN202
    gc.collect()
    before = _storages()
    obj = build()
    gc.collect()
    after = _storages()
    return obj, sum(n for p, n in after.items() if p not in before)


@pytest.mark.parametrize("preset", ["mimo-v2.5-pro", "mimo-v2.5", "gemma-3-27b", "gpt-oss-120b"])
def test_cache_tensors_fit_the_budget(preset):
    spec = ModelSpec.preset(preset, page_size=16)
    lay = ArenaLayout.for_spec(spec)
    budget = (spec.window_pages + 8) * (lay.page_bytes("full") + lay.page_bytes("swa")) + 12345
    cache, nbytes = _new_tensor_bytes(lambda: HybridKVCache(spec, CacheConfig(budget_bytes=budget, device="cpu")))
    # before this arena, full and SWA tensors were each sized for the whole budget (2x)
    assert budget - lay.block_bytes < nbytes <= budget
    assert cache.pool.tensor_bytes() == nbytes == cache.stats()["tensor_bytes"]
    assert cache.pool.budget_bytes == nbytes  # rounded down to whole blocks


def test_host_tier_arena_fits_its_budget():
    spec = tiny_spec()
    fpb, spb = arena_page_bytes(spec, "full"), arena_page_bytes(spec, "swa")
    l1, l2 = 30 * (fpb + spb), 100 * (fpb + spb) + 7

    def build():  # noqa: ANN202
        return TieredCache(spec, CacheConfig(budget_bytes=l1, device="cpu"), tiers=TierConfig(l2_bytes=l2))

    cache, nbytes = _new_tensor_bytes(build)
    try:
        assert nbytes <= l1 + l2
        assert cache.host.pool.tensor_bytes() <= l2 and cache.pool.tensor_bytes() <= l1
    finally:
        cache.close()


def _tag(kb, pages: np.ndarray, value: float) -> None:  # noqa: ANN001
    """Write ``value + page`` into every layer slot of the pages' blocks, through the kernel views."""
    P = kb.k.shape[2]
    for li in range(kb.layout.num_layers):
        slots = (pages[:, None] * P + np.arange(P)[None, :]).reshape(-1)
        vals = torch.tensor(np.repeat(value + pages, P), dtype=kb.k.dtype)
        kb.write(li, slots, vals[:, None, None].expand(-1, kb.layout.heads, kb.layout.k_dim),
                 -vals[:, None, None].expand(-1, kb.layout.heads, kb.layout.v_dim))


def _check(kb, pages: np.ndarray, value: float) -> None:  # noqa: ANN001
    P = kb.k.shape[2]
    for li in range(kb.layout.num_layers):
        slots = (pages[:, None] * P + np.arange(P)[None, :]).reshape(-1)
        k, v = kb.read(li, slots)
        want = np.repeat(value + pages, P).astype(np.float64)
        assert np.array_equal(k.amax(dim=(1, 2)).numpy(), want) and np.array_equal(k.amin(dim=(1, 2)).numpy(), want)
        assert np.array_equal(v.amax(dim=(1, 2)).numpy(), -want)


def test_pool_moves_memory_between_kinds_without_reallocating():
    spec = tiny_spec()
    lay = ArenaLayout.for_spec(spec)
    budget = 48 * lay.page_bytes("swa")
    pool = DualPool(spec, budget_bytes=budget, device="cpu")
    arena = pool.buffers
    ptr, nbytes = arena.storage.data_ptr(), pool.tensor_bytes()
    rng = np.random.default_rng(0)
    tags: dict[tuple[str, int], float] = {}  # (kind, page) -> value written into it
    for phase in range(5):
        kind = "full" if phase % 2 == 0 else "swa"
        got = []
        while True:  # fill what is left with one kind, page by page
            a = pool.alloc(1, 0) if kind == "full" else pool.alloc(0, 1)
            if a is None:
                break
            got.append(a[0] if kind == "full" else a[1])
        new = np.concatenate(got)
        _tag(arena.of(kind), new, 1000.0 * (phase + 1))
        tags.update({(kind, int(p)): 1000.0 * (phase + 1) for p in new})
        used = pool.full.num_used * lay.page_bytes("full") if kind == "full" else \
            pool.swa.num_used * lay.page_bytes("swa")
        assert used >= 0.9 * budget, (phase, kind, used, budget)  # this kind holds ~all memory now
        pool.check_invariants()
        for (k, p), value in tags.items():  # nothing written earlier was overwritten
            _check(arena.of(k), np.array([p]), value)
        drop = rng.permutation(new)[: len(new) - 1]  # give back all but one, in random order
        pool.free_full(drop) if kind == "full" else pool.free_swa(drop)
        for p in drop.tolist():
            del tags[(kind, p)]
        assert arena.storage.data_ptr() == ptr and pool.tensor_bytes() == nbytes


def test_reference_model_on_arena_full_heavy_then_swa_heavy_and_back():
    """The cache's workload moves the arena from full-heavy (many cached
    prefixes) to SWA-heavy (many live requests, each holding windows) and
    back; every logit equals the dense forward throughout."""
    spec = tiny_spec()
    model = ReferenceModel(spec, seed=3)
    lay = ArenaLayout.for_spec(spec)
    budget = 36 * lay.page_bytes("swa")
    cache = HybridKVCache(spec, CacheConfig(budget_bytes=budget, device="cpu", retention="eager",
                                            swa_checkpoint=0, decode_release_interval=4))
    ptr = cache.pool.buffers.storage.data_ptr()
    rng = np.random.default_rng(1)
    fpb, spb = cache.pool.full_page_bytes, cache.pool.swa_page_bytes
    shares = []

    def check_logits(req, tokens, logits):  # noqa: ANN001, ANN202
        dense = model.forward_dense(tokens)[req.prefix_len:]
        assert float((logits - dense).abs().max()) < 1e-9

    def full_heavy_phase() -> None:
        base = rng.integers(0, 64, 40).astype(np.int32)
        for _ in range(12):
            toks = np.concatenate([base[:int(rng.integers(8, 40))], rng.integers(0, 64, 110)]).astype(np.int32)
            req = cache.begin(toks)
            parts = []
            while req.computed < len(toks):  # chunked prefill: eager release keeps SWA at O(W + chunk)
                parts.append(model.forward_cached(cache, req, min(16, len(toks) - req.computed)))
            check_logits(req, toks, torch.cat(parts))
            cache.finish(req)
        used_f, used_s = cache.pool.full.num_used * fpb, cache.pool.swa.num_used * spb
        shares.append(used_f / (used_f + used_s))

    def swa_heavy_phase() -> None:
        live = []
        for _ in range(6):
            toks = rng.integers(0, 64, 14).astype(np.int32)
            req = cache.begin(toks)
            logits = model.forward_cached(cache, req, len(toks) - req.computed)
            check_logits(req, toks, logits)
            live.append((req, toks))
        used_f, used_s = cache.pool.full.num_used * fpb, cache.pool.swa.num_used * spb
        shares.append(used_f / (used_f + used_s))
        for req, _ in live:
            cache.finish(req)

    full_heavy_phase()
    swa_heavy_phase()
    full_heavy_phase()
    cache.check_invariants()
    assert cache.pool.buffers.storage.data_ptr() == ptr
    assert shares[0] > 0.5 and shares[1] < 0.35 and shares[2] > 0.5, shares


@pytest.mark.parametrize("backend", ["torch", "host"])
def test_transfer_kernels_copy_and_pack_arena_pages(backend):
    """copy_pages / pack_pages / unpack_pages on the arena's 5-D block views
    (page stride = block bytes): bitwise what was written, both backends."""
    from hybridkv.transfer import copy_pages, pack_pages, unpack_pages
    from hybridkv.transfer.host_kernel import load_host_kernel

    if backend == "host" and load_host_kernel() is None:
        pytest.skip("the C host kernel did not build here (no C compiler)")
    spec = tiny_spec()
    lay = ArenaLayout.for_spec(spec)
    src = DualPool(spec, budget_bytes=20 * lay.page_bytes("swa"), device="cpu")
    dst = DualPool(spec, budget_bytes=30 * lay.page_bytes("swa"), device="cpu")
    for kind, alloc in (("full", lambda p, n: p.alloc(n, 0)[0]), ("swa", lambda p, n: p.alloc(0, n)[1])):
        a = alloc(src, 5)
        dst_junk = alloc(dst, 3)  # so page ids differ between the two arenas
        b = alloc(dst, 5)
        sk, dk = src.buffers.of(kind), dst.buffers.of(kind)
        _tag(sk, a, 7.0)
        copy_pages(sk.k, sk.v, dk.k, dk.v, sk.blocks(a), dk.blocks(b), spec.page_size, backend=backend)
        for p_src, p_dst in zip(a, b):
            assert torch.equal(sk.k[:, sk.table[p_src]], dk.k[:, dk.table[p_dst]])
            assert torch.equal(sk.v[:, sk.table[p_src]], dk.v[:, dk.table[p_dst]])
        rows = pack_pages(sk.k, sk.v, torch.from_numpy(sk.blocks(a)), spec.page_size, backend=backend)
        dst.free_full(dst_junk) if kind == "full" else dst.free_swa(dst_junk)
        c = alloc(dst, 5)
        unpack_pages(rows, dk.k, dk.v, torch.from_numpy(dk.blocks(c)), spec.page_size, backend=backend)
        for p_src, p_dst in zip(a, c):
            assert torch.equal(sk.k[:, sk.table[p_src]], dk.k[:, dk.table[p_dst]])
