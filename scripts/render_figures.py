"""Render every measured figure of README.md and docs/*.md from the committed result files.

    python scripts/render_figures.py            # rewrite the marked regions in place
    python scripts/render_figures.py --check    # exit 1 and name each page that differs
    python scripts/render_figures.py --rerun [FILE ...]   # rerun the quick result files at HEAD, then render

A page marks a rendered region with two HTML comments (invisible on GitHub and
in the built site)::

    <!-- figures:NAME -->
    ...whatever RENDERERS[NAME] returns; never edit by hand...
    <!-- /figures:NAME -->

Each renderer reads result files (JSON, under ``benchmarks/``) and returns the
markdown between the markers: a table or a paragraph, ending with a line that
names the result file, the commit it was measured at and its date.  To change a
figure, rerun the command the result file records, commit the new file, run this
script, commit the pages.  ``tests/core/test_figures.py`` fails when a page
differs from its rendered form, and when a result file is older than the code it
says it depends on (see :func:`stale`).

Every result file carries a ``"provenance"`` object:

``command``  the command that produced it (from the repository root);
``commit``   the commit it was measured at (the tree the command ran on);
``date``     when (UTC, ``YYYY-MM-DD``);
``depends``  git pathspecs of the code its figures depend on; a commit after
             ``commit`` that touches one of them makes the file stale;
``note``     optional: anything a reader should know (e.g. rows merged from
             several runs, provenance reconstructed from ``git log``);
``not_rerun_after``  optional: commits after ``commit`` that touch ``depends``
             but cannot change the figures, each ``{"commit", "why"}``; the
             page shows them beside the source line;
``rerun``    optional: ``true`` when ``--rerun`` may run ``command`` again by
             itself (a few minutes at most, prints the file's JSON on stdout);
``checks``   optional: later reruns that confirmed part of the file, each
             ``{"command", "commit", "date", "covers": [pathspecs], "what",
             "hit_tokens": {"SYSTEM@GB": n}}``: the pathspecs it covers count as
             current at the check's commit, and the test compares its
             ``hit_tokens`` with the file's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/*.md")
REGION = re.compile(r"(<!-- figures:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)
OPEN = re.compile(r"<!-- /?figures:([\w.-]+) -->")

PEERS_CONV = "benchmarks/peers/results/results.json"
PEERS_WEKA = "benchmarks/peers/results/weka/results.json"
PEERS_WEKA4 = "benchmarks/peers/results/weka/first4sessions.json"
IN_ENGINE_CONV = "benchmarks/peers/results/in_engine_vllm_conversation.json"
IN_ENGINE_WEKA = "benchmarks/peers/results/in_engine_vllm_weka.json"
SAMPLE = "benchmarks/results/replay_sample.json"
FULL_CONV = "benchmarks/results/replay_conversation_full.json"
BUDGETS_K0 = "benchmarks/results/budgets_conversation_1000_k0.json"
BUDGETS_K16K = "benchmarks/results/budgets_conversation_1000_k16384.json"
ENGINE_STEP = "benchmarks/results/engine_step.json"
SOAK = "benchmarks/results/soak.json"
TIERS_VLLM = "benchmarks/peers/results/tiers_vllm.json"
TIERS = "benchmarks/results/tiers.json"
L2_ORDER = "benchmarks/results/l2_order.json"
TIER_STALL = "benchmarks/results/tier_stall.json"
LOOKUP_STALL = "benchmarks/results/lookup_stall_vllm.json"
LOOKUP_KEYS = "benchmarks/results/lookup_keys_vllm.json"
TRANSFER = "benchmarks/results/transfer.json"
TIERS_L3 = "benchmarks/results/tiers_l3.json"
SGLANG_QUOTED = "benchmarks/peers/results/in_engine_sglang.json"
SGLANG_UNQUOTED = "benchmarks/peers/results/in_engine_sglang_unquoted.json"
SGLANG_PAGE64 = "benchmarks/peers/results/in_engine_sglang_page64.json"
SGLANG_TIERS = "benchmarks/peers/results/in_engine_sglang_tiers.json"
VLLM_PREFIX_SERVER = "benchmarks/results/vllm_prefix_server.json"
VLLM_SERVER = "benchmarks/results/vllm_server.json"
VLLM_OFFLINE = "benchmarks/results/vllm_offline.json"
ROUTE = {name: f"benchmarks/results/route_sim_{name}.json"
         for name in ("default", "fifo", "balance_0", "balance_0.25", "balance_4", "max_share_1", "weka")}
GROUPS = {(w, t): f"benchmarks/results/kv_groups_{w}_window_{t}.json"
          for w in ("two", "one") for t in ("conversation_3000", "weka_600")}

Loader = Callable[[str], dict[str, Any]]


def load_file(rel: str) -> dict[str, Any]:
    """A result file, by path relative to the repository root."""
    return json.loads((ROOT / rel).read_text())


def result_files() -> list[str]:
    """Every result file a renderer reads (relative paths, sorted)."""
    return sorted({src for fig in RENDERERS.values() for src in fig[0]})


# --------------------------------------------------------------------------- formatting


def pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}%"


def times(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}x"


def source_line(load: Loader, *rels: str) -> str:
    """``Source: `FILE` (commit abc1234, 2026-12-04)``, one entry per file."""
    parts = []
    for rel in rels:
        p = load(rel)["provenance"]
        later = ", ".join(d["commit"][:7] for d in p.get("not_rerun_after", []))
        checked = [c for c in p.get("checks", [])]
        extra = (f"; code it depends on changed after it in {later}, judged not to change these figures: "
                 f"see the file's not_rerun_after" if later else "")
        extra += "".join(f"; hybridkv's rows rerun at {c['commit'][:7]}, {c['date']}: the same hit tokens"
                         for c in checked)
        parts.append(f"`{rel}` (measured at commit {p['commit'][:7]}, {p['date']}{extra})")
    return "<sub>Source: " + "; ".join(parts) + ". Rendered by `scripts/render_figures.py`.</sub>"


# --------------------------------------------------------------------------- peers (replay harness)


def _peers():
    """benchmarks/peers/run.py and sweep.py: the tables the peer harness itself prints."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    import run  # noqa: PLC0415  (the benchmark's own table code: one way to print a row)
    import sweep  # noqa: PLC0415

    return run, sweep


def _comparison(out: dict[str, Any], gb: float, peer: str) -> dict[str, Any]:
    return next(c for c in out["comparison"] if c["budget_gb"] == gb and c["peer"] == peer)


def _row(out: dict[str, Any], system: str, gb: float, **marks: bool) -> dict[str, Any]:
    return next(r for r in out["results"] if r["system"] == system and r["budget_gb"] == gb
                and all(bool(r.get(k)) == v for k, v in marks.items()))


def _best_peer(out: dict[str, Any], gb: float, which: str) -> dict[str, Any]:
    """The comparison entry of the peer whose ``which`` ("best" or "default") row hits most at ``gb``."""
    cands = [c for c in out["comparison"] if c["budget_gb"] == gb and c[f"{which}_hit_rate"] is not None]
    return max(cands, key=lambda c: c[f"{which}_hit_rate"])


def _knob(c: dict[str, Any], which: str) -> str:
    run, _ = _peers()
    name = "vLLM" if c["peer"].startswith("vllm") else "SGLang"
    return f"{name} {run.settings_label(c[f'{which}_settings'])}"


def render_readme_peers(load: Loader) -> str:
    """README: the headline sentence and the summary table of the replay harness."""
    out = load(PEERS_CONV)
    m = out["meta"]
    lo, hi = sorted({r["budget_gb"] for r in out["results"]})
    b_lo, b_hi = _best_peer(out, lo, "best"), _best_peer(out, hi, "best")
    d_lo, d_hi = _best_peer(out, lo, "default"), _best_peer(out, hi, "default")
    sg_lo, sg_hi = _comparison(out, lo, "sglang-0.5.23"), _comparison(out, hi, "sglang-0.5.23")
    vl_lo, vl_hi = _comparison(out, lo, "vllm-0.32"), _comparison(out, hi, "vllm-0.32")
    dense = {gb: _row(out, "vllm-0.32", gb) for gb in (lo, hi)}
    for gb in (lo, hi):
        dense[gb] = next(r for r in out["results"] if r["system"] == "vllm-0.32" and r["budget_gb"] == gb
                         and r["settings"].get("prefix_cache_retention_interval", 0) is None)
    naive = {gb: _row(out, "naive", gb) for gb in (lo, hi)}
    hkv = {gb: _row(out, "hybridkv", gb) for gb in (lo, hi)}
    run, _ = _peers()

    def sweep_of(c: dict[str, Any]) -> str:
        return " / ".join(run.settings_label(s).split(" ", 1)[1] for s in c["settings_swept"])

    def best_cell(c: dict[str, Any]) -> str:
        return f"{pct(c['best_hit_rate'])} ({run.settings_label(c['best_settings']).split(' ', 1)[1]})"

    lines = [
        f"In the **replay harness** (`benchmarks/peers/`: each system's own cache code driven outside its "
        f"engine, one request at a time, same bytes), against the peers at their best swept setting, the same "
        f"memory serves **{times(b_lo['hybridkv_vs_best'])} the prefix hits of the best peer at a tight budget "
        f"({lo:g} GB) and {times(b_hi['hybridkv_vs_best'])} at a roomy one ({hi:g} GB)**; against the peers at "
        f"their defaults, {times(vl_lo['hybridkv_vs_default'])} / {times(vl_hi['hybridkv_vs_default'])} vLLM's "
        f"hits and {times(sg_lo['hybridkv_vs_default'])} / {times(sg_hi['hybridkv_vs_default'])} SGLang's. "
        f"Through vLLM's own scheduler the figures differ (`docs/vllm.md`, *in-engine harness*).",
        "",
        f"| Mooncake conversation trace, first {m['requests']:,} requests, {m['model']}, page {m['page_size']}, "
        f"replay harness | {lo:g} GB | {hi:g} GB |",
        "|---|---|---|",
        f"| SGLang 0.5.23 `UnifiedRadixCache`, `swa_full_tokens_ratio` "
        f"{run.settings_label(sg_lo['default_settings']).split(' ', 1)[1]} (default) "
        f"| {pct(sg_lo['default_hit_rate'])} | {pct(sg_hi['default_hit_rate'])} |",
        f"| SGLang 0.5.23, best of {sweep_of(sg_lo)} | {best_cell(sg_lo)} | {best_cell(sg_hi)} |",
        f"| vLLM 0.32 `KVCacheManager`, `prefix_cache_retention_interval` "
        f"{run.settings_label(vl_lo['default_settings']).split(' ', 1)[1]} (default) "
        f"| {pct(vl_lo['default_hit_rate'])} | {pct(vl_hi['default_hit_rate'])} |",
        f"| vLLM 0.32, best of {sweep_of(vl_lo)} | {best_cell(vl_lo)} | {best_cell(vl_hi)} |",
        f"| vLLM 0.32, retention none (dense) | {pct(dense[lo]['token_hit_rate'])} "
        f"| {pct(dense[hi]['token_hit_rate'])} |",
        f"| naive single pool (every layer stores every token) | {pct(naive[lo]['token_hit_rate'])} "
        f"| {pct(naive[hi]['token_hit_rate'])} |",
        f"| **hybridkv** | **{pct(hkv[lo]['token_hit_rate'])}** | **{pct(hkv[hi]['token_hit_rate'])}** |",
        f"| unlimited prefix cache (bound) | {pct(m['prefix_bound_hit_rate'])} "
        f"| {pct(m['prefix_bound_hit_rate'])} |",
        f"| **hybridkv / best-configured peer** | **{times(b_lo['hybridkv_vs_best'])}** ({_knob(b_lo, 'best')}) "
        f"| **{times(b_hi['hybridkv_vs_best'])}** ({_knob(b_hi, 'best')}) |",
        f"| hybridkv / default-configured peer (the better default) | {times(d_lo['hybridkv_vs_default'])} "
        f"({_knob(d_lo, 'default')}) | {times(d_hi['hybridkv_vs_default'])} ({_knob(d_hi, 'default')}) |",
        "",
        source_line(load, PEERS_CONV),
    ]
    return "\n".join(lines) + "\n"


