"""Equal device and host bytes: hybridkv's radix backend with its tiers vs SGLang's HiCache.

The in-engine harness's tier comparison (``benchmarks/peers/in_engine.sh --tiers``),
through SGLang 0.5.23's real pools, ``Req`` objects and admission helpers on CPU
(:mod:`sglang_flow`), every hit content-checked (loaded-back ones included):

* ``hybridkv``: ``HybridKVRadixCache`` at the SWA/full split hybridkv picks
  (:func:`equal_memory.hybridkv_split`) with an L2 of ``host_bytes``
  (:mod:`hybridkv_sglang.tiers`: ``host_hit_length`` at match, ``init_load_back``
  at admission) under ``--hicache-write-policy`` ``write_back`` by default (a page
  is copied down when L1 evicts it, so L2 holds what L1 no longer does: the two
  tiers' capacities add up; ``write_through`` copies every checkpoint down, so L2
  also holds what L1 holds);
* ``hicache@R`` (``hicache@R+write_back``): SGLang's ``UnifiedRadixCache`` with
  ``init_hicache`` (``--enable-hierarchical-cache``: its two host pools and
  ``HybridCacheController``; :mod:`hicache_flow`) at ``--swa-full-tokens-ratio R``
  and the same ``host_bytes`` (``--hicache-ratio`` = host bytes / device pool
  bytes), under ``--hicache-write-policy write_through`` (SGLang's default) or
  ``write_back``; ``hicache_default`` is R = 0.8 with write-through,
  ``hicache_best`` the swept (R, policy) with the most hit tokens among the runs
  that rejected no request.

Bytes are the MiMo-shaped model's (:mod:`equal_memory`: 51,200 B a token of full
KV, 307,200 of SWA).  SGLang's host pools are sized in those bytes through the
ratio; hybridkv's L2 prices a page the same way: its host tier's spec has the
model's full:SWA byte ratio (6 SWA layers a full one in the harness's toy
shapes, only the first of which holds bytes), and its byte budget is
``host_bytes`` in those units.  The default host size is twice the device
bytes, HiCache's default ``--hicache-ratio`` of 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import equal_memory as em
import hicache_pick

__all__ = ["HICACHE_POLICIES", "HOST_FACTOR", "TierRow", "run_hybridkv_tiers", "tiers_rows"]

HOST_FACTOR = 2.0  # host bytes / device bytes: HiCache's default --hicache-ratio
HICACHE_POLICIES = (hicache_pick.DEFAULT_POLICY, "write_back")  # SGLang's --hicache-write-policy (default first)


@dataclass
class TierRow:
    size: str
    kv_bytes: int
    host_bytes: int
    system: str
    setting: dict
    hit_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int
    input_tokens: int
    requests: int
    rejected: int
    hits_verified: int
    seconds: float
    page_size: int

    def public(self) -> dict[str, Any]:
        """The row as ``in_engine.sh --json --tiers`` prints it."""
        return {k: getattr(self, k) for k in ("kv_bytes", "host_bytes", "system", "setting", "hit_tokens",
                                              "l1_hit_tokens", "l2_hit_tokens", "input_tokens")}


def _host_spec(kv_pool: Any, page_size: int, window: int) -> Any:
    """The harness pools' spec with the model's SWA:full bytes ratio (extra SWA
    layers that hold no bytes), so L2 prices pages like the model does."""
    from hybridkv.spec import AttnKind, ModelSpec
    from hybridkv_sglang.tiers import spec_from_pools

    base = spec_from_pools(kv_pool, page_size, window, name="harness")
    per = em.SWA_BYTES_PER_TOKEN // em.FULL_BYTES_PER_TOKEN
    kinds = tuple(k for kind in base.layer_kinds for k in ((kind,) if kind is AttnKind.FULL else (kind,) * per))
    return ModelSpec(name=base.name, layer_kinds=kinds, window=base.window, full=base.full, swa=base.swa,
                     dtype=base.dtype, page_size=base.page_size)


def run_hybridkv_tiers(prompts: Sequence[np.ndarray], full: int, swa: int, host_bytes: int, *,
                       page_size: int = 64, chunk: int = em.CHUNK, max_live: int = em.MAX_LIVE,
                       quoted_answers: bool = True, write_policy: str = "write_back") -> dict[str, Any]:
    """Replay ``prompts`` through hybridkv's radix backend on pools of ``full`` / ``swa``
    tokens with an L2 of ``host_bytes`` (model bytes); per-tier hit tokens."""
    from hybridkv.tiers.config import TierConfig
    from hybridkv_sglang.radix_cache import HybridKVRadixCache
    from sglang_flow import Driver, Pools

    if host_bytes <= 0:
        raise ValueError(f"host_bytes must be positive, got {host_bytes}")
    longest = max(len(p) for p in prompts) + em.OUTPUT_TOKENS + 1
    pools = Pools(full_tokens=full, swa_tokens=swa, page_size=page_size, max_reqs=max_live + 2,
                  max_context=longest)
    params = pools.init_params(em.WINDOW)
    spec = _host_spec(pools.allocator.get_kvcache(), page_size, em.WINDOW)
    budget = host_bytes * spec.bytes_per_token_full // em.FULL_BYTES_PER_TOKEN
    tiers = TierConfig(l2_bytes=int(budget), l2_device="cpu", write_policy=write_policy)
    cache = HybridKVRadixCache(params, tiers=tiers, tier_spec=spec)
    driver = Driver(cache, pools, em.WINDOW, chunk=chunk, max_live=max_live)
    start = time.perf_counter()
    outputs = em.conversation_outputs(prompts) if quoted_answers else [em.OUTPUT_TOKENS] * len(prompts)
    stats = driver.run([(p, o, None) for p, o in zip(prompts, outputs)])
    cache.sanity_check()
    tiers = cache.tier_stats()
    cache.close()
    return {"hit_tokens": stats.hit_tokens, "l1_hit_tokens": stats.hit_tokens - stats.loaded_tokens,
            "l2_hit_tokens": stats.loaded_tokens, "input_tokens": stats.input_tokens, "requests": stats.requests,
            "rejected": stats.rejected, "hits_verified": sum(1 for h in stats.hits if h),
            "seconds": round(time.perf_counter() - start, 1), "tiers": tiers}


def tiers_rows(prompts: Sequence[np.ndarray], sizes: dict[str, dict], *, host_factor: float = HOST_FACTOR,
               ratios: Sequence[float] = em.RATIOS, page_size: int = 64, systems: Sequence[str] = ("hybridkv", "hicache"),
               write_policy: str | Sequence[str] = "write_back", hicache_policies: Sequence[str] = HICACHE_POLICIES,
               progress: Callable[[str], None] | None = None, failed: list[dict] | None = None) -> list[TierRow]:
    """hybridkv (under ``write_policy``, or each of a list: the first is the
    ``hybridkv`` row, the others ``hybridkv+<policy>``), hicache_default, hicache_best (and every
    swept ``hicache@R[+policy]``: ``ratios`` x ``hicache_policies``) at every size,
    host bytes = ``host_factor`` x the device bytes.  With a ``failed`` list, a
    HiCache run whose accounting check fails is recorded there (size, system, the
    assertion) instead of ending the sweep."""
    import hicache_flow as hf
    from hybridkv_sglang.split import pools_at_ratio

    if host_factor <= 0:
        raise ValueError(f"host_factor must be positive, got {host_factor}")
    # the first policy is the "hybridkv" row, any other a "hybridkv+<policy>" row beside it
    policies = [write_policy] if isinstance(write_policy, str) else list(write_policy)
    rows: list[TierRow] = []
    for size, info in sizes.items():
        kv = int(info["kv_bytes"])
        host = int(host_factor * kv)
        if "hybridkv" in systems:
            split = em.hybridkv_split(kv, prompts, page_size=page_size)
            for n, policy in enumerate(policies):
                r = run_hybridkv_tiers(prompts, split.full_tokens, split.swa_tokens, host, page_size=page_size,
                                       write_policy=policy)
                rows.append(TierRow(size, kv, host, "hybridkv" if n == 0 else f"hybridkv+{policy}",
                                    {"swa_full_tokens_ratio": split.swa_full_tokens_ratio, "l2_bytes": host,
                                     "write_policy": policy},
                                    r["hit_tokens"], r["l1_hit_tokens"], r["l2_hit_tokens"], r["input_tokens"],
                                    r["requests"], r["rejected"], r["hits_verified"], r["seconds"], page_size))
                _say(progress, rows[-1])
        if "hicache" not in systems:
            continue
        sweep = []
        for policy in hicache_policies:
            # SGLang's default setting always runs (the write-through sweep has it)
            extra = {em.DEFAULT_RATIO} if policy == HICACHE_POLICIES[0] else set()
            if policy not in HICACHE_POLICIES:
                raise ValueError(f"hicache_policies: each of {HICACHE_POLICIES}, got {policy!r}")
            for ratio in sorted(set(ratios) | extra):
                _, swa = pools_at_ratio(kv, em.FULL_BYTES_PER_TOKEN, em.SWA_BYTES_PER_TOKEN, ratio, page_size)
                if swa <= em.WINDOW + 1:  # SGLang refuses such a pool
                    continue
                name = f"hicache@{ratio}" + ("" if policy == HICACHE_POLICIES[0] else f"+{policy}")
                try:
                    h = hf.run_hicache(prompts, kv, host, page_size=page_size, swa_ratio=ratio, write_policy=policy)
                except AssertionError as exc:  # a check of SGLang's own accounting failed in HiCache's run
                    if failed is None:
                        raise
                    failed.append({"size": size, "system": name, "error": f"{type(exc).__name__}: {exc}"})
                    if progress:
                        progress(f"{size} {name}: FAILED {failed[-1]['error']}")
                    continue
                sweep.append(TierRow(size, kv, int(h["host_bytes"]), name,
                                     {"swa_full_tokens_ratio": ratio, "hicache_ratio": round(h["hicache_ratio"], 4),
                                      "write_policy": policy},
                                     h["hit_tokens"], h["l1_hit_tokens"], h["l2_hit_tokens"], h["input_tokens"],
                                     h["requests"], h["rejected"], h["hits_verified"], 0.0, page_size))
                _say(progress, sweep[-1])
        runs = [x.__dict__ for x in sweep]
        for system, i in (("hicache_default", hicache_pick.default_index(runs)),  # none in a write-back-only sweep
                          ("hicache_best", hicache_pick.best_index(runs))):
            if i is not None:
                rows.append(TierRow(**{**runs[i], "system": system}))
        rows.extend(sweep)
    return rows


def _say(progress: Callable[[str], None] | None, r: TierRow) -> None:
    if progress:
        progress(f"{r.size} {r.system} page={r.page_size} {r.setting}: hit {r.hit_tokens} (L1 {r.l1_hit_tokens} + "
                 f"L2 {r.l2_hit_tokens}) of {r.input_tokens}, {r.hits_verified} hits content-checked, "
                 f"rejected {r.rejected}")
