"""Locks and pins: what live requests hold in the prefix index.

A locked request locks the path to its hit (``TreeNode.lock``: full KV that
is never evicted) and pins the SWA pages of the window ending at it; a pinned
page is never evicted.  :class:`SwaPins` counts pins per page id (pages are
shared by requests that hit the same window), in one growable int32 array
indexed by page id; :class:`PathLocks` takes and gives back the locks of a
tree's nodes.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .node import TreeNode
from .policy import RetentionPolicy
from .types import LockHandle

__all__ = ["PathLocks", "SwaPins"]

_SCALAR_PINS = 8  # up to this many pages, pins are counted in a Python loop (numpy calls cost more)


class _Windows(Protocol):
    """What locking reads of the window anchors: the window ending at a node."""

    def window_ids(self, node: TreeNode) -> list[int]: ...


class _Queue(Protocol):
    """What locking tells eviction: a node may have become evictable."""

    def enqueue(self, node: TreeNode, *, leaf: bool = True, swa: bool = True) -> None: ...


class SwaPins:
    """Pin count per SWA page id.  ``protected``: pages with a count > 0."""

    __slots__ = ("counts", "protected")

    def __init__(self, size: int = 1024) -> None:
        self.counts = np.zeros(size, dtype=np.int32)  # SWA page id -> pin count
        self.protected = 0

    def _grow(self, top: int) -> None:
        grown = np.zeros(max(top, 2 * self.counts.size), dtype=np.int32)
        grown[:self.counts.size] = self.counts
        self.counts = grown

    def pin_ids(self, ids: list[int], delta: int) -> None:
        """:meth:`pin` for a window's worth of page ids (Python ints, distinct):
        a window is a few pages, where a Python loop beats numpy calls."""
        if not ids:
            return
        pins = self.counts
        if max(ids) >= pins.size:
            self._grow(max(ids) + 1)
            pins = self.counts
        changed = 0  # pages whose count leaves or reaches 0
        for p in ids:
            before = pins.item(p)
            after = before + delta
            assert after >= 0
            pins[p] = after
            if before == 0 or after == 0:
                changed += 1
        self.protected += changed if delta > 0 else -changed

    def pin(self, pages: np.ndarray, delta: int) -> None:
        """Add ``delta`` (+1 / -1) to the counts of int32 ``pages``.  O(n)."""
        if pages.size == 0:
            return
        top = int(pages.max()) + 1
        if top > self.counts.size:
            self._grow(top)
        before = self.counts[pages]
        after = before + delta
        assert (after >= 0).all()
        self.counts[pages] = after
        if delta > 0:
            self.protected += int(np.count_nonzero(before == 0))
        else:
            self.protected -= int(np.count_nonzero(after == 0))

    def pinned(self, pages: np.ndarray) -> np.ndarray:
        """bool per entry of ``pages`` (``-1`` entries allowed): pinned.  O(n)."""
        out = np.zeros(pages.shape, dtype=bool)
        ok = (pages >= 0) & (pages < self.counts.size)
        out[ok] = self.counts[pages[ok].astype(np.intp)] > 0  # intp indices: ~4x faster than int32
        return out

    def pinned_ids(self) -> np.ndarray:
        """Ids with a count > 0.  O(ids seen)."""
        return np.flatnonzero(self.counts)

    def check(self) -> None:
        """``protected`` equals the pinned ids; AssertionError otherwise."""
        assert int(np.count_nonzero(self.counts)) == self.protected, (
            int(np.count_nonzero(self.counts)), self.protected)


class PathLocks:
    """Path locks and window pins of one tree's nodes.

    Args:
        pins: the tree's :class:`SwaPins`.
        windows: reads the SWA window ending at a node (the tree's anchors).
        evictable: hears of nodes a release may have made evictable (eviction).
        policy: the retention policy (its ``window_pages``).

    Attributes: ``protected_full_pages``, the full pages on locked paths.
    Invariant (checked by the tree): ``node.lock >= sum(child.lock)``.
    """

    def __init__(self, pins: SwaPins, windows: _Windows, evictable: _Queue, policy: RetentionPolicy) -> None:
        self.pins = pins
        self.windows = windows
        self.evictable = evictable
        self.policy = policy
        self.protected_full_pages = 0

    def lock(self, node: TreeNode | None) -> LockHandle:
        """Protect the path to ``node`` (full KV) and the SWA window ending at it.

        The window pages must hold SWA (true for a node returned by a split
        :meth:`match`).  Runtime complexity: O(depth).
        """
        if node is None or node.parent is None:
            return LockHandle(None)
        if not node.alive:
            raise ValueError("node was evicted; match again before locking")
        ids = self.windows.window_ids(node)
        if ids and min(ids) < 0:
            raise ValueError("the SWA window ending at node is not held (not window safe)")
        n: TreeNode = node
        protected = 0
        while n.parent is not None:
            if n.lock == 0:
                protected += len(n.full)
            n.lock += 1
            n = n.parent
        self.protected_full_pages += protected
        self.pins.pin_ids(ids, +1)
        return LockHandle(node, None, ids)

    def unlock(self, handle: LockHandle) -> None:
        """Undo :meth:`lock`.  O(depth).  Raises ValueError on a second release."""
        if not isinstance(handle, LockHandle):
            raise TypeError(f"handle must be a LockHandle, got {type(handle).__name__}")
        if handle.released:
            raise ValueError("lock handle already released")
        handle.released = True
        node = handle.node
        if node is None:
            return
        ids = handle.ids
        if ids is not None:
            self.pins.pin_ids(ids, -1)
        else:
            pages = handle.swa_pages
            if pages.size <= _SCALAR_PINS:
                self.pins.pin_ids(pages.tolist(), -1)
            else:
                self.pins.pin(pages, -1)
        window = self.policy.window_pages
        n: TreeNode = node
        while n.parent is not None:
            n.lock -= 1
            assert n.lock >= 0
            if n.lock == 0:
                self.protected_full_pages -= len(n.full)
            # pins were released on the window nodes: their SWA may be evictable now;
            # a still-locked inner node above the window has nothing to enqueue
            leafish = n.lock == 0 and not n.children
            if leafish or (window > 0 and n.swa_valid):
                self.evictable.enqueue(n, leaf=leafish, swa=window > 0)
            window -= len(n.full)
            n = n.parent

    def lock_path(self, node: TreeNode | None, swa_pages: np.ndarray) -> LockHandle:
        """Lock the path to ``node`` (full KV) and pin ``swa_pages`` (int32 SWA ids
        the caller relies on), without :meth:`lock`'s requirement that the window
        ending at ``node`` is held: a tier loading the missing window into L1 holds
        what it has while it allocates.  Undo with :meth:`unlock`.  O(depth + pages)."""
        if node is None:
            return LockHandle(None)
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            if n.lock == 0:
                self.protected_full_pages += n.n_pages
            n.lock += 1
            n = n.parent
        pages = np.asarray(swa_pages, dtype=np.int32)
        self.pins.pin(pages, +1)
        return LockHandle(node, pages)
