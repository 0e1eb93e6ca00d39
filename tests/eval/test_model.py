"""Model-level equality: the reference transformer through hybridkv vs a dense forward."""

import numpy as np
import pytest
import torch

from hybridkv import CacheConfig, HybridKVCache
from hybridkv.eval.model import ReferenceModel, tiny_spec
from hybridkv.eval.model.verify import TOLERANCE, scaled_prompts, small_cache, verify_requests


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(tiny_spec(), seed=1)


def test_cached_equals_dense_with_every_kind_of_hit(model):
    spec = model.spec
    cache = HybridKVCache(spec, CacheConfig(full_pages=200, swa_pages=60, device="cpu", swa_checkpoint=32,
                                            retention="eager"))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 64, 120).astype(np.int32)
    prompts = [
        ("a", base[:80]),                                   # cold
        ("a", base[:80]),                                   # full repeat
        ("a", base[:100]),                                  # extension (multi-turn)
        ("a", np.concatenate([base[:40], [1, 2, 3, 4]])),   # shared prefix, branch mid-sequence
        ("b", base[:100]),                                  # other namespace: no hit
    ]
    out = verify_requests(prompts, cache, model, chunk=16, decode_tokens=5)
    assert out["mismatched_requests"] == 0 and out["max_abs_diff"] < TOLERANCE
    assert out["hit_tokens"] >= 76 + 96
    cache.check_invariants()


def test_cached_equals_dense_under_eviction_on_mooncake(model):
    prompts = scaled_prompts(None, 40)
    cache = small_cache(model.spec)
    out = verify_requests(prompts, cache, model)
    assert out["mismatched_requests"] == 0, out
    assert out["hit_tokens"] > 0 and out["evicted_tokens"] > 0 and out["evicted_swa_tokens"] > 0
    cache.check_invariants()


def test_cached_equals_dense_on_weka_sessions(model, shared_traces):
    files = sorted((shared_traces / "weka").glob("*.json.gz"))
    prompts = scaled_prompts(str(files[0]), 12, scale=256) + scaled_prompts(str(files[1]), 12, scale=256)
    cache = small_cache(model.spec, full_pages=120, swa_pages=30)
    out = verify_requests(prompts, cache, model, chunk=32, decode_tokens=2)
    assert out["mismatched_requests"] == 0, out
    assert out["hit_tokens"] > 0
    cache.check_invariants()


def test_a_corrupted_page_is_detected(model):
    """The oracle is sensitive: overwrite cached KV and the next hit must mismatch."""
    spec = model.spec
    cache = HybridKVCache(spec, CacheConfig(full_pages=100, swa_pages=40, device="cpu"))
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 64, 40).astype(np.int32)
    verify_requests([("a", toks)], cache, model, decode_tokens=0)
    cache.pool.buffers.full.k.add_(0.5)  # corrupt every cached full-layer key
    out = verify_requests([("a", np.concatenate([toks, [5]]))], cache, model, decode_tokens=0)
    assert out["hit_tokens"] > 0 and out["mismatched_requests"] == 1


def test_model_never_reads_released_swa(model):
    spec = model.spec
    cache = HybridKVCache(spec, CacheConfig(full_pages=100, swa_pages=40, device="cpu", retention="eager",
                                            swa_checkpoint=0))
    toks = np.arange(60, dtype=np.int32) % 64
    req = cache.begin(toks)
    for _ in range(3):
        model.forward_cached(cache, req, 20)
    assert (req.swa_pages[:8] < 0).all()  # released behind the window
    with pytest.raises(RuntimeError, match="not held"):
        cache.swa_slots(req, 0, 4)
    cache.finish(req)


def test_layer_hook_called_in_order(model):
    cache = HybridKVCache(model.spec, CacheConfig(full_pages=50, swa_pages=20, device="cpu"))
    req = cache.begin(np.arange(10, dtype=np.int32))
    seen = []
    model.forward_cached(cache, req, 10, before_layer=seen.append)
    assert seen == list(range(model.spec.num_layers))
    cache.finish(req)


def test_model_rejects_meta_cache(model):
    cache = HybridKVCache(model.spec, CacheConfig(full_pages=50, swa_pages=20, device="meta"))
    req = cache.begin(np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError, match="real KV buffers"):
        model.forward_cached(cache, req, 4)
    cache.abort(req)
    assert torch.isfinite(model.forward_dense(np.arange(5))).all()
