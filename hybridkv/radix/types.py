"""The prefix index's vocabulary: its configuration, what its calls return, its events.

Kept apart from :mod:`hybridkv.radix.tree` so the index, its retention rules
(:mod:`~hybridkv.radix.retention`), eviction (:mod:`~hybridkv.radix.evict`)
and the rankings (:mod:`~hybridkv.radix.rankings`) share them without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from .._validate import check_int
from ..modes import EvictionRanking, SwaEviction
from ..spec import window_pages
from .node import EMPTY, TreeNode, unrecorded

__all__ = ["TreeConfig", "TreeEvent", "MatchResult", "LockHandle", "InsertResult", "PageNames", "FreedPages",
           "node_names", "join_names", "parent_keys", "unnamed", "PagePool", "SideGroup",
           "OneWindowPool", "pool_lacks", "RANKINGS", "SWA_EVICTIONS", "EMPTY", "EvictionRanking", "SwaEviction"]



RANKINGS = tuple(m.value for m in EvictionRanking)  # TreeConfig.ranking, as strings
SWA_EVICTIONS = tuple(m.value for m in SwaEviction)  # TreeConfig.swa_eviction, as strings


class SideGroup(Protocol):
    """A sliding-window group beside the lead one (a several-window model).  Its
    page of a sequence shares the lead's row of blocks, so its page id is the
    lead's SWA page id where it holds one; tree nodes and requests keep those ids
    per group (``TreeNode.side``), the pool keeps the group's storage."""

    @property
    def window_pages(self) -> int:
        """Its window, in pages."""
        ...

    @property
    def page_bytes(self) -> int:
        """Bytes one of its pages costs."""
        ...

    def holds(self, pages: np.ndarray) -> np.ndarray:
        """Bool per lead SWA page id: this group still holds its page there."""
        ...


class PagePool(Protocol):
    """A host's pages, as the core sees them: every call the tree and
    :mod:`hybridkv.lifecycle` make on a pool.  Implemented by
    :class:`~hybridkv.pools.DualPool` (hybridkv's own pages), vLLM's block pool
    adapter and SGLang's allocator adapter; a host with one sliding window has
    no ``groups`` and answers the group calls trivially."""

    @property
    def groups(self) -> tuple[SideGroup, ...]:
        """The sliding groups beside the lead one (``()``: one window)."""
        ...

    def free_full_trusted(self, pages: np.ndarray) -> None:
        """Take back int32 full ``pages`` the core held (each once; no checks needed)."""
        ...

    def free_swa_trusted(self, pages: np.ndarray) -> None:
        """Take back int32 lead SWA ``pages`` the core held (each once), with
        whatever the side groups hold under those ids."""
        ...

    def check_taken(self, kind: str, pages: np.ndarray, name: str) -> None:
        """Raise ValueError naming ``name`` unless every one of ``pages`` (of
        ``kind``, ``"full"`` or ``"swa"``) is allocated and listed once; the
        tree calls it before it takes pages from a public ``insert``."""
        ...


class OneWindowPool:
    """:class:`PagePool` for a host with one sliding window (no side groups),
    and no ownership check: a host pool that keeps its own
    references (vLLM's block pool, SGLang's allocator) subclasses it and
    implements ``free_full_trusted`` / ``free_swa_trusted``."""

    groups: tuple[SideGroup, ...] = ()

    def free_full_trusted(self, pages: np.ndarray) -> None:
        raise NotImplementedError

    def free_swa_trusted(self, pages: np.ndarray) -> None:
        raise NotImplementedError

    def check_taken(self, kind: str, pages: np.ndarray, name: str) -> None:
        """The host's allocator owns the check (its references); nothing here."""


#: the members of :class:`PagePool`, in its order
POOL_MEMBERS = ("groups", "free_full_trusted", "free_swa_trusted", "check_taken")


def pool_lacks(pool: object) -> list[str]:
    """The :class:`PagePool` members ``pool`` does not have (``[]``: complete)."""
    return [n for n in POOL_MEMBERS if not hasattr(pool, n)]


