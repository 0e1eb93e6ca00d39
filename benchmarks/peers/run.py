"""Side-by-side replay: hybridkv, SGLang 0.5.23 / 0.5.20, vLLM 0.32 and the naive pool.

The token sequences are materialised once here (``TokenMaterializer``, the
partial-block extension rule on unless ``--no-extension-rule``), written to a
memory-mapped folder, and every driver replays exactly those tokens in its
own interpreter (each peer lives in its own venv).  Every system gets the
same byte budget for the same model preset; see ``README.md`` beside this
file for how each peer's pools are sized from it.

    python run.py [--trace PATH] [--limit N] [--budgets 59,594] [--json]
                  [--systems hybridkv,hybridkv-no-ckpt,naive,sglang-0.5.23,sglang-0.5.20,vllm-0.32]
                  [--python-sglang0523 PY] [--python-sglang0520 PY] [--python-vllm PY]

Without ``--json`` it prints a table; with it, ONE JSON object
``{"results": [{"system", "budget_gb", "token_hit_rate", "op_us_p50", "op_us_p99", ...}], ...}``.
A system whose interpreter is not given (or whose driver fails) is reported
under ``"skipped"`` with the reason, never silently dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import save_sequences

HYBRIDKV_SYSTEMS = ("hybridkv", "hybridkv-no-ckpt", "naive")
PEERS = {  # system -> (driver, interpreter option, extra driver args)
    "sglang-0.5.23": ("drive_sglang.py", "python_sglang0523", ["--flavour", "unified"]),
    "sglang-0.5.20": ("drive_sglang.py", "python_sglang0520", ["--flavour", "swa-radix"]),
    "vllm-0.32": ("drive_vllm.py", "python_vllm", []),
}
ALL = HYBRIDKV_SYSTEMS + tuple(PEERS)


def materialize(trace: str | None, limit: int | None, model: str, page: int, extension_rule: bool,
                out: Path, ident: dict[str, Any]) -> dict[str, Any]:
    """Token sequences of ``trace`` (default: the shared Mooncake trace) into ``out``."""
    from hybridkv.spec import ModelSpec
    from hybridkv.traces import (
        PrefixBound,
        TokenMaterializer,
        bundled_sample,
        default_shared_traces,
        load_trace,
    )

    if trace is None:
        shared = default_shared_traces()
        path = shared / "mooncake_conversation_trace.jsonl" if shared else bundled_sample()
    else:
        path = Path(trace)
    reqs = load_trace(path, limit=limit)
    spec = ModelSpec.preset(model, page_size=page)
    mat = TokenMaterializer(extension_rule=extension_rule)
    bound = PrefixBound(page)
    seqs, names, bound_hits = [], [], 0
    for r in reqs:
        t = mat.tokens(r)
        if len(t) == 0:
            continue
        bound_hits += bound.hits(t, r.namespace, len(t) - 1)
        seqs.append(t)
        names.append(r.namespace)
    total = sum(len(s) for s in seqs)
    meta = {**ident, "trace": path.name, "requests": len(seqs), "input_tokens": total,
            "extension_rule": "on" if extension_rule else "off", "model": spec.name, "page_size": page,
            "window": spec.window, "full_bpt": spec.bytes_per_token_full, "swa_bpt": spec.bytes_per_token_swa,
            "full_layers": len(spec.full_layers), "swa_layers": len(spec.swa_layers),
            "prefix_bound_hit_rate": bound_hits / max(1, total)}
    save_sequences(out, seqs, names, meta)
    return meta


def _drive(python: str, driver: str, seq_dir: Path, budgets: str, chunk: int, extra: list[str],
           timeout: float) -> tuple[list[dict[str, Any]], str | None]:
    cmd = [python, str(HERE / driver), str(seq_dir), "--budgets", budgets, "--chunk", str(chunk), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout:.0f} s"
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return rows, f"driver exited {proc.returncode}: {' | '.join(tail)}"
    return rows, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="trace file or folder (default: shared Mooncake trace)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--budgets", default="594", help="comma-separated budgets in GB (default 594)")
    p.add_argument("--model", default="mimo-v2.5-pro")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size (all systems)")
    p.add_argument("--systems", default=",".join(ALL))
    p.add_argument("--no-extension-rule", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per driver")
    p.add_argument("--sequences", default=None, help="reuse/keep the sequence folder here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    for opt in ("python_sglang0523", "python_sglang0520", "python_vllm"):
        p.add_argument("--" + opt.replace("_", "-"), dest=opt, default=os.environ.get(opt.upper()),
                       help=f"interpreter of that peer's venv (env {opt.upper()})")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in ALL]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from {', '.join(ALL)}")
    budgets = ",".join(str(float(x)) for x in args.budgets.split(",") if x.strip())

    tmp = None
    if args.sequences:
        seq_dir = Path(args.sequences)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="hybridkv-peers-")
        seq_dir = Path(tmp.name)
    t0 = time.perf_counter()
    want = {"source": str(Path(args.trace).resolve()) if args.trace else "default", "limit": args.limit,
            "model": args.model, "page_size": args.page_size,
            "extension_rule": "off" if args.no_extension_rule else "on"}
    meta = json.loads((seq_dir / "meta.json").read_text()) if (seq_dir / "meta.json").exists() else {}
    meta.pop("namespaces", None)
    if any(meta.get(k) != v for k, v in want.items()):  # absent or made for another replay
        meta = materialize(args.trace, args.limit, args.model, args.page_size, not args.no_extension_rule,
                           seq_dir, want)
    meta["materialize_s"] = time.perf_counter() - t0
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    mine = [s for s in systems if s in HYBRIDKV_SYSTEMS]
    jobs: list[tuple[list[str], str, str, list[str]]] = []
    if mine:
        jobs.append((mine, sys.executable, "drive_hybridkv.py", ["--systems", ",".join(mine)]))
    for s in systems:
        if s in PEERS:
            driver, opt, extra = PEERS[s]
            py = getattr(args, opt)
            if not py:
                skipped[s] = f"no interpreter (--{opt.replace('_', '-')} or ${opt.upper()})"
                continue
            jobs.append(([s], py, driver, extra))
    # One process per (system, budget), one at a time: timings must not share
    # the cores, and each peak-RSS figure must be that system's alone.
    for names, py, driver, extra in jobs:
        for name in names:
            args_n = extra if driver != "drive_hybridkv.py" else ["--systems", name]
            for gb in budgets.split(","):
                if not args.json:
                    print(f"[peers] {name} at {float(gb):g} GB ...", file=sys.stderr, flush=True)
                rows, err = _drive(py, driver, seq_dir, gb, args.chunk, args_n, args.timeout)
                results.extend(rows)
                if err:
                    skipped[f"{name}@{float(gb):g}GB"] = err
    if tmp is not None:
        tmp.cleanup()
    _ratios(results)
    out = {"trace": meta["trace"], "meta": meta, "results": results, "skipped": skipped}
    if args.json:
        print(json.dumps(out))
    else:
        print(table(out))
    return 0


def _ratios(results: list[dict[str, Any]]) -> None:
    """Same-run ratios against hybridkv at the same budget (hit rate and op latency)."""
    ref = {r["budget_gb"]: r for r in results if r["system"] == "hybridkv"}
    for r in results:
        h = ref.get(r["budget_gb"])
        if h is None or r is h:
            continue
        r["hybridkv_hit_rate_ratio"] = h["token_hit_rate"] / r["token_hit_rate"] if r["token_hit_rate"] else None
        r["op_p50_ratio_vs_hybridkv"] = r["op_us_p50"] / h["op_us_p50"] if h["op_us_p50"] else None
        r["op_p99_ratio_vs_hybridkv"] = r["op_us_p99"] / h["op_us_p99"] if h["op_us_p99"] else None


def table(out: dict[str, Any]) -> str:
    """A markdown table of ``out["results"]``."""
    m = out["meta"]
    head = (f"Trace `{m['trace']}`: {m['requests']:,} requests, {m['input_tokens']:,} input tokens, "
            f"model {m['model']}, page {m['page_size']}, extension rule {m['extension_rule']}, "
            f"prefix bound {m['prefix_bound_hit_rate']:.2%}.")
    cols = ("| system | budget GB | token hit rate | prefill tokens saved | op p50 us | op p99 us "
            "| op excl. alloc kernel p50/p99 us | match p50/p99 us | alloc+evict p50/p99 us "
            "| insert+free p50/p99 us | peak metadata MB | replay s |")
    lines = [head, "", cols,
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(out["results"], key=lambda r: (r["budget_gb"], ALL.index(r["system"]))):
        lines.append(
            f"| {r['system']} | {r['budget_gb']:g} | {r['token_hit_rate']:.2%} | {r['prefill_tokens_saved']:,} "
            f"| {r['op_us_p50']:.0f} | {r['op_us_p99']:.0f} | {r['op_excl_kernel_us_p50']:.0f} / "
            f"{r['op_excl_kernel_us_p99']:.0f} | {r['match_us_p50']:.0f} / {r['match_us_p99']:.0f} "
            f"| {r['alloc_us_p50']:.0f} / {r['alloc_us_p99']:.0f} | {r['insert_us_p50']:.0f} / "
            f"{r['insert_us_p99']:.0f} | {r['peak_metadata_mb']:.0f} | {r['replay_s']:.1f} |")
    for s, why in out.get("skipped", {}).items():
        lines.append(f"\nSkipped {s}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
