"""Request-path time of two versions of hybridkv, alternated, on the same prompts.

``hybridkv replay`` times each request (``request_ops_us``), but its harness
has changed between versions (see docs/benchmarks.md: it now serves requests
in blocks so the references do not empty the CPU caches between them).  To
compare the request path of two commits, this script materialises the trace's
prompts once with the current code, then drives each version's
``HybridKVCache`` with exactly the same loop (``begin``, ``reserve`` +
``commit`` per chunk, ``finish``; no references, no bound), in a fresh process
per run, alternating the versions round by round (each goes first in every
other round).  It prints each run's p50, p90 and mean per request and the hit
rate, then the median p50 of each version and their ratio, and the median (min,
max) of the rounds' paired ratios of p50 and of the mean.

    git worktree add /tmp/old <commit>
    python benchmarks/request_path_ab.py /tmp/old . --rounds 4 [--budget-gb 594] [--step 128,4096,256]

``--together`` runs the two versions of a round at the same time, one process
each (on a machine with two free cores): drift between runs (the clock, other
tenants) then hits both halves of a pair alike, so the paired ratios scatter less
than with runs in turn; read the paired ratios, not the absolute times.

``--l2-gb G`` adds an L2 of G GB (write-through, accounting only) beside L1:
the tiers' part of the request path (page keys, L1/L2 residency, backups).
``--l3`` adds an L3 below it, a file store, empty at the start of each run (its
writes and read-ahead run on the tiers' threads, beside the measured loop).

Then the batched decode step (``cache.step`` + ``commit_step`` of B requests
with a C-token context, ``--step B,C,STEPS``), alternated the same way: the
median of each run's median step, per request.

A checkout's ``replay._make_cache(system, spec, budget, swa_checkpoint, tiers)``
builds the cache (present since the first replay; ``hybridkv.eval.replay`` since
the harness moved, ``hybridkv.replay`` before).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, pickle, sys, time
import numpy as np
root, prompts_path, budget, chunk, preset, page, l2, l3 = sys.argv[1:9]
sys.path.insert(0, root)
import hybridkv
assert hybridkv.__file__.startswith(root), hybridkv.__file__
from hybridkv import ModelSpec
from hybridkv.cache import CacheFullError
try:  # the harness lives in hybridkv.eval; older checkouts kept it at the top
    from hybridkv.eval.replay import _make_cache
except ImportError:
    from hybridkv.replay import _make_cache
with open(prompts_path, "rb") as f:
    prompts = pickle.load(f)
spec = ModelSpec.preset(preset, page_size=int(page))
tiers = None
if float(l2):  # an L2 beside L1 (accounting only): the tiers' part of the request path
    from hybridkv.tiers.tiered import TierConfig
    tiers = TierConfig(l2_bytes=int(float(l2) * 10**9), l3=f"file://{l3}" if l3 else None)
cache = _make_cache("hybridkv", spec, int(budget), 16384, tiers)
chunk = int(chunk)
us, hit, total = [], 0, 0
for tokens, ns in prompts:
    total += len(tokens)
    t0 = time.perf_counter()
    req = cache.begin(tokens, ns)
    try:
        while req.computed < len(tokens):
            n = min(chunk, len(tokens) - req.computed)
            cache.reserve(req, n)
            cache.commit(req, n)
        cache.finish(req)
        hit += req.prefix_len
    except CacheFullError:
        cache.abort(req)
    us.append((time.perf_counter() - t0) * 1e6)
if tiers is not None:
    cache.close()  # (after the loop: the L3 writer's threads stop)
print(json.dumps({"p50": float(np.percentile(us, 50)), "p90": float(np.percentile(us, 90)),
                  "mean": float(np.mean(us)), "hit_rate": hit / max(1, total)}))
"""

_STEP_CHILD = r"""
import json, sys, time
import numpy as np
root, preset, page, batch, context, steps = sys.argv[1:7]
sys.path.insert(0, root)
import hybridkv
assert hybridkv.__file__.startswith(root), hybridkv.__file__
from hybridkv import CacheConfig, HybridKVCache, ModelSpec
spec = ModelSpec.preset(preset, page_size=int(page))
batch, context, steps = int(batch), int(context), int(steps)
cache = HybridKVCache(spec, CacheConfig(budget_bytes=4000 * 10**9, device="meta"))
rng = np.random.default_rng(0)
reqs = [cache.begin(rng.integers(0, 50000, context).astype(np.int32)) for _ in range(batch)]
while True:
    left = [r for r in reqs if r.computed < r.n_tokens]
    if not left:
        break
    b = cache.step(left, num_new=np.array([min(8192, r.n_tokens - r.computed) for r in left]))
    cache.commit_step(b)
toks = rng.integers(0, 50000, (steps, batch))
per_step = []
for s in range(steps):
    t0 = time.perf_counter()
    b = cache.step(reqs, new_tokens=toks[s])
    cache.commit_step(b)
    per_step.append(time.perf_counter() - t0)
    assert b.ok.all()
print(json.dumps({"us_per_request_step": float(np.median(per_step)) / batch * 1e6}))
"""


