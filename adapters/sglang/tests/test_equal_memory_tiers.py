"""The tier comparison of the in-engine harness (``in_engine.sh --tiers``) on a tiny
workload: a prompt comes back after fillers have pushed it out of the device
pools; both stacks serve it from their host tier, at equal device and host
bytes, every hit content-checked.  The full-size run is the benchmark's."""

from __future__ import annotations

import numpy as np
import pytest

import conftest

conftest.publish_test_server_args()

import equal_memory as em  # noqa: E402
import equal_memory_tiers as et  # noqa: E402


FILLERS = 8
# the SWA that running requests need (3 x a 2,048-token chunk and windows: ~2.2 GB of the
# model's bytes) plus room for a few prompts: the fillers (12,000 tokens) push the first out
KV = 2_700_000_000


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    a = rng.integers(10, 30000, 1500).astype(np.int64)
    fillers = [rng.integers(10, 30000, 1500).astype(np.int64) for _ in range(FILLERS)]
    return [a, *fillers, a.copy()]


def test_both_stacks_serve_the_evicted_prompt_from_host_at_equal_bytes():
    prompts = _prompts()
    kv = KV
    rows = et.tiers_rows(prompts, {"tight": {"kv_bytes": kv}}, ratios=(0.8,), page_size=64)
    by = {r.system: r for r in rows}
    assert set(by) == {"hybridkv", "hicache_default", "hicache_best", "hicache@0.8", "hicache@0.8+write_back"}
    assert by["hybridkv"].setting["write_policy"] == "write_back"
    assert by["hicache_default"].setting["write_policy"] == "write_through"
    want = (1500 - 1) // 64 * 64
    for name in ("hybridkv", "hicache_default", "hicache@0.8+write_back"):
        r = by[name]
        assert r.hit_tokens == r.l1_hit_tokens + r.l2_hit_tokens
        assert r.l2_hit_tokens == want, (name, r)  # the return, from host, content-checked
        assert r.rejected == 0 and r.hits_verified >= 1
        assert r.input_tokens == (FILLERS + 2) * 1500
    assert by["hybridkv"].host_bytes == 2 * kv
    assert abs(by["hicache_default"].host_bytes - 2 * kv) <= 0.01 * kv  # SGLang pads each host pool a page
    assert set(by["hybridkv"].public()) == {"kv_bytes", "host_bytes", "system", "setting", "hit_tokens",
                                            "l1_hit_tokens", "l2_hit_tokens", "input_tokens"}


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="host_factor"):
        et.tiers_rows(_prompts(), {"tight": {"kv_bytes": 10**9}}, host_factor=0)
    with pytest.raises(ValueError, match="host_bytes"):
        et.run_hybridkv_tiers(_prompts(), 4000, 2000, 0)
