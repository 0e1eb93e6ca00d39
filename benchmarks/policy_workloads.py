"""Eviction rankings on generated workload families, at fractions of the working set.

The shared traces are two workloads; the policy must hold on others.  This
script generates five families (seeded, Mooncake-style 512-token blocks) that
stress different assumptions, replays each through the cache under the
``value`` (default), ``lru`` and ``adaptive`` rankings at 1 / 3 / 10 / 30% of
the working set's full-KV bytes, and prints the token hit rates beside LRU over
full KV with SWA free (upper reference) and the unlimited bound:

* ``rag``: a shared system prompt, 400 documents of 4K-30K tokens picked by a
  Zipf(1) popularity, each request one document plus a short question (reuse
  ends at branch points, never at tails);
* ``rag_flat``: the same with Zipf(0.5) (flatter popularity, larger working set);
* ``agents``: 60 live sessions of 5-40 turns, a turn every ~60 requests, each
  extending its prompt by 1-4 blocks (fast, regular cadence);
* ``scan_hot``: 30 hot prefixes asked 30% of the time, the rest one-shot
  prompts (scan resistance);
* ``shift``: ``agents`` then ``rag``: the statistics learned in the first half
  are wrong for the second.

None of these were used to choose the policy's rules; they exist to catch a
ranking that loses to recency on a workload shape the shared traces lack.

    python benchmarks/policy_workloads.py [--families rag,agents] [--fractions 0.03,0.3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv import ModelSpec  # noqa: E402
from hybridkv.eval.replay import replay  # noqa: E402
from hybridkv.eval.traces import TraceRequest  # noqa: E402

BLOCK = 512


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.n = 0

    def new(self, k: int) -> list[int]:
        self.n += k
        return list(range(self.n - k, self.n))


def _requests(prompts: list[list[int]], rnd: random.Random) -> list[TraceRequest]:
    """Trace requests; the last block of each prompt is partial (0-400 tokens short)."""
    return [TraceRequest("default", float(t), len(b) * BLOCK - rnd.randint(0, 400), 100, tuple(b), BLOCK)
            for t, b in enumerate(prompts)]


def rag(seed: int, n: int = 6000, docs: int = 400, zipf: float = 1.0) -> list[list[int]]:
    rnd, ids = random.Random(seed), _Ids()
    system = ids.new(1)
    documents = [ids.new(rnd.randint(8, 60)) for _ in range(docs)]
    weights = [1 / (k + 1) ** zipf for k in range(docs)]
    return [system + rnd.choices(documents, weights)[0] + ids.new(rnd.randint(1, 3)) for _ in range(n)]


def agents(seed: int, n: int = 8000, live: int = 60, turns: tuple[int, int] = (5, 40)) -> list[list[int]]:
    rnd, ids = random.Random(seed), _Ids()
    system = ids.new(2)

    def session() -> list:
        return [system + ids.new(rnd.randint(2, 10)), rnd.randint(*turns)]

    sessions, out = [session() for _ in range(live)], []
    while len(out) < n:
        k = rnd.randrange(live)
        s = sessions[k]
        s[0] = s[0] + ids.new(rnd.randint(1, 4))
        s[1] -= 1
        out.append(list(s[0]))
        if s[1] <= 0 or len(s[0]) > 250:
            sessions[k] = session()
    return out


def scan_hot(seed: int, n: int = 6000, hot: int = 30) -> list[list[int]]:
    rnd, ids = random.Random(seed), _Ids()
    prefixes = [ids.new(rnd.randint(10, 40)) for _ in range(hot)]
    return [rnd.choice(prefixes) + ids.new(1) if rnd.random() < 0.3 else ids.new(rnd.randint(10, 60))
            for _ in range(n)]


def shift(seed: int) -> list[list[int]]:
    first = agents(seed, n=4000)
    offset = 1 + max(max(p) for p in first)
    return first + [[b + offset for b in p] for p in rag(seed + 1, n=4000)]


FAMILIES = {
    "rag": lambda: rag(1),
    "rag_flat": lambda: rag(2, zipf=0.5),
    "agents": lambda: agents(3),
    "scan_hot": lambda: scan_hot(4),
    "shift": lambda: shift(5),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--fractions", default="0.01,0.03,0.1,0.3", help="budgets as fractions of the working set")
    ap.add_argument("--rankings", default="value,lru,adaptive")
    ap.add_argument("--preset", default="mimo-v2.5-pro")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    spec = ModelSpec.preset(args.preset, page_size=64)
    per_token = spec.bytes_per_token_full
    rankings = args.rankings.split(",")
    out: dict = {}
    for fam in args.families.split(","):
        if fam not in FAMILIES:
            raise SystemExit(f"--families: unknown family {fam!r} (known: {', '.join(FAMILIES)})")
        reqs = _requests(FAMILIES[fam](), random.Random(0))
        working_set = len({b for r in reqs for b in r.blocks}) * BLOCK * per_token
        for frac in (float(x) for x in args.fractions.split(",")):
            budget = int(working_set * frac)
            row: dict = {"budget_gb": budget / 1e9}
            for k, name in enumerate(rankings):
                res = replay(reqs, spec, budget, systems=("hybridkv",), references=k == 0, eviction_ranking=name)
                row[name] = res["systems"]["hybridkv"]["token_hit_rate"]
                if k == 0:
                    row["lru_full"] = res["references"]["lru_full"]["token_hit_rate"]
                    row["bound"] = res["prefix_bound_hit_rate"]
            out.setdefault(fam, {})[f"{frac:g}"] = row
            if not args.json:
                cells = "  ".join(f"{k} {v:.2%}" for k, v in row.items() if k != "budget_gb")
                print(f"{fam:9s} {frac:5.0%} of working set ({row['budget_gb']:.1f} GB): {cells}", flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
