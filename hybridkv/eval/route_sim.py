"""Routing simulator: N hybridkv workers behind a router, fed a timed trace.

Model (deliberately simple, stated in every report):

* Each worker is one engine instance with its own :class:`~hybridkv.HybridKVCache`
  (``system_config("hybridkv", spec, budget)``) and one prefill queue.  It
  prefills one request at a time: ``prefill_s = overhead + uncached / prefill_tps``
  where ``uncached = input - hit`` and ``hit`` is what the worker's *own*
  tree gives at prefill start (the truth, not the router's prediction).
* After prefill the request decodes for ``output_length * tpot_s`` seconds
  beside later prefills (continuous batching: decode does not block the
  queue) while its cache pages stay locked; at decode end the prompt is
  inserted into the worker's tree (``finish``).  TTFT = queue wait + prefill.
* Arrivals are the trace's timestamps divided by ``time_scale``.
* Queues are shortest-uncached-first with starvation protection
  (``queue="uncached"``) or FIFO; ``uncached`` at enqueue comes from the
  worker's own tree (a non-locking match).
* Router load = queued + in-flight uncached prefill tokens of each worker.
  ``affinity`` reads a :class:`GlobalPrefixIndex` fed by every worker's
  :class:`KVEventPublisher`; publishers flush at every arrival (events are
  as fresh as one inter-arrival gap).

Metrics per policy: token hit rate, prefill busy time max/mean over workers,
TTFT p50/p90 (all and ``long_threshold``+ tokens), requests per worker.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..cache import CacheFullError, HybridKVCache, Request
from ..defaults import CHUNK, SWA_CHECKPOINT
from ..routing.bus import EventBus, MemoryBus
from ..routing.events import KVEventPublisher
from ..routing.index import GlobalPrefixIndex
from ..routing.queue import UncachedFirstQueue
from ..routing.router import POLICIES, RouteDecision, Router
from ..spec import ModelSpec
from ..tiers.keys import model_fingerprint
from .replay import system_config
from .traces import TokenMaterializer, TraceRequest

__all__ = ["SimConfig", "run_policy", "simulate"]

_ARRIVE, _PREFILL_DONE, _DECODE_DONE = 0, 1, 2


@dataclass(frozen=True)
class SimConfig:
    """Cluster and cost model of a simulation (see the module docstring)."""

    workers: int = 4
    budget_bytes: int = 150 * 10**9
    prefill_tps: float = 16_000.0
    prefill_overhead_s: float = 0.02
    tpot_s: float = 0.02
    time_scale: float = 1.0
    chunk: int = CHUNK
    swa_checkpoint: int = SWA_CHECKPOINT
    queue: str = "uncached"
    max_wait_s: float = 30.0
    balance: float = 1.0
    max_share: float = 0.5
    guard_min_tokens: int = 65_536
    long_threshold: int = 32_768

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise ValueError(f"workers must be an int in [1, 64], got {self.workers!r}")
        for name in ("budget_bytes", "prefill_tps", "time_scale", "chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("prefill_overhead_s", "tpot_s", "max_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.queue not in ("uncached", "fifo"):
            raise ValueError(f"queue must be 'uncached' or 'fifo', got {self.queue!r}")


@dataclass
class _Job:
    i: int
    tokens: np.ndarray
    namespace: str
    arrival: float
    output_length: int
    decision: RouteDecision
    req: Request | None = None
    hit: int = 0


@dataclass
class _Worker:
    cache: HybridKVCache
    queue: UncachedFirstQueue
    busy: bool = False
    busy_s: float = 0.0
    requests: int = 0
    publisher: KVEventPublisher | None = None


@dataclass
class _Totals:
    input_tokens: int = 0
    hit_tokens: int = 0
    rejected: int = 0
    ttft: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    predicted_exact: int = 0


class _Sim:
    """One policy's run; see :func:`run_policy`."""

    def __init__(self, spec: ModelSpec, cfg: SimConfig, policy: str, bus: EventBus | None) -> None:
        self.spec, self.cfg, self.policy = spec, cfg, policy
        conf = system_config("hybridkv", spec, int(cfg.budget_bytes), swa_checkpoint=cfg.swa_checkpoint)
        wait = cfg.max_wait_s if cfg.queue == "uncached" else 0.0
        self.workers = [_Worker(HybridKVCache(spec, conf), UncachedFirstQueue(wait)) for _ in range(cfg.workers)]
        self.now = 0.0
        self.index: GlobalPrefixIndex | None = None
        if policy == "affinity":
            fp = model_fingerprint(spec.fingerprint(), "full")
            bus = bus if bus is not None else MemoryBus()
            self.index = GlobalPrefixIndex(cfg.workers, page_size=spec.page_size, window=spec.window,
                                           fingerprint=fp, bus=bus, stale_after_s=3600.0,
                                           clock=lambda: self.now)
            for i, w in enumerate(self.workers):
                w.publisher = KVEventPublisher(i, bus, page_size=spec.page_size, fingerprint=fp)
                w.publisher.attach(w.cache.tree)
        self.router = Router(cfg.workers, policy=policy, index=self.index, balance=cfg.balance,
                             max_share=cfg.max_share, guard_min_tokens=cfg.guard_min_tokens)
        self.heap: list[tuple[float, int, int, Any]] = []
        self._order = 0
        self.totals = _Totals()

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self.heap, (t, self._order, kind, payload))

    def run(self, requests: Sequence[TraceRequest], extension_rule: bool,
            progress: Callable[[int, int], None] | None) -> None:
        mat = TokenMaterializer(extension_rule=extension_rule)
        t0 = requests[0].timestamp if requests else 0.0
        nxt, total, done = 0, len(requests), 0
        while nxt < total or self.heap:
            # Arrivals are generated lazily in trace order (the materializer's rule needs that order).
            if nxt < total and (not self.heap or (requests[nxt].timestamp - t0) / self.cfg.time_scale
                                <= self.heap[0][0]):
                r = requests[nxt]
                self.now = (r.timestamp - t0) / self.cfg.time_scale
                self._arrive(nxt, r, mat.tokens(r))
                nxt += 1
                done += 1
                if progress is not None:
                    progress(done, total)
                continue
            t, _, kind, payload = heapq.heappop(self.heap)
            self.now = t
            if kind == _PREFILL_DONE:
                self._prefill_done(*payload)
            else:
                self._decode_done(payload)

    def _arrive(self, i: int, r: TraceRequest, tokens: np.ndarray) -> None:
        if len(tokens) == 0:
            return
        if self.index is not None:
            for k, w in enumerate(self.workers):
                assert w.publisher is not None
                w.publisher.flush(load=float(self.router.loads[k]))
            self.index.poll()
        d = self.router.route(tokens, r.namespace)
        w = self.workers[d.worker]
        uncached = len(tokens) - w.cache.match(tokens, r.namespace).length
        self.router.adjust(d, uncached)
        job = _Job(i, tokens, r.namespace, self.now, r.output_length, d)
        w.queue.push(job, uncached, self.now)
        w.requests += 1
        if not w.busy:
            self._start(d.worker)

    def _start(self, k: int) -> None:
        w = self.workers[k]
        job: _Job = w.queue.pop(self.now)
        cache = w.cache
        req = cache.begin(job.tokens, job.namespace)
        job.hit = req.prefix_len
        try:
            while req.computed < len(job.tokens):
                n = min(self.cfg.chunk, len(job.tokens) - req.computed)
                cache.reserve(req, n)
                cache.commit(req, n)
            job.req = req
        except CacheFullError:
            cache.abort(req)  # computed, served, but not cached: decode memory modelled as elsewhere
            self.totals.rejected += 1
        if job.decision.policy == "affinity":
            self.router.feedback(job.decision, job.hit)
            self.totals.predicted_exact += int(job.decision.predicted_hit == job.hit)
        dur = self.cfg.prefill_overhead_s + (len(job.tokens) - job.hit) / self.cfg.prefill_tps
        w.busy = True
        w.busy_s += dur
        self.totals.input_tokens += len(job.tokens)
        self.totals.hit_tokens += job.hit
        self._push(self.now + dur, _PREFILL_DONE, (k, job))

    def _prefill_done(self, k: int, job: _Job) -> None:
        ttft = self.now - job.arrival
        self.totals.ttft.append(ttft)
        if len(job.tokens) >= self.cfg.long_threshold:
            self.totals.long_ttft.append(ttft)
        self.router.release(job.decision)
        self._push(self.now + job.output_length * self.cfg.tpot_s, _DECODE_DONE, (k, job))
        w = self.workers[k]
        w.busy = False
        if len(w.queue):
            self._start(k)

    def _decode_done(self, payload: tuple[int, _Job]) -> None:
        k, job = payload
        if job.req is not None:
            self.workers[k].cache.finish(job.req)

    def summary(self) -> dict[str, Any]:
        tot = self.totals
        busy = np.array([w.busy_s for w in self.workers])
        ttft = np.asarray(tot.ttft) if tot.ttft else np.zeros(1)
        long = np.asarray(tot.long_ttft) if tot.long_ttft else np.zeros(1)
        out: dict[str, Any] = {
            "hit_rate": tot.hit_tokens / max(1, tot.input_tokens),
            "load_max_over_mean": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
            "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p90": float(np.percentile(ttft, 90)),
            "ttft_mean": float(ttft.mean()),
            "ttft_p90_long": float(np.percentile(long, 90)),
            "long_requests": len(tot.long_ttft),
            "requests": len(tot.ttft),
            "input_tokens": tot.input_tokens,
            "hit_tokens": tot.hit_tokens,
            "prefill_busy_s": float(busy.sum()),
            "requests_per_worker": [w.requests for w in self.workers],
            "busy_s_per_worker": [round(float(b), 3) for b in busy],
            "rejected": tot.rejected,
            "starved_pops": sum(w.queue.starved_pops for w in self.workers),
        }
        out.update({f"router_{k}": v for k, v in self.router.counters.items() if k != "routed"})
        if self.index is not None:
            out["prediction_exact_rate"] = tot.predicted_exact / max(1, len(tot.ttft))
            out["index_counters"] = dict(self.index.counters)
            out["publish_failures"] = sum(w.publisher.counters["publish_failures"]
                                          for w in self.workers if w.publisher)
        return out


