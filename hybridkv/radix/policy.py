"""RetentionPolicy: the one owner of which SWA windows and which pages survive.

A hit of length ``L`` needs full KV on ``[0, L)`` and SWA KV on the W tokens
before ``L``.  SWA costs several times full KV per token, so a hybrid cache
keeps full KV broadly and SWA only in *windows* that end where a later hit
is likely to end.  This module decides, for every user of that rule:

* which windows are **anchors** (kept last): a sequence's **tail** (the
  window ending at a leaf), **branch points** (the window ending where two
  cached sequences part: shared system prompts end there), **divergence
  points** (``[raw_match - W, raw_match)`` when a request matched more full
  KV than it could use: it recomputes that window, and keeping it turns the
  point into a hittable branch point) and **checkpoints** (the W tokens
  before every multiple of K);
* which of a live request's own SWA pages it may free (:meth:`releasable`),
  used by :meth:`hybridkv.allocation.RequestPages.release`;
* which pages L2/L3 treat as anchored (:meth:`tier_anchored`);
* the segment rankings used by eviction (:class:`AdaptiveRanking`: recency
  vs. proven reuse of a sequence, balanced online by ghost hits as in ARC);
  the default ``"value"`` ranking learns return hazards instead
  (:mod:`hybridkv.radix.reuse`).

The tree keeps *per-page anchor counts*: each anchor window adds 1 to every
page it covers (walking into parent nodes when the window spans nodes) and
removes it when the anchor goes away, so "is this SWA page anchored" is a
lookup, never a walk over children.

Runtime complexity: every method is O(window pages) or O(pages of the range
asked about) numpy work; :class:`AdaptiveRanking` is O(1) per event.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..spec import window_pages

__all__ = ["RetentionPolicy", "AdaptiveRanking"]


class RetentionPolicy:
    """Which SWA windows survive (see the module docstring).

    Args:
        page_size: tokens per page P.
        window: sliding window W in tokens.
        checkpoint: K in tokens (0: no checkpoints).
        branch_points: anchor the window before a branch point.
    """

    def __init__(self, page_size: int, window: int, checkpoint: int = 0, *, branch_points: bool = True) -> None:
        self.page_size = page_size
        self.window = window
        self.window_pages = window_pages(window, page_size)
        self.checkpoint_pages = -(-checkpoint // page_size) if checkpoint else 0
        self.branch_points = branch_points
        # learned by the tree's DivergenceModel: the window this many pages before a
        # new sequence's prompt end is kept (a predicted window); -1 = none
        self.pretail_pages = -1

    # ------------------------------------------------------------ checkpoints
    def checkpoint_mask(self, lo: int, hi: int) -> np.ndarray:
        """bool per absolute page ``[lo, hi)``: inside the window before a multiple of K.  O(hi - lo)."""
        out = np.zeros(max(0, hi - lo), dtype=bool)
        for a, b in self.checkpoint_windows(lo, hi):
            out[a - lo:b - lo] = True
        return out

    def checkpoint_windows(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The runs ``[a, b)`` of absolute pages in ``[lo, hi)`` that lie in a checkpoint
        window (the ``window_pages`` pages before a multiple of K), in order.
        O(1 + (hi - lo) / K): callers write these few runs instead of a mask per page."""
        kp, wp = self.checkpoint_pages, self.window_pages
        if not kp or hi <= lo:
            return []
        if wp >= kp:
            return [(lo, hi)]
        # windows [end - wp, end) for the multiples end of kp with lo < end < hi + wp
        return [(max(end - wp, lo), min(end, hi)) for end in range((lo // kp + 1) * kp, hi + wp, kp)]

    # ---------------------------------------------------------------- release
    def release_cut(self, computed: int) -> int:
        """First page a live request must keep after computing ``computed`` tokens.

        Kept from there on: the window the request still reads
        (``[computed - W, computed)``), the window a later extension of this
        prefix hits (ending at the last whole page, ``computed // P``) and the
        one an exact repeat hits (the hit never covers the last token, so it
        ends at ``(computed - 1) // P``).  When P does not divide W, or the
        prompt ends on a page boundary, these differ.  O(1).
        """
        p, wp = self.page_size, self.window_pages
        live = (computed - self.window) // p
        extend = computed // p - wp
        repeat = (computed - 1) // p - wp
        return max(0, min(live, extend, repeat))

    def releasable(self, lo: int, hi: int, raw_match: int, hit: int) -> np.ndarray:
        """bool per absolute page ``[lo, hi)`` that a request may free.

        Never frees checkpoint windows, nor the divergence window
        ``[raw_match - W, raw_match)`` when ``raw_match > hit`` (the tree holds
        full KV there but lost the SWA: the request's copy repairs it at
        insert).  O(hi - lo).
        """
        out = np.zeros(max(0, hi - lo), dtype=bool)
        for a, b in self.releasable_runs(lo, hi, raw_match, hit):
            out[a - lo:b - lo] = True
        return out

    def releasable_runs(self, lo: int, hi: int, raw_match: int, hit: int,
                        end_pages: int = 0) -> list[tuple[int, int]]:
        """:meth:`releasable` as the runs ``[a, b)`` of absolute pages it marks, in order
        (what is left of ``[lo, hi)`` after the kept windows).  ``end_pages``: the
        request's prompt length in whole pages, for the learned pre-tail window
        (``pretail_pages`` before it; the output decoded after it does not move it).  O(1 + (hi - lo) / K)."""
        kp, wp = self.checkpoint_pages, self.window_pages
        pre = self.pretail_pages
        if raw_match <= hit and pre < 0 and (not kp or (wp < kp and hi <= (lo // kp + 1) * kp - wp)):
            # common case: no checkpoint window reaches into [lo, hi), no divergence window
            return [(lo, hi)] if lo < hi else []
        keep = self.checkpoint_windows(lo, hi)
        if pre >= 0 and end_pages:
            a, b = max(lo, end_pages - pre - wp), min(hi, end_pages - pre)
            if a < b:
                keep.append((a, b))
                keep.sort()
        if raw_match > hit:
            end = raw_match // self.page_size
            a, b = max(lo, end - self.window_pages), min(hi, end)
            if a < b:
                keep.append((a, b))
                keep.sort()
        runs = []
        pos = lo
        for a, b in keep:  # sorted by start; the divergence window may overlap a checkpoint
            if a > pos:
                runs.append((pos, a))
            if b > pos:
                pos = b
        if pos < hi:
            runs.append((pos, hi))
        return runs

    # ------------------------------------------------------------------ tiers
    def tier_anchored(self, idx: np.ndarray, end: int) -> np.ndarray:
        """For L2/L3: which page indices ``idx`` of a sequence of ``end`` pages are
        anchored: the tail window (with the exact-repeat page) or a checkpoint.  O(len(idx))."""
        idx = np.asarray(idx)
        out = idx >= end - self.window_pages - 1
        if self.checkpoint_pages and idx.size:
            out |= self.checkpoint_mask(0, int(idx.max()) + 1)[idx]
        return out


class AdaptiveRanking:
    """Which cached leaf goes first: ARC's balance of recency and proven reuse.

    Cached pages are in one of two segments: ``RECENT`` (inserted, not used
    by a later request yet) and ``REUSED`` (hit at least once after the
    request that inserted them).  Eviction takes the least recently used leaf
    of ``RECENT`` while that segment holds more than ``target`` pages, else of
    ``REUSED``.  Evicted leaves leave a *ghost* (a key naming the first page
    that went, and how many pages): a later request whose match stops exactly
    at a ghost would have hit more had that segment been larger, so
    ``target`` moves toward it.  One-shot scans stay in ``RECENT`` and are
    evicted first once reuse proves more valuable; a workload whose reuse is
    all in new data drives ``target`` to the whole cache, i.e. plain LRU.

    ``mode`` (``CacheConfig.eviction_ranking``):

    * ``"adaptive"``: the rule above with two refinements, both
      from the rule's own logic rather than tuned constants.  (1) Reuse is
      predicted per *sequence*: a leaf that extends a ``REUSED`` leaf (the
      next turn of a conversation that already came back) starts in
      ``REUSED``; only new sequences and branches start in ``RECENT``.
      Without this the rule evicts the newest turn of every live
      conversation first, which kills the window its next turn needs.
      (2) ``target`` moves by the ghost's pages times ARC's ratio of the two
      ghost lists (``max(1, |other| / |this|)``, Megiddo & Modha, FAST'03),
      so the segment whose ghosts are rarer still wins room quickly.
    * ``"arc"``: the plain rule (every new leaf in ``RECENT``, step = the
      ghost's pages).
    * ``"lru"``: the least recently used leaf of both segments.

    Ghost lists hold at most the cache's pages each.  Runtime complexity:
    O(1) per insert, hit or eviction (amortised).
    """

    RECENT = 1
    REUSED = 2

    def __init__(self, mode: str = "adaptive") -> None:
        self.mode = mode
        self.inherit = mode == "adaptive"      # extensions of reused sequences start REUSED
        self.ratio_step = mode == "adaptive"   # ARC's |B2|/|B1| step
        self.target = 0.0
        self.pages = {self.RECENT: 0, self.REUSED: 0}
        self._ghosts = {self.RECENT: OrderedDict(), self.REUSED: OrderedDict()}
        self._ghost_pages = {self.RECENT: 0, self.REUSED: 0}
        self.ghost_hits = {self.RECENT: 0, self.REUSED: 0}

    def capacity(self) -> int:
        return self.pages[self.RECENT] + self.pages[self.REUSED]

    def start_segment(self, *, extends_reused: bool) -> int:
        """Segment of a new leaf; ``extends_reused``: it extends a ``REUSED`` leaf."""
        return self.REUSED if extends_reused and self.inherit else self.RECENT

    def evict_from(self, *, recent_available: bool, reused_available: bool) -> int:
        """Segment to evict from next (the other one if the preferred has no leaf)."""
        prefer_recent = self.pages[self.RECENT] > self.target
        if prefer_recent and recent_available or not reused_available:
            return self.RECENT
        return self.REUSED

    def remember(self, segment: int, key: int, pages: int) -> None:
        """A leaf of ``segment`` lost ``pages`` pages starting at ghost ``key``."""
        ghosts = self._ghosts[segment]
        ghosts[key] = ghosts.pop(key, 0) + pages
        self._ghost_pages[segment] += pages
        cap = max(1, self.capacity())
        while self._ghost_pages[segment] > cap and ghosts:
            _, n = ghosts.popitem(last=False)
            self._ghost_pages[segment] -= n

    def on_miss(self, key: int, now: int = 0) -> bool:
        """A request's match stopped at page ``key``: adapt if it is a ghost.  True if it was."""
        for seg, other in ((self.RECENT, self.REUSED), (self.REUSED, self.RECENT)):
            n = self._ghosts[seg].pop(key, None)
            if n:
                step = float(n)
                if self.ratio_step:  # ARC: scale by |other ghosts| / |these ghosts| (counted before the hit)
                    step *= max(1.0, self._ghost_pages[other] / max(1, self._ghost_pages[seg]))
                self._ghost_pages[seg] -= n
                cap = float(self.capacity())
                self.target = min(cap, self.target + step) if seg == self.RECENT else max(0.0, self.target - step)
                self.ghost_hits[seg] += 1
                return True
        return False
