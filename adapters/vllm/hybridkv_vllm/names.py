"""The connector's page keys kept on the prefix manager's tree, one tree for L1 and the tiers' names.

With hybridkv's device prefix cache (``--scheduler-cls``, :mod:`.prefix`) the
connector and the tree run on vLLM's scheduler thread side by side.  As in the
core (:meth:`hybridkv.tiers.coordinator.TierCoordinator.walk_prompt`), the tree
keeps the name of each page it caches: here, the connector's chained keys of
every KV-cache group for that page (each group's keys are at its own block
size; a tree page holds ``page_size // block_size`` blocks of each group), one
``bytes`` per page, the groups' keys in the connector's group order
(:data:`~hybridkv.tiers.keys.KEY_BYTES` each).  What the tree evicts stays
named as evicted runs (:mod:`hybridkv.radix.evicted`), within a cap: the full
pages L2's index holds (without L2, the device's own page count).

A lookup then reads the keys of a prompt's leading pages off the tree (its L1
walk, then the runs where that walk ends, :meth:`EvictedRuns.along
<hybridkv.radix.evicted.EvictedRuns.along>`) and hashes only the pages past
them.  A name is a function of the page's tokens and those before it, under the
connector's namespace (its ``namespace`` and the request's cache salt, which the
tree's namespace includes), so a name read off the tree is the key hashing would
give, whatever the tiers hold meanwhile.

Where L2 holds a named page is recorded on its tree entry too, as the core's
lookup does (:mod:`hybridkv.tiers.records`): each tree page keeps one (host
slot, stamp) pair per block of every group (``host_at``, :attr:`TreeNames.record_width`
columns, the groups' blocks in the connector's order).  A save or a load that
places a request's pages in L2 (a load: where L2 holds them, or admits them
from L3) keeps each slot and its stamp on the request's state
(:meth:`TreeNames.placed`) for the prefix manager's insert of those pages, and
records it at once on the tree pages already spelling the request's tokens; the
blocks past them are *orphans* (pages L2 holds that no entry records) until the
insert names them.  L2's copy-downs of blocks vLLM's pool gave up are orphans
too (:meth:`TreeNames.rescued`), and so are the held blocks of a run the tree
drops (:meth:`TreeNames.orphan_run`).  The records are then complete
(:mod:`hybridkv.tiers.records`): a lookup (:meth:`TreeNames.l2_held`) answers
every block off the tree's records and the orphans, never asking L2's index;
an orphan found is recorded on the entry naming it.  Counters
``l2_pages_read_off_tree`` (of them ``l2_pages_absent_off_tree`` and
``l2_pages_read_off_orphans``) and ``l2_pages_asked_by_key`` (0).  L3 is still
asked through its record by key (:mod:`.sources`).

The runs name what L2 and L3 hold, as in the core: L2 tells a
:class:`~hybridkv.tiers.records.LetGo` each full block it lets go that vLLM's
pool lacks, and before the next lookup's walk the runs ending with such a page
are cut back to their last page L2 or L3's record still holds
(:meth:`TreeNames.seed`; counter ``tree_run_pages_let_go``), and so are the
runs made since then whose last page neither holds (L2 let it go while vLLM's
pool held it, e.g. a page loaded into the device, which L2 does not count as
L1's; checked once the copy-downs of what the pool gave up are in L2).  A tree page is
let go by its first full group's last block (:meth:`TreeNames.page_key`): L2
lets a page's blocks go from the last, leaf first; a page whose other full
groups' blocks leave first stays named until that block does (its records say
what L2 still holds of it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from hybridkv.radix import PageNames
from hybridkv.radix.node import EvictedRun, unrecorded
from hybridkv.spec import AttnKind
from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.keys import KEY_BYTES
from hybridkv.tiers.records import HostRecords, LetGo, TreeWalk

from .jobs import ReqState
from .l1 import L1View
from .l2 import HostPageIndex
from .plan import GroupInfo

__all__ = ["FINISHING_MAX", "TreeNames", "bind_names"]

#: finished requests whose state waits for the prefix manager's insert (a delayed free:
#: until the worker's finish save is done); past it the oldest go (their pages stay unnamed)
FINISHING_MAX = 4096


class TreeNames:
    """Names of the tree's pages, made from and read back into the connector's keys.

    Args:
        groups: the connector's KV-cache groups, in its order.
        manager: the prefix manager (its ``tree`` and ``namespace``; the tree is
            rebuilt by a prefix-cache reset, so it is read each time).
        page_size: tokens per tree page (a multiple of every group's block size:
            :meth:`fits`).
        l2: L2's index, whose records the tree keeps (None: no L2, nothing recorded).
        store: L3's record, what L3 holds as the connector knows (None: no L3).

    Attributes: ``width`` (bytes of one page's name), ``record_width`` (columns
    of one page's ``host_at`` record), ``counts`` (the two record counters'
    increments since :meth:`pull_counts`).
    """

    def __init__(self, groups: Sequence[GroupInfo], manager: Any, page_size: int,
                 l2: HostPageIndex | None = None, store: StoreIndex | None = None) -> None:
        if not self.fits(groups, page_size):
            raise ValueError(f"page_size {page_size} is not a multiple of every group's block size")
        self.groups = list(groups)
        self.manager = manager
        self.page_size = page_size
        self.per_page = [page_size // g.block_size for g in self.groups]
        self.width = sum(self.per_page) * KEY_BYTES  # bytes of one page's name
        self.record_width = 2 * sum(self.per_page)  # a (slot, stamp) pair per block of every group
        self._first_pair = {g.index: int(sum(self.per_page[:i])) for i, g in enumerate(self.groups)}
        self._per_page = {g.index: k for g, k in zip(self.groups, self.per_page)}
        self._kind = {g.index: AttnKind.SWA if g.is_swa else AttnKind.FULL for g in self.groups}  # L2's
        self.counts: dict[str, int] = {}
        # complete: every L2 admission (a save's or a load's placement) is recorded on the tree
        self.records = HostRecords(l2.tier, self.counts, complete=True) if l2 is not None else None
        # the full blocks L2 lets go, cut from the runs before the next walk (none without a full group)
        full = next((g for g in self.groups if not g.is_swa), None)
        self.let_go = LetGo(l2.tier, store) if l2 is not None and full is not None else None
        self.copy_downs_pending: Callable[[], bool] = lambda: False  # L1's pages given up, not in L2 yet
        if full is not None:
            at = (self._first_pair[full.index] + self._per_page[full.index] - 1) * KEY_BYTES
            self._tail = slice(at, at + KEY_BYTES)
        self._finishing: OrderedDict[str, ReqState] = OrderedDict()

    def page_key(self, name: bytes) -> bytes:
        """The key L2 lets the tree page named ``name`` go by: its first full group's
        last block's (:meth:`EvictedRuns.key_pages_by
        <hybridkv.radix.evicted.EvictedRuns.key_pages_by>`).  O(1)."""
        return name[self._tail]

    @staticmethod
    def fits(groups: Sequence[GroupInfo], page_size: int) -> bool:
        """Every group has a whole number of blocks in a tree page."""
        return page_size > 0 and all(g.block_size > 0 and page_size % g.block_size == 0 for g in groups)

    def names(self, keys: dict[int, list[bytes]], lo: int, n: int,
              l2_at: dict[int, list[np.ndarray]] | None = None) -> PageNames:
        """Names of pages ``[0, n)`` from ``keys`` (per group index, at least ``n``
        pages' worth), None below page ``lo`` (the part the insert skips), with the
        L2 records ``l2_at`` holds for them (a request's :attr:`ReqState.l2_at`).
        O((n - lo) * groups + records)."""
        cols = [(keys[g.index], k) for g, k in zip(self.groups, self.per_page)]
        out: list[bytes | None] = [None] * lo
        out += [b"".join(b"".join(ks[i * k:(i + 1) * k]) for ks, k in cols) for i in range(lo, n)]
        rows = self._rows(lo, n, l2_at or {})
        if self.records is not None:  # the insert records these placements: no longer orphans
            for gi, parts in (l2_at or {}).items():
                k, ks = self._per_page[gi], keys[gi]
                for part in parts:
                    part = part[(part[:, 0] >= lo * k) & (part[:, 0] < min(n * k, len(ks)))]
                    self.records.adopted(self._kind[gi], [ks[i] for i in part[:, 0].tolist()], part[:, 1:3])
        return PageNames(out, np.zeros(n, dtype=bool), host_at=rows)

    def _rows(self, lo: int, n: int, l2_at: dict[int, list[np.ndarray]]) -> np.ndarray:
        """``host_at`` rows of pages ``[0, n)`` with the records ``l2_at`` holds for
        pages ``[lo, n)`` (later placements of a block win).  O(n + records)."""
        rows = unrecorded(n, self.record_width)
        for gi, parts in l2_at.items():
            k, first = self._per_page[gi], self._first_pair[gi]
            at = np.concatenate(parts) if len(parts) > 1 else parts[0]
            at = at[(at[:, 0] >= lo * k) & (at[:, 0] < n * k)]
            col = 2 * (first + at[:, 0] % k)
            rows[at[:, 0] // k, col] = at[:, 1]
            rows[at[:, 0] // k, col + 1] = at[:, 2]
        return rows

    def placed(self, st: ReqState | None, pages: dict[int, list[int]],
               slots: dict[int, np.ndarray] | dict[int, list[int]]) -> None:
        """A save or a load placed request ``st``'s ``pages`` (per group index, page
        indices) in L2 ``slots`` (parallel; ``-1``: not held): keep each slot and its stamp
        now on ``st`` (:attr:`ReqState.l2_at`) for the tree's records at the prefix
        manager's insert, and record them now on the tree pages already spelling the
        request's tokens (a finish save is placed after the insert): every L2
        admission is recorded on the entries naming its pages, so the records are
        complete (:mod:`hybridkv.tiers.records`).  O(depth + pages)."""
        if st is None or self.records is None:
            return
        stamps = self.records.host.stamps
        now: dict[int, list[np.ndarray]] = {}
        for gi, idx in pages.items():
            got = slots.get(gi)
            if got is None or not len(idx):
                continue
            got = np.asarray(got, dtype=np.int64)
            kind = self._kind[gi]
            keep = got >= 0
            if keep.any():
                part = np.stack([np.asarray(idx, dtype=np.int64)[keep], got[keep], stamps[kind].of(got[keep])], 1)
                st.l2_at.setdefault(gi, []).append(part)
                now[gi] = [part]
        n = max((int(p[0][:, 0].max()) // self._per_page[gi] + 1 for gi, p in now.items()), default=0)
        tokens = st.request.all_token_ids
        named = 0
        if n and len(tokens) >= n * self.page_size:
            mgr = self.manager
            named = mgr.lifecycle.take_records(np.asarray(tokens[:n * self.page_size], dtype=np.int32),
                                               mgr.namespace(st.request), self._rows(0, n, now))
        for gi, (part,) in now.items():  # placed where no tree page spells them yet: orphans until the insert
            keys = st.keys.get(gi, [])
            rest = part[(part[:, 0] >= named * self._per_page[gi]) & (part[:, 0] < len(keys))]
            if len(rest):
                self.records.orphan(self._kind[gi], [keys[i] for i in rest[:, 0].tolist()], rest[:, 1])

    def rescued(self, gi: int, keys: list[bytes], slots: Any) -> None:
        """L2 admitted copy-downs of group ``gi``'s blocks vLLM's pool gave up (keys and
        L2 ``slots``; the tree's entry naming each, if any, is unknown here): orphans,
        read by the next lookup over them (:meth:`HostRecords.orphan
        <hybridkv.tiers.records.HostRecords.orphan>`).  O(keys)."""
        if self.records is not None:
            self.records.orphan(self._kind[gi], keys, np.asarray(slots, dtype=np.int64))

    def orphan_run(self, run: EvictedRun) -> None:
        """The device tree drops an evicted run (its cap, an insert over it): each block
        its records say L2 holds becomes an orphan, under the block's own key (a tree
        page's name is its blocks' keys, group by group).  O(pages * blocks)."""
        rows = run.host_at
        if self.records is None or rows.shape[1] != self.record_width:
            return
        for gi, k in self._per_page.items():
            kind, first = self._kind[gi], self._first_pair[gi]
            for b in range(k):
                p = first + b
                held = np.flatnonzero(self.records.host.stamps[kind].held(rows[:, 2 * p], rows[:, 2 * p + 1]))
                if held.size:
                    keys = [run.names[i][p * KEY_BYTES:(p + 1) * KEY_BYTES] for i in held.tolist()]
                    self.records.orphan_rows(kind, keys, rows[held, 2 * p:2 * p + 2])

    def seed(self, st: ReqState, limit: int) -> int:
        """Fill ``st.keys`` (still empty) with the keys of the request's leading pages
        the tree names, up to ``limit`` tokens (page aligned), and keep the walk
        they were read off (``st.walk``: its entries' L2 records, :meth:`l2_held`).
        Returns the pages named.  On the scheduler's thread (the tree's own).
        O(depth + pages read)."""
        if st.keys or limit < self.page_size:
            return 0
        mgr = self.manager
        limit = limit // self.page_size * self.page_size
        rid, looked = mgr.looked_up  # the manager's lookup of this request, just before: its tokens
        if rid == st.request.request_id and len(looked) >= limit:
            tokens = looked[:limit]
        else:
            tokens = np.asarray(st.request.all_token_ids[:limit], dtype=np.int32)  # the tree's token dtype
        runs: list = []
        if self.let_go is not None:  # the runs name what the tiers hold: cut what L2 let go (then the cap's trim)
            cut = self.let_go.drain(mgr.tree.runs, fresh=not self.copy_downs_pending())
            self.counts["tree_run_pages_let_go"] = self.counts.get("tree_run_pages_let_go", 0) + cut
        names, path = mgr.tree.walk_names(tokens, mgr.namespace(st.request), limit, runs=runs)  # runs trimmed first
        if self.records is not None:  # the entries' records as they are now (later lookups read them too;
            st.walk = TreeWalk(path, runs).freeze(self.record_width)  # none: every page past the tree)
        if not names:
            return 0
        blob = b"".join(names)
        assert len(blob) == len(names) * self.width, "a tree name of another group layout"
        cols = np.frombuffer(blob, dtype=f"V{KEY_BYTES}").reshape(len(names), -1)  # a key per column
        off = 0
        for g, k in zip(self.groups, self.per_page):  # void items come back as bytes, NULs kept
            st.keys[g.index] = cols[:, off:off + k].reshape(-1).tolist()
            off += k
        return len(names)

    def l2_held(self, walk: TreeWalk, g: GroupInfo, keys: Sequence[bytes], lo: int, hi: int) -> np.ndarray:
        """Bool per block ``[lo, hi)`` of group ``g`` (``keys``: the group's keys, at least
        ``hi``): L2's index holds it.  Read off the records of ``walk``'s entries and
        the orphans (complete records, :mod:`hybridkv.tiers.records`); an orphan found
        is recorded on the entry naming it (so only on the scheduler's thread).  The
        same answers as asking every block by key.  O(entries of the walk + blocks)
        per block of a tree page."""
        assert self.records is not None, "no L2 to read"
        k, first = self._per_page[g.index], self._first_pair[g.index]
        kind = self._kind[g.index]
        blocks = np.arange(lo, hi, dtype=np.int64)
        out = np.zeros(blocks.size, dtype=bool)
        for b in range(k):  # block b of each tree page: its own column pair
            sel = blocks[blocks % k == b] if k > 1 else blocks
            if sel.size:
                slots = self.records.slots(kind, walk, sel // k, lambda p, b=b: keys[p * k + b], pair=first + b)
                out[sel - lo] = slots >= 0
        return out

    def pull_counts(self) -> dict[str, int]:
        """The record counters' increments since the last call (nonzero ones).  O(1)."""
        out = {n: v for n, v in self.counts.items() if v}
        for n in out:
            self.counts[n] = 0
        return out

    def reloaded(self, request_id: str, start: int, end: int) -> int:
        """Of a load of tokens ``[start, end)``, the tokens whose full KV the device's tree
        holds: repair case 2 in vLLM (the device holds a prompt's full KV but not the
        window its hit needs) loads them again, as vLLM hands the connector only the
        window-safe device hit.  O(1)."""
        return max(0, min(self.manager.device_full_tokens(request_id), end) - start)

    # ------------------------------------------------------------ finished requests
    def keep(self, st: ReqState) -> None:
        """Keep a finished request's state until the prefix manager's insert names its
        pages (vLLM frees its blocks after the connector's ``request_finished``, or
        later for a delayed free); at most :data:`FINISHING_MAX` are kept, oldest out.  Its
        walk is let go (no lookup follows a finish).  O(1)."""
        st.walk = None
        self._finishing[st.request.request_id] = st
        while len(self._finishing) > FINISHING_MAX:
            self._finishing.popitem(last=False)

    def peek(self, request_id: str, live: dict[str, ReqState]) -> ReqState | None:
        """The connector's state of a request, live or finished and kept (left kept).  O(1)."""
        return live.get(request_id) or self._finishing.get(request_id)

    def state(self, request_id: str, live: dict[str, ReqState]) -> ReqState | None:
        """The connector's state of a request: live (``live``), or finished and kept
        (:meth:`keep`; handed out once).  O(1)."""
        return live.get(request_id) or self._finishing.pop(request_id, None)


def bind_names(groups: Sequence[GroupInfo], manager: Any, live: dict[str, ReqState],
               keys_of: Callable[[ReqState, int], dict[int, list[bytes]]],
               l2: HostPageIndex | None, l1: L1View | None = None, store: StoreIndex | None = None
               ) -> TreeNames | None:
    """Keep names on ``manager``'s tree when it is hybridkv's prefix manager (its
    ``name_pages``) and its pages fit every group's blocks; None otherwise.  The
    names come from the connector's state (``live``: its requests by id, then
    :meth:`TreeNames.keep`) and keys (``keys_of(state, tokens)``); the evicted
    runs, L2 and L3 entries, are capped at the tree pages the tiers below hold as
    far as the connector knows: the full blocks L2's index (``l2``) holds (the
    device's without L2) and the keys of L3's record (``store``), per tree page's
    full blocks.  ``l1``: the copy-downs whose admissions to L2 the records hear of
    by key (:meth:`TreeNames.rescued`)."""
    page_size = getattr(manager, "page_size", 0)
    if not hasattr(manager, "name_pages") or not TreeNames.fits(groups, page_size):
        return None
    names = TreeNames(groups, manager, page_size, l2, store)
    if names.records is not None and l1 is not None:
        l1.on_admit = names.rescued
        names.copy_downs_pending = l1.pending
    per = sum(k for g, k in zip(names.groups, names.per_page) if not g.is_swa) or 1
    device = manager.block_pool.num_gpu_blocks

    def cap() -> int:  # full blocks of every full group per tree page (with those let go, not yet cut)
        held = l2.tier.num_full_pages if l2 is not None else device
        return (held + (len(store) if store is not None else 0) + len(names.let_go or ())) // per

    def namer(request: Any, lo: int, n: int) -> PageNames | None:
        st = names.state(request.request_id, live)
        return None if st is None else names.names(keys_of(st, n * page_size), lo, n, st.l2_at)

    manager.name_pages(namer, cap, on_drop=names.orphan_run if names.records is not None else None,
                       page_key=names.page_key if names.let_go is not None else None)
    return names
