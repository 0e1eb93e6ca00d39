"""SGLang 0.5.23 HiCache (device + host KV tiers) in the in-engine harness, on CPU.

Mooncake conversation requests go through ``UnifiedRadixCache`` (FULL + SWA)
with ``init_hicache`` attached, as ``--enable-hierarchical-cache`` builds it
for a hybrid SWA model, over SGLang's real pools at ``--page-size`` (default
64); see ``adapters/sglang/tests/hicache_flow.py`` for the calls driven and the
two CPU stand-ins it needs (``HICACHE_FINDINGS.md``).  Hits are split into
device (L1) and host (L2, loaded back) tokens; every hit, loaded-back ones
included, is content-checked against the K/V tags (a wrong one stops the run).

    <sglang venv>/bin/python benchmarks/peers/in_engine_hicache.py --limit 200 --host-ratios 2,20

``--kv-bytes`` defaults to the harness's ``tight`` size for the sample
(``equal_memory.pick_sizes``); each ``--host-ratios`` value R gives host bytes
= R x the device pool bytes (``--hicache-ratio R``).  Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "adapters" / "sglang" / "tests"))

import conftest  # noqa: E402  (torchvision stand-in, torch single-threaded)

conftest.publish_test_server_args()

import equal_memory as em  # noqa: E402
import hicache_flow as hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_trace = (conftest.shared_traces() or Path("traces")) / "mooncake_conversation_trace.jsonl"
    ap.add_argument("--trace", type=Path, default=default_trace)
    ap.add_argument("--limit", type=int, default=200, help="first N requests of the trace (default 200)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-bytes", type=int, help="device KV bytes (default: the sample's tight size)")
    ap.add_argument("--host-ratios", default="2", help="comma-separated host/device byte ratios (default 2)")
    ap.add_argument("--swa-ratio", type=float, default=em.DEFAULT_RATIO, help="--swa-full-tokens-ratio")
    ap.add_argument("--write-policy", default="write_through",
                    choices=["write_through", "write_through_selective", "write_back"])
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        ap.error(f"--trace {args.trace} is not a file")
    ratios = [float(x) for x in args.host_ratios.split(",") if x]
    if not ratios or any(r <= 0 for r in ratios):
        ap.error("--host-ratios: positive numbers")
    prompts = em.mooncake_prompts(args.trace, args.limit)
    sizes = em.pick_sizes(prompts)
    kv_bytes = args.kv_bytes or sizes["tight"]["kv_bytes"]
    runs = []
    for r in ratios:
        start = time.perf_counter()
        row = hf.run_hicache(prompts, kv_bytes, 0, page_size=args.page_size, swa_ratio=args.swa_ratio,
                             write_policy=args.write_policy, host_ratio=r)
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(f"[hicache] ratio {r}: L1 {row['l1_hit_tokens']} + L2 {row['l2_hit_tokens']} of "
              f"{row['input_tokens']} ({row['load_backs']} load-backs, {row['hits_verified']} hits checked, "
              f"rejected {row['rejected']}, {row['seconds']} s)", file=sys.stderr, flush=True)
        runs.append(row)
    print(json.dumps({"trace": str(args.trace.name), "limit": args.limit, "sizes": sizes, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
