"""Tree nodes and the window-safe length computation.

A node owns a page-aligned run of tokens and, per page, one page id per KV
group: the full page id, the lead SWA page id (the sliding group with the
largest window) and, on a model with several sliding windows, one id per other
sliding group (``side``); ``-1`` where the group's KV is not held.  Validity is per page,
which is per token when ``page_size == 1``: a page is the smallest unit the
pools can hold or free.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..window import safe_pages

__all__ = ["TreeNode", "EvictedRun", "node_array", "common_pages", "window_safe_pages", "NO_PAGE", "parts_pages",
           "parts_side"]

NO_PAGE = -1
EMPTY = np.zeros(0, dtype=np.int32)
_ids = itertools.count(1)


def node_array(part: np.ndarray, owned: bool) -> np.ndarray:
    """``part`` (of a caller's key or page ids) for a node to keep: a copy, unless the caller gave its arrays away and
    the view pins at most twice its own bytes (node arrays are never written in
    place: they are replaced by modified copies)."""
    base = part.base
    if owned and (base is None or base.nbytes <= 2 * part.nbytes):
        return part
    return part.copy()


class TreeNode:
    """One edge of the radix tree.

    Fields, by owner: structure (``key``, ``full``, ``swa``, ``side``, ``swa_valid``,
    ``children``, ``parent``, ``start``, ``namespace``, ``nid``), locking
    (``lock``), recency (``last_access``), retention (``anchor``, ``ends``,
    ``branched``, ``points``, ``mark``: :mod:`~hybridkv.radix.retention`) and the
    ranking's slots (``seg``, ``returns``, ``gap``, ``vcls``, ``since``: written
    only by :mod:`~hybridkv.radix.rankings`).

    Attributes:
        key: int32 token ids, ``len(key) == n_pages * page_size``.
        full: int32 full page ids, one per page.
        swa: int32 SWA page ids of the lead sliding group, one per page,
            ``NO_PAGE`` where not held.
        side: None with one sliding window; else one int32 array per other
            sliding group (the pool's ``groups`` order), one id per page:
            the group's page id where it holds its KV, ``NO_PAGE`` where it
            does not (it gave the page back, or the lead's is gone).  A side
            group's page shares the lead's row of blocks, so its id is the
            lead's id where held (``side[g][i] in (swa[i], NO_PAGE)``).
        start: position of the node's first token in its sequence.
        lock: requests holding this node's full KV (path lock: a lock on a
            node also counts on all its ancestors, so ``parent.lock >= lock``).
        swa_valid: number of pages with ``swa >= 0`` (kept in sync).
        anchor: int32 per page: how many anchor windows (tail, branch point,
            checkpoint; see :class:`~hybridkv.radix.policy.RetentionPolicy`)
            cover the page; its SWA is evicted last when > 0.
        ends: 1 while a tail or branch-point window ending at this node is
            counted in ``anchor`` (of this node and, if it spans, its ancestors).
        branched: the node has had two or more children at once (a proven
            branch point: a request diverged at its end); its end window stays
            an anchor while one child is left.
        points: absolute page numbers inside the node where a predicted window
            ends (``RetentionPolicy.pretail_pages`` before a new leaf's prompt end, where
            the learned divergence model expects requests to leave the sequence);
            each window is an anchor (counted in ``anchor``, walking into the
            parents if a split put part of it there).  None: no point.
        seg: eviction segment (:class:`~hybridkv.radix.policy.AdaptiveRanking`).
        returns: how many times the sequence ending here came back (a later
            request's match reached it); its reuse class for the ``"value"``
            ranking (:class:`~hybridkv.radix.reuse.ReuseModel`).
        gap: running mean of log2(1 + ticks between the sequence's returns), -1 if none.
        vcls: the reuse class list the leaf is filed in (-1: not filed).
        mark: where the prompt of the request that created the node ended, as an
            absolute page inside it, when its decoded output followed (-1: the
            node's end, or no prompt end inside it).  The learned divergence
            distance is measured from it, and the predicted window placed before it.
        since: start of the leaf's at-risk period (its last use, or that of
            the evicted child whose sequence it carries on).
        page_keys: with lower tiers, each page's chained key (the name L2 / L3
            store it under), else None; given by the insert that added the page
            (:class:`~hybridkv.radix.types.PageNames`), cut with the node.
        tier_anchor: with ``page_keys``, bool per page: its SWA ends a window
            the tiers keep (set by the insert, or when a hit ends there).
        host_at: with ``page_keys``, per page where L2 holds it as last recorded
            (int64 ``[pages, 2 * pairs]``: a (slot, stamp) column pair per KV the
            host keeps apart, the core's :data:`HOST_AT_COLUMNS`; valid only while
            L2's stamp of the slot matches, :mod:`hybridkv.tiers.slots`), cut with the node.
        evicted: the runs of pages L1 evicted that continue this node's end (first
            page's bytes -> run; :mod:`~hybridkv.radix.evicted`), None when none.
        inner: the runs that leave this node after its page ``j`` (``0 < j <
            n_pages``: ``j`` -> first page's bytes -> run; where the node would be
            split if they were L1 nodes), None when none.
    """

    __slots__ = ("key", "full", "swa", "side", "children", "parent", "start", "last_access",
                 "lock", "swa_valid", "nid", "namespace", "anchor", "ends", "branched", "points", "mark", "seg", "returns", "gap", "vcls",
                 "since", "page_keys", "tier_anchor", "host_at", "evicted", "inner")

    def __init__(self, key: np.ndarray, full: np.ndarray, swa: np.ndarray,
                 parent: "TreeNode | None", start: int, namespace: str, tick: int,
                 side: list[np.ndarray] | None = None) -> None:
        self.key = key
        self.full = full
        self.swa = swa
        self.side = side
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.start = start
        self.last_access = tick
        self.lock = 0
        self.swa_valid = int(np.count_nonzero(swa >= 0))
        self.nid = next(_ids)
        self.namespace = namespace
        self.anchor = np.zeros(len(full), dtype=np.int32)
        self.ends = 0
        self.branched = False
        self.points: list[int] | None = None
        self.mark = -1
        self.seg = 1
        self.returns = 0
        self.gap = -1.0
        self.vcls = -1
        self.since = tick
        self.page_keys: list[bytes | None] | None = None
        self.tier_anchor: np.ndarray | None = None
        self.host_at: np.ndarray | None = None
        self.evicted: dict[bytes, EvictedRun] | None = None
        self.inner: dict[int, dict[bytes, EvictedRun]] | None = None

    @property
    def n_pages(self) -> int:
        return len(self.full)

    @property
    def alive(self) -> bool:
        return self.key is not None

    def __lt__(self, other: "TreeNode") -> bool:  # heap tie-break, never used for order
        return self.nid < other.nid

    def __repr__(self) -> str:
        return (f"TreeNode(nid={self.nid}, start={self.start}, pages={self.n_pages}, "
                f"swa_valid={self.swa_valid}, lock={self.lock}, children={len(self.children)})")


class EvictedRun:
    """Pages L1 evicted, in order: their tokens and names, where L2 holds them as
    last recorded (``host_at``, as :attr:`TreeNode.host_at`), the runs evicted
    from under them (``below``: first page's bytes -> run, None when none) and
    those that leave them after page ``j`` (``inner``, as :attr:`TreeNode.inner`)."""

    __slots__ = ("key", "names", "host_at", "below", "home", "inner")

    def __init__(self, key: np.ndarray, names: list[bytes], host_at: np.ndarray | None = None) -> None:
        self.key = key
        self.names = names
        self.host_at = host_at if host_at is not None else unrecorded(len(names))
        self.below: dict[bytes, EvictedRun] | None = None
        self.home: dict[bytes, EvictedRun] | None = None  # the map it hangs in (None: dropped)
        self.inner: dict[int, dict[bytes, EvictedRun]] | None = None

    def __repr__(self) -> str:
        return f"EvictedRun(pages={len(self.names)}, below={len(self.below or ())}, inner={len(self.inner or ())})"


#: The columns of the core's ``host_at`` record: L2's slot of the page's full KV
#: and its stamp, then the same for its SWA (slot -1 and stamp 0: nothing
#: recorded).  A host whose pages hold more KV kinds apart (vLLM's KV-cache
#: groups, several blocks of a group per tree page) records one such
#: (slot, stamp) pair per kind and block, in its own column order.
HOST_AT_COLUMNS = ("full_slot", "full_stamp", "swa_slot", "swa_stamp")


def unrecorded(n: int, width: int = len(HOST_AT_COLUMNS)) -> np.ndarray:
    """A ``host_at`` record of ``n`` pages and ``width`` columns (an even number:
    (slot, stamp) pairs) with nothing recorded.  O(n * width)."""
    out = np.zeros((n, width), dtype=np.int64)
    out[:, 0::2] = -1
    return out


def take_records(rows: np.ndarray, new: np.ndarray, *, fill: bool = False) -> None:
    """Write into ``host_at`` ``rows`` each (slot, stamp) pair of ``new`` (same
    shape) that records something (stamp not 0), fresher than what is there;
    ``fill``: only where ``rows`` record nothing.  O(n * width)."""
    for c in range(1, new.shape[1], 2):
        at = np.flatnonzero((new[:, c] != 0) & (rows[:, c] == 0) if fill else new[:, c])
        if at.size:
            rows[at, c - 1:c + 1] = new[at, c - 1:c + 1]


def split_names(upper: TreeNode, node: TreeNode, pages: int) -> None:
    """A split hands the first ``pages`` pages' names and records of ``node`` to
    its new ``upper`` half (views of one array each, written in place).  O(pages)."""
    if node.page_keys is not None:
        upper.page_keys, node.page_keys = node.page_keys[:pages], node.page_keys[pages:]
        upper.tier_anchor, node.tier_anchor = node.tier_anchor[:pages], node.tier_anchor[pages:]
        upper.host_at, node.host_at = node.host_at[:pages], node.host_at[pages:]


def trim_names(node: TreeNode, keep: int) -> None:
    """Eviction keeps the first ``keep`` pages of leaf ``node``: so do its names.  O(1)."""
    if node.page_keys is not None:
        node.page_keys, node.tier_anchor, node.host_at = (node.page_keys[:keep], node.tier_anchor[:keep],
                                                           node.host_at[:keep])


def common_pages(node_key: np.ndarray, key: np.ndarray, pos: int, limit: int, page_size: int) -> int:
    """Number of whole pages on which ``node_key`` (a node's or a run's tokens)
    equals ``key[pos:limit]``.  A memcmp of one copy against the node's buffer
    (startswith takes any contiguous buffer; both are m tokens): one copy instead of
    two tobytes, far cheaper than array_equal.  O(m)."""
    m = min(len(node_key), limit - pos)
    b = key[pos:pos + m]
    if b.tobytes().startswith(node_key[:m]):
        return m // page_size
    return int(np.argmax(node_key[:m] != b)) // page_size


def window_safe_pages(segments: list[np.ndarray], window_pages: int) -> int:
    """Largest ``l`` (in pages) such that SWA pages ``[max(0, l - w), l)`` are all valid.

    ``segments`` are the SWA page arrays along a matched path, in order; their
    concatenation ``v`` has ``M`` pages.  ``l = 0`` is always safe.

    The rule is :func:`hybridkv.window.safe_pages`'s; this adds the common case's
    shortcut.  Runtime complexity: O(w) when the tail window is valid (the
    common case), O(M) numpy work otherwise.
    """
    total = 0
    for seg in segments:
        total += len(seg)
    if total == 0:
        return 0
    need = min(window_pages, total)
    got = 0
    i = len(segments) - 1
    tail_ok = True
    while got < need:
        seg = segments[i]
        take = min(len(seg), need - got)
        if take and (seg[len(seg) - take:] < 0).any():
            tail_ok = False
            break
        got += take
        i -= 1
    if tail_ok:
        return total
    return safe_pages(np.concatenate(segments) >= 0, window_pages)


def parts_pages(parts: list[tuple[TreeNode, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The full and SWA page ids of a match's ``(node, pages taken)`` parts
    (:meth:`~hybridkv.radix.tree.WindowSafeTree.match_parts`), as copies: the caller may write into
    them, the nodes' arrays are the tree's.  O(pages)."""
    if len(parts) == 1:
        n, take = parts[0]
        return n.full[:take].copy(), n.swa[:take].copy()
    if parts:
        return (np.concatenate([n.full[:take] for n, take in parts]),
                np.concatenate([n.swa[:take] for n, take in parts]))
    return EMPTY, EMPTY


def parts_side(parts: list[tuple[TreeNode, int]], groups: int) -> list[np.ndarray] | None:
    """The side groups' page ids of a match's ``(node, pages taken)`` parts, one
    int32 array per side group (copies); None when the tree has none.  O(pages x groups)."""
    if not groups:
        return None
    if not parts:
        return [EMPTY] * groups
    return [np.concatenate([n.side[g][:take] for n, take in parts]) for g in range(groups)]
