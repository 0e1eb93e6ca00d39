"""Where L2 holds a page, as the tree's entries record it: host slots and their stamps.

HiCache's radix tree keeps, on each node, the host indices of its pages
(``host_value``).  hybridkv's tree does the same: each named entry, an L1
node or a run L1 evicted (:mod:`hybridkv.radix.evicted`), records per page
where L2 holds it (:data:`hybridkv.radix.node.HOST_AT_COLUMNS`: the host slot
of its full KV and of its SWA, each with a *stamp*).  L2 gives every page it
admits a fresh stamp (:class:`SlotStamps`, one per host slot) and clears it
when the slot is freed, so a recorded (slot, stamp) is valid exactly while
the slot holds the very page that was recorded: a slot freed, or reused for
another page, reads as not held, whatever happened to L2 meanwhile.  A lookup
along the tree reads L2 off the entries (:meth:`SlotStamps.held`, one
vectorized compare) and asks L2 by key only for the pages whose entry has no
valid record (then records the answer on the entry).

Stamps only ever grow (an int64 counter), so a stale record can never become
valid again.  Not thread-safe by itself: L2's owner's lock guards it, as it
guards L2.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SlotStamps"]


class SlotStamps:
    """One stamp per host slot of one page kind (0: the slot holds no page).

    Args:
        slots: the slots to size the table for (the pool's capacity: reads of
            slots below it need no bounds check); it grows past them if a higher
            slot is stamped.
    """

    def __init__(self, slots: int = 1024) -> None:
        self._stamp = np.zeros(max(1, int(slots)), dtype=np.int64)  # (untouched pages stay unmapped)
        self._next = 1
        self._grown = False  # a slot past ``slots`` was stamped: reads check bounds

    def stamp(self, slots: np.ndarray) -> np.ndarray:
        """Give each of ``slots`` (distinct ints >= 0, just admitted) a fresh stamp;
        returns them (int64).  O(n)."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return np.zeros(0, dtype=np.int64)
        top = int(slots.max())
        if top >= len(self._stamp):
            grown = np.zeros(max(top + 1, 2 * len(self._stamp)), dtype=np.int64)
            grown[:len(self._stamp)] = self._stamp
            self._stamp, self._grown = grown, True
        out = np.arange(self._next, self._next + slots.size, dtype=np.int64)
        self._next += slots.size
        self._stamp[slots] = out
        return out

    def clear(self, slots: np.ndarray) -> None:
        """``slots`` were freed: any record of them is invalid from now on.  O(n)."""
        slots = np.asarray(slots, dtype=np.int64)
        self._stamp[slots[slots < len(self._stamp)]] = 0

    def of(self, slots: np.ndarray) -> np.ndarray:
        """The current stamp of each slot (``-1`` slots, or never stamped: 0).  O(n)."""
        slots = np.asarray(slots, dtype=np.int64)
        table = self._stamp
        if self._grown and slots.size and int(slots.max()) >= len(table):  # never stamped that high: 0
            slots = np.where(slots < len(table), slots, -1)
        return np.where(slots >= 0, table[slots], 0)  # (slot -1 reads the last entry, masked)

    @property
    def num_stamped(self) -> int:
        """Slots holding a stamp now.  O(slots)."""
        return int(np.count_nonzero(self._stamp))

    def held(self, slots: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        """Bool per record: slot ``slots[i]`` still holds the page stamped
        ``stamps[i]`` (a ``-1`` slot or a 0 stamp: no record).  O(n)."""
        return (np.asarray(stamps) > 0) & (self.of(slots) == stamps)
