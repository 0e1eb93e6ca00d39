"""Evicted runs: what L1 evicted stays in the tree, named, within a cap.

With lower tiers every page the tree caches has a name (its chained page key,
:class:`~hybridkv.radix.types.PageNames`).  When eviction trims a leaf or
removes it, the pages it gives up do not leave the tree: their tokens and names
become an :class:`EvictedRun` hung where they were, at the end of the node they
continued (the trimmed leaf itself, or the removed leaf's parent).  Runs evicted
from under a run hang at its end in turn, so the evicted runs form the tree's
lower part, the one HiCache's radix tree keeps as host nodes.  A later prompt's
walk goes on from the end of its L1 match into the runs and reads the names of
the pages L1 gave up, instead of hashing them again.

A run's names are a function of its pages' tokens and those before them, so a
run is never wrong about a key, whatever the tiers hold meanwhile.  A run also
keeps where L2 held each page when last recorded (``host_at``, taken over from
the node; :mod:`hybridkv.tiers.records`): a record is only believed while L2's
stamp of its slot matches, so a stale one reads as "ask L2", never as a wrong
answer.  What the tiers below let go leaves its run (:meth:`EvictedRuns.let_go`:
the owner, the core's :class:`~hybridkv.tiers.coordinator.TierCoordinator` or
vLLM's connector, hears L2 let a page go by its key
(:class:`~hybridkv.tiers.records.LetGo`), and before the next walk cuts a run
that ends with it, or a run made since whose last page no tier holds, back to
its last page L2 or L3 still holds, with what hangs past the cut), so
the runs name what the tiers hold, as HiCache's host nodes do, and not what
they held.  The runs are also kept within a cap (:meth:`EvictedRuns.cap_by`; the
owner, or vLLM's prefix manager with hybridkv's connector, gives the pages the
tiers below hold as far as it knows, L2's full pages plus the keys of L3's
record, read each time a run is made and at each walk: the runs are the tree's
L2 and L3 entries): past it the oldest runs go first, with what hangs below
them.  Each run is dropped at most once, so that costs O(1) per run made,
amortized: no sweep over the tree, no lookup in a tier.  A page's name is
unique in a tree (it spells the namespace and the whole prefix), so the runs
keep a map from each run's last page's name to the run, for :meth:`EvictedRuns.let_go`
(or from the key the tiers below let that page go by, where a page's name joins
several keys: :meth:`EvictedRuns.key_pages_by`, vLLM's blocks).

Runs also hang inside a node or a run, after its page ``j`` (``inner``), where
the entry would be split if they were L1 nodes: an insert that adds an L1 leaf
over a run takes the pages both spell and hangs what leaves the leaf where it
leaves it (:meth:`EvictedRuns.covered`), as HiCache splits a host node, and a
split or an eviction moves a node's inner runs with the pages they leave.

Invariants (:meth:`EvictedRuns.check`): at each point a run's first page
differs from every L1 child's there and from the page of the entry it hangs
inside, runs hang only at node or run ends or strictly inside them, every
page of a run is named, each run is found by its last page's name (and no other),
each run knows the map it hangs in, and ``pages`` counts them all.  The cap
is a bound the runs are brought back within whenever a run is made or
:meth:`EvictedRuns.trim` runs (a tier may shrink in between).

The tree changes the runs only on the engine's thread (its evictions and
inserts; the owner sets the cap there too), like the L1 tree itself.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import takewhile
from typing import Callable, Iterable, Iterator

import numpy as np

from .node import EvictedRun, TreeNode, common_pages, take_records

__all__ = ["EvictedRuns"]

_Inner = dict[int, dict[bytes, EvictedRun]]  # an entry's inner maps: page j -> first page's bytes -> run


def _cut(inner: _Inner | None, at: int) -> tuple[_Inner | None, dict[bytes, EvictedRun] | None, _Inner | None]:
    """Split an entry's inner maps at its page ``at``: those before it, the one at
    it, and those after it (their pages counted from ``at``), each None when none;
    empty maps go.  Maps move whole, so their runs' ``home`` stays right.  O(maps)."""
    before: _Inner = {}
    after: _Inner = {}
    there = None
    for j, m in (inner or {}).items():
        if not m:
            continue
        if j < at:
            before[j] = m
        elif j == at:
            there = m
        else:
            after[j - at] = m
    return before or None, there, after or None


