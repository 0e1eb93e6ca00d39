"""Pages of the sliding-window groups beside the lead group.

A model with several sliding windows (:attr:`~hybridkv.spec.ModelSpec.sliding_groups`)
holds a page id per KV group in its tree nodes and requests: the full page id,
the lead SWA page id (the *lead* group, the largest window, allocates them:
:class:`~hybridkv.pools.allocator.PageAllocator`), and one id per other sliding
group (:attr:`~hybridkv.radix.node.TreeNode.side`,
:attr:`~hybridkv.request.Request.side_pages`).  A side group's page shares the
lead's row of arena blocks (its own columns), so its id is the lead's id where
it holds the page and ``-1`` where it does not: a group with a smaller window
gives its pages back sooner (a request releases them more than its window
behind its end, see :mod:`hybridkv.allocation`), and all of them go when the
lead's id is freed.  :class:`GroupPages` is the group's storage allocator: which
ids it holds storage for, and how many; the owners (nodes, requests) list the
same ids (checked by ``HybridKVCache.check_invariants``).

Invariant: a group holds only ids the lead group has allocated.
"""

from __future__ import annotations

import numpy as np

from ..spec import KVGroupSpec

__all__ = ["GroupPages"]


class GroupPages:
    """Storage of one (non-lead) sliding-window group, per SWA page id.

    Args:
        group: the group's spec.
        index: its index in ``spec.sliding_groups``.
        page_bytes: bytes one of its pages costs.
        window_pages: its window in pages.

    Runtime complexity: every call is O(n) numpy work in the ids given.
    """

    def __init__(self, group: KVGroupSpec, index: int, page_bytes: int, window_pages: int) -> None:
        self.group = group
        self.index = index
        self.page_bytes = int(page_bytes)
        self.window_pages = int(window_pages)
        self.held = np.zeros(1024, dtype=bool)
        self.used = 0

    def take(self, pages: np.ndarray) -> None:
        """Hold storage for freshly allocated ids ``pages`` (none held yet)."""
        if len(pages) == 0:
            return
        top = int(pages.max()) + 1
        if top > self.held.size:
            self.held = np.concatenate([self.held, np.zeros(max(top, 2 * self.held.size) - self.held.size, bool)])
        self.held[pages] = True
        self.used += len(pages)

    def free(self, pages: np.ndarray) -> np.ndarray:
        """Give back the storage of those of ``pages`` the group holds; returns them."""
        if len(pages) == 0:
            return pages
        got = pages[self.holds(pages)]
        self.held[got] = False
        self.used -= got.size
        return got

    def holds(self, pages: np.ndarray) -> np.ndarray:
        """bool per id of ``pages`` (``-1`` allowed: not held): the group holds its KV."""
        pages = np.asarray(pages)
        out = np.zeros(pages.shape, dtype=bool)
        ok = (pages >= 0) & (pages < self.held.size)
        out[ok] = self.held[pages[ok]]
        return out

    def check_invariants(self, lead_used: np.ndarray) -> None:
        """Held ids are allocated ids of the lead group; the count matches."""
        held = np.flatnonzero(self.held)
        assert held.size == self.used, (self.group.name, held.size, self.used)
        assert np.isin(held, lead_used).all(), f"{self.group.name} holds a freed SWA id"
