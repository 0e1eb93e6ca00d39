"""hybridkv as SGLang 0.5.23's radix cache, driven through SGLang's real classes on CPU.

The flows run at page sizes 1, 16, 64 and 128 (:data:`PAGE_SIZES`): above 1 the
driver allocates through SGLang's paged ``alloc_extend`` / ``alloc_decode`` (their
torch fallbacks on CPU), hits end on page boundaries and a prompt's last partial
page stays the request's.  Every flow fails on a wrong hit (content tags behind every
hit) and on a leaked page (pool accounting after every step; all pages back to
SGLang's free lists once the tree is emptied)."""

from __future__ import annotations

import types
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch

import conftest
from sglang_flow import Driver, Pools, PseudoHitError, prefix_hashes

conftest.publish_test_server_args()

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from hybridkv_sglang.radix_cache import HybridKVRadixCache  # noqa: E402

W = 128
#: SGLang 0.5.23 serves MiMo-V2 at page size 1 on Hopper (FA3, default page size)
#: and 128 on Blackwell (FA4 forces it); 16 and 64 are common ``--page-size`` choices
PAGE_SIZES = (1, 16, 64, 128)


def _cache(full: int = 20000, swa: int = 8000, page_size: int = 1, **kw) -> tuple[HybridKVRadixCache, Pools]:
    pools = Pools(full_tokens=full, swa_tokens=swa, page_size=page_size)
    return HybridKVRadixCache(pools.init_params(W), **kw), pools


def _pages(tokens: int, page_size: int) -> int:
    """``tokens`` rounded down to whole pages (what the tree keeps of a sequence)."""
    return tokens // page_size * page_size


def _assert_no_leak(cache: HybridKVRadixCache, pools: Pools) -> None:
    """Idle: evicting everything gives every page of both pools back to SGLang."""
    assert cache.full_protected_size() == cache.swa_protected_size() == 0
    a = pools.allocator
    assert a.full_available_size() + cache.full_evictable_size() == pools.full_tokens
    assert a.swa_available_size() + cache.swa_evictable_size() == pools.swa_tokens
    cache.evict(EvictParams(num_tokens=pools.full_tokens, swa_num_tokens=pools.swa_tokens))
    assert cache.total_size() == 0 and cache.tree.full_pages_cached == cache.tree.swa_pages_cached == 0
    assert (a.full_available_size(), a.swa_available_size()) == (pools.full_tokens, pools.swa_tokens)
    assert int((a.full_to_swa_index_mapping[:-1] != 0).sum()) == 0


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
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mooncake_flow_under_pressure_is_window_safe_and_conserves_pools(page_size):
    """Chunked prefill, decode with out-of-window release, finish, eviction under
    pressure; content oracle on every hit, SGLang's pool accounting after every
    step, tree/mapping consistency (every token of every page) every few steps."""
    prompts = _trace_prompts(120, 8192)
    cache, pools = _cache(full=30000, swa=12000, page_size=page_size)
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
    assert all(h % page_size == 0 for h in stats.hits)
    print(f"\n[hybridkv radix, page {page_size}] {stats.requests} requests, {stats.input_tokens} input tokens, "
          f"{stats.hit_tokens} hit tokens ({sum(1 for h in stats.hits if h)} hits content-checked), "
          f"{stats.checks} accounting checks, "
          f"evicted full/swa pages {cache.tree.evicted_full_pages}/{cache.tree.evicted_swa_pages}")
    _assert_no_leak(cache, pools)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("prefill_end_checkpoint", [True, False])