class EvictedRuns:
    """The evicted runs of one tree (see the module docstring).

    Args:
        page_size: tokens per page.

    Off (no run is kept) until :meth:`enable`.  Attributes: ``pages`` (pages the
    runs name), ``dropped`` (pages dropped to stay within the cap),
    ``let_go_pages`` (pages cut as the tiers below let them go).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.on = False  # keep runs (an owner that caps them turns this on)
        self._cap_of: Callable[[], int] | None = None  # most pages the runs name (None: no cap)
        self.pages = 0
        self.dropped = 0
        self._order: deque[EvictedRun] = deque()  # runs, oldest first (dropped ones skipped)
        self._live = 0  # runs kept
        # told each run dropped (with those below it), before it is forgotten (the tiers'
        # records keep what L2 still holds of it: :meth:`~hybridkv.tiers.records.HostRecords.orphan_run`)
        self.on_drop: Callable[[EvictedRun], None] | None = None
        self._holds = 0  # :meth:`hold` calls not yet settled
        self._made: list[EvictedRun] = []  # runs made while held and kept nowhere (off)
        self._tails: dict[bytes, EvictedRun] = {}  # the last page's key of each kept run -> the run
        self._page_key: Callable[[bytes], bytes] | None = None  # a page's key off its name (None: the name)
        self.let_go_pages = 0  # pages cut because the tiers below let them go (:meth:`let_go`)
        self._fresh: list[EvictedRun] = []  # runs made since :meth:`let_go` last looked at them
        # (last use, made, run) of the runs that may name pages a tier holds: L2's victims off the
        # tree (None: not filed, no one asks: :meth:`file_by_use`)
        self._by_use: list[tuple[int, int, EvictedRun]] | None = None
        self._made_n = 0  # runs made so far (ties in ``_by_use``)

    def enable(self, on: bool = True) -> None:
        """Keep runs from now on (``on``), or keep no new one."""
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool, got {type(on).__name__}")
        self.on = on

    def keep_within(self, cap: int) -> None:
        """Name at most ``cap`` pages (an int >= 0) from now on; the oldest runs go
        first.  O(runs dropped)."""
        if not isinstance(cap, (int, np.integer)) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"cap must be an int >= 0, got {cap!r}")
        fixed = int(cap)
        self.cap_by(lambda: fixed)

    def cap_by(self, cap_of: Callable[[], int]) -> None:
        """Name at most ``cap_of()`` pages, read each time a run is made and at each
        :meth:`trim` (e.g. what a tier holds now).  O(runs dropped)."""
        if not callable(cap_of):
            raise TypeError(f"cap_of must be callable, got {type(cap_of).__name__}")
        self._cap_of = cap_of
        self.trim()

    def key_pages_by(self, page_key: Callable[[bytes], bytes] | None) -> None:
        """The tiers below let a page go by ``page_key(name)`` (None: by its name), as
        :meth:`let_go` hears: vLLM's connector names a tree page by the keys of its
        blocks, group by group, and L2 lets it go by its last full block's.  O(runs)."""
        if page_key is not None and not callable(page_key):
            raise TypeError(f"page_key must be callable or None, got {type(page_key).__name__}")
        self._page_key = page_key
        self._tails = {self._key(r.names[-1]): r for r in self._order if r.home is not None}

    def _key(self, name: bytes) -> bytes:
        """The key page ``name`` is let go by.  O(1)."""
        return name if self._page_key is None else self._page_key(name)

    @property
    def cap(self) -> int | None:
        """The cap now (None: none)."""
        return None if self._cap_of is None else self._cap_of()

    # ------------------------------------------------------------ the tree's hooks
    def evicted(self, node: TreeNode, keep: int) -> None:
        """Eviction gives up pages ``[keep:]`` of leaf ``node`` (before it trims
        or removes it): they become a run at the end of what stays, taking the
        runs at ``node``'s end and inside those pages along (the runs inside the
        pages that stay, and at ``keep``, stay with ``node``).  Only the named
        leading pages become the run; under an unnamed page nothing goes on (the
        chain of names breaks there).  O(1) plus the scan for an unnamed page,
        the node's inner maps, and the runs dropped."""
        if not self.on and self.on_drop is None:
            return
        at_end, node.evicted = node.evicted, None
        names = node.page_keys
        run, n = None, 0
        if names is not None:
            gone = names[keep:]
            n = gone.index(None) if None in gone else len(gone)
            if n:
                P = self.page_size
                # (the records are a view: what a free listener records on the freed names lands here)
                run = EvictedRun(node.key[keep * P:(keep + n) * P], gone[:n], node.host_at[keep:keep + n])
                if not self.on:  # kept nowhere: dropped as soon as made (or settled)
                    if self._holds:
                        self._made.append(run)
                    else:
                        self.on_drop(run)  # type: ignore[misc]
                    run = None
                elif n == len(gone) and at_end:
                    run.below, at_end = at_end, None  # the map moves whole: its runs' home stays it
        drop = list(at_end.values()) if at_end else []
        node.inner, at_keep, past = _cut(node.inner, keep)  # those inside what stays stay
        if at_keep and self.on:  # they continue what stays, beside the new run
            node.evicted = at_keep
        elif at_keep:
            drop += at_keep.values()
        if run is not None:  # inside the run, and at its end (an unnamed page follows)
            run.inner, run_end, past = _cut(past, n)
            if run_end:
                run.below = run_end
        for at in (past or {}).values():
            drop += at.values()
        if drop:
            self._drop_all(drop)
        if run is None:
            return
        host = node if keep else node.parent
        assert host is not None
        if host.evicted is None:
            host.evicted = {}
        host.evicted[run.key[:self.page_size].tobytes()] = run
        run.home = host.evicted
        self._tails[self._key(run.names[-1])] = run
        self._order.append(run)
        self._fresh.append(run)
        if self._by_use is not None:
            self._made_n += 1
            heapq.heappush(self._by_use, (node.last_access, self._made_n, run))
        self._live += 1
        self.pages += len(run.names)
        if not self._holds:
            self.trim()

    def hold(self) -> None:
        """Keep every run made from now until :meth:`settle` (the cap waits): an
        eviction's free listeners record where L2 stores the pages on the runs
        made of them, so a run the cap drops tells :attr:`on_drop` what L2 holds
        of it.  Calls nest.  O(1)."""
        self._holds += 1

    def settle(self) -> None:
        """End a :meth:`hold`: runs made kept nowhere (off) are dropped, and the
        cap applied.  O(runs dropped)."""
        self._holds -= 1
        if self._holds:
            return
        made, self._made = self._made, []
        for run in made:
            self.on_drop(run)  # type: ignore[misc]
        self.trim()

    def covered(self, node: TreeNode, first: bytes, leaf: TreeNode | None = None) -> None:
        """An insert adds an L1 ``leaf`` with first page ``first`` at ``node``'s end:
        the run there starting with the same page gives up the pages the leaf
        spells (what it named is in L1 again), and the leaf takes their records
        where it records nothing itself.  What the run and the runs under it spell
        past where they leave the leaf hangs there, inside the leaf or at its end,
        as HiCache splits a host node (a run that leaves a run the leaf spells
        after its page ``i`` leaves the leaf there too); nothing is dropped.
        Without ``leaf`` the run is dropped (:attr:`on_drop` hears of it).
        O(1), plus the pages and runs covered and moved."""
        runs = node.evicted
        run = runs.pop(first, None) if runs else None
        if run is None:
            return
        if leaf is None:
            self._drop_all((run,))
            return
        P = self.page_size
        lk, n_leaf = leaf.key, leaf.n_pages
        rows = leaf.host_at
        work = [(run, 0)]  # (a run, the leaf page it starts at)
        while work:
            r, j = work.pop()
            if j == n_leaf or r.key[:P].tobytes() != lk[j * P:(j + 1) * P].tobytes():
                self._hang(leaf, j, r)  # it leaves the leaf after page j (0 < j)
                continue
            k = common_pages(r.key, lk, j * P, len(lk), P)  # >= 1: the first page is the leaf's
            if rows is not None and rows.shape[1] == r.host_at.shape[1]:
                take_records(rows[j:j + k], r.host_at[:k], fill=True)  # pairs the leaf lacks
            self.pages -= k
            spelled, at_k, rest = _cut(r.inner, k)  # rest: inside what is left of the run
            r.inner = None
            for i, at in (spelled or {}).items():  # they leave the leaf where they leave the run
                work.extend((b, j + i) for b in at.values())
            if at_k:
                work.extend((b, j + k) for b in at_k.values())
            if k < len(r.names):  # the rest of the run goes on from leaf page j + k
                r.key, r.names, r.host_at, r.inner = r.key[k * P:], r.names[k:], r.host_at[k:], rest
                work.append((r, j + k))
                continue
            r.home = None  # spelled whole by the leaf
            self._untail(r)
            self._live -= 1
            if r.below:
                work.extend((b, j + k) for b in r.below.values())
                r.below = None

    def _hang(self, leaf: TreeNode, j: int, run: EvictedRun) -> None:
        """Hang ``run`` after page ``j`` of ``leaf`` (its end, or an inner map);
        one whose first page is there already is dropped.  O(1)."""
        assert j > 0
        if j == leaf.n_pages:
            if leaf.evicted is None:
                leaf.evicted = {}
            at = leaf.evicted
        else:
            if leaf.inner is None:
                leaf.inner = {}
            at = leaf.inner.setdefault(j, {})
        first = run.key[:self.page_size].tobytes()
        if first in at:  # (a trie's runs never meet so; kept safe)
            self._drop_all((run,))
            return
        at[first] = run
        run.home = at

    def split(self, upper: TreeNode, node: TreeNode, pages: int) -> None:
        """The tree cuts ``node`` after ``pages`` pages, ``upper`` (new) taking the
        first: each inner map moves whole with the pages it leaves, those at the
        cut to ``upper``'s end.  O(maps)."""
        upper.inner, upper.evicted, node.inner = _cut(node.inner, pages)

    # ------------------------------------------------------------------- reads
    def along(self, root: TreeNode, path: list[tuple[TreeNode, int]], key: np.ndarray, limit: int,
              runs: list[tuple[EvictedRun, int]] | None = None) -> list[bytes]:
        """Names of ``key``'s leading pages that the tree spells: those of the L1
        walk ``path`` (``WindowSafeTree.walk`` of ``key`` from ``root``) up to its
        first unnamed page, then, when the whole walk is named and ends at a node's
        end, the runs' there (:meth:`names`) up to ``limit`` tokens.  The pages past
        them are the caller's to hash.  ``runs``: a list to collect each run read
        and its leading pages read, in order (their ``host_at`` records follow the
        walk's).  O(pages of the walk and the runs read)."""
        have: list[bytes] = []
        for node, k in path:
            names = node.page_keys
            part = names[:k] if names is not None else [None]
            if None in part:  # an unnamed page (a failed naming): hashed from here
                return have + part[:part.index(None)]
            have += part
        end = path[-1][0] if path else root
        # on into the runs at its end, or where it leaves its last node
        have += self.names(end, key, len(have) * self.page_size, limit, runs, at=path[-1][1] if path else None)
        return have

    def names(self, node: TreeNode, key: np.ndarray, pos: int, limit: int,
              read: list[tuple[EvictedRun, int]] | None = None, *, at: int | None = None) -> list[bytes]:
        """Names of the pages of ``key[pos:limit]`` (page aligned) that the runs
        at ``node``'s end (or after its page ``at``: where ``key`` leaves it) spell,
        in order, up to the first page none does; ``read`` collects each run and
        its pages read.  O(pages read)."""
        out: list[bytes] = []
        P = self.page_size
        runs = node.evicted if at is None or at == node.n_pages else (node.inner or {}).get(at)
        while runs and pos < limit:
            run = runs.get(key[pos:pos + P].tobytes())
            if run is None:
                break
            k = common_pages(run.key, key, pos, limit, P)
            out += run.names[:k]
            if read is not None and k:
                read.append((run, k))
            pos += k * P
            if k == 0:
                break
            runs = run.below if k == len(run.names) else (run.inner or {}).get(k)
        return out

    # ------------------------------------------------------------- within the cap
    def trim(self) -> None:
        """Drop the oldest runs (with what hangs below them) until within the cap;
        compact the order once it holds twice as many dropped runs as kept ones.
        O(runs dropped), amortized."""
        order, cap = self._order, self.cap
        while cap is not None and self.pages > cap and order:
            run = order.popleft()
            if run.home is None:
                continue  # dropped already (covered, or under a dropped run)
            before = self.pages
            self._drop(run)
            self.dropped += before - self.pages
        if len(order) > 2 * self._live + 64:
            self._order = deque(r for r in order if r.home is not None)
        if self._by_use is not None and len(self._by_use) > 2 * self._live + 64:
            self._by_use = [e for e in self._by_use if e[2].home is not None]
            heapq.heapify(self._by_use)
        if len(self._fresh) > 2 * self._live + 64:
            self._fresh = [r for r in self._fresh if r.home is not None]

    def let_go(self, keys: Iterable[bytes], held: Callable[[bytes], bool] | None = None, *,
               fresh: bool = True) -> int:
        """The tiers below let go the pages of ``keys`` (their names, or their keys
        by :meth:`key_pages_by`; L2 evicted them, and no tier holds them now): a run
        that ends with one of them is cut back past the pages of ``keys`` at its
        end and, with ``held``, past those before them no tier holds either
        (``held(key)`` False: let go earlier, while pages after them were kept),
        with what hangs past the cut
        (:attr:`on_drop` hears of what is cut: a page L2 holds there stays
        known as an orphan).  So the runs name what the tiers hold, as HiCache's
        host nodes do, and the cap is not spent on pages no tier serves.  L2
        lets a run's pages go from its end (leaf first), so a key inside a run
        is not looked for: that page leaves with the pages after it.  Keys that
        end no run are ignored.  A run made since the last call (``fresh``, with
        ``held``) is cut back the same way from its last page: L2 may have let
        its pages go before L1 gave them up (vLLM's pool holds pages L2 does not
        know it holds).  ``fresh`` False leaves them for a later call (copy-downs
        of what L1 gave up still pending).  Only on the engine's thread, before a walk (a
        walk taken earlier may read a run cut since).  Returns the pages cut.
        O(keys + runs made + pages cut), in C loops but for one ``held`` call per
        run cut or made (and a key per page of a run cut, with :meth:`key_pages_by`)."""
        before = self.pages
        tails, gone, key = self._tails, set(keys), self._page_key
        for tail in tails.keys() & gone:
            run = tails.get(tail)
            if run is None:
                continue  # dropped with a run cut before it
            names = run.names if key is None else list(map(key, run.names))
            self._cut_back(run, len(names) - len(list(takewhile(gone.__contains__, reversed(names)))), held)
        if held is not None and fresh:
            for run in self._fresh:  # dropped, or its last page held: then as the tiers tell
                if run.home is not None and not held(self._key(run.names[-1])):
                    self._cut_back(run, len(run.names) - 1, held)
            self._fresh.clear()
        cut = before - self.pages
        self.let_go_pages += cut
        return cut

    def file_by_use(self) -> Callable[[Callable[[bytes], bool]], Iterator[bytes]]:
        """File every run made from now on by the last use of its L1 pages, for
        :meth:`oldest_pages`, which it returns (an owner asks before any run is made:
        the runs made before are not filed).  O(1)."""
        if self._by_use is None:
            self._by_use = []
        return self.oldest_pages

    def oldest_pages(self, held: Callable[[bytes], bool]) -> Iterator[bytes]:
        """The keys (:meth:`key_pages_by`) of the pages the runs name that ``held``
        says a tier holds, the least recently used run first (the last use of the
        L1 pages it was made of) and each run from its last page back: the order
        L2 gives up what it holds below L1, off the tree's L2 entries, as HiCache's
        host eviction walks its host nodes by their last access.  A run found
        naming no held page is passed over from then on (but while an eviction's
        listeners still store pages: :meth:`hold`); a page a tier takes on for it
        later is left to that tier's own order.  A hint, read lazily: the tier
        checks each key (read on a tier's thread while the engine's thread changes
        the runs, it may end early).  Nothing until :meth:`file_by_use`.  O(log runs)
        per run read, plus its pages."""
        heap, key, back = self._by_use, self._key, []
        if heap is None:
            return
        try:
            while heap:
                top = heap[0]
                run = top[2]
                found = False
                if run.home is not None:
                    for name in reversed(run.names):
                        if held(k := key(name)):
                            found = True
                            yield k
                if heap and heap[0] is top:
                    heapq.heappop(heap)
                    if run.home is not None and (found or self._holds):
                        back.append(top)
        finally:
            for top in back:
                heapq.heappush(heap, top)

    def _cut_back(self, run: EvictedRun, i: int, held: Callable[[bytes], bool] | None) -> None:
        """Cut kept ``run`` before its page ``i`` or, with ``held``, further back past
        the pages before it that ``held`` (by their keys) says no tier holds.
        O(pages walked back and cut)."""
        while held is not None and i and not held(self._key(run.names[i - 1])):
            i -= 1
        self._cut(run, i)

    def _cut(self, run: EvictedRun, i: int) -> None:
        """Cut kept ``run`` before its page ``i``: what it names from there, and
        every run below it or inside the part cut, go (:attr:`on_drop` hears of
        each); a run cut before its first page goes whole.  O(pages and runs cut)."""
        if i == 0:
            self._drop(run)
            return
        P = self.page_size
        tail = EvictedRun(run.key[i * P:], run.names[i:], run.host_at[i:])
        run.inner, at_i, past = _cut(run.inner, i)
        drop = list(run.below.values()) if run.below else []
        run.below = None
        for at in (at_i, *(past or {}).values()):
            drop += at.values() if at else ()
        self._untail(run)
        run.key, run.host_at = run.key[:i * P], run.host_at[:i]
        del run.names[i:]  # the run's own list (the tail took a copy)
        self._tails[self._key(run.names[-1])] = run
        if self.on_drop is not None:
            self.on_drop(tail)
        self.pages -= len(tail.names)
        if drop:
            self._drop_all(drop)

    def _untail(self, run: EvictedRun) -> None:
        """``run`` is no longer found by its last page's key.  O(1)."""
        tail = self._key(run.names[-1])
        if self._tails.get(tail) is run:
            del self._tails[tail]

    def _drop(self, run: EvictedRun) -> None:
        """Take kept ``run`` out of the map it hangs in and forget it, with what hangs
        below and inside it (:meth:`_drop_all`).  O(runs dropped)."""
        first = run.key[:self.page_size].tobytes()
        if run.home is not None and run.home.get(first) is run:
            del run.home[first]
        self._drop_all((run,))

    def _drop_all(self, runs: Iterable[EvictedRun]) -> None:
        """Forget ``runs`` and everything below and inside them; :attr:`on_drop`
        hears of each.  O(runs dropped)."""
        stack = list(runs)
        hook = self.on_drop
        while stack:
            run = stack.pop()
            if hook is not None:
                hook(run)
            self.pages -= len(run.names)
            self._untail(run)
            self._live -= 1
            run.home = None
            if run.below:
                stack.extend(run.below.values())
            if run.inner:
                for at in run.inner.values():
                    stack.extend(at.values())

    @staticmethod
    def iter_runs(nodes: Iterable[TreeNode]) -> Iterator[EvictedRun]:
        """Every run hanging at ``nodes``' ends or inside them, or below or inside
        those.  O(runs)."""
        stack: list[dict[bytes, EvictedRun]] = []
        for nd in nodes:
            if nd.evicted:
                stack.append(nd.evicted)
            if nd.inner:
                stack.extend(nd.inner.values())
        while stack:
            for run in stack.pop().values():
                yield run
                if run.below:
                    stack.append(run.below)
                if run.inner:
                    stack.extend(run.inner.values())

    # -------------------------------------------------------------- invariants
    def check(self, nodes: Iterator[TreeNode]) -> None:
        """Verify the module docstring's invariants over the tree's ``nodes`` (roots
        included).  O(L1 nodes + pages the runs name)."""
        P = self.page_size
        total = runs_seen = 0
        for node in nodes:
            stack = []
            if node.evicted:
                assert not set(node.evicted) & set(node.children), f"a run under an L1 child of {node}"
                stack.append(node.evicted)
            if node.inner:
                stack += self._inner_maps(node.inner, node.key, node.n_pages, node)
            while stack:
                at = stack.pop()
                for first, run in at.items():
                    n = len(run.names)
                    assert n > 0 and None not in run.names and run.host_at.ndim == 2 and len(run.host_at) == n, run
                    assert len(run.key) == n * P and first == run.key[:P].tobytes(), run
                    assert run.home is at, f"{run} does not know the map it hangs in"
                    assert self._tails.get(self._key(run.names[-1])) is run, f"{run} is not found by its last page"
                    total += n
                    runs_seen += 1
                    if run.below:
                        stack.append(run.below)
                    if run.inner:
                        stack += self._inner_maps(run.inner, run.key, n, run)
        assert total == self.pages, (total, self.pages)
        assert runs_seen == self._live, (runs_seen, self._live)
        assert len(self._tails) == runs_seen, "runs found by their last page that the tree does not hold"

    def _inner_maps(self, inner: dict[int, dict[bytes, EvictedRun]], key: np.ndarray, n: int,
                    owner: object) -> list[dict[bytes, EvictedRun]]:
        """The maps of ``inner`` (of ``owner``, ``n`` pages spelling ``key``), each
        checked to hang inside it and to leave it there.  O(maps)."""
        P = self.page_size
        for j, at in inner.items():
            assert 0 < j < n, f"a run hangs after page {j} of {owner}, outside it"
            assert key[j * P:(j + 1) * P].tobytes() not in at, f"a run inside {owner} that it spells"
        return list(inner.values())
