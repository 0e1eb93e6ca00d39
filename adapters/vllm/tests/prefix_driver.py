"""Drive a vLLM 0.32 ``KVCacheManager`` (vLLM's own, or hybridkv's) the way its
scheduler does, with a content oracle over the block pool.

The oracle records, for every (group, block) a request computes into, the
position and the tokens it holds; at every hit it checks that each full group's
blocks before the hit, and each sliding-window group's blocks in its window
before the hit, hold exactly the request's tokens at those positions.  A wrong
hit (a block reused for other tokens, a window the tree does not hold) is a
mismatch.  Used by the tests and the equal-blocks comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

HEAD = 32


def build_manager(num_blocks: int, page: int, windows: Sequence[int | None], *, max_model_len: int = 1 << 16,
                  retention: int | None = 0, hybridkv: bool = False, options: Any = None,
                  sizes: Sequence[int] | None = None) -> Any:
    """A manager with one KV-cache group per entry of ``windows`` (None: full
    attention, else a sliding window of that many tokens); ``sizes``: each
    group's block size (default ``page``; the scheduler's block size is the
    largest)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    groups = []
    sizes = list(sizes or [page] * len(windows))
    for i, w in enumerate(windows):
        kw = dict(block_size=sizes[i], num_kv_heads=page // sizes[i], head_size=HEAD, dtype=torch.bfloat16)
        spec = FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(**kw, sliding_window=w)
        groups.append(KVCacheGroupSpec([f"layers.{i}"], spec))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                           prefix_cache_retention_interval=retention)
    mgr = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=max(sizes),
                         hash_block_size=min(sizes),
                         enable_caching=True, log_stats=True)
    if hybridkv:
        from hybridkv_vllm.prefix import HybridKVCacheManager

        mgr = HybridKVCacheManager.adopt(mgr, options)
    return mgr


@dataclass
class Oracle:
    """(group, block id) -> (page index, tokens) of what was computed into it."""

    sizes: Sequence[int]  # each group's block size
    windows: Sequence[int | None]
    content: dict[tuple[int, int], tuple[int, bytes]] = field(default_factory=dict)
    checked_blocks: int = 0
    mismatches: int = 0

    def wrote(self, mgr: Any, req_id: str, tokens: np.ndarray, start: int, end: int) -> None:
        for g, blocks in enumerate(mgr.coordinator.get_blocks(req_id)):
            P = self.sizes[g]
            for p in range(start // P, -(-end // P)):
                b = blocks[p]
                if not b.is_null:
                    self.content[(g, b.block_id)] = (p, tokens[p * P:(p + 1) * P].tobytes())

    def check_hit(self, blocks: Any, tokens: np.ndarray, hit: int) -> None:
        for g, (row, w) in enumerate(zip(blocks.blocks, self.windows)):
            P = self.sizes[g]
            n = hit // P
            lo = 0 if w is None else max(0, (hit - (w - 1)) // P)
            if len(row) < n:
                self.mismatches += 1
                continue
            for p in range(lo, n):
                b = row[p]
                want = (p, tokens[p * P:(p + 1) * P].tobytes())
                self.checked_blocks += 1
                if b.is_null or self.content.get((g, b.block_id)) != want:
                    self.mismatches += 1


def replay(mgr: Any, prompts: Sequence[np.ndarray], *, page: int, windows: Sequence[int | None],
           chunk: int = 256, concurrent: int = 1, salts: Sequence[str | None] | None = None,
           check: bool = True, invariants: bool = True, sizes: Sequence[int] | None = None) -> dict[str, int]:
    """Prefill each prompt (chunked, up to ``concurrent`` requests interleaved
    chunk by chunk), free it; returns hit/input tokens, rejections and the
    oracle's counts."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    init_none_hash(hash_fn)
    sizes = list(sizes or [page] * len(windows))
    hasher = get_request_block_hasher(min(sizes), hash_fn)
    oracle = Oracle(sizes, windows)
    params = SamplingParams(max_tokens=1)
    out = {"hit_tokens": 0, "input_tokens": 0, "rejected": 0, "requests": 0}
    queue = list(range(len(prompts)))
    active: list[tuple[Any, np.ndarray]] = []
    while queue or active:
        while queue and len(active) < concurrent:
            i = queue.pop(0)
            toks = np.asarray(prompts[i], dtype=np.int64)
            req = Request(f"r{i}", toks.tolist(), params, None, block_hasher=hasher,
                          cache_salt=None if salts is None else salts[i])
            blocks, hit, junction = mgr.get_computed_blocks(req)
            req.shared_prefix_boundary = junction
            step = min(chunk, len(toks) - hit)
            got = mgr.allocate_slots(req, step, num_new_computed_tokens=hit, new_computed_blocks=blocks)
            out["requests"] += 1
            out["input_tokens"] += len(toks)
            if got is None:
                out["rejected"] += 1
                mgr.free(req)
                continue
            if check and hit:
                oracle.check_hit(blocks, toks, hit)
            out["hit_tokens"] += hit
            oracle.wrote(mgr, req.request_id, toks, hit, hit + step)
            req.num_computed_tokens = hit + step
            active.append((req, toks))
        nxt = []
        for req, toks in active:
            n = len(toks)
            if req.num_computed_tokens >= n:
                mgr.free(req)
                continue
            start = req.num_computed_tokens
            step = min(chunk, n - start)
            if mgr.allocate_slots(req, step) is None:
                out["rejected"] += 1
                mgr.free(req)
                continue
            oracle.wrote(mgr, req.request_id, toks, start, start + step)
            req.num_computed_tokens = start + step
            nxt.append((req, toks))
        active = nxt
        if invariants and hasattr(mgr, "check_invariants"):
            mgr.check_invariants()
    out["checked_blocks"] = oracle.checked_blocks
    out["mismatches"] = oracle.mismatches
    return out


def shared_prefix_prompts(rng: np.random.Generator, n: int, *, page: int, vocab: int = 5000) -> list[np.ndarray]:
    """Sessions that grow (multi-turn), system prompts shared across sessions, and
    one-off prompts; lengths not page aligned."""
    systems = [rng.integers(0, vocab, int(rng.integers(2, 12)) * page + int(rng.integers(0, page)))
               for _ in range(3)]
    sessions: list[np.ndarray] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if sessions and r < 0.55:
            k = int(rng.integers(0, len(sessions)))
            grown = np.concatenate([sessions[k], rng.integers(0, vocab, int(rng.integers(1, 5 * page)))])
            sessions[k] = grown
            out.append(grown)
        elif r < 0.85:
            s = systems[int(rng.integers(0, len(systems)))]
            p = np.concatenate([s, rng.integers(0, vocab, int(rng.integers(1, 6 * page)))])
            sessions.append(p)
            out.append(p)
        else:
            out.append(rng.integers(0, vocab, int(rng.integers(1, 8 * page))))
    return out
