"""How far can an online eviction policy get on a trace?  A sequence-level model.

``hybridkv replay`` compares the cache with LRU over full KV and with the
offline optimum (Belady) at page level.  This script asks a narrower question
behind issue 13's targets: given the features an online policy can see
(how often a sequence came back, and how long it has been idle), what is the
best it could do if the return-time distribution of every (class, idle time)
were known *exactly*, i.e. fitted offline on the very trace being replayed?

Model (SWA free, no windows, whole sequences): every request is a sequence
whose parent is the latest earlier request whose prompt it extends (same
namespace, all of the parent's complete blocks shared).  A request hits its parent's shared prefix if the parent is
cached; then the parent's entry is replaced by the request's (its prompt
extends it).  Capacity is the budget in full-KV tokens.  Policies evict:

* ``lru``: the least recently used sequence;
* ``belady``: the one whose next use is farthest (offline optimum here);
* ``fitted``: the ``"value"`` ranking's rule (lowest hit density per reuse
  class and idle time, :class:`hybridkv.radix.reuse.ReuseModel`) with the
  model fed every return period of the whole trace before the replay;
* ``online``: the same rule learning as the replay goes, as the cache does
  (a period starts at insert and ends at the sequence's return, seen in the
  cache or through an unbounded ghost list): what learning costs.

The hit rates are token hit rates of this simplified model (no shared
system-prompt nodes, no partial hits), so they sit below the replay's; the
ratios between policies are the point.

    python benchmarks/policy_ceiling.py [trace] [--budgets 59,594] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv import ModelSpec  # noqa: E402
from hybridkv.eval.traces import default_shared_traces, load_trace  # noqa: E402
from hybridkv.radix.reuse import ReuseModel, next_gap, reuse_class  # noqa: E402


def chains(reqs):
    """(parent index or -1, shared prefix tokens) per request: the parent is the latest
    earlier request whose prompt this one extends (a branch off a shared prefix,
    e.g. a system prompt, is not followed in this model)."""
    tries: dict[str, dict] = {}
    parent, shared = [], []
    for i, r in enumerate(reqs):
        node, best, depth = tries.setdefault(r.namespace, {}), -1, 0
        for k, b in enumerate(r.blocks):
            if b not in node:
                break
            node, depth = node[b], k + 1
            best = node.get(-1, best)
        node = tries[r.namespace]
        for b in r.blocks:
            node = node.setdefault(b, {})
            node[-1] = i
        # a continuation: it shares all of the parent's complete blocks (the last may have grown)
        ok = best >= 0 and depth >= max(1, len(reqs[best].blocks) - 1)
        parent.append(best if ok else -1)
        shared.append(min(depth * r.block_size, r.input_length - 1) if ok else 0)
    return np.array(parent), np.array(shared)


def simulate(lengths, parent, shared, cap, victim, events=None):
    """Token hit rate of the model under ``victim(cache, now)``; ``events``, when
    given, is told what happens (a model that learns online): ``returned(p, i)``,
    ``missed(p, i)`` (the parent is not cached), ``evicted(v, i)``, ``inserted(i)``."""
    cache: dict[int, int] = {}
    used = hits = 0
    for i, size in enumerate(lengths):
        p = int(parent[i])
        if p >= 0:
            if p in cache:
                hits += shared[i]
                used -= cache.pop(p)
                if events:
                    events.returned(p, i)
            elif events:
                events.missed(p, i)
        if size > cap:
            continue
        while used + size > cap:
            v = victim(cache, i)
            used -= cache.pop(v)
            if events:
                events.evicted(v, i)
        cache[i] = int(size)
        used += int(size)
        if events:
            events.inserted(i)
    return hits / lengths.sum()


def reuse_classes(parent):
    """Each request's reuse class at insert: how often its sequence came back before
    and at what cadence (what the ``"value"`` ranking sees)."""
    n = len(parent)
    returns = np.zeros(n, dtype=int)
    gap = np.full(n, -1.0)
    for i in range(n):
        p = parent[i]
        if p >= 0:
            returns[i] = returns[p] + 1
            gap[i] = next_gap(gap[p], i - p)
    return [reuse_class(int(r), float(g)) for r, g in zip(returns, gap)]


def density_victim(model, cls):
    """The ``"value"`` rule: the cached sequence with the lowest hit density."""
    def victim(cache, now):
        return min(cache, key=lambda k: (model.density(cls[k], now - k), k))
    return victim


def fitted_policy(parent):
    """The ``"value"`` ranking's rule with a :class:`ReuseModel` fed every period of
    the trace up front (ticks = request index): hit densities fitted offline."""
    n = len(parent)
    nxt = np.full(n, -1)
    for i in range(n):
        if parent[i] >= 0 and nxt[parent[i]] < 0:
            nxt[parent[i]] = i
    cls = reuse_classes(parent)
    model = ReuseModel()
    for i in range(n):
        model.start(cls[i], i)
        model.end(cls[i], i, int(nxt[i]) if nxt[i] >= 0 else n, returned=bool(nxt[i] >= 0))
    model._refresh(n)
    return density_victim(model, cls), nxt


class OnlineEvents:
    """The ``"value"`` rule learning as the replay goes (module docstring, ``online``):
    a period starts at insert and ends at the sequence's return, in the cache or
    through an unbounded ghost list."""

    def __init__(self, parent):
        self.cls = reuse_classes(parent)
        self.model = ReuseModel(ghosts=len(parent))
        self.victim = density_victim(self.model, self.cls)

    def returned(self, p, i):
        self.model.end(self.cls[p], p, i, returned=True)

    def missed(self, p, i):
        self.model.on_miss(p, i)  # a ghost: its return is seen all the same

    def evicted(self, v, i):
        self.model.remember(v, self.cls[v], v, i, (0, 0.0))

    def inserted(self, i):
        self.model.start(self.cls[i], i)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=None)
    ap.add_argument("--budgets", default="59,594", help="GB (10^9 bytes), comma-separated")
    ap.add_argument("--preset", default="mimo-v2.5-pro")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = args.trace or str(default_shared_traces() / "mooncake_conversation_trace.jsonl")
    reqs = load_trace(path)
    spec = ModelSpec.preset(args.preset, page_size=64)
    per_token = spec.bytes_per_token_full
    lengths = np.array([r.input_length for r in reqs])
    parent, shared = chains(reqs)
    out = {"trace": path, "requests": len(reqs), "bound": float(shared.sum() / lengths.sum()), "budgets": {}}
    for gb in (float(x) for x in args.budgets.split(",")):
        cap = gb * 1e9 / per_token
        victim, nxt = fitted_policy(parent)
        online = OnlineEvents(parent)
        far = np.where(nxt >= 0, nxt, len(reqs) + 1)
        res = {
            "lru": simulate(lengths, parent, shared, cap, lambda c, now: next(iter(c))),
            "belady": simulate(lengths, parent, shared, cap, lambda c, now: max(c, key=lambda k: far[k])),
            "fitted": simulate(lengths, parent, shared, cap, victim),
            "online": simulate(lengths, parent, shared, cap, online.victim, online),
        }
        out["budgets"][f"{gb:g}"] = res
        if not args.json:
            print(f"{gb:g} GB ({cap / 1e6:.2f}M tokens): LRU {res['lru']:.2%}  fitted class x age {res['fitted']:.2%}  "
                  f"online {res['online']:.2%}  Belady {res['belady']:.2%}  (bound {out['bound']:.2%})")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
