"""Worker side: saves leave the engine step (one background thread per worker).

A save has two parts:

1. *copy out*: gather the request's blocks from vLLM's KV tensors into host
   rows (:func:`.kvio.gather_host`).  Until this is done the blocks must not be
   reused by vLLM.
2. *store*: write the rows into L2 and through to L3 (``exists`` + framing,
   checksums, file or network I/O): the slow part, which never needs vLLM's
   blocks.

Prefill saves (pages completed by this step's prefill chunk, of a request
that keeps running) copy out inside ``wait_for_save``: vLLM may free a
sliding-window block as soon as the window has moved past it, or preempt the
request, without telling the connector, so the rows are taken while the
blocks are certainly intact.  The store is queued.

End-of-request saves use vLLM's delayed-free protocol: the scheduler-side
``request_finished`` returned ``True``, so vLLM keeps the request's blocks
until the worker lists it in ``finished_sending``.  Both parts run in the
thread; the request is reported finished as soon as its copy-out is done
(before the store), which is when vLLM may reuse the blocks.

Each job names the L2 row of every page it stores (``slots``: the scheduler's
index of L2 assigned them, :mod:`.l2`); the thread writes the rows there, tagged
with their keys, and L3 through.

The queue is bounded in bytes (``save_queue_mb``): a prefill save that does
not fit is dropped (counted; a best-effort cache only misses later).  A
finish save is never dropped without releasing its blocks.

The thread runs at the process's priority: lowering it (a per-thread nice)
was tried and made loads slower on a loaded CPU: the thread holds the L2
lock while it copies pages in, and a load waiting for that lock then waits
for a thread the kernel rarely schedules (priority inversion).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .kvio import GroupBuffers, gather_host, store_rows
from .logs import logger

__all__ = ["SaveTask", "SaveThread"]


@dataclass
class SaveTask:
    """One request's pages to store.  ``rows[gi]`` set: already copied out."""

    req_id: str
    groups: dict[int, tuple[list[int], list[bytes]]]
    finish: bool = False
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    touch: list[bytes] = field(default_factory=list)  # a touch task: keys to keep alive in L3
    slots: dict[int, list[int]] = field(default_factory=dict)  # per group: L2 row of each page (-1: none)
    nbytes: int = 0
    t_submit: float = 0.0


