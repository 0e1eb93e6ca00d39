"""DivergenceModel: where requests leave cached sequences, learned online.

A hit needs an SWA window where it ends.  Tails, branch points and
checkpoints are kept, so a request that *extends* a cached prompt hits its
whole length; a request that leaves a cached sequence somewhere inside it for
the first time (the second question on a document first seen with another
question, an edited last message) hits only up to the last checkpoint, often
nothing, although the full KV up to the divergence is cached.  The
divergence rule makes the *next* request at that point hit.

Many workloads leave sequences at a typical distance before their end: a
document with a question after it is re-asked at the document's end, i.e. the
question's length before the sequence's end.  This model learns that
distance and whether keeping one more window per sequence there pays for its
bytes:

* an **event** is a request whose match leaves a cached chain of single-child
  nodes ending in a leaf, ``dist`` pages before the leaf's end (before the
  end of the prompt that created it, when the decoded output was cached
  after it: ``TreeNode.mark``), after
  ``depth`` matched pages; what a window at ``dist`` would add over a
  checkpoint is ``depth - floor_K(depth)`` when ``dist`` is covered;
* a window ``d`` pages before each new sequence's end would serve every event
  with ``dist <= d``, ending ``d - dist`` pages early; over the last events
  (a bounded sample), ``d`` is the offset that gains the most pages, ``G``;
* it is kept while it pays for its bytes *at the margin*: one window per
  cached leaf takes ``leaves x window bytes``, which the cache would
  otherwise spend on the leaves it evicted last.  Evicted leaves leave
  ghosts (their first page's name, the bytes evicted before them, their
  pages); a request whose match stops at a ghost would have hit up to that
  many more pages had the cache been larger by the bytes evicted since.
  The window is kept while ``G`` beats the pages of the ghost returns within
  ``leaves x window bytes`` of the newest eviction, both over the same stretch
  of requests (the sample's).  A cache under no pressure keeps it whenever
  it gains anything; a workload whose requests extend their prompts (chats,
  agents) has few events and rarely keeps one.
* the windows never take SWA that tails, checkpoints or branch windows hold:
  the tree frees them before any of those (``WindowSafeTree.evict``).  Where
  the SWA pool is sized on its own for one window per cached sequence (an
  engine's SWA:full ratio), only leaf ghosts measure the margin, and a
  window that displaced another sequence's tail would cost that sequence's
  next hit unseen.

Nothing is fitted to a trace: the offset is chosen from the observed
distances, and the test compares two measured hit counts.  (Comparing with
the cache's *average* hits per byte instead kept the window too rarely at
large budgets and too often at tiny ones, where the margin is worth more
than the average.)  Runtime: O(1) per event, eviction and ghost hit; every
16 events O(sample^2) numpy work on at most 256 events plus a pass over at
most 2,048 ghost returns.  Ghosts are capped by the tree (four per node plus
1,024).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

__all__ = ["DivergenceModel"]

_SAMPLE = 256   # events kept (bounded memory; ~one stretch of the workload)
_EVERY = 16     # events between decisions
_MIN_EVENTS = 8  # fewer say nothing yet


class DivergenceModel:
    """Learns the pre-tail window offset (module docstring).  All lengths in pages."""

    def __init__(self) -> None:
        self._events: deque[tuple[int, int, int]] = deque(maxlen=_SAMPLE)  # (dist, gain, clock)
        self.hit_pages = 0      # pages hit by all matches so far: the clock of both samples
        self._since = 0
        self.decisions = 0
        # the margin: evicted leaves (ghost key -> evicted bytes before it, pages) and
        # their returns (clock, bytes evicted after it, pages it would have hit)
        self.ghosts: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.evicted_bytes = 0
        self._returns: deque[tuple[int, int, int]] = deque(maxlen=8 * _SAMPLE)

    def observe(self, dist: int, gain: int) -> bool:
        """A request left a cached chain ``dist`` pages before its leaf's end (or its
        prompt's end; 0: it repeats that prompt); a window
        there would have added ``gain`` pages (at ``dist`` exactly).  True when a new
        decision is due (call :meth:`decide`)."""
        self._events.append((dist, gain, self.hit_pages))
        self._since += 1
        return self._since >= _EVERY and len(self._events) >= _MIN_EVENTS

    def evicted(self, key: int, nbytes: int, pages: int, cap: int) -> None:
        """A leaf's last ``pages`` pages (``nbytes``) were evicted; ``key`` names its first
        page (a ghost).  At most ``cap`` ghosts are kept, the oldest forgotten first."""
        self.evicted_bytes += nbytes
        ghosts = self.ghosts
        ghosts.pop(key, None)
        ghosts[key] = (self.evicted_bytes, pages)
        while len(ghosts) > cap:
            ghosts.popitem(last=False)

    def ghost_hit(self, key: int, remaining: int) -> None:
        """A request's match stopped where ghost ``key`` starts, with ``remaining`` pages
        of its own after it: a larger cache would have hit up to that many more."""
        got = self.ghosts.pop(key, None)
        if got is not None:
            self._returns.append((self.hit_pages, self.evicted_bytes - got[0], min(got[1], remaining)))

    def decide(self, leaves: int, window_bytes: float) -> int:
        """The pre-tail offset to use (``RetentionPolicy.pretail_pages``): the best ``d`` if its windows (one per leaf,
        ``leaves`` x ``window_bytes``) gain more than the cache would lose by giving up
        as many bytes (the returns of the leaves evicted within that many bytes, over
        the same stretch of requests), else -1 (none).  ``d`` = 0 is the window
        at the prompt's end, which serves exact repeats of a prompt whose output
        was cached after it."""
        self._since = 0
        self.decisions += 1
        ev = np.array(self._events, dtype=np.float64)
        dist, gain = ev[:, 0], ev[:, 1]
        cand = np.unique(dist)
        # a window d pages before the end serves dist <= d, ending d - dist pages early
        late = cand[:, None] - dist[None, :]
        got = np.where(late >= 0, np.maximum(gain[None, :] - late, 0.0), 0.0).sum(axis=1)
        best = int(np.argmax(got))
        g = float(got[best])
        start, margin = ev[0, 2], max(1, leaves) * window_bytes
        lost = sum(p for clock, ago, p in self._returns if clock >= start and ago <= margin)
        return int(cand[best]) if g > lost else -1
