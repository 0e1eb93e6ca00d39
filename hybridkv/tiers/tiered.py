"""TieredCache: L1 device tree + L2 host tier + L3 storage behind one facade.

A :class:`TieredCache` is a :class:`~hybridkv.cache.HybridKVCache` that owns a
:class:`~hybridkv.tiers.coordinator.TierCoordinator` (its ``lower_tiers``):
the L1 tree stays device-only and decides L1 hits and evictions, the
coordinator sits beside it, is called by the cache at the documented points
of ``begin`` and ``finish`` and hears the tree's page frees.  L2
(:class:`.HostTier`) and L3 (a :class:`~hybridkv.tiers.storage.StorageBackend`
behind a :class:`.TierManager`) are indexed by chained page keys: full KV
under ``page_keys(tokens, P, namespace, ModelSpec.fingerprint())``, SWA KV
under :func:`.swa_key` of the same key.

**Match across tiers** (:meth:`TieredCache.begin`): page ``i`` has full KV if
L1, L2 or L3 holds it, SWA if L1, L2 or L3 holds it; the hit is the largest
page-aligned ``L`` with full KV for ``[0, L)`` and SWA for the window before
``L``.  Pages only L3 holds are fetched L3 -> L2 by a read-ahead job on the L3
read worker (:meth:`TieredCache.prefetch` starts the same job ahead of
scheduling); ``begin`` waits for it at most ``l3_timeout_s`` in total, without
holding the tiers' lock, then loads L2 -> L1 and inserts into the L1 tree, and
the hit is recomputed from what is *actually* resident: an L3 value that
vanished, timed out or failed verification is a miss, never garbage.  The
ordinary L1 match + lock then runs on the repaired tree, so locking and
window safety stay the tree's business.

**Write policies** (``TierConfig.write_policy``): ``"write_through"`` copies a
request's pages to L2 when it finishes (prefill end); ``"write_back"`` copies
a page to L2 only when the L1 tree frees it (the tree calls its
``free_listeners`` before a page returns to the pool).  Pages entering L2 are
queued for an asynchronous L3 write.

**Consistency repair** (the MiMo stack's four cases):

1. device has SWA the host lacks: backed up D2H at prefill end (both policies);
2. host has SWA the device lacks: copied H2D and adopted by the L1 tree at the
   next load that needs that window (the tree's insert adopts missing SWA);
3. prefixes served from L1/L2 touch their L3 keys (rate-limited), so L3's own
   LRU/TTL keeps hot prefixes;
4. retention checkpoints apply below L1 too: SWA pages that end a sequence
   (tail window) or a checkpoint window are *anchored*; L2 evicts unanchored
   SWA first and L3 receives only anchored SWA (``l3_swa="anchored"``).  The
   window that ends a *hit* is a proven branch point: at ``begin`` it is
   anchored in the L1 tree's names and in L2 and queued for L3 if L3 lacks it
   (otherwise a window first stored as plain, e.g. a shared system prompt
   that is no request's tail, would never reach L3 under write-through).

Faults never raise into the engine: storage faults are misses (the backend
layer), and any unexpected error in the tier path is logged, counted in
``tier_errors`` and degrades to the L1-only answer.
"""

from __future__ import annotations

import numpy as np

from ..cache import CacheConfig, HybridKVCache
from ..spec import ModelSpec
from .config import PageOrigin, TierConfig
from .coordinator import TierCoordinator
from .reads import PrefetchHandle

__all__ = ["PageOrigin", "PrefetchHandle", "TierConfig", "TieredCache"]


class TieredCache(HybridKVCache):
    """A :class:`HybridKVCache` whose hits also come from L2 (host) and L3 (storage).

    Same request API as :class:`HybridKVCache`; ``begin`` may load pages from
    lower tiers into L1 first.  Per-request tier figures land in
    ``req.extra["tiers"]``, totals in :meth:`stats`.  Call :meth:`close` at the end.

    Attributes: ``tiers`` (the :class:`TierConfig`), ``coordinator`` (the
    :class:`~hybridkv.tiers.coordinator.TierCoordinator`, also the cache's
    ``lower_tiers``, its :class:`~hybridkv.lifecycle.TierHooks`) and, from it, ``host``
    (L2), ``l3`` (the :class:`.TierManager` or None), ``codec`` and
    ``tier_counters``.
    """

    def __init__(self, spec: ModelSpec, config: CacheConfig | None = None, *,
                 tiers: TierConfig) -> None:
        if not isinstance(tiers, TierConfig):
            raise TypeError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        super().__init__(spec, config)
        self.tiers = tiers
        coordinator = TierCoordinator(self.spec, self.tree, self.pool, tiers)
        self.lower_tiers = coordinator  # the lifecycle's TierHooks
        self.coordinator = coordinator  # the same, with its whole interface
        self.host = coordinator.host
        self.l3 = coordinator.l3
        self.codec = coordinator.codec
        self.tier_counters = coordinator.counters
        self._mutex = coordinator.mutex  # the tiers' lock: the L3 workers land pages under it
        self._backend = coordinator.backend

    def _page_keys(self, tokens: np.ndarray, namespace: str, n_pages: int,
                   have: list[bytes] | None = None) -> list[bytes]:
        """L2/L3 keys of the first ``n_pages`` pages of ``tokens``.  O(new pages)."""
        return self.coordinator.page_keys(tokens, namespace, n_pages, have)

    def prefetch(self, tokens: object, namespace: str = "default") -> PrefetchHandle:
        """Start loading into L2 the L3 pages a later :meth:`begin` of ``tokens`` would use.

        Never blocks on L3: the reads run on the L3 read worker and the pages
        land in L2 while the request waits in the engine's queue; ``begin``
        then serves them like any L2 page.  Returns a :class:`PrefetchHandle`
        (already done when there is nothing to fetch, no L3, or the read
        breaker is open).  Raises only for bad arguments.  Runtime on the
        caller: hashing of the pages past the L1 match and one L1/L2 lookup per page.
        """
        return self.coordinator.prefetch(tokens, namespace)

    def clear_l2(self) -> int:
        """Drop every L2 page (as a host restart would), under the tiers' lock;
        listeners hear the removals.  Returns pages dropped.  O(pages)."""
        return self.coordinator.clear_l2()

    @property
    def key_fingerprint(self) -> str:
        """Fingerprint in this cache's L2/L3 page keys (a KV-event publisher of its
        tier events must hash L1 pages with the same one)."""
        return self.coordinator.fingerprint

    def l3_last_error(self) -> str | None:
        """The L3 backend's last fault in one line (why reads/writes failed), or None."""
        return self.coordinator.l3_last_error()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued L3 writes/touches; False on timeout (or True without L3)."""
        return self.coordinator.flush(timeout_s)

    def close(self) -> None:
        """Stop the L3 worker (after draining) and close a backend opened from a URL."""
        self.coordinator.close()
