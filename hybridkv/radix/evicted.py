"""Evicted runs: what L1 evicted stays in the tree while a tier below may hold it.

With lower tiers every page the tree caches has a name (its chained page key,
:class:`~hybridkv.radix.types.PageNames`).  When eviction trims a leaf or
removes it, the pages it gives up do not leave the tree: their tokens and names
become an :class:`EvictedRun` hung where they were, at the end of the node they
continued (the trimmed leaf itself, or the removed leaf's parent).  Runs evicted
from under a run hang at its end in turn, so the evicted runs form the tree's
lower part, the one HiCache's radix tree keeps as host nodes.  A later prompt's
walk goes on from the end of its L1 match into the runs and reads the names of
the pages L1 gave up, instead of hashing them again.

What a run says is only names: a name is a function of the page's tokens and
those before it, so a run is never wrong about a key, whatever the tiers hold
meanwhile; which tier holds a page is asked of the tier by that key.  The runs
are kept to what the tiers below still hold by :meth:`EvictedRuns.sweep`: a run
is cut at its first page no tier holds, with everything hung below it.  The
owner (:class:`~hybridkv.tiers.coordinator.TierCoordinator`) sweeps once the
runs name more than twice its bound (the full pages L2 holds, or the L1 tree's
node count if larger: :meth:`EvictedRuns.due`), counting L2 and what L3's record
knows, then L2 alone if that leaves more than the bound.  So the runs stay
within about twice what L2 holds, and a sweep, O(L1 nodes + pages the runs
name), costs O(1) per page evicted, amortized.

Invariants (:meth:`EvictedRuns.check`): at each point a run's first page
differs from every L1 child's there (an insert that adds an L1 leaf over a run
drops the run: :meth:`EvictedRuns.covered`), runs hang only at node ends, every
page of a run is named, and ``pages`` counts them all.

The tree changes the runs only on the engine's thread (its evictions and
inserts; the owner sweeps there too), like the L1 tree itself.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .node import EvictedRun, TreeNode

__all__ = ["EvictedRuns"]


class EvictedRuns:
    """The evicted runs of one tree (see the module docstring).

    Args:
        page_size: tokens per page.

    Off (no run is kept) until :meth:`enable`.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.on = False  # keep runs (an owner that sweeps them turns this on)
        self.pages = 0  # pages the runs name
        self.sweeps = 0

    def enable(self, on: bool = True) -> None:
        """Keep runs from now on (``on``), or keep no new one; the owner sweeps them."""
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool, got {type(on).__name__}")
        self.on = on

    def due(self, bound: int) -> bool:
        """The runs name more than twice ``bound`` pages: time to sweep them."""
        return self.pages > 2 * bound

    # ------------------------------------------------------------ the tree's hooks
    def evicted(self, node: TreeNode, keep: int) -> None:
        """Eviction gives up pages ``[keep:]`` of leaf ``node`` (before it trims
        or removes it): they become a run at the end of what stays, taking the
        runs at ``node``'s end along.  Only the named leading pages become the run;
        under an unnamed page nothing goes on (the chain of names breaks there).  O(1)
        plus the scan for an unnamed page."""
        if not self.on:
            return
        at_end, node.evicted = node.evicted, None
        names = node.page_keys
        run = None
        if names is not None:
            gone = names[keep:]
            n = gone.index(None) if None in gone else len(gone)
            if n:
                P = self.page_size
                run = EvictedRun(node.key[keep * P:(keep + n) * P], gone[:n])
                self.pages += n
                if n == len(gone):
                    run.below = at_end
                    at_end = None
        if at_end:
            self._drop_all(at_end.values())
        if run is None:
            return
        host = node if keep else node.parent
        assert host is not None
        if host.evicted is None:
            host.evicted = {}
        host.evicted[run.key[:self.page_size].tobytes()] = run

    def covered(self, node: TreeNode, first: bytes) -> None:
        """An insert adds an L1 leaf with first page ``first`` at ``node``'s end:
        a run there starting with the same page is dropped (what it named is in L1
        again, or the prompt left it).  O(1), plus the dropped pages."""
        runs = node.evicted
        if runs:
            run = runs.pop(first, None)
            if run is not None:
                self._drop_all((run,))
                if not runs:
                    node.evicted = None

    # ------------------------------------------------------------------- reads
    def names(self, node: TreeNode, key: np.ndarray, pos: int, limit: int) -> list[bytes]:
        """Names of the pages of ``key[pos:limit]`` (page aligned) that the runs
        at ``node``'s end spell, in order, up to the first page none does.  O(pages read)."""
        out: list[bytes] = []
        P = self.page_size
        runs = node.evicted
        while runs and pos < limit:
            run = runs.get(key[pos:pos + P].tobytes())
            if run is None:
                break
            rk = run.key
            m = min(len(rk), limit - pos)
            b = key[pos:pos + m]
            k = m // P if b.tobytes().startswith(rk[:m]) else int(np.argmax(rk[:m] != b)) // P
            out += run.names[:k]
            pos += k * P
            if k < len(run.names):
                break
            runs = run.below
        return out

    # ------------------------------------------------------------------- sweep
    def sweep(self, nodes: Iterator[TreeNode], held: Callable[[Sequence[bytes]], np.ndarray]) -> None:
        """Cut every run at its first page ``held`` (bool per name) says L2 lacks,
        with what hangs below it.  O(L1 nodes + pages the runs name)."""
        self.sweeps += 1
        for node in nodes:
            if node.evicted:
                self._sweep_at(node.evicted, held)
                if not node.evicted:
                    node.evicted = None

    def _sweep_at(self, runs: dict[bytes, EvictedRun], held: Callable[[Sequence[bytes]], np.ndarray]) -> None:
        stack = [runs]
        owners: list[EvictedRun] = []  # runs whose ``below`` was swept (emptied ones become None)
        while stack:
            at = stack.pop()
            for first, run in list(at.items()):
                have = held(run.names)
                n = len(run.names) if have.all() else int(np.argmin(have))
                if n < len(run.names):
                    self.pages -= len(run.names) - n
                    if run.below:
                        self._drop_all(run.below.values())
                    run.below = None
                    if n == 0:
                        del at[first]
                        continue
                    run.key, run.names = run.key[:n * self.page_size], run.names[:n]
                if run.below:
                    stack.append(run.below)
                    owners.append(run)
        for run in owners:
            if not run.below:
                run.below = None

    def _drop_all(self, runs: Iterable[EvictedRun]) -> None:
        """Forget ``runs`` and everything below them.  O(runs dropped)."""
        stack = list(runs)
        while stack:
            run = stack.pop()
            self.pages -= len(run.names)
            if run.below:
                stack.extend(run.below.values())

    # -------------------------------------------------------------- invariants
    def check(self, nodes: Iterator[TreeNode]) -> None:
        """Verify the module docstring's invariants over the tree's ``nodes`` (roots
        included).  O(L1 nodes + pages the runs name)."""
        P = self.page_size
        total = 0
        for node in nodes:
            if node.evicted is None:
                continue
            assert node.evicted, f"an empty run map on {node}"
            assert not set(node.evicted) & set(node.children), f"a run under an L1 child of {node}"
            stack = [node.evicted]
            while stack:
                at = stack.pop()
                for first, run in at.items():
                    n = len(run.names)
                    assert n > 0 and None not in run.names, run
                    assert len(run.key) == n * P and first == run.key[:P].tobytes(), run
                    total += n
                    if run.below is not None:
                        assert run.below, f"an empty run map below {run}"
                        stack.append(run.below)
        assert total == self.pages, (total, self.pages)

