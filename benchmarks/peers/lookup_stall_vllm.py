"""How long the vLLM connector's lookups hold up vLLM's scheduler thread, by store latency.

    adapters/vllm/.venv/bin/python benchmarks/peers/lookup_stall_vllm.py [--json OUT]

vLLM asks ``get_num_new_matched_tokens`` on its scheduler thread, between forward
passes: while a lookup waits for the L3 store, no running request takes its next
step.  This drives the connector's lookup (``hybridkv_vllm.lookups.Lookups`` over
``hybridkv_vllm.sources.TierView``, MiMo-V2's groups as vLLM gives them: full
attention at block 64, a 128-token sliding window at block 32) with a stream of
new prompts, half of them stored by another engine (every page in the store),
half not, against a store whose ``exists`` answers after a fixed delay (the
round trip of a remote store), three ways:

* ``inline``: the store asked on the calling thread (``TierView.hit``, as the
  connector did before ``hybridkv_vllm.lookups``);
* ``wait_5ms``: the default (``lookup_wait_ms=5``; a store whose last probes each
  answered within a quarter of it is asked inline, as the connector does);
* ``wait_0``: never wait (every lookup that needs the store is deferred once).

A deferred lookup (``None``) is asked again after a simulated engine step
(``--step-ms``, the forward pass the other requests take meanwhile).  Per prompt:
the time the scheduler thread was held (the sum of its lookup calls) and the
admission delay (first call to answer).  Every mode must give the same hit
tokens.  Prints JSON (medians and p99 per mode and delay).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "adapters" / "vllm")]

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from hybridkv.tiers.index import StoreIndex  # noqa: E402
from hybridkv_vllm.lookups import Lookups, TimedProbe  # noqa: E402
from hybridkv_vllm.plan import GroupInfo  # noqa: E402
from hybridkv_vllm.sources import TierView  # noqa: E402

GROUPS = (GroupInfo(0, None, block_size=64), GroupInfo(1, 128, block_size=32))
UNIT = 64
MODES = {"inline": None, "wait_5ms": 0.005, "wait_0": 0.0}  # lookup_wait_ms / 1000


class SlowStore:
    """``exists`` over a key set, answering after ``delay_s`` (one round trip per call)."""

    def __init__(self, keys: set[bytes], delay_s: float) -> None:
        self.keys, self.delay_s, self.calls = keys, delay_s, 0

    def exists(self, keys: list[bytes]) -> list[bool]:
        self.calls += 1
        time.sleep(self.delay_s)
        return [k in self.keys for k in keys]


def _prompts(n: int, tokens: int, seed: int) -> tuple[list[dict[int, list[bytes]]], set[bytes]]:
    """``n`` prompts' keys per group (random names), and the keys of the stored half."""
    rnd = random.Random(seed)
    prompts, stored = [], set()
    for i in range(n):
        keys = {g.index: [rnd.randbytes(16) for _ in range(tokens // g.block_size)] for g in GROUPS}
        prompts.append(keys)
        if i % 2 == 0:
            stored |= {k for ks in keys.values() for k in ks}
    order = list(range(n))
    rnd.shuffle(order)
    return [prompts[i] for i in order], stored


def _run(mode: str, delay_s: float, prompts: list[dict[int, list[bytes]]], stored: set[bytes],
         tokens: int, step_s: float) -> dict[str, float]:
    store = SlowStore(stored, delay_s)
    counts: dict[str, int] = {}

    def count(**inc: int) -> None:
        for k, v in inc.items():
            counts[k] = counts.get(k, 0) + v

    probe = TimedProbe(store.exists)
    view = TierView(GROUPS, None, CacheHitSource.EXTERNAL_UNSPECIFIED, StoreIndex(probe))
    wait_s = MODES[mode]
    lookups = Lookups(view, wait_s if wait_s is not None else 0.0, count, times=probe)
    held, admit, hits = [], [], 0
    try:
        for i, keys in enumerate(prompts):
            t0 = time.perf_counter()
            blocked = 0.0
            while True:
                c0 = time.perf_counter()
                hit = (lookups.hit(str(i), keys, 0, tokens - UNIT, UNIT) if wait_s is not None
                       else view.hit(keys, 0, tokens - UNIT, UNIT))
                blocked += time.perf_counter() - c0
                if hit is not None:
                    break
                time.sleep(step_s)  # the engine steps the running requests meanwhile
            held.append(blocked * 1e3)
            admit.append((time.perf_counter() - t0) * 1e3)
            hits += hit
    finally:
        lookups.close()
    q = statistics.quantiles
    return {"held_ms_p50": round(statistics.median(held), 3), "held_ms_p99": round(q(held, n=100)[98], 3),
            "held_ms_total": round(sum(held), 1), "admit_ms_p50": round(statistics.median(admit), 3),
            "admit_ms_p99": round(q(admit, n=100)[98], 3), "hit_tokens": hits, "store_calls": store.calls,
            "lookups_deferred": counts.get("lookups_deferred", 0),
            "lookup_probes_inline": counts.get("lookup_probes_inline", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per prompt")
    ap.add_argument("--delays-ms", default="0.1,1,5", help="the store's answer delays, comma separated")
    ap.add_argument("--step-ms", type=float, default=10.0, help="a simulated engine step")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    prompts, stored = _prompts(args.prompts, args.tokens, seed=5)
    rows = {}
    for d in (float(x) for x in args.delays_ms.split(",")):
        rows[f"{d:g}ms"] = {m: _run(m, d / 1e3, prompts, stored, args.tokens, args.step_ms / 1e3) for m in MODES}
        if len({r["hit_tokens"] for r in rows[f"{d:g}ms"].values()}) != 1:
            raise SystemExit(f"modes disagree on the hit tokens at {d:g} ms: {rows[f'{d:g}ms']}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"config": {"prompts": args.prompts, "tokens": args.tokens, "step_ms": args.step_ms,
                      "stored_share": 0.5, "groups": [[g.index, g.window, g.block_size] for g in GROUPS]},
           "rows": rows,
           "provenance": {"command": "adapters/vllm/.venv/bin/python benchmarks/peers/lookup_stall_vllm.py --json "
                                     "benchmarks/results/lookup_stall_vllm.json",
                          "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                          "depends": ["hybridkv/tiers/index.py", "hybridkv/tiers/lookup.py",
                                      "adapters/vllm/hybridkv_vllm/lookups.py",
                                      "adapters/vllm/hybridkv_vllm/sources.py",
                                      "benchmarks/peers/lookup_stall_vllm.py"],
                          "rerun": True}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
