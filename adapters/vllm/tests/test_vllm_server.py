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
   ``hkv2`` also answers ``/v1/chat/completions`` with no ``--chat-template``
   (the tiny model ships one), exports every counter from start-up (``0``),
   and once idle its ``/metrics`` equals the worker's figures in the stats
   file (saves stored after the last request's last step included).
3. The stats file: the last line of every (role, process) is its shutdown
   line (save queue drained) and carries totals equal to what ``/metrics``
   showed; the connector's log lines and the
   periodic ``KV Transfer metrics: hybridkv_...`` line are in the server log.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from bench_server import (
    Server,
    chat,
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
    words,
)
from hybridkv_vllm.metrics import COUNTERS
from tiny_models import build

KV_BYTES = 24 << 20  # ~2,400 tokens of vLLM KV cache: conversations evict each other
WORKER_COUNTERS = ["load_pages", "load_pages_l2", "load_pages_l3", "load_failures",
                   "save_pages", "save_pages_l2", "save_skipped", "save_dropped",
                   "finish_saves"]


def _final_totals(events: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, int]]:
    out: dict[tuple[str, int], dict[str, int]] = {}
    for e in events:
        out[(e["role"], e["pid"])] = e["totals"]
    return out


def _chat_turns(port: int, seed: int) -> list[dict[str, Any]]:
    """A chat of 2 turns, then the first turn of another.  A first turn's prompt
    is 60 tokens past a 64-token boundary (<bos>, a role marker per message,
    <|assistant|>), so its 16 decoded tokens complete a page: the last request
    ends with a finish save, stored after the engine's last step for it."""
    rnd, out = random.Random(seed), []
    for turns in (2, 1):
        msgs = [{"role": "system", "content": words(rnd, 100)},
                {"role": "user", "content": words(rnd, 64 * 3 + 60 - 4 - 100)}]
        for _ in range(turns):
            r = chat(port, msgs, 16)
            out.append(r)
            msgs += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": words(rnd, 20)}]
    return out


def _scrape_when_idle(port: int, stats: Path, timeout_s: float = 30.0
                      ) -> tuple[dict[str, float], dict[str, int]]:
    """``/metrics`` and the last worker line's totals once they agree (or at the
    timeout): the engine keeps stepping until the worker's saves are counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port, "vllm:hybridkv_")
        work = [e["totals"] for e in read_stats(stats) if e["role"] == "worker"][-1]
        if all(m.get(f"vllm:hybridkv_{n}_total") == work[n] for n in WORKER_COUNTERS) or \
                time.monotonic() > deadline:
            return m, work
        time.sleep(0.5)


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
        m0 = scrape(hkv2.port, "vllm:hybridkv_")
        res["hkv2"] = {"multi_turn": run_multi_turn(hkv2.port, wl)}
        probe = complete(hkv2.port, wl.batches[0][0], wl.max_tokens)  # system prompt via L3
        chats = _chat_turns(hkv2.port, seed=5)
        time.sleep(3)  # > VLLM_LOG_STATS_INTERVAL (2 s here): the periodic log line is out
        m2, idle_work = _scrape_when_idle(hkv2.port, stats)
    finally:
        hkv2.stop()

    # --- every counter has a sample line from start-up, at 0
    assert {f"vllm:hybridkv_{n}_total": 0.0 for n in COUNTERS}.items() <= m0.items(), m0
    # --- chat completions work with the model's own template (chat() raises on non-200)
    assert all(r["completion_tokens"] == 16 and r["text"].strip() for r in chats), chats
    assert chats[1]["cached_tokens"] >= 192, chats  # turn 2 extends turn 1's 252 tokens
    # --- an idle server's /metrics equals the worker's stats-file figures
    assert idle_work["finish_saves"] >= 2, idle_work  # the first turn of both chats
    assert {n: m2.get(f"vllm:hybridkv_{n}_total") for n in WORKER_COUNTERS} == \
        {n: idle_work[n] for n in WORKER_COUNTERS}, (m2, idle_work)

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
