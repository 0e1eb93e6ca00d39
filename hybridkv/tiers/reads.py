"""L3 -> L2 reads of a tier coordinator: read-ahead jobs and their landing in L2.

:class:`ReadAhead` runs the fetches on the L3 read worker (one job per
``begin``/``prefetch`` that needs pages only L3 holds, never two for one key)
and hands out :class:`PrefetchHandle` objects to wait on them.  A job plans
the hit from what L1/L2 hold plus what L3 has, reads only the pages of that
plan, and gives them to :class:`Landing`, which decodes them into new L2
pages and remembers them until a request is served from them (that page's
origin is then L3, see :class:`~hybridkv.tiers.config.PageOrigin`).

What L3 holds is asked of the coordinator's record first
(:class:`~hybridkv.tiers.index.StoreIndex`, the one the vLLM connector keeps):
the store's ``exists`` is called only for keys it has no answer for, off the
coordinator's lock, and the answers are recorded.  A key the record holds but
the store lost is a read that misses: clamped, and out of the record.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from ..radix import window_safe_pages
from ..radix.node import NO_PAGE
from ..spec import AttnKind
from .config import PageOrigin
from .host import HostTier
from .keys import parent_keys
from .manager import TierManager
from .index import StoreIndex
from .lookup import GroupInfo, stored_hit
from .payload import PayloadCodec, swa_key
from .records import HostRecords
from .writes import L3WriteQueue

__all__ = ["Landing", "PrefetchHandle", "ReadAhead", "leading_true", "window_safe"]

logger = logging.getLogger("hybridkv.tiers")

#: A read's tree entries, as :meth:`~hybridkv.tiers.records.TreeWalk.segments` gave
#: them when it began, and the records to tell where its pages land.
Walked = tuple[list[tuple[np.ndarray | None, int, int]], HostRecords]
_LANDED_BOUND = 1_000_000  # landed keys remembered (only the L3 hit attribution suffers past it)


def leading_true(mask: np.ndarray) -> int:
    """Length of the leading run of True in ``mask``.  O(n) numpy."""
    bad = np.flatnonzero(~mask)
    return int(bad[0]) if bad.size else int(mask.size)


def window_safe(swa_ok: np.ndarray, window_pages: int) -> int:
    """Largest ``l <= len(swa_ok)`` whose last ``window_pages`` pages have SWA (0 always safe)."""
    if swa_ok.size == 0:
        return 0
    return window_safe_pages([np.where(swa_ok, 0, NO_PAGE).astype(np.int32)], window_pages)


class PrefetchHandle:
    """L3 -> L2 loads started by :meth:`~hybridkv.tiers.tiered.TieredCache.prefetch` (or a ``begin``)."""

    def __init__(self, futures: list[Future] | tuple = ()) -> None:
        self._futures = [f for f in futures if f is not None]

    def done(self) -> bool:
        """Whether every load finished (landed in L2 or failed as a miss)."""
        return all(f.done() for f in self._futures)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (None: forever); True if everything finished."""
        if not self._futures:
            return True
        _, pending = concurrent.futures.wait(self._futures, timeout=timeout_s)
        return not pending


