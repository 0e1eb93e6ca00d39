"""Keeping vLLM stepping until every save the workers finish is counted.

vLLM 0.32 collects a worker's ``get_kv_connector_stats()`` only at the end
of an engine step, and steps only while it has requests (or the
scheduler-side connector says ``has_pending_push_work()``).  A save that
the worker's save thread stores after the last step of a burst (the finish
save's blocks are released once copied out, before the store; prefill
stores are queued) would otherwise stay in the worker's counters until the
next request: ``/metrics`` then lags the stats file by those pages.

Through vLLM's public connector interface (as its SimpleCPUOffloadConnector
reports its stores):

* worker: ``build_connector_worker_meta()`` returns :class:`SavesBusy`
  every step while its save thread has tasks or counts not collected yet,
  and once more when it has none (:class:`WorkerSaves`);
* scheduler: ``update_connector_output()`` hands it to :class:`SavesWatch`;
  ``has_pending_push_work()`` stays ``True`` while a worker reported work
  left, so vLLM keeps running empty steps (``kv_connector_no_forward``),
  each of which collects the worker's counters.  A save thread that makes
  no progress for :data:`STALL_S` (a hung backend) stops keeping the engine
  awake;
* an empty step (no tokens, loads or saves) waits in ``wait_for_save`` up
  to :data:`IDLE_WAIT_S` for the save thread's next progress, so the engine
  does not spin against the save thread while it stores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

__all__ = ["IDLE_WAIT_S", "STALL_S", "SavesBusy", "SavesWatch", "WorkerSaves"]

IDLE_WAIT_S = 0.002  # an empty step waits at most this long for the save thread
STALL_S = 30.0  # no save progress for this long: stop keeping the engine stepping


@dataclass
class SavesBusy(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: ``busy`` workers with saves queued or
    counts not collected yet; ``done`` save tasks finished (progress)."""

    busy: int = 0
    done: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SavesBusy:
        if isinstance(other, SavesBusy):
            return SavesBusy(self.busy + other.busy, self.done + other.done)
        return self


class WorkerSaves:
    """Worker side: the :class:`SavesBusy` of this step, or ``None`` when the
    worker was idle at its previous report too (nothing to say)."""

    def __init__(self) -> None:
        self._was_busy = False

    def report(self, saver: Any, uncollected: bool) -> SavesBusy | None:
        """``saver``: the worker's :class:`.saver.SaveThread` (or ``None``);
        ``uncollected``: counts were added after vLLM took this step's stats."""
        pending = saver.pending() if saver is not None else 0
        busy = pending > 0 or uncollected
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        return SavesBusy(int(busy), saver.done() if saver is not None else 0)


class SavesWatch:
    """Scheduler side: whether a worker still has saves to finish and count."""

    def __init__(self, stall_s: float = STALL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stall_s, self._clock = stall_s, clock
        self._last = SavesBusy()
        self._since = clock()

    def update(self, meta: Any) -> None:
        """Take a step's aggregated worker metadata (anything else is ignored)."""
        if not isinstance(meta, SavesBusy):
            return
        if (meta.busy, meta.done) != (self._last.busy, self._last.done):
            self._since = self._clock()
        self._last = meta

    def busy(self) -> bool:
        """``True`` while the last report had work left and it is progressing."""
        return self._last.busy > 0 and self._clock() - self._since < self._stall_s
