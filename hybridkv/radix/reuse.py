"""ReuseModel: how likely a cached sequence is to be used again soon, learned online.

A conversation's next turn, an agent's next step or a repeated document come
back after a *gap* whose distribution depends on the workload: in a chat
trace most turns return hundreds of requests later (users read and type),
so the hazard of a return first *rises* with the time since the last use and
falls only later; an agent polls every few requests.  Recency ranks the
freshest tail as the most valuable and the one about to come back as the
least; under a tight budget that is the wrong way round, and it is why LRU
keeps a small fraction of what the offline optimum keeps.

The model estimates, per *reuse class*, the hazard of a return as a function
of the time since the last use, with the standard piecewise-constant
estimator for censored data (events / time at risk per age bucket):

* classes (:func:`reuse_class`): a sequence that never came back; one that
  came back once; one that came back twice or more -- each of the last two
  split by its *cadence* (running mean of its log gaps, factor-4 buckets);
* an *at-risk period* starts when a leaf is last used (inserted or hit);
* it ends with a *return* (a later request's match reaches the leaf, or
  stops exactly where an evicted leaf's ghost starts) at age ``a``: one
  event in ``a``'s bucket, time at risk up to ``a``;
* or it is *censored* when the leaf stops being a leaf, or its ghost is
  forgotten (ghosts are bounded): time at risk up to then, no event;
* periods still running count up to their current age.

Ages are in tree ticks (a tick per match or insert), bucketed in half
octaves.  A class's estimate is shrunk toward its group (same return count)
and the group toward all classes where they have little time at risk.  From
the hazard the model derives each class's *hit density* per age bucket
(Beckmann et al., LHD, NSDI'18): the most returns per tick held that keeping
a leaf of that age for some further time can reach,
``max_t (S(a) - S(a + t)) / integral_a^(a+t) S``, ``S`` the survival.
Eviction takes the leaf with the lowest density (``WindowSafeTree``); with
no returns observed yet every density is 0 and the order is plain LRU.

Nothing here is fitted to a trace: the buckets are a fixed geometric grid,
the classes are powers of two and of four.

Runtime complexity: O(1) per event; the tables are rebuilt every 512 period
ends (more often while young) in O(open periods + classes x buckets^2)
numpy work, about 1 ms.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

__all__ = ["ReuseModel", "age_bucket", "reuse_class", "next_gap"]

_BUCKETS = 96  # half-octave buckets: ages up to 2**47 ticks
_BIN = 4       # running periods are counted by start tick in bins of 2**_BIN ticks
_REFRESH = 512  # period ends between rebuilds of the hazard tables (~1 ms each)
_GAP_CLASSES = 8  # factor-4 gap buckets: < 4, < 16, ..., >= 4**7 ticks
_GROUPS = ((0, 1), (1, 1 + _GAP_CLASSES), (1 + _GAP_CLASSES, 1 + 2 * _GAP_CLASSES))  # by return count


def _bucket_edges(n: int) -> np.ndarray:
    lo = np.zeros(n + 1, dtype=np.float64)
    for b in range(1, n + 1):
        k = b // 2
        lo[b] = float(2 ** k) if b % 2 == 0 else (1.0 if b == 1 else 3.0 * 2 ** (k - 1))
    return lo


_LO = _bucket_edges(_BUCKETS)          # lower edge of each bucket (and the end of the last)
_WIDTH = _LO[1:] - _LO[:-1]
# the same as plain lists, for scalar code (and for callers that inline density())
BUCKETS = _BUCKETS
EDGES = _LO.tolist()
INV_WIDTH = (1.0 / _WIDTH).tolist()


def age_bucket(age: int) -> int:
    """Half-octave bucket of ``age`` >= 0: 0, 1, 2, 3, [4, 6), [6, 8), [8, 12), ..."""
    if age < 2:
        return max(0, int(age))
    k = int(age).bit_length() - 1
    return min(_BUCKETS - 1, 2 * k + ((int(age) >> (k - 1)) & 1))


def _age_buckets(ages: np.ndarray) -> np.ndarray:
    """:func:`age_bucket` of an int64 array."""
    a = np.maximum(ages, 0)
    k = np.floor(np.log2(np.maximum(a, 1))).astype(np.int64)
    half = (a >> np.maximum(k - 1, 0)) & 1
    out = np.where(a < 2, a, 2 * k + half)
    return np.minimum(out, _BUCKETS - 1)


def reuse_class(returns: int, gap: float = -1.0) -> int:
    """Reuse class of a sequence that came back ``returns`` times, ``gap`` being the
    running mean of log2(1 + ticks between its returns) (-1: none yet).

    Class 0 is a sequence that never came back; the others pair "came back
    once" / "twice or more" with the gap in factor-4 buckets (< 4 ticks, < 16,
    ..., >= 16384): a session's cadence predicts its next return far better
    than recency (an agent that polls every few requests vs. a user who reads
    for minutes)."""
    if returns <= 0 or gap < 0:
        return 0
    g = min(_GAP_CLASSES - 1, int(gap) // 2)
    return 1 + (0 if returns == 1 else _GAP_CLASSES) + g


def next_gap(gap: float, age: int) -> float:
    """The running gap after one more return ``age`` ticks after the last use."""
    x = math.log2(1.0 + max(0, age))
    return x if gap < 0 else 0.5 * gap + 0.5 * x


class ReuseModel:
    """Online return-hazard estimate per reuse class (see the module docstring).

    Args:
        ghosts: how many evicted sequences are remembered (key -> class and
            start of their at-risk period) so that their return can still be
            observed; the oldest is forgotten (censored) first.  The tree
            keeps it at four times its nodes plus 1024, so memory stays in
            proportion to what is cached.
    """

    CLASSES = 1 + 2 * _GAP_CLASSES

    def __init__(self, ghosts: int = 8192) -> None:
        c = self.CLASSES
        # plain lists (a scalar update is ~5x cheaper than on a numpy array); arrays at rebuild
        self._events = [[0.0] * _BUCKETS for _ in range(c)]
        self._fin_count = [[0.0] * _BUCKETS for _ in range(c)]  # finished periods by end bucket
        self._fin_part = [[0.0] * _BUCKETS for _ in range(c)]   # their time inside that bucket
        self.max_ghosts = ghosts
        self._ghosts: OrderedDict[int, tuple[int, int, tuple]] = OrderedDict()  # key -> (class, since, history)
        self._running: dict[int, int] = {}  # class + CLASSES * (start tick >> _BIN) -> periods at risk
        self._pending = 0
        self._ends = 0
        self._haz: list[list[float]] = [[0.0] * _BUCKETS for _ in range(c)]
        self._index: list[list[float]] = [[0.0] * (_BUCKETS + 1) for _ in range(c)]
        self.observed = 0

    # --------------------------------------------------------------- periods
    def start(self, cls: int, since: int) -> None:
        """An at-risk period of class ``cls`` started at tick ``since`` (a leaf was used)."""
        k = cls + self.CLASSES * (since >> _BIN)
        self._running[k] = self._running.get(k, 0) + 1

    def end(self, cls: int, since: int, now: int, *, returned: bool) -> None:
        """The period started at ``since`` ended at ``now``: by a return, or not (censored)."""
        k = cls + self.CLASSES * (since >> _BIN)
        left = self._running.get(k, 0) - 1
        if left > 0:
            self._running[k] = left
        else:
            self._running.pop(k, None)
        age = now - since
        if age < 0:
            return
        if age < 2:
            b = age
        else:  # age_bucket, inlined (one call per request)
            k = age.bit_length() - 1
            b = 2 * k + ((age >> (k - 1)) & 1)
            if b >= _BUCKETS:
                b = _BUCKETS - 1
        self._fin_count[cls][b] += 1.0            # time at risk: whole buckets below b ...
        self._fin_part[cls][b] += age - EDGES[b]  # ... and this much of bucket b
        if returned:
            self._events[cls][b] += 1.0
            self.observed += 1
        self._pending += 1
        self._ends += 1
        if self._pending >= _REFRESH or 8 * self._pending >= self._ends:  # often while young
            self._refresh(now)

    def remember(self, key: int, cls: int, since: int, now: int, history: tuple[int, float]) -> None:
        """An evicted leaf of class ``cls`` whose period started at ``since``: its
        period goes on; watch for its return at ``key``.  ``history`` (returns,
        gap) is handed back by :meth:`on_miss`."""
        ghosts = self._ghosts
        if key in ghosts:
            old = ghosts.pop(key)
            self.end(old[0], old[1], now, returned=False)
        ghosts[key] = (cls, since, history)
        while len(ghosts) > self.max_ghosts:
            _, (g_cls, g_since, _h) = ghosts.popitem(last=False)
            self.end(g_cls, g_since, now, returned=False)  # censored: we stop watching

    def on_miss(self, key: int, now: int) -> tuple[int, float] | None:
        """A request's match stopped at ``key``: if it is a ghost, record the return and
        give the returning sequence's history, updated by this return (else ``None``)."""
        hit = self._ghosts.pop(key, None)
        if hit is None:
            return None
        cls, since, (returns, gap) = hit
        self.end(cls, since, now, returned=True)
        return returns + 1, next_gap(gap, now - since)

    # --------------------------------------------------------------- tables
    @property
    def events(self) -> np.ndarray:
        """Returns observed per (class, age bucket)."""
        return np.array(self._events)

    def exposure(self, now: int) -> np.ndarray:
        """Time at risk per (class, age bucket): finished periods plus the ones still
        running (counted up to their current age).  O(open periods + classes x buckets)."""
        count, part = np.array(self._fin_count), np.array(self._fin_part)
        if self._running:
            keys = np.fromiter(self._running, dtype=np.int64, count=len(self._running))
            cls, start = keys % self.CLASSES, keys // self.CLASSES
            n = np.fromiter(self._running.values(), dtype=np.float64, count=len(self._running))
            ages = np.maximum(now - ((start << _BIN) + (1 << _BIN) // 2), 0)
            b = _age_buckets(ages)
            np.add.at(count, (cls, b), n)
            np.add.at(part, (cls, b), n * (ages - _LO[b]))
        above = count.sum(axis=1, keepdims=True) - np.cumsum(count, axis=1)  # periods past bucket j
        return above * _WIDTH + part

    def _refresh(self, now: int) -> None:
        self._pending = 0
        ev, ex = self.events, self.exposure(now)
        # shrink each class toward its group (same return count, any gap), and the
        # group toward all classes, by one bucket width of pseudo time at risk
        pooled = ev.sum(axis=0) / np.maximum(ex.sum(axis=0), 1.0)  # 0 where nothing was at risk
        haz = np.empty_like(ev)
        for lo, hi in _GROUPS:
            g_ev, g_ex = ev[lo:hi].sum(axis=0), ex[lo:hi].sum(axis=0)
            group = (g_ev + pooled * _WIDTH) / (g_ex + _WIDTH)
            haz[lo:hi] = (ev[lo:hi] + group * _WIDTH) / (ex[lo:hi] + _WIDTH)
        cum = np.zeros((self.CLASSES, _BUCKETS + 1))
        np.cumsum(haz * _WIDTH, axis=1, out=cum[:, 1:])
        self._haz = haz.tolist()
        # hit density (LHD-style index): the best rate of returns per tick held that
        # keeping a leaf from age lo_i for some further time can reach
        surv = np.exp(-cum)                                            # S at bucket edges
        hw = haz * _WIDTH
        with np.errstate(divide="ignore", invalid="ignore"):
            held = np.where(hw > 1e-12, surv[:, :-1] * -np.expm1(-hw) / haz, surv[:, :-1] * _WIDTH)
        integ = np.zeros_like(surv)
        np.cumsum(held, axis=1, out=integ[:, 1:])
        # ages past the last bucket anything was at risk in have no data: index 0 there
        nb = min(_BUCKETS, int(np.flatnonzero(ex.sum(axis=0) > 0).max(initial=0)) + 2)
        s_, i_ = surv[:, :nb + 1], integ[:, :nb + 1]
        num = s_[:, :, None] - s_[:, None, :]
        den = i_[:, None, :] - i_[:, :, None]
        upper = np.triu(np.ones((nb + 1, nb + 1), dtype=bool), 1)[None]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(upper & (den > 0), num / den, 0.0)
        index = np.zeros((self.CLASSES, _BUCKETS + 1))
        index[:, :nb + 1] = ratio.max(axis=2)
        self._index = index.tolist()

    def hazard(self, cls: int, age: int) -> float:
        """Estimated returns per tick of a class-``cls`` leaf idle ``age`` ticks (as of the
        last table rebuild)."""
        return self._haz[cls][age_bucket(age)]

    def density(self, cls: int, age: int) -> float:
        """Expected returns per tick held for a leaf of class ``cls`` idle ``age`` ticks,
        at the best holding time, per half-octave age bucket (0 before any return
        was observed: then every leaf ties and eviction falls back to LRU)."""
        b = age_bucket(age)
        idx = self._index[cls]
        return idx[b] + (idx[b + 1] - idx[b]) * (age - EDGES[b]) * INV_WIDTH[b]

    def tables(self) -> list[list[float]]:
        """Per class, the density at each bucket's lower edge (``EDGES``); linear in between
        (slope ``INV_WIDTH``)."""
        return self._index

    def open_periods(self) -> int:
        """At-risk periods not ended yet (filed leaves plus ghosts)."""
        return sum(self._running.values())

    def ghost_count(self) -> int:
        return len(self._ghosts)
