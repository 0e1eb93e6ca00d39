"""Worker queue ordered by uncached tokens, with starvation protection.

Shortest-uncached-first minimises mean time to first token (a request that
mostly hits the cache needs little prefill and should not wait behind a cold
100K-token prompt), but on its own it can starve long cold prompts forever.
The guard: a request that has waited ``max_wait_s`` or more is served
before any fresher one, oldest first.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

__all__ = ["UncachedFirstQueue"]

T = TypeVar("T")


class UncachedFirstQueue(Generic[T]):
    """Priority queue: fewest uncached tokens first; starved requests first of all.

    Args:
        max_wait_s: waiting time after which a request beats every fresher
            one (``float("inf")``: pure shortest-first; ``0``: FIFO).

    Runtime complexity: push O(log n); pop O(log n) amortised (lazy deletion
    from two heaps).
    """

    def __init__(self, max_wait_s: float = 30.0) -> None:
        if not isinstance(max_wait_s, (int, float)) or max_wait_s < 0:
            raise ValueError(f"max_wait_s must be a number >= 0, got {max_wait_s!r}")
        self.max_wait_s = float(max_wait_s)
        self._by_cost: list[tuple[int, int, int]] = []
        self._by_age: list[tuple[float, int]] = []
        self._items: dict[int, tuple[T, float, int]] = {}
        self._seq = itertools.count()
        self.starved_pops = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T, uncached: int, now: float) -> None:
        """Queue ``item`` with ``uncached`` tokens to compute, arriving at ``now``."""
        if not isinstance(uncached, int) or uncached < 0:
            raise ValueError(f"uncached must be an int >= 0, got {uncached!r}")
        s = next(self._seq)
        self._items[s] = (item, float(now), uncached)
        heapq.heappush(self._by_cost, (uncached, s, s))
        heapq.heappush(self._by_age, (float(now), s))

    def pop(self, now: float) -> T:
        """Remove and return the next item; IndexError when empty."""
        if not self._items:
            raise IndexError("pop from an empty queue")
        self._drop_dead()
        t0, s = self._by_age[0]
        if now - t0 >= self.max_wait_s:
            self.starved_pops += 1
        else:
            _, _, s = self._by_cost[0]
        item, _, _ = self._items.pop(s)
        self._drop_dead()
        return item

    def peek_uncached(self) -> list[int]:
        """Uncached tokens of every queued item (unordered).  O(n)."""
        return [u for _, _, u in self._items.values()]

    def queued_tokens(self) -> int:
        return sum(u for _, _, u in self._items.values())

    def _drop_dead(self) -> None:
        items = self._items
        while self._by_cost and self._by_cost[0][2] not in items:
            heapq.heappop(self._by_cost)
        while self._by_age and self._by_age[0][1] not in items:
            heapq.heappop(self._by_age)

    def __repr__(self) -> str:
        return f"UncachedFirstQueue(len={len(self)}, max_wait_s={self.max_wait_s})"


