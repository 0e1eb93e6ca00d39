"""Engine-free planning: window-safe hit length and which pages move.

Pure numpy, importable without vLLM, so the rules are unit-tested directly.

Window rule (``../../DESIGN.md`` section 2): a prefix of ``L`` tokens is
usable iff every position in ``[0, L)`` has full KV and every position in
``[max(0, L - W), L)`` has SWA KV, for each SWA group with window ``W``.  Hits
are page aligned.  The rule itself is :mod:`hybridkv.window`'s (the core tree
and the tiers ask it too); this module maps vLLM's groups onto it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.spec import window_pages
from hybridkv.tiers.lookup import GroupInfo, window_safe_tokens  # the core's; re-exported here
from hybridkv.window import groups_safe_pages

__all__ = [
    "GroupInfo",
    "checkpoint_ends",
    "full_bases",
    "pages_to_save",
    "passed_pages",
    "swa_first_page",
    "window_safe_pages",
    "window_safe_tokens",
    "windows_before",
]


def full_bases(groups: Sequence[GroupInfo], keys: dict[int, list[bytes]], gi: int,
               pages: Sequence[int]) -> list[bytes | None] | None:
    """Per page ``pages[j]`` of sliding group ``gi``, the key of the page of the
    model's first full-attention group that holds its last token (the full KV its
    window's hit needs; L2 drops the window with it), ``None`` where ``keys`` do not
    reach that far.  ``None`` for a full group or a model without one.  O(len(pages)).
    """
    by = {g.index: g for g in groups}
    full = next((g for g in groups if not g.is_swa), None)
    if full is None or not by[gi].is_swa:
        return None
    fks, bs, fbs = keys.get(full.index, []), by[gi].block_size, full.block_size
    if not (bs and fbs):  # a block size 0 is the caller's one page size for every group
        bs = fbs = 1
    idx = [((int(i) + 1) * bs - 1) // fbs for i in pages]
    return [fks[j] if j < len(fks) else None for j in idx]


def swa_first_page(end_pages: int, page_size: int, window: int) -> int:
    """First page whose SWA KV a hit ending at ``end_pages`` pages needs.

    Covers positions ``[max(0, end - window), end)``: the last
    :func:`hybridkv.spec.window_pages` pages before the end.  O(1).
    """
    return max(0, end_pages - window_pages(window, page_size))


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
    missing = np.flatnonzero(~full_present)
    prefix = int(missing[0]) if missing.size else full_present.size
    return groups_safe_pages(swa_present, [window_pages(w, page_size) for w in windows], prefix,
                             local_pages)


def checkpoint_ends(lo: int, hi: int, unit: int, interval: int | str = "auto",
                    per_doubling: int = 4) -> list[int]:
    """SWA retention checkpoints ``c`` (tokens) with ``lo < c <= hi``.

    ``interval`` an int > 0: every multiple of it (a multiple of ``unit``);
    ``0``: none.  ``"auto"``: a grid that depends only on the position (so
    every request sharing a prefix agrees on it) and scales with it: with
    ``m = c / unit``, every ``m <= 2 * per_doubling`` is a checkpoint, then
    ``per_doubling`` evenly spaced ones per doubling of ``m`` (``m`` in
    ``[2^j, 2^(j+1))`` is a checkpoint iff it is a multiple of
    ``max(1, 2^j // per_doubling)``).  A prefix shared up to ``p`` tokens
    therefore hits at least ``p - max(unit, p / per_doubling)`` tokens, for
    short prompts as for long ones, and a prompt of ``P`` tokens has about
    ``per_doubling * (log2(P / unit) + 1)`` checkpoints.  Sorted; O(result + 64).
    """
    if unit <= 0:
        raise ValueError(f"unit must be > 0, got {unit}")
    if hi <= lo:
        return []
    if interval != "auto":
        step = int(interval)
        if step <= 0:
            return []
        first = (lo // step + 1) * step
        return list(range(first, hi + 1, step))
    if per_doubling <= 0:
        raise ValueError(f"per_doubling must be > 0, got {per_doubling}")
    m_lo, m_hi = lo // unit + 1, hi // unit  # candidate m in [m_lo, m_hi]
    out: list[int] = []
    j = max(0, m_lo.bit_length() - 1)
    while (1 << j) <= m_hi:
        step = max(1, (1 << j) // per_doubling)
        a, b = max(m_lo, 1 << j), min(m_hi, (1 << (j + 1)) - 1)
        first = -(-a // step) * step
        out.extend(m * unit for m in range(first, b + 1, step))
        j += 1
    return out


def pages_to_save(group: GroupInfo, saved_pages: int, end_pages: int, page_size: int,
                  final: bool, checkpoint_pages: int = 0,
                  checkpoints: Sequence[int] | None = None) -> list[int]:
    """Pages of ``group`` to store when a request's KV is complete up to ``end_pages``.

    Full groups store every page not stored yet (``[saved_pages, end_pages)``).
    SWA groups store only windows a later hit can end at: the window before
    every checkpoint in ``(saved_pages, end_pages]`` (``checkpoints``, in
    pages of this group, e.g. from :func:`checkpoint_ends`; else every
    multiple of ``checkpoint_pages``, 0 = none), and, when ``final`` (prompt
    end or request end), the window before ``end_pages``.  SWA KV elsewhere
    can never make a window-safe hit and is not worth its bytes.  Sorted,
    unique page indices; O(end_pages) numpy work.
    """
    if end_pages <= 0:
        return []
    if not group.is_swa:
        return list(range(min(saved_pages, end_pages), end_pages))
    assert group.window is not None
    ends: list[int] = []
    if checkpoints is not None:
        ends = [int(e) for e in checkpoints if saved_pages < e <= end_pages]
    elif checkpoint_pages > 0:
        first = (saved_pages // checkpoint_pages + 1) * checkpoint_pages
        ends = list(range(first, end_pages + 1, checkpoint_pages))
    if final and (not ends or ends[-1] != end_pages):
        ends.append(end_pages)
    return np.flatnonzero(windows_before(group, end_pages, page_size, ends)).tolist()


def passed_pages(group: GroupInfo, end_pages: int, page_size: int, kept_ends: Sequence[int]) -> list[int]:
    """SWA pages of ``group`` in ``[0, end_pages)`` that no kept window covers.

    A finished request keeps the windows it ends (its tail, its checkpoints) and
    the one its hit ended at (``kept_ends``, in pages of this group); its other
    windows in L2 are ones the sequence moved past (:meth:`.l2.HostPageIndex.demote`).
    Full groups have no windows (empty).  Sorted; O(end_pages + kept windows).
    """
    if not group.is_swa or end_pages <= 0:
        return []
    return np.flatnonzero(~windows_before(group, end_pages, page_size, kept_ends)).tolist()


def windows_before(group: GroupInfo, end_pages: int, page_size: int, ends: Sequence[int]) -> np.ndarray:
    """``[end_pages]`` bool: the pages of SWA ``group`` inside the window before any of
    ``ends`` (in pages of this group; a window past ``end_pages`` counts its part
    inside).  O(end_pages + windows)."""
    assert group.window is not None
    inside = np.zeros(end_pages, dtype=bool)
    for e in ends:
        if e > 0:
            inside[swa_first_page(int(e), page_size, group.window):int(e)] = True
    return inside
