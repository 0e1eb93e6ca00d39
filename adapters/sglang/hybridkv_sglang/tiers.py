"""hybridkv's lower tiers (L2 host, L3 storage) under ``--radix-cache-backend hybridkv``.

The core's :class:`~hybridkv.tiers.coordinator.TierCoordinator` does the tier
work (page keys, L2 index and eviction, the L3 queue and read-ahead, the
:class:`~hybridkv.tiers.backup.L2Backup` consistency repairs); this module
gives it SGLang's pages and bytes:

* :class:`SGLangTierPool`: what the coordinator calls on its L1 pool
  (``alloc``, ``shortfall``, ``free_full`` / ``free_swa`` of pages never handed
  to the tree, ``held_by_all``, ``groups``, ``buffers``) over SGLang's
  ``SWATokenToKVPoolAllocator`` (whole pages of its full and SWA
  sub-allocators; page id = token slot // page size);
* :func:`spec_from_pools`: the :class:`~hybridkv.spec.ModelSpec` of the host
  arena, read off SGLang's ``SWAKVPool`` (layer kinds in layer order, heads,
  head dims, dtype) plus the page size and window;
* :class:`SGLangTierCoordinator`: the coordinator whose ``copy`` moves pages
  between SGLang's per-layer device buffers (token slot = page * P + offset)
  and the host arena, plus the three calls the radix cache makes
  (:meth:`~hybridkv.tiers.coordinator.TierCoordinator.lower_hit_pages` at match,
  :meth:`~hybridkv.tiers.coordinator.TierCoordinator.before_match` at
  ``init_load_back``, :meth:`~SGLangTierCoordinator.checkpoint` before a
  checkpoint's insert);
* :class:`ReqShim`: the fields of :class:`hybridkv.request.Request` the
  coordinator's ``after_begin`` / ``before_finish`` read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridkv.lifecycle import TierPlan
from hybridkv.radix import PageNames
from hybridkv.spec import AttnKind, KVShape, ModelSpec
from hybridkv.tiers.config import L2Eviction, TierConfig
from hybridkv.tiers.coordinator import TierCoordinator

from .layer_loads import LayerLoads
from .pool import page_tokens

__all__ = ["ReqShim", "SGLangTierCoordinator", "SGLangTierPool", "spec_from_pools", "tiers_from_env"]

_EMPTY = np.zeros(0, dtype=np.int32)


def tiers_from_env(l2_bytes: int | None = None, write_policy: str | None = None) -> TierConfig | None:
    """The :class:`TierConfig` named by ``$HYBRIDKV_L2_BYTES`` (host bytes),
    ``$HYBRIDKV_L3`` (L3 URL, e.g. ``file:///path``), ``$HYBRIDKV_WRITE_POLICY``
    and ``$HYBRIDKV_L2_EVICTION`` (``own`` or ``tree``: :attr:`TierConfig.l2_eviction
    <hybridkv.tiers.config.TierConfig.l2_eviction>`); ``l2_bytes`` / ``write_policy`` (from SGLang's
    ``--hicache-*`` flags) are used where the variables are unset.  None when
    neither L2 bytes nor an L3 URL is given.  Raises ValueError naming the
    variable for a malformed value."""
    raw = os.environ.get("HYBRIDKV_L2_BYTES", "")
    if raw:
        try:
            l2_bytes = int(raw)
        except ValueError:
            raise ValueError(f"HYBRIDKV_L2_BYTES must be an int, got {raw!r}") from None
    l3 = os.environ.get("HYBRIDKV_L3") or None
    if l2_bytes is None and l3 is None:
        return None
    if l2_bytes is None:
        raise ValueError("HYBRIDKV_L3 needs an L2 size: set HYBRIDKV_L2_BYTES (or --hicache-size)")
    policy = os.environ.get("HYBRIDKV_WRITE_POLICY") or write_policy or "write_through"
    eviction = L2Eviction.parse(os.environ.get("HYBRIDKV_L2_EVICTION") or "own", "HYBRIDKV_L2_EVICTION")
    return TierConfig(l2_bytes=l2_bytes, l3=l3, write_policy=policy, l2_device="cpu", l2_eviction=eviction)


def spec_from_pools(kv_pool: Any, page_size: int, window: int, name: str = "sglang") -> ModelSpec:
    """ModelSpec of SGLang's ``SWAKVPool`` ``kv_pool`` (MHA pools only).  ``name``
    (part of every L2/L3 page key's fingerprint) tells apart models and ranks
    whose pools have the same shapes.

    Raises TypeError for a pool without ``layers_mapping`` / per-layer
    ``k_buffer`` lists (MLA/DSA pools), ValueError for a dtype hybridkv does
    not store (e.g. fp8 held as uint8) or layer ids with gaps.  O(layers)."""
    mapping = getattr(kv_pool, "layers_mapping", None)
    full, swa = getattr(kv_pool, "full_kv_pool", None), getattr(kv_pool, "swa_kv_pool", None)
    if not isinstance(mapping, dict) or not all(hasattr(p, "k_buffer") for p in (full, swa)):
        raise TypeError(f"kv_pool must be SGLang's SWAKVPool over MHA pools, got {type(kv_pool).__name__}")
    n = len(mapping)
    if sorted(mapping) != list(range(n)):
        raise ValueError(f"kv_pool.layers_mapping must cover layers 0..{n - 1}, got {sorted(mapping)}")
    kinds = tuple(AttnKind.SWA if mapping[i][1] else AttnKind.FULL for i in range(n))

    def shape(pool: Any) -> KVShape:
        k, v = pool.k_buffer[0], pool.v_buffer[0]
        return KVShape(int(k.shape[-2]), int(k.shape[-1]), int(v.shape[-1]))

    return ModelSpec(name=name, layer_kinds=kinds, window=int(window), full=shape(full), swa=shape(swa),
                     dtype=full.k_buffer[0].dtype, page_size=int(page_size))


def _check_host_spec(host: ModelSpec, pools: ModelSpec) -> None:
    """ValueError naming ``host_spec`` unless it can hold the pools' pages."""
    if not isinstance(host, ModelSpec):
        raise TypeError(f"host_spec must be a ModelSpec or None, got {type(host).__name__}")
    same = (host.page_size, host.window, host.full, host.swa, host.dtype)
    if same != (pools.page_size, pools.window, pools.full, pools.swa, pools.dtype):
        raise ValueError(f"host_spec must have the pools' page size, window, K/V shapes and dtype {same[:4]} != "
                         f"{(pools.page_size, pools.window, pools.full, pools.swa)}")
    for kind in (AttnKind.FULL, AttnKind.SWA):
        if len(host.layers(kind)) < len(pools.layers(kind)):
            raise ValueError(f"host_spec has {len(host.layers(kind))} {kind.value} layers, the pools "
                             f"{len(pools.layers(kind))}")


class SGLangTierPool:
    """The coordinator's L1 pool over SGLang's ``SWATokenToKVPoolAllocator``.

    Pages are whole pages of the full / SWA sub-allocators (ids = slot // P).
    One sliding window (``groups`` empty); no hybridkv arena (``buffers`` None:
    the coordinator's ``copy`` is overridden to reach SGLang's buffers).
    """

    groups: tuple = ()
    buffers = None

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.page_size = int(allocator.page_size)
        # pages given back here (a load that failed half way) drop their queued copies
        self.loads: LayerLoads | None = None

    def _pages(self, slots: torch.Tensor) -> np.ndarray:
        return (slots[::self.page_size] // self.page_size).cpu().numpy().astype(np.int32)

    def alloc(self, n_full: int, n_swa: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Whole pages in both sub-allocators, or None (nothing taken).  O(n)."""
        P, fa, sa = self.page_size, self.allocator.full_attn_allocator, self.allocator.swa_attn_allocator
        if n_full * P > fa.available_size() or n_swa * P > sa.available_size():
            return None
        full = fa.alloc(n_full * P) if n_full else None
        if n_full and full is None:
            return None
        swa = sa.alloc(n_swa * P) if n_swa else None
        if n_swa and swa is None:
            if full is not None:
                fa.free_page_ids(torch.as_tensor(self._pages(full), dtype=torch.int64))
            return None
        return (self._pages(full) if full is not None else _EMPTY,
                self._pages(swa) if swa is not None else _EMPTY)

    def shortfall(self, n_full: int, n_swa: int) -> tuple[int, int, int]:
        """Pages to evict before :meth:`alloc` can succeed (no shared byte budget)."""
        P = self.page_size
        fa, sa = self.allocator.full_attn_allocator, self.allocator.swa_attn_allocator
        return max(0, n_full - fa.available_size() // P), max(0, n_swa - sa.available_size() // P), 0

    def free_full(self, pages: np.ndarray) -> None:
        """Give back full pages never handed to the tree (their mapping cleared)."""
        if len(pages):
            ids = torch.as_tensor(np.asarray(pages, dtype=np.int64))
            slots = page_tokens(ids, self.page_size)
            self.allocator.full_to_swa_index_mapping.index_fill_(0, slots, 0)
            self.allocator.full_attn_allocator.free_page_ids(ids)
            if self.loads is not None:
                self.loads.drop(AttnKind.FULL, slots)

    def free_swa(self, pages: np.ndarray) -> None:
        """Give back SWA pages never handed to the tree."""
        if len(pages):
            ids = torch.as_tensor(np.asarray(pages, dtype=np.int64))
            self.allocator.swa_attn_allocator.free_page_ids(ids)
            if self.loads is not None:
                self.loads.drop(AttnKind.SWA, page_tokens(ids, self.page_size))

    @staticmethod
    def held_by_all(pages: np.ndarray) -> np.ndarray:
        """One sliding window: an SWA page is held wherever its id is >= 0."""
        return np.asarray(pages) >= 0


@dataclass
class ReqShim:
    """The :class:`hybridkv.request.Request` fields the coordinator reads."""

    tokens: np.ndarray
    namespace: str
    computed: int = 0
    tree_pages: int = 0
    full_pages: np.ndarray = field(default_factory=lambda: _EMPTY)
    swa_pages: np.ndarray = field(default_factory=lambda: _EMPTY)
    side_pages: None = None  # one sliding window: no side groups
    prefix_len: int = 0
    extra: dict = field(default_factory=dict)


class SGLangTierCoordinator(TierCoordinator):
    """A :class:`TierCoordinator` whose L1 is SGLang's SWA pools.

    Args:
        allocator: SGLang's ``SWATokenToKVPoolAllocator`` (its ``get_kvcache()``
            is the ``SWAKVPool`` whose buffers L1 pages live in).
        tree: the radix cache's :class:`~hybridkv.radix.WindowSafeTree`.
        window: the tree's window in tokens.
        tiers: the :class:`TierConfig` (``l2_device="cpu"`` keeps real bytes in L2).
        scope: the model and shard (e.g. model path, TP/PP rank) in the page keys'
            fingerprint: ranks and models sharing one L3 never read each other's KV.
        host_spec: the spec L2 lays out and prices pages by (default: the pools'
            own, :func:`spec_from_pools`).  It must have the pools' page size,
            window, dtype and K/V shapes and at least their layers of each kind;
            extra layers hold no bytes (a benchmark prices pages like a larger
            model this way).
    """

    def __init__(self, allocator: Any, tree: Any, window: int, tiers: TierConfig, scope: str = "sglang",
                 host_spec: ModelSpec | None = None) -> None:
        if not isinstance(tiers, TierConfig):
            raise TypeError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        if tiers.l2_device not in (None, "cpu"):
            raise ValueError(f"tiers.l2_device must be 'cpu' under SGLang (real host bytes), got {tiers.l2_device!r}")
        if tiers.l2_device is None:
            tiers = TierConfig(**{**tiers.__dict__, "l2_device": "cpu"})
        self.kv = allocator.get_kvcache()
        if not isinstance(scope, str) or not scope:
            raise TypeError(f"scope must be a non-empty str, got {scope!r}")
        spec = spec_from_pools(self.kv, allocator.page_size, window, name=scope)
        self.pool_spec = spec
        if host_spec is not None:
            _check_host_spec(host_spec, spec)
            spec = host_spec
        super().__init__(spec, tree, SGLangTierPool(allocator), tiers)
        # set by the radix cache when SGLang's layer hooks wait for loads (else
        # host -> device copies run inside ``init_load_back``)
        self.layer_loads: LayerLoads | None = None

    # ============================================================ bytes
    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        return page_tokens(np.asarray(pages, dtype=np.int64), self.page_size)

    def copy(self, kind: AttnKind, src: Any, src_pages: np.ndarray, dst: Any, dst_pages: np.ndarray) -> None:
        """Pages of ``kind`` between SGLang's device buffers (``src`` or ``dst`` is
        ``self.pool``) and the host arena (``self.host.pool``), layer by layer.
        O(pages * page_size * layers)."""
        if len(src_pages) == 0:
            return
        host = self.host.pool.buffers.of(kind)
        dev = self.kv.full_kv_pool if kind is AttnKind.FULL else self.kv.swa_kv_pool
        d2h = src is self.pool
        s_slots, d_slots = self._slots(src_pages), self._slots(dst_pages)
        loads = self.layer_loads
        if loads is not None:
            if not d2h:  # read out now, issued layer by layer when the batch runs
                loads.queue(kind, [host.read(i, s_slots.numpy()) for i in range(len(self.pool_spec.layers(kind)))],
                            d_slots)
                return
            loads.flush()  # never read a device page whose load is still queued
        # the i-th pool layer of a kind is the host arena's i-th layer of that kind
        for i, layer in enumerate(self.pool_spec.layers(kind)):
            local = self.kv.layers_mapping[layer][0]
            kb, vb = dev.k_buffer[local], dev.v_buffer[local]
            if d2h:
                host.write(i, d_slots.numpy(), kb[s_slots.to(kb.device)], vb[s_slots.to(vb.device)])
            else:
                k, v = host.read(i, s_slots.numpy())
                idx = d_slots.to(kb.device)
                kb[idx] = k.to(device=kb.device, dtype=kb.dtype)
                vb[idx] = v.to(device=vb.device, dtype=vb.dtype)

    # ============================================================ the cache's calls
    def account_hit(self, tokens: np.ndarray, namespace: str, hit_pages: int, swa_pages: np.ndarray,
                    plan: TierPlan | None) -> dict:
        """The request's hit is locked and admitted: per-tier hit figures, L3
        touches of the served keys (repair 3), the hit's window anchored (repair
        4).  Returns the request's ``extra`` (page keys, tier figures) for
        :meth:`checkpoint`.  O(hit pages)."""
        P = self.page_size
        keys = plan.keys if plan is not None else self.prompt_keys(tokens, namespace, hit_pages)
        origin = plan.origin if plan is not None else np.zeros(0, dtype=np.int8)
        shim = ReqShim(tokens=tokens, namespace=namespace, prefix_len=hit_pages * P, swa_pages=swa_pages)
        self.after_begin(shim, TierPlan(keys, origin))
        # counted at admission (the core counts at a cached finish): SGLang may never
        # checkpoint new pages of a request whose hit covers its prompt
        for k, v in shim.extra.pop("tiers", {}).items():
            self.counters[k] += v
        return shim.extra

    def checkpoint(self, tokens: np.ndarray, namespace: str, tree_pages: int, full: np.ndarray,
                   swa: np.ndarray, extra: dict) -> PageNames | None:
        """Before a checkpoint's insert of pages ``[tree_pages, len(full))``: copy
        to L2 what the write policy asks (write-through; repair 1) and return the
        pages' names for the insert (the tree keeps them; write-back copies a page
        under its name when the tree frees it).  Never raises for tier faults
        (None).  O(pages)."""
        n = len(full)
        shim = ReqShim(tokens=tokens[:n * self.page_size], namespace=namespace, computed=n * self.page_size,
                       tree_pages=tree_pages, full_pages=full, swa_pages=swa, extra=extra)
        names = self.before_finish(shim)
        keys = extra.get("page_keys")
        if keys is not None and len(keys) < n:
            extra["page_keys"] = self.page_keys(shim.tokens, namespace, n, keys)
        return names