def test_decode_release_keeps_window_and_end_of_prompt_is_not_a_pseudo_hit(prefill_end_checkpoint, page_size):
    rng = np.random.default_rng(1)
    prompt = rng.integers(10, 30000, 600).astype(np.int64)
    cache, pools = _cache(page_size=page_size)
    driver = Driver(cache, pools, W, chunk=256, checkpoint_prefill_end=prefill_end_checkpoint)
    swa_free_min = []
    driver.after_step = lambda d: swa_free_min.append(pools.allocator.swa_available_size())
    driver.run([(prompt, 700, None)])
    # decode released out-of-window SWA: the request never held more than its
    # window plus one chunk of the prompt beyond what the tree kept
    peak_swa = pools.swa_tokens - min(swa_free_min)
    assert peak_swa < len(prompt) + 700, peak_swa
    cache.sanity_check()
    # prompt + outputs are cached (full KV), whole pages of it: the last partial
    # page was the request's and went back with it
    assert cache.total_size() == _pages(1300, page_size)
    m = cache.match_prefix(MatchPrefixParams(key=_key(prompt)))
    assert m.full_kv_hit_length == _pages(600, page_size)
    if prefill_end_checkpoint:
        # SGLang's scheduler checkpoints the request when its prefill ends: the
        # tree owns the prompt's SWA, decode frees only the outputs' private SWA,
        # so the window ending at the prompt's end is still there.
        assert m.device_prefix_len == _pages(600, page_size)
        want = _pages(599, page_size)  # a request never hits its own last token
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
    _assert_no_leak(cache, pools)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lock_survives_eviction_and_namespaces_do_not_share(page_size):
    rng = np.random.default_rng(2)
    a, b = rng.integers(10, 30000, 1000), rng.integers(10, 30000, 1000)
    cache, pools = _cache(page_size=page_size)
    Driver(cache, pools, W).run([(a, 1, None), (b, 1, None)])
    held = _pages(1001, page_size)  # prompt and output, whole pages
    assert cache.total_size() == 2 * held
    m = cache.match_prefix(MatchPrefixParams(key=_key(a)))
    assert m.device_prefix_len == _pages(1000, page_size)
    lock = cache.lock(m.last_device_node)
    assert cache.full_protected_size() == _pages(1000, page_size) and cache.swa_protected_size() == W
    before = prefix_hashes(a)
    res = cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6))
    # b (and a's unlocked tail) went, a's locked path stayed
    assert res.num_tokens_evicted == 2 * held - _pages(1000, page_size)
    assert cache.match_prefix(MatchPrefixParams(key=_key(a))).device_prefix_len == _pages(1000, page_size)
    assert cache.match_prefix(MatchPrefixParams(key=_key(b))).device_prefix_len == 0
    assert cache.match_prefix(MatchPrefixParams(key=_key(a, extra_key="lora-2"))).device_prefix_len == 0
    cache.unlock(lock)
    assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0
    with pytest.raises(ValueError, match="no lock"):
        cache.dec_lock_ref(m.last_device_node)
    cache.sanity_check()
    assert before.size == 1000
    _assert_no_leak(cache, pools)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_swa_only_eviction_keeps_full_kv_and_clears_sglang_mapping(page_size):
    rng = np.random.default_rng(3)
    a = rng.integers(10, 30000, 2000)
    cache, pools = _cache(swa_checkpoint=0, page_size=page_size)
    Driver(cache, pools, W, chunk=512).run([(a, 1, None)])
    swa_before = cache.swa_evictable_size()
    res = cache.evict(EvictParams(swa_num_tokens=swa_before))
    assert res.swa_num_tokens_evicted == swa_before and res.num_tokens_evicted == 0
    assert cache.total_size() == _pages(2001, page_size)  # full KV stays for the full-attention layers
    assert cache.swa_evictable_size() == 0
    mapping = pools.allocator.full_to_swa_index_mapping
    assert int((mapping[cache.path_device_indices(cache.match_prefix(
        MatchPrefixParams(key=_key(a))).last_device_node)] != 0).sum()) == 0
    assert cache.match_prefix(MatchPrefixParams(key=_key(a))).device_prefix_len == 0
    cache.sanity_check()
    _assert_no_leak(cache, pools)


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


# ------------------------------------------------------------------ planted faults
def _reasked_prompt_flow(page_size: int) -> tuple[HybridKVRadixCache, Pools, Driver, np.ndarray]:
    """A prompt whose SWA decode released at its end (no prefill-end checkpoint):
    its raw match is longer than its window-safe hit."""
    prompt = np.random.default_rng(5).integers(10, 30000, 700).astype(np.int64)
    cache, pools = _cache(page_size=page_size)
    driver = Driver(cache, pools, W, chunk=256, checkpoint_prefill_end=False)
    driver.run([(prompt, 400, None)])
    m = cache.match_prefix(MatchPrefixParams(key=_key(prompt)))
    assert m.full_kv_hit_length > m.device_prefix_len
    return cache, pools, driver, prompt


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_planted_pseudo_hit_fails_the_content_check(page_size, monkeypatch):
    """A tree that took its raw match for window-safe would hand out SWA that
    decode released: the flow's content check (tags read back through SGLang's
    full->SWA mapping) must fail on it, at every page size."""
    cache, _, driver, prompt = _reasked_prompt_flow(page_size)
    monkeypatch.setattr(cache.tree.anchors, "safe_pages", lambda path, raw: raw)
    with pytest.raises(PseudoHitError, match="SWA KV"):
        driver.run([(prompt, 1, None)])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_planted_leaked_page_fails_the_accounting(page_size, monkeypatch):
    """A pool that drops one page of every eviction it gives back (a page SGLang
    never sees again) must fail the flow's accounting check."""
    from hybridkv_sglang.pool import SGLangPagePool

    free = SGLangPagePool.free_full_trusted
    monkeypatch.setattr(SGLangPagePool, "free_full_trusted", lambda self, pages: free(self, pages[1:]))
    cache, pools = _cache(full=4096, swa=2048, page_size=page_size)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(10, 30000, 900).astype(np.int64) for _ in range(8)]
    with pytest.raises(AssertionError, match="full pool"):
        Driver(cache, pools, W, chunk=512).run([(p, 4, None) for p in prompts])


def test_checkpoint_refuses_a_row_that_is_not_whole_pages():
    """At page size > 1 the tree's page ids come from the row's page-start slots;
    a row whose page is not one whole allocator page is refused (ValueError
    naming the request), not cached under the wrong page."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.common import checkpoint_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache, pools = _cache(page_size=64)
    prompt = np.random.default_rng(8).integers(10, 30000, 300).astype(np.int64)
    req = Req("bad-row", "", array("q", prompt.tolist()), SamplingParams(max_new_tokens=1))
    req.init_next_round_input(cache)
    req.lock = cache.lock(req.last_node)
    pools.req_to_token.alloc([req])
    lens = torch.tensor([0], dtype=torch.int64), torch.tensor([256], dtype=torch.int64)
    slots = pools.allocator.alloc_extend(lens[0], lens[0], lens[1], lens[1], torch.tensor([-1]), 256)
    pools.req_to_token.write((req.kv.req_pool_idx, slice(0, 256)), slots.roll(1).to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = 256
    with pytest.raises(ValueError, match="req bad-row: row page 0 .* not one whole page"):
        checkpoint_kv_cache(req, cache)
    assert cache.total_size() == 0
