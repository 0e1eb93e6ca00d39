"""L1 -> L2 copies of a tier coordinator, and the names of the pages L1 caches.

:class:`L2Backup` names the pages a request hands the L1 tree (their chained
keys and whether their SWA ends a kept window, a
:class:`~hybridkv.radix.PageNames` the tree keeps on its nodes and hands back
with every page it frees), tells L2 which keys L1 holds, copies pages down as
the write policy asks (``write_through``: a request's pages when it finishes;
``write_back``: a page when the tree frees it, through the tree's
``free_listeners``), and queues what enters L2 for L3.

Repair cases (the MiMo stack's four): 1. device SWA the host lacks is copied
down at prefill end under both policies; 4. retention checkpoints apply below
L1: SWA pages that end a sequence or a checkpoint window are anchored (L2
evicts unanchored SWA first, L3 receives only anchored SWA with
``l3_swa="anchored"``), and the window that ends a hit is anchored in the L1
tree's names and in L2 and queued for L3 (:meth:`L2Backup.anchor_hit_window`).
A finished request's earlier anchored windows that it moved past (neither
its tail, a checkpoint nor its hit's window) become plain SWA in L2.
"""

from __future__ import annotations

import logging
from collections import Counter
from threading import RLock
from typing import Any, Callable, Iterator

import numpy as np

from ..pools import DualPool
from ..radix import PageNames, TreeNode, WindowSafeTree
from ..radix.node import unrecorded
from ..request import Request, swa_held
from ..modes import L3Swa, WritePolicy
from ..spec import AttnKind
from .config import TierConfig
from .host import HostTier
from .keys import parent_keys
from .payload import PayloadCodec, swa_key
from .records import record_rows
from .writes import L3WriteQueue

#: copies pages of a kind between two pools: ``copy(kind, src, src_pages, dst, dst_pages)``
PageCopy = Callable[[AttnKind, Any, np.ndarray, Any, np.ndarray], None]

__all__ = ["L2Backup"]

logger = logging.getLogger("hybridkv.tiers")
_EMPTY = np.zeros(0, dtype=np.int32)


