"""The window repair (repair case 2) in a real engine: outputs as without any cache.

vLLM 0.32 (CPU build), tiny MiMo-V2 (full attention plus two sliding-window
groups, window 128 as MiMo's: wider than the 64-token hit unit, so part of the
window lies below what the device hands vLLM), hybridkv's tree as the device
prefix cache (``--scheduler-cls``) with the connector's L2 and L3, 72 device
blocks.  A 400-token
prompt is followed by two unrelated ones that take the device's room: the tree
gives up the first prompt's spare windows but keeps its full KV.  Then a prompt
sharing its first 300 tokens comes: its hit (256 tokens) needs the window the
device lost, which L2 holds.  With the repair the device serves its full KV up
to the last page before the hit's end and the connector loads the window into
fresh blocks (``hybridkv_vllm.repair``); without it the connector loads the
whole hit.  The check is on outputs: greedy decoding must match the run with
no cache at all, so a window loaded into the wrong blocks, or a block the load
did not fill, shows here (the replays carry no KV bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import build
from vllm_helpers import read_stats, run_llm

RUNS = ("repair", "no_repair")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("window-repair")
    model = build("mimo_v2", work / "mimo_v2", window=128)

    def hkv(name: str, repair: bool) -> dict[str, Any]:
        return {"checkpoint_interval": 64, "l3_url": f"file:{work / ('l3-' + name)}", "l2_gb": 0.01,
                "repair_windows": repair, "stats_file": str(work / f"{name}.jsonl")}

    tree = "hybridkv_vllm.scheduler.HybridKVScheduler"
    job = {"model": str(model), "block_size": 32, "max_tokens": 8, "trust_remote_code": True,
           "num_gpu_blocks": 72, "sets": ["window_lost"],
           "runs": [{"name": "none", "connector": "none"},
                    {"name": "repair", "connector": "hybridkv", "extra": hkv("repair", True), "scheduler_cls": tree},
                    {"name": "no_repair", "connector": "hybridkv", "extra": hkv("no_repair", False),
                     "scheduler_cls": tree}]}
    out = run_llm(job, work, "window_repair")
    for name in RUNS:
        assert "sets" in out[name], out[name]
        out[name]["stats"] = read_stats(work / f"{name}.jsonl")
    return out


def _totals(stats: list[dict[str, Any]], role: str) -> dict[str, int]:
    return [e for e in stats if e["event"] == "shutdown" and e["role"] == role][-1]["totals"]


def test_the_device_cache_alone_lost_the_window(runs: dict[str, Any]) -> None:
    base = runs["none"]["sets"]["window_lost"]
    assert base["cached_tokens"][-1] == 0  # the premise: vLLM's own cache has no window-safe hit
    assert len(set(base["outputs"][-1])) > 2  # greedy outputs vary: equality means something


@pytest.mark.parametrize("name", RUNS)
def test_the_prompt_decodes_as_without_a_cache(runs: dict[str, Any], name: str) -> None:
    got, base = runs[name]["sets"]["window_lost"], runs["none"]["sets"]["window_lost"]
    assert got["outputs"] == base["outputs"]
    assert got["cached_tokens"][-1] == 256  # the whole hit, device and connector together


def test_the_repair_serves_the_devices_full_kv_and_loads_the_window(runs: dict[str, Any]) -> None:
    on, off = _totals(runs["repair"]["stats"], "scheduler"), _totals(runs["no_repair"]["stats"], "scheduler")
    assert on["repaired_tokens"] > 0 and off.get("repaired_tokens", 0) == 0
    assert on["reloaded_held_tokens"] < off["reloaded_held_tokens"]
    assert on["hit_tokens"] < off["hit_tokens"]  # the connector's part: the device served the rest
    w_on, w_off = _totals(runs["repair"]["stats"], "worker"), _totals(runs["no_repair"]["stats"], "worker")
    assert 0 < w_on["load_pages"] < w_off["load_pages"] and w_on["load_failures"] == 0
