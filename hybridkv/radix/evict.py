"""Eviction for the prefix index: what goes when a pool is short.

Order (:meth:`Eviction.evict`): unanchored SWA (LRU first), then leaves
(the ranking's victim, :mod:`~hybridkv.radix.rankings`, trimmed back to their
last hittable window when that frees enough), then predicted windows, then
anchored SWA.  SWA lives in three lazy heaps by recency (unanchored, predicted,
anchored): touching a node costs O(1), stale entries are refreshed when they
reach the top, and the heaps are rebuilt when they outgrow the live nodes.

:class:`Eviction` is a collaborator of :class:`~hybridkv.radix.tree.WindowSafeTree`:
it owns the heaps and the order; the index it evicts from (an
:class:`EvictableIndex`) unlinks leaves, keeps the page counts and gives pages
back to the pool.  Anchors, pins, the ranking, the divergence model and the
event listeners are its other named collaborators.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterator, Protocol

import numpy as np

from .anchors import WindowAnchors
from .divergence import DivergenceModel
from .events import TreeEvents
from .evicted import EvictedRuns
from .learning import ghost_key
from .node import NO_PAGE, TreeNode, trim_names
from .pins import SwaPins
from .policy import RetentionPolicy
from .rankings import Ranking
from .types import FreedPages, PageNames, SwaEviction, node_names

__all__ = ["EvictableIndex", "Eviction"]


class EvictableIndex(Protocol):
    """What eviction asks of the prefix index it evicts from."""

    num_nodes: int

    def iter_nodes(self, namespace: str | None = None) -> Iterator[TreeNode]: ...

    def detach_leaf(self, node: TreeNode) -> TreeNode: ...

    def uncount(self, full_pages: int, swa_pages: int) -> None: ...

    free_listeners: list

    def return_full_pages(self, pages: np.ndarray, names: PageNames | None = None) -> None: ...

    def return_swa_pages(self, pages: np.ndarray, names: PageNames | None = None) -> None: ...


class Eviction:
    """Eviction heaps and order for one prefix index.

    Args:
        index: the :class:`EvictableIndex` whose nodes are evicted.
        anchors: the index's :class:`WindowAnchors` (kept in step as pages go).
        ranking: chooses the leaf to evict (:mod:`~hybridkv.radix.rankings`).
        pins: pinned SWA pages are never evicted.
        divergence: hears what the last bytes evicted would have hit.
        events: told about every page removed.
        policy: the retention policy (window, branch points).
        runs: keeps the pages a leaf gives up as an evicted run (:mod:`~hybridkv.radix.evicted`).
        mode: :class:`~hybridkv.radix.types.SwaEviction`.
        page_size, full_page_bytes, swa_page_bytes: the page geometry.
        side_bytes: with several sliding groups, the bytes of one page of each
            side group (``TreeNode.side``); an SWA page freed also frees the
            side groups' pages its node still holds there.  ``()``: one group.

    Attributes: ``evicted_full_pages`` / ``evicted_swa_pages`` (totals).
    """

    def __init__(self, index: EvictableIndex, anchors: WindowAnchors, ranking: Ranking, pins: SwaPins,
                 divergence: DivergenceModel, events: TreeEvents, policy: RetentionPolicy, runs: EvictedRuns, *,
                 mode: SwaEviction, page_size: int, full_page_bytes: int, swa_page_bytes: int,
                 side_bytes: tuple[int, ...] = ()) -> None:
        self.index = index
        self.anchors = anchors
        self.ranking = ranking
        self.pins = pins
        self.divergence = divergence
        self.events = events
        self.policy = policy
        self.runs = runs
        self.mode = mode
        # the mode as flags: the checks run per heap push and per node visited, where an
        # enum member lookup costs ~8x a local attribute on Python 3.11
        self._page_mode = mode is SwaEviction.PAGE
        self._node_mode = mode is SwaEviction.NODE
        self._keeps_swa = mode is SwaEviction.NONE  # SWA lives and dies with full KV
        self.page_size = page_size
        self.full_page_bytes = full_page_bytes
        self.swa_page_bytes = swa_page_bytes
        self.side_bytes = side_bytes
        self._side_freed = 0  # bytes of side-group pages freed by the eviction under way
        self.evicted_full_pages = 0
        self.evicted_swa_pages = 0
        self._dead: list[TreeNode] = []  # leaves left without a held tail window: no hit can end in them
        self._swa_heap: list[tuple[int, int, TreeNode]] = []      # unanchored SWA first
        self._point_heap: list[tuple[int, int, TreeNode]] = []    # then predicted windows
        self._anchor_heap: list[tuple[int, int, TreeNode]] = []   # then tails/checkpoints

    def evict(self, full_pages: int = 0, swa_pages: int = 0, nbytes: int = 0) -> tuple[int, int]:
        """Free at least ``full_pages`` full pages, ``swa_pages`` SWA pages and
        ``nbytes`` bytes (weighted by page bytes), as far as unlocked data allows.

        Order: SWA that ends no likely hit (no anchor covers it), LRU first;
        then leaves, chosen by the ranking (:mod:`~hybridkv.radix.rankings`)
        and *trimmed* back to their last hittable window when that frees
        enough (else removed whole); then the divergence model's predicted
        windows, LRU first; then anchored SWA (tails, checkpoints, branch
        windows).  When only SWA is short (a SWA pool sized on its own), the
        predicted windows and then anchored SWA go before leaves.  When SWA cannot be
        evicted on its own (``swa_eviction="none"``/``"node"`` with pins),
        leaves are evicted for it.  Locked full KV and pinned SWA are never
        touched.  Returns the pages freed ``(full, swa)``.  Arguments are
        validated by the tree (:meth:`WindowSafeTree.evict`), which also holds
        the events back until the eviction is complete.
        Runtime: O(k log n) for k nodes visited.
        """
        self.ranking.evict_started()
        try:
            return self._evict(full_pages, swa_pages, nbytes)
        finally:
            self.ranking.evict_done()

    def _evict(self, full_pages: int, swa_pages: int, nbytes: int) -> tuple[int, int]:
        self.runs.hold()  # runs made here are capped after the listeners recorded on them
        try:
            return self._evict_held(full_pages, swa_pages, nbytes)
        finally:
            self.runs.settle()

    def _evict_held(self, full_pages: int, swa_pages: int, nbytes: int) -> tuple[int, int]:
        freed = FreedPages(bool(self.index.free_listeners))  # names only for listeners
        nf = ns = 0
        fb, sb = self.full_page_bytes, self.swa_page_bytes
        # several sliding groups: an SWA page frees the lead's bytes and those of the
        # side groups its node still holds there (counted as they go); else sb each
        self._side_freed = 0
        while True:
            short_full = full_pages - nf
            short_swa = swa_pages - ns
            short_bytes = nbytes - (nf * fb + ns * sb + self._side_freed)
            if short_full <= 0 and short_swa <= 0 and short_bytes <= 0:
                break
            got = (0, 0)
            if short_full > 0:
                got = self._evict_leaf(freed, short_full)
            elif short_swa > 0:
                got = self._evict_swa(freed, anchored=False)
                if got == (0, 0):
                    got = self._evict_point(freed)
                if got == (0, 0):
                    got = self._evict_swa(freed, anchored=True)
                if got == (0, 0):
                    got = self._evict_leaf(freed, None)
            else:
                got = self._evict_swa(freed, anchored=False)
                if got == (0, 0):
                    got = self._evict_leaf(freed, -(-short_bytes // fb))
                if got == (0, 0):
                    got = self._evict_point(freed)
                if got == (0, 0):
                    got = self._evict_swa(freed, anchored=True)
            if got == (0, 0):
                break
            nf += got[0]
            ns += got[1]
        freed.give_back(self.index)
        self.evicted_full_pages += nf
        self.evicted_swa_pages += ns
        return nf, ns

    def _pop_leaf(self) -> TreeNode | None:
        """The next evictable leaf: a dead one first (its pages serve no hit), then
        the ranking's victim (:mod:`~hybridkv.radix.rankings`)."""
        dead = self._dead
        while dead:
            node = dead.pop()
            if node.key is not None and not node.children and not node.lock and node.parent is not None:
                return node
        return self.ranking.victim()

    def _trim_point(self, node: TreeNode, want: int | None) -> int:
        """Pages of leaf ``node`` to keep: the longest prefix that frees >= ``want``
        pages and still ends at a held SWA window (a hit can end there); 0 = none."""
        wp = self.policy.window_pages
        n = len(node.full)
        if want is None or want >= n or n <= wp:
            return 0
        valid = (node.swa >= 0).astype(np.int32)
        c = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(valid, out=c[1:])
        q = np.arange(wp, n - want + 1)
        good = q[c[q] - c[q - wp] == wp]
        return int(good[-1]) if good.size else 0

    def _evict_leaf(self, freed: FreedPages, want: int | None) -> tuple[int, int]:
        node = self._pop_leaf()
        if node is None:
            return 0, 0
        anchors = self.anchors
        if want is not None and not anchors.window_held(node):
            want = 1  # dead: keep what still ends at a held window, free the rest
        keep = self._trim_point(node, want)
        size = self.page_size
        parent = node.parent
        assert parent is not None
        if node.ends:
            anchors.anchor_window(node, -1)
            node.ends = 0
        if node.points:  # predicted windows past what stays go with the pages
            first = node.start // size
            for p in node.points:
                if p > first + keep:
                    anchors.anchor_window(node, -1, p - first)
            node.points = [p for p in node.points if p <= first + keep] or None
        if node.mark >= node.start // size + keep:  # the prompt's end went with the pages
            node.mark = -1
        gone_full = node.full[keep:]
        swa = node.swa[keep:]
        swa = swa[swa >= 0]
        if node.side is not None:
            self._side_freed += self._side_bytes_of(node.side, slice(keep, None))
        names = node_names(node, keep) if freed.named else None
        freed.add_full(gone_full, names)
        if swa.size:
            held = node.swa[keep:] >= 0
            freed.add_swa(swa, names and names.select(held), (node.host_at, keep + np.flatnonzero(held)))
        gone = len(node.full) - keep
        self.index.uncount(gone, int(swa.size))
        pos = node.start + keep * size
        ghost = ghost_key(node.namespace, pos, node.key[keep * size:(keep + 1) * size])
        if self.policy.branch_points:  # what the last bytes evicted would have hit: the margin
            self.divergence.evicted(ghost, gone * self.full_page_bytes + int(swa.size) * self.swa_page_bytes,
                                    gone, 4 * self.index.num_nodes + 1024)
        self.ranking.leaf_shrunk(node, ghost, gone)
        if self.events.listeners:
            self.events.emit("remove", node, keep)
        self.runs.evicted(node, keep)
        if keep:  # trimmed: still a leaf, its tail window now ends at the new end
            node.key = node.key[:keep * size]
            node.full = node.full[:keep]
            node.swa = node.swa[:keep]
            if node.side is not None:
                node.side = [s[:keep] for s in node.side]
            trim_names(node, keep)
            node.anchor = node.anchor[:keep].copy()
            node.swa_valid -= int(swa.size)
            anchors.reanchor(node)
            self.enqueue(node, swa=False)
            return gone, int(swa.size)
        self.index.detach_leaf(node)
        self.ranking.leaf_removed(node, parent, ghost, self.index.num_nodes)
        if parent.parent is not None:
            anchors.reanchor(parent)
            self.enqueue(parent)  # may be a leaf now; its tail became a leaf tail
            if not parent.children and not parent.lock and not anchors.window_held(parent):
                self._dead.append(parent)
        return gone, int(swa.size)

    def _evict_swa(self, freed: FreedPages, *, anchored: bool) -> tuple[int, int]:
        """Free the SWA of the least recently used node holding some: its unanchored
        unpinned pages, or (``anchored``) all its unpinned pages.  Returns ``(0, freed)``."""
        if self._keeps_swa or (anchored and not self._page_mode):
            return 0, 0
        heap = self._anchor_heap if anchored else self._swa_heap
        while heap:
            t, _, node = heapq.heappop(heap)
            if node.key is None or not node.swa_valid or not self._fresh(heap, t, node):
                continue
            count = self._drop_swa(node, freed, anchored=anchored)
            if count:
                return 0, count
        return 0, 0

    def _evict_point(self, freed: FreedPages) -> tuple[int, int]:
        """Predicted windows give way before tails, checkpoints and branch windows (a
        bet on where requests will leave, while those end hits that happened): the
        least recently used node's predicted windows stop being anchors and their SWA
        that no other window anchors is freed.  Where the SWA pool is sized apart
        from full KV for one window per cached sequence, a predicted window kept over
        another sequence's tail cost that sequence its next hit.  Mutates the node's
        anchors, points and SWA.  Returns ``(0, freed)``.  O(window + log n)."""
        if not self._page_mode:
            return 0, 0
        heap = self._point_heap
        while heap:
            t, _, node = heapq.heappop(heap)
            if node.key is None or not node.points or not self._fresh(heap, t, node):
                continue
            first, wp = node.start // self.page_size, self.policy.window_pages
            above = False  # a window reaching above the node (cut by a split)
            for p in node.points:
                self.anchors.anchor_window(node, -1, p - first)
                above = above or p - first < wp
            node.points = None
            if above and node.parent is not None and node.parent.key is not None:
                self.enqueue(node.parent, leaf=False)  # its SWA there is plain SWA now
            count = self._drop_swa(node, freed, anchored=False) if node.swa_valid else 0
            if node.swa_valid:
                self.enqueue(node, leaf=False)
            if count:
                return 0, count
        return 0, 0

    def _drop_swa(self, node: TreeNode, freed: FreedPages, *, anchored: bool) -> int:
        """Free ``node``'s unpinned SWA pages (only unanchored ones unless ``anchored``;
        ``"node"`` eviction: all or none) into ``freed``.  Returns how many."""
        drop = node.swa >= 0
        # only a locked node can hold pinned pages (a tree invariant): skip the lookup otherwise
        pinned = self.pins.pinned(node.swa) if node.lock else None
        if self._node_mode:
            if pinned is not None and np.count_nonzero(pinned):
                return 0
        else:
            if pinned is not None:
                drop &= ~pinned
            if not anchored:
                drop &= node.anchor == 0
        count = int(np.count_nonzero(drop))
        if count == 0:
            return 0
        names = node_names(node) if freed.named else None
        freed.add_swa(node.swa[drop], names and names.select(drop), (node.host_at, np.flatnonzero(drop)))
        node.swa = node.swa.copy()
        node.swa[drop] = NO_PAGE
        if node.side is not None:  # the side groups' pages go with the lead's
            self._side_freed += self._side_bytes_of(node.side, drop)
            node.side = [np.where(drop, NO_PAGE, s).astype(np.int32) for s in node.side]
        node.swa_valid -= count
        self.index.uncount(0, count)
        if self.events.listeners:
            self.events.emit("swa_remove", node)
        return count

    def _side_bytes_of(self, side: list[np.ndarray], where: object) -> int:
        """Bytes of the side-group pages held at ``where`` (a slice or mask) of a
        node's ``side`` arrays.  O(pages x groups)."""
        return sum(int(np.count_nonzero(s[where] >= 0)) * b for s, b in zip(side, self.side_bytes))

    def watch_points(self, node: TreeNode) -> None:
        """``node`` holds predicted windows now (``node.points``): file it with them.  O(log n)."""
        heapq.heappush(self._point_heap, (node.last_access, node.nid, node))

    def mark_dead(self, node: TreeNode) -> None:
        """``node`` is a leaf whose pages end no hit: evict it before any ranked leaf.  O(1)."""
        self._dead.append(node)

    def enqueue(self, node: TreeNode, *, leaf: bool = True, swa: bool = True) -> None:
        """Make sure ``node`` has heap entries after a state change that can make
        it evictable (new leaf, unlocked, lost a child, gained SWA).  O(log n),
        O(n) when the heaps are rebuilt."""
        entry = (node.last_access, node.nid, node)
        if leaf and not node.children and node.lock == 0:
            self.ranking.leaf_ready(node)
        if swa and node.swa_valid and not self._keeps_swa:
            heapq.heappush(self._swa_heap, entry)
            if self._page_mode:
                heapq.heappush(self._anchor_heap, entry)
        # lazy heaps collect stale entries; rebuilding at 4x the live nodes keeps
        # memory O(nodes); every heap counts, the anchor heap included
        limit = self.heap_limit()
        if (len(self._swa_heap) > limit or len(self._anchor_heap) > limit or len(self._point_heap) > limit
                or self.ranking.heap_entries() > limit):
            self._rebuild_heaps()

    def heap_limit(self) -> int:
        """Entries a lazy heap may hold (stale ones included) before the heaps are
        rebuilt from the live nodes: 4x the nodes + 4096, so their memory is O(nodes)."""
        return 4 * self.index.num_nodes + 4096

    @staticmethod
    def _fresh(heap: list, t: int, node: TreeNode) -> bool:
        """True if a popped entry is current; a stale one is pushed back with the
        node's current recency (lazy LRU: touching a node costs O(1))."""
        if t == node.last_access:
            return True
        heapq.heappush(heap, (node.last_access, node.nid, node))
        return False

    def _rebuild_heaps(self) -> None:
        leaves, swa, points = [], [], []
        for node in self.index.iter_nodes():
            entry = (node.last_access, node.nid, node)
            if not node.children and node.lock == 0:
                leaves.append(node)
            if node.swa_valid:
                swa.append(entry)
                if node.points:
                    points.append(entry)
        self.ranking.rebuild(leaves)
        heapq.heapify(swa)
        heapq.heapify(points)
        self._point_heap = points
        self._swa_heap = swa
        self._anchor_heap = list(swa) if self._page_mode else []

    def heap_sizes(self) -> dict[str, int]:
        """Entries of each eviction heap (stale ones included: heaps are cleaned
        lazily, see :meth:`heap_limit`), for memory figures and soak tests."""
        return {"leaf": 0, "reused": 0, **self.ranking.heap_sizes(), "swa": len(self._swa_heap),
                "point": len(self._point_heap), "anchor": len(self._anchor_heap), "dead": len(self._dead)}
