"""Trace replay: hit rate of hybridkv and two baselines at one byte budget.

Each request is driven the way an engine drives the cache: match and lock,
chunked prefill (allocate, commit; out-of-window SWA released at chunk
ends), finish (insert the prompt, unlock).  Traces carry no output tokens,
so prompts are what gets cached.  One request runs at a time.

Requests go in blocks of 64: the block's prompts are materialised and the
unlimited bound and reference page logs recorded first, then each system
serves the block's requests back to back (``progress`` still reports every
request).  ``request_ops_us`` thus times the cache among its own requests;
recording the references between every two requests (the order before)
filled the CPU caches with their multi-million-entry hash sets and timed each
request cold (p50 ~1.2x on the conversation trace).

Systems, all on the same token sequences and the same budget in bytes:

* ``hybridkv``: shared byte budget over the dual pools, adaptive retention,
  per-page SWA eviction, checkpoints every K tokens.
* ``naive``: one pool, every layer stores every token (SWA never released,
  evicted only with its full KV): what a plain prefix cache does.
* ``tombstone``: the peers' SWA tree: fixed pools with SWA:full token ratio
  0.8 (SGLang's default), SWA freed per whole node, no checkpoints.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..cache import CacheConfig, CacheFullError, HybridKVCache
from ..defaults import CHUNK, SWA_CHECKPOINT
from ..spec import ModelSpec
from .references import PageLog, prefill_flops, simulate_reference
from .traces import PrefixBound, TokenMaterializer, TraceRequest

__all__ = ["system_config", "replay", "run_request", "ReplayStats", "SYSTEMS", "stderr_progress"]

SYSTEMS = ("hybridkv", "naive", "tombstone")
TOMBSTONE_SWA_RATIO = 0.8


def system_config(system: str, spec: ModelSpec, budget_bytes: int, *, swa_checkpoint: int = SWA_CHECKPOINT,
                  device: str | None = "meta", eviction_ranking: str = "value") -> CacheConfig:
    """The :class:`CacheConfig` of ``system`` at ``budget_bytes``."""
    if system == "hybridkv":
        return CacheConfig(budget_bytes=budget_bytes, device=device, swa_checkpoint=swa_checkpoint,
                           eviction_ranking=eviction_ranking)
    if system == "naive":
        return CacheConfig(budget_bytes=budget_bytes, device=device, swa_checkpoint=0,
                           swa_release="none", swa_eviction="none", anchor_branch_points=False)
    if system == "tombstone":
        fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
        full = int(budget_bytes // (fpb + TOMBSTONE_SWA_RATIO * spb))
        return CacheConfig(full_pages=full, swa_pages=int(full * TOMBSTONE_SWA_RATIO), device=device,
                           swa_checkpoint=0, swa_release="none", swa_eviction="node",
                           anchor_branch_points=False)
    raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")


@dataclass
class ReplayStats:
    """Per-system results of a replay."""

    system: str
    hit_tokens: int = 0
    raw_match_tokens: int = 0
    rejected: int = 0
    match_us: list[float] = field(default_factory=list)
    begin_us: list[float] = field(default_factory=list)
    request_us: list[float] = field(default_factory=list)
    cache: HybridKVCache | None = None
    flops_saved: float = 0.0

    def summary(self, input_tokens: int, prefill_flops_total: float = 0.0) -> dict[str, Any]:
        st = self.cache.stats() if self.cache else {}
        out: dict[str, Any] = {
            "hit_tokens": self.hit_tokens,
            "token_hit_rate": self.hit_tokens / max(1, input_tokens),
            "prefill_flops_saved_fraction": self.flops_saved / prefill_flops_total if prefill_flops_total else 0.0,
            "raw_match_tokens": self.raw_match_tokens,
            "rejected_requests": self.rejected,
        }
        for key in ("full_pool_tokens", "swa_pool_tokens", "cached_tokens", "cached_swa_tokens",
                    "evicted_tokens", "evicted_swa_tokens"):
            out[key] = st.get(key, 0)
        if hasattr(self.cache, "tier_counters"):  # TieredCache (--l2-gb / --l3)
            out.update(tier_summary(st))
            out["l3_last_error"] = self.cache.l3_last_error()  # type: ignore[union-attr]
        for name, values in (("match_us", self.match_us), ("begin_us", self.begin_us),
                             ("request_ops_us", self.request_us)):
            arr = np.asarray(values) if values else np.zeros(1)
            out[f"{name}_p50"] = float(np.percentile(arr, 50))
            out[f"{name}_p99"] = float(np.percentile(arr, 99))
        return out


_BLOCK = 64  # requests per replay block (see replay)


def run_request(cache: HybridKVCache, tokens: np.ndarray, namespace: str, chunk: int,
                stats: ReplayStats) -> None:
    """Drive one prompt through ``cache`` as an engine would (prompt only)."""
    t0 = time.perf_counter()
    req = cache.begin(tokens, namespace)
    t1 = time.perf_counter()
    try:
        while req.computed < len(tokens):
            n = min(chunk, len(tokens) - req.computed)
            cache.reserve(req, n)
            cache.commit(req, n)
        cache.finish(req)
        stats.hit_tokens += req.prefix_len
        stats.raw_match_tokens += req.raw_match_len
    except CacheFullError:
        cache.abort(req)
        stats.rejected += 1
    t2 = time.perf_counter()
    stats.match_us.append(cache.last_match_us)
    stats.begin_us.append((t1 - t0) * 1e6)
    stats.request_us.append((t2 - t0) * 1e6)


def replay(requests: Sequence[TraceRequest], spec: ModelSpec, budget_bytes: int, *,
           systems: Iterable[str] = SYSTEMS, swa_checkpoint: int = SWA_CHECKPOINT, chunk: int = CHUNK,
           extension_rule: bool = True, progress: Callable[[int, int], None] | None = None,
           check_every: int = 0, tiers: Any = None, references: bool = True,
           eviction_ranking: str = "value") -> dict[str, Any]:
    """Replay ``requests`` through each system (in blocks, see the module docstring); returns a JSON-able dict.

    ``references`` adds ``references.lru_full`` and ``references.optimal_at_budget``
    (page-level replays of full KV at the same budget, SWA free: upper
    references, see :mod:`hybridkv.eval.references`).  Every system and reference
    reports ``prefill_flops_saved_fraction`` beside its token hit rate.

    ``check_every > 0`` runs every cache's ``check_invariants()`` that often.
    ``tiers`` (a :class:`hybridkv.tiers.TierConfig`) gives the ``hybridkv``
    system L2/L3 tiers; its summary then has per-tier hit tokens and bytes moved.
    """
    if not isinstance(budget_bytes, (int, np.integer)) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    systems = list(systems)
    caches = {s: _make_cache(s, spec, budget_bytes, swa_checkpoint, tiers, eviction_ranking) for s in systems}
    stats = {s: ReplayStats(s, cache=caches[s]) for s in systems}
    mat = TokenMaterializer(extension_rule=extension_rule)
    bound = PrefixBound(spec.page_size)
    log = PageLog(spec.page_size) if references else None
    input_tokens = bound_tokens = 0
    flops_total = 0.0
    t0 = time.perf_counter()
    total = len(requests)
    for lo in range(0, total, _BLOCK):  # why blocks: see the module docstring
        block = []
        for i in range(lo, min(lo + _BLOCK, total)):
            r = requests[i]
            tokens = mat.tokens(r)
            if len(tokens) == 0:
                continue
            input_tokens += len(tokens)
            bound_tokens += bound.hits(tokens, r.namespace, len(tokens) - 1)
            flops_total += prefill_flops(spec, len(tokens))
            if log is not None:
                log.record(tokens, r.namespace, len(tokens) - 1)
            block.append((i, tokens, r.namespace))
        for k, s in enumerate(systems):
            cache, st = caches[s], stats[s]
            last = k == len(systems) - 1
            for i, tokens, namespace in block:
                before = st.hit_tokens
                run_request(cache, tokens, namespace, chunk, st)
                if st.hit_tokens > before:
                    st.flops_saved += prefill_flops(spec, st.hit_tokens - before)
                if check_every and (i + 1) % check_every == 0:
                    cache.check_invariants()
                if last and progress is not None:  # per request, once every system served it
                    progress(i + 1, total)
        if not systems and progress is not None:
            progress(min(lo + _BLOCK, total), total)
    for c in caches.values():
        if hasattr(c, "close"):  # TieredCache: drain L3 writes so its counters are final
            c.close()
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {
        "model": spec.name, "page_size": spec.page_size, "budget_bytes": int(budget_bytes),
        "swa_checkpoint": swa_checkpoint, "chunk": chunk, "eviction_ranking": eviction_ranking,
        "extension_rule": "on" if extension_rule else "off",
        "trace_block_sizes": sorted({r.block_size for r in requests}),
        "requests": total, "input_tokens": input_tokens,
        "prefix_bound_hit_tokens": bound_tokens,
        "prefix_bound_hit_rate": bound_tokens / max(1, input_tokens),
        "elapsed_s": elapsed,
    }
    out["prefill_flops_total"] = flops_total
    out["systems"] = {s: stats[s].summary(input_tokens, flops_total) for s in systems}
    if log is not None:
        out["references"] = reference_summary(log, spec, budget_bytes, input_tokens, flops_total)
    if "hybridkv" in caches:
        out["metadata_bytes_per_cached_token"] = metadata_bytes_per_token(caches["hybridkv"])
    return out


_REFERENCE_LABELS = {
    "lru_full": "upper reference: LRU over full KV pages at the same budget, SWA free",
    "optimal_at_budget": "upper reference: offline-optimal (Belady) eviction of full KV pages "
                         "at the same budget, SWA free",
}


def reference_summary(log: PageLog, spec: ModelSpec, budget_bytes: int, input_tokens: int,
                      flops_total: float) -> dict[str, Any]:
    """``lru_full`` and ``optimal_at_budget`` hit rates and prefill FLOPs saved for ``log``."""
    capacity = int(budget_bytes // spec.bytes_per_page("full"))
    out: dict[str, Any] = {}
    for name, policy in (("lru_full", "lru"), ("optimal_at_budget", "optimal")):
        hits = simulate_reference(log, capacity, policy)
        saved = sum(prefill_flops(spec, int(h)) for h in hits.tolist() if h)
        out[name] = {"label": _REFERENCE_LABELS[name], "hit_tokens": int(hits.sum()),
                     "token_hit_rate": int(hits.sum()) / max(1, input_tokens),
                     "prefill_flops_saved_fraction": saved / flops_total if flops_total else 0.0,
                     "capacity_full_pages": capacity}
    return out


def _make_cache(system: str, spec: ModelSpec, budget_bytes: int, swa_checkpoint: int,
                tiers: Any, eviction_ranking: str = "value") -> HybridKVCache:
    config = system_config(system, spec, budget_bytes, swa_checkpoint=swa_checkpoint,
                           eviction_ranking=eviction_ranking)
    if tiers is None or system != "hybridkv":
        return HybridKVCache(spec, config)
    from ..tiers.tiered import TieredCache
    return TieredCache(spec, config, tiers=tiers)


_TIER_KEYS = ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "l3_preexisting_hit_tokens", "bytes_h2d",
              "bytes_d2h", "bytes_l3_read", "bytes_l3_written", "l3_clamped_pages", "tier_errors")


def tier_summary(st: dict[str, Any]) -> dict[str, Any]:
    """Per-tier figures of a TieredCache's ``stats()`` (bytes are what the real model moves)."""
    out = {k: st.get(k, 0) for k in _TIER_KEYS}
    out["bytes_moved"] = out["bytes_h2d"] + out["bytes_d2h"] + out["bytes_l3_read"] + out["bytes_l3_written"]
    out["l3_backend"] = {k[len("l3_backend_"):]: v for k, v in st.items() if k.startswith("l3_backend_")}
    out["l3_manager"] = {k: v for k, v in st.items() if k.startswith("l3_") and not k.startswith("l3_backend_")
                         and k not in _TIER_KEYS}
    out["l2"] = {k[3:]: v for k, v in st.items() if k.startswith("l2_") and k not in _TIER_KEYS}
    return out


