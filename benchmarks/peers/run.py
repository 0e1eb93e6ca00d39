"""Side-by-side replay: hybridkv, SGLang 0.5.23 / 0.5.20, vLLM 0.32 and the naive pool.

The token sequences are materialised once here (``TokenMaterializer``, the
partial-block extension rule on unless ``--no-extension-rule``), written to a
memory-mapped folder, and every driver replays exactly those tokens in its
own interpreter (each peer lives in its own venv).  Every system gets the
same byte budget for the same model preset; see ``README.md`` beside this
file for how each peer's pools are sized from it.

    python run.py [--trace PATH] [--limit N] [--max-sessions N] [--budgets 59,594] [--json]
                  [--systems hybridkv,hybridkv-no-ckpt,naive,sglang-0.5.23,sglang-0.5.20,vllm-0.32]
                  [--peer-settings sweep|default] [--vllm-retention 0,4096,16384,none]
                  [--sglang-ratios 0.05,0.1,0.2,0.4,0.6,0.8,1.0]
                  [--python-sglang0523 PY] [--python-sglang0520 PY] [--python-vllm PY]

Each peer runs with its own prefix-cache knob: vLLM's
``prefix_cache_retention_interval`` (its server default ``0``) and SGLang's
``swa_full_tokens_ratio`` (default ``0.8``).  By default (``--peer-settings
sweep``) every listed value is replayed, the default one always among them,
each from fresh state; ``--peer-settings default`` replays the defaults only.
Every row carries ``"settings"`` and ``"default"``; after the run, the row
with the most hit tokens of each (peer, budget) gets ``"best": true`` (a tie
goes to the default setting, then to the earlier one), so "best" is chosen
with hindsight on this very trace.  ``"comparison"`` holds, per budget and
peer, hybridkv's hit rate over the default-configured and the
best-configured peer's.

Without ``--json`` it prints two markdown tables (every row, then the
comparison); with it, ONE JSON object
``{"results": [{"system", "budget_gb", "settings", "default", "best", "token_hit_rate", ...}],
"comparison": [...], ...}``.
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

from common import (
    SGLANG_RATIO_DEFAULT,
    SGLANG_RATIO_SWEEP,
    VLLM_RETENTION_DEFAULT,
    VLLM_RETENTION_SWEEP,
    format_retention,
    parse_ratios,
    parse_retention,
    save_sequences,
)

HYBRIDKV_SYSTEMS = ("hybridkv", "hybridkv-no-ckpt", "naive")
PEERS = {  # system -> (driver, interpreter option, extra driver args)
    "sglang-0.5.23": ("drive_sglang.py", "python_sglang0523", ["--flavour", "unified"]),
    "sglang-0.5.20": ("drive_sglang.py", "python_sglang0520", ["--flavour", "swa-radix"]),
    "vllm-0.32": ("drive_vllm.py", "python_vllm", []),
}
ALL = HYBRIDKV_SYSTEMS + tuple(PEERS)


PEER_SETTINGS_MODES = ("sweep", "default")


def materialize(trace: str | None, limit: int | None, model: str, page: int, extension_rule: bool,
                out: Path, ident: dict[str, Any], max_sessions: int | None = None) -> dict[str, Any]:
    """Token sequences of ``trace`` (default: the shared Mooncake trace) into
    ``out`` (files written there); ``max_sessions`` keeps the first N session
    files of a kv-cache-tester folder."""
    from hybridkv.spec import ModelSpec
    from hybridkv.eval.traces import (
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
    reqs = load_trace(path, limit=limit, max_sessions=max_sessions)
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
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rows = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        return rows, f"timed out after {timeout:.0f} s ({len(rows)} setting(s) finished)"
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return rows, f"driver exited {proc.returncode}: {' | '.join(tail)}"
    return rows, None


def family(system: str) -> str:
    """``"vllm"`` or ``"sglang"``: which knob a peer system takes."""
    if system not in PEERS:
        raise ValueError(f"system {system!r} is not a peer ({', '.join(PEERS)})")
    return system.split("-")[0]


def with_default(values: list[Any], default: Any) -> list[Any]:
    """``values`` with ``default`` first if it is missing (a new list)."""
    return list(values) if default in values else [default, *values]


def peer_settings(mode: str, retention: list[int | None], ratios: list[float]) -> dict[str, list[Any]]:
    """The settings each peer family replays: only its default under
    ``mode="default"``, else the given sweep with the default always in it."""
    if mode not in PEER_SETTINGS_MODES:
        raise ValueError(f"peer settings mode must be one of {PEER_SETTINGS_MODES}, got {mode!r}")
    if mode == "default":
        return {"vllm": [VLLM_RETENTION_DEFAULT], "sglang": [SGLANG_RATIO_DEFAULT]}
    return {"vllm": with_default(retention, VLLM_RETENTION_DEFAULT),
            "sglang": with_default(ratios, SGLANG_RATIO_DEFAULT)}


def settings_args(fam: str, values: list[Any]) -> list[str]:
    """Driver command-line arguments selecting ``values`` for family ``fam``."""
    if fam == "vllm":
        return ["--retention", format_retention(values)]
    if fam == "sglang":
        return ["--ratios", ",".join(f"{v:g}" for v in values)]
    raise ValueError(f"family must be 'vllm' or 'sglang', got {fam!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of :func:`main`; errors exit through ``argparse`` naming the option.
    Adds ``systems_list``, ``budgets_str`` and ``settings`` (from :func:`peer_settings`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="trace file or folder (default: shared Mooncake trace)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--max-sessions", type=int, default=None, help="first N session files of a trace folder")
    p.add_argument("--budgets", default="594", help="comma-separated budgets in GB (default 594)")
    p.add_argument("--model", default="mimo-v2.5-pro")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size (all systems)")
    p.add_argument("--systems", default=",".join(ALL))
    p.add_argument("--peer-settings", choices=PEER_SETTINGS_MODES, default="sweep",
                   help="sweep each peer's knob (default) or run its default setting only")
    p.add_argument("--vllm-retention", default=format_retention(VLLM_RETENTION_SWEEP),
                   help="prefix_cache_retention_interval values to sweep ('none' = dense)")
    p.add_argument("--sglang-ratios", default=",".join(f"{r:g}" for r in SGLANG_RATIO_SWEEP),
                   help="swa_full_tokens_ratio values to sweep")
    p.add_argument("--no-extension-rule", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per driver and setting")
    p.add_argument("--sequences", default=None, help="reuse/keep the sequence folder here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    for opt in ("python_sglang0523", "python_sglang0520", "python_vllm"):
        p.add_argument("--" + opt.replace("_", "-"), dest=opt, default=os.environ.get(opt.upper()),
                       help=f"interpreter of that peer's venv (env {opt.upper()})")
    args = p.parse_args(argv)
    args.systems_list = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems_list if s not in ALL]
    if bad or not args.systems_list:
        p.error(f"--systems: unknown {bad or 'empty list'}; choose from {', '.join(ALL)}")
    for opt in ("limit", "max_sessions"):
        if getattr(args, opt) is not None and getattr(args, opt) < 1:
            p.error(f"--{opt.replace('_', '-')} must be >= 1")
    try:
        args.budgets_str = ",".join(str(float(x)) for x in args.budgets.split(",") if x.strip())
        retention = parse_retention(args.vllm_retention, "--vllm-retention")
        ratios = parse_ratios(args.sglang_ratios, "--sglang-ratios")
    except ValueError as e:
        p.error(str(e))
    if not args.budgets_str or min(float(x) for x in args.budgets_str.split(",")) <= 0:
        p.error("--budgets needs positive numbers")
    args.settings = peer_settings(args.peer_settings, retention, ratios)
    return args


def _sequences(args: argparse.Namespace, seq_dir: Path) -> dict[str, Any]:
    """The token sequences in ``seq_dir``, materialised unless already there for the same replay."""
    t0 = time.perf_counter()
    want = {"source": args.trace or "default", "limit": args.limit,
            "max_sessions": args.max_sessions, "model": args.model, "page_size": args.page_size,
            "extension_rule": "off" if args.no_extension_rule else "on"}
    meta = json.loads((seq_dir / "meta.json").read_text()) if (seq_dir / "meta.json").exists() else {}
    meta.pop("namespaces", None)
    if any(meta.get(k) != v for k, v in want.items()):  # absent or made for another replay
        meta = materialize(args.trace, args.limit, args.model, args.page_size, not args.no_extension_rule,
                           seq_dir, want, args.max_sessions)
    meta["materialize_s"] = time.perf_counter() - t0
    return meta


def _jobs(args: argparse.Namespace, skipped: dict[str, str]) -> list[tuple[str, str, str, list[str], int]]:
    """(system, interpreter, driver, extra args, settings count) per system to run;
    peers without an interpreter go into ``skipped`` (mutated)."""
    jobs = []
    for s in args.systems_list:
        if s in HYBRIDKV_SYSTEMS:
            jobs.append((s, sys.executable, "drive_hybridkv.py", ["--systems", s], 1))
            continue
        driver, opt, extra = PEERS[s]
        py = getattr(args, opt)
        if not py:
            skipped[s] = f"no interpreter (--{opt.replace('_', '-')} or ${opt.upper()})"
            continue
        values = args.settings[family(s)]
        jobs.append((s, py, driver, extra + settings_args(family(s), values), len(values)))
    return jobs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = None
    if args.sequences:
        seq_dir = Path(args.sequences)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="hybridkv-peers-")
        seq_dir = Path(tmp.name)
    meta = _sequences(args, seq_dir)
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    # One process per (system, budget), one at a time: timings must not share
    # the cores.  A peer's settings share that process (imports paid once),
    # each on fresh pools and a fresh tree.
    for name, py, driver, extra, n_settings in _jobs(args, skipped):
        for gb in args.budgets_str.split(","):
            print(f"[peers] {name} at {float(gb):g} GB ({n_settings} setting(s)) ...", file=sys.stderr, flush=True)
            rows, err = _drive(py, driver, seq_dir, gb, args.chunk, extra, args.timeout * n_settings)
            results.extend(rows)
            if err:
                skipped[f"{name}@{float(gb):g}GB"] = err
    if tmp is not None:
        tmp.cleanup()
    out = summarize({"trace": meta["trace"], "meta": meta, "results": results, "skipped": skipped,
                     "peer_settings": {"mode": args.peer_settings, **args.settings}})
    print(json.dumps(out) if args.json else table(out))
    return 0


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Marks best rows, adds per-row ratios and ``out["comparison"]``; returns ``out`` (mutated)."""
    for r in out["results"]:  # rows of older outputs predate the settings fields
        r.setdefault("settings", {})
        r.setdefault("default", True)
    mark_best(out["results"])
    _ratios(out["results"])
    out["comparison"] = compare(out["results"])
    return out


