"""Cache-affinity router: pick the worker from predicted hits and load.

Each worker's load is its *queued uncached tokens*: prefill work it has
accepted and not finished.  For a prompt of ``n`` tokens the router asks the
:class:`~hybridkv.routing.index.GlobalPrefixIndex` for every worker's
predicted window-safe hit ``h_w`` and scores::

    cost_w = (n - h_w) + balance * load_w

which with ``balance = 1`` is the worker's modelled time to first token
(queue ahead + own prefill, in tokens of prefill work); ``balance -> 0`` is
pure affinity, large ``balance`` is least-loaded.  A guard keeps any worker
from taking more than ``max_share`` of the total load (after this request)
once the total exceeds ``guard_min_tokens``; if every worker is over the
guard the least-loaded one gets the request.

Degradation: without an index, or when the index is unhealthy (bus down,
every worker silent), ``affinity`` routes least-loaded and counts a
fallback.  The router never raises for the index.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .index import GlobalPrefixIndex

__all__ = ["POLICIES", "RouteDecision", "Router"]

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "affinity")


@dataclass
class RouteDecision:
    """Where a request goes and why.

    ``predicted_hit``: tokens the index expected the worker to hit (0 when
    the index was not used); ``cost``: the uncached tokens charged to the
    worker's load (give it back with :meth:`Router.release`); ``policy``: the
    policy that decided (``"least_loaded"`` when affinity fell back).
    """

    worker: int
    predicted_hit: int
    cost: int
    policy: str
    keys: list[bytes]
    guarded: bool = False


class Router:
    """Routes prompts to ``num_workers`` workers.

    Args:
        num_workers: >= 1.
        policy: ``"round_robin"``, ``"least_loaded"`` or ``"affinity"``.
        index: the global prefix index (needed for affinity hits).
        balance: weight of load against predicted hit (>= 0).
        max_share: largest share of the total load one worker may hold (0, 1].
        guard_min_tokens: the guard applies once the total load exceeds this.
        tier_weights: value of a hit token per tier (L1 1.0; a lower tier
            costs a load, so it is worth less than a device hit).
    """

    def __init__(self, num_workers: int, *, policy: str = "affinity", index: GlobalPrefixIndex | None = None,
                 balance: float = 1.0, max_share: float = 0.5, guard_min_tokens: int = 65_536,
                 tier_weights: dict[str, float] | None = None) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not isinstance(balance, (int, float)) or balance < 0:
            raise ValueError(f"balance must be a number >= 0, got {balance!r}")
        if not isinstance(max_share, (int, float)) or not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share!r}")
        if not isinstance(guard_min_tokens, int) or guard_min_tokens < 0:
            raise ValueError(f"guard_min_tokens must be an int >= 0, got {guard_min_tokens!r}")
        if index is not None and index.num_workers != num_workers:
            raise ValueError(f"index has {index.num_workers} workers, router {num_workers}")
        self.num_workers = num_workers
        self.policy = policy
        self.index = index
        self.balance = float(balance)
        self.max_share = float(max_share)
        self.guard_min_tokens = guard_min_tokens
        self.tier_weights = dict(tier_weights or {"L1": 1.0, "L2": 0.9, "L3": 0.7})
        self.loads = np.zeros(num_workers, dtype=np.float64)
        self._rr = 0
        self.counters = {"routed": 0, "fallbacks": 0, "guarded": 0, "predicted_hit_tokens": 0,
                         "overpredicted_tokens": 0, "underpredicted_tokens": 0}

    # ================================================================ route
    def route(self, tokens: np.ndarray, namespace: str = "default") -> RouteDecision:
        """Choose a worker for ``tokens`` and charge its load.

        Mutates ``loads`` (adds the decision's ``cost``) and counters.
        Complexity: O(num_workers) plus :meth:`GlobalPrefixIndex.hits` for affinity.
        """
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.size == 0:
            raise TypeError("tokens must be a non-empty 1-D numpy array of token ids")
        n = int(tokens.size)
        self.counters["routed"] += 1
        if self.policy == "round_robin":
            w = self._rr % self.num_workers
            self._rr += 1
            return self._charge(RouteDecision(w, 0, n, "round_robin", []))
        if self.policy == "affinity":
            if self.index is not None and self.index.healthy():
                return self._affinity(tokens, namespace, n)
            self.counters["fallbacks"] += 1
        return self._charge(RouteDecision(self._least_loaded(), 0, n, "least_loaded", []))

    def _least_loaded(self) -> int:
        return self._pick(self.loads)

    def _pick(self, values: np.ndarray) -> int:
        """Argmin of ``values``; ties rotate.  A fixed lowest-id tie-break would
        pin an idle cluster's traffic (and every cold session) to worker 0."""
        ties = np.flatnonzero(values == values.min())
        w = int(ties[np.searchsorted(ties, self._rr % self.num_workers) % ties.size])
        self._rr = w + 1
        return w

    def _affinity(self, tokens: np.ndarray, namespace: str, n: int) -> RouteDecision:
        assert self.index is not None
        pred = self.index.hits(tokens, namespace)
        hit = np.minimum(pred.best(self.tier_weights), n - 1)
        uncached = n - hit
        cost = uncached + self.balance * self.loads
        after = self.loads + uncached
        total = self.loads.sum() + uncached
        allowed = (after <= self.max_share * total) | (total <= self.guard_min_tokens)
        guarded = not bool(allowed[cost == cost.min()].any())
        w = self._pick(np.where(allowed, cost, np.inf)) if allowed.any() else self._least_loaded()
        if guarded:
            self.counters["guarded"] += 1
        l1 = int(pred.tokens["L1"][w]) if "L1" in pred.tokens else 0
        self.counters["predicted_hit_tokens"] += int(hit[w])
        d = RouteDecision(w, int(hit[w]), int(uncached[w]), "affinity",
                          pred.keys[:l1 // self.index.page_size], guarded)
        return self._charge(d)

    def _charge(self, d: RouteDecision) -> RouteDecision:
        self.loads[d.worker] += d.cost
        return d

    # ============================================================= feedback
    def release(self, decision: RouteDecision) -> None:
        """The worker finished the request's prefill: give its cost back.  O(1)."""
        self.loads[decision.worker] = max(0.0, self.loads[decision.worker] - decision.cost)

    def adjust(self, decision: RouteDecision, actual_cost: int) -> None:
        """Replace the decision's charged cost by what the worker measured
        (its own tree match at enqueue).  Mutates ``decision.cost``.  O(1)."""
        self.loads[decision.worker] = max(0.0, self.loads[decision.worker] - decision.cost + actual_cost)
        decision.cost = int(actual_cost)

    def feedback(self, decision: RouteDecision, actual_hit: int) -> None:
        """Record the worker's real hit.  A hit below the prediction means the
        index held pages the worker had evicted: those entries are dropped so
        the next request does not repeat the miss.  O(pages forgotten)."""
        delta = decision.predicted_hit - int(actual_hit)
        if delta > 0:
            self.counters["overpredicted_tokens"] += delta
            if self.index is not None and decision.keys:
                # Pages from the first window that failed onwards; the worker's tree is the truth.
                first = max(0, int(actual_hit) // self.index.page_size)
                self.index.forget(decision.worker, decision.keys[first:])
        elif delta < 0:
            self.counters["underpredicted_tokens"] += -delta
