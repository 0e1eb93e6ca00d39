"""The in-engine vLLM harness (benchmarks/peers/in_engine_vllm.py), bounded.

60 requests of the bundled Mooncake conversation sample through vLLM 0.32's
real Scheduler: the harness's own invariants (hits from first scheduling agree
with SchedulerStats, the content oracle sees no wrong hit, every request ends,
the best row is marked), that the oracle catches a planted wrong hit, that
preemption is survived and its resumed hits are checked, and that a scheduler
class that does not import only skips its rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import in_engine_vllm as ie  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

N = 60


def _trace() -> str:
    from hybridkv.eval.traces import bundled_sample

    return str(bundled_sample())


def _run(capsys: Any, *extra: str) -> tuple[int, list[dict[str, Any]], str]:
    rc = ie.main(["--json", "--trace", _trace(), "--limit", str(N), *extra])
    cap = capsys.readouterr()
    return rc, json.loads(cap.out)["vllm"], cap.err


def _prompt_tokens() -> int:
    items, _ = ie.load_workload(Path(_trace()), N, 16)
    return int(sum(len(i.tokens) for i in items))


class WrongHitScheduler(Scheduler):
    """vLLM's scheduler with a planted bug: every hit's last two blocks of each
    group are swapped (the oracle must see it)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        mgr = self.kv_cache_manager
        inner = mgr.get_computed_blocks

        def swapped(request: Any) -> Any:
            blocks, hit, junction = inner(request)
            rows = []
            for row in blocks.blocks:
                row = list(row)
                if len(row) >= 2 and not row[-1].is_null and not row[-2].is_null:
                    row[-1], row[-2] = row[-2], row[-1]
                rows.append(row)
            return KVCacheBlocks(tuple(rows)), hit, junction

        mgr.get_computed_blocks = swapped


def test_vllm_rows_hold_the_harness_invariants(capsys: Any) -> None:
    rc, rows, err = _run(capsys, "--budgets", "59", "--systems", "vllm_default,vllm", "--retention", "0,none")
    assert rc == 0, err
    by = {(r["system"], json.dumps(r["setting"])) for r in rows}
    assert {s for s, _ in by} == {"vllm_default", "vllm", "vllm_best"}
    prompts = _prompt_tokens()
    for r in rows:
        assert r["kv_bytes"] == 59 * 10**9 and r["num_blocks"] == 18005 and r["kv_cache_groups"] == 7
        assert r["requests"] == N and r["rejected"] == 0
        assert r["input_tokens"] == prompts
        assert 0 < r["hit_tokens"] < r["input_tokens"]
        assert r["stats_match"] and r["stats_hits"] == r["hit_tokens"] and r["stats_queries"] == prompts
        assert r["oracle_mismatches"] == 0 and r["oracle_checked_blocks"] > 0 and r["oracle_anomalies"] == 0
        assert r["block_copies"] == 0
        assert r["decode_tokens"] >= N  # every request sampled at least once
    swept = [r for r in rows if r["system"] == "vllm"]
    assert sum(r["best"] for r in swept) == 1
    best = next(r for r in rows if r["system"] == "vllm_best")
    assert best["hit_tokens"] == max(r["hit_tokens"] for r in swept)
    default = next(r for r in rows if r["system"] == "vllm_default")
    assert default["setting"] == {"prefix_cache_retention_interval": 0}
    zero = next(r for r in swept if r["setting"]["prefix_cache_retention_interval"] == 0)
    assert zero["hit_tokens"] == default["hit_tokens"]  # one replay feeds both rows


def test_oracle_catches_a_planted_wrong_hit(capsys: Any) -> None:
    rc, rows, _ = _run(capsys, "--budgets", "59", "--systems", "hybridkv",
                       "--hybridkv-scheduler-cls", f"{__name__}.WrongHitScheduler")
    assert rc == 1
    (row,) = rows
    assert row["system"] == "hybridkv" and row["hit_tokens"] > 0
    assert row["oracle_mismatches"] > 0 and row["oracle_examples"]