@dataclass(frozen=True)
class TreeConfig:
    """Tree policy.

    Attributes:
        page_size: tokens per page (all keys are page aligned).
        window: sliding window W in tokens.
        swa_checkpoint: K; SWA pages in the W tokens before every multiple of
            K are retention checkpoints (evicted last).  0 disables them.
        swa_eviction: a :class:`~hybridkv.modes.SwaEviction` (or its string):
            ``"page"`` (hybridkv: per-page SWA eviction, cheapest SWA first),
            ``"node"`` (tombstone baseline: a node's SWA goes as a whole, plain
            LRU) or ``"none"`` (naive baseline: SWA lives and dies with full KV).
        anchor_branch_points: treat the window before a branch point as a
            checkpoint (shared system prompts end there).
        ranking: which leaf eviction takes, a
            :class:`~hybridkv.modes.EvictionRanking` (or its string): ``"value"`` (default: the
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
    swa_eviction: SwaEviction = SwaEviction.PAGE
    anchor_branch_points: bool = field(default=True, kw_only=True)
    ranking: EvictionRanking = EvictionRanking.VALUE

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranking", EvictionRanking.parse(self.ranking, "ranking"))
        for name in ("page_size", "window", "swa_checkpoint"):
            object.__setattr__(self, name, check_int(getattr(self, name), name))
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.swa_checkpoint < 0:
            raise ValueError(f"swa_checkpoint must be >= 0, got {self.swa_checkpoint}")
        object.__setattr__(self, "swa_eviction", SwaEviction.parse(self.swa_eviction, "swa_eviction"))

    @property
    def window_pages(self) -> int:
        return window_pages(self.window, self.page_size)

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
    deepest node the hit touches.  ``side_pages``: with several sliding groups,
    each side group's page ids of ``[0, length)`` (``NO_PAGE`` where it holds
    none); None with one window.
    """

    length: int
    raw_length: int
    full_pages: np.ndarray
    swa_pages: np.ndarray
    node: TreeNode | None
    side_pages: list[np.ndarray] | None = None


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
            self._pages = np.array(self.ids, dtype=np.int32) if self.ids else EMPTY
        return self._pages

    def __repr__(self) -> str:
        return f"LockHandle(node={self.node!r}, swa_pages={self.swa_pages!r}, released={self.released})"


@dataclass(frozen=True)
class PageNames:
    """What the lower tiers call pages the tree takes or frees, one entry per page.

    ``keys[i]``: the page's chained key (the name L2 / L3 store it under; None:
    unnamed).  ``anchored[i]``: its SWA ends a window the tiers keep (L2 keeps it
    past plain SWA; L3 may receive only those).  ``parents[i]`` (pages freed
    only): the key of the page before it in its sequence (None: the first page).
    ``host_at`` (optional, int64 ``[pages, 2 * pairs]``): where L2 holds each
    page, as recorded by the tiers (:attr:`TreeNode.host_at`; None: nothing recorded).
    An insert gives names for every page of its key; the tree keeps those of the
    pages it takes (``TreeNode.page_keys`` / ``tier_anchor`` / ``host_at``) and
    hands them to its ``free_listeners`` with the pages it frees.
    """

    keys: list[bytes | None]
    anchored: np.ndarray
    parents: list[bytes | None] | None = None
    host_at: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keys, list):
            raise TypeError(f"keys must be a list, got {type(self.keys).__name__}")
        n = len(self.keys)
        if len(self.anchored) != n or (self.parents is not None and len(self.parents) != n):
            raise ValueError(f"anchored and parents need {n} entries (one per key)")
        shape = None if self.host_at is None else np.shape(self.host_at)
        if shape is not None and (len(shape) != 2 or shape[0] != n or shape[1] < 2 or shape[1] % 2):
            raise ValueError(f"host_at must have shape ({n}, 2 * pairs), got {shape}")

    def select(self, mask: np.ndarray) -> "PageNames":
        """The names where bool ``mask`` is True (records copied).  O(pages)."""
        pick = mask.tolist()
        par = self.parents
        return PageNames([k for k, m in zip(self.keys, pick) if m], self.anchored[mask],
                         None if par is None else [k for k, m in zip(par, pick) if m],
                         None if self.host_at is None else self.host_at[mask])

    def at(self, idx: np.ndarray) -> "PageNames":
        """The names of pages ``idx`` (int indices into ``keys``), with their parents
        (the key before each; None at page 0) and records (copied).  O(len(idx))."""
        keys, at = self.keys, idx.tolist()
        return PageNames([keys[i] for i in at], self.anchored[idx], parent_keys(keys, at),
                         None if self.host_at is None else self.host_at[idx])


def parent_keys(keys: Sequence[bytes | None], pages: Iterable[int]) -> list[bytes | None]:
    """Per page index of ``pages``, the key of the page before it in ``keys``
    (``None`` for page 0): the parent L2's key tree links it to.  O(len(pages))."""
    return [keys[i - 1] if i else None for i in pages]


def node_names(node: TreeNode, keep: int = 0) -> PageNames | None:
    """The tier names of ``node``'s pages from ``keep`` on, with their parents (the
    page before the node's first is its parent node's last) and their L2 records
    (a view: the run eviction makes of them shares it, so a free listener that
    stores them in L2 records that on the run); None: unnamed.  O(pages)."""
    keys = node.page_keys
    if keys is None:
        return None
    up = node.parent.page_keys if node.parent is not None else None
    gone = keys[keep:]
    first = keys[keep - 1] if keep else (up[-1] if up else None)
    return PageNames(gone, node.tier_anchor[keep:], [first] + gone[:-1],
                     None if node.host_at is None else node.host_at[keep:])


