"""vLLM's OpenAI server with hybridkv's tree as its prefix cache vs vLLM's own cache.

    python scripts/bench_prefix_server.py [--blocks 96] [--convs 6] [--turns 4] [--repeats 2] [--json OUT]

Builds the tiny MiMo-V2 model (``scripts/tiny_models.py``) unless ``--model``
is given, then starts servers at the same ``--num-gpu-blocks-override``
(bound to 127.0.0.1 on free ports, each in its own process group), one at a
time, ``--repeats`` of each kind in the order of :func:`server_order`:

* ``vllm``: vLLM's own prefix cache (its scheduler, default retention);
* ``hybridkv``: ``--scheduler-cls hybridkv_vllm.scheduler.HybridKVScheduler``.

and drives each over HTTP, warmed by one request:

1. the *multi-turn* client: ``convs`` conversations of ``turns`` turns, turn
   ``t + 1`` = turn ``t``'s prompt + its answer + a new user message, the
   conversations interleaved so they evict each other from the small cache;
2. the *concurrent* client: ``rounds`` batches of ``batch`` requests sent at
   once, sharing a system prompt.

Prints JSON: every output of every server equal to the first ``vllm``
server's, prefix-cache queries and hits from each server's ``/metrics`` (first
server of each kind; every server's in ``metrics_per_run``), per-request cached
tokens, and the median time to first token per phase and kind over all its
servers, with the ratio and the per-server medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_server import (  # noqa: E402  (helpers shared with the connector's bench)
    Server,
    complete,
    free_port,
    make_workload,
    median_ms,
    run_concurrent,
    run_multi_turn,
    scrape,
    server_command,
)

SCHEDULER = "hybridkv_vllm.scheduler.HybridKVScheduler"


def prefix_server_command(model: str | Path, port: int, blocks: int, max_model_len: int,
                          hybridkv: bool) -> list[str]:
    """The server command at ``blocks`` KV blocks, with hybridkv's scheduler or without."""
    cmd = server_command(model, port, None, 1 << 30, max_model_len=max_model_len)
    cmd += ["--num-gpu-blocks-override", str(blocks)]
    if hybridkv:
        cmd += ["--scheduler-cls", SCHEDULER]
    return cmd


def prefix_metrics(port: int) -> dict[str, float]:
    m = scrape(port)
    return {"queries": m.get("vllm:prefix_cache_queries_total", 0.0),
            "hits": m.get("vllm:prefix_cache_hits_total", 0.0)}


def server_order(repeats: int) -> list[str]:
    """``vllm hybridkv hybridkv vllm vllm hybridkv ...``: ``repeats`` servers of
    each kind, one at a time.  Two CPU servers up at once on this 2-core machine
    were seen to leave one of them, either, 5-10x slower for a whole run, so
    the servers never overlap and the order alternates (a drift of the
    machine's load hits both alike)."""
    return [k for i in range(repeats) for k in (("vllm", "hybridkv") if i % 2 == 0 else ("hybridkv", "vllm"))]


def one_server(name: str, cmd: list[str], port: int, log: Path, wl: Any) -> dict[str, Any]:
    """Start one server, warm it, run the multi-turn then the concurrent client,
    read its prefix-cache counters, stop it."""
    srv = Server(name, cmd, port, log)
    try:
        srv.start().wait_ready()
        complete(port, list(range(5, 69)), 2)  # first-request compile, same on both
        base = prefix_metrics(port)
        results = run_multi_turn(port, wl)
        mid = prefix_metrics(port)
        cres = run_concurrent(port, wl)
        after = prefix_metrics(port)
        return {"start_s": round(srv.start_s, 1),
                "metrics": {k: after[k] - base[k] for k in ("queries", "hits")},
                # per phase: the multi-turn client sends one request at a time (its
                # hits repeat run to run); the concurrent one's depend on arrival order
                "metrics_phase": {"multi_turn": {k: mid[k] - base[k] for k in ("queries", "hits")},
                                  "concurrent": {k: after[k] - mid[k] for k in ("queries", "hits")}},
                "multi_turn": [r for conv in results for r in conv],
                "concurrent": [r for batch in cres for r in batch],
                "log_errors": srv.log_tail(200000).count("Traceback")}
    finally:
        srv.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from tiny_models import build

        model = build("mimo_v2", work / "mimo_v2", window=64)
    wl = make_workload(seed=args.seed, rounds=args.rounds, batch=args.batch, system_len=args.system_len,
                       convs=args.convs, turns=args.turns, context_len=args.context_len,
                       max_tokens=args.max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "hybridkv": []}
    t0 = time.perf_counter()
    for i, name in enumerate(server_order(args.repeats)):
        port = free_port()
        cmd = prefix_server_command(model, port, args.blocks, args.max_model_len, name == "hybridkv")
        runs[name].append(one_server(name, cmd, port, work / f"{name}-{i}.log", wl))
    servers = list(runs)
    out: dict[str, Any] = {"blocks": args.blocks, "repeats": args.repeats,
                           "wall_s": round(time.perf_counter() - t0, 1)}
    first = {n: runs[n][0] for n in servers}
    out["outputs_equal"] = all(
        [r["tokens"] for r in r_[phase]] == [r["tokens"] for r in first["vllm"][phase]]
        for n in servers for r_ in runs[n] for phase in ("multi_turn", "concurrent"))
    out["metrics"] = {n: first[n]["metrics"] for n in servers}
    out["metrics_per_run"] = {n: [r["metrics"] for r in runs[n]] for n in servers}
    out["metrics_phase"] = {n: first[n]["metrics_phase"] for n in servers}
    out["requests"] = {n: len(first[n]["multi_turn"]) + len(first[n]["concurrent"]) for n in servers}
    out["cached_tokens"] = {n: {ph: [r["cached_tokens"] for r in first[n][ph]]
                                for ph in ("multi_turn", "concurrent")} for n in servers}
    out["ttft_ms_p50"] = {ph: {n: median_ms([r["ttft_s"] for run_ in runs[n] for r in run_[ph]]) for n in servers}
                          for ph in ("multi_turn", "concurrent")}
    out["ttft_ms_p50_per_run"] = {ph: {n: [median_ms([r["ttft_s"] for r in run_[ph]]) for run_ in runs[n]]
                                       for n in servers} for ph in ("multi_turn", "concurrent")}
    out["ttft_ratio"] = {ph: round(v["hybridkv"] / v["vllm"], 3) if v["vllm"] else None
                         for ph, v in out["ttft_ms_p50"].items()}
    out["hybridkv_log_errors"] = sum(r["log_errors"] for r in runs["hybridkv"])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: build tiny MiMo-V2 in --work)")
    ap.add_argument("--work", default="/tmp/hybridkv-bench-prefix-server")
    ap.add_argument("--blocks", type=int, default=96, help="--num-gpu-blocks-override of both servers")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--convs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-len", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2,
                    help="servers of each kind, one at a time, alternating (see server_order)")
    ap.add_argument("--json", help="also write the result here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = run(args)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return out


if __name__ == "__main__":
    main()
