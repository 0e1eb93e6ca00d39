"""Global prefix index: which worker would hit how much of a prompt, per tier.

Built only from KV events (:mod:`hybridkv.routing.events`).  For every tier
it maps a chained page key to two bit masks over workers: who holds the
page's full KV, and who also holds its SWA KV.  A query hashes the prompt's
pages once and computes, for all workers at once, the window-safe hit length
with the same rule as the tree: the largest page-aligned ``L`` with full KV
for ``[0, L)`` and SWA for the pages covering ``[max(0, L - W), L)``.

The index is a *prediction*.  Each worker's own tree is the truth: a stale
entry (page evicted, event not yet seen or lost) makes the router pick a
worker that then misses; it can never make a worker return KV it does not
hold.  Lost batches (a ``seq`` gap), a new publisher epoch and ``reset``
events all drop the worker's entries, so phantom pages do not accumulate;
:meth:`GlobalPrefixIndex.forget` lets the router drop pages a worker turned
out not to hold.  Workers silent for ``stale_after_s`` count as holding
nothing, and a bus that fails makes :meth:`healthy` false (the router then
routes by load alone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..spec import window_pages
from ..tiers.keys import page_keys
from ..window import safe_pages
from .bus import BusError, EventBatch, EventBus

__all__ = ["TIERS", "GlobalPrefixIndex", "HitPrediction"]

log = logging.getLogger(__name__)

TIERS = ("L1", "L2", "L3")
_HASH_CHUNK = 32  # pages hashed per step: stop hashing once no worker holds the prefix


@dataclass
class HitPrediction:
    """Predicted window-safe hit per worker and tier.

    ``tokens[tier]`` is an int64 array of shape ``(num_workers,)``; ``keys``
    are the page keys hashed for the query (a prefix of the prompt's pages).
    """

    tokens: dict[str, np.ndarray]
    keys: list[bytes] = field(default_factory=list)

    def best(self, weights: dict[str, float] | None = None) -> np.ndarray:
        """Per-worker ``max over tiers of weight * hit`` (float64, shape ``(num_workers,)``)."""
        weights = weights or {"L1": 1.0}
        out = None
        for tier, arr in self.tokens.items():
            v = arr * float(weights.get(tier, 0.0))
            out = v if out is None else np.maximum(out, v)
        return out if out is not None else np.zeros(0)


class GlobalPrefixIndex:
    """Page-key index over the KV events of ``num_workers`` workers.

    Args:
        num_workers: 1..64 (workers are bits of a mask).
        page_size, window: the model's (window in tokens).
        fingerprint: must equal the publishers' fingerprint.
        bus: source of batches for :meth:`poll` (None: call :meth:`apply`).
        stale_after_s: a worker with no batch for this long predicts nothing;
            a bus with no successful read for this long makes the index unhealthy.
        clock: monotonic seconds (tests and simulations pass their own).
    """

    def __init__(self, num_workers: int, *, page_size: int, window: int, fingerprint: str,
                 bus: EventBus | None = None, stale_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, tiers: tuple[str, ...] = TIERS) -> None:
        if not isinstance(num_workers, int) or not 1 <= num_workers <= 64:
            raise ValueError(f"num_workers must be an int in [1, 64], got {num_workers!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if not isinstance(stale_after_s, (int, float)) or stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self.num_workers = num_workers
        self.page_size = page_size
        self.window_pages = window_pages(window, page_size)
        self.fingerprint = fingerprint
        self.bus = bus
        self.stale_after_s = float(stale_after_s)
        self.clock = clock
        self.tiers = tuple(tiers)
        self._full: dict[str, dict[bytes, int]] = {t: {} for t in self.tiers}
        self._swa: dict[str, dict[bytes, int]] = {t: {} for t in self.tiers}
        self._epoch: list[str | None] = [None] * num_workers
        self._next_seq = [0] * num_workers
        self.last_seen = np.full(num_workers, -np.inf)
        self.loads = np.zeros(num_workers)
        self.cursor = "0-0"
        self._last_read = -np.inf if bus is not None else np.inf
        self._bus_ok = bus is None
        self._last_warn = -np.inf
        self.counters = {"batches": 0, "events": 0, "gaps": 0, "resets": 0, "bus_failures": 0,
                         "foreign_batches": 0, "forgotten_pages": 0}

    # ================================================================ ingest
    def poll(self, max_batches: int = 100_000) -> int:
        """Read and apply every batch the bus has after the cursor.

        Returns batches applied.  A :class:`BusError` is counted, warned about
        (rate-limited) and makes :meth:`healthy` false; it never propagates.
        """
        if self.bus is None:
            return 0
        done = 0
        try:
            while done < max_batches:
                self.cursor, batches = self.bus.read(self.cursor, min(1000, max_batches - done))
                for b in batches:
                    self.apply(b)
                done += len(batches)
                if not batches:
                    break
        except BusError as exc:
            self.counters["bus_failures"] += 1
            self._bus_ok = False
            now = self.clock()
            if now - self._last_warn >= 10.0:
                self._last_warn = now
                log.warning("KV-event bus unreadable (%s); routing falls back to least-loaded", exc)
            return done
        self._bus_ok = True
        self._last_read = self.clock()
        return done

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch.  O(pages in its events); a reset is O(index size)."""
        w = batch.worker
        if not isinstance(w, int) or not 0 <= w < self.num_workers:
            self.counters["foreign_batches"] += 1
            return
        if batch.epoch != self._epoch[w] or batch.seq != self._next_seq[w]:
            if self._epoch[w] is not None:  # restarted publisher or lost batches: forget, never guess
                self.counters["gaps"] += 1
            self._reset(w, None)
            self._epoch[w] = batch.epoch
        self._next_seq[w] = batch.seq + 1
        self.last_seen[w] = self.clock()
        if batch.load is not None:
            self.loads[w] = float(batch.load)
        self.counters["batches"] += 1
        bit = 1 << w
        for ev in batch.events:
            self.counters["events"] += 1
            if ev.kind == "reset":
                self._reset(w, None if ev.tier == "*" else ev.tier)
                continue
            if ev.tier not in self._full:
                continue
            full, swa = self._full[ev.tier], self._swa[ev.tier]
            if ev.kind == "remove":
                self._clear(full, ev.keys, bit)
                self._clear(swa, ev.keys, bit)
            elif ev.kind == "store":
                for k, v in zip(ev.keys, ev.swa_valid):
                    full[k] = full.get(k, 0) | bit
                    swa[k] = swa.get(k, 0) | bit if v else swa.get(k, 0) & ~bit
                for k in [k for k in ev.keys if not swa.get(k, 1)]:
                    del swa[k]
            else:  # swa_store / swa_remove: full KV unchanged
                self._clear(swa, [k for k, v in zip(ev.keys, ev.swa_valid) if not v], bit)
                for k, v in zip(ev.keys, ev.swa_valid):
                    if v and full.get(k, 0) & bit:
                        swa[k] = swa.get(k, 0) | bit

    @staticmethod
    def _clear(table: dict[bytes, int], keys: object, bit: int) -> None:
        for k in keys:  # type: ignore[attr-defined]
            m = table.get(k)
            if m is not None:
                m &= ~bit
                if m:
                    table[k] = m
                else:
                    del table[k]

    def _reset(self, worker: int, tier: str | None) -> None:
        self.counters["resets"] += 1
        bit = 1 << worker
        for t in ([tier] if tier else self.tiers):
            if t in self._full:
                self._clear(self._full[t], list(self._full[t]), bit)
                self._clear(self._swa[t], list(self._swa[t]), bit)

    def forget(self, worker: int, keys: list[bytes], tier: str = "L1") -> None:
        """Drop ``worker``'s entries for ``keys`` (it turned out not to hold them).  O(len(keys))."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker!r}")
        if tier in self._full:
            self._clear(self._full[tier], keys, 1 << worker)
            self._clear(self._swa[tier], keys, 1 << worker)
            self.counters["forgotten_pages"] += len(keys)

    # ================================================================= query
    def fresh(self) -> np.ndarray:
        """Bool ``(num_workers,)``: workers heard from within ``stale_after_s``."""
        return self.clock() - self.last_seen <= self.stale_after_s

    def healthy(self) -> bool:
        """The bus reads, and at least one worker is fresh."""
        ok_bus = self._bus_ok and self.clock() - self._last_read <= self.stale_after_s
        return bool(ok_bus and self.fresh().any())

    def hits(self, tokens: np.ndarray, namespace: str = "default", max_len: int | None = None) -> HitPrediction:
        """Predicted window-safe hit (tokens) of every worker and tier for ``tokens``.

        ``max_len`` caps the hit (default ``len(tokens) - 1``, as a worker
        leaves the last prompt token to compute).  Stale workers predict 0.
        Complexity: O(P_hit) page hashes and dict lookups, where P_hit is the
        longest prefix any worker holds (plus one chunk), then
        O(P_hit * num_workers) numpy work per tier.  Mutates nothing.
        """
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
            raise TypeError("tokens must be a 1-D numpy array of token ids")
        limit = len(tokens) - 1 if max_len is None else min(len(tokens), int(max_len))
        n_pages = max(0, limit) // self.page_size
        fresh_mask = sum(1 << w for w in np.flatnonzero(self.fresh()).tolist())
        out = {t: np.zeros(self.num_workers, dtype=np.int64) for t in self.tiers}
        keys = self._prefix_keys(tokens, namespace, n_pages, fresh_mask)
        if not keys or not fresh_mask:
            return HitPrediction(out, keys)
        shifts = np.arange(self.num_workers, dtype=np.uint64)
        for t in self.tiers:
            full_t, swa_t = self._full[t], self._swa[t]
            if not full_t:
                continue
            f = np.fromiter((full_t.get(k, 0) & fresh_mask for k in keys), np.uint64, len(keys))
            s = np.fromiter((swa_t.get(k, 0) for k in keys), np.uint64, len(keys))
            out[t] = self._safe_lengths(((f[:, None] >> shifts) & 1).astype(bool),
                                        ((s[:, None] >> shifts) & 1).astype(bool))
        return HitPrediction(out, keys)

    def _prefix_keys(self, tokens: np.ndarray, namespace: str, n_pages: int, fresh_mask: int) -> list[bytes]:
        """Page keys of the prompt, chunk by chunk, until no fresh worker holds the prefix."""
        keys: list[bytes] = []
        p = self.page_size
        buf = np.ascontiguousarray(tokens[:n_pages * p], dtype=np.int32)
        anyone = [table for table in self._full.values() if table]
        while len(keys) < n_pages and fresh_mask and anyone:
            lo = len(keys)
            hi = min(n_pages, lo + _HASH_CHUNK)
            chunk = page_keys(buf[lo * p:hi * p], p, namespace=namespace, fingerprint=self.fingerprint,
                              parent=keys[-1] if keys else None)
            keys.extend(chunk)
            if not any(table.get(chunk[-1], 0) & fresh_mask for table in anyone):
                # Nobody holds the chunk's last page; find where holding stops.
                held = [any(table.get(k, 0) & fresh_mask for table in anyone) for k in chunk]
                stop = held.index(False)
                return keys[:lo + stop]
        return keys

    def _safe_lengths(self, full: np.ndarray, swa: np.ndarray) -> np.ndarray:
        """Window-safe lengths (tokens) from per-page bool matrices ``(pages, workers)``:
        per worker, :func:`hybridkv.window.safe_pages` below its leading run of
        full pages.  O(pages x workers) numpy work."""
        n = full.shape[0]
        full_len = np.where(full.all(axis=0), n, np.argmin(full, axis=0)).tolist()
        best = [safe_pages(swa[:, w], self.window_pages, limit) for w, limit in enumerate(full_len)]
        return np.asarray(best, dtype=np.int64) * self.page_size

    def pages(self, worker: int, tier: str = "L1") -> tuple[int, int]:
        """(full, swa) pages the index believes ``worker`` holds in ``tier``.  O(index size)."""
        bit = 1 << worker
        return (sum(1 for m in self._full[tier].values() if m & bit),
                sum(1 for m in self._swa[tier].values() if m & bit))
