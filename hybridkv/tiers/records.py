"""L2 read off the tree: a prompt's walk, and where its entries record L2 holds each page.

A lookup walks the tree (:meth:`~hybridkv.radix.WindowSafeTree.walk_names`):
the L1 nodes its prompt matches, then the runs L1 evicted below them
(:mod:`hybridkv.radix.evicted`).  Every named entry records, per page, where L2
holds it (``host_at``: a host slot and its stamp for the full KV and for the
SWA, :mod:`.slots`).  :class:`HostRecords` answers "which host page holds this
page's full KV / SWA" from those records first: a record is valid exactly while
L2's stamp of its slot matches, so a valid one is the answer and L2 is not asked.
Only pages with no valid record (never recorded, or the slot was freed or
reused since) are asked of L2 by key; the answer is then recorded on the entry
(on the engine's thread only: the one that changes the tree), so the next walk
reads it there.  Answers are the same as asking L2 every time (the records are
either valid or not used), which the tests check page by page.

Recorded eagerly where the slot is at hand: pages an L2 -> L1 load inserts
(:meth:`TierCoordinator._to_l1`); the rest on their first lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from ..radix.node import EvictedRun, TreeNode, unrecorded
from ..radix.types import PageNames
from ..spec import AttnKind
from .host import HostTier
from .payload import swa_key

__all__ = ["HostRecords", "TreeWalk", "record_rows"]

_SLOT = {AttnKind.FULL: 0, AttnKind.SWA: 2}  # a kind's columns in host_at: slot, then stamp


def record_rows(host: HostTier, rows: np.ndarray, kind: AttnKind, idx: np.ndarray, slots: np.ndarray) -> None:
    """Record in ``host_at`` ``rows`` that L2 holds the ``kind`` KV of pages ``idx``
    in host ``slots`` (``-1``: not), stamped now: call it while those slots still
    hold those pages.  O(pages)."""
    col = _SLOT[kind]
    rows[idx, col] = slots
    rows[idx, col + 1] = host.stamps[kind].of(slots)


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
    docstring).  Counters: ``l2_pages_read_off_tree`` (valid records used) and
    ``l2_pages_asked_by_key`` (pages L2 was asked by key).

    Args:
        host: L2.
        counters: the owner's counters (the two above are added to it).
    """

    def __init__(self, host: HostTier, counters: dict[str, int]) -> None:
        self.host = host
        self.counters = counters
        counters.setdefault("l2_pages_read_off_tree", 0)
        counters.setdefault("l2_pages_asked_by_key", 0)

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
        ask = np.flatnonzero(~valid)
        lookup = self.host.lookup_full if kind is AttnKind.FULL else self.host.lookup_swa
        done, chunk = 0, 16 if leading else ask.size
        while done < ask.size:
            part = pages[ask[done:done + chunk]]
            got = lookup([key_of(i) for i in part.tolist()])
            out[ask[done:done + chunk]] = got
            if walk.engine:
                self._record(views, part, got, stamps.of(got), col)
            done += part.size
            if leading and (got < 0).any():
                break
            chunk *= 4
        self.counters["l2_pages_read_off_tree"] += int(valid.sum())
        self.counters["l2_pages_asked_by_key"] += done
        return out

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
        slot: ``entries`` gives each named entry's names and ``host_at``.  O(pages)."""
        host = self.host
        for names, rows in entries:
            for kind, col in _SLOT.items():
                ok = np.flatnonzero(host.stamps[kind].held(rows[:, col], rows[:, col + 1]))
                if ok.size:
                    keys = [names[i] if kind is AttnKind.FULL else swa_key(names[i]) for i in ok.tolist()]
                    got = host.lookup_full(keys) if kind is AttnKind.FULL else host.lookup_swa(keys)
                    assert (got == rows[ok, col]).all(), f"a valid {kind} record L2 does not hold"

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
