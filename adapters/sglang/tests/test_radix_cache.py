"""hybridkv as SGLang 0.5.23's radix cache, driven through SGLang's real classes on CPU."""

from __future__ import annotations

import types
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch

import conftest
from sglang_flow import Driver, Pools, prefix_hashes

conftest.publish_test_server_args()

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from hybridkv_sglang.radix_cache import HybridKVRadixCache  # noqa: E402

W = 128


def _cache(full: int = 20000, swa: int = 8000, **kw) -> tuple[HybridKVRadixCache, Pools]:
    pools = Pools(full_tokens=full, swa_tokens=swa)
    return HybridKVRadixCache(pools.init_params(W), **kw), pools


def _trace_prompts(n: int, max_len: int) -> list[np.ndarray]:
    traces = conftest.shared_traces()
    if traces is None:
        pytest.skip("../shared/traces (relative to the repository root) is absent")
    from hybridkv.eval.traces import TokenMaterializer, load_trace

    reqs = [r for r in load_trace(traces / "mooncake_conversation_trace.jsonl", limit=4 * n + 200)
            if r.input_length <= max_len][:n]
    mat = TokenMaterializer()
    return [mat.tokens(r).astype(np.int64) for r in reqs]


def _key(tokens, extra_key=None) -> RadixKey:
    from array import array
    return RadixKey(array("q", [int(t) for t in tokens]), extra_key)


# ------------------------------------------------------------------ registration
def test_plugin_entry_point_registers_backend_and_sglang_builds_it():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hybridkv"]
    assert eps, "hybridkv_sglang must declare the sglang.srt.plugins entry point"
    eps[0].load()()  # what sglang.srt.plugins.load_plugins() does in every process
    eps[0].load()()  # idempotent
    from sglang.srt.mem_cache import registry

    assert "hybridkv" in registry.registered_radix_cache_backends()
    pools = Pools(full_tokens=4000, swa_tokens=2000)
    override = conftest.publish_test_server_args(radix_cache_backend="hybridkv")
    try:
        ctx = registry.TreeCacheBuildContext(
            server_args=None, params=pools.init_params(W), is_hybrid_swa=True, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
            model_config=None, tp_size=1, tp_rank=0, tp_group=None)
        cache = registry.create_tree_cache(ctx)  # SGLang's own routing on --radix-cache-backend
        assert isinstance(cache, HybridKVRadixCache)
        assert cache.sliding_window_size == W and cache.supports_swa()
        ctx.is_hybrid_swa = False
        with pytest.raises(ValueError, match="hybrid sliding-window"):
            registry.create_tree_cache(ctx)
    finally:
        override.restore()
        conftest.publish_test_server_args()


def test_bad_construction_arguments():
    pools = Pools(full_tokens=1000, swa_tokens=500)
    params = pools.init_params(None)
    with pytest.raises(ValueError, match="sliding_window_size"):
        HybridKVRadixCache(params)
    with pytest.raises(TypeError, match="params"):
        HybridKVRadixCache(object())
    params = pools.init_params(W)
    params.token_to_kv_pool_allocator = pools.allocator.full_attn_allocator
    with pytest.raises(TypeError, match="SWATokenToKVPoolAllocator"):
        HybridKVRadixCache(params)


# ------------------------------------------------------------------ flows
def test_mooncake_flow_under_pressure_is_window_safe_and_conserves_pools():
    """Chunked prefill, decode with out-of-window release, finish, eviction under
    pressure; content oracle on every hit, SGLang's pool accounting after every
    step, tree/mapping consistency every few steps."""
    prompts = _trace_prompts(120, 8192)
    cache, pools = _cache(full=30000, swa=12000)
    driver = Driver(cache, pools, W, chunk=2048, max_live=3)
    steps = {"n": 0}

    def sanity(d: Driver) -> None:
        steps["n"] += 1
        if steps["n"] % 25 == 0:
            d.cache.sanity_check()

    driver.after_step = sanity
    stats = driver.run([(p, 24, None) for p in prompts])
    cache.sanity_check()
    assert stats.requests == len(prompts) and stats.rejected == 0
    assert stats.hit_tokens > 0, "the trace has shared prefixes: some must hit"
    assert cache.tree.evicted_full_pages + cache.tree.evicted_swa_pages > 0, "pools were meant to be under pressure"
    assert stats.checks > 1000
    # idle: nothing protected, everything evictable or free
    assert cache.full_protected_size() == cache.swa_protected_size() == 0
    a = pools.allocator
    assert a.full_available_size() + cache.full_evictable_size() == pools.full_tokens
    assert a.swa_available_size() + cache.swa_evictable_size() == pools.swa_tokens
    print(f"\n[hybridkv radix] {stats.requests} requests, {stats.input_tokens} input tokens, "
          f"{stats.hit_tokens} hit tokens, {stats.checks} accounting checks, "
          f"evicted full/swa pages {cache.tree.evicted_full_pages}/{cache.tree.evicted_swa_pages}")


