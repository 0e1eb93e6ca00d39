"""The tier manager: L3 I/O on worker threads, never an exception into the engine.

Reads (exists, get, and the owner's fetch jobs) run on their own worker with
their own queue, so a read never waits behind queued writes; writes and
touches run in submission order on a second worker.  The backends are
thread-safe (their conformance suite runs two threads), so the two workers
only share the backend.  Because the queues are separate a read may miss a
page whose write is still queued: that is a miss, never wrong data.

The engine thread only waits where it asks to: a blocking read waits up to
``timeout_s`` and treats whatever did not arrive as a miss; the owner
(:class:`~hybridkv.tiers.tiered.TieredCache`) waits for its fetch jobs at
most its budget.  Reads have a circuit breaker: a read that fails or takes
longer than ``timeout_s`` counts as a failure; after ``read_breaker[0]``
consecutive failures reads are refused (misses, counted in
``l3_reads_skipped``) for ``read_breaker[1]`` seconds, then one probe read is
let through, which the caller should not wait for (:meth:`read_gate`).
Writes are fire-and-forget (write-behind) with a bounded queue; when it is
full a write is dropped and counted, never blocking the engine.  A write's
values may be given as an ``encode`` callable that runs on the write worker
(payload encoding off the engine thread).  Touches are rate-limited per key.

On GPU the host<->device copies run on a side stream of the owner; this
class only moves L3 bytes.

Counters (``stats()``): ``l3_reads``/``l3_read_pages``/``l3_read_hits``,
``l3_reads_skipped`` (breaker open or read queue full), ``l3_read_failures``,
``l3_writes_queued``/``l3_writes_dropped``/``l3_write_pages_ok``/``l3_write_failed``,
``l3_write_pages_gone`` (an encode found the page gone), ``l3_touches``/
``l3_touches_skipped``, ``l3_timeouts``, ``l3_errors``; ``l3_read_breaker_open``
(0/1) and ``l3_read_breaker_trips``.

Events: ``listeners`` (callables taking a :class:`~hybridkv.tiers.events.TierEvent`
of tier ``"L3"``) hear pages whose write *succeeded* (on the write worker,
when the write was queued with ``event_keys``) and pages the owner found gone
(:meth:`lost`).  L3 stores evict on their own without telling; a page is
announced as removed when a read of it misses.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin on Python 3.10
from typing import Any, Callable, Sequence

from .events import TierEvent, TierListener, emit
from .storage.base import CircuitBreaker, StorageBackend, backend_lacks

__all__ = ["TierManager"]

logger = logging.getLogger("hybridkv.tiers")
_STOP = object()


class TierManager:
    """Asynchronous front of one L3 :class:`StorageBackend`.

    Args:
        backend: the L3 store (its own faults already degrade to misses).
        timeout_s: how long a blocking read (:meth:`exists`, :meth:`get`)
            waits before it counts as a miss; a read slower than this counts
            as a failure for the read breaker.
        max_queued_writes: pages of pending writes beyond which new writes
            are dropped (counted in ``l3_writes_dropped``).
        touch_interval_s: a key is touched at most once per interval.
        clock: monotonic clock (tests pass a fake one).
        read_breaker: ``(failures, cooldown_s)`` of the read circuit breaker.
        max_queued_reads: read jobs waiting beyond which new reads are refused.
    """

    def __init__(self, backend: StorageBackend, *, timeout_s: float = 5.0, max_queued_writes: int = 65536,
                 touch_interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 read_breaker: tuple[int, float] = (3, 5.0), max_queued_reads: int = 1024) -> None:
        if backend_lacks(backend):
            raise TypeError(f"backend must implement StorageBackend, got {type(backend).__name__} "
                            f"(lacks {', '.join(backend_lacks(backend))})")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_queued_writes < 1:
            raise ValueError(f"max_queued_writes must be >= 1, got {max_queued_writes}")
        if touch_interval_s < 0:
            raise ValueError(f"touch_interval_s must be >= 0, got {touch_interval_s}")
        if max_queued_reads < 1:
            raise ValueError(f"max_queued_reads must be >= 1, got {max_queued_reads}")
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.max_queued_writes = int(max_queued_writes)
        self.max_queued_reads = int(max_queued_reads)
        self.touch_interval_s = float(touch_interval_s)
        self.read_breaker = CircuitBreaker(int(read_breaker[0]), float(read_breaker[1]))
        self._clock = clock
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued_write_pages = 0
        self._queued_reads = 0
        self._last_touch: dict[bytes, float] = {}
        self.counters = dict.fromkeys(
            ("l3_reads", "l3_read_pages", "l3_read_hits", "l3_reads_skipped", "l3_read_failures",
             "l3_writes_queued", "l3_writes_dropped", "l3_write_pages_ok", "l3_write_failed",
             "l3_write_pages_gone", "l3_touches", "l3_touches_skipped", "l3_timeouts", "l3_errors"), 0)
        self.listeners: list[TierListener] = []
        self._swa_written: set[bytes] = set()  # full keys whose SWA was written (store events' flags)
        self._closed = False
        self._reader = threading.Thread(target=self._run, args=(self._reads,), kwargs={"reads": True},
                                        name="hybridkv-l3-read", daemon=True)
        self._writer = threading.Thread(target=self._run, args=(self._writes,), kwargs={"reads": False},
                                        name="hybridkv-l3-write", daemon=True)
        self._reader.start()
        self._writer.start()

    # ---------------------------------------------------------------- workers
    def _run(self, q: queue.Queue, *, reads: bool) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            fn, fut, n_write = item  # on the read queue, n_write is 1 for a tracked read, 0 for a marker
            tracked = reads and n_write > 0
            t0 = time.monotonic()
            failed = False
            try:
                if tracked and self.read_breaker.state == "open":
                    self.count("l3_reads_skipped")  # queued before the breaker opened: skip
                    tracked = False
                    result = None
                else:
                    result = fn()
            except Exception as exc:  # noqa: BLE001 - the backend contract says it cannot raise; be sure
                failed = True
                self.count("l3_errors")
                logger.warning("L3 %s failed (%s: %s); treated as a miss", getattr(fn, "__name__", "op"),
                               type(exc).__name__, exc)
                result = None
            finally:
                with self._lock:
                    if reads:
                        self._queued_reads -= 1
                    elif n_write:
                        self._queued_write_pages -= n_write
            if tracked:
                if failed or time.monotonic() - t0 > self.timeout_s:
                    self._read_failed()
                else:
                    self.read_breaker.record_success()
            if fut is not None and not fut.done():
                fut.set_result(result)

    def _read_failed(self) -> None:
        self.count("l3_read_failures")
        self.read_breaker.record_failure()

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (thread safe; the owner counts what it skipped)."""
        with self._lock:
            self.counters[name] += n

    def _submit(self, fn: Callable[[], Any], *, wait: bool, n_write: int = 0) -> Future | None:
        """Queue a write-side job (writes, touches, flush markers)."""
        if self._closed:
            return None
        fut: Future | None = Future() if wait else None
        self._writes.put((fn, fut, n_write))
        return fut

    def read_gate(self) -> str | None:
        """May a read go out now?  ``"closed"`` (yes), ``"probe"`` (yes, the breaker's
        one trial read: do not wait for it) or None (no: count it as skipped)."""
        if self._closed:
            return None
        state = self.read_breaker.state
        if not self.read_breaker.allow():
            return None
        return "probe" if state == "half-open" else "closed"

    def submit_read(self, fn: Callable[[], Any], *, gated: bool = True) -> Future | None:
        """Run ``fn`` on the read worker (ahead of every queued write); its result
        (None if it raised) completes the returned future.  None (counted in
        ``l3_reads_skipped``) when closed, the breaker refuses (``gated``) or the
        read queue is full.  ``fn`` may call :meth:`backend_exists` / :meth:`backend_get`."""
        if self._closed or (gated and self.read_gate() is None):
            self.count("l3_reads_skipped")
            return None
        with self._lock:
            if self._queued_reads >= self.max_queued_reads:
                self.counters["l3_reads_skipped"] += 1
                return None
            self._queued_reads += 1
        fut: Future = Future()
        self._reads.put((fn, fut, 1))
        return fut

    def _wait(self, fut: Future | None, timeout_s: float | None) -> Any:
        if fut is None:
            return None
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            self.timed_out(timeout)
            return None

    def timed_out(self, waited_s: float) -> None:
        """A caller stopped waiting for a read after ``waited_s``: count it (and tell the breaker)."""
        self.count("l3_timeouts")
        self._read_failed()
        logger.warning("L3 read did not finish within %.3g s; treated as a miss", waited_s)

    # --------------------------------------------------------------- reads
    def backend_exists(self, keys: list[bytes]) -> list[bool]:
        """``backend.exists`` (for read jobs on the read worker)."""
        res = self.backend.exists(keys) if keys else []
        return [bool(r) for r in res] if len(res) == len(keys) else [False] * len(keys)

    def backend_get(self, keys: list[bytes]) -> list[Any]:
        """``backend.get``, counted (for read jobs on the read worker)."""
        if not keys:
            return []
        self.count("l3_reads")
        self.count("l3_read_pages", len(keys))
        res = self.backend.get(keys)
        if len(res) != len(keys):
            return [None] * len(keys)
        self.count("l3_read_hits", sum(v is not None for v in res))
        return list(res)

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool]:
        """Which keys L3 holds (blocks up to the timeout; late, refused or failed = False)."""
        keys = list(keys)
        if not keys:
            return []
        res = self._wait(self.submit_read(lambda: self.backend_exists(keys)), timeout_s)
        return list(res) if res is not None and len(res) == len(keys) else [False] * len(keys)

    def get(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[Any]:
        """Verified values or ``None`` per key (blocks up to the timeout)."""
        keys = list(keys)
        if not keys:
            return []
        res = self._wait(self.submit_read(lambda: self.backend_get(keys)), timeout_s)
        if res is None or len(res) != len(keys):
            return [None] * len(keys)
        return list(res)

    def get_async(self, keys: Sequence[bytes], done: Callable[[list[Any]], None]) -> bool:
        """Read ``keys`` in the background and call ``done(values)`` on the read worker.

        ``done`` must not raise (exceptions are logged and counted).  Returns
        False if the read was refused (closed, breaker open, queue full).
        """
        keys = list(keys)

        def job() -> None:
            done(self.backend_get(keys))

        return self.submit_read(job) is not None

    # -------------------------------------------------------------- writes
    def put_async(self, keys: Sequence[bytes], values: Sequence[Any] | None = None, *,
                  encode: Callable[[], Sequence[Any]] | None = None,
                  event_keys: Sequence[bytes] | None = None, swa: bool = False,
                  done: Callable[[list[bytes]], None] | None = None) -> bool:
        """Queue a write; False (counted as dropped) if the queue is full or closed.

        Give ``values`` or ``encode``: a callable run on the write worker that
        returns one value per key, or None for a key whose source is gone (not
        written, counted in ``l3_write_pages_gone``).  ``event_keys[i]``:
        full-KV page key of value i, announced to :attr:`listeners` as
        ``store`` (or ``swa_store`` when ``swa``) once the write succeeded.
        ``done(missed)`` runs on the write worker after the write was tried, with
        the keys that were not stored (the put failed or raised, or ``encode``
        gave None), never when this returns False.
        """
        if (values is None) == (encode is None):
            raise ValueError("give exactly one of values and encode")
        keys = list(keys)
        vals = list(values) if values is not None else None
        if vals is not None and len(vals) != len(keys):
            raise ValueError(f"values has {len(vals)} entries for {len(keys)} keys")
        ev_keys = list(event_keys) if event_keys is not None else None
        if ev_keys is not None and len(ev_keys) != len(keys):
            raise ValueError(f"event_keys has {len(ev_keys)} entries for {len(keys)} keys")
        n = len(keys)
        if n == 0:
            return True
        with self._lock:
            if self._closed or self._queued_write_pages + n > self.max_queued_writes:
                self.counters["l3_writes_dropped"] += n
                return False
            self._queued_write_pages += n
            self.counters["l3_writes_queued"] += n

        def job() -> None:
            stored: set[bytes] = set()
            try:
                write(stored)
            finally:
                if done is not None:
                    done([k for k in keys if k not in stored])

        def write(stored: set[bytes]) -> None:
            ks, ev, vs = keys, ev_keys, vals
            if vs is None:
                got = list(encode())  # type: ignore[misc]
                if len(got) != n:
                    raise ValueError(f"encode returned {len(got)} values for {n} keys")
                keep = [i for i, v in enumerate(got) if v is not None]
                self.count("l3_write_pages_gone", n - len(keep))
                ks, vs = [keys[i] for i in keep], [got[i] for i in keep]
                ev = [ev_keys[i] for i in keep] if ev_keys is not None else None
                if not ks:
                    return
            ok = self.backend.put(ks, vs)
            stored.update(k for k, o in zip(ks, ok) if o)
            good = sum(bool(x) for x in ok)
            self.count("l3_write_pages_ok", good)
            self.count("l3_write_failed", len(ks) - good)
            if ev is not None:
                self._announce([k for k, o in zip(ev, ok) if o], swa=swa)

        self._submit(job, wait=False, n_write=n)
        return True

    def _announce(self, written: list[bytes], *, swa: bool) -> None:
        """Tell listeners about pages now stored (worker thread)."""
        if swa:
            with self._lock:
                self._swa_written.update(written)
                if len(self._swa_written) > 4_000_000:
                    self._swa_written.clear()  # bounded; only store flags get conservative
        if not self.listeners or not written:
            return
        if swa:
            emit(self.listeners, TierEvent("L3", "swa_store", tuple(written), (True,) * len(written)))
        else:
            with self._lock:
                flags = tuple(k in self._swa_written for k in written)
            emit(self.listeners, TierEvent("L3", "store", tuple(written), flags))

    def lost(self, keys: Sequence[bytes], *, swa: bool = False) -> None:
        """The owner found pages (full-KV keys) gone from L3 (a read missed): announce
        ``remove`` (or ``swa_remove``) to listeners.  O(len(keys))."""
        keys = list(keys)
        if swa:
            with self._lock:
                self._swa_written.difference_update(keys)
        if keys and self.listeners:
            emit(self.listeners, TierEvent("L3", "swa_remove" if swa else "remove", tuple(keys),
                                           (False,) * len(keys) if swa else ()))

    def touch(self, keys: Sequence[bytes]) -> int:
        """Refresh L3 recency of ``keys`` not touched within the interval; returns how many."""
        now = self._clock()
        due = []
        last = self._last_touch
        for k in keys:
            t = last.get(k)
            if t is None or now - t >= self.touch_interval_s:
                due.append(k)
                last[k] = now
        self.count("l3_touches_skipped", len(keys) - len(due))
        if len(last) > 1_000_000:  # bounded memory: forget old stamps (only rate limiting suffers)
            last.clear()
        if due:
            self.count("l3_touches", len(due))
            self._submit(lambda: self.backend.touch(due), wait=False)
        return len(due)

    # ------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far (reads and writes) ran; False on timeout."""
        if self._closed:
            return True
        deadline = time.monotonic() + timeout_s
        futs = []
        for q in (self._reads, self._writes):
            fut: Future = Future()
            if q is self._reads:
                with self._lock:
                    self._queued_reads += 1
            q.put((lambda: None, fut, 0))
            futs.append(fut)
        try:
            for fut in futs:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except FutureTimeout:
            return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain the queues, stop the workers (the backend stays open).  Idempotent."""
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        self._reads.put(_STOP)
        self._writes.put(_STOP)
        self._reader.join(timeout=timeout_s)
        self._writer.join(timeout=timeout_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out["l3_queued_write_pages"] = self._queued_write_pages
            out["l3_queued_reads"] = self._queued_reads
        out["l3_read_breaker_open"] = int(self.read_breaker.state == "open")
        out["l3_read_breaker_trips"] = self.read_breaker.opened
        return out
