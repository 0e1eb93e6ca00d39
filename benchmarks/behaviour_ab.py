"""Behaviour of two checkouts of hybridkv on the same cases: every counter must match
(a counter only one of them has, e.g. a new one, is listed beside the verdict).

A redesign that claims "behaviour unchanged" is checked here, not by eye.  For
each checkout this script runs, in fresh processes with that checkout first on
``sys.path``:

- ``hybridkv replay`` of the conversation trace at 30 / 59 / 150 / 300 / 594 GB
  and of the kv-cache-tester sessions at 59 / 594 GB (hybridkv only, no
  references), recording the hit rate and every integer counter;
- the same replay at 59 GB with tiers (``--l2-gb 1 --l3 file://<fresh dir>``,
  the first 3,000 requests): L1 / L2 / L3 hit tokens, pages moved, backend
  counters;
- ``hybridkv verify`` plain and with ``--l2-gb 1 --l3 file://<fresh dir>``
  (mismatch count, prompts, hit tokens);
- a model with two sliding windows (``--hf-config configs/pro-two-window.json``:
  MiMo-V2.5-Pro's shapes, every other sliding layer at a 64-token window; the
  side group's path): the conversation replay (first 3,000 requests) at 30 and
  59 GB, and ``verify``.

It then prints one table: each case's hit rate for both checkouts and the
counters that differ (none, when behaviour is unchanged), and exits 1 if any
differ.

    git worktree add /tmp/base <commit>
    python benchmarks/behaviour_ab.py /tmp/base . [--jobs 2] [--json out.json]
    python benchmarks/behaviour_ab.py /tmp/base . --cases conv-59,verify   # a subset
    python benchmarks/behaviour_ab.py base.json .   # the baseline from an earlier --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
_CONV = str(_TRACES / "mooncake_conversation_trace.jsonl")
_WEKA = str(_TRACES / "weka")
_REPLAY = ["replay", "--systems", "hybridkv", "--no-references", "--no-progress", "--json"]


_TWO_WINDOWS = str(Path(__file__).resolve().parent / "configs" / "pro-two-window.json")


def _cases() -> dict[str, list[str]]:
    """Case name -> ``hybridkv`` arguments ({l3} is replaced by a fresh directory URL)."""
    cases = {f"conv-{gb}": [*_REPLAY, _CONV, "--budgets", str(gb)] for gb in (30, 59, 150, 300, 594)}
    cases.update({f"weka-{gb}": [*_REPLAY, _WEKA, "--budgets", str(gb)] for gb in (59, 594)})
    cases["tiers-59"] = [*_REPLAY, _CONV, "--budgets", "59", "--limit", "3000", "--l2-gb", "1", "--l3", "{l3}"]
    cases["verify"] = ["verify", "--json", "--no-progress"]
    cases["verify-tiers"] = ["verify", "--json", "--no-progress", "--l2-gb", "1", "--l3", "{l3}"]
    for gb in (30, 59):
        cases[f"two-windows-{gb}"] = [*_REPLAY, _CONV, "--budgets", str(gb), "--limit", "3000",
                                      "--hf-config", _TWO_WINDOWS]
    cases["verify-two-windows"] = ["verify", "--json", "--no-progress", "--hf-config", _TWO_WINDOWS]
    return cases


# Wall-clock figures and paths differ run to run; everything else must match.
_VOLATILE = ("_us", "elapsed", "_s_", "seconds", "trace", "bytes_per_cached", "time")


def _flatten(obj, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        key = prefix[:-1]
        if not any(m in key for m in _VOLATILE):
            out[key] = obj
    return out


def _run(root: str, name: str, argv: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [a.replace("{l3}", f"file://{tmp}/l3") for a in argv]
        env = dict(os.environ, PYTHONPATH=root)
        res = subprocess.run([sys.executable, "-m", "hybridkv", *argv], capture_output=True, text=True,
                             env=env, cwd=tmp)
    if res.returncode not in (0, 1) or not res.stdout.strip():
        raise RuntimeError(f"{name} in {root} failed (rc {res.returncode}): {res.stderr[-2000:]}")
    return _stable(_flatten(json.loads(res.stdout.replace(tmp, "{tmp}"))))


# L3 reads race the L3 write worker: a read-ahead of a key whose write has not
# landed yet is not issued (or misses), so these counts follow thread timing
# (two runs of one commit differ by thousands of pages); the hit tokens per
# tier they feed do not, and are compared.
_TIMED = ("l3_backend.hits", "l3_backend.misses", "l3_backend.bytes_read", "l3_manager.l3_reads",
          "l3_manager.l3_read_pages", "l3_manager.l3_read_hits", "l3_manager.l3_reads_skipped")
# The L3 record trusts an "absent" answer for ABSENT_TTL_S of wall clock, so how
# many keys it answers, probes and holds absent follows how fast the run went
# (two runs of one commit differ); the keys it knows present do not.
_TIMED_RECORD = tuple(f"l3_manager.l3_record_{k}" for k in
                      ("probes", "probed_keys", "probe_errors", "answered_keys", "lost_keys", "absent_keys"))


def _stable(flat: dict[str, object]) -> dict[str, object]:
    """The figures that must match.  L3 touches are rate limited by the wall
    clock (one per key per ``touch_interval_s``), so how requests split between
    ``l3_touches`` and ``l3_touches_skipped`` depends on how long the run took;
    their sum, the touches asked for, does not.  :data:`_TIMED` and
    :data:`_TIMED_RECORD` are left out."""
    for key in [k for k in flat if k.endswith("l3_touches")]:
        skipped = flat.pop(key + "_skipped", 0)
        flat[key + "_requested"] = flat.pop(key) + skipped  # type: ignore[operator]
    for key in [k for k in flat if k.endswith(_TIMED + _TIMED_RECORD)]:
        del flat[key]
    return flat


def _headline(flat: dict[str, object]) -> str:
    for key in ("token_hit_rate", "mismatched_requests"):
        if key in flat:
            v = flat[key]
            return f"{v:.4%}" if key == "token_hit_rate" else f"{v} mismatches"
    return "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs=2,
                    help="two checkouts (the first is the baseline, or a --json file of an earlier run)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--json", default=None, help="write both checkouts' flattened results here")
    args = ap.parse_args()
    cases = _cases()
    names = list(cases) if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in cases]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {', '.join(cases)}")
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    roots = [str(Path(c).resolve()) for c in args.checkouts]
    if roots[0] == roots[1]:
        ap.error("the two checkouts are the same folder (for a run-to-run check, add a second worktree)")
    by: dict[tuple[str, str], dict[str, object]] = {}
    if roots[0].endswith(".json"):
        saved = json.loads(Path(roots[0]).read_text())
        missing = [n for n in names if n not in saved]
        if missing:
            ap.error(f"{args.checkouts[0]} has no results for {missing}")
        by.update({(roots[0], n): saved[n]["new"] for n in names})
    jobs = [(root, n) for n in names for root in roots if (root, n) not in by]
    with ThreadPoolExecutor(args.jobs) as ex:
        results = list(ex.map(lambda j: _run(j[0], j[1], cases[j[1]]), jobs))
    by.update(zip(jobs, results))
    differ = 0
    base, new = roots
    for n in names:
        a, b = by[(base, n)], by[(new, n)]
        # a counter only one checkout has (added or removed) is listed, not compared
        diffs = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        only = ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(a.keys() ^ b.keys()))
        differ += bool(diffs)
        print(f"{n:14s} {_headline(a):>16s} {_headline(b):>16s}  "
              + ("same" if not diffs else "DIFFER: " + ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in diffs[:8]))
              + (f" (only in one checkout: {only})" if only else ""),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({n: {"base": by[(base, n)], "new": by[(new, n)]} for n in names},
                                              indent=1))
    print(f"{len(names) - differ} of {len(names)} cases identical")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
