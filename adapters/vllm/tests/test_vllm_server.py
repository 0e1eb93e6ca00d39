"""vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with
HybridKVConnector on tiny MiMo-V2, driven over HTTP as a user would.

One test, three servers (each bound to 127.0.0.1 on a port picked here, in
its own process group, always stopped: SIGTERM, then SIGKILL, to the group):

1. ``base`` (no connector) and ``hkv`` (connector, empty L3) start together;
   the same client runs on each: 8 concurrent requests sharing a system
   prompt, then 3 conversations x 3 turns (each turn = previous prompt + its
   answer + a new user message).  Every output must equal ``base``'s.
2. ``hkv`` stops (SIGTERM; ``--shutdown-timeout 10``, so a graceful one) and
   ``hkv2`` starts on the same L3: the multi-turn client again; the first
   turn of every conversation can only hit through L3 (vLLM's own cache is
   empty).  Outputs equal ``base``; the connector's hits are read from
   ``/metrics`` (``vllm:hybridkv_hit_tokens_total``) and match the hits the
   server reported per request.
3. The stats file: the last line of every (role, process) is its shutdown
   line (save queue drained) and carries totals equal to what ``/metrics``
   showed; the connector's log lines and the
   periodic ``KV Transfer metrics: hybridkv_...`` line are in the server log.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench_server import (
    Server,
    complete,
    free_port,
    hkv_transfer_config,
    make_workload,
    outputs,
    read_stats,
    run_concurrent,
    run_multi_turn,
    scrape,
    server_command,
)
from tiny_models import build

KV_BYTES = 24 << 20  # ~2,400 tokens of vLLM KV cache: conversations evict each other


def _final_totals(events: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, int]]:
    out: dict[tuple[str, int], dict[str, int]] = {}
    for e in events:
        out[(e["role"], e["pid"])] = e["totals"]
    return out


def test_openai_server_multi_turn_restart_metrics(tmp_path: Path) -> None:
    model = build("mimo_v2", tmp_path / "mimo_v2", window=64)
    l3, stats = f"file:{tmp_path / 'l3'}", tmp_path / "stats.jsonl"
    hkv_cfg = hkv_transfer_config(l3, stats_file=str(stats))
    wl = make_workload(seed=3, rounds=1, batch=8, system_len=400, convs=3, turns=3,
                       context_len=500, max_tokens=8)

    def server(name: str, cfg: Any) -> Server:
        port = free_port()
        return Server(name, server_command(model, port, cfg, KV_BYTES, 1024), port,
                      tmp_path / f"{name}.log")

    base, hkv = server("base", None), server("hkv", hkv_cfg)
    res: dict[str, dict[str, Any]] = {}
    try:
        base.start()
        hkv.start()
        for s in (base, hkv):
            s.wait_ready()
        for s in (base, hkv):
            res[s.name] = {"concurrent": run_concurrent(s.port, wl),
                           "multi_turn": run_multi_turn(s.port, wl)}
        m1 = scrape(hkv.port, "vllm:hybridkv_")
    finally:
        for s in (base, hkv):
            s.stop()

    hkv2 = server("hkv2", hkv_cfg)
    try:
        hkv2.start().wait_ready()
        res["hkv2"] = {"multi_turn": run_multi_turn(hkv2.port, wl)}
        probe = complete(hkv2.port, wl.batches[0][0], wl.max_tokens)  # system prompt via L3
        time.sleep(3)  # > VLLM_LOG_STATS_INTERVAL (2 s here): the periodic log line is out
        m2 = scrape(hkv2.port, "vllm:hybridkv_")
    finally:
        hkv2.stop()

    # --- outputs equal a server without the connector, token for token
    b = res["base"]
    assert len({tuple(t) for t in outputs(b["concurrent"])[0]}) > 1  # not degenerate
    assert all(len(t) == wl.max_tokens for g in outputs(b["multi_turn"]) for t in g)
    assert outputs(res["hkv"]["concurrent"]) == outputs(b["concurrent"])
    assert outputs(res["hkv"]["multi_turn"]) == outputs(b["multi_turn"])
    assert outputs(res["hkv2"]["multi_turn"]) == outputs(b["multi_turn"])
    assert probe["tokens"] == b["concurrent"][0][0]["tokens"]

    # --- hits after the restart: turn 1 of every conversation comes from L3
    first = [c[0] for c in res["hkv2"]["multi_turn"]]
    assert all(r["cached_tokens"] >= (r["prompt_len"] - 1) // 64 * 64 - 64 for r in first), \
        [(r["cached_tokens"], r["prompt_len"]) for r in first]
    assert all(c[0]["cached_tokens"] == 0 for c in b["multi_turn"])
    assert probe["cached_tokens"] >= 384  # 400-token system prompt, saved by hkv, unit 64
    hit = m2.get("vllm:hybridkv_hit_tokens_total", 0)
    assert hit >= sum(r["cached_tokens"] for r in first), m2
    assert m2.get("vllm:hybridkv_load_pages_l3_total", 0) > 0 and \
        m2.get("vllm:hybridkv_load_failures_total", 0) == 0, m2
    assert m1.get("vllm:hybridkv_save_pages_total", 0) > 0, m1

    # --- stats file: every process's last line holds its totals, equal to /metrics
    totals = _final_totals(read_stats(stats))
    roles = sorted(r for r, _ in totals)
    assert roles == ["scheduler", "scheduler", "worker", "worker"], roles
    # (first-appearance order: hkv's processes, then hkv2's)
    sched = [t for (r, _), t in totals.items() if r == "scheduler"]
    work = [t for (r, _), t in totals.items() if r == "worker"]
    assert sched[-1]["hit_tokens"] == hit, (sched, m2)
    assert work[-1]["load_pages_l3"] == m2["vllm:hybridkv_load_pages_l3_total"], (work, m2)
    assert work[0]["save_pages"] >= m1["vllm:hybridkv_save_pages_total"], (work, m1)
    # a SIGTERM'd server (--shutdown-timeout 10) shuts down cleanly: every
    # process drained its saves and wrote its shutdown line last
    last = {}
    for e in read_stats(stats):
        last[(e["role"], e["pid"])] = e
    assert all(e["event"] == "shutdown" and e["drained"] for e in last.values()), last

    # --- the connector logs through vLLM's logger; its stats reach the periodic log line
    log = (tmp_path / "hkv2.log").read_text(errors="replace")
    assert "HybridKVConnector role=WORKER" in log and "HybridKVConnector role=SCHEDULER" in log
    assert "KV Transfer metrics:" in log and "hybridkv_hit_tokens=" in log
