"""The window rule: when a cached prefix is a usable hit.

A prefix of ``L`` tokens is usable iff every position in ``[0, L)`` holds the KV
of every full-attention group and, for each sliding-window group with window
``W``, every position in ``[max(0, L - W), L)`` holds that group's KV.  Hits are
page aligned: in pages, an end ``e`` needs pages ``[max(0, e - w), e)`` of a
group whose window covers ``w = ceil(W / page_size)`` pages
(:func:`hybridkv.spec.window_pages`).  ``L = 0`` is always safe.

This module is the one statement of that rule.  The prefix tree, the tier
coordinator (what L2 / L3 hold), the routing index and the vLLM adapter all
ask it; none re-derives it.  Everything here is pure numpy over "page held"
masks, O(P) per group with no per-page Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["group_keeps", "held_windows", "safe_pages", "groups_safe_pages"]


def held_windows(held: np.ndarray, ends: np.ndarray, window_pages: int, local: int = 0) -> np.ndarray:
    """For each candidate end ``e`` (pages) in ``ends``: whether every page of
    ``[max(local, e - window_pages), e)`` is held.

    Args:
        held: ``[P]`` bool, page ``i`` holds the group's KV (``P >= max(ends)``).
        ends: int candidate hit ends in pages, each in ``[0, P]``.
        window_pages: pages of the group's window (0: none needed).
        local: pages below it count as held (a caller's own hit keeps them).

    Returns a bool array shaped like ``ends``.  O(P) numpy work.
    """
    held = np.asarray(held, dtype=bool)
    counts = np.zeros(held.size + 1, dtype=np.int64)
    np.cumsum(held, out=counts[1:])
    ends = np.asarray(ends, dtype=np.int64)
    lo = np.maximum(np.maximum(0, ends - window_pages), local)
    lo = np.minimum(lo, ends)
    return counts[ends] - counts[lo] == ends - lo


def safe_pages(held: np.ndarray, window_pages: int, limit: int | None = None) -> int:
    """Largest ``L <= limit`` (pages; default ``len(held)``) whose last
    ``window_pages`` pages are all held: one sliding-window group.  O(P)."""
    return groups_safe_pages([held], [window_pages], len(held) if limit is None else limit)


def groups_safe_pages(held: Sequence[np.ndarray], window_pages: Sequence[int], limit: int,
                      local: int = 0) -> int:
    """Largest window-safe end ``L`` in ``[0, limit]`` pages over several groups.

    Args:
        held: per sliding-window group a ``[>= limit]`` bool mask of held pages.
        window_pages: each group's window in pages (same order).
        limit: the most pages the hit may have (full KV is held below it).
        local: pages the caller already holds for every group; an end at or
            below it needs nothing (returns ``limit`` if ``limit <= local``).

    Returns ``L``; 0 when no end above ``local`` is safe.  O(limit x groups).
    """
    if limit <= local:
        return limit
    ends = np.arange(local + 1, limit + 1)
    ok = np.ones(ends.size, dtype=bool)
    for mask, wp in zip(held, window_pages):
        ok &= held_windows(np.asarray(mask, dtype=bool)[:limit], ends, wp, local)
    good = ends[ok]
    return int(good[-1]) if good.size else 0


def group_keeps(held: np.ndarray, lo: int, hi: int, lead_pages: int, group_pages: int,
                base: int = 0) -> np.ndarray:
    """Which pages ``[lo, hi)`` a sliding-window group must keep beside the lead group.

    The lead group (the largest window, ``lead_pages`` pages) decides where a hit
    may end; a group with a smaller window (``group_pages`` pages) needs its own
    window before each such end, and nothing else.  Page ``i`` is needed iff some
    end ``L`` in ``(i, i + group_pages]`` has the lead's whole window
    ``[max(0, L - lead_pages), L)`` held.

    Args:
        held: bool, ``held[j]``: the lead holds page ``base + j``; must cover pages
            up to ``hi - 1 + group_pages`` (the largest end looked at).
        lo, hi: the pages to decide (``base <= max(0, lo + 1 - lead_pages)``).
        lead_pages, group_pages: the two windows in pages (``group_pages >= 1``).

    Returns a bool array of ``hi - lo`` entries.  O(hi - lo + windows) numpy work.
    """
    if hi <= lo:
        return np.zeros(0, dtype=bool)
    top = hi - 1 + group_pages  # the largest end looked at
    ends = np.arange(lo + 1, top + 1)
    ok = held_windows(np.asarray(held, dtype=bool)[:top - base], ends - base, lead_pages)
    c = np.zeros(ok.size + 1, dtype=np.int64)
    np.cumsum(ok, out=c[1:])
    idx = np.arange(hi - lo)
    return c[idx + group_pages] - c[idx] > 0
