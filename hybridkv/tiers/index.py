"""What an L3 store holds, as far as one engine knows: the record lookups read.

One record for every host: the core's tier coordinator (its read-ahead and
its write queue, :mod:`hybridkv.tiers.reads`, :mod:`hybridkv.tiers.writes`)
and the vLLM connector's scheduler side keep a :class:`StoreIndex` each, with
the same defaults (:data:`STORE_KEYS_MAX`, :data:`ABSENT_TTL_S`).

A lookup must not cost a round trip to the store for every page of every
prompt.  :class:`StoreIndex` remembers, per chained page key
(:mod:`hybridkv.tiers.keys`):

* keys this engine **queued** for storing (a writer will put them; a load
  that races the write waits for it, or fails and reports the keys lost);
* keys **stored**: read back intact, or found by a probe;
* keys found **absent** by a probe, for ``absent_ttl_s`` only (another engine
  sharing the store may write them; past the TTL they are probed again).

:meth:`StoreIndex.present` answers from the record and probes only the keys it
has no answer for, in one batched call (the store's ``exists``), recording
the answers; :meth:`StoreIndex.leading` does the same for a lookup whose hit is
the leading run of keys, probing in growing chunks up to the first absent key.
A key a read found missing or corrupt is reported with
:meth:`StoreIndex.lost` and is absent from then on until stored again.  The
record is bounded (oldest entries out): an entry that falls out is only
probed again, never answered wrongly.

A hit is still clamped to what a load actually reads (the seed's rule): the
index decides what is worth loading, the load decides what is served.

Thread-safe: one lock guards the tables, never held across a probe (the core's
read worker looks up while the engine thread records its writes).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from enum import IntEnum

import numpy as np

__all__ = ["ABSENT_TTL_S", "Known", "STORE_KEYS_MAX", "StoreIndex"]

Probe = Callable[[list[bytes]], Sequence[bool]]
STORE_KEYS_MAX = 1 << 20  # keys remembered as queued/stored, and as absent (~150 MB at most)
ABSENT_TTL_S = 2.0  # an "absent" probe answer is trusted this long (another engine may write)


class Known(IntEnum):
    """A key's state in a :class:`StoreIndex` (absent keys live in their own table)."""

    QUEUED = 1
    STORED = 2


