"""Hit rate vs budget across all systems: a PNG plot and a markdown table.

    python sweep.py --budgets 30,59,150,594 [--limit N] [--trace PATH] [--out DIR]
    python sweep.py --from a.json b.json --out DIR     # render earlier run.sh --json outputs

Runs ``run.sh --json`` (which creates the peers' venvs as needed), merges the
results, and writes ``DIR/results.json``, ``DIR/results.md`` (the table, with
same-run ratios against hybridkv) and ``DIR/hit_rate_vs_budget.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import ALL, PEERS, settings_label, summarize, table


def merge(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result set from several run.py outputs of the same trace (later ones
    win per system, setting and budget); best rows and ratios are recomputed
    over the merged rows."""
    if not outs:
        raise ValueError("nothing to merge")
    traces = {(o["trace"], o["meta"].get("requests")) for o in outs}
    if len(traces) > 1:
        raise ValueError(f"outs are runs of different traces or lengths: {sorted(traces, key=str)}")
    rows: dict[tuple[str, str, float], dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for o in outs:
        for r in o["results"]:
            key = (r["system"], json.dumps(r.get("settings", {}), sort_keys=True), float(r["budget_gb"]))
            rows[key] = dict(r)
        skipped.update(o.get("skipped", {}))
    # a system skipped in one run but measured in another is not skipped
    done = {f"{s}@{gb:g}GB" for s, _, gb in rows}
    skipped = {k: v for k, v in skipped.items() if k not in done}
    return summarize({"trace": outs[-1]["trace"], "meta": outs[-1]["meta"], "results": list(rows.values()),
                      "skipped": skipped})


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"hybridkv": "o-", "hybridkv-no-ckpt": "o:", "naive": "x--"}
    for system in ALL:
        for which in (("default", "best") if system in PEERS else ("default",)):
            pts = sorted((r["budget_gb"], r["token_hit_rate"], settings_label(r.get("settings")))
                         for r in out["results"] if r["system"] == system and r.get(which))
            if not pts:
                continue
            label = system if system not in PEERS else f"{system} ({which} setting)"
            style = styles.get(system, "s--" if which == "default" else "^-")
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, label=label)
            if system in PEERS and which == "best":
                for x, y, name in pts:
                    ax.annotate(name, (x, 100 * y), fontsize=6, textcoords="offset points", xytext=(4, 4))
    bound = out["meta"].get("prefix_bound_hit_rate")
    if bound:
        ax.axhline(100 * bound, color="gray", ls=":", label="unlimited prefix cache")
    ax.set_xscale("log")
    ax.set_xlabel("KV budget (GB, same bytes for every system)")
    ax.set_ylabel("token hit rate (%)")
    m = out["meta"]
    ax.set_title(f"{m['model']}, {m['trace']} ({m['requests']:,} requests)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="30,59,150,594")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--trace", default=None)
    p.add_argument("--systems", default=None)
    p.add_argument("--max-sessions", default=None)
    p.add_argument("--peer-settings", default=None, choices=("sweep", "default"))
    p.add_argument("--vllm-retention", default=None)
    p.add_argument("--sglang-ratios", default=None)
    p.add_argument("--from", dest="sources", nargs="+", default=None, help="run.sh --json outputs to render")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--note", default=None, help="a line put first in results.md (e.g. the command that made the inputs)")
    args = p.parse_args(argv)
    if args.sources:
        outs = [json.loads(Path(f).read_text()) for f in args.sources]
    else:
        cmd = ["bash", str(HERE / "run.sh"), "--json", "--budgets", args.budgets]
        for opt in ("limit", "trace", "systems", "max_sessions", "peer_settings", "vllm_retention",
                    "sglang_ratios"):
            if getattr(args, opt) is not None:
                cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
        outs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)]
    out = merge(outs)
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "results.json").write_text(json.dumps(out, indent=1))
    md = (args.note + "\n\n" if args.note else "") + table(out) + "\n\n" + ratios(out) + "\n"
    (dest / "results.md").write_text(md)
    plot(out, dest / "hit_rate_vs_budget.png")
    print(md)
    return 0


def ratios(out: dict[str, Any]) -> str:
    """hybridkv's hit rate and per-request op latency against each system's
    default and best rows (and hybridkv's own variants), same run, same budget."""
    ref = {r["budget_gb"]: r for r in out["results"] if r["system"] == "hybridkv"}
    lines = [("| system | setting | budget GB | hybridkv hit rate / system's | system's op p50 / hybridkv's "
              "| system's op p50 excl. alloc kernel / hybridkv's |"), "|---|---|---|---|---|---|"]
    for r in sorted(out["results"], key=lambda r: (r["budget_gb"], ALL.index(r["system"]))):
        h = ref.get(r["budget_gb"])
        if h is None or r["system"] == "hybridkv" or (r["system"] in PEERS and not (r["default"] or r["best"])):
            continue
        hit = h["token_hit_rate"] / r["token_hit_rate"] if r["token_hit_rate"] else float("inf")
        which = ", ".join(m for m in ("default", "best") if r.get(m)) if r["system"] in PEERS else ""
        lines.append(f"| {r['system']} | {settings_label(r.get('settings'))} {f'({which})' if which else ''} "
                     f"| {r['budget_gb']:g} | {hit:.2f}x | {r['op_us_p50'] / h['op_us_p50']:.2f}x "
                     f"| {r['op_excl_kernel_us_p50'] / h['op_excl_kernel_us_p50']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
