"""A conversation pushed out of vLLM's device cache, then its next turn, in a real engine.

vLLM 0.32 (CPU build), tiny MiMo-V2 (full attention plus two sliding-window
groups, window 64), 48 device blocks: the first turn (300 tokens) is pushed out
of the device cache by four unrelated 300-token prompts, then the conversation's
next turn comes.  The connector's L2 (about 12 pages) evicts its copies of pages
the device holds first, so when the device gives the first turn's full pages up,
L2 lacks them and copies them down from their blocks before the blocks are
reused (``l2_rescued_pages``); the next turn loads its hit from L2 and L3.

The check is on outputs: the turn must decode exactly as without the connector.
A copy-down that reads a block after vLLM zeroed it for its new owner (vLLM
zeroes a step's new full-attention blocks before the forward pass) serves zeros
in some layers and changes the output; one that came too late for a block shows
here, not in a replay (no KV bytes there).  Runs under vLLM's own prefix cache
(asynchronous scheduling on) and under hybridkv's tree (``--scheduler-cls``,
which vLLM schedules synchronously).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import build
from vllm_helpers import read_stats, run_llm

RUNS = ("hkv", "hkv_tree")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("pushed-out")
    model = build("mimo_v2", work / "mimo_v2", window=64)

    def hkv(name: str) -> dict[str, Any]:
        return {"checkpoint_interval": 64, "l3_url": f"file:{work / ('l3-' + name)}",
                "l2_gb": 0.0015, "stats_file": str(work / f"{name}.jsonl")}

    job = {"model": str(model), "block_size": 32, "max_tokens": 8, "trust_remote_code": True,
           "num_gpu_blocks": 48, "sets": ["pushed_out"],
           "runs": [{"name": "none", "connector": "none"},
                    # vLLM schedules the next step while the worker runs this one
                    {"name": "hkv", "connector": "hybridkv", "extra": hkv("hkv"), "async_scheduling": True},
                    {"name": "hkv_tree", "connector": "hybridkv", "extra": hkv("hkv_tree"),
                     "scheduler_cls": "hybridkv_vllm.scheduler.HybridKVScheduler"}]}
    out = run_llm(job, work, "pushed_out")
    for name in RUNS:
        assert "sets" in out[name], out[name]
        out[name]["stats"] = read_stats(work / f"{name}.jsonl")
    return out


def _worker_totals(stats: list[dict[str, Any]]) -> dict[str, int]:
    return [e for e in stats if e["event"] == "shutdown" and e["role"] == "worker"][-1]["totals"]


def test_the_device_cache_lost_the_first_turn(runs: dict[str, Any]) -> None:
    base = runs["none"]["sets"]["pushed_out"]
    assert base["cached_tokens"][-1] == 0  # the premise: vLLM alone recomputes the turn
    assert len(set(base["outputs"][-1])) > 2  # greedy outputs vary: equality means something


@pytest.mark.parametrize("name", RUNS)
def test_the_next_turn_decodes_as_without_the_connector(runs: dict[str, Any], name: str) -> None:
    got, base = runs[name]["sets"]["pushed_out"], runs["none"]["sets"]["pushed_out"]
    assert got["outputs"] == base["outputs"]
    assert got["cached_tokens"][-1] >= 256  # the first turn's four full pages came back


@pytest.mark.parametrize("name", RUNS)
def test_the_turn_read_pages_l2_rescued(runs: dict[str, Any], name: str) -> None:
    """The hit read L2 rows, and L2 held them only because they were copied down from
    blocks the device gave up (its copies of device pages go first)."""
    totals = _worker_totals(runs[name]["stats"])
    loads = [e for e in runs[name]["stats"] if e["event"] == "load"]
    assert totals["l2_rescued_pages"] > 0
    assert loads and all(e["ok"] for e in loads)
    assert sum(e["l2_pages"] for e in loads) > 0 and totals["load_failures"] == 0
