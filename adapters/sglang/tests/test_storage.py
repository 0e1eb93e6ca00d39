"""hybridkv's L3 backends as SGLang's HiCacheStorage (v1 and v2 with SWA trailing pages)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import conftest

conftest.publish_test_server_args()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from hybridkv_sglang.storage import HybridKVStorage  # noqa: E402


class PagedHostPool:
    """Stand-in for SGLang's host KV pool: the page interface HiCacheStorage
    backends use (pool_host/base.py: get_data_page / get_dummy_flat_data_page /
    set_from_flat_data_page), over one tensor of ``pages x page_size x width``."""

    def __init__(self, pages: int, page_size: int, width: int, seed: int) -> None:
        self.page_size = page_size
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randn(pages * page_size, width, generator=g, dtype=torch.float32).to(torch.bfloat16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.data[index:index + self.page_size].reshape(-1)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(self.page_size * self.data.shape[1], dtype=self.data.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.data[index:index + self.page_size] = data_page.reshape(self.page_size, -1)


def _config(url: str, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="XiaomiMiMo/MiMo-V2.5", extra_config={"url": url, **extra})


def _indices(pages: list[int], ps: int) -> torch.Tensor:
    return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)


@pytest.fixture
def storage(tmp_path):
    s = HybridKVStorage(_config(f"file://{tmp_path}"))
    yield s
    s.close()


def test_loaded_by_sglangs_dynamic_factory(tmp_path):
    extra = {"backend_name": "hybridkv", "module_path": "hybridkv_sglang.storage",
             "class_name": "HybridKVStorage", "url": f"file://{tmp_path}"}
    # what --hicache-storage-backend-extra-config carries, through SGLang's factory
    cfg = _config("")
    cfg.extra_config = json.loads(json.dumps(extra))
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    inner = getattr(backend, "_inner", backend)
    assert isinstance(inner, HybridKVStorage) or isinstance(backend, HybridKVStorage)
    assert backend.set("k0", torch.arange(8, dtype=torch.int32))
    assert backend.exists("k0")


def test_missing_url_and_bad_config():
    os.environ.pop("HYBRIDKV_STORAGE_URL", None)
    with pytest.raises(ValueError, match="url"):
        HybridKVStorage(_config(""))
    with pytest.raises(TypeError, match="storage_config"):
        HybridKVStorage({"url": "file:///x"})


def test_v1_roundtrip_and_prefix_exists(storage):
    vals = [torch.full((16,), float(i), dtype=torch.float16) for i in range(5)]
    keys = [f"h{i}" for i in range(5)]
    assert storage.batch_set(keys[:3], vals[:3])
    assert storage.batch_exists(keys) == 3
    out = [torch.empty(16, dtype=torch.float16) for _ in range(4)]
    got = storage.batch_get(keys[:4], out)
    assert [g is not None for g in got] == [True, True, True, False]
    assert all(torch.equal(out[i], vals[i]) for i in range(3))
    wrong_size = [torch.empty(8, dtype=torch.float16)]
    assert storage.batch_get(keys[:1], wrong_size) == [None]  # size mismatch is a miss, not garbage


def test_v2_kv_and_swa_trailing_pages(storage):
    ps, window_pages = 4, 2
    kv = PagedHostPool(16, ps, 8, seed=1)
    swa = PagedHostPool(16, ps, 12, seed=2)
    storage.register_mem_pool_host(kv)
    storage.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = [f"p{i}" for i in range(6)]
    # node 1 = pages 0..3 (SWA window: pages 2,3), node 2 = pages 4..5 (window 4,5)
    res = storage.batch_set_v2([
        PoolTransfer(PoolName.KV, host_indices=_indices(list(range(6)), ps), keys=keys),
        PoolTransfer(PoolName.SWA, host_indices=_indices([2, 3], ps), keys=keys[2:4],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ])
    assert res[str(PoolName.KV)] == [True] * 6 and res[str(PoolName.SWA)] == [True, True]
    res = storage.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=_indices([4, 5], ps), keys=keys[4:6],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert res[str(PoolName.SWA)] == [True, True]
    probe = [PoolTransfer(PoolName.SWA, keys=[None] * window_pages, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    hit = storage.batch_exists_v2(keys, probe)
    # a prefix is restorable only where its last W pages hold SWA: 4 (pages 2,3), 5? (3,4) yes, 6 (4,5) yes,
    # 1..3 not (pages 0,1 never had SWA written)
    assert hit.restorable_prefix_pages == [4, 5, 6]
    assert hit.kv_hit_pages == 6
    # drop page 5's SWA object: 6 is no longer restorable, 5 still is
    storage.backend.delete([storage._key("p5", PoolName.SWA)])
    hit = storage.batch_exists_v2(keys, probe)
    assert hit.restorable_prefix_pages == [4, 5] and hit.kv_hit_pages == 5
    # load into fresh host pools: bytes equal, and a missing page reports False
    kv2, swa2 = PagedHostPool(16, ps, 8, seed=3), PagedHostPool(16, ps, 12, seed=4)
    s2 = HybridKVStorage(_config(storage.url))
    s2.register_mem_pool_host(kv2)
    s2.register_mem_host_pool_v2(swa2, PoolName.SWA)
    got = s2.batch_get_v2([
        PoolTransfer(PoolName.KV, host_indices=_indices([8, 9, 10, 11, 12], ps), keys=keys[:5]),
        PoolTransfer(PoolName.SWA, host_indices=_indices([11, 12], ps), keys=keys[3:5],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(PoolName.SWA, host_indices=_indices([13], ps), keys=keys[5:6],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
    ])
    assert got[str(PoolName.KV)] == [True] * 5
    assert got[str(PoolName.SWA)] == [False]  # the last transfer of the pool (page 5 deleted)
    assert torch.equal(kv2.data[8 * ps:13 * ps], kv.data[0:5 * ps])
    assert torch.equal(swa2.data[11 * ps:13 * ps], swa.data[3 * ps:5 * ps])
    s2.close()


def test_corrupt_object_is_a_miss_not_wrong_kv(storage, tmp_path):
    ps = 2
    kv = PagedHostPool(4, ps, 4, seed=5)
    storage.register_mem_pool_host(kv)
    storage.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=_indices([0, 1], ps), keys=["a", "b"])])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files, "the file backend stores objects under the URL's folder"
    for f in files:  # flip one payload byte in every object
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0xFF
        f.write_bytes(bytes(raw))
    target = PagedHostPool(4, ps, 4, seed=6)
    before = target.data.clone()
    s2 = HybridKVStorage(_config(storage.url))
    s2.register_mem_pool_host(target)
    got = s2.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=_indices([2, 3], ps), keys=["a", "b"])])
    assert got[str(PoolName.KV)] == [False, False]
    assert torch.equal(target.data, before)
    assert s2.get_stats()["corrupt"] >= 2
    s2.close()
