"""Reference replays and the prefill-compute model reported next to hit rates.

A replay reports what hybridkv hits beside two page-level references computed
on the same token sequences and the same byte budget, with SWA KV charged
nothing (so both are *upper references* for a hybrid cache, not systems):

* ``lru_full``: a prefix cache of full KV only, evicting the least recently
  used page (deepest first on ties, so the cached set stays prefix closed);
* ``optimal_at_budget``: the same cache with offline-optimal eviction (Belady:
  the page whose next use is farthest in the future goes first, deepest first
  on ties).  A page's next use is never earlier than its parent's, so this
  also keeps the cached set prefix closed.

Both count a hit as the longest run of cached pages from the start of the
prompt, capped at ``len - 1`` tokens like the cache itself.

**Prefill FLOPs** (:func:`prefill_flops`): computing positions ``[h, n)`` of a
prompt costs, per token ``t`` (0-based),

    ``2 * A  +  Lf * 2 * Hq * (dk + dv) * (t + 1)  +  Ls * 2 * Hq * (dk + dv) * min(t + 1, W)``

with ``A`` the active non-embedding parameters (matmuls: 2 FLOPs per
parameter), ``Lf`` / ``Ls`` the full / SWA layer counts, ``Hq`` the query
heads and ``dk`` / ``dv`` the head dims (QK^T and PV).  A hit of ``h`` tokens
saves ``F(0, h)``; ``prefill_flops_saved_fraction`` is the sum of what hits
saved over the sum of ``F(0, n)``.  Long prefixes save quadratically more in
the full layers.  ``A`` and ``Hq`` per preset are in :data:`PREFILL_MODEL`
(public model cards; MiMo-V2.5-Pro's are an assumption, documented there).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..spec import ModelSpec

__all__ = ["PREFILL_MODEL", "PrefillModel", "PageLog", "prefill_flops", "simulate_reference"]

_INF = 1 << 62


@dataclass(frozen=True)
class PrefillModel:
    """Compute constants of one model for :func:`prefill_flops`.

    ``active_params``: non-embedding parameters used per token (MoE: active).
    ``q_heads``: attention query heads (same in full and SWA layers here).
    """

    active_params: float
    q_heads: int


#: Per preset.  MiMo-V2-Flash / V2.5: 15B active, 64 query heads (model card).
#: MiMo-V2.5-Pro: not public; assumed 42B active, 128 query heads.  gpt-oss-120b:
#: 5.1B active, 64 heads.  Gemma-3-27B: 27B (dense), 32 heads.
PREFILL_MODEL: dict[str, PrefillModel] = {
    "mimo-v2-flash": PrefillModel(15e9, 64),
    "mimo-v2.5": PrefillModel(15e9, 64),
    "mimo-v2.5-pro": PrefillModel(42e9, 128),
    "gpt-oss-120b": PrefillModel(5.1e9, 64),
    "gemma-3-27b": PrefillModel(27e9, 32),
}
_DEFAULT_MODEL = PrefillModel(15e9, 64)


def _sum_min(m: int, w: int) -> int:
    """``sum(min(t, w) for t in 1..m)``."""
    if m <= w:
        return m * (m + 1) // 2
    return w * (w + 1) // 2 + (m - w) * w


def prefill_flops(spec: ModelSpec, end: int, start: int = 0) -> float:
    """FLOPs to prefill positions ``[start, end)`` (formula in the module docstring).  O(1)."""
    if end <= start:
        return 0.0
    model = PREFILL_MODEL.get(spec.name, _DEFAULT_MODEL)
    lf, ls = len(spec.full_layers), len(spec.swa_layers)
    per_pair_f = 2 * model.q_heads * (spec.full.k_head_dim + spec.full.v_head_dim)
    per_pair_s = 2 * model.q_heads * (spec.swa.k_head_dim + spec.swa.v_head_dim)
    linear = 2.0 * model.active_params * (end - start)
    full = lf * per_pair_f * ((end * (end + 1) - start * (start + 1)) // 2)
    swa = ls * per_pair_s * (_sum_min(end, spec.window) - _sum_min(start, spec.window))
    return linear + float(full) + float(swa)


class PageLog:
    """Chained page hashes of each replayed prompt, for the offline references.

    Records 8 bytes per page.  Hashes are 64-bit and namespaced (a collision
    could only overstate a reference, never touch the cache's own hits).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        rng = np.random.default_rng(6789)
        self._mult = rng.integers(1, 2**63, size=page_size, dtype=np.uint64) | np.uint64(1)
        self.pages: list[np.ndarray] = []   # per request: uint64 chained hashes of its whole pages
        self.caps: list[int] = []           # per request: most pages a hit may cover
        self.lengths: list[int] = []

    def record(self, tokens: np.ndarray, namespace: str, max_len: int) -> None:
        """Append one prompt.  O(len) numpy + O(len / page_size) Python."""
        p = self.page_size
        n = len(tokens) // p
        out = np.zeros(n, dtype=np.uint64)
        if n:
            pages = tokens[:n * p].astype(np.uint64).reshape(n, p)
            with np.errstate(over="ignore"):
                ph = (pages * self._mult).sum(axis=1, dtype=np.uint64).tolist()
            a = hash(namespace) & 0xFFFFFFFFFFFFFFFF
            chained = []
            for v in ph:
                a = (a * 0x100000001B3 + v + 0x9E3779B9) & 0xFFFFFFFFFFFFFFFF
                chained.append(a)
            out = np.array(chained, dtype=np.uint64)
        self.pages.append(out)
        self.caps.append(max(0, max_len) // p)
        self.lengths.append(len(tokens))


def simulate_reference(log: PageLog, capacity_pages: int, policy: str) -> np.ndarray:
    """Hit length in tokens of every request of ``log`` under ``policy``.

    ``policy``: ``"lru"`` or ``"optimal"`` (Belady).  ``capacity_pages`` full
    pages, SWA free.  Runtime: O(P log P) for P recorded pages.
    """
    if policy not in ("lru", "optimal"):
        raise ValueError(f"policy must be 'lru' or 'optimal', got {policy!r}")
    if not isinstance(capacity_pages, (int, np.integer)) or capacity_pages < 0:
        raise ValueError(f"capacity_pages must be a non-negative int, got {capacity_pages!r}")
    sizes = [len(p) for p in log.pages]
    if not sizes or sum(sizes) == 0:
        return np.zeros(len(sizes), dtype=np.int64)
    flat = np.concatenate(log.pages)
    _, ids = np.unique(flat, return_inverse=True)
    ids = ids.astype(np.int64)
    n_ids = int(ids.max()) + 1
    bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    nxt = None
    if policy == "optimal":
        # next request index that holds the same page (per occurrence), _INF if none
        req_of = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        nxt = np.full(flat.size, _INF, dtype=np.int64)
        order = np.lexsort((np.arange(flat.size), ids))
        same = ids[order[1:]] == ids[order[:-1]]
        nxt[order[:-1][same]] = req_of[order[1:][same]]
        nxt = nxt.tolist()
    ids_l = ids.tolist()
    present = bytearray(n_ids)
    stamp = [0] * n_ids  # lru: last use; optimal: next use
    depth_of = [0] * n_ids
    heap: list[tuple[int, int, int]] = []
    used = 0
    hits = np.zeros(len(sizes), dtype=np.int64)
    for r in range(len(sizes)):
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        cap = log.caps[r]
        h = 0
        while h < cap and lo + h < hi and present[ids_l[lo + h]]:
            h += 1
        hits[r] = h * log.page_size
        for j in range(lo, hi):
            pid = ids_l[j]
            depth = j - lo
            if policy == "lru":
                s = r
                key = (r, -depth, pid)
            else:
                s = nxt[j]  # type: ignore[index]
                key = (-s, -depth, pid)
            stamp[pid] = s
            depth_of[pid] = depth
            if not present[pid]:
                present[pid] = 1
                used += 1
            heapq.heappush(heap, key)
        while used > capacity_pages and heap:
            k0, _, pid = heapq.heappop(heap)
            s = k0 if policy == "lru" else -k0
            if not present[pid] or stamp[pid] != s:
                continue
            present[pid] = 0
            used -= 1
        if len(heap) > 4 * max(capacity_pages, 1024) + 4 * (hi - lo):
            heap = [(stamp[p] if policy == "lru" else -stamp[p], -depth_of[p], p)
                    for p in range(n_ids) if present[p]]
            heapq.heapify(heap)
    return hits
