"""Hit rate when the engine caches each request's decoded output behind its prompt.

``hybridkv replay`` caches prompts only.  An engine caches the output too, and
a chat's next prompt often does not repeat the output token for token: chat
templates drop a reasoning model's thinking from the history (MiMo-V2.5 is
one), and regenerated replies or edited messages replace it.  Then the next
turn matches the previous *prompt* and leaves the cached sequence at its end,
inside the leaf ``[prompt + output]``, whose kept tail window is at the
output's end; the window at the prompt's end was released while the output
was decoded (eager retention, or adaptive under pressure).

This script replays a trace through :class:`~hybridkv.HybridKVCache` as such
an engine would: each request's prompt is prefilled in chunks, then its
``output_length`` tokens are decoded (in steps of ``--decode-step`` tokens) and
cached at finish.  The output tokens are unique, so every next turn diverges
at the previous prompt's end (the reasoning-stripped case).  It runs the
cache twice per budget in the same process: with the divergence model learning
(the default) and with it held off (no predicted windows), and prints both
token hit rates, their ratio, and the learned offset.

    python benchmarks/engine_outputs.py [--trace T] [--budgets 59,594] [--retention eager]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv import CacheConfig, HybridKVCache, ModelSpec  # noqa: E402
from hybridkv.cache import CacheFullError  # noqa: E402
from hybridkv.eval.replay import TokenMaterializer  # noqa: E402
from hybridkv.eval.traces import load_trace  # noqa: E402

_OUT_BASE = 1 << 30  # output token ids: above every materialised prompt token


def run(prompts: list, spec: ModelSpec, budget: int, *, learn: bool, retention: str, chunk: int,
        step: int, max_output: int) -> dict:
    cache = HybridKVCache(spec, CacheConfig(budget_bytes=budget, device="meta", retention=retention))
    if not learn:
        cache.tree.divergence.observe = lambda dist, gain: False  # type: ignore[method-assign]
    hit = total = rejected = 0
    next_id = _OUT_BASE
    t0 = time.perf_counter()
    for tokens, namespace, out in prompts:
        total += len(tokens)
        req = cache.begin(tokens, namespace)
        try:
            while req.computed < len(tokens):
                n = min(chunk, len(tokens) - req.computed)
                cache.reserve(req, n)
                cache.commit(req, n)
            left = min(out, max_output)
            while left > 0:
                n = min(step, left)
                cache.append_tokens(req, np.arange(next_id, next_id + n, dtype=np.int64) % (1 << 31))
                next_id += n
                cache.reserve(req, n)
                cache.commit(req, n)
                left -= n
            cache.finish(req)
            hit += req.prefix_len
        except CacheFullError:
            cache.abort(req)
            rejected += 1
    return {"token_hit_rate": hit / max(1, total), "rejected": rejected,
            "pretail_pages": cache.tree.policy.pretail_pages,
            "decisions": cache.tree.divergence.decisions, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"
                                           / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--budgets", default="59,594", help="GB")
    ap.add_argument("--retention", default="eager", choices=["eager", "adaptive"])
    ap.add_argument("--preset", default="mimo-v2.5-pro")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--decode-step", type=int, default=16, help="output tokens per decode step")
    ap.add_argument("--max-output", type=int, default=4096, help="cap on a request's output tokens")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("chunk", "decode_step", "max_output", "page_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    spec = ModelSpec.preset(args.preset, page_size=args.page_size)
    reqs = load_trace(args.trace, limit=args.limit)
    mat = TokenMaterializer(extension_rule=True)
    prompts = [(t, r.namespace, r.output_length) for r in reqs if len(t := mat.tokens(r))]
    out = {"trace": args.trace, "requests": len(prompts), "retention": args.retention, "runs": []}
    for gb in (float(b) for b in args.budgets.split(",")):
        row = {"budget_gb": gb}
        for learn in (True, False):
            row["learned" if learn else "held_off"] = run(
                prompts, spec, int(gb * 1e9), learn=learn, retention=args.retention, chunk=args.chunk,
                step=args.decode_step, max_output=args.max_output)
        row["ratio"] = row["learned"]["token_hit_rate"] / max(1e-12, row["held_off"]["token_hit_rate"])
        out["runs"].append(row)
        if not args.json:
            a, b = row["learned"], row["held_off"]
            print(f"{gb:g} GB ({args.retention}): learned {a['token_hit_rate']:.2%} (offset {a['pretail_pages']} pages, "
                  f"{a['decisions']} decisions, {a['seconds']:.1f} s), held off {b['token_hit_rate']:.2%}, "
                  f"ratio {row['ratio']:.2f}", flush=True)
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
