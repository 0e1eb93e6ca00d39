"""Same scheduler flows, same pool sizes: SGLang 0.5.23's UnifiedRadixCache
(FULL + SWA components) against hybridkv's tree.  Both are checked by the same
content oracle (no pseudo-hit) and SGLang's pool accounting after every step;
hit totals are printed for the report.  Each comparison runs at page size 1
and 64 (at 64 through SGLang's paged ``alloc_extend`` / ``alloc_decode``)."""

from __future__ import annotations

import numpy as np
import pytest

import conftest
from sglang_flow import Driver, Pools

conftest.publish_test_server_args()

from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from hybridkv_sglang.radix_cache import HybridKVRadixCache  # noqa: E402

W = 128
PAGE_SIZES = (1, 64)


def _mooncake(n: int, max_len: int) -> list[np.ndarray]:
    traces = conftest.shared_traces()
    if traces is None:
        pytest.skip("../shared/traces (relative to the repository root) is absent")
    from hybridkv.eval.traces import TokenMaterializer, load_trace

    reqs = [r for r in load_trace(traces / "mooncake_conversation_trace.jsonl", limit=4 * n + 400)
            if r.input_length <= max_len][:n]
    mat = TokenMaterializer()  # partial-block extension rule on
    return [mat.tokens(r).astype(np.int64) for r in reqs]


def _weka(sessions: int, per_session: int, max_len: int) -> list[tuple[np.ndarray, str]]:
    traces = conftest.shared_traces()
    if traces is None or not (traces / "weka").is_dir():
        pytest.skip("../shared/traces/weka (relative to the repository root) is absent")
    from hybridkv.eval.traces import TokenMaterializer, load_trace

    files = sorted((traces / "weka").glob("trace_*.json.gz"))[:sessions]
    out = []
    for f in files:
        mat = TokenMaterializer()
        for r in load_trace(f, limit=per_session):
            # agentic prompts are ~100K tokens; the head of each keeps the
            # session's prefix structure at a size a CPU test can replay
            out.append((mat.tokens(r)[:max_len].astype(np.int64), r.namespace))
    return out


def _run(kind: str, seqs, full: int, swa: int, n_out: int, page_size: int) -> tuple[int, int]:
    pools = Pools(full_tokens=full, swa_tokens=swa, page_size=page_size)
    params = pools.init_params(W)
    if kind == "sglang":
        params.tree_components = (ComponentType.FULL, ComponentType.SWA)
        cache = UnifiedRadixCache(params)
    else:
        cache = HybridKVRadixCache(params)
    stats = Driver(cache, pools, W, chunk=2048, max_live=3).run(
        [(tokens, n_out, extra) for tokens, extra in seqs])
    assert stats.rejected == 0
    assert all(h % page_size == 0 for h in stats.hits)  # hits end on page boundaries
    return stats.hit_tokens, stats.input_tokens


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name,n,full,swa", [("mooncake-tight", 300, 30000, 12000),
                                             ("mooncake-roomy", 120, 80000, 64000)])
def test_mooncake_hits_vs_sglang_unified_swa(name, n, full, swa, page_size):
    seqs = [(p, None) for p in _mooncake(n, 8192)]
    sg_hit, total = _run("sglang", seqs, full, swa, 16, page_size)
    hk_hit, _ = _run("hybridkv", seqs, full, swa, 16, page_size)
    print(f"\n[differential {name}, page {page_size}] {len(seqs)} requests, {total} input tokens, pools (whole pages) "
          f"full={full} swa={swa}: SGLang UnifiedRadixCache hit {sg_hit} ({sg_hit / total:.2%}), "
          f"hybridkv hit {hk_hit} ({hk_hit / total:.2%})")
    assert hk_hit >= sg_hit


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_agentic_sessions_hits_vs_sglang_unified_swa(page_size):
    seqs = _weka(sessions=3, per_session=12, max_len=6000)
    sg_hit, total = _run("sglang", seqs, 24000, 9000, 8, page_size)
    hk_hit, _ = _run("hybridkv", seqs, 24000, 9000, 8, page_size)
    print(f"\n[differential kv-cache-tester, page {page_size}] {len(seqs)} requests, {total} input tokens: "
          f"SGLang hit {sg_hit} ({sg_hit / total:.2%}), hybridkv hit {hk_hit} ({hk_hit / total:.2%})")
    assert hk_hit >= sg_hit
