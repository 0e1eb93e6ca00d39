"""``hybridkv route-sim``: compare routing policies on a timed trace."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..routing.router import POLICIES
from ..spec import ModelSpec, preset_names
from .route_sim import SimConfig, simulate
from .traces import FORMATS

__all__ = ["add_route_sim_parser", "load_requests", "run_route_sim"]

_GB = 10**9


def _pos(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def add_route_sim_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``route-sim`` subcommand to an ``add_subparsers()`` object."""
    d = SimConfig()
    r = sub.add_parser("route-sim", help="simulate N workers behind round-robin / least-loaded / affinity routing")
    r.add_argument("trace", nargs="?", default=None,
                   help=f"{FORMATS} (default: the bundled Mooncake sample)")
    r.add_argument("--model", default="mimo-v2.5-pro", choices=preset_names(),
                   help="model preset (default: mimo-v2.5-pro)")
    r.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    r.add_argument("--workers", type=int, default=d.workers, help=f"workers (default {d.workers})")
    r.add_argument("--hbm-gb", type=_pos, default=d.budget_bytes / _GB,
                   help=f"KV budget per worker in GB (10^9 bytes; default {d.budget_bytes / _GB:g})")
    r.add_argument("--prefill-tps", type=_pos, default=d.prefill_tps,
                   help=f"prefill throughput per worker, uncached tokens/s (default {d.prefill_tps:g})")
    r.add_argument("--prefill-overhead", type=float, default=d.prefill_overhead_s, help="seconds per prefill")
    r.add_argument("--tpot", type=float, default=d.tpot_s, help="decode seconds per output token")
    r.add_argument("--time-scale", type=_pos, default=d.time_scale,
                   help="divide trace timestamps by this (>1: arrivals faster)")
    r.add_argument("--queue", choices=("uncached", "fifo"), default=d.queue,
                   help=f"worker queue order: fewest uncached tokens first, or arrival order (default {d.queue})")
    r.add_argument("--max-wait", type=float, default=d.max_wait_s, help="starvation guard, seconds")
    r.add_argument("--balance", type=float, default=d.balance, help="load weight against predicted hit")
    r.add_argument("--max-share", type=float, default=d.max_share, help="max share of total load per worker")
    r.add_argument("--limit", type=int, default=None, help="first N requests only (default: all)")
    r.add_argument("--sessions", type=int, default=None,
                   help="session folders: keep the first N sessions (namespaces; default: all)")
    r.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    r.add_argument("--redis", default=None,
                   help="redis:// URL: carry affinity's KV events over a Redis stream (default: none, in process)")
    r.add_argument("--plot", default=None,
                   help="write a PNG comparing the policies (needs matplotlib; default: no plot)")
    r.add_argument("--no-extension-rule", action="store_true",
                   help="treat a refilled partial block as a divergence (see docs)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    return r


def load_requests(trace: str | None, limit: int | None, sessions: int | None) -> tuple[list, str]:
    """Requests of ``trace`` (default the bundled sample), optionally the first N sessions."""
    from .traces import bundled_sample, load_trace

    path = trace or str(bundled_sample())
    reqs = load_trace(path)
    if sessions is not None:
        if sessions < 1:
            raise ValueError(f"--sessions must be >= 1, got {sessions}")
        keep = sorted({r.namespace for r in reqs})[:sessions]
        chosen = set(keep)
        reqs = [r for r in reqs if r.namespace in chosen]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        reqs = reqs[:limit]
    return reqs, path


def run_route_sim(args: argparse.Namespace) -> int:
    """Run the subcommand; prints a table or JSON.  Returns the exit code."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    spec = ModelSpec.preset(args.model, page_size=args.page_size)
    cfg = SimConfig(workers=args.workers, budget_bytes=int(args.hbm_gb * _GB), prefill_tps=args.prefill_tps,
                    prefill_overhead_s=args.prefill_overhead, tpot_s=args.tpot, time_scale=args.time_scale,
                    queue=args.queue, max_wait_s=args.max_wait, balance=args.balance, max_share=args.max_share)
    reqs, path = load_requests(args.trace, args.limit, args.sessions)
    bus_factory = None
    if args.redis:
        import uuid

        from ..routing.bus import RedisStreamBus

        def bus_factory(_: str) -> RedisStreamBus:
            return RedisStreamBus(args.redis, stream=f"hkv:route-sim:{uuid.uuid4().hex[:8]}")
    out = simulate(reqs, spec, cfg, policies=policies, bus_factory=bus_factory,
                   extension_rule=not args.no_extension_rule)
    out["trace"] = path
    if args.plot:
        _plot(out, args.plot)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    c = out["config"]
    print(f"trace {path}: {out['requests']} requests, model {out['model']}, {c['workers']} workers x "
          f"{c['budget_bytes'] / _GB:g} GB, prefill {c['prefill_tps']:g} tok/s, queue {c['queue']}, "
          f"extension rule {out['extension_rule']}")
    print(f"{'policy':<14}{'hit rate':>9}{'load max/mean':>15}{'TTFT p50 s':>12}{'TTFT p90 s':>12}"
          f"{'p90 long s':>12}{'busy s':>10}")
    for name, m in out["policies"].items():
        print(f"{name:<14}{m['hit_rate']:>9.4f}{m['load_max_over_mean']:>15.3f}{m['ttft_p50']:>12.3f}"
              f"{m['ttft_p90']:>12.3f}{m['ttft_p90_long']:>12.3f}{m['prefill_busy_s']:>10.1f}")
    base = out["policies"].get("round_robin")
    aff = out["policies"].get("affinity")
    if base and aff and base["ttft_p90"] > 0:
        print(f"affinity vs round_robin: hit rate x{aff['hit_rate'] / max(1e-12, base['hit_rate']):.2f}, "
              f"TTFT p90 x{aff['ttft_p90'] / base['ttft_p90']:.2f}, prefill busy "
              f"x{aff['prefill_busy_s'] / max(1e-12, base['prefill_busy_s']):.2f}")
    return 0


def _plot(out: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'hybridkv[plot]')") from None
    names = list(out["policies"])
    metrics = [("hit_rate", "token hit rate"), ("load_max_over_mean", "busy max / mean"),
               ("ttft_p50", "TTFT p50 (s)"), ("ttft_p90", "TTFT p90 (s)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2))
    for ax, (key, label) in zip(axes, metrics):
        ax.bar(names, [out["policies"][n][key] for n in names], color=["#999", "#69c", "#d62"][:len(names)])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{out['model']}: {out['config']['workers']} workers, {out['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m hybridkv.eval.route_cli``), same as ``hybridkv route-sim``."""
    p = argparse.ArgumentParser(prog="hybridkv")
    sub = p.add_subparsers(dest="command", required=True)
    add_route_sim_parser(sub)
    args = p.parse_args(argv)
    try:
        return run_route_sim(args)
    except ValueError as exc:
        print(f"hybridkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
