"""The tier coordinator: L2 (host) and L3 (storage) beside a cache's L1 tree.

A :class:`TierCoordinator` is owned by a
:class:`~hybridkv.cache.HybridKVCache` (its ``lower_tiers``), which calls it at
three documented points of a request:

* :meth:`TierCoordinator.before_match`, in ``begin`` before the L1 match:
  find the prompt's pages in L1/L2/L3, wait (bounded) for an L3 -> L2
  read-ahead, load L2 -> L1 and insert into the tree;
* :meth:`TierCoordinator.after_begin`, once the hit is locked: per-tier hit
  figures, hot keys touched, the hit's window anchored;
* :meth:`TierCoordinator.before_finish`, in ``finish(cache=True)`` before the
  insert: pages copied to L2 as the write policy asks, and their names (page
  keys) returned for the insert (the tree keeps them on its nodes).

Beside those it listens to the tree's ``free_listeners`` (a page leaving L1 is
backed up to L2 first under write-back) and, through its
:class:`~hybridkv.tiers.writes.L3WriteQueue`, to L2's.  It asks the tree only
through public calls (``walk``, ``lock_path``, ``insert``, ``evict``,
``unlock``).  Its lock (``mutex``) guards everything here; the L3 workers take
it to land reads and encode writes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._validate import as_token_array
from ..lifecycle import TierPlan
from ..modes import L2Eviction, WritePolicy
from ..radix.node import NO_PAGE, EvictedRun, TreeNode, parts_side
from ..radix import PageNames
from ..radix.types import node_names
from ..spec import AttnKind, ModelSpec
from ..transfer import prepare_copy
from .backup import L2Backup
from .config import PageOrigin, TierConfig
from .host import HostTier
from .index import StoreIndex
from .keys import page_keys
from .manager import TierManager
from .payload import PayloadCodec, RealPayload, ScaledPayload, swa_key
from .records import HostRecords, LetGo, TreeWalk
from .reads import Landing, PrefetchHandle, ReadAhead, leading_true, window_safe
from .storage import StorageBackend, open_backend
from .writes import L3WriteQueue

if TYPE_CHECKING:
    from ..pools import DualPool
    from ..radix import WindowSafeTree
    from ..request import Request

__all__ = ["Residency", "TierCoordinator"]

logger = logging.getLogger("hybridkv.tiers")
_COUNTERS = ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "bytes_d2h", "bytes_h2d",
             "bytes_l3_read", "bytes_l3_written", "l2_to_l1_full_pages", "l2_to_l1_swa_pages",
             "l1_to_l2_full_pages", "l1_to_l2_swa_pages", "l3_to_l2_full_pages", "l3_to_l2_swa_pages",
             "l3_clamped_pages", "repair_swa_d2h_pages", "repair_swa_h2d_pages", "l2_store_failed",
             "l1_load_failed", "tier_errors", "l3_preexisting_hit_tokens")


@dataclass
class Residency:
    """Where the pages of a prompt are in L1/L2 (taken under the mutex).

    Attributes:
        full / swa: :class:`PageOrigin` of each page's full / SWA KV (L1, L2 or NONE).
        l2_full / l2_swa: the L2 page holding it (-1: absent).
        l1_full / l1_swa: page ids of the raw (not window-safe) L1 match.
        deepest: the node that match ends in (None: no L1 match).
        swa_keys: the SWA keys hashed for the L2 lookup, by page index (the
            read-ahead reuses them).
    """

    full: np.ndarray
    swa: np.ndarray
    l2_full: np.ndarray
    l2_swa: np.ndarray
    l1_full: np.ndarray
    l1_swa: np.ndarray
    deepest: TreeNode | None
    walk: TreeWalk = field(default_factory=TreeWalk)  # the tree walk it was read along
    swa_keys: dict[int, bytes] = field(default_factory=dict)


class TierCoordinator:
    """L2/L3 beside the L1 tree of one cache (see the module docstring).

    Args:
        spec: the model.
        tree / pool: the cache's L1 tree and pools.
        tiers: the :class:`TierConfig`.

    Attributes: ``host`` (L2), ``l3`` (:class:`TierManager` or None),
    ``l3_record`` (what L3 holds as far as this cache knows, a
    :class:`~hybridkv.tiers.index.StoreIndex`), ``backend``, ``codec``,
    ``counters`` (the tier counters), ``mutex``.
    """

    def __init__(self, spec: ModelSpec, tree: WindowSafeTree, pool: DualPool, tiers: TierConfig) -> None:
        real = pool.buffers is not None and pool.buffers.device.type != "meta"
        self.spec, self.tree, self.pool, self.tiers = spec, tree, pool, tiers
        self.page_size = spec.page_size
        self.host = HostTier(spec, int(tiers.l2_bytes), device=tiers.l2_device or ("cpu" if real else "meta"))
        # under write-through L2 copies all L1 caches: its copies of pages L1 still holds go first
        self.host.l1_copies_first = tiers.write_policy is WritePolicy.WRITE_THROUGH
        # write-back stores pages as the L1 tree frees them (leaves first): its LRU follows the tree
        self.host.leaf_first = tiers.write_policy is WritePolicy.WRITE_THROUGH
        host_buffers = self.host.pool.buffers
        self.codec: PayloadCodec = (RealPayload(spec, host_buffers)
                                    if host_buffers is not None and host_buffers.device.type == "cpu"
                                    else ScaledPayload(spec))
        self.backend: StorageBackend | None = open_backend(tiers.l3) if isinstance(tiers.l3, str) else tiers.l3
        self._owns_backend = isinstance(tiers.l3, str)
        self.l3 = (TierManager(self.backend, timeout_s=tiers.l3_timeout_s, max_queued_writes=tiers.max_queued_writes,
                               touch_interval_s=tiers.touch_interval_s, read_breaker=tiers.l3_read_breaker)
                   if self.backend is not None else None)
        self.fingerprint = spec.fingerprint()
        self.window_pages = spec.window_pages  # pages of the sliding window (the spec is frozen)
        self.mutex = threading.RLock()
        self._stream = (torch.cuda.Stream(device=pool.buffers.device)
                        if real and pool.buffers.device.type == "cuda" else None)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        # L2 read off the tree's entries (every admission here records on them: complete)
        self.records = HostRecords(self.host, self.counters, complete=True)
        tree.runs.on_drop = self._run_dropped  # what a dropped run recorded L2 holds: orphans
        # what L3 holds as far as this cache knows (the record the vLLM connector keeps
        # too); the read-ahead probes the store only for keys it has no answer for
        self.l3_record = StoreIndex(self.l3.backend_exists if self.l3 is not None else None)
        # what L1 evicts stays in its tree as evicted runs, L2 and L3 entries: a page L2 lets
        # go (and L3 does not hold) leaves its run at the next walk on the engine's thread
        # (:meth:`walk_prompt`; L2 also lets pages go on the tiers' threads), so the runs name
        # what the tiers below hold.  They name at most as many pages as those tiers hold as
        # far as this cache knows: L2's full pages and the keys of L3's record, plus the pages
        # let go that have yet to leave (size reads: no lock; the engine's thread makes the runs)
        self._let_go = LetGo(self.host, self.l3_record if self.l3 is not None else None)  # (under the mutex)
        tree.runs.enable()
        if tiers.l2_eviction is L2Eviction.TREE:  # L2 gives up what the runs name first, least recently used first
            self.host.victims_by = tree.runs.file_by_use()
        tree.runs.cap_by(lambda: self.host.num_full_pages + len(self.l3_record) + len(self._let_go))
        self.writes = L3WriteQueue(self.l3, self.codec, self.mutex, self.l3_record, self.counters)
        self.landing = Landing(self.host, self.codec, self.l3, self.l3_record, self.writes.predates, self.counters)
        self.reads = (ReadAhead(self.l3, self.mutex, self.page_size, spec.window_pages, self.writes, self.landing,
                                self.l3_record, self.counters)
                      if self.l3 is not None else None)
        # ``copy`` is looked up at each call, so a replaced ``self.copy`` (another backend,
        # an injected fault) serves the backup's copies too
        self.backup = L2Backup(tree, pool, self.host, self.writes, self.codec, tiers, self.counters, self.mutex,
                               window_pages=spec.window_pages, protected=lambda: self._protect,
                               orphan=self.records.orphan,
                               copy=lambda kind, src, sp, dst, dp: self.copy(kind, src, sp, dst, dp))
        self._protect: tuple[set[int], set[int]] = (set(), set())  # L2 pages a load reads
        tree.free_listeners.append(self.backup.on_l1_free)  # back L1 pages up to L2 before they go
        self.host.free_listeners.append(self.writes.on_l2_freeing)  # encode queued L3 writes first

    # ================================================================= keys
    def page_keys(self, tokens: np.ndarray, namespace: str, n_pages: int,
                  have: list[bytes] | None = None) -> list[bytes]:
        """Keys of the first ``n_pages`` pages, extending ``have`` when given.  O(new pages)."""
        have = have or []
        if n_pages <= len(have):
            return have[:n_pages]
        P = self.page_size
        more = page_keys(tokens[len(have) * P:n_pages * P], P, namespace=namespace,
                         fingerprint=self.fingerprint, parent=have[-1] if have else None)
        return have + more

    def prompt_keys(self, tokens: np.ndarray, namespace: str, n_pages: int) -> list[bytes]:
        """Keys of the first ``n_pages`` pages of a prompt: those of its L1 match read
        off the tree's nodes (named by the insert that added each page, with these
        same keys), the rest hashed on from the last of them.  A page L1 holds is
        never hashed again.  O(L1 match pages) plus the hashing of the rest."""
        return self.walk_prompt(tokens, namespace, n_pages)[0]

    def walk_prompt(self, tokens: np.ndarray, namespace: str, n_pages: int, *,
                    engine: bool = True) -> tuple[list[bytes], TreeWalk]:
        """:meth:`prompt_keys` and the L1 walk it read them off, which :meth:`resident`
        takes instead of walking the tree again.  Past the L1 match the walk goes on
        into the runs L1 evicted (:mod:`~hybridkv.radix.evicted`), whose names it
        reads too (and where they record L2 holds each page, :mod:`.records`);
        only the pages past both are hashed.  Only the engine's thread
        changes the tree (the tiers' threads change L2 and L3), so on that thread
        the walk holds until the engine's call returns; there (``engine``) it also
        brings the runs back within their cap (the pages L2 and L3 hold).  A
        :meth:`prefetch` from another thread may read a walk the engine changed
        since: it only picks which pages to read ahead, never what a request is
        served."""
        have: list[bytes] = []
        walk = TreeWalk(engine=engine)
        if n_pages > 0:
            tree, limit = self.tree, n_pages * self.page_size
            with self.mutex:  # as resident: the walk and the names read together
                if engine and self._let_go:
                    self._let_go.drain(tree.runs)
                have, walk.path = tree.walk_names(tokens, namespace, limit, trim=engine, runs=walk.runs)
        return self.page_keys(tokens, namespace, n_pages, have), walk

    @property
    def protected(self) -> tuple[set[int], set[int]]:
        """L2 pages (full, SWA) the L2 -> L1 load under way reads: an L2 store made
        meanwhile (write-back of pages the load evicts) must not evict them."""
        return self._protect

    # ================================================================ begin
    def prefetch(self, tokens: object, namespace: str = "default") -> PrefetchHandle:
        """Start loading into L2 the L3 pages a later ``begin`` of ``tokens`` would use
        (see :meth:`hybridkv.tiers.tiered.TieredCache.prefetch`).  Raises only for bad
        arguments.  Runtime on the caller: hashing of the pages past the L1 match, one L1/L2 lookup per page."""
        tokens = as_token_array(tokens)
        if len(tokens) == 0:
            raise ValueError("tokens must not be empty")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        keys, walk = self.walk_prompt(tokens, namespace, (len(tokens) - 1) // self.page_size, engine=False)
        try:
            return self._start_fetch(keys, walk)[0]
        except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
            self.counters["tier_errors"] += 1
            logger.warning("L3 prefetch failed (%s: %s)", type(exc).__name__, exc)
            return PrefetchHandle()

    def before_match(self, tokens: np.ndarray, namespace: str) -> TierPlan:
        """Make the lower-tier hit of ``tokens`` (validated) resident in L1, before the
        cache's L1 match.  Waits for L3 at most ``l3_timeout_s``, without the mutex.
        Returns the page keys and the origin per page of the hit (a
        :class:`~hybridkv.lifecycle.TierPlan`) for :meth:`after_begin`.
        Never raises for tier faults (logged, counted, an L1-only answer).
        Runtime: hashing of the pages past the L1 match, one L2 lookup per page, the wait, the copies."""
        n = (len(tokens) - 1) // self.page_size
        keys, walk = self.walk_prompt(tokens, namespace, n)
        origin = np.zeros(n, dtype=np.int8)
        if self.l3 is not None and n:
            self._wait_for_l3(keys, walk)
        try:
            with self.mutex:
                origin = self._load(tokens, namespace, keys, walk)
        except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
            self.counters["tier_errors"] += 1
            logger.warning("tiered load failed (%s: %s); serving from L1 only", type(exc).__name__, exc)
        return TierPlan(keys, origin)

    def after_begin(self, req: Request, plan: TierPlan) -> None:
        """``req`` holds its L1 hit: record its keys and per-tier hit figures, touch
        the served keys, anchor the hit's window.  O(hit pages)."""
        req.extra["page_keys"] = plan.keys
        self._account(req, plan.keys, plan.origin)

    def _account(self, req: Request, keys: list[bytes], origin: np.ndarray) -> None:
        """Per-tier hit tokens of ``req`` (added to the totals when it finishes with
        ``cache=True``), L2 and L3 touches of the served keys, the hit's window
        anchored (repair cases 3 and 4).  O(hit pages)."""
        P = self.page_size
        h = req.prefix_len // P
        src = np.full(h, PageOrigin.L1, dtype=np.int8)
        m = min(h, len(origin))
        src[:m] = np.where(origin[:m] > PageOrigin.NONE, origin[:m], PageOrigin.L1)
        per = {f"l{int(t)}_hit_tokens": int(np.count_nonzero(src == t)) * P for t in (PageOrigin.L1, PageOrigin.L2)}
        per["l3_hit_tokens"] = int(np.count_nonzero(src >= PageOrigin.L3)) * P
        per["l3_preexisting_hit_tokens"] = int(np.count_nonzero(src == PageOrigin.L3_PREEXISTING)) * P
        req.extra["tiers"] = per
        req.extra["hit_pages"] = h  # its window stays anchored in L2 at finish (a host's shim may lack prefix_len)
        if not h:
            return
        with self.mutex:
            self.host.lookup_full(keys[:h], touch=True)
            try:
                self.backup.anchor_hit_window(req, keys, h)
            except Exception as exc:  # noqa: BLE001 - best effort, never fails the request
                self.counters["tier_errors"] += 1
                logger.warning("anchoring the hit window failed (%s: %s)", type(exc).__name__, exc)
        if self.l3 is not None:  # repair 3: hot prefixes keep their L3 keys alive
            served = [k for k, t in zip(keys[:h], src.tolist()) if t < PageOrigin.L3]
            served += [swa_key(k) for k in keys[max(0, h - self.window_pages):h]]
            self.l3.touch(served)

    def _wait_for_l3(self, keys: list[bytes], walk: TreeWalk) -> None:
        """Start the read-ahead of what L1/L2 lack and wait for it (bounded; the
        mutex is not held).  Faults are logged and counted."""
        assert self.l3 is not None
        try:
            handle, probe = self._start_fetch(keys, walk)
            budget = self.tiers.l3_timeout_s
            if not probe and not handle.wait(budget):
                self.l3.timed_out(budget)
        except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
            self.counters["tier_errors"] += 1
            logger.warning("L3 fetch failed (%s: %s); serving from L1/L2", type(exc).__name__, exc)

    def _start_fetch(self, keys: list[bytes], walk: TreeWalk) -> tuple[PrefetchHandle, bool]:
        """The read-ahead of ``keys`` (see :meth:`ReadAhead.start`), past the tree walk ``walk``."""
        if self.reads is None or not keys:
            return PrefetchHandle(), False
        with self.mutex:
            res = self.resident(keys, walk)
            return self.reads.start(keys, res.full > PageOrigin.NONE, res.swa > PageOrigin.NONE,
                                    swa_keys=res.swa_keys, walk=(walk.segments(), self.records))

    def _l1_pages(self, walk: TreeWalk) -> tuple[np.ndarray, np.ndarray, np.ndarray, TreeNode | None]:
        """Full and SWA page ids of the raw (not window-safe) L1 token match of
        ``walk`` (a :meth:`walk_prompt` walk), and where every sliding group holds its
        page (the nodes' ``swa`` and ``side`` ids)."""
        path = walk.path
        if not path:
            return _EMPTY, _EMPTY, np.zeros(0, dtype=bool), None
        full = np.concatenate([nd.full[:k] for nd, k in path])
        swa = np.concatenate([nd.swa[:k] for nd, k in path])
        held = swa >= 0
        for side in parts_side(path, self.tree.n_side) or ():
            held &= side >= 0
        return full, swa, held, path[-1][0]

    def resident(self, keys: list[bytes], walk: TreeWalk, *, every_swa: bool = True) -> Residency:
        """Where the pages of ``keys`` are in L1 (its ``walk``, from
        :meth:`walk_prompt`) and L2 (read off the walk's entries first, :mod:`.records`;
        under the mutex).  Without ``every_swa``, L2 is
        asked for the full KV of only the leading pages it holds and the SWA of only
        the pages the window-safe hit over L1/L2 depends on (:meth:`_hit_windows`);
        the other pages read as lacking them.  O(pages)."""
        n = len(keys)
        full = np.zeros(n, dtype=np.int8)
        l1_full, l1_swa, l1_held, deepest = self._l1_pages(walk)
        n1 = len(l1_full)
        full[:n1] = PageOrigin.L1
        l2_full = np.full(n, -1, dtype=np.int64)
        # a hit needs only the leading run of held pages (every_swa: the read-ahead needs them all)
        l2_full[n1:] = self.records.slots(AttnKind.FULL, walk, np.arange(n1, n), keys.__getitem__,
                                          leading=not every_swa)
        full[n1:][l2_full[n1:] >= 0] = PageOrigin.L2
        swa = np.zeros(n, dtype=np.int8)
        # an L1 SWA page counts where every sliding group holds it (what a tier copies)
        swa[:n1][l1_held] = PageOrigin.L1
        res = Residency(full, swa, l2_full, np.full(n, -1, dtype=np.int64), l1_full, l1_swa, deepest, walk)
        if every_swa:
            self._swa_in_l2(res, keys, 0, n)
        else:
            self._hit_windows(res, keys)
        return res

    def _swa_in_l2(self, res: Residency, keys: list[bytes], lo: int, hi: int) -> None:
        """Fill ``res``'s SWA of pages ``[lo, hi)`` that L1 lacks from L2.  O(hi - lo)."""
        need = lo + np.flatnonzero(res.swa[lo:hi] == PageOrigin.NONE)
        if need.size:
            def key_of(i: int) -> bytes:  # hashed only for pages looked up among the orphans
                res.swa_keys[i] = k = swa_key(keys[i])
                return k
            res.l2_swa[need] = self.records.slots(AttnKind.SWA, res.walk, need, key_of)
            res.swa[need[res.l2_swa[need] >= 0]] = PageOrigin.L2

    def _hit_windows(self, res: Residency, keys: list[bytes]) -> None:
        """Ask L2 for SWA from the end of the pages whose full KV some tier holds
        downwards, a window first and four times more each round, until the
        window-safe hit is decided: a hit found with its whole window inside what
        was asked is the one asking every page gives (an end above it would have
        its window inside that range too, seen unheld).  O(asked pages)."""
        wp = max(1, self.window_pages)
        covered = leading_true(res.full > PageOrigin.NONE)
        asked, span = covered, wp
        while asked > 0:
            start = max(0, covered - span)
            self._swa_in_l2(res, keys, start, asked)
            asked, span = start, span * 4
            if start == 0 or window_safe(res.swa[:covered] > PageOrigin.NONE, wp) >= start + wp:
                return

    def _safe_hit(self, res: Residency) -> int:
        """Window-safe hit pages over L1 and L2 of ``res``: the leading pages whose
        full KV some tier holds, cut back to the last page whose window's SWA some
        tier holds.  Clears ``res.full`` past the covered pages.  O(pages)."""
        covered = leading_true(res.full > PageOrigin.NONE)
        res.full[covered:] = PageOrigin.NONE
        return window_safe(res.swa[:covered] > PageOrigin.NONE, self.window_pages)

    def lower_hit_pages(self, tokens: np.ndarray, namespace: str, l1_pages: int, *, wait_l3: bool) -> int:
        """Pages past an L1 hit of ``l1_pages`` that L2 (and, with ``wait_l3``, what
        the L3 read-ahead lands within ``l3_timeout_s``) would add, window safe;
        nothing is loaded (a host engine that loads at admission, e.g. SGLang's
        ``host_hit_length``; :meth:`before_match` loads).  Without ``wait_l3`` the
        read-ahead is started, not waited for.  ``tokens`` holds one token past the
        matchable key.  Never raises for tier faults (0).  O(pages) plus the wait."""
        n = (len(tokens) - 1) // self.page_size
        if n <= l1_pages:
            return 0
        try:
            keys, walk = self.walk_prompt(tokens, namespace, n)
            if self.l3 is not None:
                if wait_l3:
                    self._wait_for_l3(keys, walk)
                else:
                    self._start_fetch(keys, walk)
            with self.mutex:
                hit = self._safe_hit(self.resident(keys, walk, every_swa=False))
        except Exception as exc:  # noqa: BLE001 - the tier path must never fail a request
            self.counters["tier_errors"] += 1
            logger.warning("lower-tier hit lookup failed (%s: %s)", type(exc).__name__, exc)
            return 0
        return max(0, hit - l1_pages)

    def _load(self, tokens: np.ndarray, namespace: str, keys: list[bytes], walk: TreeWalk) -> np.ndarray:
        """Make the L1/L2 hit resident in L1 (under the mutex), past the tree walk
        ``walk``; returns the :class:`PageOrigin` of each page's full KV over the
        hit.  O(pages)."""
        if not keys:
            return np.zeros(0, dtype=np.int8)
        wp = self.window_pages
        res = self.resident(keys, walk, every_swa=False)
        origin = res.full
        hit = self._safe_hit(res)
        if hit == 0:
            return origin[:0]
        self._to_l1(tokens, namespace, keys, res, hit, max(0, hit - wp))
        self.landing.served(keys, origin, hit)
        return origin[:hit]

    def _to_l1(self, tokens: np.ndarray, namespace: str, keys: list[bytes], res: Residency, hit: int,
               lo: int) -> None:
        """L2 -> L1 for the full pages of ``[0, hit)`` past the L1 match and the SWA
        window ``[lo, hit)``; insert into the tree.  The L1 match is locked meanwhile
        (the eviction this allocation may cause cannot take it), the L2 sources are
        protected.  O(pages)."""
        n1 = len(res.l1_full)
        full_idx = np.arange(min(n1, hit), hit)
        swa_idx = lo + np.flatnonzero(res.swa[lo:hit] >= PageOrigin.L2)
        if full_idx.size == 0 and swa_idx.size == 0:
            return
        from_full, from_swa = res.l2_full[full_idx], res.l2_swa[swa_idx]
        assert (res.full[full_idx] >= PageOrigin.L2).all() and (from_full >= 0).all() and (from_swa >= 0).all()
        keep_l1_swa = res.l1_swa[lo:min(n1, hit)]
        handle = self.tree.lock_path(res.deepest, keep_l1_swa[keep_l1_swa >= 0])
        self._protect = (set(from_full.tolist()), set(from_swa.tolist()))
        try:
            got = self.pool.alloc(full_idx.size, swa_idx.size)
            if got is None:
                short = self.pool.shortfall(full_idx.size, swa_idx.size)
                self.tree.evict(short[0], short[1], short[2])
                got = self.pool.alloc(full_idx.size, swa_idx.size)
            if got is None:
                self.counters["l1_load_failed"] += 1
                return
            new_full, new_swa = got
            names = None
            try:
                self.copy(AttnKind.FULL, self.host.pool, from_full, self.pool, new_full)
                self.copy(AttnKind.SWA, self.host.pool, from_swa, self.pool, new_swa)
                full_ids = np.concatenate([res.l1_full[:min(n1, hit)], new_full]).astype(np.int32)
                swa_ids = np.full(hit, NO_PAGE, dtype=np.int32)
                swa_ids[swa_idx] = new_swa
                names = self.records.loaded(self.backup.name_loaded(full_idx, keys, hit), full_idx, from_full,
                                            swa_idx, from_swa)
                # insert raises only before it takes ownership (bad input), so on any
                # exception above the new L1 pages are still ours to give back
                self.tree.insert(tokens[:hit * self.page_size], full_ids, swa_ids, namespace, names=names)
            except BaseException:
                if names is not None:
                    self.backup.load_failed(full_idx, keys)
                self.pool.free_full(new_full)  # straight to the pool: nothing here is worth a backup
                self.pool.free_swa(new_swa)
                raise
            c = self.counters
            c["l2_to_l1_full_pages"] += full_idx.size
            c["l2_to_l1_swa_pages"] += swa_idx.size
            c["repair_swa_h2d_pages"] += int(np.count_nonzero(swa_idx < n1))
            c["bytes_h2d"] += (full_idx.size * self.codec.nominal_bytes(AttnKind.FULL)
                               + swa_idx.size * self.codec.nominal_bytes(AttnKind.SWA))
        finally:
            self._protect = (set(), set())
            self.tree.unlock(handle)

    def copy(self, kind: AttnKind, src: Any, src_pages: np.ndarray, dst: Any, dst_pages: np.ndarray) -> None:
        """Copy pages of ``kind`` from pool ``src`` to pool ``dst`` (L1's ``self.pool``
        or L2's ``self.host.pool``).  O(pages) bytes moved; nothing for meta pools."""
        if len(src_pages) == 0:
            return
        sb, db = src.buffers, dst.buffers
        if sb is None or db is None or "meta" in (sb.device.type, db.device.type):
            return  # accounting only: no bytes to move
        s, d = sb.of(kind), db.of(kind)
        # both arenas share the model's block geometry: a page copy moves its blocks
        # (host <-> device: one batched DMA call of whole, coalesced blocks)
        plan = prepare_copy(s.k, s.v, d.k, d.v, s.blocks(src_pages), d.blocks(dst_pages),
                            self.page_size)
        plan.issue(stream=self._stream)
        if self._stream is not None:
            self._stream.synchronize()  # the tree may hand the pages out right after

    # ============================================================== finish
    def before_finish(self, req: Request) -> PageNames | None:
        """``req`` finishes with ``cache=True``: add its hit figures to the totals,
        name its pages for the insert (the tree keeps the names, and where L2 holds
        each page; write-back copies a page under its name when the tree frees it)
        and copy to L2 what the write policy asks for.  Returns the names (None after a fault, which
        is logged and counted).  O(pages)."""
        for k, v in req.extra.get("tiers", {}).items():
            self.counters[k] += v
        aligned = max(req.computed // self.page_size, req.tree_pages)
        names = None
        try:
            with self.mutex:
                keys = self.page_keys(req.tokens, req.namespace, aligned, req.extra.get("page_keys"))
                names = self.backup.name_pages(req, aligned, keys)  # named even if the copies fail
                names = replace(names, host_at=self.backup.at_finish(req, aligned, keys))
        except Exception as exc:  # noqa: BLE001
            self.counters["tier_errors"] += 1
            logger.warning("tier backup at finish failed (%s: %s)", type(exc).__name__, exc)
        return names

    # ============================================================== misc
    def _run_dropped(self, run: EvictedRun) -> None:
        """The tree dropped ``run`` (on the engine's thread): its pages L2 still holds
        become orphans, under the mutex (an L3 landing writes them too).  O(pages)."""
        with self.mutex:
            self.records.orphan_run(run)

    def clear_l2(self) -> int:
        """Drop every L2 page under the mutex; returns pages dropped.  O(pages)."""
        with self.mutex:
            self._let_go.keys += self.host.full_keys()  # (L2 tells its listeners key by key only as it evicts)
            return self.host.clear()

    def l3_last_error(self) -> str | None:
        """The L3 backend's last fault in one line, or None."""
        return getattr(self.backend, "last_error", None)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued L3 writes/touches; False on timeout (or True without L3)."""
        return True if self.l3 is None else self.l3.flush(timeout_s)

    def close(self) -> None:
        """Stop the L3 worker (after draining) and close a backend opened from a URL."""
        if self.l3 is not None:
            self.l3.close()
        if self._owns_backend and self.backend is not None:
            self.backend.close()

    def stats(self) -> dict[str, Any]:
        """Tier counters, ``l2_*`` host figures, ``l3_*`` manager/backend counters and
        the L1 tree's evicted runs (``evicted_run_pages`` named, ``evicted_run_pages_dropped``
        to stay within their cap, ``evicted_run_pages_let_go`` cut as the tiers below let
        them go)."""
        out = dict(self.counters)
        runs = self.tree.runs
        out.update(evicted_run_pages=runs.pages, evicted_run_pages_dropped=runs.dropped,
                   evicted_run_pages_let_go=runs.let_go_pages)
        out.update({f"l2_{k}": v for k, v in self.host.stats().items()})
        if self.l3 is not None:
            out.update(self.l3.stats())
            out.update({f"l3_backend_{k}": v for k, v in self.backend.stats().items()})
            out.update({f"l3_record_{k}": v for k, v in self.l3_record.stats().items()})
        return out

    def check_invariants(self) -> None:
        """L2 accounting; every page the L1 tree holds is named, as L2 counts it, and
        by the key of its path (what :meth:`prompt_keys` reads off the nodes); every
        valid record of where L2 holds a page is right (:meth:`HostRecords.check`).  O(n)."""
        self.host.check_invariants()
        self.backup.check_names()
        for nd in self.tree.iter_nodes():
            names = node_names(nd)
            if names is None or (names.parents[0] is None and nd.parent.parent is not None):
                continue  # unnamed, or under an unnamed page (not a root): prompt_keys hashes there
            keys = page_keys(nd.key, self.page_size, namespace=nd.namespace, fingerprint=self.fingerprint,
                             parent=names.parents[0])
            assert all(k is None or k == h for k, h in zip(names.keys, keys)), f"{nd} holds another path's names"
        nodes = [*(self.tree.root(ns) for ns in self.tree.namespaces()), *self.tree.iter_nodes()]
        self.records.check([(nd.page_keys, nd.host_at) for nd in nodes if nd.page_keys is not None]
                           + [(run.names, run.host_at) for run in self.tree.runs.iter_runs(nodes)])


_EMPTY = np.zeros(0, dtype=np.int32)
