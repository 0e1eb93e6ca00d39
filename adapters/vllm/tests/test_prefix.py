"""hybridkv's tree as vLLM's device prefix cache (``HybridKVCacheManager``),
driven as vLLM's scheduler drives a ``KVCacheManager``, with a content oracle
over vLLM's block pool (``prefix_driver``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybridkv_vllm.prefix import HybridKVCacheManager, PrefixOptions, classify_groups
from prefix_driver import build_manager, replay, shared_prefix_prompts

PAGE = 16


def _request(rid: str, tokens: list[int]):
    """A vLLM ``Request`` with vLLM's default block hasher (sha256) at ``PAGE``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(PAGE, fn))


@pytest.mark.parametrize("windows", [(None, 32, 32), (None, 32, 64, None)])
@pytest.mark.parametrize("blocks", [90, 300, 3000])
@pytest.mark.parametrize("concurrent", [1, 3])
def test_every_hit_holds_the_requests_tokens(windows, blocks, concurrent):
    """0 oracle mismatches: every full group's blocks before a hit, and every
    sliding group's blocks in its own window, hold the request's tokens (two
    different windows included); tree/block-pool invariants after every step."""
    rng = np.random.default_rng(blocks + concurrent)
    prompts = shared_prefix_prompts(rng, 160, page=PAGE)
    salts = [None if rng.random() < 0.8 else "tenant-b" for _ in prompts]
    mgr = build_manager(blocks, PAGE, windows, hybridkv=True)
    out = replay(mgr, prompts, page=PAGE, windows=windows, chunk=48, concurrent=concurrent, salts=salts)
    assert out["mismatches"] == 0, out
    assert out["hit_tokens"] > 0 and out["checked_blocks"] > 0, out
    if blocks == 90:
        assert mgr.counters["evicted_blocks"] > 0, mgr.counters  # the tight size evicts


@pytest.mark.parametrize("blocks", [120, 3000])
def test_groups_with_smaller_blocks(blocks):
    """vLLM's hybrid allocator gives a group with twice the bytes per token half
    the block size (the tiny MiMo-V2: full 32, sliding 16 here); a tree page
    spans two of its blocks."""
    windows, sizes = (None, 40, 40), (32, 16, 16)
    rng = np.random.default_rng(blocks)
    prompts = shared_prefix_prompts(rng, 120, page=32)
    mgr = build_manager(blocks, 32, windows, hybridkv=True, sizes=sizes)
    assert mgr.page_size == 32 and mgr.swa_layout.per_page == (2, 2)
    out = replay(mgr, prompts, page=32, windows=windows, chunk=64, concurrent=2, sizes=sizes)
    assert out["mismatches"] == 0 and out["hit_tokens"] > 0, out
    vllm = replay(build_manager(blocks, 32, windows, sizes=sizes), prompts, page=32, windows=windows, chunk=64,
                  concurrent=2, sizes=sizes)
    assert vllm["mismatches"] == 0, vllm


def test_the_oracle_catches_a_wrong_hit():
    """The oracle is not vacuous: a tree page pointed at another block is caught."""
    windows = (None, 32)
    rng = np.random.default_rng(5)
    prompts = shared_prefix_prompts(rng, 40, page=PAGE)
    mgr = build_manager(3000, PAGE, windows, hybridkv=True)
    replay(mgr, prompts[:20], page=PAGE, windows=windows)
    node = max(mgr.tree.iter_nodes(), key=lambda n: len(n.full))
    free_id = next(b.block_id for b in mgr.block_pool.blocks if b.ref_cnt == 0 and not b.is_null)
    node.full = node.full.copy()
    node.full[0] = free_id  # corrupt: the block holds no such tokens
    prompt = np.concatenate([node.key if node.start == 0 else prompts[0], np.arange(5)])
    out = replay(mgr, [prompt], page=PAGE, windows=windows, invariants=False)
    assert out["mismatches"] > 0


