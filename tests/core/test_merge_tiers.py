"""benchmarks/peers/merge_tiers.py: the parts of an SGLang tier comparison put
together as one run would have given them (no SGLang needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import merge_tiers  # noqa: E402


def _run(size: str, system: str, ratio: float, hits: int, rejected: int = 0, policy: str | None = None) -> dict:
    setting = {"swa_full_tokens_ratio": ratio}
    if policy is not None:
        setting["write_policy"] = policy
    return {"size": size, "system": system, "setting": setting, "hit_tokens": hits, "rejected": rejected,
            "kv_bytes": 1, "host_bytes": 2, "l1_hit_tokens": hits, "l2_hit_tokens": 0, "hits_verified": 1}


def _details(runs: list[dict], failed: list[dict] | None = None) -> dict:
    return {"trace": "/x/traces/conv.jsonl", "limit": 10, "page_size": 64, "host_factor": 2.0,
            "sizes": {"tight": {"kv_bytes": 1}}, "runs": runs, "failed": failed or []}


def test_default_and_best_are_recomputed_over_the_merged_sweep():
    old = _details([_run("tight", "hybridkv", 0.02, 50), _run("tight", "hicache@0.1", 0.1, 40),
                    _run("tight", "hicache@0.8", 0.8, 20), _run("tight", "hicache_best", 0.1, 40)])
    new = _details([_run("tight", "hybridkv", 0.02, 70, policy="write_back"),
                    _run("tight", "hicache@0.1+write_back", 0.1, 60, policy="write_back"),
                    _run("tight", "hicache@0.2+write_back", 0.2, 90, rejected=3, policy="write_back")])
    runs = {r["system"]: r for r in merge_tiers.merge([old, new])["conv.jsonl"]["runs"]}
    assert runs["hybridkv"]["hit_tokens"] == 70  # a later input replaces an earlier run
    assert runs["hicache@0.1"]["setting"]["write_policy"] == "write_through"  # pre-sweep runs
    assert runs["hicache_default"]["hit_tokens"] == 20  # 0.8, write-through
    # the best among the runs that rejected nothing (the 90 one rejected requests)
    assert runs["hicache_best"]["hit_tokens"] == 60
    assert runs["hicache_best"]["setting"]["write_policy"] == "write_back"
    assert sum(r["system"] == "hicache_best" for r in runs.values()) == 1


def test_when_every_run_rejects_the_best_is_taken_over_all():
    doc = _details([_run("tight", "hicache@0.1", 0.1, 10, rejected=2), _run("tight", "hicache@0.2", 0.2, 30, 5)])
    runs = {r["system"]: r for r in merge_tiers.merge([doc])["conv.jsonl"]["runs"]}
    assert runs["hicache_best"]["hit_tokens"] == 30 and "hicache_default" not in runs


def test_failed_runs_are_said_unless_a_later_input_ran_them(tmp_path):
    failed = [{"size": "tight", "system": "hicache@0.8", "error": "AssertionError: swa pool"}]
    doc = _details([_run("tight", "hicache@0.1", 0.1, 10)], failed)
    why = merge_tiers.failures([doc])
    assert list(why) == ["conv.jsonl tight hicache@0.8"]
    assert "AssertionError: swa pool" in why["conv.jsonl tight hicache@0.8"]
    assert merge_tiers.failures([doc, _details([_run("tight", "hicache@0.8", 0.8, 5)])]) == {}
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    prov = tmp_path / "prov.json"
    prov.write_text(json.dumps({"command": "c", "commit": "x", "date": "d", "depends": ["hybridkv"]}))
    out = tmp_path / "out.json"
    assert merge_tiers.main([str(out), str(src), "--provenance", str(prov)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"traces", "not_run", "provenance"} and "conv.jsonl tight hicache@0.8" in result["not_run"]


def test_inputs_that_disagree_on_the_setup_are_refused():
    a, b = _details([]), _details([])
    b["page_size"] = 1
    with pytest.raises(ValueError, match="page_size"):
        merge_tiers.merge([a, b])
