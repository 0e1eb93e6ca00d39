"""hybridkv's L3 backends as an SGLang 0.5.23 ``HiCacheStorage``.

Load it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hybridkv",
        "module_path": "hybridkv_sglang.storage", "class_name": "HybridKVStorage",
        "url": "file:///var/cache/hybridkv"}'

``url`` is any :func:`hybridkv.tiers.storage.open_backend` URL (``file://``,
``redis://``, ``mooncake://``, ``nixl+posix://``); ``$HYBRIDKV_STORAGE_URL``
is used when the config has none.  Every value is framed and checksummed by
hybridkv, so a truncated or corrupt object is a miss, never wrong KV, and a
backend that is down degrades to misses (counted, logged, circuit breaker).

Keys.  SGLang names a page by a chained hash string; one page has one object
per pool (``kv``, ``swa``, ...).  The stored key is a 16-byte BLAKE2b digest of
(model, tensor-parallel shard, pool, SGLang key), so ranks and pools never
collide and keys fit every backend.

SWA (v2 interface).  SGLang's SWA host pool only holds the window that ends
on an offloaded node; it passes that pool as a ``PoolTransfer`` with
``hit_policy=TRAILING_PAGES`` whose ``keys`` are the trailing window pages.
:meth:`HybridKVStorage.batch_exists_v2` returns, per the v2 contract, the
prefix lengths at which every pool can be restored (``restorable_prefix_pages``):
for a trailing pool, lengths ``L`` whose last ``len(keys)`` pages exist.  Only
window pages are written, so storage holds O(W) SWA per cached node.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch

from hybridkv.tiers.storage import open_backend
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

__all__ = ["HybridKVStorage"]

logger = logging.getLogger(__name__)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor without a copy when contiguous.  O(1) or O(n)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def _fill(target: torch.Tensor, data: Any) -> bool:
    """Copy ``data`` into ``target`` if the byte sizes match (else a miss).  O(n)."""
    raw = memoryview(data).cast("B")
    want = target.numel() * target.element_size()
    if len(raw) != want:
        return False
    src = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw.readonly else torch.frombuffer(raw, dtype=torch.uint8)
    target.view(-1).view(torch.uint8).copy_(src)
    return True


class HybridKVStorage(HiCacheStorage):
    """``HiCacheStorage`` over a hybridkv ``StorageBackend``.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; ``extra_config["url"]``
            names the backend (or ``$HYBRIDKV_STORAGE_URL``).
        kwargs: what SGLang's dynamic factory passes (unused).

    Thread-safe as far as the backend is (SGLang calls it from its prefetch and
    backup threads).  Never raises on a backend fault: misses and ``False``.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(f"storage_config must be a HiCacheStorageConfig, got {type(storage_config).__name__}")
        extra = dict(storage_config.extra_config or {})
        url = extra.get("url") or os.environ.get("HYBRIDKV_STORAGE_URL")
        if not url:
            raise ValueError("extra_config['url'] (or $HYBRIDKV_STORAGE_URL) must name a hybridkv storage URL, "
                             "e.g. file:///var/cache/hybridkv or redis://127.0.0.1:6379/0")
        self.url = str(url)
        self.backend = open_backend(self.url)
        c = storage_config
        model = (c.model_name or "").replace("/", "-")
        # MLA KV is identical on every TP rank (one object per page); other
        # models shard heads, so each rank stores its own slice.
        shard = "mla" if c.is_mla_model else f"tp{c.tp_rank}of{c.tp_size}"
        self._scope = f"{model}|{shard}|pp{c.pp_rank}of{c.pp_size}|cp{c.attn_cp_rank}of{c.attn_cp_size}"
        self.registered_pools: dict[Any, Any] = {}

    # ------------------------------------------------------------ keys
    def _key(self, key: str, pool: Any = PoolName.KV) -> bytes:
        name = pool.value if isinstance(pool, PoolName) else str(pool)
        h = hashlib.blake2b(digest_size=16, person=b"hybridkv-sgl")
        h.update(f"{self._scope}\x00{name}\x00{key}".encode())
        return h.digest()

    def _keys(self, keys: Sequence[str], pool: Any = PoolName.KV) -> list[bytes]:
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise TypeError("keys must be a list of str page hashes")
        return [self._key(k, pool) for k in keys]

    # ------------------------------------------------------------ v1 API
    def exists(self, key: str) -> bool:
        return bool(self.backend.exists(self._keys([key]))[0])

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading run of stored keys.  One batched backend call."""
        if not keys:
            return 0
        found = np.asarray(self.backend.exists(self._keys(keys)), dtype=bool)
        return int(found.size if found.all() else np.argmin(found))

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Values into ``target_locations[i]`` (byte sizes must match) or new uint8 tensors."""
        datas = self.backend.get(self._keys(keys))
        out: list[torch.Tensor | None] = []
        for i, data in enumerate(datas):
            if data is None:
                out.append(None)
            elif target_locations is not None:
                out.append(target_locations[i] if _fill(target_locations[i], data) else None)
            else:
                out.append(torch.frombuffer(bytearray(memoryview(data).cast("B")), dtype=torch.uint8))
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        vals = values if values is not None else target_locations
        if vals is None or len(vals) != len(keys):
            raise ValueError("values must hold one tensor per key")
        return all(self.backend.put(self._keys(keys), [_as_bytes(v) for v in vals]))

    # ------------------------------------------------------------ v2 API
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.registered_pools.setdefault(PoolName.KV, mem_pool_host)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """Longest restorable prefix across the KV pool and every extra pool.

        ALL_PAGES pools must hold every page of the prefix; TRAILING_PAGES pools
        (SWA, mamba) the last ``len(transfer.keys)`` pages of it.  Hits are
        touched in L3 so hot prefixes stay.  One backend call per pool; O(n).
        """
        n = len(keys)
        if n == 0:
            return PoolTransferResult(0, {}, [])
        kv = np.asarray(self.backend.exists(self._keys(keys)), dtype=bool)
        kv_pages = int(n if kv.all() else np.argmin(kv))
        ok = np.zeros(n + 1, dtype=bool)  # ok[L]: prefix of L pages restorable
        ok[1:kv_pages + 1] = True
        hits: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
        touched = [self._key(k) for k in keys[:kv_pages]]
        for t in pool_transfers or []:
            if not ok.any():
                break
            comp = np.asarray(self.backend.exists(self._keys(keys[:kv_pages], t.name)), dtype=bool)
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                lead = int(comp.size if comp.all() else np.argmin(comp))
                pool_ok = np.zeros(n + 1, dtype=bool)
                pool_ok[1:lead + 1] = True
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                run = np.zeros(kv_pages + 1, dtype=np.int64)
                np.cumsum(comp, out=run[1:])
                ends = np.arange(1, kv_pages + 1)
                starts = np.maximum(0, ends - trailing)
                pool_ok = np.zeros(n + 1, dtype=bool)
                pool_ok[1:kv_pages + 1] = (run[ends] - run[starts]) == (ends - starts)
            else:
                raise ValueError(f"unsupported hit policy {t.hit_policy!r} for pool {t.name}")
            boundary = int(np.flatnonzero(pool_ok)[-1]) if pool_ok.any() else 0
            if boundary:
                hits[str(t.name)] = boundary
                touched += [self._key(k, t.name) for k, e in zip(keys[:boundary], comp[:boundary]) if e]
            ok &= pool_ok
        restorable = [int(x) for x in np.flatnonzero(ok)]
        if touched:
            self.backend.touch(touched)
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _host_pool(self, name: Any) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None and name == PoolName.KV:
            pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise ValueError(f"no host pool registered for {name}")
        return pool

    def _pages(self, t: PoolTransfer, pool: Any) -> list[int] | None:
        ps = int(getattr(pool, "page_size", 1) or 1)
        keys = t.keys or []
        idx = t.host_indices
        if idx is None or idx.numel() != len(keys) * ps:
            logger.error("hybridkv storage: %s host indices hold %s entries for %d keys of page size %d",
                         t.name, None if idx is None else idx.numel(), len(keys), ps)
            return None
        return idx[::ps].tolist()

    def _per_pool(self, transfers: List[PoolTransfer],
                  op: Callable[[Any, list[int], list[bytes]], List[bool]]) -> dict[str, List[bool]]:
        """``op(host pool, page offsets, storage keys)`` per transfer; all False
        for a transfer whose host indices do not match its keys."""
        results: dict[str, List[bool]] = {}
        for t in transfers:
            pool = self._host_pool(t.name)
            offsets = self._pages(t, pool)
            keys = t.keys or []
            results[str(t.name)] = ([False] * len(keys) if offsets is None
                                    else op(pool, offsets, self._keys(keys, t.name)))
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Load each pool's pages into its host pool; per-page success (a miss or a
        size mismatch is False, so SGLang clamps the hit to what was loaded)."""
        def load(pool: Any, offsets: list[int], keys: list[bytes]) -> List[bool]:
            flags = []
            for off, data in zip(offsets, self.backend.get(keys)):
                good = False
                if data is not None:
                    page = pool.get_dummy_flat_data_page()
                    if _fill(page, data):
                        pool.set_from_flat_data_page(off, page)
                        good = True
                flags.append(good)
            return flags
        return self._per_pool(transfers, load)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Write each pool's pages (for SWA: the trailing window pages SGLang passes)."""
        def store(pool: Any, offsets: list[int], keys: list[bytes]) -> List[bool]:
            values = [_as_bytes(pool.get_data_page(off, flat=True)) for off in offsets]
            return [bool(x) for x in self.backend.put(keys, values)]
        return self._per_pool(transfers, store)

    # ------------------------------------------------------------ misc
    def clear(self) -> bool:
        """hybridkv backends have no bulk clear; stale entries age out by LRU/TTL."""
        logger.warning("hybridkv storage: clear() is not supported by %s; nothing removed", self.url)
        return False

    def get_stats(self) -> dict[str, int]:
        return self.backend.stats()

    def close(self) -> None:
        self.backend.close()
