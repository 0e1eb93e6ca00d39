"""Engine-free planning: window-safe hit length and which pages move.

Pure numpy, importable without vLLM, so the rules are unit-tested directly.

Window rule (``../../DESIGN.md`` section 2, shared with the core tree): a
prefix of ``L`` tokens is usable iff every position in ``[0, L)`` has full KV
and every position in ``[max(0, L - W), L)`` has SWA KV, for each SWA group
with window ``W``.  Hits are page aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "GroupInfo",
    "pages_to_save",
    "swa_first_page",
    "window_safe_pages",
    "window_safe_tokens",
]


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV-cache group as the connector sees it.

    ``window`` is ``None`` for full attention, else the sliding window in tokens.
    ``block_size`` is this group's tokens per block (vLLM may give groups of
    one model different block sizes at equal page bytes, e.g. MiMo-V2: full
    64, SWA 32); ``0`` means "the caller's single page size".
    """

    index: int
    window: int | None
    layer_names: tuple[str, ...]
    block_size: int = 0

    @property
    def is_swa(self) -> bool:
        return self.window is not None


def swa_first_page(end_pages: int, page_size: int, window: int) -> int:
    """First page whose SWA KV a hit ending at ``end_pages`` pages needs.

    Covers positions ``[max(0, end - window), end)``.  O(1).
    """
    return max(0, end_pages * page_size - window) // page_size


def window_safe_pages(full_present: np.ndarray, swa_present: Sequence[np.ndarray],
                      windows: Sequence[int], page_size: int, local_pages: int) -> int:
    """Largest window-safe hit, in pages, given what storage holds.

    Args:
        full_present: ``[P]`` bool, page ``i`` of every full group is stored
            (already AND-ed over full groups).  Only its leading run counts.
        swa_present: per SWA group a ``[P]`` bool array.
        windows: window of each SWA group (same order).
        page_size: tokens per page.
        local_pages: pages the engine already holds (its own prefix hit); their
            SWA pages need not come from storage.

    Returns:
        ``L`` in ``[0, P]``; ``L <= local_pages`` means "nothing to load".
        Pure; O(P * groups) numpy work, no per-page Python loop.
    """
    full_present = np.asarray(full_present, dtype=bool)
    n = full_present.size
    if n == 0:
        return 0
    missing = np.flatnonzero(~full_present)
    prefix = int(missing[0]) if missing.size else n
    if prefix <= local_pages:
        return prefix
    ends = np.arange(local_pages + 1, prefix + 1)  # candidate hit ends, in pages
    ok = np.ones(ends.size, dtype=bool)
    for present, window in zip(swa_present, windows):
        present = np.asarray(present, dtype=bool)[:prefix]
        csum = np.concatenate(([0], np.cumsum(present, dtype=np.int64)))
        lo = np.maximum(0, ends * page_size - window) // page_size
        lo = np.maximum(lo, local_pages)  # the engine's own hit covers pages below
        ok &= (csum[ends] - csum[lo]) == (ends - lo)
    good = ends[ok]
    return int(good[-1]) if good.size else 0


def window_safe_tokens(present: Sequence[np.ndarray], groups: Sequence[GroupInfo], unit: int,
                       local_tokens: int, max_tokens: int) -> int:
    """Largest window-safe hit in tokens over groups with their own block sizes.

    Args:
        present: per group (same order as ``groups``) a bool array, page ``i``
            (of that group's ``block_size``) is stored; at least
            ``max_tokens // block_size`` long.
        groups: the KV-cache groups; every ``block_size`` divides ``unit``.
        unit: hit granularity in tokens (the lcm of the groups' block sizes:
            a hit must end on a block boundary of every group).
        local_tokens: tokens the engine already holds (a multiple of ``unit``);
            pages below it need not come from storage (for SWA: the engine's
            own hit keeps the window before it).
        max_tokens: upper bound of the hit.

    Returns:
        ``L``, a multiple of ``unit`` in ``[0, max_tokens]``: the largest end
        such that every full group holds pages ``[local, L)`` and every SWA
        group the pages covering ``[max(local, L - W), L)``; ``L <= local_tokens``
        means "nothing to load".  Pure; O(P * groups) numpy, no per-page loop.
    """
    if unit <= 0 or any(unit % g.block_size for g in groups):
        raise ValueError(f"unit {unit} must be a positive multiple of every block size "
                         f"{[g.block_size for g in groups]}")
    first, last = local_tokens // unit + 1, max_tokens // unit
    if last < first:
        return 0
    ends = np.arange(first, last + 1, dtype=np.int64) * unit  # candidate ends, tokens
    ok = np.ones(ends.size, dtype=bool)
    for pres, g in zip(present, groups):
        bs = g.block_size
        pres = np.asarray(pres, dtype=bool)[: last * unit // bs]
        csum = np.concatenate(([0], np.cumsum(pres, dtype=np.int64)))
        hi = ends // bs
        lo = np.full(ends.size, local_tokens // bs, dtype=np.int64)
        if g.is_swa:
            lo = np.maximum(lo, np.maximum(0, ends - int(g.window)) // bs)  # type: ignore[arg-type]
        # full groups: [local, L) complete, so a gap fails every end past it
        ok &= (csum[hi] - csum[lo]) == (hi - lo)
    good = ends[ok]
    return int(good[-1]) if good.size else 0


def pages_to_save(group: GroupInfo, saved_pages: int, end_pages: int, page_size: int,
                  final: bool, checkpoint_pages: int = 0) -> list[int]:
    """Pages of ``group`` to store when a request's KV is complete up to ``end_pages``.

    Full groups store every page not stored yet (``[saved_pages, end_pages)``).
    SWA groups store only windows a later hit can end at: the window before
    every checkpoint (a multiple of ``checkpoint_pages``, 0 = none) in
    ``(saved_pages, end_pages]``, and, when ``final`` (prompt end or request
    end), the window before ``end_pages``.  SWA KV elsewhere can never make a
    window-safe hit and is not worth its bytes.  Sorted, unique page indices;
    O(pages returned).
    """
    if end_pages <= 0:
        return []
    if not group.is_swa:
        return list(range(min(saved_pages, end_pages), end_pages))
    assert group.window is not None
    ends: list[int] = []
    if checkpoint_pages > 0:
        first = (saved_pages // checkpoint_pages + 1) * checkpoint_pages
        ends = list(range(first, end_pages + 1, checkpoint_pages))
    if final and (not ends or ends[-1] != end_pages):
        ends.append(end_pages)
    pages: set[int] = set()
    for e in ends:
        pages.update(range(swa_first_page(e, page_size, group.window), e))
    return sorted(pages)
