"""L2: dual Full/SWA page pools in host memory, indexed by page keys.

L2 holds full KV per page key and SWA KV per page (its own validity,
independent of the full copy), under the chained page keys of
:mod:`hybridkv.tiers.keys` (the names L3 uses): a key names its whole prefix,
so "is page i of this prompt in L2" is one dict lookup, and an L1 page can be
backed up as the L1 tree frees it, knowing only its key.  Each full page also
names its parent's key when stored: the full pages form a tree of keys.

Memory: a :class:`~hybridkv.pools.DualPool` with one shared byte budget
(``device="cpu"``, pinned when CUDA exists, for real KV; ``"meta"`` for
accounting-only replays).

Eviction (LRU within each class), cheapest loss first:

1. *plain* SWA pages (not a sequence tail or retention checkpoint window);
2. full pages, the least recently used *leaf* first: a page goes only once no
   page L2 holds extends it (a plain LRU over keys gave up a sequence's first
   page first, as a sequence is stored and touched front to back, which left
   the later pages unreachable while they took room; HiCache's host tree gives
   up tails first too).  ``leaf_first = False`` keeps the plain LRU (its owner
   sets that under write-back, where pages enter L2 as the L1 tree frees them,
   so L2's LRU already follows the tree; measured in the changelog), and files
   no leaves.  With ``victims_by`` (``TierConfig(l2_eviction="tree")``) the
   pages the owner's tree names below L1 go first, in its order (its evicted
   runs, least recently used first, as HiCache's host eviction), leaves only,
   then the rest in L2's own.
   Each full page leaves with the SWA pages *based* on it (inserted with its
   key as ``base_keys``: one per sliding group whose window ends in the page):
   left alone, orphaned SWA (much larger than full KV per token) filled L2 with
   windows it could not serve; an anchored window was also queued for L3, so it
   is not lost (``pair_swa = False`` keeps them, for comparisons);
3. *anchored* SWA pages (tails, checkpoint windows, windows that ended a hit).

With ``l1_copies_first`` (set under write-through, where L2 holds a copy of all
L1 cached) full pages L1 also holds (:meth:`mark_l1`) go before the other full
pages, LRU among them: such a copy costs nothing while L1 keeps the page, and the
owner copies it down again when L1 frees it.  Otherwise L2 spends its bytes on
pages L1 has too, and a plain LRU evicts the tails L1 lacks.

The owner demotes (:meth:`demote` by full-KV key, :meth:`demote_swa` by SWA key)
anchored windows a longer sequence has moved past: they become plain SWA, most
recently used.  Pages in ``protect`` are never evicted (a load reads them).

Events: ``listeners`` (callables taking a :class:`~hybridkv.tiers.events.TierEvent`
of tier ``"L2"``) hear every full/SWA page stored or evicted, keyed by full-KV
page keys (SWA entries inserted with ``base_keys`` remember theirs).  Not
thread-safe: the owner (:class:`~hybridkv.tiers.tiered.TieredCache`) serialises
access with its lock.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .._validate import check_int
from ..pools import DualPool
from ..spec import AttnKind, ModelSpec
from .events import TierEvent, TierListener, emit
from .slots import SlotStamps

__all__ = ["HostTier"]


class HostTier:
    """Host page store (L2).

    Args:
        spec: the model.
        budget_bytes: host bytes for both kinds together (> 0).
        device: ``"meta"`` (accounting only), ``"cpu"`` (real buffers,
            pinned when CUDA is available) or ``None`` (no buffers).
    """

    #: SWA pages leave with the full page they are based on (see the module docstring)
    pair_swa = True

    def __init__(self, spec: ModelSpec, budget_bytes: int, *, device: str | None = "meta") -> None:
        budget_bytes = check_int(budget_bytes, "budget_bytes")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.spec = spec
        # one arena of real host memory (pinned where CUDA exists) or accounting only
        self.pool = DualPool(spec, budget_bytes=budget_bytes, device=device, pin=True)
        self._full: OrderedDict[bytes, int] = OrderedDict()
        self.holds: Callable[[bytes], bool] = self._full.__contains__  #: ``key in self``, as a (C) callable
        self._swa: OrderedDict[bytes, int] = OrderedDict()       # plain SWA (evicted first)
        self._anchor: OrderedDict[bytes, int] = OrderedDict()    # tails / checkpoints (last)
        self._class = {"swa": self._swa, "copy": self._full, "full": self._full, "anchor": self._anchor}
        self._base: dict[bytes, bytes] = {}  # SWA key -> full-KV key of its page (its base)
        self._under: dict[bytes, dict[bytes, None]] = {}  # full-KV key -> SWA keys based on it
        # the full pages as a tree of page keys: a page is evicted only as a leaf
        self._parent: dict[bytes, bytes] = {}  # held full key -> the key of the page before it
        self._kids: dict[bytes, int] = {}  # full key -> held full pages naming it as parent
        self._stamp: dict[bytes, int] = {}  # held full key -> its last use (a counter)
        self._clock = 0
        self._leaves: list[tuple[int, bytes]] = []  # (stamp, key) of leaves; stale entries skipped
        self._l1: dict[bytes, int] = {}  # full keys L1 holds -> L1 pages holding them (mark_l1)
        self._copies: OrderedDict[bytes, None] = OrderedDict()  # held full keys L1 holds too, LRU first
        #: evict the full pages L1 also holds before the others (see the module docstring)
        self.l1_copies_first = False
        self._leaf_first = True  # see leaf_first
        #: the owner's tree's order (None: L2's own): given :attr:`holds`, it yields the full keys L2
        #: holds below L1 in the order to give them up (:meth:`EvictedRuns.oldest_pages
        #: <hybridkv.radix.evicted.EvictedRuns.oldest_pages>`), leaves only, before L2's own order
        self.victims_by: Callable[[Callable[[bytes], bool]], Iterator[bytes]] | None = None
        self.listeners: list[TierListener] = []
        # Called with (kind, int32 page ids) just before pages go back to ``pool``: the
        # owner encodes a page with a queued L3 write before its data is reused.
        self.free_listeners: list[Callable[[AttnKind, np.ndarray], None]] = []
        #: told each full-KV key L2 evicts or discards that L1 lacks, once gone (the owner cuts its runs)
        self.gone_listeners: list[Callable[[bytes], None]] = []
        #: each slot's stamp, per kind (:mod:`.slots`: the tree's entries record where L2 holds a page)
        self.stamps = {AttnKind.FULL: SlotStamps(self.pool.full.capacity), AttnKind.SWA: SlotStamps(self.pool.swa.capacity)}
        self.free_listeners.append(lambda kind, pages: self.stamps[kind].clear(pages))
        self._freeing: tuple[list[int], list[int]] | None = None  # alloc's victims' pages (full, SWA)
        self.counters = dict.fromkeys(("evicted_full_pages", "evicted_swa_pages", "stored_full_pages", "stored_swa_pages",
                                       "demoted_swa_pages", "dropped_paired_swa_pages", "evicted_l1_copy_pages"), 0)

    # ---------------------------------------------------------------- lookup
    def _free_full(self, pages: np.ndarray, *, own: bool = False) -> None:
        """Give full ``pages`` back to the pool after the free listeners; ``own``: pages
        this index holds (int32, allocated, distinct: no checks), else validated."""
        for hook in self.free_listeners:
            hook(AttnKind.FULL, pages)
        (self.pool.free_full_trusted if own else self.pool.free_full)(pages)

    def _free_swa(self, pages: np.ndarray, *, own: bool = False) -> None:
        """:meth:`_free_full` for SWA pages."""
        for hook in self.free_listeners:
            hook(AttnKind.SWA, pages)
        (self.pool.free_swa_trusted if own else self.pool.free_swa)(pages)

    def _drop_page(self, kind: int, page: int) -> None:
        """Free one page this index held (``kind`` 0: full, 1: SWA); inside
        :meth:`alloc`'s eviction it is gathered and freed at the end."""
        if self._freeing is not None:
            self._freeing[kind].append(page)
        else:
            (self._free_full, self._free_swa)[kind](np.array([page], dtype=np.int32), own=True)

    def _give_back_gathered(self) -> None:
        """Free what :meth:`alloc`'s eviction gathered: one call per kind (listeners first)."""
        gathered, self._freeing = self._freeing, None
        if gathered is None:
            return
        try:  # a listener that raises for one kind leaves the other kind's pages freed
            if gathered[0]:
                self._free_full(np.array(gathered[0], dtype=np.int32), own=True)
        finally:
            if gathered[1]:
                self._free_swa(np.array(gathered[1], dtype=np.int32), own=True)

    def lookup_full(self, keys: Sequence[bytes], *, touch: bool = False) -> np.ndarray:
        """Host full page of each key, ``-1`` where absent: int64 ``[n]``.  O(n)."""
        get = self._full.get
        out = np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        if touch:
            self._touch_full(keys, out)
        return out

    def lookup_swa(self, keys: Sequence[bytes], *, touch: bool = False) -> np.ndarray:
        """Host SWA page of each SWA key, ``-1`` where absent: int64 ``[n]``.  O(n)."""
        g1, g2 = self._swa.get, self._anchor.get
        out = np.fromiter((g1(k, g2(k, -1)) for k in keys), dtype=np.int64, count=len(keys))
        if touch:
            for k, p in zip(keys, out.tolist()):
                if p >= 0:
                    (self._swa if k in self._swa else self._anchor).move_to_end(k)
        return out

    def anchored_swa(self, keys: Sequence[bytes]) -> np.ndarray:
        """bool per SWA key: held in the anchored class.  O(n)."""
        return np.fromiter((k in self._anchor for k in keys), dtype=bool, count=len(keys))

    def _touch_full(self, keys: Sequence[bytes], pages: np.ndarray) -> None:
        """The held full pages of ``keys`` become the most recently used, among the
        copies of L1 pages too.  O(n)."""
        full, copies = self._full, self._copies
        held = [k for k, p in zip(keys, pages.tolist()) if p >= 0]
        for k in held:
            full.move_to_end(k)
            if k in copies:
                copies.move_to_end(k)
        self._used(held)

    @property
    def leaf_first(self) -> bool:
        """Evict full pages as leaves of the key tree (False: a plain LRU over keys,
        and the leaves are not filed; see the module docstring)."""
        return self._leaf_first

    @leaf_first.setter
    def leaf_first(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"leaf_first must be a bool, got {type(on).__name__}")
        self._leaf_first = on
        self._file_leaves()

    def _file_leaves(self) -> None:
        """File every leaf at its last use afresh (none without ``leaf_first``).  O(n)."""
        stamp, kids = self._stamp, self._kids
        self._leaves = [(stamp[k], k) for k in self._full if not kids.get(k)] if self._leaf_first else []
        heapq.heapify(self._leaves)

    def _used(self, keys: Sequence[bytes]) -> None:
        """Held full ``keys`` are the most recently used, the last most; the leaves
        among them are filed.  O(n + leaves log n)."""
        clock, stamp, kids, heap, file = self._clock, self._stamp, self._kids, self._leaves, self._leaf_first
        for k in keys:
            clock += 1
            stamp[k] = clock
            if file and not kids.get(k):
                heapq.heappush(heap, (clock, k))
        self._clock = clock
        if len(heap) > 2 * len(self._full) + 64:  # stale entries: rebuild
            self._file_leaves()

    def _gone_full(self, key: bytes, page: int, protect_swa: set[int]) -> None:
        """Held full ``key`` left the index (its caller popped it, from host ``page``):
        the page is freed (gathered, inside :meth:`alloc`), its parent may become a
        leaf, the SWA pages based on it go along (protected ones stay), listeners
        hear it.  O(log n + SWA pages dropped)."""
        in_l1 = self._copies.pop(key, 0) is None  # L1 holds it too (so no run names it): not told
        stamp = self._stamp
        stamp.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            left = self._kids[parent] - 1
            if left:
                self._kids[parent] = left
            else:
                del self._kids[parent]
                if parent in self._full and self._leaf_first:  # a leaf now, at its own last use
                    heapq.heappush(self._leaves, (stamp[parent], parent))
        self._drop_page(0, page)
        self.counters["evicted_full_pages"] += 1
        for hook in () if in_l1 else self.gone_listeners:
            hook(key)
        if self.listeners:
            emit(self.listeners, TierEvent("L2", "remove", (key,)))
        self._drop_paired_swa(key, protect_swa)

    def _lru_leaf(self, protect: set[int]) -> bytes | None:
        """The least recently used full page no held page extends (a leaf of the key
        tree), skipping protected pages; None if there is none.  O(log n) amortised."""
        heap, full, skipped = self._leaves, self._full, []
        victim = None
        while heap:
            stamp, key = heap[0]
            if full.get(key) is None or self._stamp.get(key) != stamp or self._kids.get(key):
                heapq.heappop(heap)  # stale: gone, used since, or extended since
            elif full[key] in protect:
                skipped.append(heapq.heappop(heap))
            else:
                victim = key
                break
        for item in skipped:
            heapq.heappush(heap, item)
        return victim

    def __contains__(self, key: bytes) -> bool:
        return self.holds(key)

    @property
    def num_full_pages(self) -> int:
        return len(self._full)

    def full_keys(self) -> list[bytes]:
        """Keys of every stored full-KV page, least recently used first (a copy:
        the index is unchanged).  O(full pages)."""
        return list(self._full)

    @property
    def num_swa_pages(self) -> int:
        return len(self._swa) + len(self._anchor)

    @property
    def num_anchored_swa_pages(self) -> int:
        return len(self._anchor)

    # ------------------------------------------------------------ allocation
    def alloc(self, n_full: int, n_swa: int, protect: Iterable[int] = (),
              protect_swa: Iterable[int] = (), *, plain_only: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """Allocate host pages, evicting unprotected LRU pages as needed.

        Returns ``(full_pages, swa_pages)`` int32, or None (nothing allocated;
        some pages may have been evicted) when even eviction cannot make room.
        ``plain_only``: make room from plain SWA alone (what is stored then is
        worth no more than what it displaces: full KV and anchored windows stay).
        The caller must :meth:`insert_full` / :meth:`insert_swa` or
        :meth:`free` what it gets.  O(n + evicted).
        """
        got = self.pool.alloc(n_full, n_swa)
        if got is not None:
            return got
        pf, ps = set(int(p) for p in protect), set(int(p) for p in protect_swa)
        stages = ("swa", "copy", "full", "anchor") if self.l1_copies_first else ("swa", "full", "anchor")
        # the victims' pages are freed together at the end; the shortfall counts them as
        # freed already (a page frees whole), so they are those a free per victim picks
        self._freeing = ([], [])
        need = self.pool.shortfall(n_full, n_swa)
        try:
            for stage in ("swa",) if plain_only else stages:
                self._evict(stage, pf, ps, need)
        finally:
            self._give_back_gathered()
        return self.pool.alloc(n_full, n_swa)

    def _evict(self, stage: str, protect_full: set[int], protect_swa: set[int],
               need: tuple[int, int, int] | None = None, limit: int | None = None) -> int:
        """Evict unprotected pages of class ``stage`` (``"swa"``, ``"copy"``, ``"full"``,
        ``"anchor"``), LRU first, until its kind is not short of ``need`` (full pages,
        SWA pages, bytes missing, against every page gathered since :meth:`alloc` began),
        after ``limit`` victims, or when it has none left; returns the victims.  One
        loop per class (alloc evicts about as many pages as it stores).  O(victims + skipped)."""
        own = self._freeing is None  # called outside alloc: free what it gathers at the end
        got_full, got_swa = self._freeing = self._freeing or ([], [])
        full_kind, table = stage in ("copy", "full"), self._class[stage]
        order = self._copies if stage == "copy" else table  # LRU first (copy: full pages L1 also holds)
        counters, gone = self.counters, self._gone_full
        prot = protect_full if full_kind else protect_swa
        leaves = stage == "full" and self._leaf_first
        by_tree = self.victims_by if stage == "full" else None
        kids, tree = self._kids, (by_tree(self.holds) if by_tree is not None else None)
        fpb, spb = self.pool.full_page_bytes, self.pool.swa_page_bytes
        need_full, need_swa, need_bytes = need if need is not None else (0, 0, 0)
        taken = 0
        try:
            while limit is None or taken < limit:
                if need is not None:
                    nf, ns = len(got_full), len(got_swa)
                    if not (need_bytes > nf * fpb + ns * spb or (need_full > nf if full_kind else need_swa > ns)):
                        break
                # the owner's tree's order first, leaves only (as below), then L2's own
                victim = next((k for k in tree if not kids.get(k) and table[k] not in prot), None) if tree else None
                if victim is not None:
                    counters["evicted_off_tree_pages"] = counters.get("evicted_off_tree_pages", 0) + 1
                elif leaves:  # a page before the pages that extend it never goes first
                    victim, tree = self._lru_leaf(protect_full), None
                else:  # the LRU page not protected
                    tree = None
                    victim = next((k for k in order if table[k] not in prot), None) if prot else next(iter(order), None)
                if victim is None:
                    break
                taken += 1
                page = table.pop(victim)
                if not full_kind:
                    self._free_swa_entry(victim, page)
                    continue
                if stage == "copy":
                    counters["evicted_l1_copy_pages"] += 1
                gone(victim, page, protect_swa)
        finally:
            if tree is not None:
                tree.close()  # (the runs it read stay filed)
            if own:
                self._give_back_gathered()
        return taken

    def _free_swa_entry(self, key: bytes, page: int) -> None:
        self._drop_page(1, page)
        self.counters["evicted_swa_pages"] += 1
        base = self._base.pop(key, None)
        if base is None:
            return
        under = self._under[base]
        del under[key]
        if not under:
            del self._under[base]
        if self.listeners:
            emit(self.listeners, TierEvent("L2", "swa_remove", (base,), (False,)))

    def _drop_paired_swa(self, full_key: bytes, protect_swa: set[int]) -> None:
        """The SWA pages based on a full page go with it: without its full KV L2 cannot
        serve a window, and an anchored window was also queued for L3 (it is not lost).
        Protected pages (a load reads them) stay.  O(pages dropped)."""
        if not self.pair_swa or full_key not in self._under:
            return
        for key in list(self._under[full_key]):
            for table in (self._swa, self._anchor):
                page = table.get(key)
                if page is not None and page not in protect_swa:
                    del table[key]
                    self._free_swa_entry(key, page)
                    self.counters["dropped_paired_swa_pages"] += 1

    def mark_l1(self, keys: Iterable[bytes], held: bool) -> None:
        """L1 took (``held``) or gave back one page of each full key in ``keys``: L2
        counts per key how many L1 pages hold it, and a held L2 page whose key L1
        holds is a copy (evicted first with ``l1_copies_first``).  O(n)."""
        l1, copies = self._l1, self._copies
        for k in keys:
            if held:
                l1[k] = l1.get(k, 0) + 1
                if k in self._full:
                    copies[k] = None
            elif l1.get(k, 0) > 1:
                l1[k] -= 1
            else:
                l1.pop(k, None)
                copies.pop(k, None)

    def l1_counts(self) -> dict[bytes, int]:
        """How many L1 pages hold each full key (as :meth:`mark_l1` was told; a copy).  O(n)."""
        return dict(self._l1)

    def base_of(self, key: bytes) -> bytes | None:
        """The full-KV key the held SWA page ``key`` was inserted with (None: none).  O(1)."""
        return self._base.get(key)

    def discard(self, keys: Sequence[bytes], *, swa: bool = False) -> int:
        """Drop ``keys`` (their copy turned out unusable, e.g. a read of them failed),
        as an eviction would; absent keys are ignored.  Returns pages dropped.  O(n)."""
        n = 0
        for key in keys:
            if not swa:
                page = self._full.pop(key, None)
                if page is None:
                    continue
                self._gone_full(key, page, set())
                n += 1
                continue
            for table in (self._swa, self._anchor):
                page = table.pop(key, None)
                if page is not None:
                    self._free_swa_entry(key, page)
                    n += 1
        return n

    def clear(self) -> int:
        """Drop every page (as a host restart would); returns pages dropped.  O(pages)."""
        n = 0
        for table, free in ((self._full, self._free_full), (self._swa, self._free_swa),
                            (self._anchor, self._free_swa)):
            pages = np.fromiter(table.values(), dtype=np.int32, count=len(table))
            if pages.size:
                free(pages, own=True)
            n += pages.size
        keys = tuple(self._full)
        for table in (self._full, self._swa, self._anchor, self._base, self._under, self._copies, self._parent,
                      self._kids, self._stamp):
            table.clear()
        self._leaves = []
        if self.listeners:
            emit(self.listeners, TierEvent("L2", "remove", keys))
        return n

    def free(self, full_pages: np.ndarray, swa_pages: np.ndarray) -> None:
        """Give back pages from :meth:`alloc` that were not inserted."""
        if len(full_pages):
            self._free_full(full_pages)
        if len(swa_pages):
            self._free_swa(swa_pages)

    # --------------------------------------------------------------- insert
    def insert_full(self, keys: Sequence[bytes], pages: np.ndarray,
                    parents: Sequence[bytes | None] | None = None) -> None:
        """Index allocated ``pages`` (data already written) under ``keys`` (MRU).
        ``parents[i]``: the key of the page before ``keys[i]`` (None: the first page,
        or not known: a root); L2 evicts a page only once none it holds names it as
        parent.  A key already present keeps its old page (the new one is freed).  O(n log n)."""
        dup, new, fresh = [], [], []
        ups = parents if parents is not None else [None] * len(keys)
        if len(ups) != len(keys):
            raise ValueError(f"parents needs {len(keys)} entries, got {len(ups)}")
        full, parent_of, kids, l1, copies = self._full, self._parent, self._kids, self._l1, self._copies
        for k, p, up in zip(keys, np.asarray(pages).tolist(), ups):
            if up is not None and k not in parent_of:  # new, or stored as a root before
                parent_of[k] = up
                kids[up] = kids.get(up, 0) + 1
            if k in full:
                dup.append(p)
                full.move_to_end(k)
            else:
                full[k] = p
                fresh.append(p)
                if k in l1:
                    copies[k] = None
                new.append(k)
        self.counters["stored_full_pages"] += len(fresh)
        self._used(keys)  # after the links: only the leaves among them are filed
        self.stamps[AttnKind.FULL].stamp(np.asarray(fresh, dtype=np.int64))
        if dup:
            self._free_full(np.asarray(dup, dtype=np.int32))
        if new and self.listeners:
            from .payload import swa_key  # only hashed when someone listens
            flags = tuple(self.lookup_swa([swa_key(k) for k in new]) >= 0)
            emit(self.listeners, TierEvent("L2", "store", tuple(new), tuple(bool(f) for f in flags)))

    def insert_swa(self, keys: Sequence[bytes], pages: np.ndarray, anchored: np.ndarray,
                   base_keys: Sequence[bytes] | None = None) -> None:
        """Index SWA ``pages`` under SWA ``keys``; ``anchored[i]`` picks the eviction class.

        ``base_keys[i]``: the full-KV key of the page its window ends in, its
        *base* (named in events; the page leaves L2 with it).  SWA inserted
        without one is stored but not announced, and is evicted on its own.  O(n).
        """
        dup, new, fresh = [], [], []
        bases = base_keys if base_keys is not None else [None] * len(keys)
        for k, p, a, b in zip(keys, np.asarray(pages).tolist(), np.asarray(anchored).tolist(), bases):
            if k in self._swa or k in self._anchor:
                dup.append(p)
                if a and k in self._swa:  # promote: now known to end a window we keep
                    self._promote(k)
                continue
            (self._anchor if a else self._swa)[k] = p
            fresh.append(p)
            self.counters["stored_swa_pages"] += 1
            if b is not None:
                self._base[k] = b
                self._under.setdefault(b, {})[k] = None
                new.append(b)
        self.stamps[AttnKind.SWA].stamp(np.asarray(fresh, dtype=np.int64))
        if dup:
            self._free_swa(np.asarray(dup, dtype=np.int32))
        if new and self.listeners:
            emit(self.listeners, TierEvent("L2", "swa_store", tuple(new), (True,) * len(new)))

    def anchor(self, keys: Sequence[bytes]) -> int:
        """Move plain SWA ``keys`` to the anchored class (others ignored); returns how many moved.  O(n)."""
        moved = 0
        for k in keys:
            if k in self._swa:
                self._promote(k)
                moved += 1
        return moved

    def _promote(self, key: bytes) -> None:
        self._anchor[key] = self._swa.pop(key)

    def demote(self, full_keys: Sequence[bytes]) -> int:
        """Move the anchored SWA pages based on the pages ``full_keys`` name (full-KV
        keys: no SWA key is hashed) to the plain class, most recently used there;
        pages without one are ignored.  Returns how many moved.  O(n)."""
        moved = 0
        anchor = self._anchor
        for fk in full_keys:
            for k in self._under.get(fk, ()):
                page = anchor.pop(k, None)
                if page is not None:
                    self._swa[k] = page
                    moved += 1
        self.counters["demoted_swa_pages"] += moved
        return moved

    def demote_swa(self, keys: Sequence[bytes]) -> int:
        """:meth:`demote` by SWA ``keys`` (an owner whose SWA keys have no full-KV
        key); plain and absent keys are ignored.  Returns how many moved.  O(n)."""
        moved = 0
        for k in keys:
            page = self._anchor.pop(k, None)
            if page is None:
                continue
            self._swa[k] = page
            moved += 1
        self.counters["demoted_swa_pages"] += moved
        return moved

    # ------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Every indexed page allocated exactly once, nothing leaked.  O(n)."""
        self.pool.check_invariants()
        full = np.fromiter(self._full.values(), dtype=np.int64, count=len(self._full))
        swa = np.fromiter(list(self._swa.values()) + list(self._anchor.values()), dtype=np.int64,
                          count=self.num_swa_pages)
        assert not (set(self._swa) & set(self._anchor)), "a SWA key is in both classes"
        assert set(self._base) <= set(self._swa) | set(self._anchor), "base key of a dropped SWA page"
        under: dict[bytes, set[bytes]] = {}
        for k, b in self._base.items():
            under.setdefault(b, set()).add(k)
        assert {b: set(ks) for b, ks in self._under.items()} == under, "SWA pages by base differ from their bases"
        assert set(self._copies) == {k for k in self._full if k in self._l1}, "L2 copies of L1 pages misfiled"
        assert dict(Counter(self._parent.values())) == self._kids and set(self._parent) <= set(self._full), "L2's key tree miscounted"
        assert set(self._stamp) == set(self._full), "L2 full pages without a last use"
        live = {k for s, k in self._leaves if self._stamp.get(k) == s}
        if self._leaf_first:
            assert live >= {k for k in self._full if not self._kids.get(k)}, "an L2 leaf is not filed"
        else:
            assert not self._leaves, "leaves filed without leaf_first"
        assert np.unique(full).size == full.size == self.pool.full.num_used, \
            ("L2 full pages", np.unique(full).size, full.size, self.pool.full.num_used)
        assert np.unique(swa).size == swa.size == self.pool.swa.num_used, \
            ("L2 swa pages", np.unique(swa).size, swa.size, self.pool.swa.num_used)
        for kind, held in ((AttnKind.FULL, full), (AttnKind.SWA, swa)):  # the held slots stamped, no other
            assert (self.stamps[kind].of(held) > 0).all() and self.stamps[kind].num_stamped == held.size, kind

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update(full_pages=self.num_full_pages, swa_pages=self.num_swa_pages,
                   anchored_swa_pages=len(self._anchor), used_bytes=self.pool.used_bytes(),
                   budget_bytes=self.pool.budget_bytes)
        return out

    def kind_buffers(self, kind: AttnKind):  # noqa: ANN201 - KindBuffers | None
        return None if self.pool.buffers is None else self.pool.buffers.of(kind)