class L2Backup:
    """The names of L1's pages and the L1 -> L2 copies of a tier coordinator.

    Args:
        tree / pool: L1 (the tree keeps its pages' names; its retention policy
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
        orphan: told the pages L2 stores that no entry records (names freed
            without records: :meth:`HostRecords.orphan <hybridkv.tiers.records.HostRecords.orphan>`).
    """

    def __init__(self, tree: WindowSafeTree, pool: DualPool, host: HostTier, writes: L3WriteQueue,
                 codec: PayloadCodec, tiers: TierConfig, counters: dict[str, int], mutex: RLock, *,
                 window_pages: int, copy: PageCopy, protected: Callable[[], tuple[set[int], set[int]]],
                 orphan: Callable[[AttnKind, list[bytes], np.ndarray], None]) -> None:
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
        self.orphan = orphan

    # =============================================================== names
    def name_pages(self, req: Request, aligned: int, keys: list[bytes]) -> PageNames:
        """The names of ``req``'s pages ``[0, aligned)`` for the finish's insert (the
        tree keeps those of the pages it takes, :class:`PageNames`); L2 learns that
        L1 holds its own pages ``[tree_pages, aligned)``.  O(pages)."""
        lo = req.tree_pages
        anchored = np.zeros(aligned, dtype=bool)
        swa = req.swa_pages[lo:aligned]
        idx = lo + np.flatnonzero(swa >= 0)
        anchored[idx] = self._anchored(idx, aligned)
        self.host.mark_l1(keys[lo:aligned], True)
        return PageNames(keys[:aligned], anchored)

    def name_loaded(self, full_idx: np.ndarray, keys: list[bytes], hit: int) -> PageNames:
        """The names of pages ``[0, hit)`` of ``keys`` an L2 -> L1 load inserts (its SWA
        anchored); L2 learns that L1 holds the loaded full pages ``full_idx``.  O(pages)."""
        self.host.mark_l1([keys[i] for i in full_idx.tolist()], True)
        return PageNames(keys[:hit], np.ones(hit, dtype=bool))

    def load_failed(self, full_idx: np.ndarray, keys: list[bytes]) -> None:
        """A load that failed: L1 does not hold the full pages ``full_idx``.  O(pages)."""
        self.host.mark_l1([keys[i] for i in full_idx.tolist()], False)

    def check_names(self) -> None:
        """Every page the L1 tree holds is named, and L2's count of the L1 pages
        holding each key is the tree's.  O(n)."""
        held: Counter[bytes] = Counter()
        for nd in self.tree.iter_nodes():
            assert nd.page_keys is not None, f"an unnamed L1 node {nd}"
            held.update(k for k in nd.page_keys if k is not None)
        assert held == Counter(self.host.l1_counts()), "L1 pages and L2's count of them differ"

    def _path(self, req: Request, pages: int) -> Iterator[tuple[TreeNode, int, int, np.ndarray]]:
        """``(node, first page, pages, held)`` along the tree path of ``req``'s first
        ``pages`` pages; ``held``: bool per page, the node holds ``req``'s SWA page
        there.  O(depth + pages)."""
        _, path = self.tree.walk(req.tokens, req.namespace, pages * self.tree.page_size)
        pos = 0
        for nd, k in path:
            mine = req.swa_pages[pos:pos + k]
            yield nd, pos, k, (nd.swa[:k] == mine) & (mine >= 0)
            pos += k

    def _held_marks(self, req: Request, pages: int) -> np.ndarray:
        """bool per page of ``[0, pages)``: the tree holds ``req``'s SWA page there and
        names it anchored.  O(depth + pages)."""
        out = np.zeros(pages, dtype=bool)
        for nd, pos, k, held in self._path(req, pages):
            if nd.tier_anchor is not None:
                out[pos:pos + k] = nd.tier_anchor[:k] & held
        return out

    def _anchored(self, idx: np.ndarray, end: int) -> np.ndarray:
        """Which page indices end a kept window: the tail before ``end`` or a checkpoint
        (the tree's :class:`~hybridkv.radix.policy.RetentionPolicy` decides, as in L1)."""
        return self.tree.policy.tier_anchored(idx, end)

    def anchor_hit_window(self, req: Request, keys: list[bytes], h: int) -> None:
        """Anchor the SWA window ``[h - W, h)`` that ends this hit (repair case 4).

        The tree's names of the window's L1 pages become anchored (write-back then
        stores them anchored when the tree frees them, and write-through's
        backup at finish keeps the flag); L2 copies are promoted to the
        anchored class and queued for L3 if not known there.  O(window pages).
        """
        lo = max(0, h - self.window_pages)
        for nd, pos, k, held in self._path(req, h):
            if nd.tier_anchor is not None and pos + k > lo:
                a = max(lo - pos, 0)
                nd.tier_anchor[a:k] |= held[a:]
        swa_keys = [swa_key(k) for k in keys[lo:h]]
        pages = self.host.lookup_swa(swa_keys)
        have = pages >= 0
        if have.any():
            held = [k for k, o in zip(swa_keys, have.tolist()) if o]
            self.host.anchor(held)
            self.writes.queue(AttnKind.SWA, held, pages[have], base=[k for k, o in zip(keys[lo:h], have) if o])

    # ============================================================== copies
    def at_finish(self, req: Request, aligned: int, keys: list[bytes]) -> np.ndarray:
        """Copy ``req``'s pages ``[0, aligned)`` to L2 as the write policy asks:
        write-through all the full KV L2 lacks, and the SWA L2 lacks (write-back:
        only where L2 holds the full KV, repair case 1).  Returns where L2 holds each
        page as it found or stored it (``host_at`` rows, :mod:`.records`; each stamp
        read when its slot held the page).  O(pages)."""
        through = self.tiers.write_policy is WritePolicy.WRITE_THROUGH
        self._demote_passed(req, aligned, keys)
        rows = unrecorded(aligned)
        record_rows(self.host, rows, AttnKind.FULL, np.arange(aligned), self.host.lookup_full(keys[:aligned]))
        have_full = rows[:, 0] >= 0
        if through:
            missing_full = np.flatnonzero(~have_full)
            record_rows(self.host, rows, AttnKind.FULL, missing_full,
                        self.store_l2(AttnKind.FULL, req.full_pages[missing_full], [keys[i] for i in missing_full],
                                      None, parents=parent_keys(keys, missing_full.tolist())))
            have_full[:] = True
        # a tier copies an SWA page only where every sliding group still holds its KV
        idx = np.flatnonzero(swa_held(req.swa_pages, req.side_pages, aligned))
        if not through:
            idx = idx[have_full[idx]]
        if idx.size == 0:
            return rows
        swa_keys = [swa_key(keys[i]) for i in idx]
        record_rows(self.host, rows, AttnKind.SWA, idx, self.host.lookup_swa(swa_keys))
        missing = rows[idx, 2] < 0
        idx = idx[missing]
        if not through:
            self.counters["repair_swa_d2h_pages"] += idx.size
        pages = req.swa_pages[idx]
        # A window the tree names anchored (it ended a hit) keeps its anchor.
        tree_pages = min(req.tree_pages, aligned)
        marked = np.zeros(idx.size, dtype=bool)
        if idx.size and idx[0] < tree_pages:
            marked = self._held_marks(req, tree_pages)[np.minimum(idx, tree_pages - 1)] & (idx < tree_pages)
        record_rows(self.host, rows, AttnKind.SWA, idx,
                    self.store_l2(AttnKind.SWA, pages, [k for k, m in zip(swa_keys, missing) if m],
                                  self._anchored(idx, aligned) | marked, base=[keys[i] for i in idx]))
        return rows

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
                 parents: list[bytes | None] | None = None) -> np.ndarray:
        """Copy L1 pages to new L2 pages (D2H), index them, queue their L3 write;
        returns the host page of each key (int64, all ``-1`` when L2 had no room).

        ``keys``: storage keys (SWA keys for SWA); ``base``: their full-KV page
        keys (named in tier events); ``parents`` (full KV): the key of the page
        before each (L2 evicts a page only after the pages extending it).  L2 pages
        a load under way reads are not evicted for room.  O(pages).
        """
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return out
        plain = kind is AttnKind.SWA and anchored is not None and not np.asarray(anchored, bool).all()
        if plain and np.asarray(anchored, bool).any():  # anchored windows first, then plain SWA on its own terms
            a = np.asarray(anchored, bool)
            for sel in (a, ~a):
                idx = np.flatnonzero(sel)
                out[idx] = self.store_l2(kind, l1_pages[idx], [keys[i] for i in idx], a[idx],
                                         None if base is None else [base[i] for i in idx])
            return out
        host = self.host
        protect_full, protect_swa = self.protected()
        # plain SWA (it ends no kept window: L2 drops it first) displaces only older plain SWA,
        # never full KV or anchored windows (DESIGN: under pressure, SWA that unlocks the fewest
        # hits goes first, before full KV)
        got = host.alloc(n if kind is AttnKind.FULL else 0, n if kind is AttnKind.SWA else 0,
                         protect=protect_full, protect_swa=protect_swa, plain_only=plain)
        if got is None:
            self.counters["l2_store_failed"] += n
            return out
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
        return host_pages.astype(np.int64)

    def on_l1_free(self, kind: AttnKind, pages: np.ndarray, names: PageNames | None) -> None:
        """The L1 tree frees ``pages`` named ``names`` (a tree free listener): L2 learns
        L1 gave them up, and copies first those it lacks: under write-back every page, under
        write-through those L2 evicted as copies of L1 pages (``l1_copies_first``;
        repair case 1, device complete and host deficient).  Never raises.  O(pages)."""
        try:
            with self.mutex:
                if names is None or not pages.size:
                    return
                if kind is AttnKind.FULL:
                    keys = names.keys
                    self.host.mark_l1([k for k in keys if k is not None], False)
                    bases = anchored = None
                else:
                    bases = names.keys
                    keys = [None if k is None else swa_key(k) for k in bases]
                    anchored = names.anchored
                if self.tiers.write_policy is not WritePolicy.WRITE_BACK and not self.host.l1_copies_first:
                    return  # write-through keeps L2's copy (unless L2 evicted it as a copy: below)
                sel = np.array([k is not None for k in keys], dtype=bool)
                if kind is AttnKind.SWA and self.pool.groups:
                    sel &= self.pool.held_by_all(pages)
                if not sel.any():
                    return
                named = [keys[i] for i in np.flatnonzero(sel).tolist()]
                slots = self.host.lookup_full(named) if kind is AttnKind.FULL else self.host.lookup_swa(named)
                # where L2 holds each page is recorded on the names (they reach the pages' entries:
                # the run eviction made of them, or the node that keeps them: FreedPages); names
                # without records: no entry records them, the pages L2 stores become orphans
                rows = names.host_at if names.host_at is not None else unrecorded(len(keys))
                record_rows(self.host, rows, kind, np.flatnonzero(sel), slots)
                idx = np.flatnonzero(sel)[slots < 0]
                stored = self.store_l2(
                    kind, pages[idx], [keys[i] for i in idx], None if anchored is None else anchored[idx],
                    base=None if bases is None else [bases[i] for i in idx],
                    parents=[names.parents[i] for i in idx] if kind is AttnKind.FULL and names.parents else None)
                record_rows(self.host, rows, kind, idx, stored)
                if names.host_at is None:
                    self.orphan(kind, [keys[i] for i in idx], stored)
        except Exception as exc:  # noqa: BLE001 - freeing must go on; the backup is best effort
            self.counters["tier_errors"] += 1
            logger.warning("L1 -> L2 backup failed (%s: %s); pages dropped", type(exc).__name__, exc)
