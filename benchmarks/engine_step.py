"""Per-step cache cost an engine's scheduler pays, side by side with vLLM.

Decode: B running requests with a C-token context, ``--steps`` decode steps;
per request per step, in one run:

* ``hybridkv_batched``: ``cache.step(reqs, new_tokens=...)`` + ``cache.commit_step``
  (append, allocate both kinds, slots of the whole batch);
* ``hybridkv_single``: ``append_tokens`` + ``allocate(req, 1)`` + ``commit(req, 1)``;
* ``vllm``: vLLM 0.32 ``KVCacheManager`` (real class, same hybrid layout,
  ``benchmarks/peers/engine_step_vllm.py`` in the vLLM venv):
  ``append_output_token_ids`` + ``allocate_slots(req, 1)``.

Request path: ``begin + allocate + commit + finish`` per request replaying the
Mooncake conversation trace at 594 GB (``hybridkv replay``'s ``request_ops_us``),
medians of ``--repeats`` whole replays.

    python benchmarks/engine_step.py --json            # all of it (vLLM venv via benchmarks/peers/envs.sh)
    python benchmarks/engine_step.py --quick --json    # B 32/128, 4K context, 128 steps, 2,000 requests
    python benchmarks/engine_step.py --no-vllm --steps 64 --batches 32 --contexts 4096

Medians of ``--repeats`` runs; meta device (accounting only: what is timed is
the scheduler-side bookkeeping, not KV copies).  Progress (which step of how
many, and the time so far) goes to stderr, so ``--json`` output stays clean.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hybridkv import CacheConfig, HybridKVCache, ModelSpec
from hybridkv.eval.replay import replay
from hybridkv.eval.traces import default_shared_traces, load_trace

HERE = Path(__file__).resolve().parent
GB = 10**9
#: what --quick changes (each only where the option is not given): about a minute here
QUICK = {"batches": "32,128", "contexts": "4096", "steps": 128, "limit": 2000}
FULL = {"batches": "32,128,256", "contexts": "4096,32768", "steps": 512, "limit": None}


class Progress:
    """``engine_step [i/n] what (12.3 s)`` lines on stderr; ``n`` is set up front."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        """Announce the next step (mutates the step count)."""
        self.done += 1
        print(f"engine_step [{self.done}/{self.total}] {what} ({time.perf_counter() - self.t0:.1f} s so far)",
              file=sys.stderr, flush=True)


def _cache(spec: ModelSpec, budget: int) -> HybridKVCache:
    return HybridKVCache(spec, CacheConfig(budget_bytes=budget, device="meta"))


def _prefill(cache: HybridKVCache, batch: int, context: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    reqs = [cache.begin(rng.integers(0, 50000, context).astype(np.int32)) for _ in range(batch)]
    while True:
        left = [r for r in reqs if r.computed < r.n_tokens]
        if not left:
            return reqs
        b = cache.step(left, num_new=np.array([min(8192, r.n_tokens - r.computed) for r in left]))
        assert b.ok.all(), b.errors
        cache.commit_step(b)


def decode_batched(spec: ModelSpec, budget: int, batch: int, context: int, steps: int, seed: int) -> float:
    cache = _cache(spec, budget)
    reqs = _prefill(cache, batch, context, seed)
    toks = np.random.default_rng(seed + 1).integers(0, 50000, (steps, batch))
    clock = time.perf_counter
    total = 0.0
    for s in range(steps):
        row = toks[s]
        t0 = clock()
        b = cache.step(reqs, new_tokens=row)
        cache.commit_step(b)
        total += clock() - t0
        assert b.ok.all()
    for r in reqs:
        cache.finish(r)
    return total / (steps * batch) * 1e6


def decode_single(spec: ModelSpec, budget: int, batch: int, context: int, steps: int, seed: int) -> float:
    cache = _cache(spec, budget)
    reqs = _prefill(cache, batch, context, seed)
    toks = np.random.default_rng(seed + 1).integers(0, 50000, (steps, batch)).tolist()
    clock = time.perf_counter
    append, allocate, commit = cache.append_tokens, cache.allocate, cache.commit
    total = 0.0
    for s in range(steps):
        row = toks[s]
        t0 = clock()
        for i, r in enumerate(reqs):
            append(r, [row[i]])
            allocate(r, 1)
            commit(r, 1)
        total += clock() - t0
    for r in reqs:
        cache.finish(r)
    return total / (steps * batch) * 1e6


def vllm_python() -> str | None:
    env = os.environ.get("HYBRIDKV_VLLM_PYTHON")
    if env:
        return env
    try:
        venv = subprocess.run(["bash", "-c", f"source {HERE / 'peers' / 'envs.sh'} && vllm"], capture_output=True,
                              text=True, timeout=1800).stdout.strip().splitlines()[-1]
    except (subprocess.SubprocessError, IndexError):
        return None
    py = Path(venv) / "bin" / "python"
    return str(py) if py.exists() else None


def decode_vllm(spec: ModelSpec, budget: int, batches: list[int], contexts: list[int], steps: int,
                repeats: int) -> dict:
    py = vllm_python()
    if py is None:
        return {"error": "no vLLM venv (benchmarks/peers/envs.sh vllm)"}
    meta = {"page_size": spec.page_size, "window": spec.window, "full_layers": len(spec.full_layers),
            "swa_layers": len(spec.swa_layers), "full_bpt": spec.bytes_per_token_full,
            "swa_bpt": spec.bytes_per_token_swa, "budget_bytes": budget}
    cfg = {"meta": meta, "batches": batches, "contexts": contexts, "steps": steps, "repeats": repeats}
    r = subprocess.run([py, str(HERE / "peers" / "engine_step_vllm.py"), json.dumps(cfg)], capture_output=True,
                       text=True, timeout=3600)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def request_ops(spec: ModelSpec, trace: str | None, limit: int | None, repeats: int = 3,
                progress: Progress | None = None) -> dict:
    """``request_ops_us`` p50/p99 of ``repeats`` whole replays at 594 GB: the medians
    (the machine's load moves one run's p50 by 10-20%), and each run's figures."""
    shared = default_shared_traces()
    if trace is None and shared is None:
        raise SystemExit("engine_step: no --trace and no ../shared/traces beside the checkout (or --no-replay)")
    path = trace or str(shared / "mooncake_conversation_trace.jsonl")
    reqs = load_trace(path, limit=limit)
    runs = []
    for i in range(max(1, repeats)):
        if progress is not None:
            progress.step(f"request path: replay {i + 1} of {max(1, repeats)} of {len(reqs):,} requests at 594 GB")
        t0 = time.perf_counter()
        res = replay(reqs, spec, 594 * GB, systems=("hybridkv",), references=False)
        h = res["systems"]["hybridkv"]
        runs.append({"replay_s": time.perf_counter() - t0, "request_ops_us_p50": h["request_ops_us_p50"],
                     "request_ops_us_p99": h["request_ops_us_p99"], "token_hit_rate": h.get("token_hit_rate")})
    out = {"trace": path, "requests": len(reqs), "request_ops_runs": runs}
    for key in ("replay_s", "request_ops_us_p50", "request_ops_us_p99"):
        out[key] = float(np.median([r[key] for r in runs]))
    out["token_hit_rate"] = runs[0]["token_hit_rate"]
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mimo-v2.5-pro", help="model preset (default mimo-v2.5-pro)")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 32,128,256)")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths (default 4096,32768)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per run (default 512)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    ap.add_argument("--budget-gb", type=float, default=4000.0,
                    help="KV budget in GB (10^9 bytes); roomy so decode never evicts (default 4000)")
    ap.add_argument("--trace", default=None, help="trace for the request-path figure (default: the shared "
                    "Mooncake conversation trace)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace (default all)")
    ap.add_argument("--quick", action="store_true",
                    help="B 32,128, context 4096, 128 steps, the first 2,000 requests (options given win)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's figures")
    ap.add_argument("--no-replay", action="store_true", help="skip the request-path replay")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _decode_figures(spec: ModelSpec, budget: int, batches: list[int], contexts: list[int], args: argparse.Namespace,
                    progress: Progress) -> dict:
    """Per context: hybridkv's batched and single-request decode cost per batch size (medians)."""
    per_ctx: dict = {}
    for ctx in contexts:
        fig: dict = {"hybridkv_batched": {}, "hybridkv_single": {}}
        for b in batches:
            for name, fn in (("hybridkv_batched", decode_batched), ("hybridkv_single", decode_single)):
                progress.step(f"{name}: B={b}, context {ctx}, {args.steps} steps x {args.repeats} runs")
                vals = [fn(spec, budget, b, ctx, args.steps, seed) for seed in range(args.repeats)]
                fig[name][str(b)] = float(np.median(vals))
        per_ctx[ctx] = fig
    return per_ctx


