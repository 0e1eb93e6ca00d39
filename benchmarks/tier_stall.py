"""Does a slow L3 stall the engine?  ``begin`` latency of L1/L2-resident prefixes
with a healthy L3 vs an L3 that answers every call in 1 s (same run).

Setup (one process, one config per L3): a :class:`~hybridkv.tiers.tiered.TieredCache`
of the tiny reference spec with accounting-only buffers (``device="meta"``, so
the figures are the tier path's own cost, not KV copies), L1 small enough that
most resident prefixes live in L2, and a file L3 wrapped so that every
exists/get/put/touch first sleeps ``--l3-delay-s`` (0 for the healthy run).
``--prompts`` prompts are cached first (their pages in L1/L2, and written to
L3), then ``--requests`` begins are timed, in random order, of

* ``exact``: a cached prompt again (every page is in L1/L2), and
* ``new_suffix``: a cached prompt plus fresh tokens (the prefix is in L1/L2;
  the suffix pages are nowhere, so ``begin`` asks L3 about them).

Each begin is aborted right away (nothing new is cached).  ``begin`` waits
for L3 at most ``l3_timeout_s`` (``--budget-s``) and not at all while the
read breaker is open, so with a 1 s L3 the p99 should match the healthy run.

Usage: ``python benchmarks/tier_stall.py [--requests 2000] [--l3-delay-s 1.0]`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridkv import CacheConfig  # noqa: E402
from hybridkv.eval.model.reference import tiny_spec  # noqa: E402
from hybridkv.tiers.storage import open_backend  # noqa: E402
from hybridkv.tiers.tiered import TierConfig, TieredCache  # noqa: E402


class DelayedBackend:
    """A real backend whose every call first sleeps ``delay`` seconds."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _wait(self) -> None:
        if self.delay:
            time.sleep(self.delay)

    def exists(self, keys):  # noqa: ANN001, ANN201
        self._wait()
        return self.inner.exists(keys)

    def get(self, keys):  # noqa: ANN001, ANN201
        self._wait()
        return self.inner.get(keys)

    def put(self, keys, values):  # noqa: ANN001, ANN201
        self._wait()
        return self.inner.put(keys, values)

    def touch(self, keys):  # noqa: ANN001, ANN201
        self._wait()
        return self.inner.touch(keys)


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"n": int(a.size), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max())}


def run(delay: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    backend = DelayedBackend(open_backend(f"file://{tmp / f'l3-{delay:g}'}"), 0.0)
    cache = TieredCache(spec, CacheConfig(budget_bytes=args.l1_pages * (fpb + spb), device="meta"),
                        tiers=TierConfig(l2_bytes=args.l2_pages * (fpb + spb), l3=backend,
                                         l3_timeout_s=args.budget_s))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 64, args.prompt_tokens).astype(np.int32) for _ in range(args.prompts)]
    for p in prompts:  # cache them (write-through: L2 and L3 get every page)
        req = cache.begin(p)
        n = len(p) - req.computed
        cache.allocate(req, n)
        cache.commit(req, n)
        cache.finish(req)
    cache.flush(60)
    backend.delay = delay
    lat: dict[str, list[float]] = {"exact": [], "new_suffix": []}
    hits: dict[str, dict[str, int]] = {k: {"hit_tokens": 0, "l1_hit_tokens": 0, "l2_hit_tokens": 0,
                                           "l3_hit_tokens": 0} for k in lat}
    t_run = time.perf_counter()
    for _ in range(args.requests):
        p = prompts[int(rng.integers(len(prompts)))]
        kind = "exact" if rng.random() < 0.5 else "new_suffix"
        toks = p if kind == "exact" else np.concatenate([p, rng.integers(0, 64, args.suffix_tokens)]).astype(np.int32)
        t0 = time.perf_counter()
        req = cache.begin(toks)
        lat[kind].append(time.perf_counter() - t0)
        hits[kind]["hit_tokens"] += req.prefix_len
        for k, v in req.extra.get("tiers", {}).items():
            hits[kind][k] = hits[kind].get(k, 0) + v
        cache.abort(req)
    wall = time.perf_counter() - t_run
    st = cache.stats()
    backend.delay = 0.0
    cache.close()
    out: dict[str, Any] = {k: {**_pct(v), **hits[k]} for k, v in lat.items()}
    out["all"] = _pct(lat["exact"] + lat["new_suffix"])
    out["wall_s"] = wall
    out.update({k: st.get(k, 0) for k in ("l3_timeouts", "l3_reads_skipped", "l3_read_breaker_trips",
                                          "tier_errors")})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="timed begins per L3 (default 2000)")
    ap.add_argument("--prompts", type=int, default=64, help="distinct cached prompts (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=257, help="tokens per cached prompt (default 257)")
    ap.add_argument("--suffix-tokens", type=int, default=64, help="fresh tokens of new_suffix begins (default 64)")
    ap.add_argument("--l1-pages", type=int, default=400, help="L1 budget in pages of both kinds (default 400)")
    ap.add_argument("--l2-pages", type=int, default=20000, help="L2 budget in pages of both kinds (default 20000)")
    ap.add_argument("--l3-delay-s", type=float, default=1.0, help="seconds the slow L3 takes per call (default 1)")
    ap.add_argument("--budget-s", type=float, default=0.1,
                    help="TierConfig.l3_timeout_s: the most begin waits for L3 (default 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hkv-stall-") as d:
        healthy = run(0.0, args, Path(d))
        slow = run(args.l3_delay_s, args, Path(d))
    res = {"config": vars(args), "healthy_l3": healthy, f"l3_{args.l3_delay_s:g}s": slow,
           "p99_ratio_slow_vs_healthy": {k: slow[k]["p99_us"] / healthy[k]["p99_us"]
                                         for k in ("exact", "new_suffix", "all")}}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
