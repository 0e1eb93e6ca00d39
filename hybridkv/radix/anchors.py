"""Window anchors: which SWA windows the prefix index keeps, and the window-safe length of a path.

A window is *anchored* when a hit is likely to end at it: a leaf's tail, a
branch point, a retention checkpoint (:class:`~hybridkv.radix.policy.RetentionPolicy`)
or a window the divergence model predicts (:mod:`~hybridkv.radix.learning`).
Each page counts the anchored windows covering it (``TreeNode.anchor``);
eviction frees unanchored SWA first.  The window rule itself (when a matched
path is a usable hit) is :mod:`hybridkv.window`'s, reached through
:func:`~hybridkv.radix.node.window_safe_pages`.

:class:`WindowAnchors` is a collaborator of
:class:`~hybridkv.radix.tree.WindowSafeTree`: it keeps the anchor counts of the
nodes the tree hands it and reads their windows; it holds no node of its own.
"""

from __future__ import annotations

import numpy as np

from ..window import groups_safe_pages
from .node import TreeNode, parts_side, window_safe_pages
from .policy import RetentionPolicy
from .types import EMPTY

__all__ = ["WindowAnchors"]


class WindowAnchors:
    """Anchor counts and window reads over the nodes of one tree.

    Args:
        policy: the tree's :class:`~hybridkv.radix.policy.RetentionPolicy`
            (window, checkpoints, branch points, the predicted window's place).
        page_size: tokens per page.
        group_windows: the windows, in pages, of the sliding groups beside the
            lead one (a several-window model; their page ids are the nodes'
            ``side`` arrays, in this order): a hit needs each of their windows too.
    """

    def __init__(self, policy: RetentionPolicy, page_size: int, group_windows: tuple[int, ...] = ()) -> None:
        self.policy = policy
        self.page_size = page_size
        self.group_windows = group_windows

    def anchor_window(self, node: TreeNode, delta: int, end: int | None = None) -> None:
        """Add ``delta`` to the anchor count of the ``window_pages`` pages ending at
        ``node``'s end, or ``end`` pages into it (a predicted window), walking into the
        parents."""
        need = self.policy.window_pages
        n: TreeNode | None = node
        k = len(node.anchor) if end is None else end
        while need > 0 and n is not None and n.parent is not None:
            anchor = n.anchor
            take = need if need < k else k
            if take <= 4:  # a window of a few pages: scalar writes beat a slice ufunc
                for i in range(k - take, k):
                    anchor[i] += delta
            else:
                anchor[k - take:k] += delta
            need -= take
            n = n.parent
            k = len(n.anchor) if n is not None else 0

    def wants_end_anchor(self, node: TreeNode) -> int:
        """1 if a window ending at ``node`` is an anchor: a leaf's tail, a branch
        point, now or before (``node.branched``), or a prompt's end with the
        request's output cached below it (``node.mark``).  A point where requests
        diverged once, e.g. the end of a document asked several questions, is
        where the next one diverges too: its window stays anchored while one child
        is left, so the next question still hits the whole document.  A prompt's
        end is where the next turn leaves the cached output whenever the client
        does not send that output back token for token (reasoning stripped, tool
        calls re-rendered, a regenerated answer); an engine that caches a prompt
        before its output (vLLM's scheduler, chunk by chunk) would otherwise move
        the prompt's tail anchor onto the output and lose the prompt's window."""
        k = len(node.children)
        if k == 0 or (self.policy.branch_points and (k > 1 or node.branched)):
            return 1
        return int(node.mark >= 0 and node.mark == node.start // self.page_size + len(node.full))

    def reanchor(self, node: TreeNode) -> None:
        """Bring ``node``'s end anchor in line with its children (after they changed).  O(window)."""
        if node.parent is None or node.key is None:
            return
        want = self.wants_end_anchor(node)
        if want != node.ends:
            self.anchor_window(node, want - node.ends)
            node.ends = want

    def predict_window(self, leaf: TreeNode) -> bool:
        """Anchor the window ending ``policy.pretail_pages`` before new ``leaf``'s end
        (where the learned divergence model expects requests to leave it), if the leaf
        holds that window's SWA.  The window stays inside the leaf: no split, no extra
        node; eviction can trim the leaf back to it like to a checkpoint.  Returns
        True if a window was anchored (the caller files the leaf with eviction's
        predicted windows).  O(window)."""
        d, wp = self.policy.pretail_pages, self.policy.window_pages
        cut = (leaf.mark - leaf.start // self.page_size if leaf.mark >= 0 else len(leaf.full)) - d
        if d < 0 or cut < wp or cut >= len(leaf.full) or int(np.count_nonzero(leaf.swa[cut - wp:cut] >= 0)) < wp:
            return False  # (a window at the leaf's end is its tail's, already kept)
        leaf.anchor[cut - wp:cut] += 1
        leaf.points = [leaf.start // self.page_size + cut]
        return True

    def anchored(self, node: TreeNode) -> np.ndarray:
        """bool per page of ``node``: its SWA ends a likely hit (anchor count > 0).  O(pages)."""
        return node.anchor > 0

    def window_ids(self, node: TreeNode) -> list[int]:
        """SWA page ids of the last ``window_pages`` pages ending at ``node``, as
        Python ints: a window is a few pages, where a list beats numpy calls."""
        need = self.policy.window_pages
        swa = node.swa
        if 0 < need <= len(swa) and node.parent is not None:  # the window lies in ``node``
            return swa[len(swa) - need:].tolist()
        ids: list[int] = []
        n: TreeNode | None = node
        while need > 0 and n is not None and n.parent is not None:
            swa = n.swa
            k = len(swa)
            take = need if need < k else k
            ids[:0] = swa[k - take:].tolist()
            need -= take
            n = n.parent
        return ids

    def window_page_ids(self, node: TreeNode) -> np.ndarray:
        """SWA page ids of the last ``window_pages`` pages ending at ``node`` (int32)."""
        ids = self.window_ids(node)
        return np.array(ids, dtype=np.int32) if ids else EMPTY

    def window_held(self, node: TreeNode) -> bool:
        """True if every page of the window ending at ``node`` holds SWA."""
        ids = self.window_ids(node)
        return not ids or min(ids) >= 0

    def safe_pages(self, path: list[tuple[TreeNode, int]], total: int) -> int:
        """:func:`window_safe_pages` of the matched path (``total`` pages).  The common
        case, a held tail window, is checked on Python ints (a window is a few
        pages); only a broken tail takes the numpy scan."""
        need = self.policy.window_pages
        if need > total:
            need = total
        i = len(path) - 1
        while need > 0:
            n, k = path[i]
            take = k if k < need else need
            if take and min(n.swa[k - take:k].tolist()) < 0:
                safe = window_safe_pages([n.swa[:k] for n, k in path], self.policy.window_pages)
                return self.groups_safe(path, safe) if self.group_windows else safe
            need -= take
            i -= 1
        return self.groups_safe(path, total) if self.group_windows else total

    def groups_safe(self, path: list[tuple[TreeNode, int]], limit: int) -> int:
        """Largest end ``<= limit`` pages (safe for the lead group) where every other
        sliding group holds its own window too.  O(limit x groups)."""
        if limit == 0:
            return 0
        ids = np.concatenate([n.swa[:k] for n, k in path])[:limit]
        masks = [ids >= 0] + [s[:limit] >= 0 for s in parts_side(path, len(self.group_windows))]
        wps = [self.policy.window_pages, *self.group_windows]
        return groups_safe_pages(masks, wps, limit)

    def check(self, nodes: list[TreeNode]) -> None:
        """Anchor counts of ``nodes`` (all of a tree's) equal checkpoints + one window
        per tail / branch point / predicted window; AssertionError otherwise.  O(n)."""
        expect: dict[int, np.ndarray] = {}
        for node in nodes:
            lo = node.start // self.page_size
            expect[node.nid] = self.policy.checkpoint_mask(lo, lo + node.n_pages).astype(np.int32)

        def window(node: TreeNode, k: int) -> None:  # expect the window ending k pages into node
            need, n = self.policy.window_pages, node
            while need > 0 and n is not None and n.parent is not None:
                take = min(need, k)
                expect[n.nid][k - take:k] += 1
                need -= take
                n = n.parent
                k = n.n_pages if n is not None else 0

        for node in nodes:
            want = self.wants_end_anchor(node)
            assert node.ends == want, (node, node.ends, want)
            if want:
                window(node, node.n_pages)
            for p in node.points or ():  # predicted windows inside the node
                k = p - node.start // self.page_size
                assert 0 < k <= node.n_pages, (node, p)
                window(node, k)
            assert node.mark == -1 or 0 < node.mark - node.start // self.page_size <= node.n_pages, (node, node.mark)
        for node in nodes:
            assert np.array_equal(node.anchor, expect[node.nid]), (node, node.anchor, expect[node.nid])
