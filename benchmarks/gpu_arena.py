"""The KV arena on an accelerator (issue: GPU validation, item 4).

1. ``torch.cuda.memory_allocated`` grows by at most the budget (+ one page per
   kind) when a cache is built with ``device="cuda"``, for each preset;
2. the reference transformer (float64, ``hybridkv verify``'s workload) runs
   with its KV in a CUDA arena: every logit equals the cache-free forward.

    python benchmarks/gpu_arena.py --json               # on a CUDA machine
    python benchmarks/gpu_arena.py --device cpu --json  # dry run of the same code here

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from hybridkv import CacheConfig, HybridKVCache, ModelSpec
from hybridkv.eval.model import ReferenceModel, tiny_spec
from hybridkv.eval.model.verify import scaled_prompts, verify_requests
from hybridkv.pools import ArenaLayout, arena_page_bytes


def _allocated(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def arena_budget(device: str, gb: float) -> list[dict]:
    out = []
    for preset in ("mimo-v2.5-pro", "mimo-v2.5", "gemma-3-27b", "gpt-oss-120b"):
        spec = ModelSpec.preset(preset, page_size=64)
        lay = ArenaLayout.for_spec(spec)
        budget = int(gb * 1e9)
        before = _allocated(device)
        cache = HybridKVCache(spec, CacheConfig(budget_bytes=budget, device=device))
        grown = _allocated(device) - before if device.startswith("cuda") else cache.pool.tensor_bytes()
        slack = lay.page_bytes("full") + lay.page_bytes("swa")
        out.append({"preset": preset, "budget_bytes": budget, "allocated_bytes": grown,
                    "tensor_bytes": cache.pool.tensor_bytes(), "ok": grown <= budget + slack})
        del cache
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def verify_on(device: str, requests: int) -> dict:
    spec = tiny_spec()
    model = ReferenceModel(spec, seed=0)
    budget = 150 * arena_page_bytes(spec, "full") + 40 * arena_page_bytes(spec, "swa")
    cache = HybridKVCache(spec, CacheConfig(budget_bytes=budget, full_pages=300, swa_pages=80, device=device,
                                            swa_checkpoint=32, retention="eager"))
    res = verify_requests(scaled_prompts(None, requests), cache, model)
    cache.check_invariants()
    return {"device": device, "requests": requests, "mismatched_requests": res["mismatched_requests"],
            "hit_tokens": res["hit_tokens"], "max_abs_diff": res.get("max_abs_diff")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    ap.add_argument("--gb", type=float, default=8.0, help="arena budget per preset in GB (default 8)")
    ap.add_argument("--requests", type=int, default=60, help="verify requests (default 60)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    out = {"arena_budget": arena_budget(args.device, args.gb), "verify": verify_on(args.device, args.requests)}
    out["ok"] = all(r["ok"] for r in out["arena_budget"]) and out["verify"]["mismatched_requests"] == 0
    print(json.dumps(out, indent=1 if args.json else None))


if __name__ == "__main__":
    main()
