"""The window-safe prefix tree: the prefix index.

The tree decides what is a hit and what is evicted; it never touches KV tensors.
Pages it drops go back to the pool by ``free_full`` / ``free_swa`` (``free_listeners`` first).

This module holds the index itself (nodes, walk, match, insert, split, locks,
invariants); the rest are named collaborators in their own modules, reached
through public methods: ``anchors`` (:mod:`~hybridkv.radix.anchors`),
``eviction`` (:mod:`~hybridkv.radix.evict`), ``learning``, ``events``, ``locks``
/ ``pins``, ``ranking`` (:mod:`~hybridkv.radix.rankings`), ``policy`` and ``runs``
(what L1 evicted while a tier below holds it: :mod:`~hybridkv.radix.evicted`).

Invariants (checked by :meth:`WindowSafeTree.check_invariants`):

* every node's key is page aligned and its first page is its key in the
  parent's ``children``; ``start`` equals the sum of ancestor lengths;
* ``node.lock >= sum(child.lock)`` (path locks), root locks are never counted;
* a SWA page is pinned only while valid; an unlocked node holds no pinned page;
* no page id appears twice across the tree; counters equal the sums they cache;
* namespaces have separate roots and never share a node.

A hit of length ``L`` is *window safe* iff every page of ``[0, L)`` holds full
KV (true for every node in the tree) and every page overlapping
``[max(0, L - W), L)`` holds SWA KV.  :meth:`match` returns the largest
page-aligned window-safe ``L`` not exceeding the token match.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from .._validate import as_int_array, as_token_array, check_int
from ..spec import AttnKind
from .anchors import WindowAnchors
from .divergence import DivergenceModel
from .events import TreeEvents, deliver_after
from .evict import Eviction
from .evicted import EvictedRuns
from .learning import MatchLearning
from .node import NO_PAGE, EvictedRun, TreeNode, common_pages, node_array, parts_pages, parts_side, split_names, unrecorded
from .pins import PathLocks, SwaPins
from .policy import RetentionPolicy
from .rankings import Ranking, make_ranking
from .types import (EMPTY, RANKINGS, SWA_EVICTIONS, InsertResult, LockHandle, FreedPages, MatchResult, PageNames,
                    PagePool, SideGroup, TreeConfig, TreeEvent, pool_lacks)

__all__ = ["TreeConfig", "TreeEvent", "WindowSafeTree", "MatchResult", "LockHandle", "InsertResult",
           "PagePool", "RANKINGS", "SWA_EVICTIONS", "as_token_array", "parts_pages", "parts_side"]


class WindowSafeTree:
    """Radix tree over page-aligned token keys with dual full/SWA page ids.

    Args:
        config: :class:`TreeConfig`.
        pool: receives freed pages (:class:`PagePool`).
        full_page_bytes / swa_page_bytes: used to weigh byte-budget eviction.

    Collaborators (attributes, see the module docstring): ``anchors``, ``eviction``,
    ``learning``, ``events``, ``locks``, ``pins``, ``policy``, ``ranking``, ``divergence``, ``runs``.
    """

    def __init__(self, config: TreeConfig, pool: PagePool, *, full_page_bytes: int = 1,
                 swa_page_bytes: int = 1) -> None:
        if not isinstance(config, TreeConfig):
            raise TypeError(f"config must be a TreeConfig, got {type(config).__name__}")
        lacks = pool_lacks(pool)
        if lacks:
            raise TypeError(f"pool must implement hybridkv.radix.PagePool; {type(pool).__name__} lacks {lacks}")
        self.config = config
        self.pool = pool
        # sliding groups beside the lead one (a pool of a several-window model): each
        # node holds a page id per group (``TreeNode.side``), and a hit needs each
        # group's window too (see WindowAnchors.safe_pages)
        self.groups: tuple[SideGroup, ...] = tuple(pool.groups)
        self.n_side = len(self.groups)
        self.page_size = config.page_size
        self.full_page_bytes = full_page_bytes
        self.swa_page_bytes = swa_page_bytes
        self._roots: dict[str, TreeNode] = {}
        self._tick = 0
        self.pins = SwaPins()
        self.policy = RetentionPolicy(config.page_size, config.window, config.swa_checkpoint,
                                      branch_points=config.anchor_branch_points)
        ranking = make_ranking(config.ranking, self._clock)
        self.reuse = ranking.reuse  # the "value" ranking's learned return hazards
        self.ranking: Ranking = ranking
        self.divergence = DivergenceModel()  # learns RetentionPolicy.pretail_pages
        self.num_nodes = 0
        self.full_pages_cached = 0
        self.swa_pages_cached = 0
        self.events = TreeEvents(self.page_size)
        self.anchors = WindowAnchors(self.policy, self.page_size, tuple(g.window_pages for g in self.groups))
        self.learning = MatchLearning(self.policy, self.divergence, ranking, self.page_size, swa_page_bytes,
                                      now=self._now, node_count=lambda: self.num_nodes)
        self.runs = EvictedRuns(self.page_size)  # what L1 evicted (kept once a tier below enables it)
        self.eviction = Eviction(self, self.anchors, ranking, self.pins, self.divergence, self.events, self.policy,
                                 self.runs, mode=config.swa_eviction, page_size=self.page_size,
                                 full_page_bytes=full_page_bytes, swa_page_bytes=swa_page_bytes,
                                 side_bytes=tuple(g.page_bytes for g in self.groups))
        self.locks = PathLocks(self.pins, self.anchors, self.eviction, self.policy)
        # Called with (kind, int32 page ids, PageNames or None) just before the tree gives pages back to
        # ``pool`` (an eviction, an insert's duplicate): a tier below can copy them first (no tree calls).
        self.free_listeners: list[Callable[[AttnKind, np.ndarray, PageNames | None], None]] = []
        self._pool_free_full = pool.free_full_trusted
        self._pool_free_swa = pool.free_swa_trusted

    def return_full_pages(self, pages: np.ndarray, names: PageNames | None = None) -> None:
        """Give int32 full ``pages`` the tree dropped back to the pool, after the
        ``free_listeners`` (told the pages' tier ``names``; None: unnamed).  O(pages)."""
        for hook in self.free_listeners:
            hook(AttnKind.FULL, pages, names)
        self._pool_free_full(pages)

    def return_swa_pages(self, pages: np.ndarray, names: PageNames | None = None) -> None:
        """:meth:`return_full_pages` for SWA ``pages``.  O(pages)."""
        for hook in self.free_listeners:
            hook(AttnKind.SWA, pages, names)
        self._pool_free_swa(pages)

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def _clock(self) -> int:
        """The tick of the last update (rankings read it without advancing it)."""
        return self._tick

    # ======================================================= collaborators
    listeners = property(lambda self: self.events.listeners,
                         doc="Callables that hear every :class:`TreeEvent` (append to subscribe).")
    listener_errors = property(lambda self: self.events.errors,
                               doc="Listener exceptions caught (logged; the tree stays consistent).")

    evicted_full_pages = property(lambda self: self.eviction.evicted_full_pages, doc="Full pages evicted so far.")
    evicted_swa_pages = property(lambda self: self.eviction.evicted_swa_pages, doc="SWA pages evicted so far.")

    def evictable_full_pages(self) -> int:
        return self.full_pages_cached - self.protected_full_pages

    def evictable_swa_pages(self) -> int:
        return self.swa_pages_cached - self.protected_swa_pages

    @deliver_after
    def evict(self, full_pages: int = 0, swa_pages: int = 0, nbytes: int = 0) -> tuple[int, int]:
        """Free at least ``full_pages`` full pages, ``swa_pages`` SWA pages and
        ``nbytes`` bytes, as far as unlocked data allows; returns the pages freed
        ``(full, swa)``.  The order is :meth:`Eviction.evict`'s; events are
        delivered once it is done.  Runtime: O(k log n) for k nodes visited.
        Raises ValueError for a negative or non-int amount, changing nothing."""
        for name, value in (("full_pages", full_pages), ("swa_pages", swa_pages), ("nbytes", nbytes)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        return self.eviction.evict(full_pages, swa_pages, nbytes)

    def heap_limit(self) -> int:
        return self.eviction.heap_limit()  # see Eviction.heap_limit

    def heap_sizes(self) -> dict[str, int]:
        return self.eviction.heap_sizes()  # see Eviction.heap_sizes

    def anchored(self, node: TreeNode) -> np.ndarray:
        """bool per page of ``node``: its SWA ends a likely hit (anchor count > 0).  O(pages)."""
        return self.anchors.anchored(node)

    # ============================================ what eviction asks of the index
    def detach_leaf(self, node: TreeNode) -> TreeNode:
        """Unlink leaf ``node`` (eviction took all its pages) from its parent and
        mark it dead (``node.alive`` is False); returns the parent.  O(1)."""
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key[:self.page_size].tobytes()]
        self.num_nodes -= 1
        node.key = None  # type: ignore[assignment]
        node.parent = None
        return parent

    def uncount(self, full_pages: int, swa_pages: int) -> None:
        """Eviction dropped ``full_pages`` / ``swa_pages`` pages from nodes.  O(1)."""
        self.full_pages_cached -= full_pages
        self.swa_pages_cached -= swa_pages

    @property
    def protected_swa_pages(self) -> int:
        """SWA pages pinned by locks (never evicted while pinned)."""
        return self.pins.protected

    def root(self, namespace: str) -> TreeNode:
        """Root of ``namespace`` (created on first use).  O(1)."""
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        node = self._roots.get(namespace)
        if node is None:
            node = TreeNode(EMPTY, EMPTY, EMPTY, None, 0, namespace, 0)
            node.lock = 1  # roots are never evicted
            self._roots[namespace] = node
        return node

    def namespaces(self) -> list[str]:
        return list(self._roots)

    def walk(self, key: np.ndarray, namespace: str, limit: int) -> tuple[TreeNode, list[tuple[TreeNode, int]]]:
        """Follow ``key[:limit]``; returns root and [(node, matched_pages)].  O(depth + L/P)."""
        root = self._roots.get(namespace)
        path: list[tuple[TreeNode, int]] = []
        if root is None:
            return self.root(namespace), path
        node, pos, size = root, 0, self.page_size
        while pos < limit:
            child = node.children.get(key[pos:pos + size].tobytes())
            if child is None:
                break
            ck = child.key
            m = len(ck)
            if m > limit - pos:
                m = limit - pos
            b = key[pos:pos + m]
            if b.tobytes().startswith(ck[:m]):  # common_pages, inlined on this hot path
                k = m // size
            else:
                k = int(np.argmax(ck[:m] != b)) // size
            if k == 0:
                break
            path.append((child, k))
            pos += k * size
            if k < len(child.full):
                break
            node = child
        return root, path

    def walk_names(self, key: np.ndarray, namespace: str, limit: int, *, trim: bool = True,
                   runs: list[tuple[EvictedRun, int]] | None = None) -> tuple[list[bytes], list[tuple[TreeNode, int]]]:
        """:meth:`walk`, and the names of ``key``'s leading pages that it and the evicted runs at its end
        spell (:meth:`EvictedRuns.along`, which fills ``runs``); ``trim`` (the engine's thread only)
        first brings the runs back within their cap.  O(depth + L/P)."""
        if trim:
            self.runs.trim()
        root, path = self.walk(key, namespace, limit)
        return self.runs.along(root, path, key, limit, runs), path

    def match(self, key: object, namespace: str = "default", *, max_len: int | None = None,
              split: bool = False, touch: bool = True) -> MatchResult:
        """Longest window-safe cached prefix of ``key`` in ``namespace``.

        Args:
            key: token ids (1-D ints); only whole pages can match.
            max_len: cap on the match (e.g. ``len(key) - 1`` so one token is
                left to compute).
            split: split the last node so a node ends exactly at the hit
                (needed before :meth:`lock`).
            touch: refresh LRU recency of the matched path.

        Runtime complexity: O(depth + L / page_size) plus numpy compares of the
        matched tokens.  Mutates only recency (and node boundaries if ``split``).
        """
        return self.match_tokens(as_token_array(key, "key"), namespace, max_len, split=split, touch=touch)

    def match_tokens(self, key: np.ndarray, namespace: str, max_len: int | None = None, *, split: bool = False,
                     touch: bool = True) -> MatchResult:
        """:meth:`match` on an already validated key."""
        safe, raw_pages, parts, node = self.match_parts(key, namespace, max_len, split=split, touch=touch)
        full, swa = parts_pages(parts)
        size = self.page_size
        return MatchResult(safe * size, raw_pages * size, full, swa, node, parts_side(parts, self.n_side))

    def match_parts(self, key: np.ndarray, namespace: str, max_len: int | None = None, *, split: bool = False,
                    touch: bool = True) -> tuple[int, int, list[tuple[TreeNode, int]], TreeNode | None]:
        """:meth:`match_tokens` without building the page arrays: ``(safe_pages, raw_pages,
        [(node, pages taken)], node)``; the hit's pages are ``node.full[:taken]`` of
        each part in order (a caller copying them into its own buffer skips a copy)."""
        if max_len is not None and (not isinstance(max_len, (int, np.integer)) or max_len < 0):
            raise ValueError(f"max_len must be a non-negative int, got {max_len!r}")
        size = self.page_size
        limit = len(key) if max_len is None else min(len(key), int(max_len))
        limit -= limit % size
        _, path = self.walk(key, namespace, limit)
        raw_pages = 0
        for _, k in path:
            raw_pages += k
        safe = self.anchors.safe_pages(path, raw_pages)
        # the request leaves the cached sequence inside its last node (not at its end,
        # and not because the request ends there): it diverges, e.g. a new question on
        # a cached document or a regenerated reply
        diverged = bool(path) and path[-1][1] < len(path[-1][0].full) and raw_pages * size < limit
        parts: list[tuple[TreeNode, int]] = []
        node: TreeNode | None = None
        unmatched = None  # the lower half of a split that the request did not reach into
        left = safe
        for n, k in path:
            if left == 0:
                break
            take = k if k < left else left
            if split and take < len(n.full):
                self._split(n, take)
                if take == k:
                    unmatched = n
                n = n.parent  # the upper half ends at the hit
                assert n is not None
            parts.append((n, take))
            node = n
            left -= take
        if touch:
            self.learning.observe_match(key, namespace, path, safe, raw_pages, limit, diverged, node, unmatched)
        return safe, raw_pages, parts, node

    # ================================================================= split
    def _split(self, node: TreeNode, pages: int) -> None:
        """Cut ``node`` after ``pages`` pages; the upper half becomes its parent.  O(n)."""
        assert 0 < pages < node.n_pages
        cut = pages * self.page_size
        parent = node.parent
        assert parent is not None
        side = node.side
        upper = TreeNode(node.key[:cut], node.full[:pages], node.swa[:pages], parent,
                         node.start, node.namespace, node.last_access,
                         None if side is None else [s[:pages] for s in side])
        upper.lock = node.lock
        self.ranking.node_split(upper, node)
        upper.anchor = node.anchor[:pages].copy()  # per-page counts: windows stay where they were
        node.anchor = node.anchor[pages:].copy()
        if node.points:  # a predicted window belongs to the half its last page is in
            cut_abs = node.start // self.page_size + pages
            up = [p for p in node.points if p <= cut_abs]
            upper.points = up or None
            node.points = [p for p in node.points if p > cut_abs] or None
            if up:
                self.eviction.watch_points(upper)
        if 0 <= node.mark <= node.start // self.page_size + pages:  # the prompt ended in the upper half
            upper.mark, node.mark = node.mark, -1
        split_names(upper, node, pages)
        self.runs.split(upper, node, pages)  # the runs inside go with the pages they leave
        node.key = node.key[cut:]
        node.full = node.full[pages:]
        node.swa = node.swa[pages:]
        if side is not None:
            node.side = [s[pages:] for s in side]
        node.swa_valid -= upper.swa_valid
        node.start += cut
        parent.children[upper.key[:self.page_size].tobytes()] = upper
        upper.children[node.key[:self.page_size].tobytes()] = node
        node.parent = upper
        self.num_nodes += 1  # a locked node's halves stay locked: protected count unchanged
        self.anchors.reanchor(upper)  # the upper half may end at the prompt's end (node.mark)
        self.eviction.enqueue(upper, leaf=False)

    # ================================================================ insert
    def insert(self, key: object, full_pages: object, swa_pages: object,
               namespace: str = "default", prompt_len: int | None = None, *,
               names: PageNames | None = None) -> InsertResult:
        """Cache ``key`` with its pages; the tree takes ownership of all of them.

        ``full_pages``: one id per page of ``key`` (a whole number of pages);
        ``swa_pages`` likewise, ``NO_PAGE`` where the caller holds no SWA.  The
        caller's duplicates of pages the tree caches are freed; its SWA where the
        tree's was evicted is adopted (repair).  ``prompt_len``: the tokens of
        ``key`` that were the prompt when decoded output follows (None: all);
        the divergence model measures from there (``TreeNode.mark``).
        ``names``: the lower tiers' names of the pages (:class:`PageNames`).
        Runtime complexity: O(depth + len(key)/page_size) plus numpy work.
        Raises ValueError/TypeError on bad input without changing anything.
        """
        key = as_token_array(key, "key")
        full = as_int_array(full_pages, "full_pages")
        swa = as_int_array(swa_pages, "swa_pages")
        size = self.page_size
        if len(key) % size:
            raise ValueError(f"key length {len(key)} is not a multiple of page_size {size}")
        n = len(key) // size
        if len(full) != n or len(swa) != n:
            raise ValueError(f"full_pages and swa_pages need {n} entries, got {len(full)} and {len(swa)}")
        if n and full.min() < 0:
            raise ValueError("full_pages must be valid page ids (>= 0)")
        if n and swa.min() < NO_PAGE:
            raise ValueError("swa_pages must be page ids or -1")
        if names is not None and (not isinstance(names, PageNames) or len(names.keys) != n):
            raise ValueError(f"names must be PageNames of {n} pages, got {names!r:.80}")
        self.root(namespace)  # validates the namespace
        mark = -1 if prompt_len is None else check_int(prompt_len, "prompt_len", 0) // size
        if n:
            # the tree frees what it takes without checks, so a page it is handed must be
            # allocated in its pool and listed once (else a later free corrupts the pool)
            self.pool.check_taken("full", full, "full_pages")
            self.pool.check_taken("swa", swa[swa >= 0], "swa_pages")
        # each side group's page ids: the caller's SWA ids where the group holds them
        side = [np.where(g.holds(swa), swa, NO_PAGE).astype(np.int32) for g in self.groups] or None
        return self.insert_tokens(key, full, swa, namespace, mark=mark, side=side, names=names)

    @deliver_after
    def insert_tokens(self, key: np.ndarray, full: np.ndarray, swa: np.ndarray, namespace: str, *,
                start: TreeNode | None = None, owned: bool = False, mark: int = -1,
                continued: bool = False, side: list[np.ndarray] | None = None,
                names: PageNames | None = None) -> InsertResult:
        """:meth:`insert` for internal callers: no validation.

        ``start``: an alive node of ``namespace`` whose path spells exactly
        ``key[:start.start + len(start.key)]`` (e.g. the node a request locked);
        the walk begins there, and the pages before it (the tree's own) are
        neither compared nor freed; None (or a root): the root.  ``owned``: the
        caller hands the arrays over; a new leaf may keep views of them.
        ``mark``: the page where the prompt ended when decoded output follows
        (``TreeNode.mark``; -1: the end of ``key``).  ``continued``: ``start`` is
        where the same request's earlier insert (or counted match) ended, e.g.
        its prompt's previous chunk: the path gets recency, not one more use.
        ``side``: with side groups, each group's page ids aligned with ``full``
        (``NO_PAGE`` where it holds none).  ``names``: the tiers' names of the
        pages of ``key`` (new leaves keep them, freed duplicates carry them).
        Runtime complexity: O(depth + pages after start) plus numpy work.
        """
        assert (side is None) == (not self.groups), "side page ids are given exactly when the pool has side groups"
        size = self.page_size
        n = len(key) // size
        root = self._roots.get(namespace) or self.root(namespace)
        now = self._now()
        if start is None or start.parent is None:
            node, pi = root, 0
        else:
            node, pi = start, (start.start + len(start.key)) // size
            up: TreeNode = start
            again = self.ranking.refresh if continued else self.ranking.touch
            while up.parent is not None:  # recency as a walk from the root
                again(up, now)
                up = up.parent
        named = names if self.free_listeners else None  # names of the duplicates freed
        freed = FreedPages(named is not None)
        adopted = 0
        while pi < n:
            child = node.children.get(key[pi * size:(pi + 1) * size].tobytes())
            if child is None:
                break
            k = common_pages(child.key, key, pi * size, len(key), size)
            if k < len(child.full):
                self._split(child, k)
                child = child.parent
            ours_f, ours_s = full[pi:pi + k], swa[pi:pi + k]
            dup = ours_f != child.full
            freed.add_full(ours_f[dup], named and named.at(pi + np.flatnonzero(dup)), (child.host_at, np.flatnonzero(dup)))
            have = child.swa >= 0
            mine = ours_s >= 0
            adopt = ~have & mine
            got = int(np.count_nonzero(adopt))  # count_nonzero: a C call, .any()/.sum() go through Python
            if got:
                child.swa = child.swa.copy()
                child.swa[adopt] = ours_s[adopt]
                if side is not None:  # the side groups' pages come with the lead's
                    child.side = [np.where(adopt, s[pi:pi + k], c) for s, c in zip(side, child.side)]
                if names is not None and child.tier_anchor is not None:
                    child.tier_anchor[adopt] = names.anchored[pi:pi + k][adopt]
                child.swa_valid += got
                self.swa_pages_cached += got
                adopted += got
                self.eviction.enqueue(child, leaf=False)
                if self.events.listeners:
                    self.events.emit("swa_store", child)
            dup_s = have & mine & (ours_s != child.swa)
            freed.add_swa(ours_s[dup_s], named and named.at(pi + np.flatnonzero(dup_s)), (child.host_at, np.flatnonzero(dup_s)))
            self.ranking.touch(child, now)
            node = child
            pi += k
        new_pages = n - pi
        if new_pages:
            node = self._add_leaf(node, root, key, full, swa, pi, n, namespace, now, owned, mark, side, names)
        freed.give_back(self)
        return InsertResult(node if node is not root else None, new_pages, adopted)

    def _add_leaf(self, node: TreeNode, root: TreeNode, key: np.ndarray, full: np.ndarray, swa: np.ndarray,
                  pi: int, n: int, namespace: str, now: int, owned: bool, mark: int,
                  side: list[np.ndarray] | None, names: PageNames | None) -> TreeNode:
        """:meth:`insert_tokens`' new leaf under ``node``: pages ``[pi, n)`` of ``key``
        with their ``full`` / ``swa`` ids, filed with the ranking, anchored (tail,
        checkpoints, a predicted window) and announced.  Returns the leaf.  O(pages)."""
        size = self.page_size
        new_pages = n - pi
        was_leaf = not node.children
        leaf = TreeNode(node_array(key[pi * size:], owned), node_array(full[pi:], owned),
                        node_array(swa[pi:], owned), node, pi * size, namespace, now,
                        None if side is None else [node_array(s[pi:], owned) for s in side])
        if names is not None:
            leaf.page_keys, leaf.tier_anchor = names.keys[pi:n], names.anchored[pi:n].copy()
            leaf.host_at = unrecorded(n - pi) if names.host_at is None else names.host_at[pi:n].copy()
        if pi < mark < n:
            leaf.mark = mark
        elif mark == pi and node is not root:  # the prompt ended where the new pages start
            node.mark = mark
        first = leaf.key[:size].tobytes()
        self.runs.covered(node, first, leaf)  # a run L1 evicted there hangs past the pages the leaf spells
        node.children[first] = leaf
        if len(node.children) > 1:
            node.branched = True
        self.num_nodes += 1
        self.full_pages_cached += new_pages
        self.swa_pages_cached += leaf.swa_valid
        self.ranking.leaf_added(leaf, node, parent_is_root=node is root, was_leaf=was_leaf, pos=pi * size,
                                pages=new_pages)
        for a, b in self.policy.checkpoint_windows(pi, n):  # the new leaf's counts are all 0
            leaf.anchor[a - pi:b - pi] = 1
        anchors, eviction = self.anchors, self.eviction
        anchors.reanchor(node)
        anchors.anchor_window(leaf, 1)  # reanchor(leaf), inlined: a fresh leaf's tail is an anchor
        leaf.ends = 1
        eviction.enqueue(leaf)
        if node is not root:
            eviction.enqueue(node, leaf=False)  # its tail is no longer a leaf tail
        if self.policy.pretail_pages >= 0 and not 0 <= mark <= pi:  # (not a leaf of output only)
            if anchors.predict_window(leaf):
                eviction.watch_points(leaf)
        if self.events.listeners:
            self.events.emit("store", leaf)
        return leaf

    # ================================================================= locks
    def lock(self, node: TreeNode | None) -> LockHandle:
        """Protect the path to ``node`` (full KV) and the SWA window ending at it;
        see :meth:`PathLocks.lock`.  O(depth)."""
        return self.locks.lock(node)

    def unlock(self, handle: LockHandle) -> None:
        """Undo :meth:`lock` / :meth:`lock_path`; see :meth:`PathLocks.unlock`.  O(depth)."""
        self.locks.unlock(handle)

    def lock_path(self, node: TreeNode | None, swa_pages: np.ndarray) -> LockHandle:
        """Lock the path to ``node``, pin ``swa_pages`` (:meth:`PathLocks.lock_path`).  O(depth + pages)."""
        return self.locks.lock_path(node, swa_pages)

    def pin_swa(self, pages: np.ndarray, delta: int) -> None:
        """Add ``delta`` (+1 / -1) to the pin counts of int32 SWA ``pages`` (pinned
        pages are never evicted).  O(n)."""
        self.pins.pin(pages, delta)

    @property
    def protected_full_pages(self) -> int:
        """Full pages on locked paths (never evicted while locked)."""
        return self.locks.protected_full_pages

    # ============================================================= inspection
    def iter_nodes(self, namespace: str | None = None) -> Iterator[TreeNode]:
        """All non-root nodes (of one namespace or all).  O(n)."""
        roots = [self._roots[namespace]] if namespace is not None else list(self._roots.values())
        stack = [c for r in roots if r is not None for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_tokens(self) -> int:
        return self.full_pages_cached * self.page_size

    def check_invariants(self) -> None:
        """Verify every invariant listed in the module docstring.  O(n)."""
        size = self.page_size
        full_seen: list[np.ndarray] = []
        swa_seen: list[np.ndarray] = []
        n_nodes = swa_valid = prot_full = 0
        for ns, root in self._roots.items():
            stack = [root]
            while stack:
                node = stack.pop()
                for first, child in node.children.items():
                    assert child.alive and child.parent is node
                    assert child.namespace == ns
                    assert first == child.key[:size].tobytes()
                    assert len(child.key) == child.n_pages * size > 0
                    assert len(child.swa) == child.n_pages
                    assert (child.side is None) == (not self.groups), child
                    for s in child.side or ():  # a side group's id is the lead's where it holds one
                        assert len(s) == child.n_pages and ((s == NO_PAGE) | (s == child.swa)).all(), child
                    assert child.start == node.start + (len(node.key) if node.parent is not None else 0)
                    assert child.page_keys is None or (len(child.page_keys) == len(child.tier_anchor)
                                                     == len(child.host_at) == child.n_pages)
                    stack.append(child)
                if node.parent is None:
                    continue
                n_nodes += 1
                assert node.lock >= sum(c.lock for c in node.children.values())
                valid = node.swa >= 0
                assert node.swa_valid == int(valid.sum())
                swa_valid += node.swa_valid
                if node.lock:
                    prot_full += node.n_pages
                else:
                    assert not self.pins.pinned(node.swa).any(), f"pinned SWA in unlocked {node}"
                full_seen.append(node.full)
                swa_seen.append(node.swa[valid])
        assert n_nodes == self.num_nodes, (n_nodes, self.num_nodes)
        nodes = list(self.iter_nodes())
        self.anchors.check(nodes)
        self.ranking.check(nodes)
        assert swa_valid == self.swa_pages_cached
        assert prot_full == self.protected_full_pages, (prot_full, self.protected_full_pages)
        full = np.concatenate(full_seen) if full_seen else EMPTY
        swa = np.concatenate(swa_seen) if swa_seen else EMPTY
        assert full.size == self.full_pages_cached
        assert np.unique(full).size == full.size, "a full page is cached twice"
        assert np.unique(swa).size == swa.size, "a SWA page is cached twice"
        self.pins.check()
        self.runs.check([*self._roots.values(), *nodes])
        pinned_ids = self.pins.pinned_ids()
        if pinned_ids.size:
            assert np.isin(pinned_ids, swa).all(), "a pinned SWA page is not held by the tree"