def test_vllm_manager_passes_the_same_oracle():
    windows = (None, 32, 32)
    rng = np.random.default_rng(2)
    prompts = shared_prefix_prompts(rng, 120, page=PAGE)
    for retention in (0, None):
        out = replay(build_manager(300, PAGE, windows, retention=retention), prompts, page=PAGE,
                     windows=windows, concurrent=2)
        assert out["mismatches"] == 0 and out["hit_tokens"] > 0, out


def test_idle_pool_is_the_trees_and_reset_frees_everything():
    windows = (None, 32, 32)
    rng = np.random.default_rng(3)
    mgr = build_manager(400, PAGE, windows, hybridkv=True, max_model_len=4096)
    replay(mgr, shared_prefix_prompts(rng, 80, page=PAGE), page=PAGE, windows=windows, concurrent=2)
    mgr.check_invariants()  # idle: every referenced or hashed block is the tree's
    assert mgr.tree.full_pages_cached > 0
    assert 0.0 <= mgr.usage < 0.05  # cached blocks the tree could evict count as free
    assert mgr.reset_prefix_cache()
    assert mgr.tree.full_pages_cached == 0
    assert mgr.block_pool.get_num_free_blocks() == 400 - 1  # all but vLLM's null block
    mgr.check_invariants()


def test_reset_refused_while_a_request_holds_a_hit():
    windows = (None, 32)
    mgr = build_manager(300, PAGE, windows, hybridkv=True)
    toks = list(range(100, 100 + 5 * PAGE + 3))
    replay(mgr, [np.array(toks)], page=PAGE, windows=windows)
    req = _request("again", toks + [7])
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert hit == 5 * PAGE
    assert mgr.allocate_slots(req, len(toks) + 1 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    before = mgr.tree.full_pages_cached
    assert mgr.reset_prefix_cache() is False
    assert mgr.tree.full_pages_cached == before  # nothing changed
    mgr.free(req)
    assert mgr.reset_prefix_cache()


def test_hits_and_windows_for_two_sliding_groups():
    """A hit's sliding-window blocks are real exactly in each group's window."""
    windows = (None, 32, 64)
    mgr = build_manager(500, PAGE, windows, hybridkv=True)
    toks = list(range(1, 20 * PAGE + 1))
    replay(mgr, [np.array(toks)], page=PAGE, windows=windows, chunk=64)
    req = _request("r", toks + [9, 9])
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert hit == 20 * PAGE  # adaptive retention kept the window at the prompt's end
    full, w32, w64 = blocks.blocks
    assert not any(b.is_null for b in full)
    assert [b.is_null for b in w32].count(False) == -(-31 // PAGE)
    assert [b.is_null for b in w64].count(False) == -(-63 // PAGE)
    assert all(not b.is_null for b in w64[-4:]) and all(b.is_null for b in w64[:-4])
    mgr.free(req)


def test_unsupported_groups_and_settings_are_refused():
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    kw = dict(block_size=PAGE, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(**kw)),
              KVCacheGroupSpec(["b"], ChunkedLocalAttentionSpec(**kw, attention_chunk_size=64))]
    with pytest.raises(ValueError, match=r"kv_cache_groups\[1\] is ChunkedLocalAttentionSpec"):
        classify_groups(KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups))
    groups = [KVCacheGroupSpec(["a"], FullAttentionSpec(**kw)),
              KVCacheGroupSpec(["b"], SlidingWindowSpec(**{**kw, "block_size": 24}, sliding_window=64))]
    with pytest.raises(ValueError, match=r"block sizes \[16, 24\] do not divide the largest"):
        classify_groups(KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups))
    with pytest.raises(ValueError, match="no sliding-window group"):
        classify_groups(KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups[:1]))
    with pytest.raises(ValueError, match="^retention must be one of"):
        PrefixOptions(retention="dense")
    with pytest.raises(ValueError, match="^swa_release must be one of"):
        PrefixOptions(swa_release="dense")
    # the old name of swa_release, as a keyword, an extra key and an --additional-config key
    assert PrefixOptions(retention="sparse").swa_release == "sparse" == PrefixOptions(retention="sparse").retention
    assert PrefixOptions.from_extra({"hybridkv_retention": "sparse"}).swa_release == "sparse"
    assert PrefixOptions.from_extra({"hybridkv_retention": "sparse"}, {"swa_release": "adaptive"}).swa_release \
        == "adaptive"
    with pytest.raises(ValueError, match="swa_checkpoint"):
        PrefixOptions(swa_checkpoint=True)
    with pytest.raises(TypeError, match="manager"):
        HybridKVCacheManager.adopt(object())


