"""What the prefix index learns from matches, fed after each match is answered.

:meth:`MatchLearning.observe_match` runs once per touching match, after the
hit is computed: the :class:`~hybridkv.radix.divergence.DivergenceModel` hears
where the request left a cached sequence (it sets
``RetentionPolicy.pretail_pages``, where predicted windows go) and whether it
hit the ghost of an evicted leaf; the ranking (:mod:`~hybridkv.radix.rankings`)
hears misses at ghosts and returns of cached sequences; the path's recency is
refreshed.  Order: divergence, ranking (before the recency refresh), recency,
ranking (after).

:class:`MatchLearning` is a collaborator of
:class:`~hybridkv.radix.tree.WindowSafeTree`: the tree calls it with the walk
of each touching match and with the leaves eviction cuts (:func:`ghost_key`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .divergence import DivergenceModel
from .node import TreeNode
from .policy import RetentionPolicy
from .rankings import Ranking

__all__ = ["MatchLearning", "ghost_key"]


def ghost_key(namespace: str, pos: int, page: np.ndarray) -> int:
    """Name of the page at token ``pos`` (a statistic: collisions only mis-steer adaptation).  O(page)."""
    return hash((namespace, pos, page.tobytes()))


class MatchLearning:
    """What matches teach the divergence model and the ranking.

    Args:
        policy: the tree's retention policy (its ``pretail_pages`` is set here).
        divergence: the :class:`DivergenceModel` it feeds.
        ranking: the tree's leaf ranking (hears misses at ghosts and returns).
        page_size / swa_page_bytes: the tree's page geometry.
        now: advances the tree's clock and returns the new tick (recency).
        node_count: the tree's current number of nodes.
    """

    def __init__(self, policy: RetentionPolicy, divergence: DivergenceModel, ranking: Ranking, page_size: int,
                 swa_page_bytes: int, now: Callable[[], int], node_count: Callable[[], int]) -> None:
        self.policy = policy
        self.divergence = divergence
        self.ranking = ranking
        self.page_size = page_size
        self.swa_page_bytes = swa_page_bytes
        self.now = now
        self.node_count = node_count

    def observe_match(self, key: np.ndarray, namespace: str, path: list[tuple[TreeNode, int]], safe: int,
                       raw_pages: int, limit: int, diverged: bool, node: TreeNode | None,
                       unmatched: TreeNode | None) -> None:
        """What a touching match tells the learners, after the index answered it: the
        divergence model (where requests leave sequences, ghosts of evicted leaves),
        the ranking (misses at ghosts, returns of cached sequences) and the path's
        recency.  ``path``: the walk's ``[(node, pages matched)]``; ``safe`` /
        ``raw_pages``: the hit and the token match in pages; ``limit``: the tokens the
        match could reach; ``diverged``: the request leaves the sequence inside the
        last node; ``node``: the hit's node; ``unmatched``: the lower half of a split
        the request did not reach into (not touched).  O(path)."""
        size = self.page_size
        self.divergence.hit_pages += safe
        if path and raw_pages * size < limit:
            end_node, took = path[-1]
            # the request left inside a node, or at the end of one with one child
            # (most requests extend a leaf or leave at a branch point: no call)
            if (took < len(end_node.full) or len(end_node.children) == 1) and self.policy.branch_points:
                self._observe_divergence(end_node, took, raw_pages)
        elif path and self.policy.branch_points and path[-1][0].mark >= 0:
            # the request ends at (or a page before) a prompt end whose decoded output
            # was cached behind it: an exact repeat of that prompt (a retry, a
            # regenerated reply)
            end_node, took = path[-1]
            if end_node.mark >= end_node.start // size + took:
                self._observe_divergence(end_node, took, raw_pages)
        pos = raw_pages * size
        if pos + size <= len(key):  # did a ghost of an evicted leaf start here?
            ghost = ghost_key(namespace, pos, key[pos:pos + size])
            div = self.divergence
            if ghost in div.ghosts:
                div.ghost_hit(ghost, (len(key) - pos) // size)
            self.ranking.missed(namespace, pos, ghost)
        if path:
            last = path[-1][0]
            token = self.ranking.matched_before_touch(last, namespace, pos, diverged=diverged)
            now = self.now()
            touch = self.ranking.touch
            for n, _ in path:
                if n.key is not None and n is not unmatched:  # a request does not use what it left
                    touch(n, now)
            if node is not None and node is not last:  # touching ``last`` again changes nothing
                touch(node, now)
            self.ranking.matched_after_touch(last, token)

    def _observe_divergence(self, node: TreeNode, took: int, raw_pages: int) -> None:
        """A request's match stopped ``took`` pages into ``node`` and the request goes on:
        if that is inside a chain of single-child nodes ending in a leaf, tell the
        :class:`DivergenceModel` how far before the leaf's end it left, and what a
        window there would add over a checkpoint.  O(chain length)."""
        dist = len(node.full) - took
        if dist == 0 and node.branched:
            return  # it left at a proven branch point: the branch-point rule serves it
        # measured to the first prompt end at or after the divergence whose decoded output
        # was cached behind it (TreeNode.mark), else to the leaf's end
        pos = node.start // self.page_size + took
        if node.mark >= pos:
            dist = node.mark - pos
        else:
            if node.mark >= 0:
                return  # the request reaches into the output: it extends the sequence
            n = node
            while True:
                if not n.children:
                    if dist <= 0:
                        return  # the request extends a leaf: its tail window serves it
                    break
                if len(n.children) > 1:
                    return  # the sequences part below: no one end to measure from
                n = next(iter(n.children.values()))
                if n.mark >= 0:
                    dist += n.mark - n.start // self.page_size
                    break
                dist += len(n.full)
        kp = self.policy.checkpoint_pages
        base = (raw_pages // kp) * kp if kp else 0
        if self.divergence.observe(dist, raw_pages - base):
            leaves = self.ranking.leaves_hint(self.node_count())
            self.policy.pretail_pages = self.divergence.decide(leaves, self.policy.window_pages * self.swa_page_bytes)