class Landing:
    """L3 values decoded into L2, and the full keys landed that no request was
    served from yet (-> whether the data predates this cache).  Not
    thread-safe: the coordinator's mutex."""

    def __init__(self, host: HostTier, codec: PayloadCodec, l3: TierManager, record: StoreIndex,
                 predates: Callable[[bytes], bool], counters: dict[str, int]) -> None:
        self._host = host
        self._codec = codec
        self._l3 = l3
        self._record = record
        self._predates = predates
        self._counters = counters
        self._landed: OrderedDict[bytes, bool] = OrderedDict()

    def land(self, keys: list[bytes], full_idx: np.ndarray, swa_idx: np.ndarray, full_keys: list[bytes],
             swa_keys: list[bytes], values: list[Any], hit: int, lo: int, *, walk: Walked | None = None) -> None:
        """Decode ``values`` (full pages ``full_idx`` then SWA pages ``swa_idx`` of
        ``keys``) into new L2 pages and index them.  Pages of the planned hit
        ``[0, hit)`` (SWA: ``[lo, hit)``) already in L2 are protected from the
        L2 eviction this allocation may cause.  A value that does not decode is a
        miss, reported to L3 as lost.  ``walk``: the tree entries naming ``keys``'
        pages and the owner's records (``(segments, records)``), told where L2 now
        holds what landed.  O(pages)."""
        host = self._host
        in_l2_full = host.lookup_full(keys[:hit])
        in_l2_swa = host.lookup_swa([swa_key(k) for k in keys[lo:hit]])
        got = host.alloc(full_idx.size, swa_idx.size, protect=in_l2_full[in_l2_full >= 0].tolist(),
                         protect_swa=in_l2_swa[in_l2_swa >= 0].tolist())
        ok_full = np.zeros(full_idx.size, dtype=bool)
        ok_swa = np.zeros(swa_idx.size, dtype=bool)
        if got is not None:
            ok_full, ok_swa = self._decode(keys, full_idx, swa_idx, full_keys, swa_keys, values, got)
        else:
            self._counters["l2_store_failed"] += full_idx.size + swa_idx.size
        if walk is not None and got is not None:
            segments, records = walk
            records.landed(segments, AttnKind.FULL, full_idx[ok_full], [k for k, o in zip(full_keys, ok_full) if o])
            records.landed(segments, AttnKind.SWA, swa_idx[ok_swa], [k for k, o in zip(swa_keys, ok_swa) if o])
        c = self._counters
        c["l3_to_l2_full_pages"] += int(ok_full.sum())
        c["l3_to_l2_swa_pages"] += int(ok_swa.sum())
        c["bytes_l3_read"] += (int(ok_full.sum()) * self._codec.nominal_bytes(AttnKind.FULL)
                               + int(ok_swa.sum()) * self._codec.nominal_bytes(AttnKind.SWA))
        c["l3_clamped_pages"] += int((~ok_full).sum() + (~ok_swa).sum())
        if got is not None:  # a read that missed: L3 lost (evicted) or never finished those pages
            self._l3.lost([k for k, o in zip(full_keys, ok_full) if not o])
            self._l3.lost([keys[int(i)] for i in swa_idx[~ok_swa]], swa=True)
            self._record.lost([k for k, o in zip(full_keys + swa_keys, np.concatenate([ok_full, ok_swa])) if not o])

    def _decode(self, keys: list[bytes], full_idx: np.ndarray, swa_idx: np.ndarray, full_keys: list[bytes],
                swa_keys: list[bytes], values: list[Any], got: tuple[np.ndarray, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
        """Decode into the new L2 pages ``got``, index what decoded, free the rest;
        returns the decoded masks (full, SWA).  O(pages)."""
        host = self._host
        new_full, new_swa = got
        n_full = len(full_keys)
        try:
            ok_full = np.asarray(self._codec.decode(AttnKind.FULL, full_keys, values[:n_full], new_full), dtype=bool)
            ok_swa = np.asarray(self._codec.decode(AttnKind.SWA, swa_keys, values[n_full:], new_swa), dtype=bool)
        except BaseException:
            host.free(new_full, new_swa)  # nothing was indexed yet: the host pages go back
            raise
        host.insert_full([k for k, o in zip(full_keys, ok_full) if o], new_full[ok_full],
                         parent_keys(keys, full_idx[ok_full].tolist()))
        host.insert_swa([k for k, o in zip(swa_keys, ok_swa) if o], new_swa[ok_swa], np.ones(int(ok_swa.sum()), bool),
                        [keys[int(i)] for i in swa_idx[ok_swa]])
        host.free(new_full[~ok_full], new_swa[~ok_swa])
        landed = [k for k, o in zip(full_keys, ok_full) if o]
        self._record.stored(landed)
        self._record.stored([k for k, o in zip(swa_keys, ok_swa) if o])
        for k in landed:
            self._landed[k] = self._predates(k)
        while len(self._landed) > _LANDED_BOUND:
            self._landed.popitem(last=False)
        return ok_full, ok_swa

    def served(self, keys: list[bytes], origin: np.ndarray, hit: int) -> None:
        """Pages ``[0, hit)`` are served; those served from L2 for the first time since
        they landed get origin L3 (or L3_PREEXISTING: data older than this cache).
        Mutates ``origin``.  O(hit)."""
        for i in np.flatnonzero(origin[:hit] == PageOrigin.L2).tolist():
            predates = self._landed.pop(keys[i], None)
            if predates is not None:
                origin[i] = PageOrigin.L3_PREEXISTING if predates else PageOrigin.L3


class ReadAhead:
    """L3 fetches in flight: the read worker's jobs and the keys each is loading.

    Args:
        l3: the L3 manager.
        mutex: the coordinator's lock (jobs land pages under it).
        page_size: tokens per page.
        window_pages: the model's SWA window in pages.
        writes: the write queue (reads of keys queued but not yet put are served
            from it).
        landing: where read values go.
        record: what L3 holds (the coordinator's, probing the store's ``exists``).
        counters: the coordinator's counters (``tier_errors``).
    """

    def __init__(self, l3: TierManager, mutex: threading.RLock, page_size: int, window_pages: int,
                 writes: L3WriteQueue, landing: Landing, record: StoreIndex, counters: dict[str, int]) -> None:
        self._l3 = l3
        self._mutex = mutex
        self._page_size = page_size
        self._wp = window_pages
        # the tiers' two groups: full KV, and SWA pages holding every sliding group's window
        self._groups = (GroupInfo(0, None, block_size=page_size),
                        GroupInfo(1, window_pages * page_size, block_size=page_size))
        self._writes = writes
        self._landing = landing
        self._record = record
        self._counters = counters
        self._inflight: dict[bytes, Future] = {}  # L3 key -> fetch job loading it

    def start(self, keys: list[bytes], have_full: np.ndarray, have_swa: np.ndarray, *,
              swa_keys: dict[int, bytes] | None = None, walk: Walked | None = None) -> tuple[PrefetchHandle, bool]:
        """Queue a fetch of what L1/L2 lack (``have_*`` False) for ``keys``, unless in
        flight (under the mutex).  ``swa_keys``: SWA keys already hashed, by page
        index (the others are hashed here).  ``walk``: the tree entries naming the
        pages, told where they land (:meth:`Landing.land`).  Returns the handle over this and
        overlapping in-flight fetches, and whether the new fetch is the read
        breaker's probe (not to be waited for).  O(len(keys))."""
        n = len(keys)
        first_gap = leading_true(have_full)
        if first_gap == n and window_safe(have_swa, self._wp) == n:
            return PrefetchHandle(), False  # all of it is in L1/L2
        want_full = np.arange(first_gap, n)[~have_full[first_gap:]]
        want_swa = np.flatnonzero(~have_swa)
        full_keys = [keys[i] for i in want_full.tolist()]
        known = swa_keys or {}
        swa_keys = [known.get(i) or swa_key(keys[i]) for i in want_swa.tolist()]
        inflight = self._inflight
        waits = {id(f): f for f in (inflight.get(k) for k in full_keys + swa_keys) if f is not None}
        if self._l3.read_breaker.state != "closed":
            waits = {}  # L3 is failing: do not wait for reads already in flight either
        new_full = np.array([k not in inflight for k in full_keys], dtype=bool)
        new_swa = np.array([k not in inflight for k in swa_keys], dtype=bool)
        if not new_full.any() and not new_swa.any():
            return PrefetchHandle(list(waits.values())), False
        gate = self._l3.read_gate()  # claims the breaker's probe slot when half-open
        if gate is None:
            self._l3.count("l3_reads_skipped")
            return PrefetchHandle(list(waits.values())), False
        mine = [k for k, o in zip(full_keys, new_full) if o] + [k for k, o in zip(swa_keys, new_swa) if o]
        box: dict[str, Future] = {}

        def job() -> None:
            try:
                self._fetch(keys, have_full, have_swa, want_full, want_swa, full_keys, swa_keys, walk)
            finally:
                with self._mutex:  # registration below finished before this lock was free
                    fut = box.get("fut")
                    for k in mine:
                        if inflight.get(k) is fut:
                            del inflight[k]

        fut = self._l3.submit_read(job, gated=False)
        if fut is None:  # closed or the read queue is full
            if gate == "probe":
                self._l3.read_breaker.record_failure()  # give the probe slot back (re-opens)
            return PrefetchHandle(list(waits.values())), False
        box["fut"] = fut
        for k in mine:
            inflight[k] = fut
        waits[id(fut)] = fut
        return PrefetchHandle(list(waits.values())), gate == "probe"

    def _fetch(self, keys: list[bytes], have_full: np.ndarray, have_swa: np.ndarray, want_full: np.ndarray,
               want_swa: np.ndarray, full_keys: list[bytes], swa_keys: list[bytes], walk: Walked | None) -> None:
        """On the L3 read worker: plan the hit over what L1/L2 hold, queued writes and
        L3 (:func:`~hybridkv.tiers.lookup.stored_hit`: the record first, the store
        asked only what the answer needs, off the lock), read the pages of the
        plan, land them in L2 (under the mutex)."""
        wp, P, n = self._wp, self._page_size, len(keys)
        with self._mutex:  # values of queued writes not yet put (encoded when L2 freed their page)
            queued = self._writes.queued_values(full_keys + swa_keys)
        held_full, held_swa = have_full.copy(), have_swa.copy()
        held_full[want_full] = [k in queued for k in full_keys]
        held_swa[want_swa] = [k in queued for k in swa_keys]
        named_swa: list[bytes | None] = [None] * n  # SWA keys of the pages L1/L2 lack
        for i, k in zip(want_swa.tolist(), swa_keys):
            named_swa[i] = k
        hit, _ = stored_hit(self._groups, {0: keys, 1: named_swa},
                            lambda g, lo, hi: (held_swa if g.is_swa else held_full)[lo:hi],
                            self._record, 0, n * P, P)
        hit //= P
        lo = max(0, hit - wp)
        # a window-safe hit: every full page below it and its window's SWA are in some tier
        sel_full = want_full < hit
        sel_swa = (want_swa >= lo) & (want_swa < hit)
        if not sel_full.any() and not sel_swa.any():
            return
        read_full = [k for k, o in zip(full_keys, sel_full) if o]
        read_swa = [k for k, o in zip(swa_keys, sel_swa) if o]
        ask = [k for k in read_full + read_swa if k not in queued]
        read = dict(zip(ask, self._l3.backend_get(ask)))
        values = [queued[k] if k in queued else read[k] for k in read_full + read_swa]
        try:
            with self._mutex:
                self._landing.land(keys, want_full[sel_full], want_swa[sel_swa], read_full, read_swa, values, hit, lo,
                                   walk=walk)
        except Exception as exc:  # noqa: BLE001 - a bad page is a miss, never a failed request
            self._counters["tier_errors"] += 1
            logger.warning("landing L3 pages in L2 failed (%s: %s); treated as a miss", type(exc).__name__, exc)