class FreedPages:
    """The full and SWA pages one tree call frees, with their tier names when
    ``named`` (the tree has ``free_listeners``), given back at the call's end
    (:meth:`give_back`) so listeners hear them in one batch per kind.

    A listener may record on the names it hears where L2 now holds the pages
    (``host_at``, :mod:`hybridkv.tiers.records`): those records reach the
    entries naming the pages, through the views the names share with them or,
    for names copied out of an entry, the ``back`` an add names."""

    __slots__ = ("named", "full", "swa", "full_names", "swa_names", "_any", "_back")

    def __init__(self, named: bool) -> None:
        self.named = named
        self._any = False  # some page had a name (else listeners hear None)
        self.full: list[np.ndarray] = []
        self.swa: list[np.ndarray] = []
        self.full_names: list[PageNames] = []
        self.swa_names: list[PageNames] = []
        # (names' records, as added, the entry's records, the rows of it they copy)
        self._back: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add_full(self, pages: np.ndarray, names: PageNames | None = None,
                 back: tuple[np.ndarray | None, np.ndarray] | None = None) -> None:
        """Free full ``pages`` named ``names``; ``back``: ``(records, rows)``, the
        entry's ``host_at`` the names' records copy rows ``rows`` of (None: a view)."""
        self.full.append(pages)
        if self.named:
            self._add(self.full_names, len(pages), names, back)

    def add_swa(self, pages: np.ndarray, names: PageNames | None = None,
                back: tuple[np.ndarray | None, np.ndarray] | None = None) -> None:
        """:meth:`add_full` for SWA ``pages``."""
        self.swa.append(pages)
        if self.named:
            self._add(self.swa_names, len(pages), names, back)

    def _add(self, into: list[PageNames], n: int, names: PageNames | None,
             back: tuple[np.ndarray | None, np.ndarray] | None) -> None:
        self._any = self._any or names is not None
        into.append(names if names is not None else unnamed(n))
        rows = None if names is None else names.host_at
        if back is not None and back[0] is not None and rows is not None and rows.shape[1] == back[0].shape[1]:
            self._back.append((rows, rows.copy(), back[0], back[1]))

    def give_back(self, index: "FreeingIndex") -> None:
        """Hand the pages (and names) to ``index``'s ``return_*_pages``; the L2
        records a listener writes on the joined names go back to each part's
        (views of the nodes' and runs' records), and the cells it changed in a
        copied part to the entry it copies.  O(pages)."""
        if self.full:
            self._give(index.return_full_pages, self.full, self.full_names)
        if self.swa:
            self._give(index.return_swa_pages, self.swa, self.swa_names)
        for rows, before, entry, at in self._back:
            changed = rows != before
            if changed.any():
                mine = entry[at]
                mine[changed] = rows[changed]
                entry[at] = mine

    def _give(self, hook: Callable[[np.ndarray, "PageNames | None"], None], pages: list[np.ndarray],
              parts: list[PageNames]) -> None:
        joined = join_names(parts) if self._any else None
        hook(pages[0] if len(pages) == 1 else np.concatenate(pages), joined)
        if joined is not None and len(parts) > 1 and joined.host_at is not None:
            at = 0
            for part in parts:
                if part.host_at is not None:
                    part.host_at[:] = joined.host_at[at:at + len(part.keys)]
                at += len(part.keys)


class FreeingIndex(Protocol):
    """Where :class:`FreedPages` gives pages back (the tree)."""

    def return_full_pages(self, pages: np.ndarray, names: PageNames | None = None) -> None: ...

    def return_swa_pages(self, pages: np.ndarray, names: PageNames | None = None) -> None: ...


def join_names(parts: list[PageNames]) -> PageNames | None:
    """The names of several runs of pages, in order (None: no run).  O(pages)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    keys: list[bytes | None] = []
    parents: list[bytes | None] = []
    for p in parts:
        keys += p.keys
        parents += p.parents if p.parents is not None else [None] * len(p.keys)
    rows = None
    if any(p.host_at is not None for p in parts):
        width = next(p.host_at.shape[1] for p in parts if p.host_at is not None)
        rows = np.concatenate([p.host_at if p.host_at is not None else unrecorded(len(p.keys), width)
                               for p in parts])
    return PageNames(keys, np.concatenate([p.anchored for p in parts]), parents, rows)


def unnamed(n: int) -> PageNames:
    """Names of ``n`` pages no tier named."""
    return PageNames([None] * n, np.zeros(n, dtype=bool), [None] * n)


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


