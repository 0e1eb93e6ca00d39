"""The connector's counters as vLLM KV-connector stats (periodic log line and ``/metrics``).

vLLM 0.32 collects ``get_kv_connector_stats()`` from every worker after each
step and from the scheduler-side connector after each ``update_from_output``,
aggregates them (:meth:`HybridKVStats.aggregate`), ships the payload to the
front-end process, rebuilds it there with the connector class's
``build_kv_connector_stats`` and hands it to

* ``KVConnectorLogging``: ``reduce()`` becomes the periodic
  ``KV Transfer metrics: hybridkv_hit_tokens=..., ...`` log line;
* ``KVConnectorProm``: ``build_prom_metrics`` registers one Prometheus counter
  per name (``vllm:hybridkv_<name>_total``, labelled like vLLM's own metrics)
  and :meth:`HybridKVPromMetrics.observe` increments them.

The payload is a flat ``{name: int}`` of increments since the previous
report (counters only), so it survives vLLM's IPC serialisation unchanged.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "Counters", "HybridKVPromMetrics", "HybridKVStats"]

# name -> help text.  Scheduler side: lookups and hits; worker side: pages moved.
COUNTERS: dict[str, str] = {
    "lookups": "tier lookups of the scheduler-side connector (one per request and attempt; two where a window "
               "repair was looked for and not taken)",
    "lookups_deferred": "lookups answered 'ask again later' while their store probe ran off the scheduler's thread",
    "lookup_probes": "store probes of lookups, run on the scheduler side's probe thread",
    "lookup_probes_inline": "store probes of lookups asked on the scheduler's thread (its last probes were fast)",
    "lookup_probes_given_up": "lookups answered from the tiers' record alone: the store did not answer in time",
    "tree_named_pages": "prompt pages whose keys a lookup read off hybridkv's device tree (its pages and evicted "
                        "runs) instead of hashing them",
    "l2_pages_read_off_tree": "blocks a lookup answered from the record on hybridkv's device tree entry "
                              "naming them, without asking L2's index (--scheduler-cls): held (a valid "
                              "record) or not (absent, or its slot freed since)",
    "l2_pages_absent_off_tree": "of l2_pages_read_off_tree, the blocks the records answered 'not held'",
    "l2_pages_read_off_orphans": "of l2_pages_read_off_tree, the blocks found held in the list of L2 pages no "
                                 "tree entry records (placed before the insert, copy-downs, runs the tree "
                                 "dropped), then recorded on the entry naming them",
    "tree_run_pages_let_go": "pages hybridkv's device tree stopped naming as evicted runs because L2 let them go "
                             "(and L3's record lacks them), cut before a lookup's walk (--scheduler-cls)",
    "l2_pages_asked_by_key": "blocks a lookup asked L2's index about by key (0 with hybridkv's prefix cache: "
                             "its records are complete; kept for a host whose records are not)",
    "reloaded_held_tokens": "hit tokens whose full KV hybridkv's device tree holds, loaded again from L2 / L3 "
                            "with the window the device lacked (repair case 2 without a window repair, or the "
                            "last unit or page of one: a load carries at least one token)",
    "repaired_tokens": "device hit tokens whose full KV the device served while the connector loaded the window "
                       "it lacked (repair case 2: a window repair, --scheduler-cls)",
    "hit_requests": "requests that got an external hit from hybridkv",
    "hit_tokens": "prompt tokens served from hybridkv's L2/L3 instead of being computed",
    "load_pages": "pages loaded into vLLM's KV cache (all groups)",
    "load_pages_l2": "pages loaded from the worker's host L2",
    "load_pages_l3": "pages loaded from L3 storage",
    "load_failures": "requests whose load failed (recomputed)",
    "save_pages": "pages written to L3",
    "save_pages_l2": "pages written to the worker's host L2",
    "save_skipped": "pages not written because L3 already held them",
    "save_dropped": "pages not saved because the save queue was full",
    "finish_saves": "end-of-request saves completed (blocks released to vLLM)",
    "l2_demoted_pages": "anchored SWA pages of L2 (its index, on the scheduler side) made plain (evicted before full "
                        "pages): windows a finished request's sequence moved past",
    "l2_anchored_pages": "plain SWA pages of L2 (its index, on the scheduler side) made anchored (evicted after "
                         "full pages): the window a hit ended at",
    "l2_rescued_pages": "full pages vLLM's device cache gave up that L2 lacked, copied down to L2 "
                        "before their blocks were reused",
    "touch_keys": "L3 keys touched so a prefix served from the device or L2 stays in L3",
}


class Counters:
    """One connector's counters: the totals, the increments vLLM pulls next and the
    stats file (thread-safe: the save and probe threads count too).

    Args:
        role: the connector's role name (each stats line carries it).
        path: the stats file ("": none).
    """

    def __init__(self, role: str, path: str) -> None:
        self.role = role
        self.totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._interval: dict[str, int] = {}  # increments since the last pull
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None
        self._closed = False

    def count(self, **inc: int) -> None:
        """Add to the totals and to the increments vLLM pulls next."""
        with self._lock:
            for k, v in inc.items():
                if v:
                    self.totals[k] = self.totals.get(k, 0) + int(v)
                    self._interval[k] = self._interval.get(k, 0) + int(v)

    def record(self, **event: Any) -> None:
        """Append one JSON line to the stats file.  Every line carries ``totals``, this
        role's counters so far, so the last line of a (role, pid) holds its final totals
        even when the process is killed (vLLM's default ``--shutdown-timeout 0``: the API
        server SIGKILLs the engine and workers right after SIGTERM, before any shutdown
        hook runs).  One ``O_APPEND`` write per line: lines of both roles and of several
        processes never interleave and a kill never leaves half a line."""
        if self._fd is None:
            return
        event.update(role=self.role, pid=os.getpid(), t=time.time())
        with self._lock:
            if self._fd is None:
                return
            event["totals"] = dict(self.totals)
            os.write(self._fd, (json.dumps(event) + "\n").encode())

    def pull(self) -> dict[str, int]:
        """The increments since the last pull."""
        with self._lock:
            data, self._interval = self._interval, {}
        return data

    def uncollected(self) -> bool:
        """Some increments wait for vLLM's next pull."""
        with self._lock:
            return bool(self._interval)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.totals)

    def close_once(self) -> bool:
        """True the first time only (a shutdown that runs twice does its work once)."""
        with self._lock:
            first, self._closed = not self._closed, True
        return first

    def close_file(self) -> None:
        """fsync and close the stats file."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass
class HybridKVStats(KVConnectorStats):
    """``data``: ``{counter name: increment}`` (names from :data:`COUNTERS`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HybridKVStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"hybridkv_{k}": v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HybridKVPromMetrics(KVConnectorPromMetrics):
    """One ``vllm:hybridkv_<name>_total`` counter per :data:`COUNTERS` entry.

    Every counter gets its labelled child for every engine at construction
    (as vLLM's own per-engine metrics do), so ``/metrics`` shows a sample
    line from start-up on, ``0`` until something is counted: a Prometheus
    query (``rate``, alerts on ``load_failures``) sees the series exist
    instead of "no data".
    """

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        self._children: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            c = self._counter_cls(name=f"vllm:hybridkv_{name}", documentation=doc,
                                  labelnames=self._labelnames)
            self._counters[name] = c
            self._children[name] = {idx: c.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, v in (transfer_stats_data or {}).items():
            children = self._children.get(name)
            if children is None or not v:
                continue
            child = children.get(engine_idx)
            if child is None:  # an engine index vLLM did not announce: label it anyway
                labels = self.per_engine_labelvalues.get(engine_idx, [])
                child = children[engine_idx] = self._counters[name].labels(*labels)
            child.inc(v)
