"""The tier manager: L3 I/O on a worker thread, never an exception into the engine.

Every L3 operation (exists, get, put, touch) runs on one worker thread, in
submission order, so a read submitted after a write of the same key sees it
(FIFO), and the engine thread only waits where it must: a match waits for
its L3 reads up to ``timeout_s`` and treats whatever did not arrive as a miss
(the hit is clamped to what was actually loaded).  Writes are fire-and-forget
(write-behind) with a bounded queue; when it is full a write is dropped and
counted, never blocking the engine.  Touches are rate-limited per key.

On GPU the host<->device copies run on a side stream of the owner
(:class:`~hybridkv.tiers.tiered.TieredCache`); this class only moves L3 bytes.

Counters (``stats()``): ``l3_reads``/``l3_read_pages``/``l3_read_hits``,
``l3_writes_queued``/``l3_writes_dropped``/``l3_write_pages_ok``/``l3_write_failed``,
``l3_touches``/``l3_touches_skipped``, ``l3_timeouts``, ``l3_errors``.

Events: ``listeners`` (callables taking a :class:`~hybridkv.tiers.events.TierEvent`
of tier ``"L3"``) hear pages whose write *succeeded* (on the worker thread,
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
from typing import Any, Callable, Sequence

from .events import TierEvent, TierListener, emit
from .storage.base import StorageBackend

__all__ = ["TierManager"]

logger = logging.getLogger("hybridkv.tiers")
_STOP = object()


class TierManager:
    """Asynchronous front of one L3 :class:`StorageBackend`.

    Args:
        backend: the L3 store (its own faults already degrade to misses).
        timeout_s: how long a blocking read (:meth:`exists`, :meth:`get`)
            waits before it counts as a miss.
        max_queued_writes: pages of pending writes beyond which new writes
            are dropped (counted in ``l3_writes_dropped``).
        touch_interval_s: a key is touched at most once per interval.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, backend: StorageBackend, *, timeout_s: float = 5.0, max_queued_writes: int = 65536,
                 touch_interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(backend, StorageBackend):
            raise TypeError(f"backend must implement StorageBackend, got {type(backend).__name__}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_queued_writes < 1:
            raise ValueError(f"max_queued_writes must be >= 1, got {max_queued_writes}")
        if touch_interval_s < 0:
            raise ValueError(f"touch_interval_s must be >= 0, got {touch_interval_s}")
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.max_queued_writes = int(max_queued_writes)
        self.touch_interval_s = float(touch_interval_s)
        self._clock = clock
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued_write_pages = 0
        self._last_touch: dict[bytes, float] = {}
        self.counters = dict.fromkeys(
            ("l3_reads", "l3_read_pages", "l3_read_hits", "l3_writes_queued", "l3_writes_dropped",
             "l3_write_pages_ok", "l3_write_failed", "l3_touches", "l3_touches_skipped",
             "l3_timeouts", "l3_errors"), 0)
        self.listeners: list[TierListener] = []
        self._swa_written: set[bytes] = set()  # full keys whose SWA was written (store events' flags)
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="hybridkv-l3", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- worker
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, fut, n_write = item
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - the backend contract says it cannot raise; be sure
                self._count("l3_errors")
                logger.warning("L3 %s failed (%s: %s); treated as a miss", getattr(fn, "__name__", "op"),
                               type(exc).__name__, exc)
                result = None
            finally:
                if n_write:
                    with self._lock:
                        self._queued_write_pages -= n_write
            if fut is not None:
                fut.set_result(result)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _submit(self, fn: Callable[[], Any], *, wait: bool, n_write: int = 0) -> Future | None:
        if self._closed:
            return None
        fut: Future | None = Future() if wait else None
        self._queue.put((fn, fut, n_write))
        return fut

    def _wait(self, fut: Future | None, timeout_s: float | None) -> Any:
        if fut is None:
            return None
        try:
            return fut.result(timeout=self.timeout_s if timeout_s is None else timeout_s)
        except TimeoutError:
            self._count("l3_timeouts")
            logger.warning("L3 read did not finish within %.3g s; treated as a miss", self.timeout_s)
            return None

    # --------------------------------------------------------------- reads
    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool]:
        """Which keys L3 holds (blocks up to the timeout; late or failed = False)."""
        keys = list(keys)
        if not keys:
            return []
        res = self._wait(self._submit(lambda: self.backend.exists(keys), wait=True), timeout_s)
        return [bool(r) for r in res] if res is not None and len(res) == len(keys) else [False] * len(keys)

    def get(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[Any]:
        """Verified values or ``None`` per key (blocks up to the timeout)."""
        keys = list(keys)
        if not keys:
            return []
        self._count("l3_reads")
        self._count("l3_read_pages", len(keys))
        res = self._wait(self._submit(lambda: self.backend.get(keys), wait=True), timeout_s)
        if res is None or len(res) != len(keys):
            return [None] * len(keys)
        self._count("l3_read_hits", sum(v is not None for v in res))
        return list(res)

    def get_async(self, keys: Sequence[bytes], done: Callable[[list[Any]], None]) -> bool:
        """Read ``keys`` in the background and call ``done(values)`` on the worker.

        ``done`` must not raise (exceptions are logged and counted).  Returns
        False if the manager is closed.
        """
        keys = list(keys)

        def job() -> None:
            self._count("l3_reads")
            self._count("l3_read_pages", len(keys))
            values = self.backend.get(keys)
            self._count("l3_read_hits", sum(v is not None for v in values))
            done(list(values))

        return self._submit(job, wait=False) is not None or not self._closed

    # -------------------------------------------------------------- writes
    def put_async(self, keys: Sequence[bytes], values: Sequence[Any], *,
                  event_keys: Sequence[bytes] | None = None, swa: bool = False) -> bool:
        """Queue a write; False (counted as dropped) if the queue is full or closed.

        ``event_keys[i]``: full-KV page key of value i, announced to
        :attr:`listeners` as ``store`` (or ``swa_store`` when ``swa``) once the
        write succeeded.
        """
        keys, values = list(keys), list(values)
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
            ok = self.backend.put(keys, values)
            good = sum(bool(x) for x in ok)
            self._count("l3_write_pages_ok", good)
            self._count("l3_write_failed", n - good)
            if ev_keys is not None:
                self._announce([k for k, o in zip(ev_keys, ok) if o], swa)

        self._submit(job, wait=False, n_write=n)
        return True

    def _announce(self, written: list[bytes], swa: bool) -> None:
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
        self._count("l3_touches_skipped", len(keys) - len(due))
        if len(last) > 1_000_000:  # bounded memory: forget old stamps (only rate limiting suffers)
            last.clear()
        if due:
            self._count("l3_touches", len(due))
            self._submit(lambda: self.backend.touch(due), wait=False)
        return len(due)

    # ------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far ran; False on timeout."""
        fut = self._submit(lambda: None, wait=True)
        if fut is None:
            return True
        try:
            fut.result(timeout=timeout_s)
            return True
        except TimeoutError:
            return False

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, stop the worker (the backend stays open).  Idempotent."""
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        self._queue.put(_STOP)
        self._worker.join(timeout=timeout_s)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out["l3_queued_write_pages"] = self._queued_write_pages
        return out
