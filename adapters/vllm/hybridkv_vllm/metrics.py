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

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "HybridKVPromMetrics", "HybridKVStats"]

# name -> help text.  Scheduler side: lookups and hits; worker side: pages moved.
COUNTERS: dict[str, str] = {
    "lookups": "tier lookups of the scheduler-side connector (one per request and attempt)",
    "lookups_deferred": "lookups answered 'ask again later' while their store probe ran off the scheduler's thread",
    "lookup_probes": "store probes of lookups, run on the scheduler side's probe thread",
    "lookup_probes_inline": "store probes of lookups asked on the scheduler's thread (its last probes were fast)",
    "lookup_probes_given_up": "lookups answered from the tiers' record alone: the store did not answer in time",
    "tree_named_pages": "prompt pages whose keys a lookup read off hybridkv's device tree (its pages and evicted "
                        "runs) instead of hashing them",
    "reloaded_held_tokens": "hit tokens whose full KV hybridkv's device tree holds, loaded again from L2 / L3 "
                            "with the window the device lacked (repair case 2: vLLM hands the connector only the "
                            "window-safe device hit)",
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
