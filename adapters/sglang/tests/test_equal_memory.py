"""Equal KV memory inside SGLang 0.5.23, reduced sweep: hybridkv's backend at the
split it chooses vs ``UnifiedRadixCache`` at its default and best swept
``--swa-full-tokens-ratio``.  Every run checks SGLang's pool accounting after
each step, the content tags behind every hit (read back from SGLang's K/V
buffers) and the caches' sanity checks every 5,000 steps (a check of the roomy
tree, 4.9M pages, takes seconds) and at the end.

The requests are the benchmark's (the first 1,000 Mooncake conversation
requests, 13.7M tokens, three running at once); the sweep is reduced to 0.1
and the default 0.8 (the full run's best ratio is 0.1 at the roomy size, and
0.025-0.2 tie at the tight one).  Fewer requests do not
see what the learned pre-tail window does to a SWA pool sized for tails: the
divergence model first keeps a window after ~450 requests, and a backend whose
learned windows displace other sequences' tails still beats the sweep at 800
requests (roomy 1,268,174 vs 1,010,726 hit tokens) while falling below it at
1,000 (1,546,880 vs 1,944,956).  About 2-3 minutes on 2
CPU cores.  The full-size run is ``benchmarks/peers/in_engine.sh``."""

from __future__ import annotations

import numpy as np
import pytest

import conftest

conftest.publish_test_server_args()

import equal_memory as em  # noqa: E402
from hybridkv_sglang.split import live_swa_tokens, plan_swa_split, pools_at_ratio  # noqa: E402

LIMIT, MAX_LEN, MAX_LIVE = 1000, None, em.MAX_LIVE
RATIOS = (0.1,)


def test_split_plan_fits_the_bytes_and_holds_running_requests():
    fb, sb = em.FULL_BYTES_PER_TOKEN, em.SWA_BYTES_PER_TOKEN
    live = live_swa_tokens(window=128, chunked_prefill_size=8192, max_running_requests=64)
    assert live == 64 * 131 + 2 * 8192 + 1
    for kv in (2 * 10**10, 59 * 10**9, 594 * 10**9):
        s = plan_swa_split(kv, fb, sb, window=128, chunked_prefill_size=8192, max_running_requests=64,
                           page_size=64, tokens_per_window=8192)
        assert s.kv_bytes(fb, sb) <= kv
        assert s.full_tokens % 64 == 0 and s.swa_tokens % 64 == 0
        assert s.swa_tokens >= live and 0 < s.swa_full_tokens_ratio <= 1
        # SGLang's own sizing at that ratio gives (about) the same pools back
        full, swa = pools_at_ratio(kv, fb, sb, s.swa_full_tokens_ratio, page_size=64)
        assert 0 <= full - s.full_tokens <= 8 * 64 and abs(swa - s.swa_tokens) <= 64
    with pytest.raises(ValueError, match="running requests"):
        plan_swa_split(10**9, fb, sb, window=128, chunked_prefill_size=8192, max_running_requests=64)
    with pytest.raises(ValueError, match="ratio"):
        pools_at_ratio(10**9, fb, sb, 1.5)


def test_conversation_outputs_are_the_next_turns_continuation():
    rng = np.random.default_rng(0)
    a = rng.integers(10, 30000, 300)
    b = np.concatenate([a, rng.integers(10, 30000, 100)])
    c = rng.integers(10, 30000, 200)
    out = em.conversation_outputs([a, c, b], n_out=8)
    assert np.array_equal(out[0], b[300:308])  # b extends a: a's answer is what b quotes
    assert len(out[1]) == len(out[2]) == 8 and not np.array_equal(out[1], b[200:208])


def test_equal_memory_hybridkv_at_least_unified_best_at_both_sizes():
    traces = conftest.shared_traces()
    if traces is None:
        pytest.skip("../shared/traces (relative to the repository root) is absent")
    prompts = em.mooncake_prompts(traces / "mooncake_conversation_trace.jsonl", LIMIT, MAX_LEN)
    sizes = em.pick_sizes(prompts)
    assert sizes["tight"]["kv_bytes"] * 10 <= sizes["roomy"]["kv_bytes"] + 10 * em.FULL_BYTES_PER_TOKEN
    assert sizes["roomy"]["full_kv_lru_hits"] >= em.ROOMY_BOUND_SHARE * sizes["roomy"]["prefix_bound"]
    lines = []
    rows = em.equal_memory(prompts, sizes, ratios=RATIOS, sanity_every=5000, max_live=MAX_LIVE,
                           progress=lines.append)
    print(f"\n[equal memory, {len(prompts)} Mooncake requests]\n  " + "\n  ".join(lines))
    by = {(r.size, r.system): r for r in rows}
    for size in ("roomy", "tight"):
        hk, best, default = by[size, "hybridkv"], by[size, "unified_best"], by[size, "unified_default"]
        for r in (hk, best, default):
            assert r.kv_bytes == sizes[size]["kv_bytes"]
            assert r.full_tokens * em.FULL_BYTES_PER_TOKEN + r.swa_tokens * em.SWA_BYTES_PER_TOKEN <= r.kv_bytes
            assert r.requests == len(prompts) and r.accounting_checks > len(prompts)
        assert hk.rejected == 0 and best.rejected == 0
        assert hk.swa_ratio < 0.2, "hybridkv's split keeps the SWA pool small"
        assert hk.hit_tokens >= best.hit_tokens > 0 and default.hit_tokens > 0, \
            (size, hk.hit_tokens, best.swa_ratio, best.hit_tokens)
        assert hk.hit_tokens <= sizes[size]["prefix_bound"] + len(prompts) * em.LRU_BLOCK
