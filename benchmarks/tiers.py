"""Tier benchmark: hit rate with L1 only vs L1+L2 vs L1+L2+L3, and L3 overhead.

Hit rates: the ``hybridkv`` system of :func:`hybridkv.eval.replay.replay` (one
request at a time, chunked prefill, prompts cached, partial-block extension
rule ON) at fixed budgets for mimo-v2.5-pro (defaults: L1 59 GB, L2 594 GB,
L3 a file backend without a size limit), on

* the kv-cache-tester sessions (``<traces>/weka``, the first ``--sessions``
  sessions interleaved by timestamp as tenants), and
* the Mooncake conversation trace (first ``--mooncake-limit`` requests).

Replays carry scaled-down L3 payloads (an 8-byte checksum of the page key,
see :mod:`hybridkv.tiers.payload`) through the real file backend; ``bytes_*``
figures are what the real model would move.

``l3_overhead_ratio`` per backend comes from ``benchmarks/tiers_l3.py``, run
in a fresh process (hybridkv put+get vs the raw client, same bytes, same run).

Usage: ``python benchmarks/tiers.py --json [--traces DIR] [--sessions 8]
[--mooncake-limit 2000] [--l1-gb 59] [--l2-gb 594] [--backends file,redis,mooncake,nixl]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


GB = 10**9
HERE = Path(__file__).resolve().parent


def _replay_configs(reqs: list, spec: Any, l1_gb: float, l2_gb: float, tmp: Path, tag: str) -> dict[str, Any]:
    from hybridkv.eval.replay import replay
    from hybridkv.tiers.tiered import TierConfig
    out: dict[str, Any] = {}
    configs = {
        "l1": None,
        "l1_l2": TierConfig(l2_bytes=int(l2_gb * GB)),
        # unbounded write queue: a replay assumes L3 keeps up (figures independent of timing)
        "l1_l2_l3": TierConfig(l2_bytes=int(l2_gb * GB), l3=f"file://{tmp / ('l3-' + tag)}", l3_timeout_s=120.0,
                               max_queued_writes=1 << 26),
    }
    for name, tiers in configs.items():
        t0 = time.perf_counter()
        res = replay(reqs, spec, int(l1_gb * GB), systems=["hybridkv"], tiers=tiers)
        hk = res["systems"]["hybridkv"]
        row = {"token_hit_rate": round(hk["token_hit_rate"], 4), "hit_tokens": hk["hit_tokens"],
               "wall_s": round(time.perf_counter() - t0, 1)}
        for k in ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "bytes_h2d", "bytes_d2h",
                  "bytes_l3_read", "bytes_l3_written", "bytes_moved", "l3_clamped_pages", "tier_errors"):
            if k in hk:
                row[k] = hk[k]
        out[name] = row
        out["input_tokens"] = res["input_tokens"]
        out["requests"] = res["requests"]
        out["prefix_bound_hit_rate"] = round(res["prefix_bound_hit_rate"], 4)
    return out


def _overhead(backends: list[str], pages: int, repeats: int) -> dict[str, Any]:
    """``benchmarks/tiers_l3.py`` in a fresh process (the replays' heap does
    not weigh on the comparison), the same measurement it prints itself."""
    cmd = [sys.executable, str(HERE / "tiers_l3.py"), "--json", "--pages", str(pages),
           "--repeats", str(repeats), "--backends", ",".join(backends)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"tiers_l3.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)["backends"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--traces", default=None, help="folder with weka/ and the Mooncake jsonl "
                                                   "(default: $HYBRIDKV_TRACES or shared/traces beside the checkout)")
    ap.add_argument("--sessions", type=int, default=8, help="kv-cache-tester sessions (default 8)")
    ap.add_argument("--mooncake-limit", type=int, default=2000, help="Mooncake requests (default 2000)")
    ap.add_argument("--model", default="mimo-v2.5-pro")
    ap.add_argument("--l1-gb", type=float, default=59.0)
    ap.add_argument("--l2-gb", type=float, default=594.0)
    ap.add_argument("--backends", default="file,redis,mooncake,nixl",
                    help="L3 overhead backends (default all four; a missing client is reported as skipped)")
    ap.add_argument("--pages", type=int, default=8, help="pages per L3 overhead batch (default 8)")
    ap.add_argument("--repeats", type=int, default=41, help="L3 overhead repeats (default 41)")
    args = ap.parse_args(argv)
    from hybridkv.eval.traces import default_shared_traces, load_trace
    from hybridkv.spec import ModelSpec
    traces = Path(args.traces) if args.traces else default_shared_traces()
    if traces is None or not traces.is_dir():
        ap.error("trace folder not found: pass --traces or set HYBRIDKV_TRACES")
    spec = ModelSpec.preset(args.model)
    t0 = time.perf_counter()
    # L3 overhead first: the replays below leave the file system busy for a
    # while (deleting their L3 directories: many files, freed with discard).
    backends = [b for b in args.backends.split(",") if b]
    l3 = _overhead(backends, args.pages, args.repeats)
    result: dict[str, Any] = {"model": spec.name, "l1_gb": args.l1_gb, "l2_gb": args.l2_gb, "l3": "file (no limit)",
                              "extension_rule": "on", "hit_rates": {}}
    with tempfile.TemporaryDirectory(prefix="hkv-tiers-") as tmp:
        weka = traces / "weka"
        if weka.is_dir():
            sub = Path(tmp) / "weka"
            sub.mkdir()
            for f in sorted(weka.iterdir())[:args.sessions]:
                (sub / f.name).symlink_to(f)
            reqs = load_trace(sub)
            res = _replay_configs(reqs, spec, args.l1_gb, args.l2_gb, Path(tmp), "weka")
            res["sessions"] = args.sessions
            result["hit_rates"]["kv_cache_tester"] = res
        moon = traces / "mooncake_conversation_trace.jsonl"
        if moon.exists():
            reqs = load_trace(moon, limit=args.mooncake_limit)
            result["hit_rates"]["mooncake"] = _replay_configs(reqs, spec, args.l1_gb, args.l2_gb, Path(tmp), "moon")
    result["l3"] = l3
    result["l3_overhead_ratio"] = {n: r.get("l3_overhead_ratio") for n, r in l3.items()}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
