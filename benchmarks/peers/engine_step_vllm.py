"""vLLM 0.32's ``KVCacheManager`` per decode step, driven as its scheduler does.

Run by ``benchmarks/engine_step.py`` with the vLLM venv's python (see
``envs.sh``).  The hybrid layout (full + sliding-window layer groups) is
built exactly like ``drive_vllm.py``.  For each batch size and context: B
requests are prefilled (``allocate_slots`` per 8K chunk), then every decode
step does, per running request, what the scheduler and output processor do
for the KV cache: ``append_output_token_ids`` (block hashing when a block
fills) and ``allocate_slots(req, 1)`` (which also frees SWA blocks that left
the window), then advances ``num_computed_tokens``.

    python engine_step_vllm.py '{"meta": {...}, "batches": [32], "contexts": [4096], "steps": 512, "repeats": 3}'

Prints one JSON object: ``{"decode_us_per_req": {"<ctx>": {"<batch>": us}}, "version": ...}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402

from drive_vllm import build_manager  # noqa: E402


def run(meta: dict, batch: int, context: int, steps: int, seed: int) -> float:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    page = meta["page_size"]
    budget = int(meta["budget_bytes"])
    mgr, _, _ = build_manager(meta, budget, context + steps + page)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(page, hash_fn)
    params = SamplingParams(max_tokens=steps + 1)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(batch):
        req = Request(f"r{i}", rng.integers(0, 50000, context).tolist(), params, None, block_hasher=hasher)
        blocks, hit, _ = mgr.get_computed_blocks(req)
        first = True
        while req.num_computed_tokens < context:
            n = min(8192, context - req.num_computed_tokens)
            got = (mgr.allocate_slots(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks)
                   if first else mgr.allocate_slots(req, n))
            if got is None:
                raise RuntimeError("vLLM KV budget too small for the benchmark's batch")
            req.num_computed_tokens += n
            first = False
        reqs.append(req)
    toks = rng.integers(0, 50000, (steps, batch)).tolist()
    clock = time.perf_counter
    total = 0.0
    for s in range(steps):
        row = toks[s]
        t0 = clock()
        for i, req in enumerate(reqs):
            req.append_output_token_ids(row[i])
            if mgr.allocate_slots(req, 1) is None:
                raise RuntimeError("vLLM ran out of blocks during decode")
            req.num_computed_tokens += 1
        total += clock() - t0
    for req in reqs:
        mgr.free(req)
    return total / (steps * batch) * 1e6


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.getLogger("vllm").setLevel(logging.WARNING)
    out: dict = {}
    for ctx in cfg["contexts"]:
        for b in cfg["batches"]:
            vals = [run(cfg["meta"], b, ctx, cfg["steps"], seed) for seed in range(cfg["repeats"])]
            out.setdefault(str(ctx), {})[str(b)] = float(np.median(vals))
    import vllm

    print(json.dumps({"decode_us_per_req": out, "version": f"vllm {vllm.__version__} KVCacheManager"}))


if __name__ == "__main__":
    main()
