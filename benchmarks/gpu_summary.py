"""Summarise a GPU check (``src_cuda/device_check.sh``) into ``summary.json`` and one table.

Reads the files the check wrote to DIR (suite.txt, transfer_bench.json,
arena_check.json, gpu_layerwise.json, reference_layerwise.json,
sanitizer.txt, env.txt) and writes DIR/summary.json::

    {"device", "date", "python", "suites": {"passed", "failed"},
     "copy_vs_memcpy": {"h2d", "d2h", "d2d"}, "layerwise": [<gpu_layerwise runs>],
     "reference_agreement": [...], "arena_ok", "sanitizer_errors", "targets": {...}}

A file that is missing or unreadable gives nulls, never a crash.  Exit code 1
when a suite failed or the sanitizer found errors.

    python benchmarks/gpu_summary.py DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

# Targets of the GPU data path (H200): overlap at 16k+ and at 4k, copies vs memcpy.
TARGETS = {"overlap_16k_plus": 1.10, "overlap_4k": 1.25, "h2d_d2h_16k_plus": 0.95,
           "load_4k": 0.6, "d2d": 0.85, "host_us_per_layer": 15.0}


def _json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def suite_counts(text: str) -> dict[str, Optional[int]]:
    """``passed`` / ``failed`` from pytest's closing line (errors count as failed)."""
    out: dict[str, Optional[int]] = {"passed": None, "failed": None, "skipped": None}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    if not lines:
        return out
    last = lines[-1]
    for key in ("passed", "failed", "errors?", "skipped"):
        m = re.search(rf"(\d+) {key}\b", last)
        name = key.rstrip("s?") if key.startswith("error") else key
        if m:
            out[name] = int(m.group(1))
    out["passed"] = out["passed"] or 0
    out["skipped"] = out.get("skipped") or 0
    out["failed"] = (out["failed"] or 0) + (out.pop("error", None) or 0)
    return out


def sanitizer_errors(text: str) -> Optional[int]:
    """Sum of compute-sanitizer's ``ERROR SUMMARY: N errors`` lines."""
    found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    return sum(int(n) for n in found) if found else None


def agreement(ours: list[dict], ref: Optional[dict]) -> list[dict]:
    """Per prefix size, our overlap / load figures against the reference's."""
    if not ref:
        return []
    by_size = {r["prefix_tokens"]: r for r in ref.get("runs", [])}
    out = []
    for r in ours:
        other = by_size.get(r["prefix_tokens"])
        if other is None or r.get("overlap_ratio") is None:
            continue
        row = {"prefix_tokens": r["prefix_tokens"]}
        for key in ("overlap_ratio", "load_vs_memcpy"):
            a, b = r[key], other.get(key)
            row[key] = {"ours": a, "reference": b,
                        "within_10pct": None if not b else abs(a - b) / b <= 0.10}
        out.append(row)
    return out


def summarise(d: Path) -> dict[str, Any]:
    env = (d / "env.txt").read_text() if (d / "env.txt").is_file() else ""
    py = re.search(r"python (\S+)", env)
    bench = _json(d / "transfer_bench.json") or {}
    layer = _json(d / "gpu_layerwise.json") or {}
    arena = _json(d / "arena_check.json")
    suite = (d / "suite.txt").read_text() if (d / "suite.txt").is_file() else ""
    san = (d / "sanitizer.txt").read_text() if (d / "sanitizer.txt").is_file() else ""
    runs = layer.get("runs", [])
    return {
        "device": layer.get("device") or bench.get("cuda_device"),
        "date": layer.get("date"),
        "python": py.group(1) if py else None,
        "suites": suite_counts(suite),
        "copy_vs_memcpy": {k: bench.get(f"cuda_{k}_ratio_vs_memcpy") for k in ("h2d", "d2h", "d2d")},
        "copy_paths": {k: bench.get(f"cuda_{k}_path") for k in ("h2d", "d2h", "d2d")},
        "layerwise": runs,
        "concurrency": layer.get("concurrency"),
        "reference_agreement": agreement(runs, _json(d / "reference_layerwise.json")),
        "arena_ok": None if arena is None else arena.get("ok", arena.get("all_ok")),
        "sanitizer_errors": sanitizer_errors(san),
        "targets": TARGETS,
    }


def table(s: dict[str, Any]) -> str:
    f = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = [f"GPU check: {s['device']}, python {s['python']}, {s['date']}",
             f"  suites: {s['suites']['passed']} passed, {s['suites']['failed']} failed; "
             f"sanitizer errors: {f(s['sanitizer_errors'])}; arena ok: {f(s['arena_ok'])}",
             "  copy vs cudaMemcpy: " + ", ".join(f"{k} {f(v)}" for k, v in s["copy_vs_memcpy"].items()),
             "  prefix  overlap  serial  load/memcpy  host us/layer"]
    for r in s["layerwise"]:
        lines.append(f"  {r['prefix_tokens']:>6}  {f(r.get('overlap_ratio')):>7}  "
                     f"{f(r.get('serial_ratio')):>6}  {f(r.get('load_vs_memcpy')):>11}  "
                     f"{f(r.get('host_us_per_layer')):>13}")
    if s.get("concurrency"):
        lines.append("  copy beside matmul: " + ", ".join(
            f"{k} {f(v)}" for k, v in s["concurrency"].items()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    d = Path(argv[0])
    s = summarise(d)
    (d / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    print(table(s))
    bad = (s["suites"]["failed"] or 0) > 0 or (s["sanitizer_errors"] or 0) > 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
