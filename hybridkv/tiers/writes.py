"""The L3 write queue of a tier coordinator, and what it knows of L3's keys.

A page entering L2 is queued for an asynchronous L3 write (:class:`L3WriteQueue`).
Its value is encoded on the L3 write worker from the L2 page, or earlier,
when L2 is about to free that page (the queue listens to L2's
``free_listeners``).  Until the put ran, reads of the key are served from the
queued value (read-your-writes: reads do not queue behind writes).  What L3
holds is the coordinator's :class:`~hybridkv.tiers.index.StoreIndex` (the
record the vLLM connector keeps too): a key it holds is not written again, a
queued key enters it, a put that failed leaves it.  The queue also remembers
which keys this cache queued itself, so a hit on data older than this cache
can be told apart (:meth:`L3WriteQueue.predates`).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..spec import AttnKind
from .index import StoreIndex
from .manager import TierManager
from .payload import PayloadCodec

__all__ = ["L3WriteQueue"]

_MINE_BOUND = 4_000_000  # keys queued here remembered; past it no hit counts as older data


class _PendingWrite:
    """An L3 write whose values are encoded later from L2 pages."""

    __slots__ = ("kind", "keys", "pages", "values")

    def __init__(self, kind: AttnKind, keys: list[bytes], pages: np.ndarray) -> None:
        self.kind, self.keys, self.pages = kind, keys, pages
        self.values: list[Any] = [None] * len(keys)


class L3WriteQueue:
    """L2 pages queued for L3: which L2 page backs which queued value, which
    keys are queued but not yet put.

    Args:
        l3: the L3 manager (None: no L3, :meth:`queue` does nothing).
        codec: encodes L2 pages into L3 values.
        mutex: the coordinator's lock (the write worker takes it to encode).
        record: what L3 holds (the coordinator's).
        counters: the coordinator's counters (``bytes_l3_written``).
    """

    def __init__(self, l3: TierManager | None, codec: PayloadCodec, mutex: threading.RLock, record: StoreIndex,
                 counters: dict[str, int]) -> None:
        self._l3 = l3
        self._codec = codec
        self._mutex = mutex
        self._record = record
        self._counters = counters
        self._mine: set[bytes] = set()  # keys this cache queued (bounded, see predates)
        self._mine_overflow = False
        self._by_page: dict[tuple[AttnKind, int], tuple[_PendingWrite, int]] = {}  # L2 page -> queued value
        self._unwritten: dict[bytes, tuple[_PendingWrite, int]] = {}  # L3 key -> queued value not yet put

    def queue(self, kind: AttnKind, keys: list[bytes], host_pages: np.ndarray,
              sel: np.ndarray | None = None, base: list[bytes] | None = None) -> None:
        """Queue the L3 write of L2 pages ``host_pages`` (where ``sel``) the record
        does not hold.

        ``keys``: storage keys (SWA keys for SWA); ``base``: their full-KV keys,
        named in the L3 tier events of SWA writes.  Under the mutex.  O(len(keys)).
        """
        if self._l3 is None or not keys:
            return
        n = len(keys)
        sel = np.ones(n, bool) if sel is None else np.asarray(sel, bool).copy()
        sel &= ~self._record.held(keys)
        if not sel.any():
            return
        write_keys = [k for k, s in zip(keys, sel) if s]
        names = keys if kind is AttnKind.FULL else base
        event_keys = [k for k, s in zip(names, sel) if s] if names is not None else None
        pending = _PendingWrite(kind, write_keys, np.asarray(host_pages)[sel].astype(np.int64))

        def encode() -> list[Any]:
            """On the L3 write worker: encode what L2 did not free (and encode) meanwhile."""
            with self._mutex:
                self.encode([(pending, i) for i in range(len(write_keys)) if pending.values[i] is None])
            return pending.values

        def written(missed: list[bytes]) -> None:
            """On the write worker, after the put: reads go to L3 for these keys again;
            those not stored (the put failed, the page was gone) leave the record."""
            with self._mutex:
                for i, k in enumerate(write_keys):
                    if self._unwritten.get(k) == (pending, i):
                        del self._unwritten[k]
                if missed:
                    self._record.lost(missed)

        if self._l3.put_async(write_keys, encode=encode, event_keys=event_keys, swa=kind is AttnKind.SWA,
                              done=written):
            for i, p in enumerate(pending.pages.tolist()):  # under the mutex: before encode() can run
                self._by_page[(kind, p)] = (pending, i)
            for i, k in enumerate(write_keys):
                self._unwritten[k] = (pending, i)
            self._record.queued(write_keys)
            self._wrote_here(write_keys)
            self._counters["bytes_l3_written"] += len(write_keys) * self._codec.nominal_bytes(kind)

    def _wrote_here(self, keys: list[bytes]) -> None:
        if not self._mine_overflow:
            self._mine.update(keys)
            if len(self._mine) > _MINE_BOUND:
                self._mine.clear()
                self._mine_overflow = True

    def predates(self, key: bytes) -> bool:
        """Whether L3's value of ``key`` was written before this cache existed (not
        queued here; False for every key once more than the bound were).  O(1)."""
        return not self._mine_overflow and key not in self._mine

    def encode(self, items: list[tuple[_PendingWrite, int]]) -> None:
        """Encode queued values ``(write, index)`` from their L2 pages now (under the
        mutex).  O(pages)."""
        groups: dict[int, tuple[_PendingWrite, list[int]]] = {}
        for pw, i in items:
            if self._by_page.get((pw.kind, int(pw.pages[i]))) == (pw, i):
                del self._by_page[(pw.kind, int(pw.pages[i]))]
            groups.setdefault(id(pw), (pw, []))[1].append(i)
        for pw, idx in groups.values():
            vals = self._codec.encode(pw.kind, [pw.keys[i] for i in idx], pw.pages[idx])
            for i, v in zip(idx, vals):
                pw.values[i] = v

    def on_l2_freeing(self, kind: AttnKind, pages: np.ndarray) -> None:
        """L2 is about to free ``pages``: encode their still-queued values first (on
        whichever thread frees; usually the write worker encodes them).  O(pages)."""
        if not self._by_page:
            return
        hit = [e for e in (self._by_page.get((kind, int(p))) for p in np.asarray(pages).tolist())
               if e is not None]
        if hit:
            self.encode(hit)

    def queued_values(self, keys: Sequence[bytes]) -> dict[bytes, Any]:
        """Encoded values of ``keys`` queued but not yet put (under the mutex).  O(len(keys))."""
        out = {}
        for k in keys:
            e = self._unwritten.get(k)
            if e is not None and e[0].values[e[1]] is not None:
                out[k] = e[0].values[e[1]]
        return out
