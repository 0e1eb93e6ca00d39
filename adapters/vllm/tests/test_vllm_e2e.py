"""Real vLLM 0.32 (CPU) with HybridKVConnector on tiny random-weight models.

One LLM process per configuration (init ~30-60 s each on 2 shared cores):
baseline without connector, hybridkv (process 1, fills L3), hybridkv again in
a fresh process (can only hit through L3), vLLM's OffloadingConnector on the
same prompts, and the tiny MiMo-V2 model.  ``reset_between`` drops vLLM's own
prefix cache before every request so every hit is a connector hit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiny_models import build
from vllm_helpers import read_stats, run_llm

PAGE = 32
EXTRA = {"checkpoint_interval": 64}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def gemma2(work: Path) -> Path:
    return build("gemma2", work / "gemma2", window=64)


@pytest.fixture(scope="module")
def runs(work: Path, gemma2: Path) -> dict[str, Any]:
    base = {"model": str(gemma2), "block_size": PAGE, "max_tokens": 12, "reset_between": True}
    l3 = f"file:{work / 'l3'}"
    out: dict[str, Any] = {"stats_file": work / "stats.jsonl"}
    out["none"] = run_llm({**base, "connector": "none"}, work, "none")
    hkv = {**EXTRA, "l3_url": l3, "stats_file": str(out["stats_file"])}
    out["hkv1"] = run_llm({**base, "connector": "hybridkv", "extra": hkv}, work, "hkv1")
    out["hkv2"] = run_llm({**base, "connector": "hybridkv", "extra": hkv}, work, "hkv2")
    # vLLM's own CPU offload, same prompts and byte budget.  In vLLM 0.32 it
    # refuses to start without a CUDA/XPU device: record the exact error then.
    try:
        out["offload"] = run_llm({**base, "connector": "offloading",
                                  "extra": {"cpu_bytes_to_use": 64 << 20}}, work, "offload")
    except RuntimeError as exc:
        out["offload"] = {"error": str(exc)}
    return out


def test_outputs_equal_without_connector(runs: dict[str, Any]) -> None:
    for name in ("hkv1", "hkv2"):
        for s, res in runs["none"]["sets"].items():
            assert runs[name]["sets"][s]["outputs"] == res["outputs"], (name, s)
    # the model is not degenerate: greedy outputs vary, so equality means something
    outs = runs["none"]["sets"]["repeat"]["outputs"][0]
    assert len(set(outs)) > 3


def test_connector_hits_in_process_1(runs: dict[str, Any]) -> None:
    sets = runs["hkv1"]["sets"]
    assert sets["repeat"]["cached_tokens"][:2] == [0, 224]   # 230-token prompt, 7 pages
    assert sets["repeat"]["cached_tokens"][2] == 192          # prefix 200 -> checkpoint page 6
    # 170 shared tokens -> 5 full pages; checkpoints every 64 tokens with W=64 keep SWA dense
    assert sets["shared_prefix"]["cached_tokens"][1] == 160
    assert sets["multi_turn"]["cached_tokens"][1] >= 160      # turn 1 prompt + output
    assert sets["multi_turn"]["cached_tokens"][2] >= 192
    for res in sets.values():
        assert all(c % PAGE == 0 for c in res["cached_tokens"])  # page-aligned hits only


def test_fresh_process_hits_through_l3(runs: dict[str, Any]) -> None:
    sets = runs["hkv2"]["sets"]
    first = [sets[s]["cached_tokens"][0] for s in ("repeat", "shared_prefix", "multi_turn")]
    assert first[0] == 224 and first[1] > 0 and first[2] > 0, first
    stats = read_stats(runs["stats_file"])
    hkv2_pid = {e["pid"] for e in stats if e["role"] == "scheduler"}
    assert len(hkv2_pid) == 2  # two schedulers (two processes) wrote hit events
    loads = [e for e in stats if e["event"] == "load"]
    assert loads and all(e["ok"] for e in loads)


def test_side_by_side_with_offloading_connector(runs: dict[str, Any]) -> None:
    rows = []
    ran = [n for n in ("none", "hkv1", "hkv2", "offload") if "sets" in runs[n]]
    if "error" in runs["offload"]:
        print(f"\nOffloadingConnector did not run: {runs['offload']['error']}")
        assert "CUDA" in runs["offload"]["error"] or "cuda" in runs["offload"]["error"]
    for name in ran:
        sets = runs[name]["sets"]
        hits = sum(sum(r["cached_tokens"]) for r in sets.values())
        wall = sum(sum(r["wall_s"]) for r in sets.values())
        rows.append((name, hits, wall, runs[name]["init_s"]))
    print("\nconnector   hit_tokens  generate_wall_s  init_s")
    for name, hits, wall, init in rows:
        print(f"{name:<10} {hits:>11} {wall:>16.2f} {init:>7.1f}")
    if "sets" in runs["offload"]:
        for s, res in runs["none"]["sets"].items():
            assert runs["offload"]["sets"][s]["outputs"] == res["outputs"], ("offload", s)
    assert rows[0][1] == 0  # no connector and no local cache between requests: no hits
    assert rows[1][1] > 0


def test_tiny_mimo_v2(work: Path) -> None:
    """MiMo-V2 shape (hybrid pattern, SWA sinks, K 192 / V 128) through the connector.

    vLLM routes K != V head dims to its DiffKV attention backends (Triton or
    FlashAttention); when the CPU build cannot run them the exact engine error
    is reported as the xfail reason (the connector is not involved).
    """
    model = build("mimo_v2", work / "mimo_v2", window=64)
    extra = {**EXTRA, "l3_url": f"file:{work / 'l3-mimo'}"}
    job = {"model": str(model), "block_size": PAGE, "max_tokens": 8, "reset_between": True,
           "connector": "hybridkv", "extra": extra, "sets": ["repeat"],
           "trust_remote_code": True}
    try:
        res = run_llm(job, work, "mimo")
    except RuntimeError as exc:
        msg = str(exc)
        if "mixed block sizes are not supported" in msg:
            # vLLM gives MiMo's full and SWA groups different block sizes (equal page
            # bytes); the connector keys one page size for all groups so far.
            pytest.xfail(f"known connector gap: {msg[:300]}")
        assert "hybridkv" not in msg.lower(), msg  # a connector fault is a real failure
        pytest.xfail(f"vLLM 0.32 CPU cannot run tiny mimo_v2: {msg[:400]}")
    assert res["sets"]["repeat"]["cached_tokens"][1] > 0