def render_readme_weka(load: Loader) -> str:
    """README: the kv-cache-tester sentence (replay harness)."""
    out = load(PEERS_WEKA)
    m = out["meta"]
    lo, hi = sorted({r["budget_gb"] for r in out["results"]})
    swept = " / ".join(f"{r:g}" for r in sorted(s["swa_full_tokens_ratio"] for s in
                                               _comparison(out, lo, "sglang-0.5.23")["settings_swept"]))
    b_lo, b_hi = _best_peer(out, lo, "best"), _best_peer(out, hi, "best")
    sg_lo, sg_hi = _comparison(out, lo, "sglang-0.5.23"), _comparison(out, hi, "sglang-0.5.23")
    vl_hi = _comparison(out, hi, "vllm-0.32")
    text = (
        f"On the kv-cache-tester sessions (first {m['requests']:,} requests of the interleaved sessions; "
        f"SGLang swept over {swept} only), same harness: hybridkv hits {pct(b_lo['hybridkv_hit_rate'])} at "
        f"{lo:g} GB against the best peer's {pct(b_lo['best_hit_rate'])} ({_knob(b_lo, 'best')}; SGLang "
        f"{pct(sg_lo['best_hit_rate'])}), {times(b_lo['hybridkv_vs_best'], 1)}, and "
        f"{pct(b_hi['hybridkv_hit_rate'])} at {hi:g} GB against {pct(b_hi['best_hit_rate'])} "
        f"({_knob(b_hi, 'best')}; {times(b_hi['hybridkv_vs_best'])}; {times(vl_hi['hybridkv_vs_default'])} "
        f"vLLM's default, {times(sg_hi['hybridkv_vs_best'])} SGLang's best, "
        f"{times(sg_hi['hybridkv_vs_default'], 1)} SGLang's default)."
    )
    return text + "\n\n" + source_line(load, PEERS_WEKA) + "\n"


def render_peers_tables(rel: str) -> Callable[[Loader], str]:
    """docs/benchmarks.md: the harness's own comparison, every-row and ratio tables for one result file."""

    def render(load: Loader) -> str:
        run, sweep = _peers()
        out = load(rel)
        rows = run.table({**out, "comparison": []}).split("\n\n")[1]  # the every-row table alone
        return "\n\n".join([
            "Default and best setting of each peer, against hybridkv:",
            run.comparison_table(out["comparison"]),
            "Every row (latencies are per request, from one run on a shared machine: compare medians "
            "within the table, not across runs):",
            rows,
            "hybridkv against each row (hit rate) and each row's op latency against hybridkv's:",
            sweep.ratios(out),
            source_line(load, rel),
        ]) + "\n"

    return render


def render_peers_meta(rel: str) -> Callable[[Loader], str]:
    """One line: what the replay harness replayed (requests, tokens, bound)."""

    def render(load: Loader) -> str:
        m = load(rel)["meta"]
        return (f"{m['requests']:,} requests, {m['input_tokens']:,} input tokens, unlimited prefix bound "
                f"{pct(m['prefix_bound_hit_rate'])}.\n")

    return render


def render_weka_first4(load: Loader) -> str:
    out = load(PEERS_WEKA4)
    m = out["meta"]
    lo, hi = sorted({r["budget_gb"] for r in out["results"]})
    h = {gb: _row(out, "hybridkv", gb) for gb in (lo, hi)}
    v = {gb: _comparison(out, gb, "vllm-0.32") for gb in (lo, hi)}
    run, _ = _peers()

    def knob(c: dict[str, Any]) -> str:
        return run.settings_label(c["best_settings"]).split(" ", 1)[1]

    return (
        f"The first {m['max_sessions']} sessions complete (`--max-sessions {m['max_sessions']}`, "
        f"{m['requests']:,} requests, {m['input_tokens']:,} tokens, bound {pct(m['prefix_bound_hit_rate'])}) "
        f"fit in either budget, so every system is near the bound there: hybridkv "
        f"{pct(h[lo]['token_hit_rate'])} / {pct(h[hi]['token_hit_rate'])}, vLLM at its default "
        f"{pct(v[lo]['default_hit_rate'])} / {pct(v[hi]['default_hit_rate'])} and at its best "
        f"{pct(v[lo]['best_hit_rate'])} ({knob(v[lo])}) / {pct(v[hi]['best_hit_rate'])} ({knob(v[hi])}) at "
        f"{lo:g} / {hi:g} GB ({times(v[lo]['hybridkv_vs_default'])} / {times(v[hi]['hybridkv_vs_default'])} "
        f"the default, {times(v[lo]['hybridkv_vs_best'])} / {times(v[hi]['hybridkv_vs_best'])} the best; "
        f"SGLang not run on that selection).\n\n" + source_line(load, PEERS_WEKA4) + "\n"
    )


# --------------------------------------------------------------------------- in-engine (vLLM's scheduler)


def _in_engine(out: dict[str, Any], system: str, gb: float) -> dict[str, Any]:
    return next(r for r in out["rows"] if r["system"] == system and r["budget_gb"] == gb)


def render_in_engine_vllm(load: Loader) -> str:
    lines = ["| trace | budget | vLLM default (retention 0) | vLLM best (setting) | hybridkv | hybridkv / best "
             "| bound |", "|---|---|---|---|---|---|---|"]
    names = {IN_ENGINE_CONV: "Mooncake conversation", IN_ENGINE_WEKA: "kv-cache-tester"}
    for rel, name in names.items():
        out = load(rel)
        for gb in sorted({r["budget_gb"] for r in out["rows"]}):
            d, b, h = (_in_engine(out, s, gb) for s in ("vllm_default", "vllm_best", "hybridkv"))
            knob = b["setting"]["prefix_cache_retention_interval"]
            lines.append(f"| {name}, {out['requests']:,} req | {gb:g} GB | {pct(d['hit_rate'])} "
                         f"| {pct(b['hit_rate'])} ({'none' if knob is None else knob}) | {pct(h['hit_rate'])} "
                         f"| {times(h['hit_tokens'] / b['hit_tokens'] if b['hit_tokens'] else None, 3)} "
                         f"| {pct(out['bound']['hit_rate'])} |")
    return "\n".join(lines) + "\n\n" + source_line(load, IN_ENGINE_CONV, IN_ENGINE_WEKA) + "\n"


def render_harnesses(load: Loader) -> str:
    """The same cell in both harnesses, side by side, so two figures never look like one."""
    peers, eng = load(PEERS_CONV), load(IN_ENGINE_CONV)
    lo = min(r["budget_gb"] for r in peers["results"])
    c = _comparison(peers, lo, "vllm-0.32")
    b = _in_engine(eng, "vllm_best", lo)
    h = _in_engine(eng, "hybridkv", lo)
    return (
        f"Two harnesses measure the same {peers['meta']['requests']:,} conversation requests at {lo:g} GB, and "
        f"their figures are not interchangeable. The **replay harness** (`benchmarks/peers/run.sh`, docs "
        f"*Benchmarks*) drives each cache alone, one request at a time: hybridkv {pct(c['hybridkv_hit_rate'])}, "
        f"vLLM's best {pct(c['best_hit_rate'])}, **{times(c['hybridkv_vs_best'])}**. The **in-engine harness** "
        f"(`benchmarks/peers/in_engine_vllm.sh`, docs *vLLM*) runs vLLM's own scheduler with up to "
        f"{eng['args']['max_inflight']} requests in flight: hybridkv {pct(h['hit_rate'])}, vLLM's best "
        f"{pct(b['hit_rate'])}, **{times(h['hit_tokens'] / b['hit_tokens'])}**.\n\n"
        + source_line(load, PEERS_CONV, IN_ENGINE_CONV) + "\n"
    )


# --------------------------------------------------------------------------- in-engine (SGLang's pools)


def _sglang(out: dict[str, Any], size: str, system: str) -> dict[str, Any]:
    return next(r for r in out["runs"] if r["size"] == size and r["system"] == system)


def _sweep(out: dict[str, Any], size: str) -> list[dict[str, Any]]:
    return sorted((r for r in out["runs"] if r["size"] == size and r["system"].startswith("unified@")),
                  key=lambda r: r["swa_ratio"])


def _vs(a: int, b: int) -> str:
    """``a`` against ``b`` as a ratio, or how many fewer when below."""
    return times(a / b) if a >= b else f"{pct(1 - a / b, 1)} fewer"


def _sweep_text(out: dict[str, Any], size: str) -> str:
    return " / ".join(f"{r['swa_ratio']:g} {r['hit_tokens']:,}" + (f" ({r['rejected']} rejected)" if r["rejected"]
                                                                   else "") for r in _sweep(out, size))


def render_sglang_in_engine(load: Loader) -> str:
    """docs/sglang.md: benchmarks/peers/in_engine.sh, answers quoted by the next turn."""
    return _sglang_in_engine(load, SGLANG_QUOTED)