def main() -> None:
    args = _args()
    spec = ModelSpec.preset(args.preset, page_size=args.page_size)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    budget = int(args.budget_gb * GB)
    progress = Progress(2 * len(batches) * len(contexts) + (not args.no_vllm)
                        + (0 if args.no_replay else max(1, args.repeats)))
    out: dict = {"preset": args.preset, "page_size": args.page_size, "steps": args.steps, "repeats": args.repeats,
                 "quick": args.quick}
    per_ctx = _decode_figures(spec, budget, batches, contexts, args, progress)
    if not args.no_vllm:
        progress.step("vllm: KVCacheManager in the vLLM venv (benchmarks/peers/envs.sh vllm makes it once)")
        v = decode_vllm(spec, budget, batches, contexts, args.steps, args.repeats)
        out["vllm_version"] = v.get("version", v.get("error"))
        for ctx in contexts:
            per_ctx[ctx]["vllm"] = v.get("decode_us_per_req", {}).get(str(ctx), {})
    for ctx in contexts:
        key = "decode_us_per_req" if ctx == 4096 else f"decode_us_per_req_{ctx // 1024}k"
        out[key] = per_ctx[ctx]
        vl = per_ctx[ctx].get("vllm") or {}
        out[key.replace("decode_us_per_req", "batched_vs_vllm")] = {
            b: per_ctx[ctx]["hybridkv_batched"][b] / vl[b] for b in vl if vl[b]}
    if not args.no_replay:
        out.update(request_ops(spec, args.trace, args.limit, args.repeats, progress))
    print(f"engine_step: done in {time.perf_counter() - progress.t0:.1f} s", file=sys.stderr)
    _print(out, args.json)


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for key, fig in out.items():
        if key.startswith("decode_us_per_req"):
            print(key)
            for name, row in fig.items():
                print(f"  {name:<18}" + "  ".join(f"B={b}: {us:6.2f} us" for b, us in row.items()))
    for key in ("request_ops_us_p50", "request_ops_us_p99", "replay_s"):
        if key in out:
            print(f"{key}: {out[key]:.1f}")


if __name__ == "__main__":
    main()