def metadata_bytes_per_token(cache: HybridKVCache) -> float:
    """Host bytes of tree metadata per cached token (arrays + node objects + heap entries)."""
    nodes = 0
    arrays = 0
    for n in cache.tree.iter_nodes():
        nodes += 1
        arrays += n.key.nbytes + n.full.nbytes + n.swa.nbytes
    tokens = cache.tree.cached_tokens()
    if not tokens:
        return 0.0
    t = cache.tree
    per_node = (sys.getsizeof(next(iter(t.iter_nodes()), None)) + 3 * 112 + 232 + 3 * 80 + 100) if nodes else 0
    sizes = t.heap_sizes()
    heap = (sizes["leaf"] + sizes["reused"] + sizes["swa"] + sizes["anchor"]) * 72
    return (arrays + nodes * per_node + heap) / tokens


def stderr_progress(label: str = "replay") -> Callable[[int, int], None]:
    """A minimal progress bar on stderr (updates every 1%)."""
    state = {"last": -1, "t0": time.perf_counter()}

    def report(done: int, total: int) -> None:
        pct = done * 100 // max(1, total)
        if pct != state["last"] or done == total:
            state["last"] = pct
            bar = "#" * (pct // 4) + "." * (25 - pct // 4)
            el = time.perf_counter() - state["t0"]
            sys.stderr.write(f"\r{label} [{bar}] {pct:3d}% {done}/{total} {el:5.1f}s")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return report
