"""The window-safe prefix tree.

The tree decides what is a hit and what is evicted; it never touches KV
tensors.  Pages it drops are returned to the pool through ``free_full`` /
``free_swa``.

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

import functools
import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from .._validate import as_int_array, as_token_array
from ..spec import AttnKind
from .divergence import DivergenceModel
from .node import NO_PAGE, TreeNode, window_safe_pages
from .policy import AdaptiveRanking, RetentionPolicy
from .reuse import BUCKETS as _AGE_BUCKETS, EDGES as _AGE_EDGES, INV_WIDTH as _AGE_INV_WIDTH
from .reuse import ReuseModel, next_gap, reuse_class

__all__ = ["TreeConfig", "TreeEvent", "WindowSafeTree", "MatchResult", "LockHandle", "InsertResult",
           "PagePool", "as_token_array"]

_EMPTY = np.zeros(0, dtype=np.int32)
_SCALAR_PINS = 8  # up to this many pages, pins are counted in a Python loop (numpy calls cost more)
_logger = logging.getLogger("hybridkv.radix")


def _keep(part: np.ndarray, owned: bool) -> np.ndarray:
    """``part`` for a node to keep: a copy, unless the caller gave its arrays away and
    the view pins at most twice its own bytes (node arrays are never written in
    place: they are replaced by modified copies)."""
    base = part.base
    if owned and (base is None or base.nbytes <= 2 * part.nbytes):
        return part
    return part.copy()


def _events_after(fn: Callable) -> Callable:
    """Deliver the tree events ``fn`` emits only when it returns (the tree, and the
    pool its freed pages went back to, are consistent again).  Nested calls join
    the outermost batch."""

    @functools.wraps(fn)
    def run(self: "WindowSafeTree", *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if self._event_queue is not None or not self.listeners:
            return fn(self, *args, **kwargs)
        self._event_queue = []
        try:
            return fn(self, *args, **kwargs)
        finally:
            queued, self._event_queue = self._event_queue, None
            for event in queued:
                self._deliver(event)

    return run


RANKINGS = ("value", "adaptive", "arc", "lru")  # TreeConfig.ranking
SWA_EVICTIONS = ("page", "node", "none")  # TreeConfig.swa_eviction


class PagePool(Protocol):
    """What the tree needs from a pool: give pages back."""

    def free_full(self, pages: np.ndarray) -> None: ...

    def free_swa(self, pages: np.ndarray) -> None: ...


@dataclass(frozen=True)
class TreeConfig:
    """Tree policy.

    Attributes:
        page_size: tokens per page (all keys are page aligned).
        window: sliding window W in tokens.
        swa_checkpoint: K; SWA pages in the W tokens before every multiple of
            K are retention checkpoints (evicted last).  0 disables them.
        swa_eviction: ``"page"`` (hybridkv: per-page SWA eviction, cheapest
            SWA first), ``"node"`` (tombstone baseline: a node's SWA goes as a
            whole, plain LRU) or ``"none"`` (naive baseline: SWA lives and
            dies with full KV).
        anchor_branch_points: treat the window before a branch point as a
            checkpoint (shared system prompts end there).
        ranking: which leaf eviction takes: ``"value"`` (default: the
            lowest hit density, returns per tick held, learned online per
            reuse class and idle time by
            :class:`~hybridkv.radix.reuse.ReuseModel`), ``"adaptive"``
            (ARC's RECENT/REUSED segment rule with reuse predicted per
            sequence, :class:`~hybridkv.radix.policy.AdaptiveRanking`),
            ``"arc"`` (the plain segment rule) or ``"lru"``.
    """

    page_size: int
    window: int
    swa_checkpoint: int = 0
    swa_eviction: str = "page"
    anchor_branch_points: bool = True
    ranking: str = "value"

    def __post_init__(self) -> None:
        if self.ranking not in RANKINGS:
            raise ValueError(f"ranking must be one of {RANKINGS}, got {self.ranking!r}")
        for name in ("page_size", "window", "swa_checkpoint"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.swa_checkpoint < 0:
            raise ValueError(f"swa_checkpoint must be >= 0, got {self.swa_checkpoint}")
        if self.swa_eviction not in SWA_EVICTIONS:
            raise ValueError(f"swa_eviction must be one of {SWA_EVICTIONS}, got {self.swa_eviction!r}")

    @property
    def window_pages(self) -> int:
        return -(-self.window // self.page_size)

    @property
    def checkpoint_pages(self) -> int:
        """Checkpoint interval in pages (K rounded up to a page multiple), 0 if off."""
        return -(-self.swa_checkpoint // self.page_size) if self.swa_checkpoint else 0


@dataclass
class MatchResult:
    """Result of :meth:`WindowSafeTree.match`.

    ``length`` is the window-safe hit in tokens; ``raw_length`` the page-aligned
    token match (for statistics: the gap is full KV without a usable window).
    ``full_pages[i]`` / ``swa_pages[i]`` are the pages of ``[0, length)``
    (``swa_pages`` is ``NO_PAGE`` where the tree holds no SWA).  ``node`` is
    the node ending exactly at ``length`` when the match was split, else the
    deepest node the hit touches.
    """

    length: int
    raw_length: int
    full_pages: np.ndarray
    swa_pages: np.ndarray
    node: TreeNode | None


class LockHandle:
    """What :meth:`WindowSafeTree.lock` pinned; give it back to :meth:`unlock`.

    ``node``: the locked node (None: nothing locked).  ``swa_pages``: the
    pinned SWA page ids (int32).  ``ids``: the same as Python ints when the
    tree pinned a window (a few pages; the request path reads them without
    building an array).  ``released``: :meth:`unlock` was called.
    """

    __slots__ = ("node", "_pages", "ids", "released")

    def __init__(self, node: TreeNode | None, swa_pages: np.ndarray | None = None,
                 ids: list[int] | None = None) -> None:
        self.node = node
        self._pages = swa_pages
        self.ids = ids
        self.released = False

    @property
    def swa_pages(self) -> np.ndarray:
        if self._pages is None:
            self._pages = np.array(self.ids, dtype=np.int32) if self.ids else _EMPTY
        return self._pages

    def __repr__(self) -> str:
        return f"LockHandle(node={self.node!r}, swa_pages={self.swa_pages!r}, released={self.released})"


@dataclass
class InsertResult:
    """``node`` ends at the inserted key's end; ``new_pages`` pages were added."""

    node: TreeNode | None
    new_pages: int
    adopted_swa_pages: int


@dataclass(frozen=True)
class TreeEvent:
    """A change of what the tree caches, for listeners (KV-event publishers).

    ``kind``: ``"store"`` (pages added), ``"remove"`` (full KV of the pages
    dropped, SWA with it), ``"swa_store"`` (SWA re-adopted) or
    ``"swa_remove"`` (SWA dropped, full KV kept).  The affected pages are
    ``[start, end)`` in tokens; ``tokens`` holds the whole prefix ``[0, end)``
    so a listener can hash page keys; ``swa_valid`` has one flag per affected
    page as it is *after* the event.
    """

    kind: str
    namespace: str
    start: int
    end: int
    tokens: np.ndarray
    swa_valid: np.ndarray


