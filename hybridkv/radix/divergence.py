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
  nodes ending in a leaf, ``dist`` pages before the leaf's end, after
  ``depth`` matched pages; what a window at ``dist`` would add over a
  checkpoint is ``depth - floor_K(depth)`` when ``dist`` is covered;
* a window ``d`` pages before each new sequence's end would serve every event
  with ``dist <= d``, ending ``d - dist`` pages early; over the last events
  (a bounded sample), ``d`` is the offset that gains the most pages, ``G``;
* it is kept (:meth:`offset` > 0) while it pays at least what the cache's
  bytes pay on average: ``G / (leaves x window bytes) >= hits / cache bytes``,
  hits and ``G`` over the same stretch of requests (the sample's).  Windows
  the cache holds earn the hits it serves; this one must earn as much per
  byte, so a workload whose requests extend their prompts (chats, agents)
  keeps none, and a workload of documents asked several questions keeps one
  per document.

Nothing is fitted to a trace: the offset is chosen from the observed
distances, and the test compares two measured rates.  Runtime: O(1) per
event; every 16 events O(sample^2) numpy work on at most 256 events.
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["DivergenceModel"]

_SAMPLE = 256   # events kept (bounded memory; ~one stretch of the workload)
_EVERY = 16     # events between decisions
_MIN_EVENTS = 8  # fewer say nothing yet


class DivergenceModel:
    """Learns the pre-tail window offset (module docstring).  All lengths in pages."""

    def __init__(self) -> None:
        self._events: deque[tuple[int, int, int]] = deque(maxlen=_SAMPLE)  # (dist, gain, hits before)
        self.hit_pages = 0      # pages hit by all matches so far
        self._since = 0
        self.offset = 0         # current decision: 0 = no pre-tail window
        self.decisions = 0

    def observe(self, dist: int, gain: int) -> bool:
        """A request left a cached chain ``dist`` pages before its leaf's end; a window
        there would have added ``gain`` pages (at ``dist`` exactly).  True when a new
        decision is due (call :meth:`decide`)."""
        self._events.append((dist, gain, self.hit_pages))
        self._since += 1
        return self._since >= _EVERY and len(self._events) >= _MIN_EVENTS

    def decide(self, leaves: int, window_bytes: float, cache_bytes: float) -> int:
        """Set and return :attr:`offset`: the best ``d`` if its window pays for itself
        at ``leaves`` windows of ``window_bytes`` each in a cache holding
        ``cache_bytes``, else 0."""
        self._since = 0
        self.decisions += 1
        ev = np.array(self._events, dtype=np.float64)
        dist, gain = ev[:, 0], ev[:, 1]
        hits = self.hit_pages - ev[0, 2]
        cand = np.unique(dist)
        # a window d pages before the end serves dist <= d, ending d - dist pages early
        late = cand[:, None] - dist[None, :]
        got = np.where(late >= 0, np.maximum(gain[None, :] - late, 0.0), 0.0).sum(axis=1)
        best = int(np.argmax(got))
        g = float(got[best])
        if g <= 0 or g * cache_bytes < hits * max(1, leaves) * window_bytes:
            self.offset = 0
        else:
            self.offset = int(cand[best])
        return self.offset
