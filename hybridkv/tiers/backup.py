"""L1 -> L2 copies of a tier coordinator, and the page keys of L1 pages.

:class:`L2Backup` registers the key of every page the L1 tree holds (so a
page the tree frees can be named in L2), copies pages down as the write
policy asks (``write_through``: a request's pages when it finishes;
``write_back``: a page when the tree frees it, through the tree's
``free_listeners``), and queues what enters L2 for L3.

Repair cases (the MiMo stack's four): 1. device SWA the host lacks is copied
down at prefill end under both policies; 4. retention checkpoints apply below
L1: SWA pages that end a sequence or a checkpoint window are anchored (L2
evicts unanchored SWA first, L3 receives only anchored SWA with
``l3_swa="anchored"``), and the window that ends a hit is anchored in L1's
registration and in L2 and queued for L3 (:meth:`L2Backup.anchor_hit_window`).
A finished request's earlier anchored windows that it moved past (neither
its tail, a checkpoint nor its hit's window) become plain SWA in L2.
"""

from __future__ import annotations

import logging
from threading import RLock
from typing import Any, Callable

import numpy as np

from ..pools import DualPool
from ..radix import WindowSafeTree
from ..request import Request, swa_held
from ..modes import L3Swa, WritePolicy
from ..spec import AttnKind
from .config import TierConfig
from .host import HostTier
from .keys import parent_keys
from .payload import PayloadCodec, swa_key
from .writes import L3WriteQueue

#: copies pages of a kind between two pools: ``copy(kind, src, src_pages, dst, dst_pages)``
PageCopy = Callable[[AttnKind, Any, np.ndarray, Any, np.ndarray], None]

__all__ = ["L2Backup"]

logger = logging.getLogger("hybridkv.tiers")
_EMPTY = np.zeros(0, dtype=np.int32)


