"""Merge ``in_engine.sh --tiers --details FILE`` runs into one result file.

The tier comparison is long (a HiCache run per ratio, write policy and size), so it
is run in parts (``--sizes``, ``--systems``, ``--ratios``, ``--hicache-write-policies``,
one trace at a time); this puts the parts together the way one run would have:
per trace and size, every run by system name (a later input replaces an earlier
run of the same name), ``hicache_default`` (ratio 0.8, write-through) and
``hicache_best`` (the most hit tokens among the runs that rejected no request, or
among all when every run rejected some; ties to the ratio nearest 0.8) recomputed
over the merged sweep.

    python benchmarks/peers/merge_tiers.py OUT.json IN.json [IN.json ...] \\
        --provenance PROVENANCE.json

An input is a ``--details`` file or an earlier merged file (its ``traces``);
``--provenance`` is the ``provenance`` object written into OUT (its ``depends``
list is kept from OUT when it exists and the given object has none).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "adapters" / "sglang" / "tests"))
import hicache_pick  # noqa: E402 - the harness's own rule (pure, no SGLang)

DERIVED = ("hicache_default", "hicache_best")


def _parts(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(trace name, {limit, page_size, host_factor, sizes, runs}) of one input."""
    if "traces" in doc:
        return list(doc["traces"].items())
    return [(Path(doc["trace"]).name, doc)]


def merge(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    traces: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for name, part in _parts(doc):
            t = traces.setdefault(name, {"limit": part["limit"], "page_size": part["page_size"],
                                         "host_factor": part["host_factor"], "sizes": {}, "runs": {}})
            for key in ("limit", "page_size", "host_factor"):
                if t[key] != part[key]:
                    raise ValueError(f"{name}: inputs disagree on {key} ({t[key]} vs {part[key]})")
            t["sizes"].update(part["sizes"])
            for r in part["runs"]:
                if r["system"] not in DERIVED:
                    # runs from before the write-policy sweep were all write-through
                    r = {**r, "setting": {"write_policy": "write_through", **r["setting"]}}
                    t["runs"][(r["size"], r["system"])] = r
    out = {}
    for name, t in traces.items():
        runs = list(t["runs"].values())
        for size in sorted({r["size"] for r in runs}):
            sweep = [r for r in runs if r["size"] == size and r["system"].startswith("hicache@")]
            for system, i in (("hicache_default", hicache_pick.default_index(sweep)),
                              ("hicache_best", hicache_pick.best_index(sweep))):
                if i is not None:
                    runs.append({**sweep[i], "system": system})
        out[name] = {**{k: t[k] for k in ("limit", "page_size", "host_factor", "sizes")}, "runs": runs}
    return out


def failures(docs: list[dict[str, Any]]) -> dict[str, str]:
    """``{"<trace> <size> <system>": error}`` of the HiCache runs that failed and
    that no input ran since."""
    ran = {(name, r["size"], r["system"]) for doc in docs for name, part in _parts(doc) for r in part["runs"]}
    return {f"{name} {f['size']} {f['system']}":
            f"SGLang's HiCache as {f['system']} on {name} at the {f['size']} size: the harness's check of "
            f"SGLang's pool accounting (busy-time conservation, after every step) failed ({f['error']})"
            for doc in docs for name, part in _parts(doc)
            for f in part.get("failed", []) if (name, f["size"], f["system"]) not in ran}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    ap.add_argument("--provenance", type=Path, required=True)
    ap.add_argument("--not-run", type=Path, help="JSON object {trace: why} of what was not run")
    args = ap.parse_args(argv)
    prov = json.loads(args.provenance.read_text())
    if "depends" not in prov and args.out.exists():
        prov["depends"] = json.loads(args.out.read_text())["provenance"]["depends"]
    docs = [json.loads(p.read_text()) for p in args.inputs]
    not_run = json.loads(args.not_run.read_text()) if args.not_run else {}
    result = {"traces": merge(docs), "not_run": {**not_run, **failures(docs)}, "provenance": prov}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
