"""Page growth and SWA release of live requests.

:class:`RequestPages` is a collaborator of :class:`~hybridkv.cache.HybridKVCache`
(its ``pages``): it is built over the cache's pool, tree, config, counters and
live requests and changes them only through their public calls.  Its methods
trust their callers: the cache's public methods validate first.
"""

from __future__ import annotations

import numpy as np

from .cache_config import CacheConfig
from .lifecycle import Lifecycle
from .modes import SwaRelease
from .pools import DualPool
from .radix import WindowSafeTree
from .radix.node import NO_PAGE
from .request import Request
from .window import group_keeps

__all__ = ["CacheFullError", "RequestPages"]


class CacheFullError(RuntimeError):
    """Not enough free or evictable memory; the request's state is unchanged."""


class RequestPages:
    """Pages of live requests: growth (evicting, then releasing spare SWA, as
    memory requires) and the release of out-of-window SWA that the retention
    policy allows.

    Args:
        pool: the pages (both kinds, and the sliding groups beside the lead one).
        tree: evicts for room.
        lifecycle: the request lifecycle every host shares: its release rule
            (the retention policy) decides what a release keeps.
        config: the :class:`CacheConfig` (``swa_release``, ``spare_fraction``).
        counters: the cache's counters (``rejected``, ``released_swa_pages``,
            ``released_group_pages``), updated in place.
        live: the cache's live requests by ``id``, read only (spare SWA of other
            requests is released when memory runs short).
    """

    def __init__(self, pool: DualPool, tree: WindowSafeTree, lifecycle: Lifecycle, config: CacheConfig,
                 counters: dict[str, int], live: dict[int, Request]) -> None:
        self.pool = pool
        self.tree = tree
        self.lifecycle = lifecycle
        self.config = config
        self.counters = counters
        self.live = live
        self.page_size = tree.page_size
        # the release mode as flags (checked at every chunk end: an enum member lookup
        # costs ~8x a local attribute on Python 3.11)
        self._adaptive = config.swa_release is SwaRelease.ADAPTIVE
        self._never_releases = config.swa_release in (SwaRelease.NONE, SwaRelease.DENSE)

    def reserve(self, req: Request, n: int) -> None:
        """Pages for positions up to ``req.computed + n`` (grows when needed).  O(new pages)."""
        end = req.computed + n
        need = -(-end // self.page_size) - req.n_pages
        if need > 0:
            self.grow(req, need)
        if end > req.allocated:
            req.allocated = end

    def grow(self, req: Request, need: int, waiting: set | None = None) -> None:
        """Give ``req`` ``need`` more pages of each kind, evicting if needed; raises
        :class:`CacheFullError` with ``req`` unchanged.  ``waiting``: ids of other
        requests (rows of a step not served yet) whose spare SWA is not released."""
        got = self.pool.take(need, need)
        if got is None:
            short = self.pool.shortfall(need, need)
            self.tree.evict(short[0], short[1], short[2])
            got = self.pool.take(need, need)
        if got is None and self._adaptive:
            # SWA that live requests kept while memory was spare is the cheapest to give back
            for live in self.live.values():
                if live is not req and (waiting is None or id(live) not in waiting):
                    self.release(live, force=True)
            # the request's own spare SWA goes too, but only once the allocation is sure to
            # succeed with it (a request that gets CacheFullError is left exactly as it
            # was): evict what is short beyond it, then release it if that is enough
            own = self._own_releasable(req)
            sb = self.pool.swa_page_bytes
            short = self.pool.shortfall(need, need)
            self.tree.evict(short[0], max(0, short[1] - own), max(0, short[2] - own * sb))
            got = self.pool.take(need, need)
            if got is None and own:
                short = self.pool.shortfall(need, need)
                if short[0] == 0 and short[1] <= own and short[2] <= own * sb:
                    self.release(req, force=True)
                    got = self.pool.take(need, need)
        if got is None:
            self.counters["rejected"] += 1
            raise CacheFullError(f"cannot allocate {need} pages in both pools "
                                 f"(free bytes {self.pool.free_bytes()}, evictable full pages "
                                 f"{self.tree.evictable_full_pages()}, swa {self.tree.evictable_swa_pages()})")
        self._place(req, got[0], got[1])

    def _own_releasable(self, req: Request) -> int:
        """SWA pages ``release(req, force=True)`` would free now.  O(1 + runs)."""
        lo, cut = self._release_range(req)
        if cut <= lo:
            return 0
        return sum(b - a for a, b in self._releasable_runs(req, lo, cut))

    @staticmethod
    def _place(req: Request, full: np.ndarray, swa: np.ndarray) -> None:
        """Append freshly allocated pages to ``req`` (page arrays double when full);
        every side group holds its page of a fresh SWA id.  O(pages)."""
        lo = req.n_pages
        hi = lo + len(full)
        side = req.side_pages
        if hi > req.full_pages.size:
            size = max(hi, 2 * req.full_pages.size)
            grow = np.full(size - req.swa_pages.size, NO_PAGE, np.int32)
            req.full_pages = np.concatenate([req.full_pages, np.empty(size - req.full_pages.size, np.int32)])
            req.swa_pages = np.concatenate([req.swa_pages, grow])
            if side is not None:
                side = req.side_pages = [np.concatenate([s, grow]) for s in side]
        req.full_pages[lo:hi] = full
        req.swa_pages[lo:hi] = swa
        for s in side or ():
            s[lo:hi] = swa
        req.n_pages = hi

    def _release_range(self, req: Request) -> tuple[int, int]:
        """``(lo, cut)``: the pages ``[lo, cut)`` a release scans.  The tree's
        RetentionPolicy gives the cut; only pages added since the last release are
        scanned (``release_mark``): O(new pages) per release."""
        cut = self.lifecycle.release_cut(req.computed)
        return (req.release_mark if req.release_mark > req.tree_pages else req.tree_pages), cut

    def _releasable_runs(self, req: Request, lo: int, cut: int) -> list[tuple[int, int]]:
        """The runs of ``req``'s pages ``[lo, cut)`` its release frees (the policy keeps
        checkpoint, divergence and predicted windows).  O(1 + runs)."""
        return self.lifecycle.release_runs(lo, cut, req.raw_match_len, req.prefix_len, req.prompt_len)

    def release(self, req: Request, *, force: bool) -> int:
        """Free ``req``'s out-of-window SWA runs the policy releases (``force``: even
        while the adaptive policy sees spare memory).  Returns pages freed.  O(runs)."""
        if self._never_releases:
            return 0
        lo, cut = self._release_range(req)
        if cut <= lo:
            return 0  # nothing new to scan (checked first: it is cheaper than free_bytes)
        if (self._adaptive and not force
                and self.pool.free_bytes() > self.config.spare_fraction * self.pool.budget_bytes):
            return 0
        req.release_mark = cut
        # Pages from the release mark on were never released, so all hold SWA (checked
        # by check_invariants): free the runs the policy releases, no per-page mask.
        swa = req.swa_pages
        runs = self._releasable_runs(req, lo, cut)
        count = 0
        if runs:
            if len(runs) == 1:
                a, b = runs[0]
                gone = swa[a:b]  # a view: the pool copies the ids before they are overwritten below
            else:
                gone = np.concatenate([swa[a:b] for a, b in runs])
            count = gone.size
            self.pool.free_swa_trusted(gone)  # the request's own pages, with the side groups'
            for a, b in runs:
                swa[a:b] = NO_PAGE
                for s in req.side_pages or ():
                    s[a:b] = NO_PAGE
            self.counters["released_swa_pages"] += count
        if self.pool.groups:  # after the lead's release: the groups follow its windows
            self.release_groups(req, cut)
        return count

    def release_groups(self, req: Request, final: int) -> None:
        """Free the pages of each sliding group beside the lead one that no hit can
        use: page ``i`` of a group with a ``w``-page window is kept only while some
        end ``L`` in ``(i, i + w]`` has the lead group's whole window held (so the
        group holds its own window wherever the lead's window rule allows a hit).
        The lead's pages below ``final`` are decided (released or kept for good), so
        ends up to ``final`` are scanned; each group resumes at its mark.  O(new
        pages + windows)."""
        wl = self.tree.policy.window_pages
        if req.group_marks is None:
            # Below the raw match the tree holds these tokens too: at the insert it may
            # adopt this request's SWA beside its own, so a window there can be whole
            # in the tree that is not in the request.  Decide only pages whose ends'
            # windows lie past the raw match.
            first = max(req.tree_pages, req.raw_match_len // self.page_size + wl - 1)
            req.group_marks = [first] * len(self.pool.groups)
        swa = req.swa_pages
        for gi, (group, side) in enumerate(zip(self.pool.groups, req.side_pages)):
            wg = group.window_pages
            lo = req.group_marks[gi]
            hi = final - wg + 1  # page i is decided once every end in (i, i + wg] is
            if hi <= lo:
                continue
            base = max(0, lo + 1 - wl)
            needed = group_keeps(swa[base:hi - 1 + wg] >= 0, lo, hi, wl, wg, base)
            ids = side[lo:hi]  # a view: the request's own page ids of the group
            drop = ~needed & (ids >= 0)
            gone = ids[drop]
            if gone.size:
                self.counters["released_group_pages"] += self.pool.release_group_trusted(group, gone)
                ids[drop] = NO_PAGE
            req.group_marks[gi] = hi

    def step_grow(self, pending: list, ok: np.ndarray, errors: dict, nums: list, grew: list,
                   reqs: list) -> None:
        """Pages for the rows of a step that cross a page boundary: one pool call for
        all of them when memory is free (decode: every row of a batch that started
        together crosses at once), else row by row with eviction; a row that cannot
        get its pages is failed (``nums[i] = 0``) and its appended tokens taken back."""
        total = sum(need for _, _, need, _ in pending)
        got = self.pool.take(total, total)
        o = 0
        # rows that failed already, and rows still waiting for pages (they may yet fail),
        # are left as they were: no other row's growth releases their spare SWA
        waiting = {id(req) for _, req, _, _ in pending}
        waiting.update(id(reqs[i]) for i in np.flatnonzero(~ok).tolist())
        for i, req, need, appended in pending:
            before = req.n_pages
            if got is not None:
                self._place(req, got[0][o:o + need], got[1][o:o + need])
                o += need
            else:
                try:
                    self.grow(req, need, waiting)
                except CacheFullError as exc:
                    req.n_tokens -= appended
                    ok[i] = False
                    errors[i] = exc
                    nums[i] = 0
                    continue
            waiting.discard(id(req))
            grew.append((i, before, req.n_pages))

    def check_ownership(self) -> None:
        """Every used page is owned exactly once (by a tree node or a live request),
        and each live request's page bookkeeping is consistent.  O(n)."""
        nodes = list(self.tree.iter_nodes())
        owned_full = [n.full for n in nodes]
        owned_swa = [n.swa[n.swa >= 0] for n in nodes]
        # each side group holds storage for exactly the ids its owners list for it
        owned_side = [[n.side[g] for n in nodes] for g in range(len(self.pool.groups))]
        for req in self.live.values():
            owned_full.append(req.full_pages[req.tree_pages:req.n_pages])
            s = req.swa_pages[req.tree_pages:req.n_pages]
            owned_swa.append(s[s >= 0])
            assert (req.side_pages is None) == (not self.pool.groups), req
            for g, side in enumerate(req.side_pages or ()):
                own = side[req.tree_pages:req.n_pages]
                assert ((own == NO_PAGE) | (own == s)).all(), ("side group page ids", req)
                owned_side[g].append(own)
            # release relies on this: pages past the release mark were never released
            assert (req.swa_pages[max(req.release_mark, req.tree_pages):req.n_pages] >= 0).all(), req
            assert req.tree_pages <= req.n_pages
            assert req.computed <= req.allocated <= min(req.n_tokens, req.n_pages * self.page_size)
        for group, ids in zip(self.pool.groups, owned_side):
            held = np.concatenate(ids) if ids else np.zeros(0, np.int32)
            held = held[held >= 0]
            assert held.size == group.used and group.holds(held).all(), ("side group ownership", group.group.name)
        full = np.concatenate(owned_full) if owned_full else np.zeros(0, np.int32)
        swa = np.concatenate(owned_swa) if owned_swa else np.zeros(0, np.int32)
        assert np.unique(full).size == full.size == self.pool.full.num_used, \
            ("full page ownership", np.unique(full).size, full.size, self.pool.full.num_used)
        assert np.unique(swa).size == swa.size == self.pool.swa.num_used, \
            ("swa page ownership", np.unique(swa).size, swa.size, self.pool.swa.num_used)
        assert self.pool.full.is_allocated(full).all() and self.pool.swa.is_allocated(swa).all()