class L2Backup:
    """The L1 page-key registry and the L1 -> L2 copies of a tier coordinator.

    Args:
        tree / pool: L1 (the tree's pages are registered; its retention policy
            says which pages are anchored).
        host: L2.
        writes: the L3 write queue (what enters L2 is queued for L3).
        codec: the payload codec (bytes per page, for the counters).
        tiers: the :class:`TierConfig` (write policy, ``l3_swa``).
        counters: the coordinator's tier counters, updated in place.
        mutex: the coordinator's lock (taken when the tree frees pages).
        window_pages: the model's SWA window in pages.
        copy: moves pages between L1 and L2 (:data:`PageCopy`).
        protected: the L2 pages (full, SWA) a load under way reads; a store
            made meanwhile must not evict them.
    """

    def __init__(self, tree: WindowSafeTree, pool: DualPool, host: HostTier, writes: L3WriteQueue,
                 codec: PayloadCodec, tiers: TierConfig, counters: dict[str, int], mutex: RLock, *,
                 window_pages: int, copy: PageCopy, protected: Callable[[], tuple[set[int], set[int]]]) -> None:
        self.tree = tree
        self.pool = pool
        self.host = host
        self.writes = writes
        self.codec = codec
        self.tiers = tiers
        self.counters = counters
        self.mutex = mutex
        self.window_pages = window_pages
        self.copy = copy
        self.protected = protected
        self._full_key: dict[int, tuple[bytes, bytes | None]] = {}  # L1 full page -> (key, parent key)
        self._swa_key: dict[int, tuple[bytes, bool]] = {}  # L1 SWA page -> (page key, anchored)

    # ======================================================== registration
    def register(self, req: Request, aligned: int, keys: list[bytes]) -> None:
        """Register the keys of ``req``'s own pages ``[tree_pages, aligned)`` (before
        the tree takes them).  O(pages)."""
        lo = req.tree_pages
        own = range(lo, aligned)
        for p, i, up in zip(req.full_pages[lo:aligned].tolist(), own, parent_keys(keys, own)):
            self._name_full(p, keys[i], up)
        swa = req.swa_pages[lo:aligned]
        idx = lo + np.flatnonzero(swa >= 0)
        for p, i, a in zip(req.swa_pages[idx].tolist(), idx.tolist(), self._anchored(idx, aligned).tolist()):
            self._swa_key[p] = (keys[i], a)

    def register_loaded(self, full_pages: np.ndarray, full_idx: np.ndarray, swa_pages: np.ndarray,
                        swa_idx: np.ndarray, keys: list[bytes]) -> None:
        """Register L1 pages loaded from L2: full page ``full_pages[j]`` holds page
        ``full_idx[j]`` of ``keys``, likewise SWA (anchored).  O(pages)."""
        idx = full_idx.tolist()
        for p, i, up in zip(full_pages.tolist(), idx, parent_keys(keys, idx)):
            self._name_full(p, keys[i], up)
        for p, i in zip(swa_pages.tolist(), swa_idx.tolist()):
            self._swa_key[p] = (keys[i], True)

    def _name_full(self, page: int, key: bytes, parent: bytes | None) -> None:
        """L1 full page ``page`` holds ``key``, the page after ``parent`` (L2 learns
        that L1 holds it).  O(1)."""
        old = self._full_key.get(page)
        if old is not None:
            self.host.mark_l1((old[0],), False)
        self._full_key[page] = (key, parent)
        self.host.mark_l1((key,), True)

    def unregister(self, full_pages: np.ndarray, swa_pages: np.ndarray) -> None:
        """Forget the keys of these L1 pages (a load that failed).  O(pages)."""
        for p in full_pages.tolist():
            k = self._full_key.pop(p, None)
            if k is not None:
                self.host.mark_l1((k[0],), False)
        for p in swa_pages.tolist():
            self._swa_key.pop(p, None)

    def check_registered(self) -> None:
        """Every page the L1 tree holds has a registered key, no other page has.  O(n)."""
        tree = self.tree
        tree_full = {int(p) for nd in tree.iter_nodes() for p in nd.full.tolist()}
        assert set(self._full_key) == tree_full, "L1 full pages and registered keys differ"
        tree_swa = {int(p) for nd in tree.iter_nodes() for p in nd.swa[nd.swa >= 0].tolist()}
        assert set(self._swa_key) == tree_swa, "L1 SWA pages and registered keys differ"

    def _anchored(self, idx: np.ndarray, end: int) -> np.ndarray:
        """Which page indices end a kept window: the tail before ``end`` or a checkpoint
        (the tree's :class:`~hybridkv.radix.policy.RetentionPolicy` decides, as in L1)."""
        return self.tree.policy.tier_anchored(idx, end)

    def anchor_hit_window(self, req: Request, keys: list[bytes], h: int) -> None:
        """Anchor the SWA window ``[h - W, h)`` that ends this hit (repair case 4).

        L1 pages of the window are re-registered as anchored (write-back then
        stores them anchored when the tree frees them, and write-through's
        backup at finish keeps the flag); L2 copies are promoted to the
        anchored class and queued for L3 if not known there.  O(window pages).
        """
        lo = max(0, h - self.window_pages)
        for i, p in zip(range(lo, h), req.swa_pages[lo:h].tolist()):
            if p >= 0 and p in self._swa_key:
                self._swa_key[p] = (keys[i], True)
        swa_keys = [swa_key(k) for k in keys[lo:h]]
        pages = self.host.lookup_swa(swa_keys)
        have = pages >= 0
        if have.any():
            held = [k for k, o in zip(swa_keys, have.tolist()) if o]
            self.host.anchor(held)
            self.writes.queue(AttnKind.SWA, held, pages[have], base=[k for k, o in zip(keys[lo:h], have) if o])

    # ============================================================== copies
    def at_finish(self, req: Request, aligned: int, keys: list[bytes]) -> None:
        """Copy ``req``'s pages ``[0, aligned)`` to L2 as the write policy asks:
        write-through all the full KV L2 lacks, and the SWA L2 lacks (write-back:
        only where L2 holds the full KV, repair case 1).  O(pages)."""
        through = self.tiers.write_policy is WritePolicy.WRITE_THROUGH
        self._demote_passed(req, aligned, keys)
        have_full = self.host.lookup_full(keys[:aligned]) >= 0
        if through:
            missing_full = np.flatnonzero(~have_full).tolist()
            self.store_l2(AttnKind.FULL, req.full_pages[missing_full], [keys[i] for i in missing_full], None,
                          parents=parent_keys(keys, missing_full))
            have_full[:] = True
        # a tier copies an SWA page only where every sliding group still holds its KV
        idx = np.flatnonzero(swa_held(req.swa_pages, req.side_pages, aligned))
        if not through:
            idx = idx[have_full[idx]]
        if idx.size == 0:
            return
        swa_keys = [swa_key(keys[i]) for i in idx]
        missing = self.host.lookup_swa(swa_keys) < 0
        idx = idx[missing]
        if not through:
            self.counters["repair_swa_d2h_pages"] += idx.size
        pages = req.swa_pages[idx]
        # A window anchored since registration (it ended a hit) keeps its anchor.
        marked = np.fromiter((self._swa_key.get(p, (b"", False))[1] for p in pages.tolist()),
                             bool, count=idx.size)
        self.store_l2(AttnKind.SWA, pages, [k for k, m in zip(swa_keys, missing) if m],
                      self._anchored(idx, aligned) | marked, base=[keys[i] for i in idx])

    def _demote_passed(self, req: Request, aligned: int, keys: list[bytes]) -> None:
        """Anchored L2 windows inside ``req``'s pages ``[0, aligned)`` that it neither ends
        (its tail, a checkpoint) nor hit at: the sequence has moved past them, as the
        L1 tree moves a leaf's tail anchor when the leaf is extended.  They become
        plain SWA (kept, but given up before full KV under pressure).  O(pages)."""
        if not self.host.num_anchored_swa_pages or aligned <= 0:
            return
        keep = self._anchored(np.arange(aligned), aligned)
        h = min(req.extra.get("hit_pages", req.prefix_len // self.tree.policy.page_size), aligned)
        keep[max(0, h - self.window_pages):h] = True
        self.host.demote([keys[i] for i in np.flatnonzero(~keep).tolist()])

    def store_l2(self, kind: AttnKind, l1_pages: np.ndarray, keys: list[bytes],
                 anchored: np.ndarray | None, base: list[bytes] | None = None,
                 parents: list[bytes | None] | None = None) -> None:
        """Copy L1 pages to new L2 pages (D2H), index them, queue their L3 write.

        ``keys``: storage keys (SWA keys for SWA); ``base``: their full-KV page
        keys (named in tier events); ``parents`` (full KV): the key of the page
        before each (L2 evicts a page only after the pages extending it).  L2 pages
        a load under way reads are not evicted for room.  O(pages).
        """
        n = len(keys)
        if n == 0:
            return
        plain = kind is AttnKind.SWA and anchored is not None and not np.asarray(anchored, bool).all()
        if plain and np.asarray(anchored, bool).any():  # anchored windows first, then plain SWA on its own terms
            a = np.asarray(anchored, bool)
            for sel in (a, ~a):
                idx = np.flatnonzero(sel)
                self.store_l2(kind, l1_pages[idx], [keys[i] for i in idx], a[idx],
                              None if base is None else [base[i] for i in idx])
            return
        host = self.host
        protect_full, protect_swa = self.protected()
        # plain SWA (it ends no kept window: L2 drops it first) displaces only older plain SWA,
        # never full KV or anchored windows (DESIGN: under pressure, SWA that unlocks the fewest
        # hits goes first, before full KV)
        got = host.alloc(n if kind is AttnKind.FULL else 0, n if kind is AttnKind.SWA else 0,
                         protect=protect_full, protect_swa=protect_swa, plain_only=plain)
        if got is None:
            self.counters["l2_store_failed"] += n
            return
        host_pages = got[0] if kind is AttnKind.FULL else got[1]
        try:
            self.copy(kind, self.pool, l1_pages, host.pool, host_pages)
        except BaseException:
            host.free(host_pages if kind is AttnKind.FULL else _EMPTY,
                         host_pages if kind is AttnKind.SWA else _EMPTY)
            raise
        if kind is AttnKind.FULL:
            host.insert_full(keys, host_pages, parents)
        else:
            host.insert_swa(keys, host_pages, anchored if anchored is not None else np.ones(n, bool), base)
        c = self.counters
        c["l1_to_l2_full_pages" if kind is AttnKind.FULL else "l1_to_l2_swa_pages"] += n
        c["bytes_d2h"] += n * self.codec.nominal_bytes(kind)
        sel = None
        if kind is AttnKind.SWA and self.tiers.l3_swa is L3Swa.ANCHORED and anchored is not None:
            sel = np.asarray(anchored, bool)
        self.writes.queue(kind, keys, host_pages, sel, base=base)

    def on_l1_free(self, kind: AttnKind, pages: np.ndarray) -> None:
        """The L1 tree frees ``pages`` (a tree free listener): drop their keys, and
        copy to L2 first those L2 lacks: under write-back every page, under
        write-through those L2 evicted as copies of L1 pages (``l1_copies_first``;
        repair case 1, device complete and host deficient).  Never raises.  O(pages)."""
        try:
            with self.mutex:
                if kind is AttnKind.FULL:
                    named_full = [self._full_key.pop(p, None) for p in pages.tolist()]
                    keys = [None if x is None else x[0] for x in named_full]
                    self.host.mark_l1([k for k in keys if k is not None], False)
                    bases = anchored = None
                else:
                    pairs = [self._swa_key.pop(p, None) for p in pages.tolist()]
                    keys = [None if x is None else swa_key(x[0]) for x in pairs]
                    bases = [None if x is None else x[0] for x in pairs]
                    anchored = np.array([bool(x and x[1]) for x in pairs], dtype=bool)
                if self.tiers.write_policy is not WritePolicy.WRITE_BACK and not self.host.l1_copies_first:
                    return  # write-through keeps L2's copy (unless L2 evicted it as a copy: below)
                sel = np.array([k is not None for k in keys], dtype=bool)
                if kind is AttnKind.SWA and self.pool.groups:
                    sel &= self.pool.held_by_all(pages)
                if not sel.any():
                    return
                named = [keys[i] for i in np.flatnonzero(sel).tolist()]
                have = (self.host.lookup_full(named) if kind is AttnKind.FULL else self.host.lookup_swa(named)) >= 0
                idx = np.flatnonzero(sel)[~have]
                self.store_l2(kind, pages[idx], [keys[i] for i in idx],
                              None if anchored is None else anchored[idx],
                              base=None if bases is None else [bases[i] for i in idx],
                              parents=[named_full[i][1] for i in idx] if kind is AttnKind.FULL else None)
        except Exception as exc:  # noqa: BLE001 - freeing must go on; the backup is best effort
            self.counters["tier_errors"] += 1
            logger.warning("L1 -> L2 backup failed (%s: %s); pages dropped", type(exc).__name__, exc)
