"""Page allocator: hands out page ids of one pool in bulk.

Pages are the unit of KV allocation.  A page id ``p`` owns token slots
``p * page_size ... p * page_size + page_size - 1`` of the pool's buffers.
The allocator only does accounting; it never touches KV memory.
"""

from __future__ import annotations

import numpy as np

from .._validate import as_int_array as as_page_array
from .._validate import check_int

__all__ = ["PageAllocator"]

_INITIAL = 1024


class PageAllocator:
    """Free-list allocator over page ids ``[0, capacity)``.

    Pages are handed out lazily (ids never used before come last), so a pool
    with a huge capacity costs memory only for the pages actually touched.
    Freed pages are reused first.  Every free is checked against an
    "allocated" bitmap: a double free or a foreign id raises ``ValueError``
    and changes nothing.

    Runtime complexity: ``alloc(n)`` and ``free(pages)`` are O(n) numpy work.
    """

    def __init__(self, capacity: int, name: str = "pool") -> None:
        self.capacity = check_int(capacity, "capacity", 0)
        self.name = name
        self._high = 0  # ids [0, _high) have been handed out at least once
        self._allocated = np.zeros(min(self.capacity, _INITIAL), dtype=bool)
        # recycled ids live in _free[:_nfree]; intp, so a slice of it indexes the bitmap
        # directly (numpy indexes with intp ~4x faster than with int32)
        self._free = np.empty(min(self.capacity, _INITIAL), dtype=np.intp)
        self._nfree = 0
        self.used = 0
        self._scratch = np.empty(0, dtype=np.int32)  # for the O(n) repeat check

    # ---------------------------------------------------------------- queries
    @property
    def num_used(self) -> int:
        return self.used

    @property
    def num_free(self) -> int:
        return self.capacity - self.used

    def is_allocated(self, pages: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``pages`` are currently allocated."""
        pages = as_page_array(pages, "pages")
        out = np.zeros(pages.shape, dtype=bool)
        ok = (pages >= 0) & (pages < self._high)
        out[ok] = self._allocated[pages[ok]]
        return out

    def used_ids(self) -> np.ndarray:
        """Allocated ids (int64).  O(capacity touched)."""
        return np.flatnonzero(self._allocated[:self._high])

    # -------------------------------------------------------------- mutation
    def alloc(self, n: int) -> np.ndarray | None:
        """Allocate ``n`` pages; returns int32 ids, or None (nothing changed) if short."""
        n = check_int(n, "n", 0)
        if n > self.num_free:
            return None
        return self.take(n)

    def take(self, n: int) -> np.ndarray:
        """:meth:`alloc` without checks, for owners that checked ``n <= num_free``
        (the pools, per chunk of every request).  O(n)."""
        nfree = self._nfree
        if n <= nfree:  # all recycled (the steady state), newest freed first
            ids = self._free[nfree - n:nfree][::-1]
            self._allocated[ids] = True
            out = ids.astype(np.int32)
            self._nfree = nfree - n
        else:
            out = np.empty(n, dtype=np.int32)
            if nfree:
                out[:nfree] = self._free[:nfree][::-1]
                self._nfree = 0
            fresh = n - nfree
            self._grow_bitmap(self._high + fresh)
            out[nfree:] = np.arange(self._high, self._high + fresh, dtype=np.int32)
            self._high += fresh
            self._allocated[out.astype(np.intp)] = True
        self.used += n
        return out

    def free(self, pages: object) -> None:
        """Return ``pages`` to the free list.

        Raises ValueError (and frees nothing) if any id is out of range, not
        allocated, or repeated.
        """
        if type(pages) is np.ndarray and pages.dtype == np.int32 and pages.ndim == 1:
            arr = pages  # the tree's and the cache's own arrays: no conversion
        else:
            arr = as_page_array(pages, "pages")
        if arr.size == 0:
            return
        # ids >= _high are never allocated (the bitmap reads False or is out of range)
        if arr.min() < 0 or arr.max() >= self._high:
            raise ValueError(f"pages contain ids outside the allocated range of pool {self.name!r}")
        if not self._allocated[arr].all():
            raise ValueError(f"pages contain ids that are not allocated in pool {self.name!r} (double free?)")
        if arr.size > 1 and self.has_repeats(arr):
            raise ValueError(f"pages contain repeated ids (pool {self.name!r})")
        self.free_trusted(arr)

    def has_repeats(self, arr: np.ndarray) -> bool:
        """Whether int32 ids ``arr`` (in range) repeat an id.  O(n): the last write of
        each id wins in a scratch array."""
        if self._scratch.size < self._high:
            self._scratch = np.empty(self._allocated.size, dtype=np.int32)
        order = np.arange(arr.size, dtype=np.int32)
        self._scratch[arr] = order
        return bool((self._scratch[arr] != order).any())

    def free_trusted(self, arr: np.ndarray) -> None:
        """:meth:`free` for internal callers that own ``arr`` (allocated, distinct
        int32 ids): no checks.  O(n)."""
        if arr.size == 0:
            return
        need = self._nfree + arr.size
        if need > self._free.size:
            grown = np.empty(max(need, 2 * self._free.size), dtype=np.intp)
            grown[:self._nfree] = self._free[:self._nfree]
            self._free = grown
        ids = self._free[self._nfree:need]
        ids[:] = arr
        self._allocated[ids] = False  # the intp copy indexes the bitmap (see __init__)
        self._nfree = need
        self.used -= arr.size

    def _grow_bitmap(self, high: int) -> None:
        if high > self._allocated.size:
            grown = np.zeros(min(self.capacity, max(high, 2 * self._allocated.size)), dtype=bool)
            grown[:self._allocated.size] = self._allocated
            self._allocated = grown

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Verify accounting; raises AssertionError on any inconsistency.  O(capacity touched)."""
        alloc = self._allocated[:self._high]
        assert int(alloc.sum()) == self.used, (self.name, int(alloc.sum()), self.used)
        free = self._free[:self._nfree]
        assert np.unique(free).size == free.size, f"{self.name}: free list has duplicates"
        assert not alloc[free].any(), f"{self.name}: a free page is marked allocated"
        assert self.used + self._nfree == self._high, (self.name, self.used, self._nfree, self._high)
        assert 0 <= self.used <= self.capacity