def run_policy(requests: Sequence[TraceRequest], spec: ModelSpec, cfg: SimConfig, policy: str, *,
               bus: EventBus | None = None, extension_rule: bool = True,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Simulate ``requests`` under one routing ``policy``; returns its metrics.

    ``bus`` (affinity only): the KV-event transport, e.g. a
    :class:`RedisStreamBus`; default an in-process :class:`MemoryBus`.
    Complexity: one cache request per trace request per policy (same work as
    a replay) plus index queries for affinity.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    sim = _Sim(spec, cfg, policy, bus)
    t0 = time.perf_counter()
    sim.run(requests, extension_rule, progress)
    out = sim.summary()
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def simulate(requests: Sequence[TraceRequest], spec: ModelSpec, cfg: SimConfig, *,
             policies: Sequence[str] = POLICIES, bus_factory: Callable[[str], EventBus] | None = None,
             extension_rule: bool = True) -> dict[str, Any]:
    """Run every policy on the same requests; JSON-able result with ``policies``."""
    out: dict[str, Any] = {"model": spec.name, "page_size": spec.page_size, "config": asdict(cfg),
                           "extension_rule": "on" if extension_rule else "off",
                           "requests": len(requests), "policies": {}}
    for p in policies:
        bus = bus_factory(p) if (bus_factory is not None and p == "affinity") else None
        out["policies"][p] = run_policy(requests, spec, cfg, p, bus=bus, extension_rule=extension_rule)
    return out