def test_preemption_is_replayed_and_resumed_hits_checked(capsys: Any) -> None:
    # 6 GB = 1,830 blocks with long decodes: running requests outgrow the pool.
    rc, rows, err = _run(capsys, "--budgets", "6", "--systems", "vllm_default", "--max-decode", "1024")
    assert rc == 0, err
    (row,) = rows
    assert row["preemptions"] > 0
    assert row["requests"] + row["rejected"] == N
    assert row["stats_match"] and row["oracle_mismatches"] == 0
    assert row["oracle_hits_checked"] > 0


def test_a_scheduler_class_that_does_not_import_is_skipped(capsys: Any) -> None:
    rc, rows, err = _run(capsys, "--limit", "8", "--budgets", "59", "--systems", "vllm_default,hybridkv",
                         "--hybridkv-scheduler-cls", "no_such_module.Sched")
    assert rc == 0
    assert [r["system"] for r in rows] == ["vllm_default"]
    assert "skipping hybridkv" in err


def test_arrivals_serialise_a_session_and_keep_trace_order() -> None:
    tok = np.zeros(1, np.int32)
    items = [ie.Item(i, s, s or "default", tok, 1) for i, s in enumerate(["a", "a", None, "b", "a"])]
    arr = ie.Arrivals(items)
    got = [arr.next().idx for _ in range(3)]
    assert got == [0, 2, 3] and arr.next() is None  # session a waits for its turn 0
    arr.done(items[0])
    assert arr.next().idx == 1 and arr.next() is None
    arr.done(items[1])
    assert arr.next().idx == 4 and arr.pending == 0


def test_best_is_the_most_hits_ties_to_the_default() -> None:
    rows = [{"kv_bytes": 1, "system": "vllm", "hit_tokens": h, "default": d, "best": False}
            for h, d in ((5, False), (5, True), (3, False))]
    (best,) = ie.mark_best(rows)
    assert best["system"] == "vllm_best" and best["default"] and [r["best"] for r in rows] == [False, True, False]


@pytest.mark.skipif(not ie.importable(ie.DEFAULT_HYBRIDKV_CLS), reason="hybridkv scheduler does not import")
def test_hybridkv_scheduler_rows_hold_the_invariants(capsys: Any) -> None:
    rc, rows, err = _run(capsys, "--budgets", "59", "--systems", "hybridkv")
    assert rc == 0, err
    (row,) = rows
    assert row["requests"] == N and row["stats_match"] and row["oracle_mismatches"] == 0
    assert row["hit_tokens"] > 0


def _item(idx: int, toks: list[int], ns: str = "default") -> Any:
    return ie.Item(idx, None, ns, np.asarray(toks, dtype=np.int32), 1)


def test_prefix_bound_counts_page_aligned_prefixes_seen_before() -> None:
    P = 4
    a = list(range(100, 113))                  # 3 whole pages + 1 token
    items = [_item(0, a),
             _item(1, a[:8] + [7] * 5),        # shares 2 pages with a
             _item(2, a + [1, 2, 3]),          # a's 3 pages; len 16 -> at most (16 - 1) // 4 = 3 pages
             _item(3, a[:12]),                 # a's 3 pages, but one token is left to compute: 2 pages
             _item(4, a, ns="other"),          # another namespace shares nothing
             _item(5, [5] * 4 + a[4:])]        # first page differs: nothing, even where later pages agree
    b = ie.prefix_bound(items, P)
    assert b["hit_tokens"] == (2 + 3 + 2) * P
    assert b["input_tokens"] == sum(len(i.tokens) for i in items)


def test_every_row_is_under_the_prefix_bound(capsys: Any) -> None:
    rc = ie.main(["--json", "--trace", _trace(), "--limit", str(N), "--budgets", "594",
                  "--systems", "vllm_default,hybridkv"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    bound = out["bound"]
    assert bound["input_tokens"] == _prompt_tokens()
    assert {r["system"] for r in out["vllm"]} == {"vllm_default", "hybridkv"}
    for r in out["vllm"]:
        assert 0 < r["hit_tokens"] <= bound["hit_tokens"], (r["system"], r["hit_tokens"], bound)
