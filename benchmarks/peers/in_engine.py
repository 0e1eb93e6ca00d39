"""In-engine equal-memory benchmark: hybridkv's SGLang backend vs SGLang's own tree.

Runs inside the SGLang 0.5.23 venv (``in_engine.sh`` makes it).  Mooncake
conversation requests go through SGLang's real pools, ``Req`` objects and
scheduler helpers (``adapters/sglang/tests/sglang_flow.py``) at two KV-memory
sizes picked from the workload (``roomy`` ~ the replays' 594 GB regime, ``tight``
~ 59 GB; see ``adapters/sglang/tests/equal_memory.py``), for

* ``hybridkv``         ``HybridKVRadixCache`` at the split ``hybridkv_sglang.split`` chooses;
* ``unified_default``  ``UnifiedRadixCache`` (FULL + SWA) at ``--swa-full-tokens-ratio`` 0.8;
* ``unified_best``     the same at the swept ratio with the most hit tokens.

    benchmarks/peers/in_engine.sh --json [--trace T] [--limit N] [--systems hybridkv] [--page-size 64]

``--page-size N`` is SGLang's ``--page-size`` (default 1): at N > 1 every
allocation goes through SGLang's paged ``alloc_extend`` / ``alloc_decode`` (their
torch fallbacks on CPU) and hits end on page boundaries.  Every hit of every run
is content-checked (tags read back from SGLang's K/V buffers); a wrong one stops
the run with an error.

``--json`` prints one object ``{"sglang": [{"kv_bytes", "system", "swa_ratio",
"hit_tokens", "input_tokens", "page_size"}, ...]}`` on stdout; progress and every
swept ratio go to stderr (and to ``--details FILE`` as JSON when given).

``--tiers`` compares the stacks with a host tier instead (``equal_memory_tiers``):
hybridkv's radix backend with its L2 (``host_hit_length`` / ``init_load_back``)
against SGLang's HiCache (``UnifiedRadixCache`` + ``init_hicache``, as
``--enable-hierarchical-cache`` builds it; ``hicache_flow`` has the two CPU
stand-ins it needs) at equal device and host bytes (``--host-factor`` x the
device bytes, default 2), hybridkv under ``--write-policy`` (default write-back),
HiCache swept over the ratios and ``--hicache-write-policies`` (default both),
``hicache_default`` at ratio 0.8 with write-through and ``hicache_best`` over the
sweep; ``--json`` then prints ``{"sglang": [{"kv_bytes", "host_bytes",
"system", "setting", "hit_tokens", "l1_hit_tokens", "l2_hit_tokens",
"input_tokens"}]}``.  ``--sizes`` runs one of the two sizes (two processes can
share the work).

    benchmarks/peers/in_engine.sh --json --page-size 64 --tiers [--trace T] [--limit N] [--sizes tight]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "adapters" / "sglang" / "tests"))

import conftest  # noqa: E402  (torchvision stand-in, torch single-threaded)

conftest.publish_test_server_args()

import equal_memory as em  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    default_trace = (conftest.shared_traces() or Path("traces")) / "mooncake_conversation_trace.jsonl"
    ap.add_argument("--trace", type=Path, default=default_trace, help=f"trace file or kv-cache-tester folder (default {default_trace})")
    ap.add_argument("--limit", type=int, default=1000, help="first N requests of the trace (default 1000)")
    ap.add_argument("--ratios", default=",".join(str(r) for r in em.RATIOS),
                    help="UnifiedRadixCache --swa-full-tokens-ratio values to sweep (0.8 is always run)")
    ap.add_argument("--unquoted-answers", action="store_true",
                    help="decode tokens no later turn quotes (as when reasoning is stripped from the history) "
                         "instead of the answer the next turn quotes")
    ap.add_argument("--details", type=Path, help="write every run (pool sizes, sweep, timings) here as JSON")
    ap.add_argument("--systems", default=",".join(em.SYSTEMS),
                    help="comma-separated subset of hybridkv,unified (unified: the ratio sweep with its default "
                         "and best rows; default both)")
    ap.add_argument("--page-size", type=int, default=1,
                    help="SGLang's --page-size: tokens per KV page for every system (default 1)")
    ap.add_argument("--tiers", action="store_true",
                    help="with host tiers: hybridkv's radix backend with its L2 vs SGLang's HiCache "
                         "(--enable-hierarchical-cache) at equal device and host bytes")
    ap.add_argument("--sizes", default="roomy,tight", help="comma-separated subset of roomy,tight (default both)")
    ap.add_argument("--host-factor", type=float, default=None,
                    help="with --tiers: host bytes = this x device bytes (default 2, HiCache's --hicache-ratio)")
    ap.add_argument("--write-policy", default="write_back",
                    help="with --tiers: hybridkv's --hicache-write-policy, or a comma-separated list (the first "
                         "is the hybridkv row, the others hybridkv+<policy> rows; default write_back)")
    ap.add_argument("--hicache-write-policies", default="write_through,write_back",
                    help="with --tiers: HiCache's --hicache-write-policy values swept with each ratio "
                         "(default write_through,write_back; SGLang's default row needs write_through)")
    args = ap.parse_args(argv)
    if args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.page_size < 1:
        ap.error(f"--page-size must be >= 1, got {args.page_size}")
    if not args.trace.exists():
        ap.error(f"--trace {args.trace}: no such file or directory (a JSONL trace or kv-cache-tester's folder)")
    ratios = [float(x) for x in args.ratios.split(",") if x]
    if any(not 0 < r <= 1 for r in ratios):
        ap.error("--ratios: SGLang accepts --swa-full-tokens-ratio in (0, 1]")
    if args.tiers:
        return tiers_main(args, ratios)
    systems = tuple(x for x in args.systems.split(",") if x)
    if not systems or any(x not in em.SYSTEMS for x in systems):
        ap.error(f"--systems: a comma-separated subset of {','.join(em.SYSTEMS)}, got {args.systems!r}")

    def log(msg: str) -> None:
        print(f"[in-engine] {msg}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    prompts = em.mooncake_prompts(args.trace, args.limit)
    sizes = em.pick_sizes(prompts)
    for name, s in sizes.items():
        log(f"{name}: {s['kv_bytes'] / 1e9:.2f} GB ({s['kv_bytes'] // em.FULL_BYTES_PER_TOKEN} tokens of full KV "
            f"alone: LRU {s['full_kv_lru_hits']} hit tokens, prefix bound {s['prefix_bound']}, "
            f"input {s['input_tokens']})")
    try:
        rows = em.equal_memory(prompts, sizes, ratios=ratios, quoted_answers=not args.unquoted_answers,
                               progress=log, systems=systems, page_size=args.page_size)
    except ValueError as exc:  # a sample so small that its sizes cannot hold the running requests
        log(f"error: {exc} (the sizes scale with the sample: use a larger --limit)")
        return 2
    main_rows = [r for r in rows if r.system in ("hybridkv", "unified_default", "unified_best")]
    bad = [r for r in main_rows if r.system == "hybridkv" and r.rejected]
    if args.details:
        args.details.write_text(json.dumps({"trace": str(args.trace), "limit": args.limit, "sizes": sizes,
                                            "page_size": args.page_size,
                                            "quoted_answers": not args.unquoted_answers, "systems": list(systems),
                                            "runs": [vars(r) for r in rows]}, indent=1))
    log(f"done in {time.perf_counter() - start:.0f} s")
    if args.json:
        print(json.dumps({"sglang": [r.public() for r in main_rows]}))
    else:
        print(f"page size {args.page_size}; {sum(r.hits_verified for r in rows)} hits content-checked, none wrong\n")
        print("| size | kv_bytes | system | swa_ratio | full / SWA pool tokens | hit tokens | input tokens | hit rate |")
        print("|---|---|---|---|---|---|---|---|")
        for r in main_rows:
            print(f"| {r.size} | {r.kv_bytes:,} | {r.system} | {r.swa_ratio:.4f} | {r.full_tokens:,} / "
                  f"{r.swa_tokens:,} | {r.hit_tokens:,} | {r.input_tokens:,} | {r.hit_tokens / r.input_tokens:.2%} |")
    return 1 if bad else 0


def tiers_main(args: argparse.Namespace, ratios: list[float]) -> int:
    """``--tiers``: :func:`equal_memory_tiers.tiers_rows` at both sizes of the sample."""
    import equal_memory_tiers as et

    def log(msg: str) -> None:
        print(f"[in-engine tiers] {msg}", file=sys.stderr, flush=True)

    # --systems under --tiers: hybridkv and/or hicache (the sweep); a partial run's rows are merged by hand
    systems = ["hicache" if x == "unified" else x for x in args.systems.split(",") if x]
    if not systems or any(x not in ("hybridkv", "hicache") for x in systems):
        log(f"--systems with --tiers: a subset of hybridkv,hicache; got {args.systems!r}")
        return 2
    mine = [x for x in args.write_policy.split(",") if x]
    if not mine or any(x not in et.HICACHE_POLICIES for x in mine):
        log(f"--write-policy: one or more of {','.join(et.HICACHE_POLICIES)}; got {mine}")
        return 2
    policies = [x for x in args.hicache_write_policies.split(",") if x]
    if not policies or any(x not in et.HICACHE_POLICIES for x in policies):
        log(f"--hicache-write-policies: a subset of {','.join(et.HICACHE_POLICIES)}; got {policies}")
        return 2
    start = time.perf_counter()
    prompts = em.mooncake_prompts(args.trace, args.limit)
    sizes = {k: v for k, v in em.pick_sizes(prompts).items() if k in args.sizes.split(",")}
    if not sizes:
        log(f"--sizes: a subset of roomy,tight, got {args.sizes!r}")
        return 2
    factor = et.HOST_FACTOR if args.host_factor is None else args.host_factor
    failed: list[dict] = []
    rows = et.tiers_rows(prompts, sizes, host_factor=factor, ratios=ratios, page_size=args.page_size,
                         write_policy=mine, hicache_policies=policies, systems=systems, progress=log,
                         failed=failed)
    main_rows = [r for r in rows if r.system in ("hybridkv", "hicache_default", "hicache_best")]
    if args.details:
        args.details.write_text(json.dumps({"trace": str(args.trace), "limit": args.limit, "sizes": sizes,
                                            "page_size": args.page_size, "host_factor": factor,
                                            "runs": [vars(r) for r in rows], "failed": failed}, indent=1))
    log(f"done in {time.perf_counter() - start:.0f} s; {sum(r.hits_verified for r in rows)} hits content-checked, "
        "none wrong")
    if args.json:
        print(json.dumps({"sglang": [r.public() for r in main_rows]}))
    else:
        print("| size | kv_bytes | host_bytes | system | setting | L1 hit tokens | L2 hit tokens | hit tokens | input |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in main_rows:
            print(f"| {r.size} | {r.kv_bytes:,} | {r.host_bytes:,} | {r.system} | {r.setting} | {r.l1_hit_tokens:,} "
                  f"| {r.l2_hit_tokens:,} | {r.hit_tokens:,} | {r.input_tokens:,} |")
    return 1 if any(r.system == "hybridkv" and r.rejected for r in main_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