class StoreIndex:
    """The keys one L3 store holds, as this engine knows them (see module docstring).

    Args:
        probe: the store's batched ``exists`` (``None``: never probe; only what
            this engine queued or read counts).  A probe that raises counts as
            "absent" for this lookup and is not recorded (a store that is down
            degrades to a miss).
        bound: most keys remembered as queued/stored, and as absent (> 0).
        absent_ttl_s: how long an "absent" answer is trusted (>= 0).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, probe: Probe | None, *, bound: int = STORE_KEYS_MAX, absent_ttl_s: float = ABSENT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if probe is not None and not callable(probe):
            raise TypeError(f"probe must be callable or None, got {type(probe).__name__}")
        if isinstance(bound, bool) or not isinstance(bound, int) or bound <= 0:
            raise ValueError(f"bound must be a positive int, got {bound!r}")
        if isinstance(absent_ttl_s, bool) or not isinstance(absent_ttl_s, (int, float)) or absent_ttl_s < 0:
            raise ValueError(f"absent_ttl_s must be a number >= 0, got {absent_ttl_s!r}")
        self._probe = probe
        self._bound = bound
        self._ttl = float(absent_ttl_s)
        self._clock = clock
        self._known: OrderedDict[bytes, Known] = OrderedDict()
        self._absent: OrderedDict[bytes, float] = OrderedDict()  # key -> trusted until
        self._touched: OrderedDict[bytes, float] = OrderedDict()  # key -> last touch asked
        self.counters = {"probes": 0, "probed_keys": 0, "probe_errors": 0, "answered_keys": 0, "lost_keys": 0}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._known)

    def state(self, key: bytes) -> Known | None:
        """The record of ``key`` (``None``: unknown or absent).  O(1)."""
        with self._lock:
            return self._known.get(key)

    def _remember(self, keys: Sequence[bytes], state: Known) -> None:
        known, absent = self._known, self._absent
        for k in keys:
            if state == Known.QUEUED and known.get(k) == Known.STORED:
                known.move_to_end(k)
                continue
            known[k] = state
            known.move_to_end(k)
            absent.pop(k, None)
        self._trim(known)

    def _trim(self, table: OrderedDict) -> None:
        """Drop ``table``'s oldest entries past the bound.  Amortised O(1)."""
        while len(table) > self._bound:
            table.popitem(last=False)

    def _set_absent(self, keys: Sequence[bytes], until: float) -> None:
        """``keys`` are absent until ``until`` (newest last).  O(n)."""
        absent = self._absent
        for k in keys:
            absent[k] = until
            absent.move_to_end(k)
        self._trim(absent)

    def queued(self, keys: Sequence[bytes]) -> None:
        """This engine handed ``keys`` to a writer: they count as present.  O(n)."""
        with self._lock:
            self._remember(keys, Known.QUEUED)

    def stored(self, keys: Sequence[bytes]) -> None:
        """``keys`` are in the store (read back intact, or a writer confirmed).  O(n)."""
        with self._lock:
            self._remember(keys, Known.STORED)

    def lost(self, keys: Sequence[bytes]) -> None:
        """A read found ``keys`` missing or corrupt (or their write was dropped):
        absent until stored again.  O(n)."""
        keys = list(keys)
        with self._lock:
            for k in keys:
                if self._known.pop(k, None) is not None:
                    self.counters["lost_keys"] += 1
            self._set_absent(keys, self._clock() + self._ttl)

    def _answer(self, key: bytes, now: float) -> bool | None:
        """The record's answer for ``key`` at ``now``: True (stored or queued), False
        (found absent within the TTL) or None (no answer: ask the store).  O(1)."""
        if key in self._known:
            return True
        until = self._absent.get(key)
        return False if until is not None and until >= now else None

    def held(self, keys: Sequence[bytes]) -> np.ndarray:
        """Bool per key: the record holds it as queued or stored (never probes, not
        counted as an answer): what a writer need not store again.  O(n)."""
        with self._lock:
            known = self._known
            return np.fromiter((k in known for k in keys), dtype=bool, count=len(keys))

    def _record(self, keys: Sequence[bytes], got: list[bool]) -> None:
        """One probe's answers (under the lock): present keys as stored, the others
        absent for the TTL.  O(n)."""
        self.counters["probes"] += 1
        self.counters["probed_keys"] += len(keys)
        self._remember([k for k, ok in zip(keys, got) if ok], Known.STORED)
        self._set_absent([k for k, ok in zip(keys, got) if not ok], self._clock() + self._ttl)

    def present(self, keys: Sequence[bytes], *, probe: bool = True,
                deferred: list[bytes] | None = None) -> np.ndarray:
        """Bool per key: whether the store holds it (or will: queued).  Keys with no
        trusted answer are probed in one batched call when ``probe`` (else absent);
        with a ``deferred`` list they are not probed but appended to it (absent for
        this answer: a caller that probes them elsewhere asks again).
        O(n) plus one probe of the unknown keys."""
        out = np.zeros(len(keys), dtype=bool)
        at: list[int] = []
        with self._lock:
            now = self._clock()
            for i, k in enumerate(keys):
                known = self._answer(k, now)
                if known is None:
                    at.append(i)
                else:
                    out[i] = known
            self.counters["answered_keys"] += len(keys) - len(at)
        if at and deferred is not None:
            deferred.extend(keys[i] for i in at)
        elif at and probe and self._probe is not None:
            self._ask([keys[i] for i in at], at, out)
        return out

    def leading(self, keys: Sequence[bytes], held: np.ndarray | None = None, *,
                first: int = 16, grow: int = 4, deferred: list[bytes] | None = None) -> int:
        """How many leading ``keys`` the store holds (or will), for a lookup whose hit is
        the leading run: ``held`` (bool per key, optional) marks keys known present
        elsewhere (a faster tier), not asked about.  The record answers first; unknown
        keys are probed from the first one on, in chunks of ``first`` keys, ``grow``
        times more each round, and probing stops at the first absent key: a miss costs
        one small probe, not one key per page of the prompt; a hit of ``n`` unknown
        pages ``O(log n)`` probes.  Answers are recorded as :meth:`present` records
        them; a probe that fails ends the run there.  With a ``deferred`` list nothing
        is probed: the first chunk's unknown keys are appended to it and the run ends
        at the first of them.  O(run) plus the probes."""
        for name, v in (("first", first), ("grow", grow)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if held is not None and len(held) != len(keys):
            raise ValueError(f"held must have one flag per key ({len(keys)}), got {len(held)}")
        n, i, chunk = len(keys), 0, first
        while i < n:
            ask: list[bytes] = []
            at: list[int] = []
            stop = n  # a key known absent ends the run
            j = i
            with self._lock:
                now = self._clock()
                while j < n and len(ask) < chunk:
                    if held is None or not held[j]:
                        known = self._answer(keys[j], now)
                        if known is None:
                            ask.append(keys[j])
                            at.append(j)
                        else:
                            self.counters["answered_keys"] += 1
                            if not known:
                                stop = j
                                break
                    j += 1
            if ask and deferred is not None:
                deferred.extend(ask)
                return at[0]
            if ask:
                got = np.zeros(len(ask), dtype=bool)
                if self._probe is not None:
                    self._ask(ask, list(range(len(ask))), got)
                if not got.all():
                    return at[int(np.argmin(got))]
            if stop < n:
                return stop
            i = j
            chunk *= grow
        return n

    def _ask(self, ask: list[bytes], at: list[int], out: np.ndarray) -> None:
        """Probe ``ask`` (outside the lock) and record the answers into ``out[at]``;
        a probe that raises or answers the wrong number of keys records nothing."""
        try:
            got = [bool(x) for x in self._probe(ask)]  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - a store that is down is a miss, not a failed lookup
            got = None
        with self._lock:
            if got is None or len(got) != len(ask):
                self.counters["probes"] += 1
                self.counters["probed_keys"] += len(ask)
                self.counters["probe_errors"] += 1
                return
            self._record(ask, got)
        for i, ok in zip(at, got):
            out[i] = ok

    def due_touch(self, keys: Sequence[bytes], interval_s: float) -> list[bytes]:
        """Of ``keys``, those the store holds (or will) whose last touch is older than
        ``interval_s``; they count as touched now.  A hot prefix served from a faster
        tier keeps its store entries alive this way (the seed's repair case 3)
        without a touch per lookup.  O(n)."""
        out = []
        with self._lock:
            now = self._clock()
            touched = self._touched
            for k in keys:
                if k not in self._known:
                    continue
                last = touched.get(k)
                if last is not None and now - last < interval_s:
                    continue
                touched[k] = now
                touched.move_to_end(k)
                out.append(k)
            self._trim(touched)
        return out

    def stats(self) -> dict[str, int]:
        """Counters plus the record's sizes."""
        with self._lock:
            return {**self.counters, "known_keys": len(self._known), "absent_keys": len(self._absent)}