def _step_ab(roots: list[str], args: argparse.Namespace, cwd: str) -> None:
    """The batched decode step (``cache.step`` + ``commit_step``, B requests of a
    C-token context), alternated like the request path; medians of step medians."""
    batch, context, steps = (int(x) for x in args.step.split(","))
    runs: dict[str, list[float]] = {r: [] for r in roots}
    for i in range(args.rounds):
        for root in roots:
            res = subprocess.run([sys.executable, "-c", _STEP_CHILD, root, args.preset, str(args.page_size),
                                  str(batch), str(context), str(steps)],
                                 capture_output=True, text=True, check=True, cwd=cwd)
            us = json.loads(res.stdout.strip().splitlines()[-1])["us_per_request_step"]
            runs[root].append(us)
            print(f"step round {i + 1} {root}: {us:.3f} us per request per step (B {batch}, C {context})",
                  flush=True)
    med = {root: statistics.median(runs[root]) for root in roots}
    base, new = roots
    print(f"median batched step: {base} {med[base]:.3f} us, {new} {med[new]:.3f} us, "
          f"ratio {med[new] / med[base]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs=2, help="two checkouts of hybridkv (the first is the baseline)")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"
                                           / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--budget-gb", type=float, default=594)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--preset", default="mimo-v2.5-pro")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--l2-gb", type=float, default=0.0,
                    help="with an L2 of this many GB (write-through, accounting only; default 0: L1 alone)")
    ap.add_argument("--l3", action="store_true",
                    help="with --l2-gb: an L3 file store below L2, a fresh one per run (in the temp folder)")
    ap.add_argument("--together", action="store_true",
                    help="run the two versions of each round at the same time, one process each (needs 2 free "
                         "cores): the machine's drift between runs then hits both, so the paired ratios are "
                         "steadier; the absolute times are those of a loaded machine")
    ap.add_argument("--step", default="128,4096,256", metavar="B,C,STEPS",
                    help="batched decode step A/B: batch, context, steps (default 128,4096,256; 'none': skip)")
    args = ap.parse_args()
    if args.step != "none" and (len(args.step.split(",")) != 3
                                or not all(x.strip().isdigit() and int(x) > 0 for x in args.step.split(","))):
        raise ValueError(f"--step must be B,C,STEPS (three positive ints) or 'none', got {args.step!r}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.l3 and not args.l2_gb:
        raise ValueError("--l3 needs --l2-gb (L3 loads go through L2)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hybridkv.eval.replay import TokenMaterializer
    from hybridkv.eval.traces import load_trace

    reqs = load_trace(args.trace, limit=args.limit)
    mat = TokenMaterializer(extension_rule=True)
    prompts = [(t, r.namespace) for r in reqs if len(t := mat.tokens(r))]
    roots = [str(Path(c).resolve()) for c in args.checkouts]
    runs: dict[str, list[dict]] = {r: [] for r in roots}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.pkl")
        with open(path, "wb") as f:
            pickle.dump(prompts, f)
        stores = itertools.count()

        def child(root: str) -> list[str]:
            l3 = os.path.join(tmp, f"l3-{next(stores)}") if args.l3 else ""  # a fresh store per run
            return [sys.executable, "-c", _CHILD, root, path, str(int(args.budget_gb * 10**9)),
                    str(args.chunk), args.preset, str(args.page_size), str(args.l2_gb), l3]

        for i in range(args.rounds):
            order = roots if i % 2 == 0 else roots[::-1]  # each goes first in turn
            if args.together:  # both at once, a core each: the pair sees the same machine
                procs = [subprocess.Popen(child(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          cwd=tmp) for root in order]
                outs = []
                for proc in procs:
                    out, err = proc.communicate()
                    if proc.returncode:
                        raise RuntimeError(f"a run failed ({proc.returncode}): {err[-2000:]}")
                    outs.append(out)
            else:
                outs = [subprocess.run(child(root), capture_output=True, text=True, check=True, cwd=tmp).stdout
                        for root in order]
            for root, out in zip(order, outs):
                r = json.loads(out.strip().splitlines()[-1])
                runs[root].append(r)
                print(f"round {i + 1} {root}: p50 {r['p50']:.1f} us, p90 {r['p90']:.1f} us, "
                      f"mean {r['mean']:.1f} us, hit rate {r['hit_rate']:.2%}", flush=True)
        med = {root: statistics.median(r["p50"] for r in runs[root]) for root in roots}
        base, new = roots
        print(f"median p50: {base} {med[base]:.1f} us, {new} {med[new]:.1f} us, ratio {med[new] / med[base]:.3f}",
              flush=True)
        for stat in ("p50", "mean"):  # the same round's two runs, paired
            pairs = sorted(b[stat] and n[stat] / b[stat] for b, n in zip(runs[base], runs[new]))
            print(f"paired rounds, {stat}: median ratio {statistics.median(pairs):.3f} "
                  f"(min {pairs[0]:.3f}, max {pairs[-1]:.3f})", flush=True)
        if args.step != "none":
            _step_ab(roots, args, tmp)


if __name__ == "__main__":
    main()