class SaveThread:
    """Runs :class:`SaveTask` s in FIFO order on one daemon thread.

    Args:
        backend: the L3 backend (thread-safe: hybridkv's backends lock inside).
        buffers: per group index, vLLM's KV tensors (:class:`.kvio.GroupBuffers`).
        l2: the worker's L2 rows (:class:`.l2.HostPageRows`, thread-safe) or ``None``.
        swa: per group index, whether it is a sliding-window group.
        max_bytes: bound of the rows queued (prefill saves beyond it are dropped).
        count: callback ``count(**increments)`` for the connector's counters.
        record: callback ``record(**event)`` for the stats file.
    """

    def __init__(self, backend: Any, buffers: dict[int, GroupBuffers], l2: Any,
                 swa: dict[int, bool], max_bytes: int,
                 count: Callable[..., None], record: Callable[..., None]) -> None:
        self.backend, self.buffers, self.l2, self.swa = backend, buffers, l2, swa
        self.max_bytes = int(max_bytes)
        self._count, self._record = count, record
        self._q: queue.Queue[SaveTask | None] = queue.Queue()
        self._lock = threading.Condition()
        self._queued_bytes = 0
        self._pending = 0          # tasks submitted and not finished
        self._done = 0             # tasks finished (progress, see wait_progress)
        self._progress = 0         # tasks finished + finish saves released
        self._released: set[str] = set()  # finish saves copied out, not reported yet
        self._keys: dict[bytes, int] = {}  # key -> queued tasks storing it
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hybridkv-save", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ execute thread
    def submit(self, req_id: str, groups: dict[int, tuple[list[int], list[bytes]]],
               finish: bool, slots: dict[int, list[int]] | None = None) -> bool:
        """Queue one job; prefill jobs (``finish=False``) are copied out now.

        ``slots``: per group index, the L2 row of each page (``-1``: not in L2).
        Returns ``False`` when the job was dropped (queue full or stopped);
        a dropped finish job is released at once (its blocks go back to vLLM).
        """
        task = SaveTask(req_id, groups, finish, slots=dict(slots or {}), t_submit=time.perf_counter())
        pages = sum(len(ids) for ids, _ in groups.values())
        nbytes = sum(len(ids) * self.buffers[gi].page_bytes for gi, (ids, _) in groups.items())
        with self._lock:
            full = self._stopped or (nbytes > 0 and self._queued_bytes + nbytes > self.max_bytes
                                     and self._pending > 0)
            if full:
                if finish:
                    self._released.add(req_id)
                self._count(save_dropped=pages)
                return False
            self._queued_bytes += nbytes
            self._pending += 1
            for _, ks in task.groups.values():
                for k in ks:
                    self._keys[k] = self._keys.get(k, 0) + 1
        task.nbytes = nbytes
        if not task.finish:
            for gi, (ids, _) in task.groups.items():
                if ids:
                    task.rows[gi] = gather_host(self.buffers[gi], ids)
        self._q.put(task)
        return not full

    def touch(self, keys: list[bytes]) -> None:
        """Queue an L3 touch of ``keys`` (behind the saves queued before it)."""
        with self._lock:
            if self._stopped:
                return
            self._pending += 1
        self._q.put(SaveTask("", {}, touch=list(keys), t_submit=time.perf_counter()))

    def pop_released(self) -> set[str]:
        """Finish saves whose blocks vLLM may reuse now (report as ``finished_sending``)."""
        with self._lock:
            out, self._released = self._released, set()
        return out

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def done(self) -> int:
        """Tasks finished so far (stored, failed or stopped)."""
        with self._lock:
            return self._done

    def wait_progress(self, timeout_s: float) -> bool:
        """Wait until a task finishes or a finish save is released (``True``),
        nothing is pending (``False`` at once) or ``timeout_s`` passed."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            start = self._progress
            while self._pending and self._progress == start:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return self._progress != start

    def wait_keys(self, keys: list[bytes], timeout_s: float) -> bool:
        """Wait until no queued task still has to store any of ``keys`` (``True``),
        or ``timeout_s`` passed.  Loads call this: the scheduler counts pages it
        sent for saving as present before their store is done."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while any(k in self._keys for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def drain(self, timeout_s: float | None) -> bool:
        """Wait until every queued task is done (``True``) or ``timeout_s`` passed
        (``None``: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while self._pending:
                if deadline is None:
                    self._lock.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def stop(self, timeout_s: float) -> bool:
        """Drain (bounded), then end the thread.  Returns whether all tasks finished."""
        done = self.drain(timeout_s)
        with self._lock:
            self._stopped = True
        self._q.put(None)
        if done:
            self._thread.join(timeout=1.0)
        return done

    # ------------------------------------------------------------- save thread
    def _run(self) -> None:
        while True:
            task = self._q.get()
            if task is None:
                return
            try:
                self._do(task)
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a crash
                logger.exception("hybridkv: save of request %s failed", task.req_id)
                if task.finish:
                    with self._lock:
                        self._released.add(task.req_id)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._done += 1
                    self._progress += 1
                    self._queued_bytes -= task.nbytes
                    for _, ks in task.groups.values():
                        for k in ks:
                            n = self._keys.pop(k, 1) - 1
                            if n > 0:
                                self._keys[k] = n
                    self._lock.notify_all()

    def _do(self, task: SaveTask) -> None:
        t0 = time.perf_counter()
        if task.touch:
            self.backend.touch(task.touch)  # a backend fault is counted there, never raised
            self._count(touch_keys=len(task.touch))
            return
        if task.finish:
            for gi, (ids, _) in task.groups.items():
                if ids:
                    task.rows[gi] = gather_host(self.buffers[gi], ids)
            with self._lock:  # copied out: vLLM may reuse the blocks from now on
                self._released.add(task.req_id)
                self._progress += 1
                self._lock.notify_all()
        stored = skipped = in_l2 = 0
        for gi, (_, keys) in task.groups.items():
            rows = task.rows.get(gi)
            if rows is None or not keys:
                continue
            s, k, h = store_rows(self.backend, keys, rows, self.l2, self.swa[gi], task.slots.get(gi))
            stored, skipped, in_l2 = stored + s, skipped + k, in_l2 + h
        task.rows.clear()
        self._count(save_pages=stored, save_pages_l2=in_l2, save_skipped=skipped,
                    finish_saves=int(task.finish))
        self._record(event="save", req=task.req_id, stored=stored, skipped=skipped,
                     stored_l2=in_l2, finish=task.finish,
                     queued_ms=round((t0 - task.t_submit) * 1e3, 3),
                     store_ms=round((time.perf_counter() - t0) * 1e3, 3))
