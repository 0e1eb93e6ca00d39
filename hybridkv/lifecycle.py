"""One request lifecycle over the window-safe tree, for every host.

hybridkv runs in three hosts: its own :class:`~hybridkv.cache.HybridKVCache`,
vLLM's scheduler (``hybridkv_vllm.prefix.HybridKVCacheManager``) and SGLang's
(``hybridkv_sglang.radix_cache.HybridKVRadixCache``).  Each owns its pages
and its request objects; what a request does to the *tree* is the same in
all three, and lives here, in :class:`Lifecycle`:

1. **begin** (:meth:`Lifecycle.begin`): the largest window-safe cached prefix,
   split so a node ends at the hit, and locked (the path's full KV and the
   window before the hit).  A host whose engine locks later (SGLang's
   ``match_prefix`` then ``inc_lock_ref``) uses :meth:`Lifecycle.match` and
   :meth:`Lifecycle.lock`.
2. **grow**: the host's own allocation (its pool, its block tables).
3. **release** (:meth:`Lifecycle.release_runs`, :meth:`Lifecycle.kept_runs`):
   which of the request's out-of-window SWA pages go back, the retention
   policy's rule (checkpoint, divergence and predicted windows stay).
4. **checkpoint** (optional, :meth:`Lifecycle.insert` then
   :meth:`Lifecycle.move_lock`): the computed prefix so far goes into the tree
   and the request's lock moves to its end.
5. **finish** (:meth:`Lifecycle.insert`, :meth:`Lifecycle.end`): the computed
   page-aligned prefix is inserted starting at the node the request holds,
   then the lock goes; **abort** is :meth:`Lifecycle.end` alone.

The host supplies its pages to the tree through the
:class:`~hybridkv.radix.PagePool` protocol (every call the core makes on a
pool) and, where it has lower tiers, the :class:`TierHooks` protocol (the
three calls a request makes on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .radix import InsertResult, LockHandle, MatchResult, PagePool, WindowSafeTree
from .radix import PageNames
from .radix.node import TreeNode, take_records
from .radix.tree import parts_pages
from .request import Request

__all__ = ["Hit", "Lifecycle", "PagePool", "TierHooks", "TierPlan"]


@dataclass(frozen=True)
class TierPlan:
    """What the lower tiers found for a prompt before its L1 match: the
    prompt's page keys and, per page, the tier it was read from
    (:class:`~hybridkv.tiers.config.PageOrigin` values)."""

    keys: list[bytes]
    origin: np.ndarray


class TierHooks(Protocol):
    """The lower tiers (L2 host, L3 storage) as a request's lifecycle calls them;
    :class:`~hybridkv.tiers.coordinator.TierCoordinator` implements it."""

    def before_match(self, tokens: np.ndarray, namespace: str) -> TierPlan:
        """Before the L1 match: load what L2/L3 hold of ``tokens`` into L1."""
        ...

    def after_begin(self, req: Request, plan: TierPlan) -> None:
        """Once the hit is locked: per-tier hit figures, the hit's window anchored."""
        ...

    def before_finish(self, req: Request) -> PageNames | None:
        """Before the finish's insert: the request's pages copied down as the write
        policy asks; returns their names for the insert (None: unnamed)."""
        ...

    def stats(self) -> dict[str, object]:
        """The tiers' counters (merged into the host's stats)."""
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError if the tiers disagree with the tree."""
        ...


@dataclass
class Hit:
    """A locked window-safe hit: ``pages`` page-aligned pages (``raw_pages``
    matched before the window rule), ``parts`` the ``(node, pages taken)`` runs
    its page ids come from, ``handle`` the lock (``handle.node`` None: nothing
    locked)."""

    pages: int
    raw_pages: int
    parts: list[tuple[TreeNode, int]]
    handle: LockHandle

    def page_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The hit's full and SWA page ids (int32 copies; SWA ``NO_PAGE`` where not
        held), as :meth:`~hybridkv.radix.WindowSafeTree.match_tokens` gives them.  O(pages)."""
        return parts_pages(self.parts)


