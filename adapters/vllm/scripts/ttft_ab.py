"""TTFT of vLLM's OpenAI server with and without HybridKVConnector (empty L3),
multi-turn chat, one server at a time, alternating.

    python scripts/ttft_ab.py [--blocks 3] [--convs 8] [--turns 6] [--json OUT]

Block ``i`` starts a fresh server (``base``: no connector; ``hkv``: the
connector on a fresh, empty L3 directory), warms it with two unrelated chat
requests, runs the same chat workload on it and stops it; the order
alternates ``base hkv hkv base base hkv ...`` so a drift of the machine's
load hits both alike.  Workload: ``convs`` conversations sharing a system
prompt, ``turns`` turns each (turn ``t + 1`` = the conversation so far, the
answer, a new user message), interleaved, one request at a time, streamed
``/v1/chat/completions`` through the tiny model's chat template, greedy,
``max_tokens`` tokens.  The KV cache (``--kv-cache-mb``) is large enough
for vLLM to keep every conversation itself by default, so the connector
can only add cost.

For every ``hkv`` block the script then sends one more request that ends
with a finish save (its decode completes a page), waits until the server is
idle and compares the worker counters on ``/metrics`` with the stats file.  Prints
JSON: TTFT medians (and p90, mean) per server over all blocks, the ratio of
medians, per-block medians, and the idle ``/metrics`` vs stats-file figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_server import (  # noqa: E402
    Server,
    chat,
    free_port,
    hkv_transfer_config,
    read_stats,
    scrape,
    server_command,
    words,
)

WORKER = ["save_pages", "save_pages_l2", "save_skipped", "finish_saves", "load_pages"]


def conversations(seed: int, convs: int, turns: int, system_len: int, first_len: int,
                  user_len: int) -> tuple[list[list[dict[str, str]]], list[list[str]]]:
    """Opening messages per conversation and the later user messages."""
    rnd = random.Random(seed)
    system = words(rnd, system_len)
    starts = [[{"role": "system", "content": system},
               {"role": "user", "content": words(rnd, first_len + rnd.randint(0, 40))}]
              for _ in range(convs)]
    later = [[words(rnd, user_len) for _ in range(turns - 1)] for _ in range(convs)]
    return starts, later


def run_chat(port: int, starts: list[list[dict[str, str]]], later: list[list[str]],
             max_tokens: int) -> list[dict[str, Any]]:
    """Turn t of every conversation, then turn t + 1; one request at a time."""
    msgs = [list(m) for m in starts]
    out = []
    for t in range(1 + len(later[0])):
        for c, m in enumerate(msgs):
            if t:
                m += [{"role": "assistant", "content": out[-len(msgs)]["text"]},
                      {"role": "user", "content": later[c][t - 1]}]
            r = chat(port, m, max_tokens)
            r.update(conv=c, turn=t)
            out.append(r)
    return out


def idle_compare(port: int, stats: Path, timeout_s: float) -> dict[str, Any]:
    """Worker counters on ``/metrics`` and in the stats file, once equal or at the timeout."""
    t0 = time.monotonic()
    while True:
        m = scrape(port, "vllm:hybridkv_")
        work = [e["totals"] for e in read_stats(stats) if e["role"] == "worker"]
        w = work[-1] if work else {}
        metrics = {n: int(m.get(f"vllm:hybridkv_{n}_total", -1)) for n in WORKER}
        stats_file = {n: int(w.get(n, -1)) for n in WORKER}
        if metrics == stats_file or time.monotonic() - t0 > timeout_s:
            return {"metrics": metrics, "stats_file": stats_file, "equal": metrics == stats_file,
                    "waited_s": round(time.monotonic() - t0, 1)}
        time.sleep(0.5)


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "median_ms": round(statistics.median(xs) * 1e3, 1),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 1),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: build tiny MiMo-V2 in --work)")
    ap.add_argument("--work", default="/tmp/hybridkv-ttft-ab")
    ap.add_argument("--blocks", type=int, default=3, help="servers of each kind, alternating")
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=200)
    ap.add_argument("--first-len", type=int, default=300)
    ap.add_argument("--user-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--idle-timeout", type=float, default=20.0,
                    help="how long to wait for /metrics to equal the stats file")
    ap.add_argument("--connector-module", default="hybridkv_vllm.connector",
                    help="kv_connector_module_path (e.g. another checkout's copy)")
    ap.add_argument("--extra", default="{}", help="JSON: more kv_connector_extra_config")
    ap.add_argument("--only", choices=["base", "hkv"], help="run one kind only")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        from tiny_models import build

        model = build("mimo_v2", work / "mimo_v2", window=64)
    starts, later = conversations(7, args.convs, args.turns, args.system_len,
                                  args.first_len, args.user_len)
    warm, _ = conversations(99, 2, 1, args.system_len, args.first_len, args.user_len)
    max_len = 4 + args.system_len + args.first_len + 40 + (args.turns - 1) * (
        args.user_len + args.max_tokens + 2) + args.max_tokens + 64
    order = [("base", "hkv") if i % 2 == 0 else ("hkv", "base") for i in range(args.blocks)]
    order_flat = [k for pair in order for k in pair if args.only in (None, k)]
    res: dict[str, list[dict[str, Any]]] = {"base": [], "hkv": []}
    blocks: list[dict[str, Any]] = []
    for i, kind in enumerate(order_flat):
        tag = f"{kind}-{i}"
        stats = work / f"stats-{tag}.jsonl"
        stats.unlink(missing_ok=True)
        cfg = None
        if kind == "hkv":
            cfg = hkv_transfer_config(f"file:{work / f'l3-{tag}-{time.time_ns()}'}",
                                      stats_file=str(stats), **json.loads(args.extra))
            cfg["kv_connector_module_path"] = args.connector_module
        port = free_port()
        srv = Server(tag, server_command(model, port, cfg, args.kv_cache_mb << 20, max_len),
                     port, work / f"{tag}.log")
        row: dict[str, Any] = {"block": i, "server": kind}
        try:
            srv.start().wait_ready()
            for m in warm:
                chat(port, m, 2)
            out = run_chat(port, starts, later, args.max_tokens)
            res[kind] += out
            row.update(summary([r["ttft_s"] for r in out]))
            row["cached_tokens"] = sum(r["cached_tokens"] for r in out)
            if kind == "hkv":
                # a last request whose decode completes a page: it ends with a
                # finish save, stored after the engine's last step for it
                rnd = random.Random(i)
                chat(port, [{"role": "user", "content": words(rnd, 64 * 3 + 60 - 3)}], 16)
                row["idle"] = idle_compare(port, stats, args.idle_timeout)
        finally:
            srv.stop()
        blocks.append(row)
        print(json.dumps(row), flush=True)
    result: dict[str, Any] = {"args": vars(args), "blocks": blocks,
                              "ttft": {k: summary([r["ttft_s"] for r in v])
                                       for k, v in res.items() if v}}
    if res["base"] and res["hkv"]:
        result["ratio_median"] = round(result["ttft"]["hkv"]["median_ms"]
                                       / result["ttft"]["base"]["median_ms"], 3)
        result["ratio_mean"] = round(result["ttft"]["hkv"]["mean_ms"]
                                     / result["ttft"]["base"]["mean_ms"], 3)
        result["outputs_equal"] = [r["text"] for r in res["hkv"]] == [
            r["text"] for r in res["base"]]
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return result


if __name__ == "__main__":
    main()
