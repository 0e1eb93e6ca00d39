"""What a vLLM lookup pays for a prompt's keys: read off hybridkv's device tree, or hashed.

With ``--scheduler-cls`` the prefix manager's tree keeps the connector's page keys
(and, past eviction, evicted runs of them); a lookup reads a prompt's leading keys
there and hashes only the rest (``hybridkv_vllm/names.py``).  This replays the
conversation trace through vLLM's real scheduler with hybridkv's prefix cache and
connector (``tiers_vllm_connector.run_hybridkv_vllm``: the worker stood in, a file
L3 and an L2), once with the names and once with them switched off, alternating
rounds (the window repair, which needs the names, off in both), and prints per lookup (``get_num_new_matched_tokens``, the scheduler
thread's whole lookup) the median and mean time, the pages named, and whether
the two runs' rows (hit tokens, their split by tier, L2's end) are the same --
they must be (the steps are printed: a lookup deferred while its store probe
runs costs a step, and which are deferred follows the probe thread's timing).  Run with the vLLM venv's python::

    adapters/vllm/.venv/bin/python benchmarks/peers/lookup_keys_vllm.py --limit 1000 --l1-gb 8 --host-gb 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiers_vllm as tv  # noqa: E402
import tiers_vllm_connector as tc  # noqa: E402

GB = 10**9
#: what must not change (the steps may: a lookup deferred while its store probe runs costs one step, and
#: which are deferred follows the probe thread's timing)
SAME = ("hit_tokens", "l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "l2_end")


def _timed(sink: list[float]) -> Callable[[Any], Any]:
    """A wrapper of the connector's lookup that appends each call's seconds to ``sink``."""
    def wrap(real: Any) -> Any:
        def lookup(self: Any, request: Any, num_computed_tokens: int) -> Any:
            t0 = time.perf_counter()
            try:
                return real(self, request, num_computed_tokens)
            finally:
                sink.append(time.perf_counter() - t0)
        return lookup
    return wrap


def one_run(seqs: Sequence[tuple[Any, str]], meta: dict[str, Any], l1: int, host: int, names: bool
            ) -> tuple[dict[str, Any], list[float]]:
    """One replay (names on or off): its row and each lookup's seconds."""
    import hybridkv_vllm.connector as cm

    times: list[float] = []
    real_lookup, real_bind = cm.HybridKVConnector.get_num_new_matched_tokens, cm.bind_names
    cm.HybridKVConnector.get_num_new_matched_tokens = _timed(times)(real_lookup)  # type: ignore[method-assign]
    if not names:
        cm.bind_names = lambda *a, **k: None  # type: ignore[assignment]
    try:
        # the window repair needs the names (it would differ between the two modes): off in both
        row = tc.run_hybridkv_vllm(seqs, meta, l1, host, True, extra={"repair_windows": False})
    finally:
        cm.HybridKVConnector.get_num_new_matched_tokens = real_lookup  # type: ignore[method-assign]
        cm.bind_names = real_bind
    return row, times


def merge(path: Path, row: dict[str, Any], command: str) -> None:
    """Put ``row`` into the result file at ``path`` (its ``rows``, replacing one of the
    same trace) with the ``command`` that made it and the commit checked out; the
    file's provenance is kept."""
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"rows": []}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    data["rows"] = [r for r in data["rows"] if r["trace"] != row["trace"]] + [{**row, "command": command,
                                                                               "commit": commit}]
    data["rows"].sort(key=lambda r: r["trace"])
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", default=str(HERE.parents[1].parent / "shared" / "traces"))
    p.add_argument("--limit", type=int, default=1000, help="conversation requests (default 1000)")
    p.add_argument("--sessions", type=int, default=0, help="replay the first N kv-cache-tester sessions "
                   "instead of the conversation trace (default 0: the conversation trace)")
    p.add_argument("--l1-gb", type=float, default=8.0, help="device KV bytes, GB (default 8: the tree evicts)")
    p.add_argument("--host-gb", type=float, default=60.0, help="the connector's L2, GB (default 60)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (names, no names), alternated (default 2)")
    p.add_argument("--model", default="mimo-v2.5-pro")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--json-out", default=None, help="merge the row into this result file's rows (by trace)")
    args = p.parse_args(argv)
    if args.limit <= 0 or args.sessions < 0 or args.l1_gb <= 0 or args.host_gb <= 0 or args.rounds <= 0:
        p.error("--limit, --l1-gb, --host-gb and --rounds must be positive")
    from hybridkv.spec import ModelSpec

    spec = ModelSpec.preset(args.model)
    meta = tv.preset_meta(spec)
    with tempfile.TemporaryDirectory(prefix="hkv-lookup-keys-") as tmp:
        (trace, reqs), = list(tv.load_traces(Path(args.traces), 0 if args.sessions else args.limit,
                                             args.sessions, Path(tmp)))
        seqs = tv.materialize(reqs)
    l1, host = int(args.l1_gb * GB), int(args.host_gb * GB)
    runs: dict[bool, list[tuple[dict[str, Any], list[float]]]] = {True: [], False: []}
    for r in range(args.rounds):
        for names in ((True, False) if r % 2 == 0 else (False, True)):
            runs[names].append(one_run(seqs, meta, l1, host, names))
    out: dict[str, Any] = {"trace": trace, "requests": len(seqs), "l1_gb": args.l1_gb,
                           "host_gb": args.host_gb, "model": spec.name, "rounds": args.rounds}
    for names, label in ((True, "names"), (False, "hashed")):
        per_round = [(statistics.median(t) * 1e6, statistics.fmean(t) * 1e6, len(t)) for _, t in runs[names]]
        out[label] = {"lookups": per_round[0][2],
                      "median_us": round(statistics.median(m for m, _, _ in per_round), 1),
                      "mean_us": round(statistics.median(a for _, a, _ in per_round), 1),
                      "per_round_median_us": [round(m, 1) for m, _, _ in per_round],
                      "tree_named_pages": runs[names][0][0].get("tree_named_pages", 0)}
    first = runs[True][0][0]
    out["differs"] = sorted({k for rs in runs.values() for row, _ in rs for k in SAME if row[k] != first[k]})
    out["rows_identical"] = not out["differs"]
    out["steps"] = {label: [row["steps"] for row, _ in runs[names]] for names, label in ((True, "names"),
                                                                                         (False, "hashed"))}
    out["hit_tokens"] = first["hit_tokens"]
    out["ratio_median"] = round(out["names"]["median_us"] / out["hashed"]["median_us"], 3)
    out["ratio_mean"] = round(out["names"]["mean_us"] / out["hashed"]["mean_us"], 3)
    if args.json_out:
        merge(Path(args.json_out), out, " ".join(["adapters/vllm/.venv/bin/python", "benchmarks/peers/lookup_keys_vllm.py",
                                                  *(argv if argv is not None else sys.argv[1:])]))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for label in ("names", "hashed"):
            o = out[label]
            print(f"{label:7s} lookups {o['lookups']:,}  median {o['median_us']:.1f} us  mean {o['mean_us']:.1f} us"
                  f"  (rounds {o['per_round_median_us']})  pages named {o['tree_named_pages']:,}")
        print(f"names / hashed: median {out['ratio_median']:.3f}x, mean {out['ratio_mean']:.3f}x; "
              f"rows identical: {out['rows_identical']}; hit tokens {out['hit_tokens']:,}")
    return 0 if out["rows_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
