"""TieredCache: L1 device tree + L2 host tier + L3 storage behind one facade.

The L1 tree (the :class:`~hybridkv.cache.HybridKVCache` it extends) stays
device-only and decides L1 hits and evictions.  L2 (:class:`.HostTier`) and
L3 (a :class:`~hybridkv.tiers.storage.StorageBackend` behind a
:class:`.TierManager`) are indexed by chained page keys: full KV under
``page_keys(tokens, P, namespace, ModelSpec.fingerprint())``, SWA KV under
:func:`.swa_key` of the same key.

**Match across tiers** (:meth:`TieredCache.begin`): page ``i`` has full KV if
L1, L2 or L3 holds it, SWA if L1, L2 or L3 holds it; the hit is the largest
page-aligned ``L`` with full KV for ``[0, L)`` and SWA for the window before
``L``.  Pages only L3 holds are fetched L3 -> L2 by a job on the L3 read
worker (:meth:`TieredCache.prefetch` starts the same job ahead of scheduling);
``begin`` waits for it at most ``l3_timeout_s`` in total, without holding the
cache's lock, then loads L2 -> L1 and inserts into the L1 tree, and the hit is
recomputed from what is *actually* resident: an L3 value that vanished, timed
out or failed verification is a miss, never garbage.  The ordinary L1 match +
lock then runs on the repaired tree, so locking and window safety stay the
tree's business.

**Write policies** (``TierConfig.write_policy``): ``"write_through"`` copies a
request's pages to L2 when it finishes (prefill end); ``"write_back"`` copies
a page to L2 only when the L1 tree frees it: the tree's pool is wrapped so
every page it frees is backed up *before* it returns to the allocator (the
tree frees through ``pool.free_*`` only).  Pages entering L2 are queued for an
asynchronous L3 write.

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
   anchored in L1's registration and in L2 and queued for L3 if L3 lacks it
   (otherwise a window first stored as plain, e.g. a shared system prompt
   that is no request's tail, would never reach L3 under write-through).

Faults never raise into the engine: storage faults are misses (the backend
layer), and any unexpected error in the tier path is logged, counted in
``tier_errors`` and degrades to the L1-only answer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._validate import as_token_array
from ..cache import CacheConfig, HybridKVCache, Request
from ..radix import LockHandle, window_safe_pages
from ..radix.node import NO_PAGE, TreeNode
from ..spec import AttnKind, ModelSpec
from ..transfer import copy_pages
from .host import HostTier
from .keys import page_keys
from .manager import TierManager
from .payload import PayloadCodec, RealPayload, ScaledPayload, swa_key
from .storage import StorageBackend, open_backend

__all__ = ["TierConfig", "TieredCache", "PrefetchHandle"]

logger = logging.getLogger("hybridkv.tiers")
_EMPTY = np.zeros(0, dtype=np.int32)
_POLICIES = ("write_through", "write_back")
_COUNTERS = ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "bytes_d2h", "bytes_h2d",
             "bytes_l3_read", "bytes_l3_written", "l2_to_l1_full_pages", "l2_to_l1_swa_pages",
             "l1_to_l2_full_pages", "l1_to_l2_swa_pages", "l3_to_l2_full_pages", "l3_to_l2_swa_pages",
             "l3_clamped_pages", "repair_swa_d2h_pages", "repair_swa_h2d_pages", "l2_store_failed",
             "l1_load_failed", "tier_errors", "l3_preexisting_hit_tokens")


@dataclass(frozen=True)
class TierConfig:
    """Lower tiers of a :class:`TieredCache`.

    Attributes:
        l2_bytes: host (L2) budget in bytes for both kinds (> 0).
        l3: L3 backend URL (see :func:`~hybridkv.tiers.storage.open_backend`),
            a backend object, or None (no L3).
        write_policy: ``"write_through"`` or ``"write_back"`` (L1 -> L2).
        l2_device: host buffer device; None picks ``"cpu"`` when L1 holds
            real KV and ``"meta"`` (accounting only) when L1 is ``"meta"``.
        l3_timeout_s: the most :meth:`TieredCache.begin` waits for L3 in total
            (the fetch runs on the L3 read worker, never under the cache's
            mutex; what has not arrived in L2 by then is a miss).  A read
            slower than this counts as a failure for the read breaker.
        l3_read_breaker: ``(failures, cooldown_s)``: after that many failed or
            late L3 reads in a row, reads are skipped (misses, no waiting) for
            ``cooldown_s``; then one probe read goes out, not waited for.
        touch_interval_s: minimum seconds between two L3 touches of a key.
        max_queued_writes: pending L3 write pages before writes are dropped.
        l3_swa: ``"anchored"`` (tails and checkpoint windows only) or ``"all"``.
    """

    l2_bytes: int
    l3: Any = None
    write_policy: str = "write_through"
    l2_device: str | None = None
    l3_timeout_s: float = 5.0
    touch_interval_s: float = 30.0
    max_queued_writes: int = 65536
    l3_swa: str = "anchored"
    l3_read_breaker: tuple = (3, 5.0)

    def __post_init__(self) -> None:
        if not isinstance(self.l2_bytes, (int, np.integer)) or isinstance(self.l2_bytes, bool):
            raise TypeError(f"l2_bytes must be an int, got {type(self.l2_bytes).__name__}")
        if self.l2_bytes <= 0:
            raise ValueError(f"l2_bytes must be > 0, got {self.l2_bytes}")
        if self.write_policy not in _POLICIES:
            raise ValueError(f"write_policy must be one of {_POLICIES}, got {self.write_policy!r}")
        if self.l3_swa not in ("anchored", "all"):
            raise ValueError(f"l3_swa must be 'anchored' or 'all', got {self.l3_swa!r}")
        rb = self.l3_read_breaker
        if (not isinstance(rb, tuple) or len(rb) != 2 or not isinstance(rb[0], int) or rb[0] < 1
                or not isinstance(rb[1], (int, float)) or rb[1] < 0):
            raise ValueError(f"l3_read_breaker must be (failures >= 1, cooldown_s >= 0), got {rb!r}")
        if self.l3_timeout_s <= 0:
            raise ValueError(f"l3_timeout_s must be > 0, got {self.l3_timeout_s}")
        if self.l3 is not None and not isinstance(self.l3, (str, StorageBackend)):
            raise TypeError(f"l3 must be a URL, a StorageBackend or None, got {type(self.l3).__name__}")


class PrefetchHandle:
    """L3 -> L2 loads started by :meth:`TieredCache.prefetch` (or a ``begin``)."""

    def __init__(self, futures: list[Future] | tuple = ()) -> None:
        self._futures = [f for f in futures if f is not None]

    def done(self) -> bool:
        """Whether every load finished (landed in L2 or failed as a miss)."""
        return all(f.done() for f in self._futures)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: forever); True if everything finished."""
        if not self._futures:
            return True
        _, pending = concurrent.futures.wait(self._futures, timeout=timeout_s)
        return not pending