def mark_best(results: list[dict[str, Any]]) -> None:
    """Sets ``"best"`` on every peer row (mutated): True on the row with the
    most hit tokens of its (system, budget); a tie goes to the default row,
    then to the earliest."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in results:
        if r["system"] in PEERS:
            groups.setdefault((r["system"], float(r["budget_gb"])), []).append(r)
    for rows in groups.values():
        best = max(rows, key=lambda r: (r["hit_tokens"], bool(r.get("default"))))  # max keeps the first
        for r in rows:
            r["best"] = r is best


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget and peer system: hybridkv's hit rate over the peer's at its
    default setting and at its best (needs :func:`mark_best` first)."""
    out = []
    budgets = sorted({float(r["budget_gb"]) for r in results})
    for gb in budgets:
        here = [r for r in results if float(r["budget_gb"]) == gb]
        h = next((r for r in here if r["system"] == "hybridkv"), None)
        hit = h["token_hit_rate"] if h else None
        for peer in PEERS:
            rows = [r for r in here if r["system"] == peer]
            if not rows:
                continue
            d = next((r for r in rows if r.get("default")), None)
            b = next(r for r in rows if r.get("best"))
            out.append({"budget_gb": gb, "peer": peer, "settings_swept": [r["settings"] for r in rows],
                        "hybridkv_hit_rate": hit,
                        "default_settings": d["settings"] if d else None,
                        "default_hit_rate": d["token_hit_rate"] if d else None,
                        "best_settings": b["settings"], "best_hit_rate": b["token_hit_rate"],
                        "hybridkv_vs_default": _ratio(hit, d["token_hit_rate"] if d else None),
                        "hybridkv_vs_best": _ratio(hit, b["token_hit_rate"])})
    return out


