"""The scheduler side's lookups, with the store asked off the scheduler's thread.

vLLM calls ``get_num_new_matched_tokens`` on its scheduler thread, between
forward passes: a lookup that waits for the L3 store (a round trip per probe:
a remote Redis or Mooncake store, a slow disk) holds up every running request's
next step.  hybridkv's core already asks the store on its read worker, with a
bounded wait (:class:`hybridkv.tiers.reads.ReadAhead`); :class:`Lookups` gives
the connector the same shape:

1. the lookup runs on the tiers' record alone (:meth:`.sources.TierView.hit`
   with a ``deferred`` list): L2's index and what the store is known to hold
   or lack.  Nothing left to ask: that is the answer.
2. A store whose last probes each answered within a quarter of ``wait_s``
   (:class:`TimedProbe`) is asked inline: handing a lookup to the probe thread
   and back costs more than such an answer (two GIL hand-overs, each up to
   Python's 5 ms switch interval when a save thread of the same process runs).
   A store that turns slow costs one slow inline probe (the backend's own
   timeouts and breaker bound it); its lookups go to the probe thread until
   its probes are fast again.
3. Otherwise a probe job runs the lookup on the probe thread, over a copy of
   what L2 holds, asking the store (its answers land in the record), and the
   scheduler waits for it at most ``wait_s``.  Done in time: its answer is the
   record's, now complete (L2 cannot change while the scheduler waits).
4. Not done: the lookup answers ``None`` (vLLM 0.32: "ask again later"; the
   request waits, the others run) and later calls answer from the record once
   the job is done.  A store that does not answer within ``give_up_s`` is
   given up on for that request (the record's answer: what it cannot vouch
   for is computed), and no new probe is queued while one has been running
   that long.

Every answer is the record's, read on the scheduler thread, so a hit never
counts a page the record does not hold (a load still clamps to what it reads).
Not thread-safe: the scheduler's thread calls it; the probe thread touches
only the record (thread-safe) and its own copies.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from functools import partial

from .sources import L2Held, TierView

__all__ = ["GIVE_UP_S", "Lookups", "TimedProbe"]

GIVE_UP_S = 2.0  # a probe still running after this long: answer from the record alone


class TimedProbe:
    """A store's ``exists`` that keeps how long its last ``keep`` calls took
    (whichever thread made them; a call that raised counts too)."""

    def __init__(self, probe: Callable[[list[bytes]], Sequence[bool]], keep: int = 8) -> None:
        if not callable(probe):
            raise TypeError(f"probe must be callable, got {type(probe).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self._probe = probe
        self._last: deque[float] = deque(maxlen=keep)

    def __call__(self, keys: list[bytes]) -> Sequence[bool]:
        t0 = time.perf_counter()
        try:
            return self._probe(keys)
        finally:
            self._last.append(time.perf_counter() - t0)

    def answers_within(self, limit_s: float) -> bool:
        """Its last ``keep`` calls each took less than ``limit_s`` (False before ``keep`` calls)."""
        last = list(self._last)
        return len(last) == self._last.maxlen and max(last) < limit_s


class Lookups:
    """Lookups of one scheduler-side connector (see the module docstring).

    Args:
        view: the tiers' record (:class:`.sources.TierView`).
        wait_s: how long a lookup waits for its probe before answering ``None`` (>= 0).
        count: adds to the connector's counters (``lookups_deferred``, ``lookup_probes``,
            ``lookup_probes_inline``, ``lookup_probes_given_up``: :data:`.metrics.COUNTERS`).
        times: the record's probe, timed (None: never ask inline).
        give_up_s: how long a probe may run before lookups answer without it (> 0).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, view: TierView, wait_s: float, count: Callable[..., None], *, times: TimedProbe | None = None,
                 give_up_s: float = GIVE_UP_S, clock: Callable[[], float] = time.monotonic) -> None:
        for name, v, low_ok in (("wait_s", wait_s, True), ("give_up_s", give_up_s, False)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (v == 0 and not low_ok):
                raise ValueError(f"{name} must be a number {'>=' if low_ok else '>'} 0, got {v!r}")
        self.view = view
        self.wait_s = float(wait_s)
        self.give_up_s = float(give_up_s)
        self._count = count
        self._times = times
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None  # started by the first probe
        self._pending: dict[str, tuple[Future, float]] = {}  # request -> its probe, queued at
        self._running: dict[int, float] = {}  # id of each probe not done -> queued at

    def hit(self, req_id: str, keys: dict[int, list[bytes]], local_tokens: int, max_tokens: int,
            unit: int, *, device_full: int = 0, l2_held: L2Held | None = None) -> int | None:
        """The window-safe hit of ``req_id``'s lookup (as :meth:`.sources.TierView.hit`,
        ``device_full`` and ``l2_held`` too; a probe job reads a copy of what L2 held,
        taken here), or ``None``: its probe is still running, ask again later.
        O(keys), plus the wait for a probe (at most ``wait_s``)."""
        ask = partial(self.view.hit, device_full=device_full, l2_held=l2_held)
        pending = self._pending.get(req_id)
        if pending is not None:
            fut, since = pending
            if not fut.done():
                if self._clock() - since < self.give_up_s:
                    return None
                self._count(lookup_probes_given_up=1)
            del self._pending[req_id]
            return ask(keys, local_tokens, max_tokens, unit, deferred=[])
        deferred: list[bytes] = []
        hit = ask(keys, local_tokens, max_tokens, unit, deferred=deferred)
        if not deferred or self._stuck():
            return hit
        if self._times is not None and self.wait_s and self._times.answers_within(self.wait_s / 4):
            self._count(lookup_probes_inline=1)
            return ask(keys, local_tokens, max_tokens, unit)  # a fast store: asked here
        fut = self._submit(ask, keys, local_tokens, max_tokens, unit, l2_held)
        if self.wait_s and not wait_for([fut], timeout=self.wait_s).not_done:
            # L2 did not change meanwhile (this thread owns it): the probe's answer is the record's
            return fut.result() if fut.exception() is None else ask(keys, local_tokens, max_tokens, unit,
                                                                           deferred=[])
        self._pending[req_id] = (fut, self._clock())
        self._count(lookups_deferred=1)
        return None

    def _submit(self, ask: Callable[..., int], keys: dict[int, list[bytes]], local_tokens: int,
                max_tokens: int, unit: int, l2_held: L2Held | None = None) -> Future:
        """Queue the probe job over copies of the keys and of what L2 holds now
        (read here, on the scheduler's thread: ``l2_held`` writes the tree's records)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-lookup")
        copy = {gi: list(ks) for gi, ks in keys.items()}
        fut = self._pool.submit(ask, copy, local_tokens, max_tokens, unit, in_l2=self.view.in_l2(copy, l2_held))
        self._running[id(fut)] = self._clock()
        fut.add_done_callback(lambda f: self._running.pop(id(f), None))
        self._count(lookup_probes=1)
        return fut

    def _stuck(self) -> bool:
        """A probe has been running for ``give_up_s`` or more (the store does not answer)."""
        now = self._clock()
        return any(now - t >= self.give_up_s for t in list(self._running.values()))

    def drop(self, req_id: str) -> None:
        """``req_id`` finished or was aborted: its pending probe is forgotten (it still
        records its answers).  O(1)."""
        self._pending.pop(req_id, None)

    def pending(self) -> int:
        """Lookups waiting for their probe."""
        return len(self._pending)

    def close(self) -> None:
        """Stop the probe thread (a probe running finishes on its own)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

