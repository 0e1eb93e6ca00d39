"""The reference model loads a cached prefix layer by layer while it computes.

A prefix computed in one cache (think: the host copy) is loaded into a
second cache (the device) with a LayerwiseLoader: full pages for the whole
prefix and only the SWA window pages.  The model waits per layer before its
attention; a slowed copy shows it never reads a layer before that layer's
load finished, and its logits still equal the dense forward.
"""

import time

import numpy as np

from hybridkv import CacheConfig, HybridKVCache
from hybridkv.eval.model import ReferenceModel, tiny_spec
from hybridkv.transfer import copy_pages
from hybridkv.transfer.layerwise import LayerwiseLoader, arena_layer_jobs


def test_layerwise_prefix_load_feeds_the_model():
    spec = tiny_spec()
    model = ReferenceModel(spec, seed=7)
    cfg = CacheConfig(full_pages=64, swa_pages=32, device="cpu", retention="eager", swa_checkpoint=0)
    host, dev = HybridKVCache(spec, cfg), HybridKVCache(spec, cfg)
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 64, 48).astype(np.int32)
    req = host.begin(prompt)
    model.forward_cached(host, req, len(prompt))
    host.finish(req)

    follow = np.concatenate([prompt, rng.integers(0, 64, 10)]).astype(np.int32)
    m = host.match(follow)
    hit = m.length
    assert hit == 48
    wp = spec.window_pages
    req = dev.begin(follow)
    assert req.prefix_len == 0
    dev.reserve(req, hit)
    n = hit // spec.page_size
    src_full, dst_full = m.full_pages, req.full_pages[:n].copy()
    src_swa, dst_swa = m.swa_pages[n - wp:n], req.swa_pages[n - wp:n].copy()
    dev.commit(req, hit)  # out-of-window SWA (never loaded) is released, not cached
    hb, db = host.pool.buffers, dev.pool.buffers
    jobs = arena_layer_jobs([k.value for k in spec.layer_kinds], hb, db,
                            {"full": (src_full, dst_full), "swa": (src_swa, dst_swa)})

    def slow_copy(*args, **kwargs):
        time.sleep(0.02)
        return copy_pages(*args, **kwargs)

    reads: dict[int, float] = {}
    with LayerwiseLoader(jobs, copy_fn=slow_copy) as loader:
        def before(i):
            loader.wait(i)
            reads[i] = time.monotonic()
            assert loader.done(i)
        logits = model.forward_cached(dev, req, len(follow) - hit, before_layer=before)
        finish = dict(loader.finish_times)
    dev.finish(req)
    for i in range(spec.num_layers):
        assert finish[i] <= reads[i], f"layer {i} read before its load finished"
    dense = model.forward_dense(follow)[hit:]
    assert float((logits - dense).abs().max()) < 1e-9
    dev.check_invariants()
