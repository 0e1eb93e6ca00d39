"""``hybridkv verify``: the reference model through the cache vs a dense forward.

Trace prompts are scaled down (every ``scale``-th token, capped at
``max_tokens``), which keeps their prefix sharing: two prompts that share
``L`` tokens share ``ceil(L / scale)`` after scaling.  The budget is small,
so eviction of full KV, of SWA only, and SWA release during prefill and
decode all happen while later requests hit.  Every logit the cache path
produces is compared with a cache-free forward of the same tokens.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from ...cache import CacheConfig, HybridKVCache
from ...pools import arena_page_bytes
from ...spec import ModelSpec
from ..traces import TokenMaterializer, bundled_sample, load_trace
from .reference import ReferenceModel, tiny_spec, torch_threads

__all__ = ["run_verify", "verify_requests", "scaled_prompts"]

TOLERANCE = 1e-9


def scaled_prompts(trace: str | None, requests: int, *, scale: int = 64, max_tokens: int = 192,
                   vocab: int = 64, branch_every: int = 3, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """``(namespace, tokens)`` of the first ``requests`` prompts, scaled down.

    Every ``branch_every``-th prompt is followed by a *branch*: a random-length
    prefix of an earlier prompt plus new tokens.  Branches end hits in the
    middle of cached sequences, where SWA was released, which is exactly where
    a cache without window safety would serve a pseudo-hit.
    """
    reqs = load_trace(trace or bundled_sample(), limit=requests)
    mat = TokenMaterializer()
    rng = np.random.default_rng(seed)
    out: list[tuple[str, np.ndarray]] = []
    for i, r in enumerate(reqs):
        toks = mat.tokens(r)[::scale][:max_tokens] % vocab
        if len(toks) >= 2:
            out.append((r.namespace, toks.astype(np.int32)))
        if branch_every and i % branch_every == branch_every - 1 and out:
            ns, src = out[int(rng.integers(len(out)))]
            cut = int(rng.integers(1, len(src)))
            tail = rng.integers(0, vocab, int(rng.integers(1, 12)))
            out.append((ns, np.concatenate([src[:cut], tail]).astype(np.int32)))
    return out


def verify_requests(prompts: list[tuple[str, np.ndarray]], cache: HybridKVCache, model: ReferenceModel, *,
                    chunk: int = 24, decode_tokens: int = 3,
                    on_request: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run every prompt (chunked prefill + greedy decode) and compare with the dense forward.

    Runs on as many of torch's intra-op threads as the model's ops are worth
    (:meth:`ReferenceModel.threads_for` the longest prompt: one for the verify
    model), restored afterwards: more threads than work spin against each other,
    and against any other process on the machine."""
    longest = max((len(tokens) for _, tokens in prompts), default=1) + decode_tokens
    with torch_threads(model.threads_for(longest)):
        return _verify_requests(prompts, cache, model, chunk, decode_tokens, on_request)


def _verify_requests(prompts: list[tuple[str, np.ndarray]], cache: HybridKVCache, model: ReferenceModel,
                     chunk: int, decode_tokens: int, on_request: Callable[[int], None] | None) -> dict[str, Any]:
    max_diff = 0.0
    mismatched = hit = total = 0
    for idx, (ns, tokens) in enumerate(prompts):
        req = cache.begin(tokens, ns)
        hit += req.prefix_len
        total += len(tokens)
        logits = []
        while req.computed < len(req.tokens):
            logits.append(model.forward_cached(cache, req, min(chunk, len(req.tokens) - req.computed)))
        for _ in range(decode_tokens):
            nxt = int(torch.argmax(logits[-1][-1]))
            cache.append_tokens(req, [nxt])
            logits.append(model.forward_cached(cache, req, 1))
        prefix = req.prefix_len
        full_tokens = req.tokens.copy()
        cache.finish(req)
        dense = model.forward_dense(full_tokens)[prefix:]
        diff = float((torch.cat(logits) - dense).abs().max())
        max_diff = max(max_diff, diff)
        mismatched += int(not diff <= TOLERANCE)
        if on_request is not None:
            on_request(idx)
    st = cache.stats()
    return {"requests": len(prompts), "input_tokens": total, "hit_tokens": hit,
            "max_abs_diff": max_diff, "mismatched_requests": mismatched,
            "evicted_tokens": st["evicted_tokens"], "evicted_swa_tokens": st["evicted_swa_tokens"],
            "released_swa_pages": st["released_swa_pages"]}


def small_cache(spec: Any, *, full_pages: int = 150, swa_pages: int = 40, swa_checkpoint: int = 32,
                retention: str = "eager") -> HybridKVCache:
    """A CPU-buffer cache small enough that the verify workload evicts constantly."""
    budget = full_pages * arena_page_bytes(spec, "full") + swa_pages * arena_page_bytes(spec, "swa")
    return HybridKVCache(spec, CacheConfig(budget_bytes=budget, full_pages=full_pages * 2, swa_pages=swa_pages * 2,
                                           device="cpu", swa_checkpoint=swa_checkpoint, retention=retention))


def run_verify(trace: str | None = None, *, requests: int = 60, seed: int = 0,
               progress: Callable[[int, int], None] | None = None,
               spec: ModelSpec | None = None) -> dict[str, Any]:
    """The ``hybridkv verify`` job; returns its JSON dict (``progress(done, total)`` per request).

    ``spec``: the float64 model to verify (default :func:`tiny_spec`); its KV
    groups (windows, layers, shapes) are what the reference model runs."""
    t0 = time.perf_counter()
    if spec is None:
        spec = tiny_spec()
    elif not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    model = ReferenceModel(spec, seed=seed)
    prompts = scaled_prompts(trace, requests)
    cache = small_cache(spec)
    out = verify_requests(prompts, cache, model,
                          on_request=None if progress is None else lambda i: progress(i + 1, len(prompts)))
    cache.check_invariants()
    out["trace"] = str(trace or bundled_sample())
    out["model"] = spec.name
    out["kv_groups"] = [g.name for g in spec.groups]
    out["elapsed_s"] = time.perf_counter() - t0
    return out
