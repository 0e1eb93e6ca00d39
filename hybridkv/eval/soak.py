"""Soak: does a long-running cache hold memory proportional to what it caches?

Replays a trace several times through ONE cache (fresh token ids each pass,
so every pass is new traffic that evicts the previous one) and records, at the
end of each pass, the Python heap (``tracemalloc``) and the size of every
internal index of the cache: every list, dict, set, deque, heap and numpy
array reachable from the cache, its tree, its pools and their helpers (found
by walking attributes, so a new index cannot hide from the check).  After the
first passes they must stop growing: a cache serving requests for days may not
keep evicted nodes alive through stale heap entries.

    python -m hybridkv.eval.soak --passes 5 --json         # the shared conversation trace
    python -m hybridkv.eval.soak --l2-gb 594 --hbm-gb 59   # with an L2 (accounting only) below L1

With ``--l2-gb`` the cache is a :class:`~hybridkv.tiers.tiered.TieredCache`: its
L2 index and the L1 tree's evicted runs (:mod:`hybridkv.radix.evicted`) must
stop growing too.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time
import tracemalloc
from typing import Any, Sequence

import numpy as np

from ..cache import CacheConfig, HybridKVCache
from ..defaults import CHUNK, SWA_CHECKPOINT
from ..spec import ModelSpec
from .replay import ReplayStats, run_request
from .traces import TokenMaterializer, TraceRequest, default_shared_traces, load_trace

__all__ = ["index_sizes", "soak", "growth", "lazy_heaps"]

_CONTAINERS = (list, dict, set, frozenset, collections.deque)


def index_sizes(cache: HybridKVCache, depth: int = 3) -> dict[str, int]:
    """``{"tree.eviction._swa_heap": 1234, "pool.full._allocated": 5678, ...}``: entries of
    every container (list, dict, set, deque; numpy arrays by size) reachable from
    ``cache`` through attributes of hybridkv objects (``depth`` levels), named by
    their attribute path.

    Deliberately by reflection over ``__dict__`` / ``__slots__``, private
    attributes included: the check is that no index grows, and an index that no
    public call reports must not escape it.  The names are the objects' own and
    follow their internals; read-only.  O(objects reached + containers)."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None)
        if attrs is None and hasattr(obj, "__slots__"):
            attrs = {s: getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s)}
        for name, val in (attrs or {}).items():
            key = f"{path}.{name}" if path else name
            if isinstance(val, _CONTAINERS):
                out[key] = len(val)
            elif isinstance(val, np.ndarray):
                out[key] = int(val.size)
            elif type(val).__module__.startswith("hybridkv") and not isinstance(val, type):
                walk(val, key, level + 1)

    walk(cache, "", 0)
    return out


def soak(requests: Sequence[TraceRequest], spec: ModelSpec, budget_bytes: int, *, passes: int = 5,
         chunk: int = CHUNK, swa_checkpoint: int = SWA_CHECKPOINT, progress: bool = False,
         l2_bytes: int = 0) -> list[dict[str, Any]]:
    """Replay ``requests`` ``passes`` times through one cache; one record per pass.
    ``l2_bytes`` > 0: a tiered cache with an L2 of that many bytes (accounting only)."""
    config = CacheConfig(budget_bytes=budget_bytes, swa_checkpoint=swa_checkpoint)
    if l2_bytes > 0:
        from ..tiers.tiered import TierConfig, TieredCache
        cache: HybridKVCache = TieredCache(spec, config, tiers=TierConfig(l2_bytes=l2_bytes))
    else:
        cache = HybridKVCache(spec, config)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    records = []
    try:
        for k in range(passes):
            t0 = time.perf_counter()
            mat = TokenMaterializer(seed=1_000_003 * (k + 1))  # fresh token ids: new traffic
            stats = ReplayStats("hybridkv", cache=cache)
            for r in requests:
                run_request(cache, mat.tokens(r), r.namespace, chunk, stats)
            del mat
            gc.collect()
            heap, _ = tracemalloc.get_traced_memory()
            rec = {"pass": k + 1, "seconds": time.perf_counter() - t0, "heap_bytes": heap,
                   "tree_nodes": cache.tree.num_nodes, "hit_tokens": stats.hit_tokens,
                   "heap_limit": cache.tree.heap_limit(), "indexes": index_sizes(cache)}
            records.append(rec)
            if progress:
                print(f"pass {k + 1}: heap {heap / 2**20:.1f} MiB, nodes {rec['tree_nodes']}, "
                      f"largest index {max(rec['indexes'].items(), key=lambda kv: kv[1])}", flush=True)
    finally:
        if not tracing:
            tracemalloc.stop()
        if l2_bytes > 0:
            cache.close()
    return records


