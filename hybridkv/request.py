"""A live request of :class:`~hybridkv.cache.HybridKVCache`: its tokens, pages and lock.

Kept apart from the cache so the modules that work on requests (the cache,
:mod:`hybridkv.allocation`, the tiers) share it without importing each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .radix import LockHandle

__all__ = ["Request", "swa_held"]


def swa_held(swa_pages: np.ndarray, side_pages: list[np.ndarray] | None, pages: int) -> np.ndarray:
    """bool per page ``[0, pages)`` of a request: every sliding group holds its page
    there (the lead's ``swa_pages`` and each side group's ``side_pages``; what a
    tier may copy).  O(pages x groups)."""
    held = swa_pages[:pages] >= 0
    for side in side_pages or ():
        held &= side[:pages] >= 0
    return held


class Request:
    """A live request: its tokens, pages and lock.  Mutated only by the cache.

    ``tokens`` is a read-only view of the first ``n_tokens`` entries of
    ``token_buffer``, a buffer the cache doubles when full, so decode appends
    are amortised O(1).
    ``allocated`` is the end of the slots handed out (``commit`` may not pass it).
    ``side_pages``: with several sliding groups, one int32 array per side group
    beside ``swa_pages`` (the group's page id where it holds its page, ``NO_PAGE``
    where not; see :attr:`~hybridkv.radix.node.TreeNode.side`); None with one window.
    """

    __slots__ = ("rid", "namespace", "token_buffer", "n_tokens", "prefix_len", "raw_match_len", "full_pages",
                 "swa_pages", "side_pages", "tree_pages", "handle", "computed", "n_pages", "allocated", "last_release", "prompt_len",
                 "release_mark", "group_marks", "finished", "extra", "__weakref__")

    def __init__(self, rid: Any, namespace: str, buf: np.ndarray, n_tokens: int, prefix_len: int,
                 raw_match_len: int, full_pages: np.ndarray, swa_pages: np.ndarray, tree_pages: int,
                 handle: LockHandle, computed: int = 0, n_pages: int = 0, last_release: int = 0,
                 side_pages: list[np.ndarray] | None = None) -> None:
        self.rid = rid
        self.namespace = namespace
        # the request owns its tokens (``buf``, a copy with room to grow, made by the
        # cache), so decode appends in place and the caller may reuse its array
        self.token_buffer = buf
        self.n_tokens = n_tokens
        self.prompt_len = n_tokens  # the tokens given to begin; later appends are output
        self.prefix_len = prefix_len
        self.raw_match_len = raw_match_len
        self.full_pages = full_pages
        self.swa_pages = swa_pages
        self.side_pages = side_pages
        self.tree_pages = tree_pages
        self.handle = handle
        self.computed = computed
        self.n_pages = n_pages
        self.allocated = computed
        self.last_release = last_release
        self.release_mark = tree_pages  # pages below this were already scanned for release
        # per sliding group beside the lead one: pages below it were scanned for its release
        self.group_marks: list[int] | None = None
        self.finished = False
        self.extra: dict = {}

    @property
    def tokens(self) -> np.ndarray:
        """The request's tokens (prompt + appended), a read-only int32 view."""
        view = self.token_buffer[:self.n_tokens]
        view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        return (f"Request(rid={self.rid!r}, namespace={self.namespace!r}, n_tokens={self.n_tokens}, "
                f"prefix_len={self.prefix_len}, computed={self.computed}, n_pages={self.n_pages}, "
                f"finished={self.finished})")
