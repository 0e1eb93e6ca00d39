"""Whose order L2 gives up full pages in: its own, or the L1 tree's (``TierConfig.l2_eviction``).

``own`` (the default): the least recently used leaf of L2's key tree, after its
copies of the pages L1 holds.  ``tree``: the pages the L1 tree's evicted runs
name, the run of the least recently used L1 pages first and tail first, as
HiCache's host eviction walks its host nodes; then L2's own order for the rest.
Both under write-through (the ``tree`` order needs it).

Each split of the budget (L1 GB, L2 GB; optionally a file L3 without a size
limit) replays the Mooncake conversation trace (first ``--limit`` requests)
through the ``hybridkv`` system of :func:`hybridkv.eval.replay.replay`, once per
order, in its own process (two at a time).  Rows: hit tokens and rate per tier,
and the tree order's hit tokens over the own order's (same run).

Usage: ``python benchmarks/l2_order.py --json [--traces DIR] [--limit 3000]
[--splits 30:30,30:60,30:240,59:59,59:240,150:150,59:1:l3]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

GB = 10**9
ORDERS = ("own", "tree")
_KEEP = ("token_hit_rate", "hit_tokens", "l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "bytes_moved")


def _split(text: str) -> tuple[float, float, bool]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "l3"):
        raise argparse.ArgumentTypeError(f"a split is L1_GB:L2_GB[:l3], got {text!r}")
    return float(parts[0]), float(parts[1]), len(parts) == 3


def _one(trace: str, limit: int, model: str, l1_gb: float, l2_gb: float, l3: bool, order: str) -> dict[str, Any]:
    """One replay (in a worker process): the figures of the hybridkv system."""
    from hybridkv.eval.replay import replay
    from hybridkv.eval.traces import load_trace
    from hybridkv.spec import ModelSpec
    from hybridkv.tiers.tiered import TierConfig

    spec = ModelSpec.preset(model)
    with tempfile.TemporaryDirectory(prefix="hkv-l2-order-") as tmp:
        # a replay assumes L3 keeps up (unbounded write queue): the figures do not follow timing
        tiers = TierConfig(l2_bytes=int(l2_gb * GB), l2_eviction=order, l3=f"file://{tmp}/l3" if l3 else None,
                           l3_timeout_s=120.0, max_queued_writes=1 << 26)
        t0 = time.perf_counter()
        res = replay(load_trace(trace, limit=limit), spec, int(l1_gb * GB), systems=["hybridkv"], tiers=tiers)
    hk = res["systems"]["hybridkv"]
    row = {k: hk[k] for k in _KEEP if k in hk}
    row["token_hit_rate"] = round(row["token_hit_rate"], 6)
    row["evicted_off_tree_pages"] = hk.get("l2", {}).get("evicted_off_tree_pages", 0)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return {"row": row, "requests": res["requests"], "prefix_bound_hit_rate": round(res["prefix_bound_hit_rate"], 6)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (else indented)")
    ap.add_argument("--traces", default=None, help="folder with the Mooncake jsonl "
                                                   "(default: $HYBRIDKV_TRACES or shared/traces beside the checkout)")
    ap.add_argument("--limit", type=int, default=3000, help="Mooncake requests (default 3000)")
    ap.add_argument("--model", default="mimo-v2.5-pro")
    ap.add_argument("--splits", default="30:30,30:60,30:240,59:59,59:240,150:150,59:1:l3",
                    help="L1_GB:L2_GB[:l3] for each row, comma-separated")
    ap.add_argument("--jobs", type=int, default=2, help="replays at once (default 2)")
    args = ap.parse_args(argv)
    from hybridkv.eval.traces import default_shared_traces

    traces = Path(args.traces) if args.traces else default_shared_traces()
    trace = traces / "mooncake_conversation_trace.jsonl" if traces is not None else None
    if trace is None or not trace.exists():
        ap.error("trace not found: pass --traces or set HYBRIDKV_TRACES")
    splits = [_split(s) for s in args.splits.split(",") if s]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = {(s, o): pool.submit(_one, str(trace), args.limit, args.model, *s, o) for s in splits for o in ORDERS}
        got = {key: f.result() for key, f in futs.items()}
    rows = []
    for s in splits:
        own, tree = got[(s, "own")]["row"], got[(s, "tree")]["row"]
        rows.append({"l1_gb": s[0], "l2_gb": s[1], "l3": "file (no limit)" if s[2] else None, "own": own, "tree": tree,
                     "tree_over_own": round(tree["hit_tokens"] / own["hit_tokens"], 4) if own["hit_tokens"] else None})
    first = got[(splits[0], "own")]
    result = {"model": args.model, "trace": f"Mooncake conversation, first {first['requests']:,} requests",
              "write_policy": "write_through", "prefix_bound_hit_rate": first["prefix_bound_hit_rate"],
              "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