def _ratios(results: list[dict[str, Any]]) -> None:
    """Same-run ratios against hybridkv at the same budget (hit rate and op latency), set on each row."""
    ref = {r["budget_gb"]: r for r in results if r["system"] == "hybridkv"}
    for r in results:
        h = ref.get(r["budget_gb"])
        if h is None or r is h:
            continue
        r["hybridkv_hit_rate_ratio"] = h["token_hit_rate"] / r["token_hit_rate"] if r["token_hit_rate"] else None
        r["op_p50_ratio_vs_hybridkv"] = r["op_us_p50"] / h["op_us_p50"] if h["op_us_p50"] else None
        r["op_p99_ratio_vs_hybridkv"] = r["op_us_p99"] / h["op_us_p99"] if h["op_us_p99"] else None


_SHORT = {"prefix_cache_retention_interval": "retention", "swa_full_tokens_ratio": "ratio",
          "swa_checkpoint": "checkpoint"}


def settings_label(settings: dict[str, Any] | None) -> str:
    """``{"prefix_cache_retention_interval": None}`` -> ``"retention none"``."""
    if not settings:
        return "-"
    parts = []
    for k, v in settings.items():
        shown = "none" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
        parts.append(f"{_SHORT.get(k, k)} {shown}")
    return ", ".join(parts)


