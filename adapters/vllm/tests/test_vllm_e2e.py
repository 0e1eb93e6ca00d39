"""Real vLLM 0.32 (CPU) with HybridKVConnector on tiny random-weight models.

Two driver processes (``scripts/run_llm.py``), one per model, run in parallel;
each runs its configurations one after another, and vLLM starts a fresh
engine-core and worker process for every ``LLM``:

* Gemma-2 (interleaved SWA, W=64, both groups block 32): no connector;
  hybridkv (fills L2 and L3); hybridkv again with ``l2_gb: 0`` (a fresh worker
  and no L2: every hit comes through L3); vLLM's OffloadingConnector.
* MiMo-V2 (full at layers 0 and 5, SWA between, SWA 2 KV heads vs full 1:
  vLLM gives the full group block 64 and the SWA groups block 32): no
  connector; hybridkv; hybridkv again in a fresh worker (L3 first, then L2).

``reset_between`` drops vLLM's own prefix cache before every request so every
hit is a connector hit.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiny_models import build
from vllm_helpers import read_stats, run_llm

PAGE = 32
EXTRA = {"checkpoint_interval": 64}
SETS = ("repeat", "shared_prefix", "multi_turn")
# vLLM 0.32 CPU on the real MiMo head dims (K 192 != V 128): it picks its DiffKV
# Triton backend, whose KV-cache write fails at the first forward (the CPU build
# ships a triton placeholder).  Seen in this environment; re-checked by
# test_tiny_mimo_v2_real_head_dims when HYBRIDKV_VLLM_DIFFKV=1.
DIFFKV_ERROR = "AttributeError: module 'triton' has no attribute 'next_power_of_2'"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


def _gemma_job(work: Path) -> dict[str, Any]:
    model = build("gemma2", work / "gemma2", window=64)
    l3 = f"file:{work / 'l3-gemma'}"
    hkv = {**EXTRA, "l3_url": l3}
    return {"model": str(model), "block_size": PAGE, "max_tokens": 12, "reset_between": True,
            "runs": [{"name": "none", "connector": "none"},
                     {"name": "hkv1", "connector": "hybridkv",
                      "extra": {**hkv, "stats_file": str(work / "gemma-hkv1.jsonl")}},
                     {"name": "hkv2", "connector": "hybridkv",
                      "extra": {**hkv, "l2_gb": 0, "stats_file": str(work / "gemma-hkv2.jsonl")}},
                     # vLLM's own CPU offload, same prompts and byte budget
                     {"name": "offload", "connector": "offloading",
                      "extra": {"cpu_bytes_to_use": 64 << 20}}]}


def _mimo_job(work: Path) -> dict[str, Any]:
    model = build("mimo_v2", work / "mimo_v2", window=64)
    hkv = {**EXTRA, "l3_url": f"file:{work / 'l3-mimo'}"}
    return {"model": str(model), "block_size": PAGE, "max_tokens": 8, "reset_between": True,
            "trust_remote_code": True,
            "runs": [{"name": "none", "connector": "none"},
                     {"name": "hkv1", "connector": "hybridkv",
                      "extra": {**hkv, "stats_file": str(work / "mimo-hkv1.jsonl")}},
                     {"name": "hkv2", "connector": "hybridkv",
                      "extra": {**hkv, "stats_file": str(work / "mimo-hkv2.jsonl")}}]}


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, dict[str, Any]]:
    jobs = {"gemma": _gemma_job(work), "mimo": _mimo_job(work)}
    with ThreadPoolExecutor(2) as pool:
        futs = {k: pool.submit(run_llm, job, work, k) for k, job in jobs.items()}
        out = {k: f.result() for k, f in futs.items()}
    for model in out:
        for name in ("hkv1", "hkv2"):
            out[model][name]["stats"] = read_stats(work / f"{model}-{name}.jsonl")
    return out


def _loads(res: dict[str, Any]) -> tuple[int, int, int]:
    """(L2 pages, L3 pages, failed loads) the worker reported in one run."""
    ev = [e for e in res["stats"] if e["event"] == "load"]
    return (sum(e["l2_pages"] for e in ev), sum(e["l3_pages"] for e in ev),
            sum(not e["ok"] for e in ev))


def _hits(res: dict[str, Any]) -> int:
    return sum(sum(r["cached_tokens"]) for r in res["sets"].values())


@pytest.mark.parametrize("model", ["gemma", "mimo"])
def test_outputs_equal_without_connector(runs: dict[str, Any], model: str) -> None:
    r = runs[model]
    for name in ("hkv1", "hkv2"):
        assert "sets" in r[name], r[name]
        for s in SETS:
            assert r[name]["sets"][s]["outputs"] == r["none"]["sets"][s]["outputs"], (name, s)
    # the model is not degenerate: greedy outputs vary, so equality means something
    assert len(set(r["none"]["sets"]["repeat"]["outputs"][0])) > 2
    assert _hits(r["none"]) == 0  # no connector and no local cache between requests


def test_gemma_hits_in_process_from_l2(runs: dict[str, Any]) -> None:
    sets = runs["gemma"]["hkv1"]["sets"]
    assert sets["repeat"]["cached_tokens"][:2] == [0, 224]   # 230-token prompt, 7 pages
    assert sets["repeat"]["cached_tokens"][2] == 192          # prefix 200 -> checkpoint page 6
    # 170 shared tokens -> 5 full pages; checkpoints every 64 tokens with W=64 keep SWA dense
    assert sets["shared_prefix"]["cached_tokens"][1] == 160
    assert sets["multi_turn"]["cached_tokens"][1] >= 160      # turn 1 prompt + output
    assert sets["multi_turn"]["cached_tokens"][2] >= 192
    for res in sets.values():
        assert all(c % PAGE == 0 for c in res["cached_tokens"])  # page-aligned hits only
    l2, l3, failed = _loads(runs["gemma"]["hkv1"])
    assert l2 > 0 and l3 == 0 and failed == 0  # saved here, so L2 (1 GB) serves every load


def test_gemma_fresh_process_hits_through_l3(runs: dict[str, Any]) -> None:
    r = runs["gemma"]["hkv2"]
    first = [r["sets"][s]["cached_tokens"][0] for s in SETS]
    assert first[0] == 224 and first[1] > 0 and first[2] > 0, first
    l2, l3, failed = _loads(r)
    assert l2 == 0 and l3 > 0 and failed == 0  # l2_gb 0: every page from L3
    pids = {e["pid"] for e in runs["gemma"]["hkv1"]["stats"] + r["stats"]
            if e["event"] == "init" and e["role"] == "worker"}
    assert len(pids) == 2  # two different worker processes


def test_tiny_mimo_v2(runs: dict[str, Any]) -> None:
    """MiMo-V2 layout: full group block 64, SWA groups block 32, hits on the lcm 64."""
    r = runs["mimo"]
    init = next(e for e in r["hkv1"]["stats"] if e["event"] == "init")
    sizes = {(w is None, bs) for _, w, bs in init["groups"]}
    assert sizes == {(True, 64), (False, 32)} and init["unit"] == 64, init
    one, two = r["hkv1"]["sets"], r["hkv2"]["sets"]
    assert one["repeat"]["cached_tokens"] == [0, 192, 192]  # 229 computable -> 3 x 64
    assert one["shared_prefix"]["cached_tokens"][1:] == [128, 128]  # 170 shared -> 2 x 64
    assert one["multi_turn"]["cached_tokens"][1] >= 128
    for res in (*one.values(), *two.values()):
        assert all(c % 64 == 0 for c in res["cached_tokens"])
    # fresh process: the first request of every set can only hit through L3
    # (process 1 stored each set's prompts: 230 -> 192, 230 -> 192, 150 -> 128)
    assert [two[s]["cached_tokens"][0] for s in SETS] == [192, 192, 128]
    assert _hits(r["hkv2"]) > _hits(r["hkv1"])
    l2, l3, failed = _loads(r["hkv1"])
    assert l2 > 0 and l3 == 0 and failed == 0
    l2, l3, failed = _loads(r["hkv2"])
    assert l3 > 0 and l2 > 0 and failed == 0  # L3 reads fill L2, which serves repeats


def test_side_by_side_with_offloading_connector(runs: dict[str, Any]) -> None:
    g = runs["gemma"]
    off = g["offload"]
    if "error" in off:
        # vLLM 0.32's OffloadingConnector refuses to start without CUDA/XPU.
        print(f"\nOffloadingConnector did not run: {off['root_cause']}")
        assert "CPU Offloading is currently only supported on CUDA" in off["root_cause"], off
    print("\nmodel  run      hit_tokens  L2_pages  L3_pages  generate_wall_s  init_s")
    for model, r in runs.items():
        for name in ("none", "hkv1", "hkv2", "offload"):
            if name not in r or "sets" not in r[name]:
                continue
            wall = sum(sum(x["wall_s"]) for x in r[name]["sets"].values())
            l2, l3, _ = _loads(r[name]) if "stats" in r[name] else (0, 0, 0)
            print(f"{model:<6} {name:<8} {_hits(r[name]):>10} {l2:>9} {l3:>9} "
                  f"{wall:>16.2f} {r[name]['init_s']:>7.1f}")
    print("cached tokens per request (prompt lengths in brackets):")
    for model, r in runs.items():
        for name in ("hkv1", "hkv2"):
            for s in SETS:
                x = r[name]["sets"][s]
                print(f"  {model:<6} {name:<5} {s:<14} {x['cached_tokens']} {x['prompt_lens']}")
    if "sets" in off:
        for s in SETS:
            assert off["sets"][s]["outputs"] == g["none"]["sets"][s]["outputs"], ("offload", s)


@pytest.mark.skipif(os.environ.get("HYBRIDKV_VLLM_DIFFKV") != "1",
                    reason="costs one more vLLM process (~60 s); set HYBRIDKV_VLLM_DIFFKV=1 "
                           "to re-check vLLM CPU on MiMo's real K 192 / V 128 head dims")
def test_tiny_mimo_v2_real_head_dims(work: Path) -> None:
    model = build("mimo_v2", work / "mimo_v2_diffkv", window=64, head_dim=192, v_head_dim=128)
    job = {"model": str(model), "block_size": PAGE, "max_tokens": 8, "reset_between": True,
           "trust_remote_code": True, "sets": ["repeat"],
           "runs": [{"name": "hkv", "connector": "hybridkv",
                     "extra": {**EXTRA, "l3_url": f"file:{work / 'l3-diffkv'}"}}]}
    res = run_llm(job, work, "diffkv")["hkv"]
    if "error" in res:  # the engine died in vLLM's attention backend, not in the connector
        print(f"\nvLLM CPU on K 192 / V 128: {res['root_cause']}")
        assert DIFFKV_ERROR in res["root_cause"] or "next_power_of_2" in res["root_cause"], res
        assert "hybridkv" not in res["root_cause"].lower(), res
        return
    assert res["sets"]["repeat"]["cached_tokens"][1] > 0
