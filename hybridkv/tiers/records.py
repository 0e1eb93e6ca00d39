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

*Complete records* (``complete``: the core's
:class:`~hybridkv.tiers.coordinator.TierCoordinator`, so SGLang's radix cache
too, and vLLM's connector with hybridkv's prefix manager): every page L2 holds
is recorded on the tree entry naming it, or else is an *orphan*, a page L2
holds that no entry records, kept in a short list (:meth:`HostRecords.orphan`).
A lookup then never asks L2's index: valid is held; absent, stale (the slot
was freed or reused since), never recorded or past the walk is not held unless
the page is an orphan (then recorded on the entry naming it, if any).  So what
L2 holds is known in one place, the tree, as HiCache's host nodes are; L2's
index serves L2 alone (admission, eviction).  Every admission records where it
happens:

* a finish's copies on the request's path (:meth:`hybridkv.lifecycle.Lifecycle.take_records`,
  before the insert) and on the new leaves (the insert's names);
* a free listener's on the pages' entry (:class:`~hybridkv.radix.types.FreedPages`:
  views, or the cells it changed written back); names without records: orphans;
* an L2 -> L1 load on the pages it inserts; an L3 -> L2 landing on the walk
  that asked for it (:meth:`HostRecords.landed`), orphans past it;
* vLLM: a save's or load's placement on the tree pages spelling the request's
  tokens, orphans past them until the insert adopts them
  (:meth:`HostRecords.adopted`); copy-downs (keys only): orphans;
* a run the tree drops (its cap, runs off) or cuts (:meth:`EvictedRuns.let_go
  <hybridkv.radix.evicted.EvictedRuns.let_go>`: L2 let a page go) leaves its held
  pages as orphans (:attr:`EvictedRuns.on_drop
  <hybridkv.radix.evicted.EvictedRuns.on_drop>`; an eviction's runs are capped
  after its listeners recorded on them).  A page L2 lets go leaves its run
  (:class:`LetGo`, in the core and in vLLM's connector alike), so the cap no
  longer drops pages L2 holds.

Orphans are believed only while L2's stamp of their slot matches, and swept
of stale ones as they grow.  :meth:`HostRecords.check` holds every record to
L2 exactly and every full page L2 holds to a record or an orphan.  Without
``complete`` only valid records are believed and the other pages are asked of
L2's index by key, the answers recorded on the entry (on the engine's thread
only: the one that changes the tree).  Either way answers are the same as
asking L2 every time, which the tests check page by page, with planted faults
for each admission path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain, compress, filterfalse
from typing import Callable, Iterable, Sequence

import numpy as np

from ..radix.evicted import EvictedRuns
from ..radix.node import EvictedRun, TreeNode, unrecorded
from ..radix.types import PageNames
from ..spec import AttnKind
from .host import HostTier
from .index import StoreIndex
from .payload import swa_key

__all__ = ["ABSENT", "HostRecords", "LetGo", "TreeWalk", "record_rows"]

_SLOT = {AttnKind.FULL: 0, AttnKind.SWA: 2}  # a kind's columns in host_at: slot, then stamp

_ORPHANS_MIN = 4096  # orphans kept before the first sweep for stale ones

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
        # pages L2 holds that no entry records (complete only): L2 key -> (slot, stamp), per kind
        self._orphans: dict[AttnKind, dict[bytes, tuple[int, int]]] = {AttnKind.FULL: {}, AttnKind.SWA: {}}
        self._bound = dict.fromkeys(self._orphans, _ORPHANS_MIN)  # swept for stale ones past it
        for name in ("l2_pages_read_off_tree", "l2_pages_absent_off_tree", "l2_pages_read_off_orphans",
                     "l2_pages_asked_by_key"):
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
        if self.complete:
            self._off_orphans(kind, walk, pages, key_of, valid, out, views, col, leading)
            return out
        ask = np.flatnonzero(~valid)
        lookup = self.host.lookup_full if kind is AttnKind.FULL else self.host.lookup_swa
        done, chunk = 0, 16 if leading else ask.size
        while done < ask.size:
            part = pages[ask[done:done + chunk]]
            got = lookup([key_of(i) for i in part.tolist()])
            out[ask[done:done + chunk]] = got
            if walk.engine:
                self._record(views, part, got, _stamps_of(self.host, kind, got), col)
            done += part.size
            if leading and (got < 0).any():
                break
            chunk *= 4
        self.counters["l2_pages_read_off_tree"] += int(np.count_nonzero(valid))
        self.counters["l2_pages_asked_by_key"] += done
        return out

    def _off_orphans(self, kind: AttnKind, walk: TreeWalk, pages: np.ndarray, key_of: Callable[[int], bytes],
                     valid: np.ndarray, out: np.ndarray, views: list[tuple[np.ndarray, int, int]], col: int,
                     leading: bool) -> None:
        """:meth:`slots` with complete records: a page without a valid record is held
        only as an orphan (:meth:`orphan`), found there and then recorded on the
        walk's entry naming it; L2's index is not asked.  ``leading``: the orphans
        are looked up in page order up to the first page neither recorded held
        nor an orphan (the pages after it read ``-1`` unless recorded).  Fills
        ``out``.  O(pages), or O(pages up to that one) with ``leading``."""
        orphans = self._orphans[kind]
        rest = np.flatnonzero(~valid)
        found = 0
        if rest.size and orphans:  # (keys hashed only while some page is an orphan)
            at = []
            for j in rest.tolist():
                got = orphans.get(key_of(int(pages[j])))
                if got is not None:
                    at.append((j, got))
                elif leading:
                    break
            if at:
                idx = np.array([j for j, _ in at], dtype=np.int64)
                cand = np.array([got for _, got in at], dtype=np.int64)
                ok = self.host.stamps[kind].held(cand[:, 0], cand[:, 1])
                idx, cand = idx[ok], cand[ok]
                out[idx] = cand[:, 0]
                found = idx.size
                if walk.engine and found:
                    self._record(views, pages[idx], cand[:, 0], cand[:, 1], col)
        c = self.counters
        c["l2_pages_read_off_tree"] += len(pages)
        c["l2_pages_absent_off_tree"] += int(rest.size) - found
        c["l2_pages_read_off_orphans"] += found

    def orphan(self, kind: AttnKind, keys: Sequence[bytes], slots: np.ndarray) -> None:
        """L2 holds the ``kind`` KV stored under ``keys`` in host ``slots`` (``-1``:
        not: skipped), and no tree entry records it: a page the owner admitted
        before any entry named it (an L3 landing past a walk, a save before the
        insert, a copy-down known by key only), or whose entry the tree dropped
        (:meth:`orphan_rows`).  Kept while L2's stamp of the slot matches (swept
        past a bound).  O(keys), amortized."""
        slots = np.asarray(slots, dtype=np.int64)
        stamps = _stamps_of(self.host, kind, slots)
        d = self._orphans[kind]
        for k, s, t in zip(keys, slots.tolist(), stamps.tolist()):
            if s >= 0:
                d[k] = (s, t)
        if len(d) > self._bound[kind]:
            self._sweep(kind)

    def adopted(self, kind: AttnKind, keys: Sequence[bytes], rows: np.ndarray) -> None:
        """An entry now records the pages stored under ``keys`` at (slot, stamp)
        ``rows`` (an insert named them with their records): an orphan recorded
        there is one no more (one L2 moved since stays).  O(keys)."""
        d = self._orphans[kind]
        if d:
            for k, s, t in zip(keys, rows[:, 0].tolist(), rows[:, 1].tolist()):
                if d.get(k) == (s, t):
                    del d[k]

    def orphan_rows(self, kind: AttnKind, keys: Sequence[bytes], rows: np.ndarray) -> None:
        """The entry naming ``keys`` with (slot, stamp) ``rows`` (two columns, one
        per key) leaves the tree: its pages L2 still holds become orphans.  O(keys)."""
        ok = np.flatnonzero(self.host.stamps[kind].held(rows[:, 0], rows[:, 1]))
        if ok.size:
            d = self._orphans[kind]
            d.update(zip([keys[i] for i in ok.tolist()], zip(rows[ok, 0].tolist(), rows[ok, 1].tolist())))
            if len(d) > self._bound[kind]:
                self._sweep(kind)

    def orphan_run(self, run: EvictedRun) -> None:
        """An evicted run the tree drops (its cap, runs off): the pages it
        records L2 holds become orphans (a run hook of the core's records; SWA keys
        hashed only for those).  O(pages)."""
        rows = run.host_at
        if rows.shape[1] != _WIDTH:
            return
        self.orphan_rows(AttnKind.FULL, run.names, rows[:, 0:2])
        held = np.flatnonzero(self.host.stamps[AttnKind.SWA].held(rows[:, 2], rows[:, 3]))
        if held.size:
            self.orphan_rows(AttnKind.SWA, [swa_key(run.names[i]) for i in held.tolist()], rows[held, 2:4])

    def _sweep(self, kind: AttnKind) -> None:
        """Forget the orphans L2 no longer holds; the next sweep waits for twice as
        many.  O(orphans)."""
        d = self._orphans[kind]
        if d:
            cand = np.fromiter(chain.from_iterable(d.values()), dtype=np.int64, count=2 * len(d)).reshape(-1, 2)
            ok = self.host.stamps[kind].held(cand[:, 0], cand[:, 1])
            self._orphans[kind] = {k: d[k] for k in compress(list(d), ok.tolist())}
        self._bound[kind] = max(_ORPHANS_MIN, 2 * len(self._orphans[kind]))

    @property
    def num_orphans(self) -> int:
        """Orphans kept (some may be stale until the next sweep).  O(1)."""
        return sum(len(d) for d in self._orphans.values())

    def landed(self, views: Sequence[tuple[np.ndarray | None, int, int]], kind: AttnKind, pages: np.ndarray,
               keys: Sequence[bytes]) -> None:
        """Record on ``views`` (a walk's :meth:`TreeWalk.segments`, taken on the
        engine's thread when the read began) where L2 holds the ``kind`` KV of
        ``pages`` (ascending page indices of the walk's prompt, stored under L2
        ``keys``) now: an L3 -> L2 landing, admitted off the engine's thread (under
        the owner's mutex; a torn pair reads as not held: a miss, never a wrong
        page).  Pages no entry of the walk names become orphans (:meth:`orphan`).
        O(entries + pages)."""
        if not len(pages):
            return
        pages = np.asarray(pages, dtype=np.int64)
        slots = self.host.lookup_full(keys) if kind is AttnKind.FULL else self.host.lookup_swa(keys)
        views = [(rows, lo, k) for rows, lo, k in views if rows is not None and rows.shape[1] == _WIDTH]
        self._record(views, pages, slots, _stamps_of(self.host, kind, slots), _SLOT[kind])
        named = np.zeros(len(pages), dtype=bool)
        for _, lo, k in views:
            a, b = np.searchsorted(pages, (lo, lo + k))
            named[a:b] = True
        if not named.all():
            rest = np.flatnonzero(~named)
            self.orphan(kind, [keys[i] for i in rest.tolist()], slots[rest])

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
        slot.  With ``complete``: every recorded page too (absent or stale: L2
        holds none under that name, unless it is an orphan), and every full page
        L2 holds is recorded on an entry or an orphan, so a lookup needs not ask
        L2.  ``entries`` gives each named entry's names and ``host_at``.  O(pages)."""
        host = self.host
        named: set[bytes] = set()
        for names, rows in entries:
            for kind, col in _SLOT.items():
                valid = host.stamps[kind].held(rows[:, col], rows[:, col + 1])
                ok = np.flatnonzero(valid | (rows[:, col + 1] != 0) if self.complete else valid)
                if ok.size:
                    keys = [names[i] if kind is AttnKind.FULL else swa_key(names[i]) for i in ok.tolist()]
                    got = host.lookup_full(keys) if kind is AttnKind.FULL else host.lookup_swa(keys)
                    want = np.where(valid[ok], rows[ok, col], -1)
                    bad = np.flatnonzero(got != want)
                    assert all(self._orphan_at(kind, keys[i]) == got[i] for i in bad.tolist()), \
                        f"a {kind} record L2 does not bear out"
                    if kind is AttnKind.FULL:
                        named.update(keys[i] for i in np.flatnonzero(valid[ok]).tolist())
        if self.complete:
            for k in host.full_keys():
                assert k in named or self._orphan_at(AttnKind.FULL, k) >= 0, "a full page L2 holds that no entry records"

    def _orphan_at(self, kind: AttnKind, key: bytes) -> int:
        """The slot of orphan ``key`` while L2 holds it there, else ``-1``.  O(1)."""
        got = self._orphans[kind].get(key)
        if got is None or not self.host.stamps[kind].held(np.array([got[0]]), np.array([got[1]]))[0]:
            return -1
        return got[0]

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


class LetGo:
    """The full keys L2 let go since the last walk, to cut from a tree's evicted runs.

    L2 tells it each full key it evicts or discards that L1 lacks
    (:attr:`HostTier.gone_listeners <hybridkv.tiers.host.HostTier.gone_listeners>`,
    possibly on a tiers' thread: its owner's lock covers both); before the next
    walk, on the engine's thread, :meth:`drain` cuts the runs ending with them
    back to their last page L2 (again) or L3 (as its record knows) holds
    (:meth:`EvictedRuns.let_go <hybridkv.radix.evicted.EvictedRuns.let_go>`).
    The core's coordinator and vLLM's connector (its tree's pages are let go by
    their last full block's key) both keep one.

    Args:
        host: L2.
        l3: L3's record, what L3 holds as far as the owner knows (None: no L3).
    """

    def __init__(self, host: HostTier, l3: StoreIndex | None = None) -> None:
        self.keys: list[bytes] = []  # let go since the last drain (L2's listener appends)
        self._holds = host.holds
        self._l3 = l3
        host.gone_listeners.append(self.keys.append)

    def __len__(self) -> int:
        """Keys not drained yet (they still count within the runs' cap).  O(1)."""
        return len(self.keys)

    def drain(self, runs: EvictedRuns, *, fresh: bool = True) -> int:
        """Cut ``runs`` as the keys let go since the last drain say, and (``fresh``) the
        runs made since then whose last page neither L2 nor L3's record holds;
        returns the pages cut.  O(keys + runs made + pages cut), with one L3
        record lookup for all the keys."""
        holds, gone = self._holds, self.keys
        if self._l3 is not None:  # (without L3 a run's page comes back to L2 only through L1)
            state = self._l3.state
            gone = list(filterfalse(holds, gone))
            gone = list(compress(gone, (~self._l3.held(gone)).tolist()))  # one lock for them all
            cut = runs.let_go(gone, lambda k: holds(k) or state(k) is not None, fresh=fresh)
        else:
            cut = runs.let_go(gone, holds, fresh=fresh)
        self.keys.clear()  # the same list: L2's listener appends to it
        return cut