class _PendingWrite:
    """An L3 write whose values are encoded later from L2 pages (see ``_queue_l3``)."""

    __slots__ = ("kind", "keys", "pages", "values")

    def __init__(self, kind: AttnKind, keys: list[bytes], pages: np.ndarray) -> None:
        self.kind, self.keys, self.pages = kind, keys, pages
        self.values: list[Any] = [None] * len(keys)


class TieredCache(HybridKVCache):
    """A :class:`HybridKVCache` whose hits also come from L2 (host) and L3 (storage).

    Same request API as :class:`HybridKVCache`; ``begin`` may load pages from
    lower tiers into L1 first.  Per-request tier figures land in
    ``req.extra["tiers"]``, totals in :meth:`stats`.  Call :meth:`close` at the end.
    """

    def __init__(self, spec: ModelSpec, config: CacheConfig | None = None, *,
                 tiers: TierConfig) -> None:
        if not isinstance(tiers, TierConfig):
            raise TypeError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        super().__init__(spec, config)
        real = self.pool.buffers is not None and self.pool.buffers.device.type != "meta"
        l2_device = tiers.l2_device or ("cpu" if real else "meta")
        self.tiers = tiers
        self.host = HostTier(spec, int(tiers.l2_bytes), device=l2_device)
        self.codec: PayloadCodec = (RealPayload(spec, self.host.pool.buffers)
                                    if self.host.pool.buffers is not None
                                    and self.host.pool.buffers.device.type == "cpu"
                                    else ScaledPayload(spec))
        self._backend: StorageBackend | None = None
        self._owns_backend = False
        if isinstance(tiers.l3, str):
            self._backend = open_backend(tiers.l3)
            self._owns_backend = True
        elif tiers.l3 is not None:
            self._backend = tiers.l3
        self.l3 = (TierManager(self._backend, timeout_s=tiers.l3_timeout_s,
                               max_queued_writes=tiers.max_queued_writes,
                               touch_interval_s=tiers.touch_interval_s,
                               read_breaker=tiers.l3_read_breaker)
                   if self._backend is not None else None)
        self._fingerprint = spec.fingerprint()
        self._l1_full_key: dict[int, bytes] = {}                 # L1 full page -> page key
        self._l1_swa_key: dict[int, tuple[bytes, bool]] = {}     # L1 SWA page -> (page key, anchored)
        self._protect: tuple[set[int], set[int]] = (set(), set())  # L2 pages a load reads
        self._l3_known: set[bytes] = set()                        # keys written to / read from L3
        self._inflight: dict[bytes, Future] = {}                  # L3 key -> fetch job loading it
        self._landed: OrderedDict[bytes, bool] = OrderedDict()    # full keys L3 put in L2, not yet served
        #                                                           (-> whether the data predates this cache)
        self._l3_mine: set[bytes] = set()                          # keys this cache queued for L3
        self._l3_mine_overflow = False                             # too many to tell what predates us
        self._mutex = threading.RLock()
        self._stream = (torch.cuda.Stream(device=self.pool.buffers.device)
                        if real and self.pool.buffers.device.type == "cuda" else None)
        self.tier_counters = dict.fromkeys(_COUNTERS, 0)
        self.tree.free_listeners.append(self._on_l1_free)  # back L1 pages up to L2 before they go
        self._pending_l3: dict[tuple[AttnKind, int], tuple[_PendingWrite, int]] = {}  # L2 page -> queued write
        self._unwritten: dict[bytes, tuple[_PendingWrite, int]] = {}  # L3 key -> queued write not yet put
        self.host.free_listeners.append(self._l2_freeing)  # encode queued L3 writes before L2 reuses a page

    # ================================================================= keys
    def _page_keys(self, tokens: np.ndarray, namespace: str, n_pages: int,
                   have: list[bytes] | None = None) -> list[bytes]:
        """Keys of the first ``n_pages`` pages, extending ``have`` when given.  O(new pages)."""
        have = have or []
        if n_pages <= len(have):
            return have[:n_pages]
        P = self.page_size
        more = page_keys(tokens[len(have) * P:n_pages * P], P, namespace=namespace,
                         fingerprint=self._fingerprint, parent=have[-1] if have else None)
        return have + more

    # ================================================================ begin
    def _check_prompt(self, tokens: object, namespace: str) -> np.ndarray:
        tokens = as_token_array(tokens)
        if len(tokens) == 0:
            raise ValueError("tokens must not be empty")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        return tokens

    def prefetch(self, tokens: object, namespace: str = "default") -> PrefetchHandle:
        """Start loading into L2 the L3 pages a later :meth:`begin` of ``tokens`` would use.

        Never blocks on L3: the reads run on the L3 read worker and the pages
        land in L2 while the request waits in the engine's queue; ``begin``
        then serves them like any L2 page.  Returns a :class:`PrefetchHandle`
        (already done when there is nothing to fetch, no L3, or the read
        breaker is open).  Raises only for bad arguments.  Runtime on the
        caller: key hashing O(L) and one L1/L2 lookup per page.
        """
        tokens = self._check_prompt(tokens, namespace)
        keys = self._page_keys(tokens, namespace, (len(tokens) - 1) // self.page_size)
        try:
            return self._start_fetch(tokens, namespace, keys)[0]
        except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
            self.tier_counters["tier_errors"] += 1
            logger.warning("L3 prefetch failed (%s: %s)", type(exc).__name__, exc)
            return PrefetchHandle()

    def begin(self, tokens: object, namespace: str = "default", rid: Any = None) -> Request:
        """Match across L1/L2/L3, load what L1 lacks, then lock the hit in L1.

        Returns the :class:`Request` (``prefix_len`` = the hit).  Raises only
        for bad arguments (like :meth:`HybridKVCache.begin`).  Pages only L3
        holds are fetched into L2 in the background (see :meth:`prefetch`);
        ``begin`` waits for them at most ``TierConfig.l3_timeout_s`` in total,
        without holding the cache's mutex, and serves what is in L1/L2 then
        (not at all while the read breaker is open).  Runtime: key hashing
        O(L), one L2 lookup per page, the wait, the copies of loaded pages.
        """
        tokens = self._check_prompt(tokens, namespace)
        n = (len(tokens) - 1) // self.page_size
        keys = self._page_keys(tokens, namespace, n)
        origin = np.zeros(n, dtype=np.int8)
        if self.l3 is not None and n:
            try:
                handle, probe = self._start_fetch(tokens, namespace, keys)
                budget = self.tiers.l3_timeout_s
                if not probe and not handle.wait(budget):  # the mutex is not held here
                    self.l3.timed_out(budget)
            except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
                self.tier_counters["tier_errors"] += 1
                logger.warning("L3 fetch failed (%s: %s); serving from L1/L2", type(exc).__name__, exc)
        try:
            with self._mutex:
                origin = self._load(tokens, namespace, keys)
        except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
            self.tier_counters["tier_errors"] += 1
            logger.warning("tiered load failed (%s: %s); serving from L1 only", type(exc).__name__, exc)
        req = super().begin(tokens, namespace, rid)
        req.extra["page_keys"] = keys
        self._account(req, keys, origin)
        return req

    def _l1_path(self, tokens: np.ndarray, namespace: str, limit: int
                 ) -> tuple[np.ndarray, np.ndarray, TreeNode | None]:
        """Full and SWA page ids of the raw (not window-safe) L1 token match."""
        _, path = self.tree.walk(tokens, namespace, limit)
        if not path:
            return _EMPTY, _EMPTY, None
        full = np.concatenate([nd.full[:k] for nd, k in path])
        swa = np.concatenate([nd.swa[:k] for nd, k in path])
        return full, swa, path[-1][0]

    def _resident(self, tokens: np.ndarray, namespace: str, keys: list[bytes]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple]:
        """Where pages are in L1/L2: full origin (1 = L1, 2 = L2, 0 = neither), SWA
        source (same codes), L2 pages of both (-1 = absent) and the L1 path.  Under the mutex."""
        n = len(keys)
        origin = np.zeros(n, dtype=np.int8)
        l1_full, l1_swa, deepest = self._l1_path(tokens, namespace, n * self.page_size)
        n1 = len(l1_full)
        origin[:n1] = 1
        h_full = np.full(n, -1, dtype=np.int64)
        h_full[n1:] = self.host.lookup_full(keys[n1:])
        origin[n1:][h_full[n1:] >= 0] = 2
        swa_src = np.zeros(n, dtype=np.int8)
        swa_src[:n1][l1_swa >= 0] = 1
        need = np.flatnonzero(swa_src == 0)
        h_swa = np.full(n, -1, dtype=np.int64)
        if need.size:
            h_swa[need] = self.host.lookup_swa([swa_key(keys[i]) for i in need.tolist()])
            swa_src[need[h_swa[need] >= 0]] = 2
        return origin, swa_src, h_full, h_swa, (l1_full, l1_swa, deepest)

    def _start_fetch(self, tokens: np.ndarray, namespace: str, keys: list[bytes]
                     ) -> tuple[PrefetchHandle, bool]:
        """Queue an L3 -> L2 fetch of what L1/L2 lack for ``keys`` (unless in flight).

        Returns the handle over this and overlapping in-flight fetches, and
        whether the new fetch is the read breaker's probe (not to be waited for).
        """
        n = len(keys)
        if self.l3 is None or n == 0:
            return PrefetchHandle(), False
        wp = self.spec.window_pages
        with self._mutex:
            origin, swa_src, _, _, _ = self._resident(tokens, namespace, keys)
            have_f, have_s = origin > 0, swa_src > 0
            F = _prefix_true(have_f)
            if F == n and _window_safe(have_s, wp) == n:
                return PrefetchHandle(), False  # all of it is in L1/L2
            cand_f = np.arange(F, n)[~have_f[F:]]
            cand_s = np.flatnonzero(~have_s)
            fkeys = [keys[i] for i in cand_f.tolist()]
            skeys = [swa_key(keys[i]) for i in cand_s.tolist()]
            waits = {id(f): f for f in (self._inflight.get(k) for k in fkeys + skeys) if f is not None}
            if self.l3.read_breaker.state != "closed":
                waits = {}  # L3 is failing: do not wait for reads already in flight either
            new_f = np.array([k not in self._inflight for k in fkeys], dtype=bool)
            new_s = np.array([k not in self._inflight for k in skeys], dtype=bool)
            if not new_f.any() and not new_s.any():
                return PrefetchHandle(list(waits.values())), False
            gate = self.l3.read_gate()  # claims the breaker's probe slot when half-open
            if gate is None:
                self.l3.count("l3_reads_skipped")
                return PrefetchHandle(list(waits.values())), False
            mine = [k for k, o in zip(fkeys, new_f) if o] + [k for k, o in zip(skeys, new_s) if o]
            box: dict[str, Future] = {}

            def job() -> None:
                try:
                    self._fetch_job(keys, have_f, have_s, cand_f, cand_s, fkeys, skeys)
                finally:
                    with self._mutex:  # registration below finished before this lock was free
                        fut = box.get("fut")
                        for k in mine:
                            if self._inflight.get(k) is fut:
                                del self._inflight[k]

            fut = self.l3.submit_read(job, gated=False)
            if fut is None:  # closed or the read queue is full
                if gate == "probe":
                    self.l3.read_breaker.record_failure()  # give the probe slot back (re-opens)
                return PrefetchHandle(list(waits.values())), False
            box["fut"] = fut
            for k in mine:
                self._inflight[k] = fut
            waits[id(fut)] = fut
        return PrefetchHandle(list(waits.values())), gate == "probe"

    def _fetch_job(self, keys: list[bytes], have_f: np.ndarray, have_s: np.ndarray, cand_f: np.ndarray,
                   cand_s: np.ndarray, fkeys: list[bytes], skeys: list[bytes]) -> None:
        """On the L3 read worker: which candidates L3 holds, plan the hit, read the
        pages of the plan, land them in L2 (under the mutex)."""
        assert self.l3 is not None
        wp = self.spec.window_pages
        allk = fkeys + skeys
        with self._mutex:  # values of queued writes not yet put (encoded when L2 freed their page)
            queued = {}
            for k in allk:
                e = self._unwritten.get(k)
                if e is not None and e[0].values[e[1]] is not None:
                    queued[k] = e[0].values[e[1]]
        ask = [k for k in allk if k not in queued]
        got = dict(zip(ask, self.l3.backend_exists(ask)))
        there = np.fromiter((k in queued or bool(got[k]) for k in allk), dtype=bool, count=len(allk))
        ok_f, ok_s = have_f.copy(), have_s.copy()
        ok_f[cand_f[there[:len(fkeys)]]] = True
        ok_s[cand_s[there[len(fkeys):]]] = True
        F = _prefix_true(ok_f)
        L = _window_safe(ok_s[:F], wp)
        lo = max(0, L - wp)
        sel_f = there[:len(fkeys)] & (cand_f < L)
        sel_s = there[len(fkeys):] & (cand_s >= lo) & (cand_s < L)
        if not sel_f.any() and not sel_s.any():
            return
        fi, si = cand_f[sel_f], cand_s[sel_s]
        gk = [k for k, o in zip(fkeys, sel_f) if o]
        gs = [k for k, o in zip(skeys, sel_s) if o]
        ask = [k for k in gk + gs if k not in queued]
        read = dict(zip(ask, self.l3.backend_get(ask)))
        values = [queued[k] if k in queued else read[k] for k in gk + gs]
        try:
            with self._mutex:
                self._land(keys, fi, si, gk, gs, values, L, lo)
        except Exception as exc:  # noqa: BLE001 - a bad page is a miss, never a failed request
            self.tier_counters["tier_errors"] += 1
            logger.warning("landing L3 pages in L2 failed (%s: %s); treated as a miss", type(exc).__name__, exc)

    def _land(self, keys: list[bytes], fi: np.ndarray, si: np.ndarray, fkeys: list[bytes], sk: list[bytes],
              values: list[Any], L: int, lo: int) -> None:
        """Decode L3 values into new L2 pages and index them (under the mutex).

        Pages of the planned hit already in L2 are protected from the L2
        eviction this allocation may cause.
        """
        assert self.l3 is not None
        hf = self.host.lookup_full(keys[:L])
        hs = self.host.lookup_swa([swa_key(k) for k in keys[lo:L]])
        got = self.host.alloc(fi.size, si.size, protect=hf[hf >= 0].tolist(), protect_swa=hs[hs >= 0].tolist())
        ok_f = np.zeros(fi.size, dtype=bool)
        ok_s = np.zeros(si.size, dtype=bool)
        if got is not None:
            pf, ps = got
            try:
                ok_f = np.asarray(self.codec.decode(AttnKind.FULL, fkeys, values[:fi.size], pf), dtype=bool)
                ok_s = np.asarray(self.codec.decode(AttnKind.SWA, sk, values[fi.size:], ps), dtype=bool)
            except BaseException:
                self.host.free(pf, ps)  # nothing was indexed yet: the host pages go back
                raise
            self.host.insert_full([k for k, o in zip(fkeys, ok_f) if o], pf[ok_f])
            self.host.insert_swa([k for k, o in zip(sk, ok_s) if o], ps[ok_s], np.ones(int(ok_s.sum()), bool),
                                 [keys[int(i)] for i in si[ok_s]])
            self.host.free(pf[~ok_f], ps[~ok_s])
            landed = [k for k, o in zip(fkeys, ok_f) if o]
            self._l3_known.update(landed)
            self._l3_known.update(k for k, o in zip(sk, ok_s) if o)
            mine, unknown = self._l3_mine, self._l3_mine_overflow
            for k in landed:
                self._landed[k] = not unknown and k not in mine  # written before this cache existed
            while len(self._landed) > 1_000_000:  # bounded (only the L3 hit attribution suffers)
                self._landed.popitem(last=False)
        else:
            self.tier_counters["l2_store_failed"] += fi.size + si.size
        c = self.tier_counters
        c["l3_to_l2_full_pages"] += int(ok_f.sum())
        c["l3_to_l2_swa_pages"] += int(ok_s.sum())
        c["bytes_l3_read"] += (int(ok_f.sum()) * self.codec.nominal_bytes(AttnKind.FULL)
                               + int(ok_s.sum()) * self.codec.nominal_bytes(AttnKind.SWA))
        c["l3_clamped_pages"] += int((~ok_f).sum() + (~ok_s).sum())
        if got is not None:  # a read that missed: L3 lost (evicted) or never finished those pages
            self.l3.lost([k for k, o in zip(fkeys, ok_f) if not o])
            self.l3.lost([keys[int(i)] for i in si[~ok_s]], swa=True)
            self._l3_known.difference_update(k for k, o in zip(fkeys + sk, np.concatenate([ok_f, ok_s])) if not o)

    def _load(self, tokens: np.ndarray, namespace: str, keys: list[bytes]) -> np.ndarray:
        """Make the L1/L2 hit resident in L1 (under the mutex); returns per-page origin
        of full KV (1 = L1, 2 = L2, 3 = landed in L2 from L3, 4 = the same
        from data older than this cache, 0 = none) over the hit."""
        n = len(keys)
        if n == 0:
            return np.zeros(0, dtype=np.int8)
        wp = self.spec.window_pages
        origin, swa_src, h_full, h_swa, (l1_full, l1_swa, deepest) = self._resident(tokens, namespace, keys)
        F = _prefix_true(origin > 0)
        origin[F:] = 0
        L = _window_safe(swa_src[:F] > 0, wp)
        if L == 0:
            return origin[:0]
        lo = max(0, L - wp)
        self._to_l1(tokens, namespace, keys, origin, swa_src, h_full, h_swa, l1_full, l1_swa,
                    deepest, L, lo, {})
        for i in np.flatnonzero(origin[:L] == 2).tolist():
            old = self._landed.pop(keys[i], None)
            if old is not None:  # first served since it came from L3 (4: data older than this cache)
                origin[i] = 4 if old else 3
        return origin[:L]

    def _to_l1(self, tokens: np.ndarray, namespace: str, keys: list[bytes], origin: np.ndarray,
               swa_src: np.ndarray, h_full: np.ndarray, h_swa: np.ndarray, l1_full: np.ndarray,
               l1_swa: np.ndarray, deepest: TreeNode | None, L: int, lo: int,
               skeys: dict[int, bytes]) -> None:
        """L2 -> L1 for pages ``[n1, L)`` (full) and the window ``[lo, L)`` (SWA); insert."""
        n1 = len(l1_full)
        fi = np.arange(min(n1, L), L)
        si = lo + np.flatnonzero(swa_src[lo:L] >= 2)
        if fi.size == 0 and si.size == 0:
            return
        assert (origin[fi] >= 2).all() and (h_full[fi] >= 0).all() and (h_swa[si] >= 0).all()
        keep_l1_swa = l1_swa[lo:min(n1, L)]
        handle = self.tree.lock_path(deepest, keep_l1_swa[keep_l1_swa >= 0])
        self._protect = (set(h_full[fi].tolist()), set(h_swa[si].tolist()))
        try:
            got = self.pool.alloc(fi.size, si.size)
            if got is None:
                short = self.pool.shortfall(fi.size, si.size)
                self.tree.evict(short[0], short[1], short[2])
                got = self.pool.alloc(fi.size, si.size)
            if got is None:
                self.tier_counters["l1_load_failed"] += 1
                return
            nf, ns = got
            try:
                self._copy(AttnKind.FULL, self.host, h_full[fi], self, nf)
                self._copy(AttnKind.SWA, self.host, h_swa[si], self, ns)
                full_ids = np.concatenate([l1_full[:min(n1, L)], nf]).astype(np.int32)
                swa_ids = np.full(L, NO_PAGE, dtype=np.int32)
                swa_ids[si] = ns
                for p, i in zip(nf.tolist(), fi.tolist()):
                    self._l1_full_key[p] = keys[i]
                for p, i in zip(ns.tolist(), si.tolist()):
                    self._l1_swa_key[p] = (keys[i], True)
                # insert raises only before it takes ownership (bad input), so on any
                # exception above the new L1 pages are still ours to give back
                self.tree.insert(tokens[:L * self.page_size], full_ids, swa_ids, namespace)
            except BaseException:
                for p in nf.tolist():
                    self._l1_full_key.pop(p, None)
                for p in ns.tolist():
                    self._l1_swa_key.pop(p, None)
                self.pool.free_full(nf)  # the raw pool: these pages hold nothing worth a backup
                self.pool.free_swa(ns)
                raise
            c = self.tier_counters
            c["l2_to_l1_full_pages"] += fi.size
            c["l2_to_l1_swa_pages"] += si.size
            c["repair_swa_h2d_pages"] += int(np.count_nonzero(si < n1))
            c["bytes_h2d"] += (fi.size * self.codec.nominal_bytes(AttnKind.FULL)
                               + si.size * self.codec.nominal_bytes(AttnKind.SWA))
        finally:
            self._protect = (set(), set())
            self.tree.unlock(handle)

    def _copy(self, kind: AttnKind, src: Any, src_pages: np.ndarray, dst: Any, dst_pages: np.ndarray) -> None:
        """Copy pages of ``kind`` between L1 (``self``) and L2 (``self.host``) buffers."""
        if len(src_pages) == 0:
            return
        sb, db = src.pool.buffers, dst.pool.buffers
        if sb is None or db is None or "meta" in (sb.device.type, db.device.type):
            return  # accounting only: no bytes to move
        s, d = sb.of(kind), db.of(kind)
        # both arenas share the model's block geometry: a page copy moves its blocks
        copy_pages(s.k, s.v, d.k, d.v, s.blocks(src_pages), d.blocks(dst_pages),
                   self.page_size, stream=self._stream)
        if self._stream is not None:
            self._stream.synchronize()  # the tree may hand the pages out right after

    def _account(self, req: Request, keys: list[bytes], origin: np.ndarray) -> None:
        h = req.prefix_len // self.page_size
        src = np.ones(h, dtype=np.int8)
        m = min(h, len(origin))
        src[:m] = np.where(origin[:m] > 0, origin[:m], 1)
        per = {f"l{t}_hit_tokens": int(np.count_nonzero(src == t)) * self.page_size for t in (1, 2)}
        per["l3_hit_tokens"] = int(np.count_nonzero(src >= 3)) * self.page_size
        per["l3_preexisting_hit_tokens"] = int(np.count_nonzero(src == 4)) * self.page_size
        req.extra["tiers"] = per  # added to the totals when the request finishes (not on abort)
        if h:
            with self._mutex:
                self.host.lookup_full(keys[:h], touch=True)
                try:
                    self._anchor_hit_window(req, keys, h)
                except Exception as exc:  # noqa: BLE001 - best effort, never fails the request
                    self.tier_counters["tier_errors"] += 1
                    logger.warning("anchoring the hit window failed (%s: %s)", type(exc).__name__, exc)
            if self.l3 is not None:  # repair 3: hot prefixes keep their L3 keys alive
                served = [k for k, t in zip(keys[:h], src.tolist()) if t < 3]
                served += [swa_key(k) for k in keys[max(0, h - self.spec.window_pages):h]]
                self.l3.touch(served)

    def _anchor_hit_window(self, req: Request, keys: list[bytes], h: int) -> None:
        """Anchor the SWA window ``[h - W, h)`` that ends this hit (repair case 4).

        L1 pages of the window are re-registered as anchored (write-back then
        stores them anchored when the tree frees them, and write-through's
        backup at finish keeps the flag); L2 copies are promoted to the
        anchored class and queued for L3 if not known there.  Mutates the
        registrations, L2's classes and the L3 write queue.  O(window pages).
        """
        lo = max(0, h - self.spec.window_pages)
        for i, p in zip(range(lo, h), req.swa_pages[lo:h].tolist()):
            if p >= 0 and p in self._l1_swa_key:
                self._l1_swa_key[p] = (keys[i], True)
        sk = [swa_key(k) for k in keys[lo:h]]
        pages = self.host.lookup_swa(sk)
        have = pages >= 0
        if have.any():
            wk = [k for k, o in zip(sk, have.tolist()) if o]
            self.host.anchor(wk)
            self._queue_l3(AttnKind.SWA, wk, pages[have], base=[k for k, o in zip(keys[lo:h], have) if o])

    # ============================================================== finish
    def finish(self, req: Request, cache: bool = True) -> int:
        """End ``req`` (see :meth:`HybridKVCache.finish`); before the insert, register its
        pages' keys for write-back and copy to L2 what the write policy (and repair
        case 1) asks for.  Per-tier hit tokens count requests that finish with
        ``cache=True`` (an aborted request's hit is not counted, as in replays)."""
        self._check_live(req)
        if cache:
            for k, v in req.extra.get("tiers", {}).items():
                self.tier_counters[k] += v
            aligned = max(req.computed // self.page_size, req.tree_pages)
            try:
                with self._mutex:
                    keys = self._page_keys(req.tokens, req.namespace, aligned, req.extra.get("page_keys"))
                    self._register(req, aligned, keys)
                    self._backup_at_finish(req, aligned, keys)
            except Exception as exc:  # noqa: BLE001
                self.tier_counters["tier_errors"] += 1
                logger.warning("tier backup at finish failed (%s: %s)", type(exc).__name__, exc)
        return super().finish(req, cache)

    def _anchored(self, idx: np.ndarray, end: int) -> np.ndarray:
        """Which page indices end a kept window: the tail before ``end`` or a checkpoint
        (the tree's :class:`~hybridkv.radix.policy.RetentionPolicy` decides, as in L1)."""
        return self.tree.policy.tier_anchored(idx, end)

    def _register(self, req: Request, aligned: int, keys: list[bytes]) -> None:
        lo = req.tree_pages
        for p, k in zip(req.full_pages[lo:aligned].tolist(), keys[lo:aligned]):
            self._l1_full_key[p] = k
        swa = req.swa_pages[lo:aligned]
        idx = lo + np.flatnonzero(swa >= 0)
        for p, i, a in zip(req.swa_pages[idx].tolist(), idx.tolist(), self._anchored(idx, aligned).tolist()):
            self._l1_swa_key[p] = (keys[i], a)

    def _backup_at_finish(self, req: Request, aligned: int, keys: list[bytes]) -> None:
        through = self.tiers.write_policy == "write_through"
        have_full = self.host.lookup_full(keys[:aligned]) >= 0
        if through:
            fi = np.flatnonzero(~have_full)
            self._store_l2(AttnKind.FULL, req.full_pages[fi], [keys[i] for i in fi], None)
            have_full[:] = True
        idx = np.flatnonzero(req.swa_pages[:aligned] >= 0)
        if not through:  # repair case 1: only where the host already holds the full KV
            idx = idx[have_full[idx]]
        if idx.size == 0:
            return
        sk = [swa_key(keys[i]) for i in idx]
        missing = self.host.lookup_swa(sk) < 0
        idx = idx[missing]
        if not through:
            self.tier_counters["repair_swa_d2h_pages"] += idx.size
        pages = req.swa_pages[idx]
        # A window anchored since registration (it ended a hit) keeps its anchor.
        marked = np.fromiter((self._l1_swa_key.get(p, (b"", False))[1] for p in pages.tolist()),
                             bool, count=idx.size)
        self._store_l2(AttnKind.SWA, pages, [k for k, m in zip(sk, missing) if m],
                       self._anchored(idx, aligned) | marked, base=[keys[i] for i in idx])

    def _store_l2(self, kind: AttnKind, l1_pages: np.ndarray, keys: list[bytes],
                  anchored: np.ndarray | None, base: list[bytes] | None = None) -> None:
        """Copy L1 pages to new L2 pages (D2H), index them, queue their L3 write.

        ``keys``: storage keys (SWA keys for SWA); ``base``: their full-KV page
        keys (named in tier events; defaults to ``keys`` for full KV).
        """
        n = len(keys)
        if n == 0:
            return
        pf, ps = self._protect
        got = self.host.alloc(n if kind is AttnKind.FULL else 0, n if kind is AttnKind.SWA else 0,
                              protect=pf, protect_swa=ps)
        if got is None:
            self.tier_counters["l2_store_failed"] += n
            return
        hp = got[0] if kind is AttnKind.FULL else got[1]
        try:
            self._copy(kind, self, l1_pages, self.host, hp)
        except BaseException:
            self.host.free(hp if kind is AttnKind.FULL else _EMPTY, hp if kind is AttnKind.SWA else _EMPTY)
            raise
        if kind is AttnKind.FULL:
            self.host.insert_full(keys, hp)
        else:
            self.host.insert_swa(keys, hp, anchored if anchored is not None else np.ones(n, bool), base)
        c = self.tier_counters
        c["l1_to_l2_full_pages" if kind is AttnKind.FULL else "l1_to_l2_swa_pages"] += n
        c["bytes_d2h"] += n * self.codec.nominal_bytes(kind)
        sel = None
        if kind is AttnKind.SWA and self.tiers.l3_swa == "anchored" and anchored is not None:
            sel = np.asarray(anchored, bool)
        self._queue_l3(kind, keys, hp, sel, base=base)

    def _queue_l3(self, kind: AttnKind, keys: list[bytes], host_pages: np.ndarray,
                  sel: np.ndarray | None = None, base: list[bytes] | None = None) -> None:
        """Queue the L3 write of L2 pages ``host_pages`` (where ``sel``) not known in L3
        (``base``: full-KV keys for the L3 tier events, see :meth:`_store_l2`)."""
        if self.l3 is None or not keys:
            return
        n = len(keys)
        sel = np.ones(n, bool) if sel is None else np.asarray(sel, bool).copy()
        sel &= np.fromiter((k not in self._l3_known for k in keys), bool, count=n)
        if not sel.any():
            return
        wk = [k for k, s in zip(keys, sel) if s]
        names = keys if kind is AttnKind.FULL else base
        ev = [k for k, s in zip(names, sel) if s] if names is not None else None
        pending = _PendingWrite(kind, wk, np.asarray(host_pages)[sel].astype(np.int64))

        def encode() -> list[Any]:
            """On the L3 write worker: encode what L2 did not free (and encode) meanwhile."""
            with self._mutex:
                self._encode_pending([(pending, i) for i in range(len(wk)) if pending.values[i] is None])
            return pending.values

        def written() -> None:
            """On the write worker, after the put: reads go to L3 for these keys again."""
            with self._mutex:
                for i, k in enumerate(wk):
                    if self._unwritten.get(k) == (pending, i):
                        del self._unwritten[k]

        if self.l3.put_async(wk, encode=encode, event_keys=ev, swa=kind is AttnKind.SWA, done=written):
            for i, p in enumerate(pending.pages.tolist()):  # under the mutex: before encode() can run
                self._pending_l3[(kind, p)] = (pending, i)
            for i, k in enumerate(wk):  # read-your-writes until the put ran (reads do not queue behind writes)
                self._unwritten[k] = (pending, i)
            self._l3_known.update(wk)
            if not self._l3_mine_overflow:
                self._l3_mine.update(wk)
                if len(self._l3_mine) > 4_000_000:  # bounded: stop telling old data from ours
                    self._l3_mine.clear()
                    self._l3_mine_overflow = True
            if len(self._l3_known) > 4_000_000:
                self._l3_known.clear()  # bounded; only redundant writes result
            self.tier_counters["bytes_l3_written"] += len(wk) * self.codec.nominal_bytes(kind)

    def _encode_pending(self, items: list[tuple["_PendingWrite", int]]) -> None:
        """Encode queued L3 values from their L2 pages now (under the mutex).  O(pages)."""
        groups: dict[int, tuple[_PendingWrite, list[int]]] = {}
        for pw, i in items:
            if self._pending_l3.get((pw.kind, int(pw.pages[i]))) == (pw, i):
                del self._pending_l3[(pw.kind, int(pw.pages[i]))]
            groups.setdefault(id(pw), (pw, []))[1].append(i)
        for pw, idx in groups.values():
            vals = self.codec.encode(pw.kind, [pw.keys[i] for i in idx], pw.pages[idx])
            for i, v in zip(idx, vals):
                pw.values[i] = v

    def _l2_freeing(self, kind: AttnKind, pages: np.ndarray) -> None:
        """L2 is about to free ``pages``: encode their still-queued L3 writes first
        (on whichever thread frees; usually the write worker encodes them)."""
        if not self._pending_l3:
            return
        hit = [e for e in (self._pending_l3.get((kind, int(p))) for p in np.asarray(pages).tolist())
               if e is not None]
        if hit:
            self._encode_pending(hit)

    def _on_l1_free(self, kind: AttnKind, pages: np.ndarray) -> None:
        """The L1 tree frees ``pages``: drop their keys, back them up first under write-back."""
        try:
            with self._mutex:
                if kind is AttnKind.FULL:
                    keys = [self._l1_full_key.pop(p, None) for p in pages.tolist()]
                    anchored = None
                else:
                    pairs = [self._l1_swa_key.pop(p, None) for p in pages.tolist()]
                    keys = [None if x is None else swa_key(x[0]) for x in pairs]
                    bases = [None if x is None else x[0] for x in pairs]
                    anchored = np.array([bool(x and x[1]) for x in pairs], dtype=bool)
                if self.tiers.write_policy != "write_back":
                    return
                sel = np.array([k is not None for k in keys], dtype=bool)
                if not sel.any():
                    return
                ks = [k for k in keys if k is not None]
                have = (self.host.lookup_full(ks) if kind is AttnKind.FULL else self.host.lookup_swa(ks)) >= 0
                idx = np.flatnonzero(sel)[~have]
                self._store_l2(kind, pages[idx], [keys[i] for i in idx],
                               None if anchored is None else anchored[idx],
                               base=None if anchored is None else [bases[i] for i in idx])
        except Exception as exc:  # noqa: BLE001 - freeing must go on; the backup is best effort
            self.tier_counters["tier_errors"] += 1
            logger.warning("L1 -> L2 backup failed (%s: %s); pages dropped", type(exc).__name__, exc)

    # ============================================================== misc
    def clear_l2(self) -> int:
        """Drop every L2 page (as a host restart would), under the tiers' lock;
        listeners hear the removals.  Returns pages dropped.  O(pages)."""
        with self._mutex:
            return self.host.clear()

    @property
    def key_fingerprint(self) -> str:
        """Fingerprint in this cache's L2/L3 page keys (a KV-event publisher of its
        tier events must hash L1 pages with the same one)."""
        return self._fingerprint

    def l3_last_error(self) -> str | None:
        """The L3 backend's last fault in one line (why reads/writes failed), or None."""
        return getattr(self._backend, "last_error", None)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued L3 writes/touches; False on timeout (or True without L3)."""
        return True if self.l3 is None else self.l3.flush(timeout_s)

    def close(self) -> None:
        """Stop the L3 worker (after draining) and close a backend opened from a URL."""
        if self.l3 is not None:
            self.l3.close()
        if self._owns_backend and self._backend is not None:
            self._backend.close()

    def stats(self) -> dict[str, Any]:
        """L1 stats plus tier counters, ``l2_*`` host figures and ``l3_*`` manager/backend counters."""
        out = super().stats()
        out.update(self.tier_counters)
        out.update({f"l2_{k}": v for k, v in self.host.stats().items()})
        if self.l3 is not None:
            out.update(self.l3.stats())
            out.update({f"l3_backend_{k}": v for k, v in self._backend.stats().items()})
        return out

    def check_invariants(self) -> None:
        """L1 ownership, L2 accounting, and: every page the L1 tree holds has a
        registered key (so write-back can name it), no registered page is free."""
        super().check_invariants()
        self.host.check_invariants()
        tree_full = {int(p) for nd in self.tree.iter_nodes() for p in nd.full.tolist()}
        assert set(self._l1_full_key) == tree_full, "L1 full pages and registered keys differ"
        tree_swa = {int(p) for nd in self.tree.iter_nodes() for p in nd.swa[nd.swa >= 0].tolist()}
        assert set(self._l1_swa_key) == tree_swa, "L1 SWA pages and registered keys differ"


def _prefix_true(mask: np.ndarray) -> int:
    """Length of the leading run of True in ``mask``.  O(n) numpy."""
    bad = np.flatnonzero(~mask)
    return int(bad[0]) if bad.size else int(mask.size)


def _window_safe(swa_ok: np.ndarray, window_pages: int) -> int:
    """Largest ``l <= len(swa_ok)`` whose last ``window_pages`` pages have SWA (0 always safe)."""
    if swa_ok.size == 0:
        return 0
    return window_safe_pages([np.where(swa_ok, 0, NO_PAGE).astype(np.int32)], window_pages)
