"""L2 read off the tree: a prompt's walk, and where its entries record L2 holds each page.

A lookup walks the tree (:meth:`~hybridkv.radix.WindowSafeTree.walk_names`):
the L1 nodes its prompt matches, then the runs L1 evicted below them
(:mod:`hybridkv.radix.evicted`).  Every named entry records, per page, where L2
holds it (``host_at``: a host slot and its stamp for the full KV and for the
SWA, :mod:`.slots`).  :class:`HostRecords` answers "which host page holds this
page's full KV / SWA" from those records first: a record is valid exactly while
L2's stamp of its slot matches, so a valid one is the answer and L2 is not asked.
A page L2 was found not to hold is recorded too, as *absent*
(:data:`ABSENT`: slot ``-1``, stamp ``-1``; never recorded is stamp 0).

An owner whose every L2 admission of a page an entry names is recorded on that
entry (``complete``: the core's :class:`~hybridkv.tiers.coordinator.TierCoordinator`)
reads the records as the whole answer for the pages the walk names: valid is
held, absent or stale (the slot was freed or reused since) is not held, and
only pages never recorded (or past the walk: no entry names them) are asked of
L2 by key.  The admissions record where they happen: a finish's copies on the
request's path (:meth:`hybridkv.lifecycle.Lifecycle.insert`), a free listener's
on the pages' entry (:class:`~hybridkv.radix.types.FreedPages`), an L2 -> L1
load on the pages it inserts, an L3 -> L2 landing on the walk that asked for it.
:meth:`HostRecords.check` then holds every record to L2 exactly.
Otherwise (vLLM's connector, whose finish saves land in L2 after the prefix
manager's insert) an absent or stale record is asked again, and only valid
records are believed.  The answer for a page asked is recorded on the entry
(on the engine's thread only: the one that changes the tree), so the next walk
reads it there.  Either way answers are the same as asking L2 every time, which
the tests check page by page.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from ..radix.node import EvictedRun, TreeNode, unrecorded
from ..radix.types import PageNames
from ..spec import AttnKind
from .host import HostTier
from .payload import swa_key

__all__ = ["ABSENT", "HostRecords", "TreeWalk", "record_rows"]

_SLOT = {AttnKind.FULL: 0, AttnKind.SWA: 2}  # a kind's columns in host_at: slot, then stamp

PENDING_MAX = 1 << 16  # keys admitted_unnamed remembered

_WIDTH = 2 * len(_SLOT)  # the core's records: a full and an SWA pair

#: The stamp of a record saying L2 does not hold the page (slot ``-1``); 0: never recorded.
ABSENT = -1


def _stamps_of(host: HostTier, kind: AttnKind, slots: np.ndarray) -> np.ndarray:
    """The stamp to record for each of ``slots`` (:data:`ABSENT` where ``-1``).  O(n)."""
    return np.where(np.asarray(slots) >= 0, host.stamps[kind].of(slots), ABSENT)


def record_rows(host: HostTier, rows: np.ndarray, kind: AttnKind, idx: np.ndarray, slots: np.ndarray) -> None:
    """Record in ``host_at`` ``rows`` that L2 holds the ``kind`` KV of pages ``idx``
    in host ``slots`` (``-1``: not, recorded :data:`ABSENT`), stamped now: call it
    while those slots still hold those pages.  O(pages)."""
    col = _SLOT[kind]
    rows[idx, col] = slots
    rows[idx, col + 1] = _stamps_of(host, kind, slots)


@dataclass
class TreeWalk:
    """A prompt's walk of the tree: the L1 nodes it matched, each with its pages
    matched (``path``), and the evicted runs read past them (``runs``).
    ``engine``: taken on the engine's thread (records may be written back).
    ``fixed``: the segments as :meth:`freeze` took them (None: read at each call)."""

    path: list[tuple[TreeNode, int]] = field(default_factory=list)
    runs: list[tuple[EvictedRun, int]] = field(default_factory=list)
    engine: bool = True
    fixed: list[tuple[np.ndarray | None, int, int]] | None = None

    def freeze(self, width: int) -> "TreeWalk":
        """Keep the entries' records as they are now (views: what is recorded later
        lands on them), for a walk read again after the tree changed (a node trimmed
        or split since keeps its rows).  Records of another ``width`` read as
        unrecorded.  Returns ``self``.  O(entries)."""
        self.fixed = [(rows if rows is not None and rows.shape[1] == width else None, lo, k)
                      for rows, lo, k in self.segments()]
        return self

    def segments(self) -> list[tuple[np.ndarray | None, int, int]]:
        """``(host_at rows or None, first page, pages)`` of each entry along the
        walk, in page order: the L1 nodes, then the runs.  O(entries)."""
        if self.fixed is not None:
            return self.fixed
        out: list[tuple[np.ndarray | None, int, int]] = []
        pos = 0
        for node, k in self.path:
            out.append((None if node.host_at is None else node.host_at[:k], pos, k))
            pos += k
        for run, k in self.runs:
            out.append((run.host_at[:k], pos, k))
            pos += k
        return out


class HostRecords:
    """Where L2 holds a walk's pages, read off the tree's records (see the module
    docstring).  Counters: ``l2_pages_read_off_tree`` (pages answered by their
    record: valid, or with ``complete`` absent or stale), of them
    ``l2_pages_absent_off_tree`` (answered "not held"), and
    ``l2_pages_asked_by_key`` (pages L2 was asked by key).

    Args:
        host: L2.
        counters: the owner's counters (the three above are added to it).
        complete: every L2 admission of a page an entry names is recorded on that
            entry, so a record is the whole answer (keyword only).
    """

    def __init__(self, host: HostTier, counters: dict[str, int], *, complete: bool = False) -> None:
        if not isinstance(complete, bool):
            raise TypeError(f"complete must be a bool, got {type(complete).__name__}")
        self.host = host
        self.counters = counters
        self.complete = complete
        self._pending: OrderedDict[bytes, None] = OrderedDict()  # admitted_unnamed, oldest first
        for name in ("l2_pages_read_off_tree", "l2_pages_absent_off_tree", "l2_pages_asked_by_key"):
            counters.setdefault(name, 0)

    def slots(self, kind: AttnKind, walk: TreeWalk, pages: np.ndarray,
              key_of: Callable[[int], bytes], *, leading: bool = False, pair: int | None = None) -> np.ndarray:
        """The host page of ``kind`` (L2's slot) holding each of ``pages`` (int
        page indices of the walk's prompt, ascending), ``-1`` where L2 holds none.
        ``key_of(i)``: the L2 key of page ``i`` (asked only for pages without a
        valid record).  ``leading``: only the leading run of held pages matters
        (a hit): pages without a record are asked in order, in chunks of 16,
        four times more each round, up to the first chunk with an absent page;
        the pages after it read ``-1`` unless recorded.  ``pair``: the records'
        (slot, stamp) column pair to read and write (default: ``kind``'s in
        :data:`~hybridkv.radix.node.HOST_AT_COLUMNS`; a host with more pairs per
        page names its own).  O(entries of the walk + pages)."""
        n = len(pages)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if pair is not None and (isinstance(pair, bool) or not isinstance(pair, int) or pair < 0):
            raise ValueError(f"pair must be an int >= 0 or None, got {pair!r}")
        col = _SLOT[kind] if pair is None else 2 * pair
        stamps = self.host.stamps[kind]
        rec, views = self._gather(walk, pages, col)
        valid = stamps.held(rec[:, 0], rec[:, 1])
        out = np.where(valid, rec[:, 0], -1)
        known = valid | (rec[:, 1] != 0) if self.complete else valid  # complete: absent and stale are "not held"
        pending = self._pending
        if pending:  # admitted where no entry could record it: a "not held" record of one is asked
            doubt = np.flatnonzero(known & ~valid)
            known[[j for j in doubt.tolist() if key_of(int(pages[j])) in pending]] = False
        ask = np.flatnonzero(~known)
        lookup = self.host.lookup_full if kind is AttnKind.FULL else self.host.lookup_swa
        done, chunk = 0, 16 if leading else ask.size
        while done < ask.size:
            part = pages[ask[done:done + chunk]]
            got = lookup([key_of(i) for i in part.tolist()])
            out[ask[done:done + chunk]] = got
            if walk.engine:
                self._record(views, part, got, _stamps_of(self.host, kind, got), col)
                if pending:
                    for i in part.tolist():
                        pending.pop(key_of(i), None)
            done += part.size
            if leading and (got < 0).any():
                break
            chunk *= 4
        answered = int(np.count_nonzero(known))
        self.counters["l2_pages_read_off_tree"] += answered
        self.counters["l2_pages_absent_off_tree"] += answered - int(np.count_nonzero(valid))
        self.counters["l2_pages_asked_by_key"] += done
        return out

    def admitted_unnamed(self, keys: Iterable[bytes]) -> None:
        """L2 admitted ``keys`` where its owner could not record them on the entries
        naming them (vLLM's copy-downs of blocks its pool gave up come with keys
        only): a record reading "not held" for one of them is asked of L2 by key
        (once: the answer is recorded).  At most :data:`PENDING_MAX` are kept,
        oldest out (past it such a page reads as a miss, never a wrong page).  O(keys)."""
        pending = self._pending
        for k in keys:
            pending[k] = None
        while len(pending) > PENDING_MAX:
            pending.popitem(last=False)

    def landed(self, views: Sequence[tuple[np.ndarray | None, int, int]], kind: AttnKind, pages: np.ndarray,
               keys: Sequence[bytes]) -> None:
        """Record on ``views`` (a walk's :meth:`TreeWalk.segments`, taken on the
        engine's thread when the read began) where L2 holds the ``kind`` KV of
        ``pages`` (ascending page indices of the walk's prompt, stored under L2
        ``keys``) now: an L3 -> L2 landing, admitted off the engine's thread (under
        the owner's mutex; a torn pair reads as not held: a miss, never a wrong
        page).  O(entries + pages)."""
        if not len(pages):
            return
        slots = self.host.lookup_full(keys) if kind is AttnKind.FULL else self.host.lookup_swa(keys)
        views = [(rows, lo, k) for rows, lo, k in views if rows is not None and rows.shape[1] == _WIDTH]
        self._record(views, np.asarray(pages, dtype=np.int64), slots, _stamps_of(self.host, kind, slots), _SLOT[kind])

    def loaded(self, names: PageNames, full_idx: np.ndarray, from_full: np.ndarray, swa_idx: np.ndarray,
               from_swa: np.ndarray) -> PageNames:
        """``names`` of the pages an L2 -> L1 load inserts, with where L2 holds them
        recorded: the full KV of pages ``full_idx`` in host pages ``from_full``, the
        SWA of pages ``swa_idx`` in ``from_swa`` (the insert keeps the records of the
        pages it adds).  O(pages)."""
        rows = unrecorded(len(names.keys))
        record_rows(self.host, rows, AttnKind.FULL, full_idx, from_full)
        record_rows(self.host, rows, AttnKind.SWA, swa_idx, from_swa)
        return replace(names, host_at=rows)

    def check(self, entries: Iterable[tuple[list[bytes | None], np.ndarray]]) -> None:
        """Every valid record names a page L2 holds under that entry's name, in that
        slot; with ``complete``, every recorded page too (absent or stale: L2 holds
        none under that name).  ``entries`` gives each named entry's names and
        ``host_at``.  O(pages)."""
        host = self.host
        for names, rows in entries:
            for kind, col in _SLOT.items():
                valid = host.stamps[kind].held(rows[:, col], rows[:, col + 1])
                ok = np.flatnonzero(valid | (rows[:, col + 1] != 0) if self.complete else valid)
                if ok.size:
                    keys = [names[i] if kind is AttnKind.FULL else swa_key(names[i]) for i in ok.tolist()]
                    got = host.lookup_full(keys) if kind is AttnKind.FULL else host.lookup_swa(keys)
                    want = np.where(valid[ok], rows[ok, col], -1)
                    assert (got == want).all(), f"a {kind} record L2 does not bear out"

    @staticmethod
    def _gather(walk: TreeWalk, pages: np.ndarray, col: int
                ) -> tuple[np.ndarray, list[tuple[np.ndarray, int, int]]]:
        """The (slot, stamp) record of each of ``pages`` (unrecorded past the walk
        or on an unnamed node) and the walk's recorded entries.  O(entries + pages)."""
        rec = unrecorded(len(pages))[:, :2]
        first, last = int(pages[0]), int(pages[-1])
        views = [(rows, lo, k) for rows, lo, k in walk.segments()
                 if rows is not None and lo <= last and lo + k > first]  # the entries holding some of pages
        if last - first + 1 == len(pages):  # a range of pages: plain slices
            for rows, lo, k in views:
                a, b = max(lo, first), min(lo + k, last + 1)
                rec[a - first:b - first] = rows[a - lo:b - lo, col:col + 2]
            return rec, views
        for rows, lo, k in views:
            a, b = np.searchsorted(pages, (lo, lo + k))
            if a < b:
                rec[a:b] = rows[pages[a:b] - lo, col:col + 2]
        return rec, views

    @staticmethod
    def _record(views: Sequence[tuple[np.ndarray, int, int]], pages: np.ndarray, slots: np.ndarray,
                stamps: np.ndarray, col: int) -> None:
        """Write L2's answers for ``pages`` onto the entries recording them.  O(entries + pages)."""
        for rows, lo, k in views:
            a, b = np.searchsorted(pages, (lo, lo + k))
            if a < b:
                at = pages[a:b] - lo
                rows[at, col] = slots[a:b]
                rows[at, col + 1] = stamps[a:b]
