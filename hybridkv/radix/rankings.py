"""Rankings: which cached leaf eviction takes next.  Plug-ins of the prefix index.

The index (:class:`~hybridkv.radix.tree.WindowSafeTree`) keeps the structure;
a ranking keeps its own view of the leaves and learns from what the index
tells it, through one small interface (:class:`Ranking`):

========================  ==================================================
``touch(node, now)``      a request used ``node`` (sets its recency)
``refresh(node, now)``    the request already counted still uses ``node``
``leaf_ready(node)``      ``node`` may be an evictable leaf now
``rebuild(leaves)``       the index dropped stale heap entries: re-file these
``missed(ns, pos, g)``    a match stopped at token ``pos`` (page name ``g``)
``matched_before_touch``  a match reached leaf ``last`` (before the index
                          refreshes the path's recency); returns a token
``matched_after_touch``   ... and after, with that token
``leaf_added(...)``       the index made a new leaf
``node_split(up, low)``   ``low`` was cut; ``up`` is its new upper half
``victim()``              the leaf to evict next (None: none)
``leaf_shrunk(...)``      an evicted leaf lost pages (trimmed or removed)
``leaf_removed(...)``     an evicted leaf left the tree
``check(nodes)``          its invariants over the index's nodes
========================  ==================================================

Per-node state a ranking owns lives in the node's ranking slots (``seg``,
``vcls``, ``since``, ``returns``, ``gap``; :class:`~hybridkv.radix.node.TreeNode`);
the index never reads or writes them.  Every ranking keeps ARC's two segments
(``RECENT`` / ``REUSED`` pages, :class:`~hybridkv.radix.policy.AdaptiveRanking`):
``pages`` counts them for every mode.

Two families:

* :class:`SegmentRanking` (``"adaptive"``, ``"arc"``, ``"lru"``): two lazy
  heaps of leaves by recency, one per segment, and ARC's rule between them.
* :class:`ValueRanking` (``"value"``): leaves filed by reuse class, each class
  in recency order; the victim has the lowest learned hit density
  (:class:`~hybridkv.radix.reuse.ReuseModel`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from .node import TreeNode
from .policy import AdaptiveRanking
from .reuse import BUCKETS as _AGE_BUCKETS, EDGES as _AGE_EDGES, INV_WIDTH as _AGE_INV_WIDTH
from .reuse import ReuseModel, next_gap, reuse_class

__all__ = ["Ranking", "SegmentRanking", "ValueRanking", "make_ranking"]

RECENT, REUSED = AdaptiveRanking.RECENT, AdaptiveRanking.REUSED
_HISTORY = 4096  # entries a "came back" memo holds before it is cleared


class Ranking:
    """The interface (see the module docstring); also ARC's segment book-keeping
    every ranking shares.  ``tick`` reads the index's clock."""

    def __init__(self, mode: str, tick) -> None:  # noqa: ANN001 - a zero-argument callable
        self.mode = mode
        self.segments = AdaptiveRanking(mode)
        self.pages = self.segments.pages  # RECENT / REUSED -> pages (shared dict)
        self.reuse = ReuseModel()  # learned by the "value" ranking (idle in the others)
        self._clock = tick

    # -- recency -----------------------------------------------------------
    def touch(self, node: TreeNode, now: int) -> None:
        """A request used ``node`` at ``now``.  A node used again moves to REUSED."""
        self._promote(node, now)

    def refresh(self, node: TreeNode, now: int) -> None:
        """The request that made ``node`` (or matched it, already counted) is still
        using it at ``now``: recency only, not a new use (no promotion)."""
        node.last_access = now

    def _promote(self, node: TreeNode, now: int) -> bool:
        """Stamp ``node``'s access; True when it moved from RECENT to REUSED."""
        node.last_access = now
        if node.seg != RECENT:
            return False
        node.seg = REUSED
        n = len(node.full)
        self.pages[RECENT] -= n
        self.pages[REUSED] += n
        return True

    def leaf_ready(self, node: TreeNode) -> None:
        """``node`` is an unlocked leaf: file it as a candidate."""

    def rebuild(self, leaves: list[TreeNode]) -> None:
        """Replace the candidates by ``leaves`` (the unlocked leaves)."""

    def heap_entries(self) -> int:
        """Entries of the ranking's lazy heaps (0: none)."""
        return 0

    def heap_sizes(self) -> dict[str, int]:
        return {}

    # -- matches -----------------------------------------------------------
    def missed(self, namespace: str, pos: int, ghost: int) -> None:
        """A match stopped at token ``pos``; ``ghost`` names the page there."""

    def matched_before_touch(self, last: TreeNode, namespace: str, pos: int, *, diverged: bool) -> bool:
        """A match's walk ended in ``last`` at token ``pos``; ``diverged``: the
        request leaves the sequence inside it.  Returns a token for
        :meth:`matched_after_touch`."""
        return False

    def matched_after_touch(self, last: TreeNode, token: bool) -> None:
        """The index refreshed the matched path's recency."""

    def leaves_hint(self, num_nodes: int) -> int:
        """How many leaves compete for memory (for the divergence model's cost)."""
        return num_nodes

    # -- structure ---------------------------------------------------------
    def leaf_added(self, leaf: TreeNode, parent: TreeNode, *, parent_is_root: bool, was_leaf: bool,
                   pos: int, pages: int) -> None:
        """The index added ``leaf`` (``pages`` pages at token ``pos``) under
        ``parent``; ``was_leaf``: ``parent`` had no children before."""
        extends_reused = not parent_is_root and was_leaf and parent.seg == REUSED
        leaf.seg = self.segments.start_segment(extends_reused=extends_reused)
        self._place(leaf, parent, parent_is_root, pos)
        self.pages[leaf.seg] += pages
        self._filed(leaf, parent, parent_is_root, pos)

    def _place(self, leaf: TreeNode, parent: TreeNode, parent_is_root: bool, pos: int) -> None:
        """Adjust a new leaf's segment before its pages are counted."""

    def _filed(self, leaf: TreeNode, parent: TreeNode, parent_is_root: bool, pos: int) -> None:
        """File a new leaf after its pages are counted."""

    @staticmethod
    def node_split(upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` became ``lower``'s parent (a split): it is in the same segment."""
        upper.seg = lower.seg

    # -- eviction ----------------------------------------------------------
    def evict_started(self) -> None:
        """An eviction begins (time stands still until :meth:`evict_done`)."""

    def evict_done(self) -> None:
        """The eviction ended."""

    def victim(self) -> TreeNode | None:
        """The unlocked leaf to evict next, or None."""
        raise NotImplementedError

    def leaf_shrunk(self, node: TreeNode, ghost: int, gone: int) -> None:
        """Evicted leaf ``node`` lost ``gone`` pages, the first named ``ghost``."""
        self.pages[node.seg] -= gone

    def leaf_removed(self, node: TreeNode, parent: TreeNode, ghost: int, num_nodes: int) -> None:
        """``node`` left the tree (its parent, ``parent``, may be a leaf now)."""

    # -- checks ------------------------------------------------------------
    def check(self, nodes: list[TreeNode]) -> None:
        """Segment sizes equal the nodes' pages; AssertionError otherwise."""
        pages = {RECENT: 0, REUSED: 0}
        for node in nodes:
            pages[node.seg] += node.n_pages
        assert pages == self.pages, (pages, self.pages)


def _alive_leaf(node: TreeNode) -> bool:
    return node.key is not None and not node.children and not node.lock and node.parent is not None


class SegmentRanking(Ranking):
    """``"adaptive"`` / ``"arc"`` / ``"lru"``: the least recently used leaf of
    the segment ARC's rule names (``"lru"``: of both).  Lazy heaps: touching a
    leaf costs O(1); stale entries are refreshed when they reach the top."""

    def __init__(self, mode: str, tick) -> None:  # noqa: ANN001
        super().__init__(mode, tick)
        self._recent_heap: list[tuple[int, int, TreeNode]] = []
        self._reused_heap: list[tuple[int, int, TreeNode]] = []
        self._ghost_hits: set[tuple[str, int]] = set()  # where a match hit a ghost: its re-insert is proven reuse

    def touch(self, node: TreeNode, now: int) -> None:
        if self._promote(node, now) and not node.children and node.lock == 0:
            heapq.heappush(self._reused_heap, (now, node.nid, node))

    def leaf_ready(self, node: TreeNode) -> None:
        heapq.heappush(self._recent_heap if node.seg == RECENT else self._reused_heap, (node.last_access, node.nid, node))

    def rebuild(self, leaves: list[TreeNode]) -> None:
        recent = [(n.last_access, n.nid, n) for n in leaves if n.seg == RECENT]
        reused = [(n.last_access, n.nid, n) for n in leaves if n.seg != RECENT]
        heapq.heapify(recent)
        heapq.heapify(reused)
        self._recent_heap, self._reused_heap = recent, reused

    def heap_entries(self) -> int:
        return len(self._recent_heap) + len(self._reused_heap)

    def heap_sizes(self) -> dict[str, int]:
        return {"leaf": len(self._recent_heap), "reused": len(self._reused_heap)}

    def missed(self, namespace: str, pos: int, ghost: int) -> None:
        if self.segments.on_miss(ghost, self._clock()):
            if len(self._ghost_hits) > _HISTORY:
                self._ghost_hits.clear()
            self._ghost_hits.add((namespace, pos))

    def _place(self, leaf: TreeNode, parent: TreeNode, parent_is_root: bool, pos: int) -> None:
        if self._ghost_hits and (leaf.namespace, pos) in self._ghost_hits:
            self._ghost_hits.discard((leaf.namespace, pos))
            leaf.seg = REUSED

    def _top(self, heap: list, seg: int) -> TreeNode | None:
        """The current top of a lazy leaf heap (stale entries dropped or refreshed)."""
        while heap:
            t, _, node = heap[0]
            if not _alive_leaf(node) or node.seg != seg:
                heapq.heappop(heap)
            elif t != node.last_access:
                heapq.heapreplace(heap, (node.last_access, node.nid, node))
            else:
                return node
        return None

    def victim(self) -> TreeNode | None:
        recent = self._top(self._recent_heap, RECENT)
        reused = self._top(self._reused_heap, REUSED)
        if recent is None or reused is None:
            pick = recent or reused
            if pick is None:
                return None
        elif self.mode == "lru":
            pick = recent if (recent.last_access, recent.nid) < (reused.last_access, reused.nid) else reused
        else:
            pick = recent if self.segments.evict_from(recent_available=True, reused_available=True) == RECENT else reused
        heapq.heappop(self._recent_heap if pick.seg == RECENT else self._reused_heap)
        return pick

    def leaf_shrunk(self, node: TreeNode, ghost: int, gone: int) -> None:
        self.pages[node.seg] -= gone
        self.segments.remember(node.seg, ghost, gone)  # ARC's ghost lists steer the segment rule


class ValueRanking(Ranking):
    """``"value"``: the leaf least likely to pay back the memory it holds.

    Leaves are filed by reuse class (``returns`` and ``gap`` of the sequence,
    :func:`~hybridkv.radix.reuse.reuse_class`), most recent last; each filed
    leaf has an open at-risk period from ``since``.  A return (a later match
    reaching the leaf) or an eviction ends it; :class:`ReuseModel` learns the
    return hazard per class and idle time from the periods."""

    def __init__(self, mode: str, tick) -> None:  # noqa: ANN001
        super().__init__(mode, tick)
        self._by_class: list[OrderedDict[int, TreeNode]] = [OrderedDict() for _ in range(ReuseModel.CLASSES)]
        self._victims: list | None = None  # candidates ranked in this eviction
        self._ghost_returns: dict[tuple[str, int], tuple[int, float]] = {}   # a ghost that came back
        # (namespace, pos) -> history of a sequence a request left at pos (diverged): the node
        # that ends at pos after the request's insert is the part that came back
        self._branch_returns: dict[tuple[str, int], tuple[int, float]] = {}

    def touch(self, node: TreeNode, now: int) -> None:
        if node.vcls >= 0:
            self._by_class[node.vcls].move_to_end(node.nid)
        self._promote(node, now)

    def refresh(self, node: TreeNode, now: int) -> None:
        if node.vcls >= 0:
            self._by_class[node.vcls].move_to_end(node.nid)
        node.last_access = now

    def filed_leaves(self) -> int:
        return sum(map(len, self._by_class))

    def leaves_hint(self, num_nodes: int) -> int:
        return self.filed_leaves()

    def _file(self, node: TreeNode, cls: int | None = None, since: int | None = None) -> None:
        """File leaf ``node`` under its reuse class, most recent last.  A new at-risk
        period starts at its last use, unless ``cls``/``since`` carry on an existing one."""
        if cls is None:
            cls, since = reuse_class(node.returns, node.gap), node.last_access
            self.reuse.start(cls, since)
        node.since = since  # type: ignore[assignment]
        self._by_class[cls][node.nid] = node
        node.vcls = cls

    def _unfile(self, node: TreeNode, end: bool) -> None:
        """Take ``node`` out of the filed leaves; ``end``: its period ends here (no return)."""
        if node.vcls < 0:
            return
        del self._by_class[node.vcls][node.nid]
        if end:
            self.reuse.end(node.vcls, node.since, self._clock(), returned=False)
        node.vcls = -1

    def missed(self, namespace: str, pos: int, ghost: int) -> None:
        came_back = self.reuse.on_miss(ghost, self._clock())
        if came_back is not None:  # the re-inserted sequence keeps its history
            if len(self._ghost_returns) > _HISTORY:
                self._ghost_returns.clear()
            self._ghost_returns[(namespace, pos)] = came_back

    def matched_before_touch(self, last: TreeNode, namespace: str, pos: int, *, diverged: bool) -> bool:
        # a request that diverges inside the leaf brought the sequence back up to ``pos``: the
        # return counts for the leaf's class (its period ends), but the history goes to the node
        # that will end at ``pos`` (the branch point), not to the tail past it (crediting the tail
        # ranks worse than LRU on a trace of documents asked several questions)
        tick = self._clock()
        returned = last.vcls >= 0
        if diverged:  # the prefix up to pos came back
            if len(self._branch_returns) > _HISTORY:
                self._branch_returns.clear()
            self._branch_returns[(namespace, pos)] = (last.returns + 1, next_gap(last.gap, tick - last.last_access))
        if returned:  # a cached sequence came back: its period ends with a return
            self.reuse.end(last.vcls, last.since, tick, returned=True)
            self._unfile(last, end=False)
            if not diverged:
                last.returns += 1
                last.gap = next_gap(last.gap, tick - last.since)
        return returned

    def matched_after_touch(self, last: TreeNode, token: bool) -> None:
        if token and last.key is not None and not last.children:
            self._file(last)  # a tail the request left: its period restarts at its last use

    def _filed(self, leaf: TreeNode, parent: TreeNode, parent_is_root: bool, pos: int) -> None:
        # the next turn of a sequence inherits its history; so does one whose ghost was hit
        ns = leaf.namespace
        if not parent_is_root and len(parent.children) == 1:
            leaf.returns, leaf.gap = parent.returns, parent.gap
        if self._branch_returns and not parent_is_root:
            history = self._branch_returns.pop((ns, pos), None)
            if history is not None and history[0] > parent.returns:
                parent.returns, parent.gap = history  # the branch point came back
        if self._ghost_returns:
            history = self._ghost_returns.pop((ns, pos), None)
            if history is not None and history[0] > leaf.returns:
                leaf.returns, leaf.gap = history
        cls = parent.vcls
        if cls >= 0 and cls == reuse_class(leaf.returns, leaf.gap):
            # the sequence's period (restarted by this request's match) moves on to its new tail
            since = parent.since
            self._unfile(parent, end=False)
            self._file(leaf, cls, since)
        else:
            self._unfile(parent, end=True)
            self._file(leaf)

    def evict_started(self) -> None:
        self._victims = None

    def evict_done(self) -> None:
        self._victims = None

    def victim(self, per_end: int = 4, max_skip: int = 64) -> TreeNode | None:
        """The lowest hit density (:meth:`ReuseModel.density
        <hybridkv.radix.reuse.ReuseModel.density>`: returns per tick held) among
        the ``per_end`` oldest and newest unlocked leaves of each class.  A return
        hazard that rises and then falls with idle time (a chat's think time) is
        lowest at one end of a class's recency order, so the ends are the
        candidates.  Ties (nothing learned yet) go to the least recently used.
        Within one eviction time stands still, so the ranked candidates are kept
        and served in order until they run out.  O(classes x per_end)."""
        ranked = self._victims
        if ranked:
            while ranked:
                node = ranked[-1][3]
                if node.key is not None and not node.children and not node.lock and node.vcls >= 0:
                    return node
                ranked.pop()
        ranked = self._rank(per_end, max_skip)
        if not ranked:
            return None
        ranked.sort(reverse=True)  # best victim last; a leaf at both ends of a class is listed twice
        self._victims = ranked
        return ranked[-1][3]

    def _rank(self, per_end: int, max_skip: int) -> list:
        tables, now, top = self.reuse.tables(), self._clock(), _AGE_BUCKETS
        edges, inv_width = _AGE_EDGES, _AGE_INV_WIDTH
        ranked = []
        for cls, filed in enumerate(self._by_class):
            if not filed:
                continue
            index = tables[cls]
            for oldest_first in (True, False):
                taken = skipped = 0
                for node in (iter(filed.values()) if oldest_first else reversed(filed.values())):
                    if node.lock:
                        skipped += 1
                        if skipped > max_skip:
                            break
                        continue
                    age = now - node.since
                    if age < 2:
                        b = age if age > 0 else 0
                    else:  # reuse.age_bucket, inlined: this loop is the eviction hot path
                        k = age.bit_length() - 1
                        b = 2 * k + ((age >> (k - 1)) & 1)
                        if b >= top:
                            b = top - 1
                    d = index[b] + (index[b + 1] - index[b]) * (age - edges[b]) * inv_width[b]
                    ranked.append((d, node.last_access, node.nid, node))
                    taken += 1
                    if taken >= per_end:
                        break
        return ranked

    def leaf_removed(self, node: TreeNode, parent: TreeNode, ghost: int, num_nodes: int) -> None:
        cls, since = node.vcls, node.since
        self._unfile(node, end=False)
        if parent.parent is not None and not parent.children:
            if parent.returns > node.returns:
                # requests branched off the parent: it came back on its own account
                if cls >= 0:
                    self.reuse.end(cls, since, self._clock(), returned=False)
                self._file(parent)
            else:
                # the parent is the same sequence, shorter: it carries the period on
                parent.returns, parent.gap = node.returns, node.gap
                if cls >= 0:
                    self._file(parent, cls, since)
                else:
                    self._file(parent)
        elif cls >= 0:  # watch for the sequence's return where its pages started
            # ghosts in proportion to what is cached (a few turnovers' worth of leaves)
            self.reuse.max_ghosts = 4 * num_nodes + 1024
            self.reuse.remember(ghost, cls, since, self._clock(), (node.returns, node.gap))

    def check(self, nodes: list[TreeNode]) -> None:
        """Segments, and every leaf filed once under its class with one open period."""
        super().check(nodes)
        leaves = {n.nid for n in nodes if not n.children}
        filed = {nid for cls, f in enumerate(self._by_class) for nid, n in f.items() if n.vcls == cls}
        assert leaves == filed and self.filed_leaves() == len(filed), (leaves ^ filed)
        assert self.reuse.open_periods() == len(filed) + self.reuse.ghost_count()


def make_ranking(mode: str, tick) -> Ranking:  # noqa: ANN001
    """The ranking for ``TreeConfig.ranking`` ``mode``; ``tick()`` reads the index's clock."""
    return (ValueRanking if mode == "value" else SegmentRanking)(mode, tick)

