"""KV-event publisher: a worker's cache changes, as page keys, on a bus.

:class:`KVEventPublisher` listens to a :class:`~hybridkv.radix.WindowSafeTree`
(``tree.listeners``) and turns each :class:`~hybridkv.radix.TreeEvent` into a
:class:`~hybridkv.routing.bus.KVEvent` of tier ``"L1"``: the chained page keys
of the affected pages plus their SWA validity after the event, which is all a
reader needs to recompute the window-safe hit length this worker would give.
Lower tiers: :meth:`KVEventPublisher.attach_tiers` subscribes to a
:class:`~hybridkv.tiers.tiered.TieredCache`'s ``host.listeners`` (L2 pages
stored/evicted) and ``l3.listeners`` (L3 pages written, or found gone by a
read) and records their :class:`~hybridkv.tiers.events.TierEvent` as events
of tier ``"L2"`` / ``"L3"``; anything else may call :meth:`record` directly.
L3 events arrive on the tier manager's worker thread: recording and flushing
are serialised by a lock.

Events are batched: :meth:`flush` sends one :class:`EventBatch` (also when
empty: it doubles as a heartbeat carrying the worker's load).  A failing bus
never raises into the engine: the batch is dropped, a counter and a
rate-limited warning record it, and the next successful flush first sends a
``reset`` plus a snapshot of the whole tree, so the index converges again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np
import xxhash

from ..radix import TreeEvent, WindowSafeTree
from ..tiers.events import TIER_EVENT_KINDS, TierEvent
from ..tiers.keys import page_keys
from .bus import BusError, EventBatch, EventBus, KVEvent

__all__ = ["KVEventPublisher"]

log = logging.getLogger(__name__)

_TREE_KINDS = ("store", "remove", "swa_store", "swa_remove")


class KVEventPublisher:
    """Batches one worker's KV events and publishes them.

    Args:
        worker: worker id (0 <= worker < 64; the index packs workers in bit masks).
        bus: where batches go (:class:`MemoryBus`, :class:`RedisStreamBus`).
        page_size: tokens per page (must equal the tree's).
        fingerprint: model fingerprint mixed into page keys
            (:func:`hybridkv.tiers.keys.model_fingerprint` of the full KV kind).
        max_events: pending events that trigger an automatic flush.
        chain_cache: remembered chain ends (prefix hash -> last page key), so
            a store that extends a known prefix hashes only its new pages.
        warn_interval_s: at most one warning per interval for bus failures.
    """

    def __init__(self, worker: int, bus: EventBus, *, page_size: int, fingerprint: str,
                 max_events: int = 512, chain_cache: int = 65_536, warn_interval_s: float = 10.0) -> None:
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < 64:
            raise ValueError(f"worker must be an int in [0, 64), got {worker!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError("fingerprint must be a non-empty str")
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        self.worker = worker
        self.bus = bus
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.max_events = max_events
        self.warn_interval_s = warn_interval_s
        self.epoch = uuid.uuid4().hex[:12]
        self.tree: WindowSafeTree | None = None
        self.tiered: Any = None  # a TieredCache whose L2/L3 events we record
        self._lock = threading.RLock()
        self._pending: list[KVEvent] = []
        self._seq = 0
        self._need_reset = True  # the first batch of an epoch tells readers to forget older state
        self._chain: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._chain_cap = chain_cache
        self._last_warn = -float("inf")
        self.counters = {"events": 0, "batches": 0, "publish_failures": 0, "dropped_events": 0,
                         "snapshots": 0, "hashed_pages": 0}

    # ============================================================ tree hook
    def attach(self, tree: WindowSafeTree) -> None:
        """Subscribe to ``tree`` (mutates ``tree.listeners``).  O(1)."""
        if not isinstance(tree, WindowSafeTree):
            raise TypeError(f"tree must be a WindowSafeTree, got {type(tree).__name__}")
        if tree.page_size != self.page_size:
            raise ValueError(f"tree page_size {tree.page_size} != publisher page_size {self.page_size}")
        self.tree = tree
        tree.listeners.append(self.on_tree_event)

    def detach(self) -> None:
        if self.tree is not None and self.on_tree_event in self.tree.listeners:
            self.tree.listeners.remove(self.on_tree_event)
        self.tree = None

    def attach_tiers(self, cache: Any) -> None:
        """Subscribe to the L2 host tier and L3 manager of ``cache`` (a
        :class:`~hybridkv.tiers.tiered.TieredCache`; mutates their ``listeners``).

        Its page keys must be the ones this publisher hashes: raises
        ``ValueError`` unless ``cache.key_fingerprint == self.fingerprint``.  O(1).
        """
        host = getattr(cache, "host", None)
        if host is None or not hasattr(cache, "key_fingerprint"):
            raise TypeError(f"cache must be a TieredCache, got {type(cache).__name__}")
        if cache.key_fingerprint != self.fingerprint:
            raise ValueError(f"cache keys use fingerprint {cache.key_fingerprint!r}, the publisher "
                             f"{self.fingerprint!r}: L1 and L2/L3 keys would not match")
        if cache.page_size != self.page_size:
            raise ValueError(f"cache page_size {cache.page_size} != publisher page_size {self.page_size}")
        self.detach_tiers()
        self.tiered = cache
        host.listeners.append(self.on_tier_event)
        if cache.l3 is not None:
            cache.l3.listeners.append(self.on_tier_event)

    def detach_tiers(self) -> None:
        cache, self.tiered = self.tiered, None
        if cache is None:
            return
        for owner in (cache.host, cache.l3):
            if owner is not None and self.on_tier_event in owner.listeners:
                owner.listeners.remove(self.on_tier_event)

    def on_tier_event(self, event: TierEvent) -> None:
        """Listener for L2/L3 tier events (any thread).  O(len(event.keys))."""
        if event.kind in TIER_EVENT_KINDS:
            self.record(event.tier, event.kind, "", list(event.keys), event.swa_valid)

    def on_tree_event(self, event: TreeEvent) -> None:
        """Listener: record ``event`` as an L1 event; flushes when the batch is full.

        Complexity: O(new pages) hashing when the prefix before ``event.start``
        is a remembered chain end, O(event.end / page_size) otherwise.
        """
        if event.kind not in _TREE_KINDS:
            return
        keys = self._keys(event.tokens, event.namespace, event.start // self.page_size,
                          event.end // self.page_size)
        self.record("L1", event.kind, event.namespace, keys, event.swa_valid)

    def record(self, tier: str, kind: str, namespace: str, keys: list[bytes], swa_valid: Any) -> None:
        """Queue one event (for tiers that are not the tree).  ``swa_valid``: one flag per key."""
        flags = tuple(bool(v) for v in np.asarray(swa_valid, dtype=bool).reshape(-1))
        if kind in ("remove", "reset"):
            flags = ()
        elif len(flags) != len(keys):
            raise ValueError(f"swa_valid needs {len(keys)} flags, got {len(flags)}")
        with self._lock:
            self._pending.append(KVEvent(tier, kind, namespace, tuple(keys), flags))
            self.counters["events"] += 1
            if len(self._pending) >= self.max_events:
                self.flush()

    def _keys(self, tokens: np.ndarray, namespace: str, start_page: int, end_page: int) -> list[bytes]:
        p = self.page_size
        buf = np.ascontiguousarray(tokens[:end_page * p], dtype=np.int32)
        parent = None
        if start_page:
            parent = self._chain.get((namespace, start_page, xxhash.xxh3_64_intdigest(buf[:start_page * p])))
        if parent is not None or start_page == 0:
            keys = page_keys(buf[start_page * p:], p, namespace=namespace, fingerprint=self.fingerprint,
                             parent=parent)
        else:  # the prefix ends mid-node (a split): hash it from the start
            keys = page_keys(buf, p, namespace=namespace, fingerprint=self.fingerprint)[start_page:]
            self.counters["hashed_pages"] += start_page
        self.counters["hashed_pages"] += len(keys)
        if keys:
            self._chain[(namespace, end_page, xxhash.xxh3_64_intdigest(buf))] = keys[-1]
            if len(self._chain) > self._chain_cap:
                self._chain.popitem(last=False)
        return keys

    # ================================================================ flush
    def flush(self, load: float | None = None) -> bool:
        """Send pending events (or a heartbeat) as one batch.

        Returns True when delivered.  On :class:`BusError` the batch is
        dropped, counted, warned about (rate-limited) and the next successful
        flush starts with a reset and a snapshot.  Never raises for the bus.
        """
        with self._lock:
            return self._flush(load)

    def _flush(self, load: float | None) -> bool:
        events = self._pending
        self._pending = []
        if self._need_reset:
            # The snapshot is taken now: pending events of a tier it covers are older, drop them.
            covered = {"L1"} if self.tree is not None else set()
            if self.tiered is not None:
                covered.add("L2")
            events = self._reset_events() + [e for e in events if e.tier not in covered]
        batch = EventBatch(self.worker, self.epoch, self._seq, time.time(), events, load)
        try:
            self.bus.publish(batch)
        except BusError as exc:
            self.counters["publish_failures"] += 1
            self.counters["dropped_events"] += len(events)
            self._need_reset = True
            now = time.monotonic()
            if now - self._last_warn >= self.warn_interval_s:
                self._last_warn = now
                log.warning("KV events of worker %d not published (%s); the router falls back until "
                            "a snapshot gets through", self.worker, exc)
            return False
        self._seq += 1
        self._need_reset = False
        self.counters["batches"] += 1
        return True

    def _reset_events(self) -> list[KVEvent]:
        """A reset and, when attached to a tree, a snapshot of all it caches (O(cached pages))."""
        out = [KVEvent("*", "reset", "", (), ())]  # "*": every tier of the worker
        if self.tiered is not None:  # L2 is known exactly; L3 comes back as pages are written/read
            out.append(self._l2_snapshot())
        if self.tree is None:
            return out
        self.counters["snapshots"] += 1
        for node in self.tree.iter_nodes():
            parts = []
            n = node
            while n is not None and n.parent is not None:
                parts.append(n.key)
                n = n.parent
            tokens = np.concatenate(parts[::-1])
            keys = self._keys(tokens, node.namespace, node.start // self.page_size,
                              (node.start + len(node.key)) // self.page_size)
            out.append(KVEvent("L1", "store", node.namespace, tuple(keys), tuple(bool(v) for v in node.swa >= 0)))
        return out

    def _l2_snapshot(self) -> KVEvent:
        """A store event of every L2 full page, with its L2 SWA validity.  O(L2 pages)."""
        from ..tiers.payload import swa_key
        host = self.tiered.host
        keys = host.full_keys()
        flags = host.lookup_swa([swa_key(k) for k in keys]) >= 0
        return KVEvent("L2", "store", "", tuple(keys), tuple(bool(f) for f in flags))

    @property
    def pending(self) -> int:
        return len(self._pending)
