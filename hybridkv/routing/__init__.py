"""Cache-affinity routing across workers (KV events, global index, router, queue).

The route simulator that drives them over a trace is part of the evaluation
harness: :mod:`hybridkv.eval.route_sim`.

Data flow::

    worker cache tree --TreeEvent--> KVEventPublisher --batches--> bus (Redis stream)
                                                                     |
    Router.route(prompt) <-- GlobalPrefixIndex.hits() <-- poll() ----+

See ``docs/routing.md``.
"""

from .bus import BusError, EventBatch, KVEvent, MemoryBus, RedisStreamBus
from .events import KVEventPublisher
from .index import GlobalPrefixIndex, HitPrediction
from .queue import UncachedFirstQueue
from .router import POLICIES, RouteDecision, Router

__all__ = [
           "POLICIES",
           "BusError",
           "EventBatch",
           "GlobalPrefixIndex",
           "HitPrediction",
           "KVEvent",
           "KVEventPublisher",
           "MemoryBus",
           "RedisStreamBus",
           "RouteDecision",
           "Router",
           "UncachedFirstQueue",
]