class WindowSafeTree:
    """Radix tree over page-aligned token keys with dual full/SWA page ids.

    Args:
        config: :class:`TreeConfig`.
        pool: receives freed pages (:class:`PagePool`).
        full_page_bytes / swa_page_bytes: used to weigh byte-budget eviction.
    """

    def __init__(self, config: TreeConfig, pool: PagePool, *, full_page_bytes: int = 1,
                 swa_page_bytes: int = 1) -> None:
        if not isinstance(config, TreeConfig):
            raise TypeError(f"config must be a TreeConfig, got {type(config).__name__}")
        self.config = config
        self.pool = pool
        self.page_size = config.page_size
        self.full_page_bytes = full_page_bytes
        self.swa_page_bytes = swa_page_bytes
        self._roots: dict[str, TreeNode] = {}
        self._tick = 0
        self._pins = np.zeros(1024, dtype=np.int32)  # SWA page id -> pin count
        self.policy = RetentionPolicy(config.page_size, config.window, config.swa_checkpoint,
                                      config.anchor_branch_points)
        self.ranking = AdaptiveRanking(config.ranking)
        self._leaf_heap: list[tuple[int, int, TreeNode]] = []     # leaves of the RECENT segment
        self._reused_heap: list[tuple[int, int, TreeNode]] = []   # leaves of the REUSED segment
        self._dead: list[TreeNode] = []  # leaves left without a held tail window: no hit can end in them
        self._ghost_hits: set[tuple[str, int]] = set()  # (namespace, token pos) where a match hit a ghost
        self._swa_heap: list[tuple[int, int, TreeNode]] = []      # unanchored SWA first
        self._point_heap: list[tuple[int, int, TreeNode]] = []    # then predicted windows
        self._anchor_heap: list[tuple[int, int, TreeNode]] = []   # then tails/checkpoints
        # "value" ranking: leaves filed by reuse class, each list in recency order
        self.value_ranking = config.ranking == "value"
        self.reuse = ReuseModel()
        self.divergence = DivergenceModel()  # learns RetentionPolicy.pretail_pages
        self._by_class: list[OrderedDict[int, TreeNode]] = [OrderedDict() for _ in range(ReuseModel.CLASSES)]
        self._victims: list | None = None  # "value" ranking: candidates ranked in this evict() call
        self._ghost_returns: dict[tuple[str, int], tuple[int, float]] = {}  # (namespace, pos) -> history of a ghost that came back
        # (namespace, pos) -> history of a sequence a request left at pos (diverged): the node
        # that ends at pos after the request's insert is the part that came back
        self._branch_returns: dict[tuple[str, int], tuple[int, float]] = {}
        self.num_nodes = 0
        self.full_pages_cached = 0
        self.swa_pages_cached = 0
        self.protected_full_pages = 0
        self.protected_swa_pages = 0
        self.evicted_full_pages = 0
        self.evicted_swa_pages = 0
        self.listeners: list[Callable[[TreeEvent], None]] = []
        self.listener_errors = 0  # listener exceptions caught (logged; the tree stays consistent)
        self._event_queue: list[TreeEvent] | None = None  # events held until an update completes
        # Called with (kind, int32 page ids) just before the tree gives pages back to
        # ``pool`` (an eviction, a duplicate of an insert): the pages still hold their
        # KV, so a tier below can copy them first.  A hook must not call into the tree.
        self.free_listeners: list[Callable[[AttnKind, np.ndarray], None]] = []
        self._pool_free_full = getattr(pool, "free_full_trusted", None) or pool.free_full
        self._pool_free_swa = getattr(pool, "free_swa_trusted", None) or pool.free_swa

    # Pages the tree frees are its own: a pool may offer unchecked frees for them.
    def _free_full(self, pages: np.ndarray) -> None:
        for hook in self.free_listeners:
            hook(AttnKind.FULL, pages)
        self._pool_free_full(pages)

    def _free_swa(self, pages: np.ndarray) -> None:
        for hook in self.free_listeners:
            hook(AttnKind.SWA, pages)
        self._pool_free_swa(pages)

    def _emit(self, kind: str, node: TreeNode, lo: int = 0, hi: int | None = None) -> None:
        """Tell listeners about ``node``'s pages ``[lo, hi)`` (only built when someone listens).

        Inside an update (:func:`_events_after`) the event is held and delivered
        when the update completes.  A listener that raises is logged and counted
        (``listener_errors``), never propagated."""
        parts = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            parts.append(n.key)
            n = n.parent
        tokens = np.concatenate(parts[::-1]) if parts else _EMPTY
        hi = node.n_pages if hi is None else hi
        end = node.start + hi * self.page_size
        event = TreeEvent(kind, node.namespace, node.start + lo * self.page_size, end, tokens[:end],
                          node.swa[lo:hi] >= 0)
        if self._event_queue is not None:
            self._event_queue.append(event)
        else:
            self._deliver(event)

    def _deliver(self, event: TreeEvent) -> None:
        kind = event.kind
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - a listener must not leave the tree half-updated
                self.listener_errors += 1
                if self.listener_errors & (self.listener_errors - 1) == 0:  # 1st, 2nd, 4th, ... failure
                    _logger.warning("tree event listener %r failed on %s (%s: %s); event dropped for it "
                                    "(%d listener failures so far)", listener, kind, type(exc).__name__, exc,
                                    self.listener_errors)

    # ================================================================ helpers
    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def root(self, namespace: str) -> TreeNode:
        """Root of ``namespace`` (created on first use).  O(1)."""
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        node = self._roots.get(namespace)
        if node is None:
            node = TreeNode(_EMPTY, _EMPTY, _EMPTY, None, 0, namespace, 0)
            node.lock = 1  # roots are never evicted
            self._roots[namespace] = node
        return node

    def namespaces(self) -> list[str]:
        return list(self._roots)

    def _page_key(self, key: np.ndarray, pos: int) -> bytes:
        return key[pos:pos + self.page_size].tobytes()

    def _common_pages(self, node_key: np.ndarray, key: np.ndarray, pos: int, limit: int) -> int:
        """Number of whole pages on which ``node_key`` equals ``key[pos:]`` (<= limit)."""
        m = min(len(node_key), limit - pos)
        b = key[pos:pos + m]
        # memcmp of one copy against the node's buffer (startswith takes any contiguous
        # buffer; both are m tokens): one copy instead of two tobytes, far cheaper than array_equal
        if b.tobytes().startswith(node_key[:m]):
            return m // self.page_size
        return int(np.argmax(node_key[:m] != b)) // self.page_size

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
            if b.tobytes().startswith(ck[:m]):  # see _common_pages
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

    # ================================================================= match
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
        return self.match_tokens(as_token_array(key, "key"), namespace, max_len, split, touch)

    def match_tokens(self, key: np.ndarray, namespace: str, max_len: int | None, split: bool,
               touch: bool) -> MatchResult:
        """:meth:`match` on an already validated key."""
        safe, raw_pages, parts, node = self.match_parts(key, namespace, max_len, split, touch)
        # copies: the caller may write into them, the nodes' arrays are the tree's
        if len(parts) == 1:
            n, take = parts[0]
            full, swa = n.full[:take].copy(), n.swa[:take].copy()
        elif parts:
            full = np.concatenate([n.full[:take] for n, take in parts])
            swa = np.concatenate([n.swa[:take] for n, take in parts])
        else:
            full = swa = _EMPTY
        size = self.page_size
        return MatchResult(safe * size, raw_pages * size, full, swa, node)

    def match_parts(self, key: np.ndarray, namespace: str, max_len: int | None, split: bool,
                     touch: bool) -> tuple[int, int, list[tuple[TreeNode, int]], TreeNode | None]:
        """:meth:`_match` without building the page arrays: ``(safe_pages, raw_pages,
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
        safe = self._safe_pages(path, raw_pages)
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
                ghost = self._ghost_key(namespace, pos, key[pos:pos + size])
                div = self.divergence
                if ghost in div.ghosts:
                    div.ghost_hit(ghost, (len(key) - pos) // size)
                if not self.value_ranking:
                    if self.ranking.on_miss(ghost, self._tick):
                        if len(self._ghost_hits) > 4096:
                            self._ghost_hits.clear()
                        self._ghost_hits.add((namespace, pos))  # its re-insert is proven reuse (ARC)
                else:
                    came_back = self.reuse.on_miss(ghost, self._tick)
                    if came_back is not None:  # the re-inserted sequence keeps its history
                        if len(self._ghost_returns) > 4096:
                            self._ghost_returns.clear()
                        self._ghost_returns[(namespace, pos)] = came_back
            if path:
                last = path[-1][0]
                # a request that diverges inside the leaf brought the sequence back up to
                # ``pos``: the return counts for the leaf's class (its period ends), but the
                # history goes to the node that will end at ``pos`` (the branch point), not
                # to the tail past it (crediting the tail made the ranking worse than LRU on
                # a trace of documents asked several questions)
                returned = self.value_ranking and last.vcls >= 0
                if diverged and self.value_ranking:  # the prefix up to pos came back
                    if len(self._branch_returns) > 4096:
                        self._branch_returns.clear()
                    self._branch_returns[(namespace, pos)] = (
                        last.returns + 1, next_gap(last.gap, self._tick - last.last_access))
                if returned:  # a cached sequence came back: its period ends with a return
                    self.reuse.end(last.vcls, last.since, self._tick, True)
                    self._unfile(last, end=False)
                    if not diverged:
                        last.returns += 1
                        last.gap = next_gap(last.gap, self._tick - last.since)
                now = self._now()
                for n, _ in path:
                    if n.key is not None and n is not unmatched:  # a request does not use what it left
                        self._touch(n, now)
                if node is not None and node is not last:  # touching ``last`` again changes nothing
                    self._touch(node, now)
                if returned and last.key is not None and not last.children:
                    self._file(last)  # a tail the request left: its period restarts at its last use
        return safe, raw_pages, parts, node

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
            leaves = sum(map(len, self._by_class)) if self.value_ranking else self.num_nodes
            self.policy.pretail_pages = self.divergence.decide(leaves, self.policy.window_pages * self.swa_page_bytes)

    def _predict_window(self, leaf: TreeNode) -> None:
        """Anchor the window ending ``policy.pretail_pages`` before new ``leaf``'s end
        (where the learned divergence model expects requests to leave it), if the leaf
        holds that window's SWA.  The window stays inside the leaf: no split, no extra
        node; eviction can trim the leaf back to it like to a checkpoint.  O(window)."""
        d, wp = self.policy.pretail_pages, self.policy.window_pages
        cut = (leaf.mark - leaf.start // self.page_size if leaf.mark >= 0 else len(leaf.full)) - d
        if d < 0 or cut < wp or cut >= len(leaf.full) or int(np.count_nonzero(leaf.swa[cut - wp:cut] >= 0)) < wp:
            return  # (a window at the leaf's end is its tail's, already kept)
        leaf.anchor[cut - wp:cut] += 1
        leaf.points = [leaf.start // self.page_size + cut]
        heapq.heappush(self._point_heap, (leaf.last_access, leaf.nid, leaf))

    def _safe_pages(self, path: list[tuple[TreeNode, int]], total: int) -> int:
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
                return window_safe_pages([n.swa[:k] for n, k in path], self.policy.window_pages)
            need -= take
            i -= 1
        return total

    def _touch(self, node: TreeNode, now: int) -> None:
        # Recency: heap entries are refreshed lazily when popped (see _fresh).  A node
        # used again by a later request moves to the REUSED segment.
        node.last_access = now
        if node.vcls >= 0:
            self._by_class[node.vcls].move_to_end(node.nid)
        if node.seg == AdaptiveRanking.RECENT:
            node.seg = AdaptiveRanking.REUSED
            self.ranking.pages[AdaptiveRanking.RECENT] -= len(node.full)
            self.ranking.pages[AdaptiveRanking.REUSED] += len(node.full)
            if not node.children and node.lock == 0 and not self.value_ranking:
                heapq.heappush(self._reused_heap, (now, node.nid, node))

    def _file(self, node: TreeNode, cls: int | None = None, since: int | None = None) -> None:
        """File leaf ``node`` under its reuse class, most recent last.  A new at-risk
        period starts at its last use, unless ``cls``/``since`` carry on an existing one."""
        if cls is None:
            cls, since = reuse_class(node.returns, node.gap), node.last_access
            self.reuse.start(cls, since)
        node.since = since  # type: ignore[assignment]
        self._by_class[cls][node.nid] = node
        node.vcls = cls

    def _unfile(self, node: TreeNode, end: bool) -> None:
        """Take ``node`` out of the filed leaves; ``end``: its period ends here (no return)."""
        if node.vcls < 0:
            return
        del self._by_class[node.vcls][node.nid]
        if end:
            self.reuse.end(node.vcls, node.since, self._tick, False)
        node.vcls = -1

    @staticmethod
    def _ghost_key(namespace: str, pos: int, page: np.ndarray) -> int:
        """Name of the page at token ``pos`` (a statistic: collisions only mis-steer adaptation)."""
        return hash((namespace, pos, page.tobytes()))

    # ================================================================ anchors
    def _anchor_window(self, node: TreeNode, delta: int, end: int | None = None) -> None:
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

    def _wants_end_anchor(self, node: TreeNode) -> int:
        """1 if a window ending at ``node`` is an anchor: a leaf's tail, or a branch
        point, now or before (``node.branched``).  A point where requests diverged
        once, e.g. the end of a document asked several questions, is where the next
        one diverges too; dropping its window when all but one child are evicted
        made the next question miss the whole document (the window's SWA was freed
        as unanchored before any leaf)."""
        k = len(node.children)
        return int(k == 0 or (self.policy.branch_points and (k > 1 or node.branched)))

    def _reanchor(self, node: TreeNode) -> None:
        """Bring ``node``'s end anchor in line with its children (after they changed).  O(window)."""
        if node.parent is None or node.key is None:
            return
        want = self._wants_end_anchor(node)
        if want != node.ends:
            self._anchor_window(node, want - node.ends)
            node.ends = want

    def _enqueue(self, node: TreeNode, leaf: bool = True, swa: bool = True) -> None:
        """Make sure ``node`` has heap entries after a state change that can make
        it evictable (new leaf, unlocked, lost a child, gained SWA)."""
        entry = (node.last_access, node.nid, node)
        if leaf and not node.children and node.lock == 0 and not self.value_ranking:  # value: filed instead
            heapq.heappush(self._leaf_heap if node.seg == AdaptiveRanking.RECENT else self._reused_heap, entry)
        mode = self.config.swa_eviction
        if swa and node.swa_valid and mode != "none":
            heapq.heappush(self._swa_heap, entry)
            if mode == "page":
                heapq.heappush(self._anchor_heap, entry)
        # lazy heaps collect stale entries; rebuilding at 4x the live nodes keeps
        # memory O(nodes) (the anchor heap was left out and grew without bound)
        limit = self.heap_limit()
        if (len(self._swa_heap) > limit or len(self._anchor_heap) > limit or len(self._point_heap) > limit
                or len(self._leaf_heap) + len(self._reused_heap) > limit):
            self._rebuild_heaps()

    def heap_limit(self) -> int:
        """Entries a lazy heap may hold (stale ones included) before the heaps are
        rebuilt from the live nodes: 4x the nodes + 4096, so their memory is O(nodes)."""
        return 4 * self.num_nodes + 4096

    @staticmethod
    def _fresh(heap: list, t: int, node: TreeNode) -> bool:
        """True if a popped entry is current; a stale one is pushed back with the
        node's current recency (lazy LRU: touching a node costs O(1))."""
        if t == node.last_access:
            return True
        heapq.heappush(heap, (node.last_access, node.nid, node))
        return False

    def _rebuild_heaps(self) -> None:
        leaves, reused, swa, points = [], [], [], []
        for node in self.iter_nodes():
            entry = (node.last_access, node.nid, node)
            if not node.children and node.lock == 0 and not self.value_ranking:  # value: filed instead
                (leaves if node.seg == AdaptiveRanking.RECENT else reused).append(entry)
            if node.swa_valid:
                swa.append(entry)
                if node.points:
                    points.append(entry)
        heapq.heapify(leaves)
        heapq.heapify(reused)
        heapq.heapify(swa)
        heapq.heapify(points)
        self._point_heap = points
        self._leaf_heap = leaves
        self._reused_heap = reused
        self._swa_heap = swa
        self._anchor_heap = list(swa) if self.config.swa_eviction == "page" else []

    # ================================================================= split
    def _split(self, node: TreeNode, pages: int) -> None:
        """Cut ``node`` after ``pages`` pages; the upper half becomes its parent.  O(n)."""
        assert 0 < pages < node.n_pages
        cut = pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:cut], node.full[:pages], node.swa[:pages], parent,
                         node.start, node.namespace, node.last_access)
        upper.lock = node.lock
        upper.seg = node.seg
        upper.anchor = node.anchor[:pages].copy()  # per-page counts: windows stay where they were
        node.anchor = node.anchor[pages:].copy()
        if node.points:  # a predicted window belongs to the half its last page is in
            cut_abs = node.start // self.page_size + pages
            up = [p for p in node.points if p <= cut_abs]
            upper.points = up or None
            node.points = [p for p in node.points if p > cut_abs] or None
            if up:
                heapq.heappush(self._point_heap, (upper.last_access, upper.nid, upper))
        if 0 <= node.mark <= node.start // self.page_size + pages:  # the prompt ended in the upper half
            upper.mark, node.mark = node.mark, -1
        node.key = node.key[cut:]
        node.full = node.full[pages:]
        node.swa = node.swa[pages:]
        node.swa_valid -= upper.swa_valid
        node.start += cut
        parent.children[upper.key[:self.page_size].tobytes()] = upper
        upper.children[node.key[:self.page_size].tobytes()] = node
        node.parent = upper
        self.num_nodes += 1  # a locked node's halves stay locked: protected count unchanged
        self._enqueue(upper, leaf=False)

    # ================================================================ insert
    def insert(self, key: object, full_pages: object, swa_pages: object,
               namespace: str = "default", prompt_len: int | None = None) -> InsertResult:
        """Cache ``key`` with its pages; the tree takes ownership of all of them.

        ``full_pages`` has one id per page of ``key`` (``len(key)`` must be a
        multiple of the page size); ``swa_pages`` likewise with ``NO_PAGE``
        where the caller holds no SWA.  Where the tree already caches a page,
        the caller's duplicate ids are freed; where the tree's SWA was evicted
        and the caller has it, the caller's SWA page is adopted (repair).
        ``prompt_len``: how many tokens of ``key`` were the request's prompt when
        its decoded output follows (None: all of it); the learned divergence
        model measures from the prompt's end (``TreeNode.mark``).

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
        self.root(namespace)  # validates the namespace
        mark = -1
        if prompt_len is not None:
            if not isinstance(prompt_len, (int, np.integer)) or isinstance(prompt_len, bool):
                raise TypeError(f"prompt_len must be an int or None, got {type(prompt_len).__name__}")
            if prompt_len < 0:
                raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
            mark = int(prompt_len) // size
        if n:
            self._check_owned(full, "full_pages", "full")
            self._check_owned(swa[swa >= 0], "swa_pages", "swa")
        return self.insert_tokens(key, full, swa, namespace, mark=mark)

    def _check_owned(self, pages: np.ndarray, name: str, kind: str) -> None:
        """The tree frees what it takes without checks, so a page it is handed must be
        allocated in its pool and listed once (else a later free would corrupt the
        pool).  Checked where the pool can tell (a :class:`DualPool`); O(n)."""
        alloc = getattr(self.pool, kind, None)
        if alloc is None or not hasattr(alloc, "is_allocated") or pages.size == 0:
            return
        if not alloc.is_allocated(pages).all():
            raise ValueError(f"{name} holds ids that are not allocated in the {kind} pool")
        if pages.size > 1 and alloc.has_repeats(pages):
            raise ValueError(f"{name} holds repeated ids")

    @_events_after
    def insert_tokens(self, key: np.ndarray, full: np.ndarray, swa: np.ndarray, namespace: str, *,
                start: TreeNode | None = None, owned: bool = False, mark: int = -1) -> InsertResult:
        """:meth:`insert` for internal callers: no validation.

        ``start``, when given, is an alive node of ``namespace`` whose path spells
        exactly ``key[:start.start + len(start.key)]`` (e.g. the node a request
        locked at :meth:`lock`); the walk begins there instead of at the root.
        The pages before it are the caller's pages the tree already owns: they
        are neither compared nor freed.  ``None`` (or a root) walks from the
        root.  ``owned``: the caller hands the arrays over (a finishing
        request): a new leaf may keep views of them instead of copies.
        ``mark``: the page where the request's prompt ended, when its decoded
        output follows in ``key`` (``TreeNode.mark``; -1: the end of ``key``).
        Runtime complexity: O(depth + pages after start) plus numpy work.
        """
        size = self.page_size
        n = len(key) // size
        root = self._roots.get(namespace) or self.root(namespace)
        now = self._now()
        if start is None or start.parent is None:
            node, pi = root, 0
        else:
            node, pi = start, (start.start + len(start.key)) // size
            up: TreeNode = start
            while up.parent is not None:  # recency as a walk from the root
                self._touch(up, now)
                up = up.parent
        drop_full: list[np.ndarray] = []
        drop_swa: list[np.ndarray] = []
        adopted = 0
        while pi < n:
            child = node.children.get(key[pi * size:(pi + 1) * size].tobytes())
            if child is None:
                break
            k = self._common_pages(child.key, key, pi * size, len(key))
            if k < len(child.full):
                self._split(child, k)
                child = child.parent
            ours_f, ours_s = full[pi:pi + k], swa[pi:pi + k]
            drop_full.append(ours_f[ours_f != child.full])
            have = child.swa >= 0
            mine = ours_s >= 0
            adopt = ~have & mine
            got = int(np.count_nonzero(adopt))  # count_nonzero: a C call, .any()/.sum() go through Python
            if got:
                child.swa = child.swa.copy()
                child.swa[adopt] = ours_s[adopt]
                child.swa_valid += got
                self.swa_pages_cached += got
                adopted += got
                self._enqueue(child, leaf=False)
                if self.listeners:
                    self._emit("swa_store", child)
            drop_swa.append(ours_s[have & mine & (ours_s != child.swa)])
            self._touch(child, now)
            node = child
            pi += k
        new_pages = n - pi
        if new_pages:
            # the next turn of a sequence that proved reuse is predicted reused too
            extends_reused = node is not root and not node.children and node.seg == AdaptiveRanking.REUSED
            leaf = TreeNode(_keep(key[pi * size:], owned), _keep(full[pi:], owned), _keep(swa[pi:], owned),
                            node, pi * size, namespace, now)
            leaf.seg = self.ranking.start_segment(extends_reused)
            if pi < mark < n:
                leaf.mark = mark
            elif mark == pi and node is not root:  # the prompt ended where the new pages start
                node.mark = mark
            node.children[leaf.key[:size].tobytes()] = leaf
            if len(node.children) > 1:
                node.branched = True
            self.num_nodes += 1
            self.full_pages_cached += new_pages
            self.swa_pages_cached += leaf.swa_valid
            if self._ghost_hits and (namespace, pi * size) in self._ghost_hits:
                self._ghost_hits.discard((namespace, pi * size))
                leaf.seg = AdaptiveRanking.REUSED
            self.ranking.pages[leaf.seg] += new_pages
            if self.value_ranking:
                # the next turn of a sequence inherits its history; so does one whose ghost was hit
                if node is not root and len(node.children) == 1:
                    leaf.returns, leaf.gap = node.returns, node.gap
                if self._branch_returns and node is not root:
                    history = self._branch_returns.pop((namespace, pi * size), None)
                    if history is not None and history[0] > node.returns:
                        node.returns, node.gap = history  # the branch point came back
                if self._ghost_returns:
                    history = self._ghost_returns.pop((namespace, pi * size), None)
                    if history is not None and history[0] > leaf.returns:
                        leaf.returns, leaf.gap = history
                cls = node.vcls
                if cls >= 0 and cls == reuse_class(leaf.returns, leaf.gap):
                    # the sequence's period (restarted by this request's match) moves on to its new tail
                    since = node.since
                    self._unfile(node, end=False)
                    self._file(leaf, cls, since)
                else:
                    self._unfile(node, end=True)
                    self._file(leaf)
            for a, b in self.policy.checkpoint_windows(pi, n):  # the new leaf's counts are all 0
                leaf.anchor[a - pi:b - pi] = 1
            self._reanchor(node)
            self._anchor_window(leaf, 1)  # _reanchor(leaf), inlined: a fresh leaf's tail is an anchor
            leaf.ends = 1
            self._enqueue(leaf)
            if node is not root:
                self._enqueue(node, leaf=False)  # its tail is no longer a leaf tail
            if self.policy.pretail_pages >= 0 and not 0 <= mark <= pi:  # (not a leaf of output only)
                self._predict_window(leaf)
            node = leaf
            if self.listeners:
                self._emit("store", leaf)
        if drop_full:
            self._free_full(drop_full[0] if len(drop_full) == 1 else np.concatenate(drop_full))
        if drop_swa:
            self._free_swa(drop_swa[0] if len(drop_swa) == 1 else np.concatenate(drop_swa))
        return InsertResult(node if node is not root else None, new_pages, adopted)

    # ================================================================= locks
    def lock(self, node: TreeNode | None) -> LockHandle:
        """Protect the path to ``node`` (full KV) and the SWA window ending at it.

        The window pages must hold SWA (true for a node returned by a split
        :meth:`match`).  Runtime complexity: O(depth).
        """
        if node is None or node.parent is None:
            return LockHandle(None)
        if not node.alive:
            raise ValueError("node was evicted; match again before locking")
        ids = self._window_ids(node)
        if ids and min(ids) < 0:
            raise ValueError("the SWA window ending at node is not held (not window safe)")
        n: TreeNode = node
        protected = 0
        while n.parent is not None:
            if n.lock == 0:
                protected += len(n.full)
            n.lock += 1
            n = n.parent
        self.protected_full_pages += protected
        self._pin_ids(ids, +1)
        return LockHandle(node, None, ids)

    def unlock(self, handle: LockHandle) -> None:
        """Undo :meth:`lock`.  O(depth).  Raises ValueError on a second release."""
        if not isinstance(handle, LockHandle):
            raise TypeError(f"handle must be a LockHandle, got {type(handle).__name__}")
        if handle.released:
            raise ValueError("lock handle already released")
        handle.released = True
        node = handle.node
        if node is None:
            return
        ids = handle.ids
        if ids is not None:
            self._pin_ids(ids, -1)
        else:
            pages = handle.swa_pages
            if pages.size <= _SCALAR_PINS:
                self._pin_ids(pages.tolist(), -1)
            else:
                self.pin_swa(pages, -1)
        window = self.policy.window_pages
        n: TreeNode = node
        while n.parent is not None:
            n.lock -= 1
            assert n.lock >= 0
            if n.lock == 0:
                self.protected_full_pages -= len(n.full)
            # pins were released on the window nodes: their SWA may be evictable now;
            # a still-locked inner node above the window has nothing to enqueue
            leafish = n.lock == 0 and not n.children
            if leafish or (window > 0 and n.swa_valid):
                self._enqueue(n, leaf=leafish, swa=window > 0)
            window -= len(n.full)
            n = n.parent

    def lock_path(self, node: TreeNode | None, swa_pages: np.ndarray) -> LockHandle:
        """Lock the path to ``node`` (full KV) and pin ``swa_pages`` (int32 SWA ids
        the caller relies on), without :meth:`lock`'s requirement that the window
        ending at ``node`` is held: a tier loading the missing window into L1 holds
        what it has while it allocates.  Undo with :meth:`unlock`.  O(depth + pages)."""
        if node is None:
            return LockHandle(None)
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            if n.lock == 0:
                self.protected_full_pages += n.n_pages
            n.lock += 1
            n = n.parent
        pages = np.asarray(swa_pages, dtype=np.int32)
        self.pin_swa(pages, +1)
        return LockHandle(node, pages)

    def heap_sizes(self) -> dict[str, int]:
        """Entries of each eviction heap (stale ones included: heaps are cleaned
        lazily, see :meth:`heap_limit`), for memory figures and soak tests."""
        return {"leaf": len(self._leaf_heap), "reused": len(self._reused_heap), "swa": len(self._swa_heap),
                "point": len(self._point_heap), "anchor": len(self._anchor_heap), "dead": len(self._dead)}

    def _window_ids(self, node: TreeNode) -> list[int]:
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

    def _window_pages(self, node: TreeNode) -> np.ndarray:
        """SWA page ids of the last ``window_pages`` pages ending at ``node``."""
        ids = self._window_ids(node)
        return np.array(ids, dtype=np.int32) if ids else _EMPTY

    def _window_held(self, node: TreeNode) -> bool:
        """True if every page of the window ending at ``node`` holds SWA."""
        ids = self._window_ids(node)
        return not ids or min(ids) >= 0

    def _pin_ids(self, ids: list[int], delta: int) -> None:
        """:meth:`_pin` for a window's worth of page ids (Python ints, distinct)."""
        if not ids:
            return
        pins = self._pins
        if max(ids) >= pins.size:
            self._grow_pins(max(ids) + 1)
            pins = self._pins
        changed = 0  # pages whose count leaves or reaches 0
        for p in ids:
            before = pins.item(p)
            after = before + delta
            assert after >= 0
            pins[p] = after
            if before == 0 or after == 0:
                changed += 1
        self.protected_swa_pages += changed if delta > 0 else -changed

    def _grow_pins(self, top: int) -> None:
        grown = np.zeros(max(top, 2 * self._pins.size), dtype=np.int32)
        grown[:self._pins.size] = self._pins
        self._pins = grown

    def pin_swa(self, pages: np.ndarray, delta: int) -> None:
        if pages.size == 0:
            return
        top = int(pages.max()) + 1
        if top > self._pins.size:
            self._grow_pins(top)
        before = self._pins[pages]
        after = before + delta
        assert (after >= 0).all()
        self._pins[pages] = after
        if delta > 0:
            self.protected_swa_pages += int(np.count_nonzero(before == 0))
        else:
            self.protected_swa_pages -= int(np.count_nonzero(after == 0))

    def _pinned(self, pages: np.ndarray) -> np.ndarray:
        out = np.zeros(pages.shape, dtype=bool)
        ok = (pages >= 0) & (pages < self._pins.size)
        out[ok] = self._pins[pages[ok].astype(np.intp)] > 0  # intp indices: ~4x faster than int32
        return out

    # ============================================================== eviction
    def evictable_full_pages(self) -> int:
        return self.full_pages_cached - self.protected_full_pages

    def evictable_swa_pages(self) -> int:
        return self.swa_pages_cached - self.protected_swa_pages

    @_events_after
    def evict(self, full_pages: int = 0, swa_pages: int = 0, nbytes: int = 0) -> tuple[int, int]:
        """Free at least ``full_pages`` full pages, ``swa_pages`` SWA pages and
        ``nbytes`` bytes (weighted by page bytes), as far as unlocked data allows.

        Order: SWA that ends no likely hit (no anchor covers it), LRU first;
        then leaves, chosen by :class:`~hybridkv.radix.policy.AdaptiveRanking`
        and *trimmed* back to their last hittable window when that frees
        enough (else removed whole); then the divergence model's predicted
        windows, LRU first; then anchored SWA (tails, checkpoints, branch
        windows).  When only SWA is short (a SWA pool sized on its own), the
        predicted windows and then anchored SWA go before leaves.  When SWA cannot be
        evicted on its own (``swa_eviction="none"``/``"node"`` with pins),
        leaves are evicted for it.  Locked full KV and pinned SWA are never
        touched.  Returns the pages freed ``(full, swa)``.
        Runtime: O(k log n) for k nodes visited.
        """
        for name, value in (("full_pages", full_pages), ("swa_pages", swa_pages), ("nbytes", nbytes)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self._victims = None
        try:
            return self._evict(full_pages, swa_pages, nbytes)
        finally:
            self._victims = None

    def _evict(self, full_pages: int, swa_pages: int, nbytes: int) -> tuple[int, int]:
        freed_f: list[np.ndarray] = []
        freed_s: list[np.ndarray] = []
        nf = ns = 0
        fb, sb = self.full_page_bytes, self.swa_page_bytes
        while True:
            short_full = full_pages - nf
            short_swa = swa_pages - ns
            short_bytes = nbytes - (nf * fb + ns * sb)
            if short_full <= 0 and short_swa <= 0 and short_bytes <= 0:
                break
            got = (0, 0)
            if short_full > 0:
                got = self._evict_leaf(freed_f, freed_s, short_full)
            elif short_swa > 0:
                got = self._evict_swa(freed_s, anchored=False)
                if got == (0, 0):
                    got = self._evict_point(freed_s)
                if got == (0, 0):
                    got = self._evict_swa(freed_s, anchored=True)
                if got == (0, 0):
                    got = self._evict_leaf(freed_f, freed_s, None)
            else:
                got = self._evict_swa(freed_s, anchored=False)
                if got == (0, 0):
                    got = self._evict_leaf(freed_f, freed_s, -(-short_bytes // fb))
                if got == (0, 0):
                    got = self._evict_point(freed_s)
                if got == (0, 0):
                    got = self._evict_swa(freed_s, anchored=True)
            if got == (0, 0):
                break
            nf += got[0]
            ns += got[1]
        if freed_f:
            self._free_full(np.concatenate(freed_f))
        if freed_s:
            self._free_swa(np.concatenate(freed_s))
        self.evicted_full_pages += nf
        self.evicted_swa_pages += ns
        return nf, ns

    def _pop_leaf(self) -> TreeNode | None:
        """The next evictable leaf: a dead one first (its pages serve no hit), then
        the least recently used leaf of the segment the ranking names (``"lru"``:
        the least recently used leaf of both)."""
        dead = self._dead
        while dead:
            node = dead.pop()
            if node.key is not None and not node.children and not node.lock and node.parent is not None:
                return node
        if self.value_ranking:
            return self._pick_by_value()
        recent = self._heap_top(self._leaf_heap, AdaptiveRanking.RECENT)
        reused = self._heap_top(self._reused_heap, AdaptiveRanking.REUSED)
        if recent is None or reused is None:
            pick = recent or reused
            if pick is None:
                return None
        else:
            if self.config.ranking == "lru":
                pick = recent if (recent.last_access, recent.nid) < (reused.last_access, reused.nid) else reused
            else:
                seg = self.ranking.evict_from(True, True)
                pick = recent if seg == AdaptiveRanking.RECENT else reused
        heapq.heappop(self._leaf_heap if pick.seg == AdaptiveRanking.RECENT else self._reused_heap)
        return pick

    def _pick_by_value(self, per_end: int = 4, max_skip: int = 64) -> TreeNode | None:
        """The leaf least likely to pay back the memory it holds: the lowest hit
        density (:meth:`ReuseModel.density <hybridkv.radix.reuse.ReuseModel.density>`:
        returns per tick held, learned per reuse class and idle time) among the
        ``per_end`` oldest and newest unlocked leaves of each class.  A return
        hazard that rises and then falls with idle time (a chat's think time) is
        lowest at one end of a class's recency order, so the ends are the
        candidates.  Ties (nothing learned yet, same density) go to the least
        recently used.  Within one :meth:`evict` call time stands still, so the
        ranked candidates are kept and served in order until they run out.
        O(classes x per_end) per ranking."""
        ranked = self._victims
        if ranked:
            while ranked:
                node = ranked[-1][3]
                if node.key is not None and not node.children and not node.lock and node.vcls >= 0:
                    return node
                ranked.pop()
        tables, now, top = self.reuse.tables(), self._tick, _AGE_BUCKETS
        edges, inv_width = _AGE_EDGES, _AGE_INV_WIDTH
        ranked = []
        for cls, filed in enumerate(self._by_class):
            if not filed:
                continue
            index = tables[cls]
            for oldest_first in (True, False):
                taken = skipped = 0
                for node in (iter(filed.values()) if oldest_first else reversed(filed.values())):
                    if node.lock:
                        skipped += 1
                        if skipped > max_skip:
                            break
                        continue
                    age = now - node.since
                    if age < 2:
                        b = age if age > 0 else 0
                    else:  # reuse.age_bucket, inlined: this loop is the eviction hot path
                        k = age.bit_length() - 1
                        b = 2 * k + ((age >> (k - 1)) & 1)
                        if b >= top:
                            b = top - 1
                    d = index[b] + (index[b + 1] - index[b]) * (age - edges[b]) * inv_width[b]
                    ranked.append((d, node.last_access, node.nid, node))
                    taken += 1
                    if taken >= per_end:
                        break
        if not ranked:
            return None
        ranked.sort(reverse=True)  # best victim last; a leaf at both ends of a class is listed twice
        self._victims = ranked
        return ranked[-1][3]

    def _heap_top(self, heap: list, seg: int) -> TreeNode | None:
        """The current top of a lazy leaf heap (stale entries dropped or refreshed)."""
        while heap:
            t, _, node = heap[0]
            if node.key is None or node.children or node.lock or node.parent is None or node.seg != seg:
                heapq.heappop(heap)
            elif t != node.last_access:
                heapq.heapreplace(heap, (node.last_access, node.nid, node))
            else:
                return node
        return None

    def _trim_point(self, node: TreeNode, want: int | None) -> int:
        """Pages of leaf ``node`` to keep: the longest prefix that frees >= ``want``
        pages and still ends at a held SWA window (a hit can end there); 0 = none."""
        wp = self.policy.window_pages
        n = len(node.full)
        if want is None or want >= n or n <= wp:
            return 0
        valid = (node.swa >= 0).astype(np.int32)
        c = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(valid, out=c[1:])
        q = np.arange(wp, n - want + 1)
        good = q[c[q] - c[q - wp] == wp]
        return int(good[-1]) if good.size else 0

    def _evict_leaf(self, freed_f: list, freed_s: list, want: int | None) -> tuple[int, int]:
        node = self._pop_leaf()
        if node is None:
            return 0, 0
        if want is not None and not self._window_held(node):
            want = 1  # dead: keep what still ends at a held window, free the rest
        keep = self._trim_point(node, want)
        size = self.page_size
        parent = node.parent
        assert parent is not None
        if node.ends:
            self._anchor_window(node, -1)
            node.ends = 0
        if node.points:  # predicted windows past what stays go with the pages
            first = node.start // size
            for p in node.points:
                if p > first + keep:
                    self._anchor_window(node, -1, p - first)
            node.points = [p for p in node.points if p <= first + keep] or None
        if node.mark >= node.start // size + keep:  # the prompt's end went with the pages
            node.mark = -1
        gone_full = node.full[keep:]
        swa = node.swa[keep:]
        swa = swa[swa >= 0]
        freed_f.append(gone_full)
        if swa.size:
            freed_s.append(swa)
        gone = len(node.full) - keep
        self.full_pages_cached -= gone
        self.swa_pages_cached -= int(swa.size)
        self.ranking.pages[node.seg] -= gone
        pos = node.start + keep * size
        ghost = self._ghost_key(node.namespace, pos, node.key[keep * size:(keep + 1) * size])
        if self.policy.branch_points:  # what the last bytes evicted would have hit: the margin
            self.divergence.evicted(ghost, gone * self.full_page_bytes + int(swa.size) * self.swa_page_bytes,
                                    gone, 4 * self.num_nodes + 1024)
        if not self.value_ranking:  # ARC's ghost lists steer only the segment rule
            self.ranking.remember(node.seg, ghost, gone)
        if self.listeners:
            self._emit("remove", node, keep)
        if keep:  # trimmed: still a leaf, its tail window now ends at the new end
            node.key = node.key[:keep * size]
            node.full = node.full[:keep]
            node.swa = node.swa[:keep]
            node.anchor = node.anchor[:keep].copy()
            node.swa_valid -= int(swa.size)
            self._reanchor(node)
            self._enqueue(node, swa=False)
            return gone, int(swa.size)
        del parent.children[node.key[:size].tobytes()]
        self.num_nodes -= 1
        if self.value_ranking:
            cls, since = node.vcls, node.since
            self._unfile(node, end=False)
            if parent.parent is not None and not parent.children:
                if parent.returns > node.returns:
                    # requests branched off the parent: it came back on its own account
                    if cls >= 0:
                        self.reuse.end(cls, since, self._tick, False)
                    self._file(parent)
                else:
                    # the parent is the same sequence, shorter: it carries the period on
                    parent.returns, parent.gap = node.returns, node.gap
                    if cls >= 0:
                        self._file(parent, cls, since)
                    else:
                        self._file(parent)
            elif cls >= 0:  # watch for the sequence's return where its pages started
                # ghosts in proportion to what is cached (a few turnovers' worth of leaves)
                self.reuse.max_ghosts = 4 * self.num_nodes + 1024
                self.reuse.remember(ghost, cls, since, self._tick, (node.returns, node.gap))
        node.key = None  # type: ignore[assignment]
        node.parent = None
        if parent.parent is not None:
            self._reanchor(parent)
            self._enqueue(parent)  # may be a leaf now; its tail became a leaf tail
            if not parent.children and not parent.lock and not self._window_held(parent):
                self._dead.append(parent)
        return gone, int(swa.size)

    def _evict_swa(self, freed_s: list, anchored: bool) -> tuple[int, int]:
        """Free the SWA of the least recently used node holding some: its unanchored
        unpinned pages, or (``anchored``) all its unpinned pages.  Returns ``(0, freed)``."""
        mode = self.config.swa_eviction
        if mode == "none" or (anchored and mode != "page"):
            return 0, 0
        heap = self._anchor_heap if anchored else self._swa_heap
        while heap:
            t, _, node = heapq.heappop(heap)
            if node.key is None or not node.swa_valid or not self._fresh(heap, t, node):
                continue
            count = self._drop_swa(node, freed_s, anchored)
            if count:
                return 0, count
        return 0, 0

    def _evict_point(self, freed_s: list) -> tuple[int, int]:
        """Predicted windows give way before tails, checkpoints and branch windows (a
        bet on where requests will leave, while those end hits that happened): the
        least recently used node's predicted windows stop being anchors and their SWA
        that no other window anchors is freed.  Where the SWA pool is sized apart
        from full KV for one window per cached sequence, a predicted window kept over
        another sequence's tail cost that sequence its next hit.  Mutates the node's
        anchors, points and SWA.  Returns ``(0, freed)``.  O(window + log n)."""
        if self.config.swa_eviction != "page":
            return 0, 0
        heap = self._point_heap
        while heap:
            t, _, node = heapq.heappop(heap)
            if node.key is None or not node.points or not self._fresh(heap, t, node):
                continue
            first, wp = node.start // self.page_size, self.policy.window_pages
            above = False  # a window reaching above the node (cut by a split)
            for p in node.points:
                self._anchor_window(node, -1, p - first)
                above = above or p - first < wp
            node.points = None
            if above and node.parent is not None and node.parent.key is not None:
                self._enqueue(node.parent, leaf=False)  # its SWA there is plain SWA now
            count = self._drop_swa(node, freed_s, anchored=False) if node.swa_valid else 0
            if node.swa_valid:
                self._enqueue(node, leaf=False)
            if count:
                return 0, count
        return 0, 0

    def _drop_swa(self, node: TreeNode, freed_s: list, anchored: bool) -> int:
        """Free ``node``'s unpinned SWA pages (only unanchored ones unless ``anchored``;
        ``"node"`` eviction: all or none) into ``freed_s``.  Returns how many."""
        drop = node.swa >= 0
        # only a locked node can hold pinned pages (a tree invariant): skip the lookup otherwise
        pinned = self._pinned(node.swa) if node.lock else None
        if self.config.swa_eviction == "node":
            if pinned is not None and np.count_nonzero(pinned):
                return 0
        else:
            if pinned is not None:
                drop &= ~pinned
            if not anchored:
                drop &= node.anchor == 0
        count = int(np.count_nonzero(drop))
        if count == 0:
            return 0
        freed_s.append(node.swa[drop])
        node.swa = node.swa.copy()
        node.swa[drop] = NO_PAGE
        node.swa_valid -= count
        self.swa_pages_cached -= count
        if self.listeners:
            self._emit("swa_remove", node)
        return count

    def anchored(self, node: TreeNode) -> np.ndarray:
        """bool per page of ``node``: its SWA ends a likely hit (anchor count > 0).  O(pages)."""
        return node.anchor > 0

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

    def _check_anchors(self) -> None:
        """Anchor counts equal checkpoints + one window per tail / branch point; segment sizes."""
        expect: dict[int, np.ndarray] = {}
        nodes = list(self.iter_nodes())
        pages = {AdaptiveRanking.RECENT: 0, AdaptiveRanking.REUSED: 0}
        for node in nodes:
            lo = node.start // self.page_size
            expect[node.nid] = self.policy.checkpoint_mask(lo, lo + node.n_pages).astype(np.int32)
            pages[node.seg] += node.n_pages
        def window(node: TreeNode, k: int) -> None:  # expect the window ending k pages into node
            need, n = self.policy.window_pages, node
            while need > 0 and n is not None and n.parent is not None:
                take = min(need, k)
                expect[n.nid][k - take:k] += 1
                need -= take
                n = n.parent
                k = n.n_pages if n is not None else 0

        for node in nodes:
            want = self._wants_end_anchor(node)
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
        assert pages == self.ranking.pages, (pages, self.ranking.pages)
        if self.value_ranking:  # every leaf is filed once, under its class; one open period each
            leaves = {n.nid for n in nodes if not n.children}
            filed = {nid for cls, f in enumerate(self._by_class) for nid, n in f.items() if n.vcls == cls}
            assert leaves == filed and sum(map(len, self._by_class)) == len(filed), (leaves ^ filed)
            assert self.reuse.open_periods() == len(filed) + self.reuse.ghost_count()

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
                    assert child.start == node.start + (len(node.key) if node.parent is not None else 0)
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
                    assert not self._pinned(node.swa).any(), f"pinned SWA in unlocked {node}"
                full_seen.append(node.full)
                swa_seen.append(node.swa[valid])
        assert n_nodes == self.num_nodes, (n_nodes, self.num_nodes)
        self._check_anchors()
        assert swa_valid == self.swa_pages_cached
        assert prot_full == self.protected_full_pages, (prot_full, self.protected_full_pages)
        full = np.concatenate(full_seen) if full_seen else _EMPTY
        swa = np.concatenate(swa_seen) if swa_seen else _EMPTY
        assert full.size == self.full_pages_cached
        assert np.unique(full).size == full.size, "a full page is cached twice"
        assert np.unique(swa).size == swa.size, "a SWA page is cached twice"
        pinned_total = int(np.count_nonzero(self._pins))
        assert pinned_total == self.protected_swa_pages, (pinned_total, self.protected_swa_pages)
        if pinned_total:
            pinned_ids = np.flatnonzero(self._pins)
            assert np.isin(pinned_ids, swa).all(), "a pinned SWA page is not held by the tree"


