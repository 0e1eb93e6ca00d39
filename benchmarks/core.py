"""Core performance and hit-rate targets (issue: core), printed as figures and ratios.

    python benchmarks/core.py [--json] [--quick]

Measures, on this machine, in one run:
* full Mooncake conversation trace through hybridkv alone: wall time (target < 30 s),
  tree-match p50 (target < 50 us at page 64), metadata bytes per cached token (< 32);
* MiMo-V2.5-Pro at 594 GB with the baselines: hit rate / naive (>= 2.5x) and
  hit rate / prefix bound (>= 0.7);
* an effectively unlimited budget (100,000 GB): hit rate / prefix bound >= 0.9 on
  the Mooncake trace and on the kv-cache-tester sessions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybridkv import ModelSpec
from hybridkv.eval.replay import replay
from hybridkv.eval.traces import default_shared_traces, load_trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="first 3,000 Mooncake requests, 20 weka sessions")
    ap.add_argument("--traces", default=None, help="folder with mooncake_conversation_trace.jsonl and weka/")
    args = ap.parse_args()
    traces = Path(args.traces) if args.traces else default_shared_traces()
    if traces is None:
        print("shared traces not found (pass --traces)", file=sys.stderr)
        return 2
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    limit = 3000 if args.quick else None
    mooncake = load_trace(traces / "mooncake_conversation_trace.jsonl", limit=limit)
    weka = load_trace(traces / "weka", max_sessions=20 if args.quick else None)

    t0 = time.perf_counter()
    solo = replay(mooncake, spec, int(594e9), systems=["hybridkv"])
    solo_s = time.perf_counter() - t0
    h = solo["systems"]["hybridkv"]
    full = replay(mooncake, spec, int(594e9))
    s = full["systems"]
    unl_m = replay(mooncake, spec, int(1e14), systems=["hybridkv"])
    unl_w = replay(weka, spec, int(1e14), systems=["hybridkv"])
    bound = full["prefix_bound_hit_rate"]
    out = {
        "requests": solo["requests"], "input_tokens": solo["input_tokens"],
        "replay_s_hybridkv_only": solo_s, "match_us_p50": h["match_us_p50"], "match_us_p99": h["match_us_p99"],
        "metadata_bytes_per_cached_token": solo["metadata_bytes_per_cached_token"],
        "hit_rate_594gb": {k: v["token_hit_rate"] for k, v in s.items()},
        "prefix_bound_hit_rate": bound,
        "ratio_vs_naive_594gb": s["hybridkv"]["token_hit_rate"] / s["naive"]["token_hit_rate"],
        "ratio_vs_bound_594gb": s["hybridkv"]["token_hit_rate"] / bound,
        "unlimited_ratio_vs_bound_mooncake": unl_m["systems"]["hybridkv"]["token_hit_rate"] / unl_m["prefix_bound_hit_rate"],
        "unlimited_ratio_vs_bound_weka": unl_w["systems"]["hybridkv"]["token_hit_rate"] / unl_w["prefix_bound_hit_rate"],
        "weka_requests": unl_w["requests"],
    }
    out["targets"] = {
        "replay_under_30s": out["replay_s_hybridkv_only"] < 30,
        "match_p50_under_50us": out["match_us_p50"] < 50,
        "metadata_under_32_bytes": out["metadata_bytes_per_cached_token"] < 32,
        "ratio_vs_naive_at_least_2.5": out["ratio_vs_naive_594gb"] >= 2.5,
        "ratio_vs_bound_at_least_0.7": out["ratio_vs_bound_594gb"] >= 0.7,
        "unlimited_at_least_0.9_of_bound": min(out["unlimited_ratio_vs_bound_mooncake"],
                                               out["unlimited_ratio_vs_bound_weka"]) >= 0.9,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