def _marks(r: dict[str, Any]) -> str:
    if r["system"] not in PEERS:
        return ""
    return ", ".join(m for m, on in (("default", r.get("default")), ("best", r.get("best"))) if on)


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted (``"x"`` appended for ratios, ``spec`` ``".2f"``), or ``"n/a"``."""
    if x is None:
        return "n/a"
    return format(x, spec) + ("x" if spec == ".2f" else "")


def table(out: dict[str, Any]) -> str:
    """Markdown: every row of ``out["results"]``, then ``out["comparison"]``."""
    m = out["meta"]
    head = (f"Trace `{m['trace']}`: {m['requests']:,} requests, {m['input_tokens']:,} input tokens, "
            f"model {m['model']}, page {m['page_size']}, extension rule {m['extension_rule']}, "
            f"prefix bound {m['prefix_bound_hit_rate']:.2%}.")
    cols = ("| system | setting | | budget GB | token hit rate | prefill tokens saved | op p50 us | op p99 us "
            "| op excl. alloc kernel p50/p99 us | match p50/p99 us | alloc+evict p50/p99 us "
            "| insert+free p50/p99 us | peak metadata MB | replay s |")
    lines = [head, "", cols, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(out["results"], key=lambda r: (r["budget_gb"], ALL.index(r["system"]))):
        lines.append(
            f"| {r['system']} | {settings_label(r.get('settings'))} | {_marks(r)} | {r['budget_gb']:g} "
            f"| {r['token_hit_rate']:.2%} | {r['prefill_tokens_saved']:,} "
            f"| {r['op_us_p50']:.0f} | {r['op_us_p99']:.0f} | {r['op_excl_kernel_us_p50']:.0f} / "
            f"{r['op_excl_kernel_us_p99']:.0f} | {r['match_us_p50']:.0f} / {r['match_us_p99']:.0f} "
            f"| {r['alloc_us_p50']:.0f} / {r['alloc_us_p99']:.0f} | {r['insert_us_p50']:.0f} / "
            f"{r['insert_us_p99']:.0f} | {r['peak_metadata_mb']:.0f} | {r['replay_s']:.1f} |")
    lines += ["", comparison_table(out.get("comparison") or compare(out["results"]))]
    for s, why in out.get("skipped", {}).items():
        lines.append(f"\nSkipped {s}: {why}")
    return "\n".join(lines)


def comparison_table(comparison: list[dict[str, Any]]) -> str:
    """Markdown: per budget and peer, its default and best setting against hybridkv
    (best = most hit tokens among the settings swept, picked after the run)."""
    lines = ["| budget GB | peer | default setting | peer hit rate (default) | best setting "
             "| peer hit rate (best) | hybridkv hit rate | hybridkv / default | hybridkv / best |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in comparison:
        lines.append(
            f"| {c['budget_gb']:g} | {c['peer']} | {settings_label(c['default_settings'])} "
            f"| {_fmt(c['default_hit_rate'], '.2%')} | {settings_label(c['best_settings'])} "
            f"| {c['best_hit_rate']:.2%} | {_fmt(c['hybridkv_hit_rate'], '.2%')} "
            f"| {_fmt(c['hybridkv_vs_default'], '.2f')} | {_fmt(c['hybridkv_vs_best'], '.2f')} |")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
