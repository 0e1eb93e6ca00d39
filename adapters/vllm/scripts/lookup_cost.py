"""Cost of one connector lookup (the scheduler side's ``TierView``) against an L3 store.

    python scripts/lookup_cost.py [--l3 URL] [--tokens N] [--runs N]

Two cases, each on fresh keys per run so the record never answers (what a new
prompt costs): ``miss`` (nothing stored) and ``cross_engine_hit`` (another engine
stored every full page and the last window: this engine's record knows none of
it).  MiMo-V2's groups as vLLM builds them (full attention in 64-token blocks, one
sliding group of 32-token blocks, window 128).  Prints JSON: the median lookup
time (ms, runs after the first 10), the hit, and the probes / keys asked of the
store.  Runs against the ``hybridkv_vllm`` on ``PYTHONPATH``, older ones too (a
``TierView`` without ``hit``: every key asked, then ``window_safe_tokens``), so two
checkouts can be compared on the same store.  ``--l3`` defaults to a file store
in a temporary folder (removed at the end); a Redis or Mooncake URL works too
(keys are left there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from typing import Any

from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.storage import open_backend
from hybridkv_vllm.plan import GroupInfo, window_safe_tokens
from hybridkv_vllm.sources import TierView
from vllm.v1.metrics.cache_hit_source import CacheHitSource

FULL, SWA = GroupInfo(0, None, ("f",), 64), GroupInfo(1, 128, ("s",), 32)
UNIT = 64


def _keys(tag: str, tokens: int) -> dict[int, list[bytes]]:
    return {0: [f"{tag}f{i}".encode().ljust(16, b".") for i in range(tokens // 64)],
            1: [f"{tag}s{i}".encode().ljust(16, b".") for i in range(tokens // 32)]}


def _lookup(view: Any, keys: dict[int, list[bytes]], tokens: int) -> int:
    if hasattr(view, "hit"):
        return view.hit(keys, 0, tokens, UNIT)
    held = view.present(keys)  # before TierView.hit: every key asked
    return window_safe_tokens([held[0], held[1]], [FULL, SWA], UNIT, 0, tokens)


def run(backend: Any, tokens: int, runs: int) -> dict[str, Any]:
    """Both cases on ``backend``; see the module docstring."""
    out = {}
    for case in ("miss", "cross_engine_hit"):
        times, hit, asked = [], 0, (0, 0)
        for r in range(runs):
            keys = _keys(f"{case}{r}-{time.time_ns()}-", tokens)
            if case == "cross_engine_hit":
                backend.put(keys[0], [b"x" * 64] * len(keys[0]))
                backend.put(keys[1][-4:], [b"y" * 64] * 4)
            view = TierView([FULL, SWA], None, CacheHitSource.DISK, StoreIndex(backend.exists))
            t = time.perf_counter()
            hit = _lookup(view, keys, tokens)
            times.append((time.perf_counter() - t) * 1e3)
            asked = (view.store.counters["probes"], view.store.counters["probed_keys"])
        out[case] = {"median_ms": round(statistics.median(times[10:] or times), 3), "hit_tokens": hit,
                     "probes": asked[0], "probed_keys": asked[1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--l3", default="", help="store URL (default: a file store in a temporary folder)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length, a multiple of 64")
    ap.add_argument("--runs", type=int, default=60)
    a = ap.parse_args()
    if a.tokens <= 0 or a.tokens % 64:
        ap.error("--tokens must be a positive multiple of 64")
    if a.runs <= 10:
        ap.error("--runs must be > 10 (the first 10 are warm-up)")
    tmp = None if a.l3 else tempfile.mkdtemp(prefix="hkv-lookup-")
    backend = open_backend(a.l3 or f"file://{tmp}/l3")
    try:
        print(json.dumps({"l3": a.l3 or "file (temporary folder)", "tokens": a.tokens, **run(backend, a.tokens, a.runs)}))
    finally:
        backend.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