class Lifecycle:
    """A request's calls on the tree (see the module docstring).

    Args:
        tree: the host's :class:`~hybridkv.radix.WindowSafeTree` (built over the
            host's :class:`~hybridkv.radix.PagePool`).

    Requests are the host's own; these calls take what they need (tokens,
    pages, the lock handle, lengths) and change only the tree.  Not
    thread-safe (every host calls from its scheduler thread).
    """

    __slots__ = ("tree", "page_size", "policy")

    def __init__(self, tree: WindowSafeTree) -> None:
        if not isinstance(tree, WindowSafeTree):
            raise TypeError(f"tree must be a WindowSafeTree, got {type(tree).__name__}")
        self.tree = tree
        self.page_size = tree.page_size
        self.policy = tree.policy

    # ------------------------------------------------------------- begin
    def begin(self, tokens: np.ndarray, namespace: str, limit: int | None, *, touch: bool = True) -> Hit:
        """The window-safe hit of ``tokens`` (at most ``limit`` tokens; the host
        leaves its last prompt token to compute), split so a node ends there,
        and locked.  ``touch``: the lookup is a use the ranking learns from
        (False for a host's repeated lookup of one request).  O(depth + L/P)."""
        safe, raw, parts, node = self.tree.match_parts(tokens, namespace, limit, split=True, touch=touch)
        return Hit(safe, raw, parts, self.tree.lock(node))  # node None (no hit): nothing locked

    def peek(self, tokens: np.ndarray, namespace: str, limit: int | None) -> MatchResult:
        """The window-safe hit :meth:`begin` would find, changing nothing (no
        split, no lock, no recency).  O(depth + L/P)."""
        return self.tree.match_tokens(tokens, namespace, limit, split=False, touch=False)

    def match(self, tokens: np.ndarray, namespace: str, limit: int | None = None, *, touch: bool = True
              ) -> tuple[int, int, TreeNode | None]:
        """:meth:`begin` without the lock (a host that locks later, with
        :meth:`lock`): ``(safe pages, raw pages, node ending the hit)``."""
        safe, raw, _, node = self.tree.match_parts(tokens, namespace, limit, split=True, touch=touch)
        return safe, raw, node

    def lock(self, node: TreeNode | None) -> LockHandle:
        """Lock the path to ``node`` and the window before it.  O(depth)."""
        return self.tree.lock(node)

    def reach(self, tokens: np.ndarray, namespace: str, pages: int) -> tuple[LockHandle, list[tuple[TreeNode, int]]]:
        """Lock the full KV of the first ``pages`` pages of ``tokens`` the tree matches,
        without :meth:`lock`'s rule that the window before them is held: repair case
        2, where the device's full KV serves a hit while a lower tier loads the
        window the device lacks.  Returns the lock (give it back with :meth:`end`)
        and the walk's ``(node, pages taken)`` parts.  O(depth + pages)."""
        _, path = self.tree.walk(tokens, namespace, pages * self.page_size)
        if not path:
            return LockHandle(None), path
        return self.tree.lock_path(path[-1][0], np.empty(0, np.int32)), path

    # ----------------------------------------------------------- release
    def release_cut(self, computed: int) -> int:
        """Pages wholly before ``computed - W``: below it SWA may go."""
        return self.policy.release_cut(computed)

    def release_runs(self, lo: int, cut: int, raw_match_len: int, hit_len: int, prompt_len: int
                     ) -> list[tuple[int, int]]:
        """The runs of pages ``[lo, cut)`` whose SWA a request gives back: all but
        the retention policy's checkpoint, divergence and predicted windows.
        Lengths in tokens (the request's raw match, its hit, its prompt).
        O(1 + runs)."""
        rp = self.policy
        return rp.releasable_runs(lo, cut, raw_match_len, hit_len,
                                  prompt_len // self.page_size if rp.pretail_pages >= 0 else 0)

    def kept_runs(self, lo: int, cut: int, raw_match_len: int, hit_len: int, prompt_len: int
                  ) -> list[tuple[int, int]]:
        """``[lo, cut)`` minus :meth:`release_runs`: the windows the policy keeps."""
        out, pos = [], lo
        for a, b in self.release_runs(lo, cut, raw_match_len, hit_len, prompt_len):
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
        if pos < cut:
            out.append((pos, cut))
        return out

    # ------------------------------------------------- checkpoint, finish
    def insert(self, handle: LockHandle, held_pages: int, tokens: np.ndarray, full: np.ndarray,
               swa: np.ndarray, namespace: str, *, mark: int = -1, continued: bool = False,
               side: list[np.ndarray] | None = None, names: PageNames | None = None) -> InsertResult | None:
        """Cache the request's pages ``[0, len(full))`` (``tokens`` spells them),
        starting at the node its lock holds (``held_pages`` pages long; pages
        before it are the tree's own and skipped); the tree takes the pages it
        keeps and frees its duplicates.  ``mark``: the page where the prompt
        ends (output after it); ``continued``: a later chunk of one prompt, not
        a reuse; ``side``: each side group's page ids beside ``swa`` (a host
        whose pool has side groups, see :attr:`TreeNode.side`); ``names``: the
        lower tiers' names of the pages (:meth:`TierHooks.before_finish`).  None when the lock no longer ends at ``held_pages`` (cannot
        happen while locked: nothing is freed that the tree did not take).
        O(depth + new pages)."""
        start = handle.node
        if not self.lock_ends_at(handle, held_pages):
            return None
        if names is not None and len(names.keys) != len(full):
            raise ValueError(f"names must name the {len(full)} pages, got {len(names.keys)}")
        if names is not None and names.host_at is not None:
            self.take_records(tokens, namespace, names.host_at)
        return self.tree.insert_tokens(tokens, full, swa, namespace, start=start, owned=True, mark=mark,
                                       continued=continued, side=side, names=names)

    def take_records(self, tokens: np.ndarray, namespace: str, rows: np.ndarray) -> int:
        """Record on the tree's nodes spelling ``tokens`` where ``host_at`` ``rows``
        (one per page) record L2 holds (or lacks) their pages: a finish's copies
        to L2, which may store pages the tree already names
        (:mod:`hybridkv.tiers.records`), before the insert (whose freed
        duplicates may record fresher facts), or a host's placement in L2 after
        it.  Nodes without records, or with records of another width, are left
        alone.  Returns the leading pages the tree's nodes spell (the rest have no
        node to record on).  O(depth + pages)."""
        _, path = self.tree.walk(tokens, namespace, len(rows) * self.page_size)
        pos = 0
        for nd, k in path:
            if nd.host_at is not None and nd.host_at.shape[1] == rows.shape[1]:
                take_records(nd.host_at[:k], rows[pos:pos + k])
            pos += k
        return pos

    def lock_ends_at(self, handle: LockHandle, pages: int) -> bool:
        """The request's lock holds an alive node ending at page ``pages`` (or
        nothing): where :meth:`insert` may start.  A host that hands pages to
        the tree checks this first.  O(1)."""
        start = handle.node
        return start is None or (start.alive and start.start + len(start.key) == pages * self.page_size)

    def move_lock(self, handle: LockHandle, node: TreeNode | None) -> LockHandle:
        """Lock ``node`` and give ``handle`` back (a checkpoint's new end).  Raises
        ValueError, ``handle`` still held, when the window before ``node`` is
        not held.  O(depth)."""
        new = self.tree.lock(node)
        self.tree.unlock(handle)
        return new

    def end(self, handle: LockHandle) -> None:
        """Give the request's lock back (finish after its insert; abort).  O(depth)."""
        self.tree.unlock(handle)