def render_sglang_in_engine_page64(load: Loader) -> str:
    """docs/sglang.md: the same benchmark at page size 64 (``--page-size 64``)."""
    return _sglang_in_engine(load, SGLANG_PAGE64)


def _sglang_in_engine(load: Loader, path: str) -> str:
    out = load(path)
    sz = out["sizes"]
    ro, ti = sz["roomy"], sz["tight"]
    lines = [
        f"Sizes for this sample: **roomy** {ro['kv_bytes'] / 1e9:.2f} GB, where an LRU cache of full KV alone hits "
        f"{ro['full_kv_lru_hits']:,} tokens, {pct(ro['full_kv_lru_hits'] / ro['prefix_bound'], 1)} of the prefix "
        f"bound ({ro['prefix_bound']:,}); **tight** {ti['kv_bytes'] / 1e9:.2f} GB (LRU of full KV alone: "
        f"{ti['full_kv_lru_hits']:,}).",
        "",
        "| size | kv_bytes | system | swa_ratio | full / SWA pool tokens | hit tokens | input tokens | hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in ("roomy", "tight"):
        for system in ("hybridkv", "unified_default", "unified_best"):
            r = _sglang(out, size, system)
            hit = f"**{r['hit_tokens']:,}**" if system == "hybridkv" else f"{r['hit_tokens']:,}"
            if r["rejected"]:
                hit += f" ({r['rejected']} requests rejected)"
            lines.append(f"| {size} | {r['kv_bytes']:,} | {system} | {r['swa_ratio']:.4f} | {r['full_tokens']:,} / "
                         f"{r['swa_tokens']:,} | {hit} | {r['input_tokens']:,} | {pct(r['hit_tokens'] / r['input_tokens'])} |")
    h, d, b = (_sglang(out, "roomy", s)["hit_tokens"] for s in ("hybridkv", "unified_default", "unified_best"))
    ht, dt, bt = (_sglang(out, "tight", s)["hit_tokens"] for s in ("hybridkv", "unified_default", "unified_best"))
    text = (
        f"At the roomy size hybridkv hits **{_vs(h, d)}** `UnifiedRadixCache`'s tokens at its default ratio and "
        f"**{_vs(h, b)}** at its best ratio ({_sglang(out, 'roomy', 'unified_best')['swa_ratio']:g}; the sweep: "
        f"{_sweep_text(out, 'roomy')}). At the tight size: {_vs(ht, dt)} the default ratio, {_vs(ht, bt)} the best "
        f"({_sglang(out, 'tight', 'unified_best')['swa_ratio']:g}; the sweep: {_sweep_text(out, 'tight')})."
    )
    return ("\n".join(lines) + "\n\n" + text + "\n\n" + source_line(load, path) + "\n")


def render_sglang_tiers(load: Loader) -> str:
    """docs/sglang.md: ``in_engine.sh --tiers``, hybridkv's backend with its L2 vs SGLang's HiCache."""
    out = load(SGLANG_TIERS)
    names = {"mooncake_conversation_trace.jsonl": "conversation", "weka": "kv-cache-tester"}
    lines = ["| trace | size | device / host GB | system | setting | L1 hit tokens | L2 (host) hit tokens "
             "| hit tokens | hybridkv vs it |", "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for trace, t in out["traces"].items():
        for size in ("roomy", "tight"):
            rows = {r["system"]: r for r in t["runs"] if r["size"] == size}
            if not rows:
                continue
            h = rows["hybridkv"]["hit_tokens"]
            for system in ("hybridkv", "hybridkv+write_through", "hicache_default", "hicache_best"):
                if system not in rows:  # an older file (write-through only), or a run that failed (not_run)
                    continue
                r = rows[system]
                st = r["setting"]
                setting = (f"swa ratio {st['swa_full_tokens_ratio']:.4g}"
                           + (f", hicache ratio {st['hicache_ratio']:g}" if "hicache_ratio" in st else "")
                           + f", {st.get('write_policy', 'write_through').replace('_', '-')}")
                hit = f"**{r['hit_tokens']:,}**" if system == "hybridkv" else f"{r['hit_tokens']:,}"
                if r["rejected"]:
                    hit += f" ({r['rejected']} rejected)"
                vs = "" if system == "hybridkv" else _vs(h, r["hit_tokens"])
                lines.append(f"| {names.get(trace, trace)} ({t['limit']:,} req.) | {size} | {r['kv_bytes'] / 1e9:.2f} / "
                             f"{r['host_bytes'] / 1e9:.2f} | {system} | {setting} | {r['l1_hit_tokens']:,} | "
                             f"{r['l2_hit_tokens']:,} | {hit} | {vs} |")
            sweep = sorted((r for r in t["runs"] if r["size"] == size and r["system"].startswith("hicache@")),
                           key=lambda r: r["setting"]["swa_full_tokens_ratio"])
            for policy in ("write_through", "write_back"):
                runs = [r for r in sweep if r["setting"].get("write_policy", "write_through") == policy]
                if runs:
                    notes.append(f"{names.get(trace, trace)} {size}, {policy.replace('_', '-')}: " + " / ".join(
                        f"{r['setting']['swa_full_tokens_ratio']:g} {r['hit_tokens']:,}"
                        + (f" ({r['rejected']} rejected)" if r["rejected"] else "") for r in runs))
    checked = sum(r["hits_verified"] for t in out["traces"].values() for r in t["runs"]
                  if r["system"] not in ("hicache_default", "hicache_best"))
    verdicts = []
    for trace, t in out["traces"].items():
        for size in ("roomy", "tight"):
            rows = {r["system"]: r["hit_tokens"] for r in t["runs"] if r["size"] == size}
            if rows:
                said = []
                for k, what in (("hicache_best", "HiCache's best"), ("hicache_default", "its default")):
                    if k in rows:
                        vs = _vs(rows["hybridkv"], rows[k])
                        said.append(f"{vs}{' than' * ('fewer' in vs)} {what}")
                verdicts.append(f"{names.get(trace, trace)} {size}: hybridkv hits " + ", ".join(said))
    missing = "".join(f" Not run: {why}." for why in out.get("not_run", {}).values())
    return ("\n".join(lines) + "\n\n" + "; ".join(verdicts) + ". HiCache's sweep of `--swa-full-tokens-ratio` "
            "(hit tokens): " + "; ".join(notes) + f". {checked:,} hits content-checked over all runs, none wrong."
            + missing + "\n\n" + source_line(load, SGLANG_TIERS) + "\n")


def render_sglang_unquoted(load: Loader) -> str:
    """docs/sglang.md: the same benchmark with ``--unquoted-answers``."""
    out = load(SGLANG_UNQUOTED)
    parts = []
    for size in ("roomy", "tight"):
        h, d, b = (_sglang(out, size, s) for s in ("hybridkv", "unified_default", "unified_best"))
        parts.append(f"{size} hybridkv {h['hit_tokens']:,} vs `unified_default` {d['hit_tokens']:,} "
                     f"({_vs(h['hit_tokens'], d['hit_tokens'])}) and `unified_best` ({b['swa_ratio']:g}) "
                     f"{b['hit_tokens']:,} (**{_vs(h['hit_tokens'], b['hit_tokens'])}**)")
    return "Same run otherwise: " + "; ".join(parts) + ".\n\n" + source_line(load, SGLANG_UNQUOTED) + "\n"


# --------------------------------------------------------------------------- vLLM's OpenAI server


def render_vllm_prefix_server(load: Loader) -> str:
    """docs/vllm.md: adapters/vllm/scripts/bench_prefix_server.py (hybridkv's tree as vLLM's prefix cache)."""
    out = load(VLLM_PREFIX_SERVER)
    m, ph = out["metrics"], out["metrics_phase"]
    t, per = out["ttft_ms_p50"], out["ttft_ms_p50_per_run"]

    def hits(d: dict[str, Any]) -> str:
        return f"{d['hybridkv']['hits']:,.0f} vs {d['vllm']['hits']:,.0f}"

    def phase(name: str) -> str:
        return (f"{name.replace('_', '-')} {hits({k: v[name] for k, v in ph.items()})} of "
                f"{ph['hybridkv'][name]['queries']:,.0f}")

    def per_server(phase: str) -> str:
        return (" / ".join(f"{x:.1f}" for x in per[phase]["hybridkv"]) + " vs "
                + " / ".join(f"{x:.1f}" for x in per[phase]["vllm"]))

    return (
        f"Served, hybridkv's tree vs vLLM's own prefix cache (`adapters/vllm/scripts/bench_prefix_server.py "
        f"--repeats {out['repeats']}`: tiny MiMo-V2 at `--num-gpu-blocks-override {out['blocks']}`, multi-turn "
        f"and concurrent clients, {out['repeats']} servers of each kind one at a time, alternating; `ranking` "
        f"adaptive; {out['wall_s']:.0f} s on a shared 2-core machine with other jobs running): every output equal "
        f"to vLLM's own: {'yes' if out['outputs_equal'] else '**no**'}; `/metrics` prefix-cache hits "
        f"{hits(m)} of {m['hybridkv']['queries']:,.0f} queried tokens ({phase('multi_turn')}, "
        f"{phase('concurrent')}); TTFT p50 (hybridkv vs vLLM, over all servers) "
        f"multi-turn {t['multi_turn']['hybridkv']:.1f} vs {t['multi_turn']['vllm']:.1f} ms "
        f"({times(out['ttft_ratio']['multi_turn'])}; per server {per_server('multi_turn')}), concurrent "
        f"{t['concurrent']['hybridkv']:.1f} vs {t['concurrent']['vllm']:.1f} ms "
        f"({times(out['ttft_ratio']['concurrent'])}; per server {per_server('concurrent')}). On a loaded "
        f"machine these medians say little; the hits repeat run to run for the multi-turn client.\n\n"
        + source_line(load, VLLM_PREFIX_SERVER) + "\n"
    )


def render_vllm_server(load: Loader) -> str:
    """docs/vllm.md: adapters/vllm/scripts/bench_server.py (the KV connector's TTFT and hits), one cell per run."""
    out = load(VLLM_SERVER)
    runs = out["runs"]

    def cells(f: Callable[[dict[str, Any]], str | None]) -> str:
        xs = [f(r) for r in runs]
        return "" if all(x is None for x in xs) else " / ".join("n/a" if x is None else x for x in xs)

    def ttft(name: str, phase: str, base: str | None) -> Callable[[dict[str, Any]], str | None]:
        def f(r: dict[str, Any]) -> str | None:
            row = r["ttft_ms"].get(name, {})
            if phase not in row:
                return None
            return f"{row[phase]:.1f}" + (f" ({times(row[phase] / r['ttft_ms'][base][phase])})" if base else "")
        return f

    def metric(name: str, key: str) -> Callable[[dict[str, Any]], str | None]:
        def f(r: dict[str, Any]) -> str | None:
            if name not in r["metrics"]:
                return None
            return f"{r['metrics'][name].get('vllm:hybridkv_' + key, 0):,.0f}"
        return f

    def loads(name: str) -> Callable[[dict[str, Any]], str | None]:
        def f(r: dict[str, Any]) -> str | None:
            if name not in r["metrics"]:
                return None
            mm = r["metrics"][name]
            return (f"{mm.get('vllm:hybridkv_load_pages_l2_total', 0):,.0f} + "
                    f"{mm.get('vllm:hybridkv_load_pages_l3_total', 0):,.0f}")
        return f

    def equal(name: str) -> str:
        ok = all(v for r in runs for k, v in r["ttft_ms"].get(name, {}).items() if k.endswith("_outputs_equal_base"))
        return "yes" if ok else "**no**"

    rows = [("`base`, no connector", "base", None, None), ("`hkv`, async saves (default)", "hkv", "base", None),
            ("`hkv_sync`, saves in the step", "hkv_sync", "base", None),
            ("`base2`, restarted, no connector", "base2", None, None),
            ("`hkv2`, restarted on the filled L3", "hkv2", None, "base2")]
    lines = ["| server | concurrent TTFT, empty L3 (ms) | multi-turn TTFT (ms) | `hybridkv_hit_tokens` (`/metrics`) "
             "| pages loaded, L2 + L3 | outputs = no connector |", "|---|---|---|---|---|---|"]
    for label, name, cbase, mbase in rows:
        if not any(name in r["ttft_ms"] for r in runs):
            continue
        lines.append(f"| {label} | {cells(ttft(name, 'concurrent', cbase))} "
                     f"| {cells(ttft(name, 'multi_turn', mbase))} | {cells(metric(name, 'hit_tokens_total'))} "
                     f"| {cells(loads(name))} | {'(reference)' if name == 'base' else equal(name)} |")
    conc = [r["ratios"]["concurrent_empty_l3_vs_base"] for r in runs]
    filled = [r["ratios"]["multi_turn_filled_l3_vs_base"] for r in runs]
    rounds = [x for r in runs for xs in r["concurrent_ttft_ms_per_round"].values() for x in xs]
    per_turn = cells(lambda r: ", ".join(f"{x:.1f}" for x in r["multi_turn_ttft_ms_per_turn"].get("hkv2", [])))
    hits2 = runs[0]["hits"].get("hkv2", [])
    w = runs[0]["workload"]
    first = sorted({c[0] for c in hits2}) if hits2 else []
    return (
        f"{'One run' if len(runs) == 1 else f'{len(runs)} runs'} of `bench_server.py --rounds {w['rounds']}"
        f"{' --sync-save' if w.get('sync_save') else ''}` on a 2-core machine (the load it ran under: the file's note) "
        f"({'' if len(runs) == 1 else 'a cell per run, `a / b`; '}ratios against the server without connector "
        f"of the same run; the multi-turn TTFT of `hkv` and `hkv_sync` is in the same server life as their "
        f"concurrent batches, so their loads come from L2; "
        f"{'the servers not being measured paused meanwhile' if w.get('no_pause') is False else 'every server left running meanwhile'}"
        f"):\n\n"
        + "\n".join(lines) + "\n\n"
        f"Targets: concurrent batch with an empty L3 at most 1.2 times no connector (measured "
        f"{', '.join(times(x) for x in conc)}: {'held' if all(x <= 1.2 for x in conc) else 'not held in every run'}); "
        f"filled-L3 multi-turn below no connector (measured {', '.join(times(x) for x in filled)}: "
        f"{'held' if all(x < 1 for x in filled) else 'not held in every run'}). Per-round medians of the "
        f"concurrent batches span {min(rounds):.0f}-{max(rounds):.0f} ms over the servers and runs; the "
        f"restarted hybridkv server's multi-turn TTFT per turn: {per_turn} ms. Cached tokens of its first turn "
        f"(from L3): {', '.join(f'{x:,}' for x in first) or 'none'}.\n\n"
        + source_line(load, VLLM_SERVER) + "\n"
    )


def render_vllm_offline(load: Loader) -> str:
    """docs/vllm.md: the offline ``LLM`` runs of adapters/vllm/tests/test_vllm_e2e.py, cached tokens per request."""
    out = load(VLLM_OFFLINE)
    models = out["models"]
    labels = (("gemma", "hkv1", "Gemma-2, hybridkv, process 1"),
              ("gemma", "hkv2", "Gemma-2, fresh process, `l2_gb: 0`"),
              ("mimo", "hkv1", "MiMo-V2, hybridkv, process 1"),
              ("mimo", "hkv2", "MiMo-V2, fresh process (L2 on)"),
              ("gemma", "offload", "OffloadingConnector (Gemma-2)"))
    first = models["gemma"]["hkv1"]["sets"]

    def lens(name: str) -> str:
        return ", ".join(str(n) for n in first[name]["prompt_lens"])

    lines = [f"| model, run | repeat ({lens('repeat')} tok) | shared prefix ({lens('shared_prefix')}) | multi-turn "
             f"| outputs = no connector | pages loaded from L2 / L3 |", "|---|---|---|---|---|---|"]
    for model, name, label in labels:
        r = models[model].get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {label} | does not start on CPU: \"{r['error'].strip()}\" | | | | |")
            continue
        sets = r["sets"]

        def cells(set_name: str, with_lens: bool = False) -> str:
            text = ", ".join(str(n) for n in sets[set_name]["cached_tokens"])
            if with_lens:
                text += " (" + ", ".join(str(n) for n in sets[set_name]["prompt_lens"]) + " tok)"
            return text

        loads = (f"{r['l2_pages']} / {r['l3_pages']}" + (f", {r['failed_loads']} failed" if r["failed_loads"] else "")
                 if "l2_pages" in r else "")
        lines.append(f"| {label} | {cells('repeat')} | {cells('shared_prefix')} "
                     f"| {cells('multi_turn', name == 'hkv1')} | {'yes' if r['outputs_equal_none'] else '**no**'} "
                     f"| {loads} |")
    inits = [r["init_s"] for m in models.values() for r in m.values() if "init_s" in r]
    return ("\n".join(lines) + "\n\n"
            f"Per `LLM`: init {min(inits):.0f}-{max(inits):.0f} s on a shared 2-core machine (other jobs running).\n\n"
            + source_line(load, VLLM_OFFLINE) + "\n")


# --------------------------------------------------------------------------- hybridkv replay


def render_sample(load: Loader) -> str:
    s = load(SAMPLE)
    return (
        f"`hybridkv replay` prints, for the bundled sample (the first {s['requests']:,} requests of the Mooncake "
        f"conversation trace; its first line says so) at {s['hbm_gb']:g} GB, in about "
        f"{5 * round(s['provenance']['wall_s'] / 5):.0f} s: hybridkv {pct(s['token_hit_rate'], 1)}, naive single "
        f"pool {pct(s['baselines']['naive']['token_hit_rate'], 1)}, tombstone "
        f"{pct(s['baselines']['tombstone']['token_hit_rate'], 1)} token hit rate, prefix bound "
        f"{pct(s['prefix_bound_hit_rate'])}.\n\n" + source_line(load, SAMPLE) + "\n"
    )


def _runs(out: dict[str, Any]) -> dict[float, dict[str, Any]]:
    """``hybridkv replay --json`` runs by budget (GB): ``runs`` with ``--budgets``, else the one run."""
    return {r["hbm_gb"]: r for r in out["runs"]} if "runs" in out else {out["hbm_gb"]: out}


def render_full_conversation(load: Loader) -> str:
    """hybridkv's own baselines and references on the whole conversation trace."""
    runs = _runs(load(FULL_CONV))
    lines = ["| budget | hybridkv | naive single pool | tombstone | LRU over full KV (SWA free) "
             "| offline optimal (SWA free) | unlimited prefix bound |", "|---|---|---|---|---|---|---|"]
    for gb, r in sorted(runs.items()):
        ref = r["references"]
        lines.append(f"| {gb:g} GB | **{pct(r['token_hit_rate'])}** | {pct(r['baselines']['naive']['token_hit_rate'])} "
                     f"| {pct(r['baselines']['tombstone']['token_hit_rate'])} | {pct(ref['lru_full']['token_hit_rate'])} "
                     f"| {pct(ref['optimal_at_budget']['token_hit_rate'])} | {pct(r['prefix_bound_hit_rate'])} |")
    any_run = next(iter(runs.values()))
    head = (f"The whole Mooncake conversation trace ({any_run['requests']:,} requests, "
            f"{any_run['input_tokens']:,} input tokens) through `hybridkv replay`, hybridkv against its own "
            f"baselines and two references that charge nothing for SWA KV:")
    return head + "\n\n" + "\n".join(lines) + "\n\n" + source_line(load, FULL_CONV) + "\n"


def render_budgets(load: Loader) -> str:
    k16, k0 = _runs(load(BUDGETS_K16K)), _runs(load(BUDGETS_K0))
    any_run = next(iter(k0.values()))
    lines = [
        f"First {any_run['requests']:,} Mooncake conversation requests, {any_run['model']}, page "
        f"{any_run['page_size']}, extension rule {any_run['extension_rule']} (the benchmarks page uses the "
        f"first 3,000 through the peer harness; these are `hybridkv replay` runs):",
        "",
        "| budget GB | K = 16,384 | K = 0 (off) | naive single pool | unlimited prefix bound "
        "| request ops p50 us (K = 16,384) |",
        "|---|---|---|---|---|---|",
    ]
    for gb in sorted(k0):
        a, b = k16[gb], k0[gb]
        lines.append(f"| {gb:g} | {pct(a['token_hit_rate'])} | {pct(b['token_hit_rate'])} "
                     f"| {pct(b['baselines']['naive']['token_hit_rate'])} | {pct(b['prefix_bound_hit_rate'])} "
                     f"| {a['request_ops_us_p50']:.0f} |")
    return "\n".join(lines) + "\n\n" + source_line(load, BUDGETS_K16K, BUDGETS_K0) + "\n"


def render_engine_step(load: Loader) -> str:
    """benchmarks/engine_step.py: per request per decode step, and the request path."""
    out = load(ENGINE_STEP)
    batches = sorted(out["decode_us_per_req"]["hybridkv_batched"], key=int)
    names = {"hybridkv_batched": "hybridkv `step` + `commit_step` (batched)",
             "hybridkv_single": "hybridkv `append_tokens` + `allocate(1)` + `commit(1)`",
             "vllm": "vLLM 0.32 `append_output_token_ids` + `KVCacheManager.allocate_slots`"}
    lines = ["| context | API | " + " | ".join(f"B = {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for ctx, key in (("4K", "decode_us_per_req"), ("32K", "decode_us_per_req_32k")):
        for api, per_batch in out[key].items():
            lines.append(f"| {ctx} | {names.get(api, api)} | "
                         + " | ".join(f"{per_batch[b]:.2f}" for b in batches) + " |")
    runs = out["request_ops_runs"]
    p50 = " / ".join(f"{r['request_ops_us_p50']:.0f}" for r in runs)
    p99 = " / ".join(f"{r['request_ops_us_p99'] / 1000:.2f}" for r in runs)
    vllm = ("" if out.get("batched_vs_vllm") else
            " vLLM's rows were not run (`--no-vllm`: they need the vLLM venv); the changelog has the last run "
            "with them.")
    return (
        f"Per request per decode step, microseconds ({out['preset']}, page {out['page_size']}, {out['steps']} "
        f"decode steps after a prefill of the context, median of {out['repeats']} runs, accounting only):\n\n"
        + "\n".join(lines) + "\n\n"
        f"Request path, {out['requests']:,} requests at 594 GB, {len(runs)} whole replays in the same run: "
        f"`request_ops_us` p50 {p50} us, p99 {p99} ms; hit rate {pct(out['token_hit_rate'])}.{vllm} Measured on "
        f"a shared 2-core machine with other jobs running: compare rows within the table, not with other runs."
        "\n\n" + source_line(load, ENGINE_STEP) + "\n"
    )


def render_soak(load: Loader) -> str:
    """python -m hybridkv.eval.soak: heap and tree size per pass over the same cache."""
    out = load(SOAK)
    lines = ["| pass | seconds | Python heap MB | tree nodes |", "|---|---|---|---|"]
    for r in out["passes"]:
        lines.append(f"| {r['pass']} | {r['seconds']:.1f} | {r['heap_bytes'] / 1e6:.1f} | {r['tree_nodes']:,} |")
    g = out["growth_after_pass_2"]
    heaps = ", ".join(f"`{n}` at most {h['max']:,} of {h['limit']:,}" for n, h in out["lazy_heaps"].items())
    worst = out["worst_growth"]
    return (
        f"{out['requests']:,} requests per pass, {len(out['passes'])} passes:\n\n" + "\n".join(lines) + "\n\n"
        f"From pass 2 to {len(out['passes'])} the heap grew {100 * g['heap_bytes']:.1f}%; the largest growth of "
        f"any index (lazy heaps aside) was `{worst['name']}`, {100 * worst['fraction']:+.1f}%.  Lazy heaps against "
        f"their rebuild limit: {heaps}.\n\n" + source_line(load, SOAK) + "\n"
    )


def render_tiers_vllm(load: Loader) -> str:
    """benchmarks/peers/tiers_vllm.py: hit tokens per tier, vLLM's offload vs hybridkv's tiers."""
    out = load(TIERS_VLLM)
    names = {"hybridkv-l1": "hybridkv L1 only", "hybridkv-l2": "hybridkv L1 + L2",
             "hybridkv-l2-l3": "hybridkv L1 + L2 + L3", "vllm-l1": "vLLM device cache only (no connector)",
             "vllm-cpu": "vLLM CPU offload", "vllm-cpu-fs": "vLLM CPU + fs tiering",
             "hybridkv-vllm-l1": "hybridkv in vLLM (`--scheduler-cls`), no connector",
             "hybridkv-vllm-l2-l3": "hybridkv in vLLM + its connector (L2 + file L3)"}
    traces = {"mooncake_conversation": "conversation", "kv_cache_tester_16_sessions": "kv-cache-tester"}
    lines = ["| trace | system | vLLM retention | L1 (device) hit tokens | L2 / CPU hit tokens | L3 (file) hit tokens "
             "| total hit rate |", "|---|---|---|---|---|---|---|"]
    seen = set()
    for r in out["rows"]:
        first = r["trace"] not in seen
        seen.add(r["trace"])
        what = (f"{traces.get(r['trace'], r['trace'])} ({r['requests']:,} req., {r['input_tokens']:,} tok.)"
                if first else "")
        vllm = r["system"].startswith("vllm")
        ret = r.get("retention_interval")
        ret = ("None (dense)" if ret is None else f"{ret}{' (default)' if ret == 0 else ''}") if vllm else ""
        l2 = f"{r['l2_hit_tokens']:,}" if r["system"] not in ("hybridkv-l1", "vllm-l1", "hybridkv-vllm-l1") else ""
        l3 = (f"{r['l3_hit_tokens']:,}" if r["system"] in ("hybridkv-l2-l3", "vllm-cpu-fs", "hybridkv-vllm-l2-l3")
              else "")
        lines.append(f"| {what} | {names[r['system']]} | {ret} | {r['l1_hit_tokens']:,} | {l2} | {l3} "
                     f"| {pct(r['token_hit_rate'])} |")
    return (f"Device {out['l1_gb']:g} GB, host {' / '.join(f'{h:g}' for h in out['host_gb'])} GB:\n\n"
            + "\n".join(lines) + "\n\n" + source_line(load, TIERS_VLLM) + "\n")


def render_tiers_vllm_conclusions(load: Loader) -> str:
    """docs/vllm.md: the conclusions under the tiers table, every figure from the same file."""
    out = load(TIERS_VLLM)
    conv, weka = "mooncake_conversation", "kv_cache_tester_16_sessions"
    missing = object()

    def row(trace: str, system: str, ret: Any = missing) -> dict[str, Any]:
        return next(r for r in out["rows"] if r["trace"] == trace and r["system"] == system
                    and (ret is missing or r.get("retention_interval", missing) == ret))

    def rate(trace: str, system: str, ret: Any = missing) -> float:
        return row(trace, system, ret)["token_hit_rate"]

    def pts(a: float, b: float) -> str:
        return f"{100 * (a - b):.2f}"

    h2c, h2w = rate(conv, "hybridkv-l2"), rate(weka, "hybridkv-l2")
    h1c, h1w = rate(conv, "hybridkv-l1"), rate(weka, "hybridkv-l1")
    h3c = rate(conv, "hybridkv-l2-l3")
    v = {(t, ret): rate(t, "vllm-cpu", ret) for t in (conv, weka) for ret in (0, 16384, None)}
    fs0, fs16 = rate(conv, "vllm-cpu-fs", 0), rate(conv, "vllm-cpu-fs", 16384)
    l1c, l1w = rate(conv, "vllm-l1", 0), rate(weka, "vllm-l1", 0)
    host = {t: (row(t, "vllm-cpu", 0)["l2_hit_tokens"], row(t, "hybridkv-l2")["l2_hit_tokens"]) for t in (conv, weka)}
    dev = {t: (row(t, "vllm-cpu", 0)["l1_hit_tokens"], row(t, "hybridkv-l2")["l1_hit_tokens"]) for t in (conv, weka)}

    def mtok(n: int) -> str:
        return f"{n / 1e6:.2f}M" if n < 1e8 else f"{n / 1e6:.1f}M"

    return "\n".join([
        "Conclusions, at equal device and host bytes and with vLLM's transfers assumed",
        "free and infallible:",
        "",
        f"* **vLLM's own CPU offload is close to hybridkv's L2.** On the conversation trace hybridkv L1 + L2 "
        f"leads vLLM's default by {pts(h2c, v[conv, 0])} points ({pct(h2c)} vs {pct(v[conv, 0])}) and vLLM at "
        f"retention 16384 by {pts(h2c, v[conv, 16384])} points ({pct(v[conv, 16384])}); on kv-cache-tester by "
        f"{pts(h2w, v[weka, 0])} and {pts(h2w, v[weka, 16384])} points. On the device alone hybridkv leads by "
        f"more (conversation {pct(h1c)} vs vLLM's {pct(l1c)}, kv-cache-tester {pct(h1w)} vs {pct(l1w)}): vLLM's "
        f"offloader stores the sliding-window blocks at the prompt ends that its device cache drops, and the host "
        f"tier then wins most of that gap back.",
        f"* **With a file tier.** hybridkv L1 + L2 + L3 {pct(h3c)} vs vLLM CPU + fs {pct(fs0)} at vLLM's default "
        f"retention on the conversation trace (the L3 adds {pts(h3c, h2c)} vs {pts(fs0, v[conv, 0])} points), "
        f"and {pts(h3c, fs16)} points at retention 16384 ({pct(fs16)}); at {max(out['host_gb']):g} GB of host "
        f"nothing on the kv-cache-tester sessions needs the third tier in either system.",
        f"* **Where the hits are served differs.** vLLM serves more from host memory ({mtok(host[conv][0])} vs "
        f"{mtok(host[conv][1])} conversation tokens; {mtok(host[weka][0])} vs {mtok(host[weka][1])} "
        f"kv-cache-tester tokens) and fewer from the device ({mtok(dev[conv][0])} vs {mtok(dev[conv][1])}; "
        f"{mtok(dev[weka][0])} vs {mtok(dev[weka][1])}): every host hit is a host-to-device copy before the "
        f"prefill (here assumed free), so the same hit rate costs vLLM more transfer time.",
        *_in_vllm_bullet(out, rate, pts, conv, weka, v, fs0),
        f"* **Dense retention (`None`) on the conversation trace** ({pct(v[conv, None])}"
        + (", below hybridkv's device cache alone" if v[conv, None] < h1c else "")
        + "): every sliding-window block is kept on the device and stored to the host, so a long prompt takes "
        "up to seven times the bytes (7 groups instead of about one).",
        "",
        source_line(load, TIERS_VLLM),
    ]) + "\n"


def _in_vllm_bullet(out: dict[str, Any], rate: Callable[..., float], pts: Callable[[float, float], str],
                    conv: str, weka: str, v: dict, fs0: float) -> list[str]:
    """The bullet on hybridkv inside vLLM (scheduler + connector), if the file has those rows."""
    if not any(r["system"] == "hybridkv-vllm-l2-l3" for r in out["rows"]):
        return []
    c, w = rate(conv, "hybridkv-vllm-l2-l3"), rate(weka, "hybridkv-vllm-l2-l3")
    return [f"* **Inside vLLM, as a user serves it** (hybridkv's tree as vLLM's device cache and its connector "
            f"for L2 + L3, the worker stood in like vLLM's): {pct(c)} on the conversation trace ({pts(c, v[conv, 0])} "
            f"points over vLLM's CPU offload, {pts(c, fs0)} over its CPU + fs tiering) and {pct(w)} on "
            f"kv-cache-tester ({pts(w, v[weka, 0])} points over vLLM's CPU offload); the device alone "
            f"{pct(rate(conv, 'hybridkv-vllm-l1'))} and {pct(rate(weka, 'hybridkv-vllm-l1'))}."]


def render_kv_groups(load: Loader) -> str:
    """docs/concepts.md: a two-window model against its one-window twin (hybridkv only)."""
    names = {"conversation_3000": "Mooncake conversation", "weka_600": "kv-cache-tester"}
    lines = ["| trace | budget | two windows | one window (what the cache kept before per-group pages) |",
             "|---|---|---|---|"]
    for trace, name in names.items():
        two, one = _runs(load(GROUPS["two", trace])), _runs(load(GROUPS["one", trace]))
        for gb in sorted(two):
            a, b = two[gb], one[gb]
            cell = pct(a["token_hit_rate"])
            cell = f"**{cell}**" if a["token_hit_rate"] < b["token_hit_rate"] else cell
            lines.append(f"| {name}, {a['requests']:,} requests | {gb:g} GB | {cell} | {pct(b['token_hit_rate'])} |")
    return "\n".join(lines) + "\n\n" + source_line(load, *GROUPS.values()) + "\n"


def render_tiers(load: Loader) -> str:
    """benchmarks/tiers.py: hit rate with L1 only, L1+L2 and L1+L2+L3, and the L3 overhead."""
    out = load(TIERS)
    names = {"kv_cache_tester": "kv-cache-tester ({sessions} sessions, {requests:,} requests)",
             "mooncake": "Mooncake conversation (first {requests:,} requests)"}
    lines = ["| trace | L1 only | L1+L2 | L1+L2+L3 | prefix bound |", "|---|---|---|---|---|"]
    for trace, r in out["hit_rates"].items():
        lines.append(f"| {names[trace].format(**r)} | {pct(r['l1']['token_hit_rate'])} "
                     f"| {pct(r['l1_l2']['token_hit_rate'])} | {pct(r['l1_l2_l3']['token_hit_rate'])} "
                     f"| {pct(r['prefix_bound_hit_rate'])} |")
    m = out["hit_rates"]["mooncake"]
    tail = (f"Mooncake L1+L2+L3: {m['l1_l2_l3']['l2_hit_tokens'] / 1e6:.2f} M tokens hit from L2, "
            f"{m['l1_l2_l3']['l3_hit_tokens'] / 1e6:.2f} M from L3; bytes the real model would move: "
            f"{m['l1_l2_l3']['bytes_moved'] / 1e12:.2f} TB (L1+L2: {m['l1_l2']['bytes_moved'] / 1e12:.2f} TB, "
            f"mostly write-through D2H).  `l3_overhead_ratio` (hybridkv put+get vs the raw client, same bytes, "
            f"same run, in a fresh process): "
            + ", ".join(f"{k} {v:.2f}" for k, v in out["l3_overhead_ratio"].items()) + ".")
    return (f"L1 {out['l1_gb']:g} GB, L2 {out['l2_gb']:g} GB, L3 a file backend without limit, extension rule "
            f"{out['extension_rule']}:\n\n" + "\n".join(lines) + "\n\n" + tail + "\n\n"
            + source_line(load, TIERS) + "\n")


def _tokens(n: int) -> str:
    """Tokens in millions, or as they are below 100,000."""
    return f"{n / 1e6:.2f} M" if n >= 100_000 else f"{n:,}"


def render_l2_order(load: Loader) -> str:
    """benchmarks/l2_order.py: L2's own eviction order against the L1 tree's, per split of the budget."""
    out = load(L2_ORDER)
    lines = ["| L1 | L2 | L3 | own order | tree order | tree / own (hit tokens) | L2 hits, own / tree |",
             "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        own, tree = r["own"], r["tree"]
        lines.append(f"| {r['l1_gb']:g} GB | {r['l2_gb']:g} GB | {r['l3'] or 'none'} | {pct(own['token_hit_rate'])} "
                     f"| {pct(tree['token_hit_rate'])} | {r['tree_over_own']:.4f} "
                     f"| {_tokens(own['l2_hit_tokens'])} / {_tokens(tree['l2_hit_tokens'])} |")
    worse = sum(1 for r in out["rows"] if r["tree"]["hit_tokens"] < r["own"]["hit_tokens"])
    better = sum(1 for r in out["rows"] if r["tree"]["hit_tokens"] > r["own"]["hit_tokens"])
    return (f"{out['trace']}, {out['model']}, write-through, prefix bound {pct(out['prefix_bound_hit_rate'])}; "
            f"hit rate per order:\n\n" + "\n".join(lines) + "\n\n"
            f"The tree's order serves fewer hit tokens at {worse} of {len(out['rows'])} splits and more at "
            f"{better}.\n\n" + source_line(load, L2_ORDER) + "\n")


def render_tier_stall(load: Loader) -> str:
    """benchmarks/tier_stall.py: begin p99 of L1/L2-resident prefixes, healthy vs slow L3."""
    out = load(TIER_STALL)
    h, slow = out["healthy_l3"], out["l3_1s"]
    rows = (("exact", "exact repeats (every page in L1/L2)"),
            ("new_suffix", f"resident prefix + {out['config']['suffix_tokens']} new tokens (L3 asked about the suffix)"),
            ("all", "all"))
    lines = [f"| begins | healthy L3 | L3 answering in {out['config']['l3_delay_s']:g} s |", "|---|---|---|"]
    lines += [f"| {name} | {h[k]['p99_us'] / 1000:.1f} ms | {slow[k]['p99_us'] / 1000:.1f} ms |" for k, name in rows]
    return (
        f"`begin` p99, {out['config']['requests']:,} timed begins per L3:\n\n" + "\n".join(lines) + "\n\n"
        f"With the slow L3, {slow['l3_timeouts']} reads waited the {out['config']['budget_s']:g} s budget (slowest "
        f"new-suffix begin {slow['new_suffix']['max_us'] / 1000:.0f} ms), then the read breaker opened "
        f"({slow['l3_read_breaker_trips']} trips) and {slow['l3_reads_skipped']:,} reads were skipped (no waiting); "
        f"the healthy L3 timed out {h['l3_timeouts']} reads.\n\n" + source_line(load, TIER_STALL) + "\n"
    )


def render_lookup_stall(load: Loader) -> str:
    """benchmarks/peers/lookup_stall_vllm.py: the scheduler thread held per lookup, by store delay."""
    out = load(LOOKUP_STALL)
    cfg, rows = out["config"], out["rows"]
    modes = (("inline", "always asked inline (before)"), ("wait_5ms", "default (`lookup_wait_ms` 5)"),
             ("wait_0", "`lookup_wait_ms` 0 (probe thread only)"))
    lines = ["| store answers in | " + " | ".join(name for _, name in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for delay, r in rows.items():
        cells = [f"{r[m]['held_ms_p50']:.2f} / {r[m]['held_ms_p99']:.2f} ms (admitted {r[m]['admit_ms_p50']:.1f} ms)"
                 for m, _ in modes]
        lines.append(f"| {delay.replace('ms', ' ms')} | " + " | ".join(cells) + " |")
    hits = {r[m]["hit_tokens"] for r in rows.values() for m, _ in modes}
    return (
        f"The scheduler thread held per lookup (p50 / p99), and the prompt's median admission delay, over "
        f"{cfg['prompts']} new {cfg['tokens']:,}-token prompts, half of them in the store; a deferred lookup is asked "
        f"again after a simulated {cfg['step_ms']:g} ms engine step:\n\n" + "\n".join(lines) + "\n\n"
        f"Every mode gave the same hit tokens ({', '.join(f'{h:,}' for h in sorted(hits))}). With the default, "
        + ", ".join(f"{r['wait_5ms'].get('lookup_probes_inline', 0)} lookups asked the {d.replace('ms', ' ms')} store "
                    f"inline" for d, r in rows.items()) + ". "
        + source_line(load, LOOKUP_STALL) + "\n"
    )


def render_lookup_keys(load: Loader) -> str:
    """benchmarks/peers/lookup_keys_vllm.py: a vLLM lookup with the keys read off the tree, and hashed."""
    out = load(LOOKUP_KEYS)
    lines = ["| trace | requests | device / L2 GB | pages named | per lookup, names (median / mean) "
             "| hashed (median / mean) | names / hashed (median) | rows identical |", "|---" * 8 + "|"]
    for r in out["rows"]:
        a, b = r["names"], r["hashed"]
        lines.append(f"| {r['trace']} | {r['requests']:,} | {r['l1_gb']:g} / {r['host_gb']:g} "
                     f"| {a['tree_named_pages']:,} | {a['median_us'] / 1000:.2f} / {a['mean_us'] / 1000:.2f} ms "
                     f"| {b['median_us'] / 1000:.2f} / {b['mean_us'] / 1000:.2f} ms | {r['ratio_median']:.3f}x "
                     f"| {'yes' if r['rows_identical'] else 'NO'} |")
    return (
        "A lookup's time on vLLM's scheduler thread (`get_num_new_matched_tokens`, the whole lookup: keys, "
        "L2's index, the store's record), with the keys of a prompt's leading pages read off hybridkv's device "
        "tree and with every key hashed, in alternated rounds of the same replay (MiMo-V2.5-Pro's seven KV-cache "
        "groups, a file L3, the worker stood in); \"rows identical\": the hit tokens, their split by tier, "
        "and L2's end state are the same both ways:\n\n" + "\n".join(lines) + "\n\n"
        + "Each round's median, names / hashed: " + "; ".join(
            f"{r['trace']} " + ", ".join(f"{a / 1000:.2f} / {b / 1000:.2f} ms" for a, b in
                                         zip(r["names"]["per_round_median_us"], r["hashed"]["per_round_median_us"]))
            for r in out["rows"]) + " (2 vCPUs: rounds of one mode spread; see the file's note). "
        + source_line(load, LOOKUP_KEYS) + "\n"
    )


_ROUTE_COLS = ("| hit rate | busy max/mean | TTFT p50 s | TTFT p90 s | TTFT p90 (>=32K) s | prefill busy s |",
               "|---|---|---|---|---|---|")


def _route_row(r: dict[str, Any], long: bool = True) -> str:
    cells = [f"{r['hit_rate']:.4f}", f"{r['load_max_over_mean']:.3f}", f"{r['ttft_p50']:.3f}", f"{r['ttft_p90']:.3f}"]
    if long:
        cells.append(f"{r['ttft_p90_long']:.3f}")
    return " | ".join(cells) + f" | {r['prefill_busy_s']:.0f} |"


def render_route_sim(load: Loader) -> str:
    """docs/routing.md: the three policies on the bundled sample, and affinity against round-robin."""
    out = load(ROUTE["default"])
    pol = out["policies"]
    lines = ["| policy " + _ROUTE_COLS[0], "|---" + _ROUTE_COLS[1]]
    lines += [f"| {name} | {_route_row(r)}" for name, r in pol.items()]
    rr, ll, af = pol["round_robin"], pol["least_loaded"], pol["affinity"]

    def change(a: float, b: float) -> str:
        return f"{100 * (a / b - 1):+.0f}%"

    return (
        "\n".join(lines) + "\n\n"
        f"Affinity vs round-robin: hit rate x{af['hit_rate'] / rr['hit_rate']:.2f}, TTFT p90 "
        f"{change(af['ttft_p90'], rr['ttft_p90'])} ({change(af['ttft_p90'], ll['ttft_p90'])} vs least-loaded), "
        f"TTFT p90 of >=32K-token prompts {change(af['ttft_p90_long'], rr['ttft_p90_long'])}, prefill GPU time "
        f"{change(af['prefill_busy_s'], rr['prefill_busy_s'])}, load max/mean {af['load_max_over_mean']:.3f}.  Index "
        f"predictions equalled the worker's real hit for {pct(af['prediction_exact_rate'], 1)} of requests (the "
        f"rest: the tree changed between routing and prefill start).\n\n" + source_line(load, ROUTE["default"]) + "\n"
    )


def render_route_knobs(load: Loader) -> str:
    runs = (("balance 0 (pure affinity)", "balance_0"), ("balance 0.25", "balance_0.25"),
            ("balance 1 (default)", "default"), ("balance 4", "balance_4"),
            ("max_share 1.0 (no guard)", "max_share_1"))
    lines = ["| setting " + _ROUTE_COLS[0], "|---" + _ROUTE_COLS[1]]
    lines += [f"| {label} | {_route_row(load(ROUTE[name])['policies']['affinity'])}" for label, name in runs]
    srcs = [ROUTE[name] for _, name in runs]
    return "\n".join(lines) + "\n\n" + source_line(load, *srcs) + "\n"


def render_route_fifo(load: Loader) -> str:
    fifo, unc = load(ROUTE["fifo"])["policies"], load(ROUTE["default"])["policies"]
    names = ("round_robin", "least_loaded", "affinity")
    cut = [100 * (1 - unc[n]["ttft_p50"] / fifo[n]["ttft_p50"]) for n in names]
    return (
        f"`--queue fifo` (same defaults): round-robin / least-loaded / affinity TTFT p90 "
        + " / ".join(f"{fifo[n]['ttft_p90']:.3f}" for n in names) + " s, p50 "
        + " / ".join(f"{fifo[n]['ttft_p50']:.3f}" for n in names)
        + f" s: uncached-first queues cut p50 by {min(cut):.0f}-{max(cut):.0f}% for every policy.\n\n"
        + source_line(load, ROUTE["fifo"], ROUTE["default"]) + "\n"
    )


def render_route_weka(load: Loader) -> str:
    out = load(ROUTE["weka"])
    pol = out["policies"]
    any_r = next(iter(pol.values()))
    lines = ["| policy | hit rate | busy max/mean | TTFT p50 s | TTFT p90 s | prefill busy s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {_route_row(r, long=False)}" for name, r in pol.items()]
    return (f"{any_r['requests']:,} requests, mean input {any_r['input_tokens'] / any_r['requests'] / 1000:.0f}K "
            f"tokens:\n\n" + "\n".join(lines) + "\n\n" + source_line(load, ROUTE["weka"]) + "\n")


def render_transfer(load: Loader) -> str:
    """benchmarks/transfer.py: host page copies against memcpy, and the layerwise loader."""
    out = load(TRANSFER)
    rows = (("host page copy GB/s", f"{out['host_copy_gbps']:.2f}"),
            ("memcpy bound GB/s (the faster of numpy and torch)", f"{out['memcpy_gbps']:.2f}"),
            ("`host_copy_ratio_vs_memcpy` (target >= 0.8)", f"{out['host_copy_ratio_vs_memcpy']:.2f}"),
            ("`host_pack_ratio_vs_memcpy`", f"{out['host_pack_ratio_vs_memcpy']:.2f}"),
            ("`host_unpack_ratio_vs_memcpy`", f"{out['host_unpack_ratio_vs_memcpy']:.2f}"),
            ("host kernel speed-up vs torch reference", times(out["host_copy_speedup_vs_torch_ref"], 1)),
            ("`layerwise_overlap_ratio` (matmul; target <= 1.1)", f"{out['layerwise_overlap_ratio']:.2f}"),
            ("`layerwise_serial_ratio` (no overlap, same run)", f"{out['layerwise_serial_ratio']:.2f}"),
            ("`layerwise_overlap_ratio_sleep_compute`", f"{out['layerwise_overlap_ratio_sleep_compute']:.2f}"))
    lines = ["| figure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return (f"{out['cpu_count']} CPU cores, 1-minute load average {out['loadavg_1min_start']:.1f} at the start "
            f"(other jobs running); medians of {out['repeats']} interleaved rounds, "
            f"{out['bytes_per_copy'] / 1e6:.0f} MB per copy:\n\n" + "\n".join(lines) + "\n\n"
            + source_line(load, TRANSFER) + "\n")


# --------------------------------------------------------------------------- L3 storage backends


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _l3_span(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float], digits: int = 2) -> str:
    """``median (min-max)`` of one figure over the runs."""
    xs = [get(r) for r in runs]
    return f"{_med(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def render_storage_checksums(load: Loader) -> str:
    """docs/storage.md: the checksum rates over one batch (benchmarks/tiers_l3.py)."""
    runs = load(TIERS_L3)["runs"]
    r0 = runs[0]

    def rate(k: str) -> float:
        return _med([r["checksum_rates"][k] for r in runs])

    one, all_ = rate("nh64_1_thread_gbps"), rate("nh64_all_threads_gbps")
    both = (f"on all {r0['cpu_count']} threads {all_:.1f} GB/s"
            + (" (slower than one thread here: the other core was busy with other jobs)" if all_ < one else ""))
    return (f"Measured here (`benchmarks/tiers_l3.py`: one batch of {r0['pages_per_batch']} pages, "
            f"{r0['pages_per_batch'] * r0['payload_bytes'] / 1e6:.0f} MB, in cache; medians of {len(runs)} runs "
            f"on a shared {r0['cpu_count']}-core machine with other jobs running): NH64 {one:.1f} GB/s on one "
            f"thread, {both}; xxh3_64 {rate('xxh3_64_gbps'):.1f} GB/s (one core, GIL held); crc32 "
            f"{rate('crc32_gbps'):.1f} GB/s.\n\n" + source_line(load, TIERS_L3) + "\n")


def render_storage_l3(load: Loader) -> str:
    """docs/storage.md: raw client vs hybridkv per backend (benchmarks/tiers_l3.py), over several runs."""
    out = load(TIERS_L3)
    runs = out["runs"]
    r0 = runs[0]
    rows = (("file", "file", lambda b: b),
            ("redis", "redis", lambda b: b),
            ("mooncake, pool in a storage-node process (tcp)", "mooncake", lambda b: b),
            ("nixl (POSIX)", "nixl", lambda b: b),
            ("mooncake, pool in the benchmark's own process", "mooncake", lambda b: b["local_segment"]))
    lines = ["| backend | raw put GB/s | raw get GB/s | hybridkv put GB/s | hybridkv get GB/s "
             "| `l3_overhead_ratio` median (range) |", "|---|---|---|---|---|---|"]
    for label, name, part in rows:
        if any(name not in r["backends"] or "skipped" in r["backends"][name] for r in runs):
            lines.append(f"| {label} | not run: client not installed | | | | |")
            continue

        def cell(k: str, digits: int = 2) -> str:
            return f"{_med([part(r['backends'][name])[k] for r in runs]):.{digits}f}"

        lines.append(f"| {label} | {cell('raw_put_gbps')} | {cell('raw_get_gbps')} | {cell('hkv_put_gbps')} "
                     f"| {cell('hkv_get_gbps')} "
                     f"| {_l3_span(runs, lambda r: part(r['backends'][name])['l3_overhead_ratio'])} |")
    meets = [n for n in ("file", "redis", "mooncake", "nixl")
             if _med([r["backends"][n]["l3_overhead_ratio"] for r in runs]) <= r0["target_ratio"]]
    misses = [n for n in ("file", "redis", "mooncake", "nixl") if n not in meets]
    verdict = (f"Against the target (<= {r0['target_ratio']:g}), medians over the runs: "
               + (f"within it {', '.join(meets)}" if meets else "none within it")
               + (f"; above it {', '.join(misses)}" if misses else "") + ".")
    loads = " / ".join(f"{r['loadavg_1min_start']:.1f}" for r in runs)
    walls = " / ".join(f"{r['wall_s']:.0f}" for r in runs)
    nbytes = r0["pages_per_batch"] * r0["payload_bytes"]
    nh = _med([r["checksum_rates"]["nh64_all_threads_gbps"] for r in runs])
    return (f"{len(runs)} runs of `python benchmarks/tiers_l3.py --json` (checksum {r0['checksum']}, batches of "
            f"{r0['pages_per_batch']} pages, medians of {r0['repeats']} repeats per run) on a shared "
            f"{r0['cpu_count']}-core machine with other jobs running (1-minute load average {loads} at the start "
            f"of each run; each took {walls} s). GB/s are the medians of the runs' medians; the ratio column "
            f"gives the median and the range over the runs:\n\n" + "\n".join(lines) + "\n\n"
            + verdict + f" One NH64 pass over a batch ({nbytes / 1e6:.0f} MB) at the measured rate on all "
            f"threads ({nh:.1f} GB/s) takes {nbytes / nh / 1e6:.1f} ms, paid once per put and once per get.\n\n"
            + source_line(load, TIERS_L3) + "\n")


# NAME -> (result files it reads, renderer)
RENDERERS: dict[str, tuple[tuple[str, ...], Callable[[Loader], str]]] = {
    "readme-sample": ((SAMPLE,), render_sample),
    "readme-peers": ((PEERS_CONV,), render_readme_peers),
    "readme-weka": ((PEERS_WEKA,), render_readme_weka),
    "harnesses": ((PEERS_CONV, IN_ENGINE_CONV), render_harnesses),
    "full-conversation": ((FULL_CONV,), render_full_conversation),
    "budgets-measured": ((BUDGETS_K0, BUDGETS_K16K), render_budgets),
    "peers-conversation-meta": ((PEERS_CONV,), render_peers_meta(PEERS_CONV)),
    "peers-conversation": ((PEERS_CONV,), render_peers_tables(PEERS_CONV)),
    "peers-weka-meta": ((PEERS_WEKA,), render_peers_meta(PEERS_WEKA)),
    "peers-weka": ((PEERS_WEKA,), render_peers_tables(PEERS_WEKA)),
    "peers-weka-first4": ((PEERS_WEKA4,), render_weka_first4),
    "in-engine-vllm": ((IN_ENGINE_CONV, IN_ENGINE_WEKA), render_in_engine_vllm),
    "engine-step": ((ENGINE_STEP,), render_engine_step),
    "sglang-in-engine": ((SGLANG_QUOTED,), render_sglang_in_engine),
    "sglang-unquoted": ((SGLANG_UNQUOTED,), render_sglang_unquoted),
    "sglang-in-engine-page64": ((SGLANG_PAGE64,), render_sglang_in_engine_page64),
    "sglang-tiers": ((SGLANG_TIERS,), render_sglang_tiers),
    "vllm-prefix-server": ((VLLM_PREFIX_SERVER,), render_vllm_prefix_server),
    "vllm-server": ((VLLM_SERVER,), render_vllm_server),
    "vllm-offline": ((VLLM_OFFLINE,), render_vllm_offline),
    "soak": ((SOAK,), render_soak),
    "tiers-vllm": ((TIERS_VLLM,), render_tiers_vllm),
    "tiers-vllm-conclusions": ((TIERS_VLLM,), render_tiers_vllm_conclusions),
    "kv-groups": (tuple(GROUPS.values()), render_kv_groups),
    "tiers": ((TIERS,), render_tiers),
    "l2-order": ((L2_ORDER,), render_l2_order),
    "tier-stall": ((TIER_STALL,), render_tier_stall),
    "lookup-stall": ((LOOKUP_STALL,), render_lookup_stall),
    "lookup-keys": ((LOOKUP_KEYS,), render_lookup_keys),
    "transfer": ((TRANSFER,), render_transfer),
    "storage-checksums": ((TIERS_L3,), render_storage_checksums),
    "storage-l3": ((TIERS_L3,), render_storage_l3),
    "route-sim": ((ROUTE["default"],), render_route_sim),
    "route-knobs": (tuple(ROUTE[n] for n in ("balance_0", "balance_0.25", "default", "balance_4", "max_share_1")),
                    render_route_knobs),
    "route-fifo": ((ROUTE["fifo"], ROUTE["default"]), render_route_fifo),
    "route-weka": ((ROUTE["weka"],), render_route_weka),
}


# --------------------------------------------------------------------------- pages


def pages() -> list[Path]:
    return sorted(p for pattern in PAGES for p in ROOT.glob(pattern))


def render_text(text: str, load: Loader = load_file, where: str = "page") -> str:
    """``text`` with every marked region replaced by its renderer's output.

    Raises ValueError for an unknown region name or a marker without its pair."""
    names = [m.group(1) for m in OPEN.finditer(text)]
    paired = [m.group("name") for m in REGION.finditer(text)]
    if len(names) != 2 * len(paired):
        raise ValueError(f"{where}: unpaired figures marker (regions {paired}, markers {names})")
    unknown = sorted(set(paired) - set(RENDERERS))
    if unknown:
        raise ValueError(f"{where}: unknown figures region(s) {unknown}; known: {sorted(RENDERERS)}")
    cache: dict[str, dict[str, Any]] = {}

    def cached(rel: str) -> dict[str, Any]:
        if rel not in cache:
            cache[rel] = load(rel)
        return cache[rel]

    return REGION.sub(lambda m: m.group(1) + RENDERERS[m.group("name")][1](cached) + m.group(4), text)


def regions(text: str) -> list[str]:
    return [m.group("name") for m in REGION.finditer(text)]


# --------------------------------------------------------------------------- provenance


REQUIRED = ("command", "commit", "date", "depends")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def provenance_problems(rel: str, out: dict[str, Any]) -> list[str]:
    """What is missing or malformed in a result file's ``provenance`` (no git needed)."""
    p = out.get("provenance")
    if not isinstance(p, dict):
        return [f"{rel}: no provenance object"]
    bad = [f"{rel}: provenance.{k} missing or empty" for k in REQUIRED if not p.get(k)]
    if p.get("commit") and not re.fullmatch(r"[0-9a-f]{40}", p["commit"]):
        bad.append(f"{rel}: provenance.commit must be a full 40-hex commit id")
    if p.get("date") and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", p["date"]):
        bad.append(f"{rel}: provenance.date must be YYYY-MM-DD")
    for c in p.get("checks", []):
        for k in ("command", "commit", "date", "covers", "what"):
            if not c.get(k):
                bad.append(f"{rel}: a check lacks {k}")
    for d in p.get("not_rerun_after", []):
        if not (d.get("commit") and d.get("why")):
            bad.append(f"{rel}: a not_rerun_after entry needs commit and why")
    return bad


def check_hit_tokens(rel: str, out: dict[str, Any]) -> list[str]:
    """Each check's ``hit_tokens`` must equal the file's rows for those systems and budgets."""
    bad = []
    rows = out.get("results") or out.get("rows") or []
    for c in out["provenance"].get("checks", []):
        for key, n in c.get("hit_tokens", {}).items():
            trace, _, key = key.rpartition(":")  # "SYSTEM@GB" or "TRACE:SYSTEM@GB"
            system, gb = key.rsplit("@", 1)
            found = [r["hit_tokens"] for r in rows if r["system"] == system and (not trace or r["trace"] == trace)
                     and r.get("budget_gb", r.get("l1_gb")) == float(gb)]
            if found != [n]:
                bad.append(f"{rel}: check at {c['commit'][:7]} found {key} = {n}, the file has {found}")
    return bad


def stale(rel: str, out: dict[str, Any]) -> list[str]:
    """Why ``out`` is older than the code it depends on (empty when current).

    The file's commit (and each check's) must be an ancestor of HEAD or HEAD;
    no commit after it may touch a ``depends`` pathspec (a check moves the
    pathspecs it ``covers`` to its own commit)."""
    p = out["provenance"]
    bad = []
    since: dict[str, str] = {spec: p["commit"] for spec in p["depends"]}
    for c in p.get("checks", []):
        for spec in c["covers"]:
            if spec not in since:
                bad.append(f"{rel}: a check covers {spec!r}, which is not in depends")
            since[spec] = c["commit"]
    for commit in {p["commit"], *(c["commit"] for c in p.get("checks", []))}:
        if _git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
            bad.append(f"{rel}: commit {commit[:7]} is not an ancestor of HEAD (or unknown)")
    if bad:
        return bad
    excludes = [s for s in p["depends"] if s.startswith(":(exclude)")]
    declared = {d["commit"] for d in p.get("not_rerun_after", [])}
    for spec, commit in since.items():
        if spec.startswith(":(exclude)"):
            continue
        log = _git("log", "--format=%H %s", f"{commit}..HEAD", "--", spec, *excludes)
        if log.returncode != 0:
            bad.append(f"{rel}: git log failed for {spec}: {log.stderr.strip()}")
            continue
        changes = [ln for ln in log.stdout.splitlines() if ln.split(" ", 1)[0] not in declared]
        if changes:
            first = changes[-1][:7] + changes[-1][40:120]
            how = (f"python scripts/render_figures.py --rerun {rel}" if p.get("rerun")
                   else f"{p['command']}, then record its provenance")
            bad.append(f"{rel}: measured at {commit[:7]}, but {spec} changed after it ({first}); "
                       f"rerun: {p['command']} (quick way: {how})")
    return bad


# --------------------------------------------------------------------------- rerun


def rerun(rel: str) -> None:
    """Run a result file's recorded command again at HEAD and rewrite the file.

    Only for files marked ``"rerun": true``; refuses when the code it depends on
    has uncommitted changes (the commit recorded would not be what ran)."""
    import datetime  # noqa: PLC0415
    import shlex  # noqa: PLC0415
    import time  # noqa: PLC0415

    old = load_file(rel)
    p = old["provenance"]
    if not p.get("rerun"):
        raise SystemExit(f"{rel}: not marked for --rerun; run by hand: {p['command']}")
    dirty = _git("status", "--porcelain", "--", *p["depends"]).stdout.strip()
    if dirty:
        raise SystemExit(f"{rel}: commit these first (the file records HEAD):\n{dirty}")
    argv = shlex.split(p["command"])
    if argv[0] == "hybridkv":
        argv = [sys.executable, "-m", "hybridkv", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{rel}: {p['command']} exited {res.returncode}:\n{res.stderr[-2000:]}")
    text = res.stdout.replace(str(ROOT.parent) + "/", "../").replace(str(ROOT) + "/", "")
    out = json.loads(text.replace("../" + ROOT.name + "/", ""))
    commit = _git("rev-parse", "HEAD").stdout.strip()
    prov = {k: v for k, v in p.items() if k not in ("checks", "not_rerun_after")}
    prov.update(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    if "wall_s" in p:
        prov["wall_s"] = round(time.perf_counter() - t0, 1)
    out["provenance"] = prov
    (ROOT / rel).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{rel}: rerun at {commit[:7]}")


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs")
    ap.add_argument("--rerun", nargs="*", metavar="FILE", default=None,
                    help="rerun these result files (default: every one marked \"rerun\": true), then render")
    args = ap.parse_args(argv)
    if args.rerun is not None:
        for rel in args.rerun or [r for r in result_files() if load_file(r)["provenance"].get("rerun")]:
            rerun(rel)
    differ = []
    for page in pages():
        text = page.read_text()
        name = os.path.relpath(page, ROOT)
        new = render_text(text, where=name)
        if new != text:
            differ.append(name)
            if not args.check:
                page.write_text(new)
    if args.check and differ:
        print("pages that differ from their result files: " + ", ".join(differ), file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(differ)) if differ else "every page matches its result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
