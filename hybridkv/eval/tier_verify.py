"""``hybridkv verify --l2-gb X --l3 URL``: the reference model through a TieredCache.

Same workload and oracle as :mod:`hybridkv.eval.model.verify` (every logit of the
cached path equals a cache-free forward), but the cache is a
:class:`~hybridkv.tiers.tiered.TieredCache` with real CPU buffers in L1 and
L2 and real page bytes in L3, and evict -> reload cycles are forced:

* every ``l1_flush_every`` requests all unlocked L1 content is evicted, so the
  next hits must come back from L2 (write-back copies pages down as they go);
* every ``l2_flush_every`` requests L2 is emptied as well, so hits must come
  back from L3 (checksummed values, unpacked into host pages, then H2D).

The L2 budget is the smaller of ``--l2-gb`` and what the tiny model needs,
so the run stays small whatever is asked.
"""

from __future__ import annotations

import time
from typing import Any

from ..cache import CacheConfig
from ..pools import arena_page_bytes
from ..spec import ModelSpec
from ..tiers.tiered import TierConfig, TieredCache
from .model.reference import ReferenceModel, tiny_spec
from .model.verify import scaled_prompts, verify_requests
from .traces import bundled_sample

__all__ = ["run_tier_verify", "flush_l2"]

_GB = 10**9


def flush_l2(cache: TieredCache) -> int:
    """Drop every L2 page (as a host restart would).  Returns pages dropped.  O(pages)."""
    return cache.clear_l2()


def run_tier_verify(trace: str | None = None, *, requests: int = 60, seed: int = 0, l2_gb: float = 1.0,
                    l3: str | None = None, write_policy: str = "write_back", l1_flush_every: int = 3,
                    l2_flush_every: int = 7, progress: Any = None, spec: ModelSpec | None = None,
                    l2_eviction: str = "own") -> dict[str, Any]:
    """Run the verify workload through L1/L2/L3 with forced reloads; returns its JSON dict
    (``progress(done, total)`` is called after each request; ``spec``: the float64
    model, default :func:`~hybridkv.eval.model.reference.tiny_spec`; ``l2_eviction``:
    :attr:`TierConfig.l2_eviction <hybridkv.tiers.config.TierConfig.l2_eviction>`)."""
    if l2_gb <= 0:
        raise ValueError(f"l2_gb must be > 0, got {l2_gb}")
    if spec is not None and not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    t0 = time.perf_counter()
    spec = spec or tiny_spec()
    model = ReferenceModel(spec, seed=seed)
    prompts = scaled_prompts(trace, requests)
    fpb, spb = arena_page_bytes(spec, "full"), arena_page_bytes(spec, "swa")
    l2_bytes = int(min(l2_gb * _GB, 4000 * (fpb + spb)))
    l1 = CacheConfig(budget_bytes=150 * fpb + 40 * spb, full_pages=300, swa_pages=80, device="cpu",
                     swa_checkpoint=32)
    cache = TieredCache(spec, l1, tiers=TierConfig(l2_bytes=l2_bytes, l3=l3, write_policy=write_policy,
                                                   l3_timeout_s=30.0, l2_eviction=l2_eviction))
    cycles = {"l1_flushes": 0, "l2_flushes": 0}

    def on_request(idx: int) -> None:
        if (idx + 1) % l1_flush_every == 0:
            cache.tree.evict(full_pages=cache.tree.evictable_full_pages(),
                             swa_pages=cache.tree.evictable_swa_pages())
            cycles["l1_flushes"] += 1
        if l3 is not None and (idx + 1) % l2_flush_every == 0:
            cache.flush()  # the L3 writes of what L2 holds land before L2 forgets it
            flush_l2(cache)
            cycles["l2_flushes"] += 1
        if progress is not None:
            progress(idx + 1, len(prompts))

    try:
        out = verify_requests(prompts, cache, model, on_request=on_request)
        cache.check_invariants()
        st = cache.stats()
    finally:
        cache.close()
    out.update(cycles)
    for k in ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "bytes_h2d", "bytes_d2h", "bytes_l3_read",
              "bytes_l3_written", "l3_clamped_pages", "tier_errors", "repair_swa_h2d_pages",
              "repair_swa_d2h_pages"):
        out[k] = st[k]
    out["l3_backend_corrupt"] = st.get("l3_backend_corrupt", 0)
    out["l3_backend_read_keys_failed"] = st.get("l3_backend_read_keys_failed", 0)
    out["l3_backend_write_keys_failed"] = st.get("l3_backend_write_keys_failed", 0)
    out["l3_last_error"] = cache.l3_last_error()
    out["l3"] = l3
    out["write_policy"] = write_policy
    out["trace"] = str(trace or bundled_sample())
    out["model"] = spec.name
    out["kv_groups"] = [g.name for g in spec.groups]
    out["elapsed_s"] = time.perf_counter() - t0
    return out