def test_hybridkv_holds_shared_prefixes_under_pressure():
    """At a tight size, sessions that return after one-off traffic still hit in
    hybridkv's tree (SWA kept where hits end); printed against vLLM's manager."""
    windows = (None, 32, 32)
    rows = {}
    for name, kw in (("hybridkv", {"hybridkv": True}), ("vllm_default", {"retention": 0}),
                     ("vllm_dense", {"retention": None})):
        rng = np.random.default_rng(11)
        out = replay(build_manager(150, PAGE, windows, **kw), shared_prefix_prompts(rng, 300, page=PAGE),
                     page=PAGE, windows=windows, concurrent=2)
        assert out["mismatches"] == 0
        rows[name] = out["hit_tokens"] / out["input_tokens"]
    print("hit rates at 150 blocks:", {k: round(v, 4) for k, v in rows.items()})
    assert rows["hybridkv"] > 0


def test_a_waiting_request_looked_up_again_is_one_use():
    """vLLM retries a waiting request's lookup each step it cannot admit it: the
    ranking learns one use (one return), not one per retry."""
    windows = (None, 32)
    mgr = build_manager(300, PAGE, windows, hybridkv=True, options=PrefixOptions(ranking="value"))
    toks = list(range(100, 100 + 5 * PAGE + 3))
    replay(mgr, [np.array(toks)], page=PAGE, windows=windows)
    req = _request("again", toks + [7])
    hits = []
    for _ in range(3):  # not admitted twice, then admitted
        blocks, hit, _ = mgr.get_computed_blocks(req)
        hits.append(hit)
    leaf = next(n for n in mgr.tree.iter_nodes() if n.start == 0)
    assert hits == [5 * PAGE] * 3 and leaf.returns == 1
    assert mgr.allocate_slots(req, len(toks) + 1 - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    mgr.free(req)
    mgr.check_invariants()


def test_a_request_aborted_while_its_load_is_in_flight_caches_nothing_past_its_hit():
    """vLLM counts a connector's asynchronous load as computed while the request
    waits for it (WAITING_FOR_REMOTE_KVS); freed then (an abort), those blocks
    hold no KV and must not become hits."""
    from vllm.v1.request import RequestStatus

    windows = (None, 32)
    mgr = build_manager(300, PAGE, windows, hybridkv=True)
    toks = list(range(100, 100 + 3 * PAGE))
    replay(mgr, [np.array(toks)], page=PAGE, windows=windows)  # 3 pages cached
    longer = toks + list(range(900, 900 + 5 * PAGE + 1))
    req = _request("loading", longer)
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert hit == 3 * PAGE
    external = 4 * PAGE  # the connector's hit past the local one, loaded asynchronously
    assert mgr.allocate_slots(req, len(longer) - hit - external, num_new_computed_tokens=hit,
                              new_computed_blocks=blocks, num_external_computed_tokens=external,
                              delay_cache_blocks=True) is not None
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    req.num_computed_tokens = hit + external  # what vLLM's scheduler sets
    before = mgr.tree.full_pages_cached
    mgr.free(req)  # aborted before the load finished
    assert mgr.tree.full_pages_cached == before == 3
    probe = _request("probe", longer)
    assert mgr.get_computed_blocks(probe)[1] == 3 * PAGE
    mgr.free(probe)
    mgr.check_invariants()
