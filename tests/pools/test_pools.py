import numpy as np
import pytest
import torch

from hybridkv import DualPool, KVShape, ModelSpec
from hybridkv.pools import PageAllocator, slots_of_pages

SPEC = ModelSpec("t", ["full", "swa", "swa"], 8, KVShape(2, 6, 4), KVShape(3, 6, 4), dtype="float32", page_size=4)


def test_allocator_roundtrip_and_reuse():
    a = PageAllocator(10)
    x = a.alloc(6)
    assert sorted(x.tolist()) == list(range(6)) and a.num_free == 4
    assert a.alloc(5) is None and a.num_used == 6  # short: nothing changed
    a.free(x[:3])
    y = a.alloc(7)
    assert len(set(y.tolist()) | set(x[3:].tolist())) == 10
    a.check_invariants()


@pytest.mark.parametrize("bad", [[99], [-1], [0, 0]])
def test_allocator_bad_free_changes_nothing(bad):
    a = PageAllocator(10)
    a.alloc(3)
    with pytest.raises(ValueError, match="pages"):
        a.free(np.array(bad))
    assert a.num_used == 3
    a.check_invariants()


def test_allocator_double_free():
    a = PageAllocator(4)
    x = a.alloc(2)
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free(x[:1])


def test_allocator_type_errors():
    a = PageAllocator(4)
    with pytest.raises(TypeError, match="pages"):
        a.free("12")
    with pytest.raises(TypeError, match="pages"):
        a.free(np.array([1.5]))
    with pytest.raises(TypeError, match="n must be an int"):
        a.alloc(1.0)


def test_huge_capacity_is_lazy():
    a = PageAllocator(10**12)
    x = a.alloc(5)
    assert x.tolist() == [0, 1, 2, 3, 4] and a._allocated.size < 10**6


def test_dual_pool_admission_checks_both_pools():
    pool = DualPool(SPEC, full_pages=6, swa_pages=2, device=None)
    assert pool.alloc(3, 3) is None  # SWA short
    assert pool.full.num_used == 0
    full, swa = pool.alloc(3, 2)
    assert pool.shortfall(4, 1) == (1, 1, pool.full_page_bytes + pool.swa_page_bytes)
    pool.free_swa(swa)
    assert pool.swa.num_used == 0 and pool.full.num_used == 3
    pool.check_invariants()


def test_dual_pool_shared_budget():
    fpb, spb = SPEC.bytes_per_page("full"), SPEC.bytes_per_page("swa")
    pool = DualPool(SPEC, budget_bytes=4 * fpb + 2 * spb, device="meta")
    assert pool.shared
    assert pool.alloc(4, 2) is not None
    assert pool.alloc(1, 0) is None  # budget spent although the full allocator has room
    assert pool.free_bytes() == 0
    pool.check_invariants()


def test_buffers_layout_and_slots():
    pool = DualPool(SPEC, full_pages=3, swa_pages=2, device="cpu")
    b = pool.buffers
    # blocks of 480 B: one SWA layer slot (4 tok x 3 heads x (6 + 4) x 4 B) or one full layer slot (320 B)
    assert b.layout.block_bytes == 480
    assert b.layout.full.blocks_per_page == 1 and b.layout.swa.blocks_per_page == 2
    assert b.num_blocks == 3 * 1 + 2 * 2 and b.storage.untyped_storage().nbytes() == 7 * 480
    assert b.full.k.shape == (1, 7, 4, 2, 6) and b.full.v.shape == (1, 7, 4, 2, 4)
    assert b.swa.k.shape == (1, 7, 4, 3, 6) and b.swa.v.dtype == torch.float32
    assert b.swa.local(2) == 1
    with pytest.raises(ValueError, match="layer 0"):
        b.swa.local(0)
    assert slots_of_pages(np.array([2, 0]), 4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    meta = DualPool(ModelSpec.preset("mimo-v2.5-pro"), budget_bytes=10**12, device="meta")
    assert meta.buffers.full.k.device.type == "meta"


def test_pool_bad_arguments():
    with pytest.raises(ValueError, match="budget_bytes"):
        DualPool(SPEC, full_pages=2)
    with pytest.raises(ValueError, match="full_pages"):
        DualPool(SPEC, full_pages=-1, swa_pages=2)
    with pytest.raises(TypeError, match="spec"):
        DualPool("mimo", full_pages=1, swa_pages=1)
    pool = DualPool(SPEC, full_pages=2, swa_pages=2, device=None)
    with pytest.raises(ValueError, match="n_full"):
        pool.alloc(-1, 0)