@pytest.mark.parametrize("prefill_end_checkpoint", [True, False])
def test_decode_release_keeps_window_and_end_of_prompt_is_not_a_pseudo_hit(prefill_end_checkpoint):
    rng = np.random.default_rng(1)
    prompt = rng.integers(10, 30000, 600).astype(np.int64)
    cache, pools = _cache()
    driver = Driver(cache, pools, W, chunk=256, checkpoint_prefill_end=prefill_end_checkpoint)
    swa_free_min = []
    driver.after_step = lambda d: swa_free_min.append(pools.allocator.swa_available_size())
    driver.run([(prompt, 700, None)])
    # decode released out-of-window SWA: the request never held more than its
    # window plus one chunk of the prompt beyond what the tree kept
    peak_swa = pools.swa_tokens - min(swa_free_min)
    assert peak_swa < len(prompt) + 700, peak_swa
    cache.sanity_check()
    assert cache.total_size() == 1300  # prompt + outputs are cached (full KV)
    m = cache.match_prefix(MatchPrefixParams(key=_key(prompt)))
    assert m.full_kv_hit_length == 600
    if prefill_end_checkpoint:
        # SGLang's scheduler checkpoints the request when its prefill ends: the
        # tree owns the prompt's SWA, decode frees only the outputs' private SWA,
        # so the window ending at the prompt's end is still there.
        assert m.device_prefix_len == 600
        want = 599  # a request never hits its own last token
    else:
        # The prompt ends where its SWA was released during decode: the
        # window-safe hit stops at the last prefill chunk boundary (512), whose
        # SWA the tree kept from the chunk checkpoint.
        assert m.device_prefix_len == 512
        want = 512
    # a request for the same prompt gets exactly that hit, and its KV (tags read
    # back from SGLang's K/V buffers) is right
    stats = driver.run([(prompt, 1, None)])
    assert stats.hits[-1] == want


def test_lock_survives_eviction_and_namespaces_do_not_share():
    rng = np.random.default_rng(2)
    a, b = rng.integers(10, 30000, 1000), rng.integers(10, 30000, 1000)
    cache, pools = _cache()
    Driver(cache, pools, W).run([(a, 1, None), (b, 1, None)])
    assert cache.total_size() == 2002
    m = cache.match_prefix(MatchPrefixParams(key=_key(a)))
    assert m.device_prefix_len == 1000
    lock = cache.lock(m.last_device_node)
    assert cache.full_protected_size() == 1000 and cache.swa_protected_size() == W
    before = prefix_hashes(a)
    res = cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6))
    assert res.num_tokens_evicted >= 1001  # b (and a's unlocked tail) went, a's locked path stayed
    assert cache.match_prefix(MatchPrefixParams(key=_key(a))).device_prefix_len == 1000
    assert cache.match_prefix(MatchPrefixParams(key=_key(b))).device_prefix_len == 0
    assert cache.match_prefix(MatchPrefixParams(key=_key(a, extra_key="lora-2"))).device_prefix_len == 0
    cache.unlock(lock)
    assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
    with pytest.raises(ValueError, match="no lock"):
        cache.dec_lock_ref(m.last_device_node)
    cache.sanity_check()
    assert before.size == 1000


def test_swa_only_eviction_keeps_full_kv_and_clears_sglang_mapping():
    rng = np.random.default_rng(3)
    a = rng.integers(10, 30000, 2000)
    cache, pools = _cache(swa_checkpoint=0)
    Driver(cache, pools, W, chunk=512).run([(a, 1, None)])
    swa_before = cache.swa_evictable_size()
    res = cache.evict(EvictParams(swa_num_tokens=swa_before))
    assert res.swa_num_tokens_evicted == swa_before and res.num_tokens_evicted == 0
    assert cache.total_size() == 2001  # full KV stays for the full-attention layers
    assert cache.swa_evictable_size() == 0
    mapping = pools.allocator.full_to_swa_index_mapping
    assert int((mapping[cache.path_device_indices(cache.match_prefix(
        MatchPrefixParams(key=_key(a))).last_device_node)] != 0).sum()) == 0
    assert cache.match_prefix(MatchPrefixParams(key=_key(a))).device_prefix_len == 0
    cache.sanity_check()


def test_match_rejects_bigram_keys():
    from array import array

    cache, _ = _cache()
    with pytest.raises(ValueError, match="bigram"):
        cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3]), is_bigram=True)))
    assert isinstance(cache.path_device_indices(cache.root_node), torch.Tensor)


def test_predicted_windows_do_not_take_the_tails_of_a_swa_pool_sized_for_tails():
    """SGLang sizes the SWA pool apart from full KV (``--swa-full-tokens-ratio``;
    ``hybridkv_sglang.split`` plans one window per cached sequence).  With the
    learned divergence model keeping a window before each new prompt's end, that
    window's SWA must give way before other conversations' tails: every next turn
    (the previous prompt, its output, a new message) hits its whole previous turn.
    When the least recently used node's windows went together, the predicted
    windows pushed the first conversations' tails out and their next turns hit
    nothing."""
    rng = np.random.default_rng(7)
    n, length, d = 6, 1000, 300
    prompts = [rng.integers(10, 30000, length).astype(np.int64) for _ in range(n)]
    outputs = [rng.integers(10, 30000, 1).astype(np.int64) for _ in range(n)]
    # full KV for everything; SWA for one request's prompt (one chunk) and window plus
    # the n tails, not for the n predicted windows besides
    cache, pools = _cache(full=30000, swa=length + 2 * W + n * (W + 2) + 64)
    tree = cache.tree
    tree.policy.pretail_pages = d  # the decision the model takes on re-asked documents, frozen
    tree.divergence.observe = lambda dist, gain: False
    driver = Driver(cache, pools, W, chunk=1024, max_live=1)
    driver.run([(prompts[0], outputs[0], None)])
    assert [node.points for node in tree.iter_nodes() if node.points] == [[length - d]]  # the window is kept
    driver.run([(p, o, None) for p, o in zip(prompts[1:], outputs[1:])])
    cache.sanity_check()
    turns = [np.concatenate([p, o, rng.integers(10, 30000, 40)]) for p, o in zip(prompts, outputs)]
    stats = driver.run([(t, 1, None) for t in turns])
    cache.sanity_check()
    assert stats.hits[-n:] == [length + 1] * n, stats.hits[-n:]
