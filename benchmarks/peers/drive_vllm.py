"""vLLM 0.32's ``KVCacheManager`` (hybrid allocator) on a sequence file, driven like its scheduler.

The model's layers become vLLM layer specs (``FullAttentionSpec`` for full
layers, ``SlidingWindowSpec(sliding_window=W)`` for SWA layers, sized so one
token of one layer costs the preset's bytes); vLLM's own grouping
(``unify_kv_cache_spec_page_size`` + ``_get_kv_cache_groups_uniform_page_size``)
turns them into KV-cache groups, and the shared block pool gets
``budget // bytes_per_block`` blocks, where a block holds one page of every
layer of the largest group (what ``get_kv_cache_config_from_groups`` does).
For MiMo-V2.5-Pro that is 1 full + 6 SWA groups of 10 layers.

Per request, one at a time, as ``Scheduler.schedule`` does it: the request
is built with vLLM's block hasher (default ``sha256``; the namespace is the
``cache_salt``), ``get_computed_blocks`` finds the hit, ``allocate_slots``
per prefill chunk (it caches full blocks and frees out-of-window SWA blocks),
``free`` at the end.  ``get_computed_blocks``' shared-prefix boundary is
stored on the request (``Request.shared_prefix_boundary``) as the scheduler
does, so sparse retention keeps the junction's window tail.

``--retention`` lists values of vLLM's ``prefix_cache_retention_interval``
(``CacheConfig`` default ``0``: keep only the SWA tails a later request can
resume at, the replay boundary and shared-prefix junctions; ``N``: also one
tail every N tokens; ``none``: every block, dense).  ``vllm serve`` passes its
``CacheConfig`` value into ``KVCacheConfig.prefix_cache_retention_interval``,
which the ``KVCacheCoordinator`` reads; this driver builds that
``KVCacheConfig`` directly.  Every (budget, interval) gets a fresh manager in
this one process.

    python drive_vllm.py SEQ_DIR --budgets 59,594 [--retention 0,4096,16384,none]
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (
    GB,
    VLLM_RETENTION_DEFAULT,
    VLLM_RETENTION_SWEEP,
    Run,
    Sequences,
    driver_args,
    emit,
    format_retention,
    load_sequences,
    parse_retention,
    release_memory,
    vllm_num_blocks,
)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch

HEAD_SIZE = 128  # K and V head size of the stand-in layer specs; heads are chosen to match bytes


def _layer_spec(kind: str, per_layer_bpt: int, page: int, window: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    per_head = 2 * HEAD_SIZE * 2  # K + V, bf16
    if per_layer_bpt % per_head:
        raise ValueError(f"per-layer bytes per token {per_layer_bpt} is not a multiple of {per_head}")
    heads = per_layer_bpt // per_head
    if kind == "full":
        return FullAttentionSpec(block_size=page, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    return SlidingWindowSpec(block_size=page, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                             sliding_window=window)


def build_manager(meta: dict[str, Any], budget_bytes: int, max_model_len: int,
                  retention: int | None = VLLM_RETENTION_DEFAULT) -> tuple[Any, int, int]:
    """A new manager, its number of blocks and the number of KV-cache groups;
    ``retention`` is the ``prefix_cache_retention_interval`` it runs with."""
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig

    page, window = meta["page_size"], meta["window"]
    specs = {}
    nf, ns = meta["full_layers"], meta["swa_layers"]
    f_bpt, s_bpt = meta["full_bpt"] // nf, meta["swa_bpt"] // ns
    # Interleave the kinds as a real model does (grouping depends only on counts and specs).
    for i in range(nf + ns):
        kind = "full" if i * nf // (nf + ns) != (i + 1) * nf // (nf + ns) else "swa"
        specs[f"model.layers.{i}.attn"] = _layer_spec(kind, f_bpt if kind == "full" else s_bpt, page, window)
    kinds = [type(s).__name__ for s in specs.values()]
    assert kinds.count("FullAttentionSpec") == nf, kinds
    specs = ku.unify_kv_cache_spec_page_size(specs)
    groups = ku._get_kv_cache_groups_uniform_page_size(specs)
    group_size = max(len(g.layer_names) for g in groups)
    page_bytes = max(s.page_size_bytes for s in specs.values())
    num_blocks = vllm_num_blocks(budget_bytes, page_bytes // page, page, group_size)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                           prefix_cache_retention_interval=retention)
    mgr = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=page,
                         hash_block_size=page, enable_caching=True)
    return mgr, num_blocks, len(groups)


def drive(seqs: Sequences, budget_gb: float, chunk: int,
          retention: int | None = VLLM_RETENTION_DEFAULT) -> dict[str, Any]:
    """Replay ``seqs`` through a new manager; returns the result record."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    m = seqs.meta
    page = m["page_size"]
    max_len = int((seqs.offsets[1:] - seqs.offsets[:-1]).max()) + page
    run = Run("vllm-0.32", budget_gb)
    mgr, num_blocks, n_groups = build_manager(m, int(budget_gb * GB), max_len, retention)
    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(page, hash_fn)
    params = SamplingParams(max_tokens=1)
    clock = time.perf_counter
    hash_us = []
    for i, (tokens, ns) in enumerate(seqs):
        ids = tokens.tolist()  # request construction (tokenised prompt) is not a cache operation
        t_h = clock()
        req = Request(f"r{i}", ids, params, None, block_hasher=hasher,
                      cache_salt=None if ns == "default" else ns)
        t0 = clock()
        hash_us.append((t0 - t_h) * 1e6)
        blocks, hit, junction = mgr.get_computed_blocks(req)
        req.shared_prefix_boundary = junction  # what Scheduler.schedule stores for cache_blocks
        t1 = clock()
        ok = True
        n = len(ids)
        first = True
        while req.num_computed_tokens < n:
            start = hit if first else req.num_computed_tokens
            step = min(chunk, n - start)
            if first:
                got = mgr.allocate_slots(req, step, num_new_computed_tokens=hit, new_computed_blocks=blocks)
            else:
                got = mgr.allocate_slots(req, step)
            if got is None:
                ok = False
                break
            req.num_computed_tokens = start + step  # the scheduler advances it after scheduling
            first = False
        t2 = clock()
        mgr.free(req)
        t3 = clock()
        if not ok:
            run.rejected += 1
        # block hashing happens when the engine admits the request; it is the
        # prefix cache's keying cost, so it counts as part of the match
        run.times.add(t1 - t0 + (t0 - t_h), t2 - t1, t3 - t2)
        run.record(n, hit if ok else 0)  # a rejected request saved nothing
    import numpy as np
    import vllm

    run.extra.update({"settings": {"prefix_cache_retention_interval": retention},
                      "default": retention == VLLM_RETENTION_DEFAULT, "num_blocks": num_blocks, "kv_cache_groups": n_groups, "hash_fn": "sha256",
                      "hash_us_p50": float(np.percentile(hash_us, 50)) if hash_us else 0.0,
                      "version": f"vllm {vllm.__version__} KVCacheManager"})
    return run.result()


def main() -> None:
    args = driver_args(__doc__, extra={"--retention": {
        "default": format_retention(VLLM_RETENTION_SWEEP),
        "help": "comma-separated prefix_cache_retention_interval values ('none' = dense)"}})
    try:
        retentions = parse_retention(args.retention, "--retention")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    logging.getLogger("vllm").setLevel(logging.WARNING)
    seqs = load_sequences(args.sequences)
    for gb in args.budgets:
        for retention in retentions:
            release_memory()  # each replay's memory baseline starts after the last one's garbage
            emit(drive(seqs, gb, args.chunk, retention))


if __name__ == "__main__":
    main()