def growth(records: list[dict[str, Any]], *, after: int = 2, slack: int = 256) -> dict[str, float]:
    """Relative growth of the heap and every index from the end of pass ``after``
    to the last pass (``(last - base) / max(base, slack)``), largest first."""
    base, last = records[after - 1], records[-1]
    out = {"heap_bytes": (last["heap_bytes"] - base["heap_bytes"]) / max(base["heap_bytes"], 1)}
    for name, v in last["indexes"].items():
        b = base["indexes"].get(name, 0)
        out[name] = (v - b) / max(b, slack)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def lazy_heaps(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The tree's lazy heaps (``tree.*_heap``): they fill with stale entries up to
    :meth:`~hybridkv.radix.tree.WindowSafeTree.heap_limit` and are then rebuilt, so
    their size is a saw-tooth from pass to pass; what bounds them is the limit.
    ``{name: {"max": largest size seen, "limit": largest limit seen}}``."""
    names = [n for n in records[-1]["indexes"] if n.startswith("tree.") and n.endswith("_heap")]
    limit = max(r.get("heap_limit", 0) for r in records)
    return {n: {"max": max(r["indexes"].get(n, 0) for r in records), "limit": limit} for n in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridkv.eval.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=None,
                    help="trace (default: the shared Mooncake conversation trace)")
    ap.add_argument("--passes", type=int, default=5, help="replays of the trace in one process (default 5)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--hbm-gb", type=float, default=594.0, help="KV budget in GB (10^9 bytes, default 594)")
    ap.add_argument("--model", default="mimo-v2.5-pro", help="model preset (default mimo-v2.5-pro)")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    ap.add_argument("--l2-gb", type=float, default=0.0,
                    help="an L2 of this many GB below L1 (accounting only; default 0: none)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    shared = default_shared_traces()
    path = args.trace or (str(shared / "mooncake_conversation_trace.jsonl") if shared else None)
    if path is None:
        ap.error("no trace given and no shared traces found")
    reqs = load_trace(path, limit=args.limit)
    spec = ModelSpec.preset(args.model, page_size=args.page_size)
    records = soak(reqs, spec, int(args.hbm_gb * 1e9), passes=args.passes, progress=not args.json,
                   l2_bytes=int(args.l2_gb * 1e9))
    g = growth(records) if len(records) >= 3 else {}
    heaps = lazy_heaps(records)
    # a lazy heap within its rebuild limit is bounded whatever its saw-tooth phase
    steady = {k: v for k, v in g.items() if not (k in heaps and heaps[k]["max"] <= heaps[k]["limit"])}
    worst = max(steady.items(), key=lambda kv: kv[1]) if steady else ("", 0.0)
    out = {"trace": path, "requests": len(reqs), "passes": records, "growth_after_pass_2": g,
           "lazy_heaps": heaps, "worst_growth": {"name": worst[0], "fraction": worst[1]}}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in records:
            print(f"pass {r['pass']}: {r['seconds']:.1f} s, heap {r['heap_bytes'] / 2**20:.1f} MiB, "
                  f"tree nodes {r['tree_nodes']}")
        for name, h in heaps.items():
            print(f"{name}: at most {h['max']} entries, rebuilt past {h['limit']} (4x nodes + 4096)")
        print(f"largest growth from pass 2 to {len(records)} (lazy heaps aside): {worst[0]} {worst[1]:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
