"""Command line: ``hybridkv replay | verify | info | route-sim``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable, Sequence

from .. import __version__
from ..defaults import CHUNK, SWA_CHECKPOINT
from ..spec import ModelSpec, preset_names
from .cli_parsing import CommandParser, Parser
from .traces import FORMATS

__all__ = ["main"]

_GB = 10**9  # every "GB" of the CLI is 10^9 bytes (the Python API takes bytes)
_LEVELS = ("debug", "info", "warning", "error")
_QUICK_REQUESTS = 15  # verify --quick: 15 trace requests + 5 branch prompts


_DESCRIPTION = ("hybridkv: KV-cache management for hybrid sliding-window-attention models.  "
                "Commands: replay a trace through the cache and baselines, verify the cache against a "
                "dense forward of a reference model, info on bytes per token and what fits, route-sim to "
                "compare routing policies.  'hybridkv COMMAND --help' describes each.")


def _spec(args: argparse.Namespace) -> ModelSpec:
    """The model of ``--hf-config`` (a Hugging Face config.json) if given, else the ``--model`` preset."""
    if getattr(args, "hf_config", None):
        return _hf_spec(args.hf_config, args.page_size)
    return ModelSpec.preset(args.model, page_size=args.page_size)


def _hf_spec(path: str, page_size: int) -> ModelSpec:
    """``ModelSpec.from_hf_config`` of the JSON file at ``path``; ValueError naming the option."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(f"--hf-config {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-config {path}: not valid JSON (line {exc.lineno} column {exc.colno})") from None
    try:
        return ModelSpec.from_hf_config(config, page_size=page_size)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--hf-config {path}: {exc}") from None


def _budgets(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers (got {text!r})") from None
    if not values or not min(values) > 0:
        raise argparse.ArgumentTypeError(f"must be positive numbers (got {text!r})")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (the error is one line naming the option)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="hybridkv", description=_DESCRIPTION, epilog="GB everywhere means 10^9 bytes.  Logs go to stderr.")
    p.add_argument("--version", action="version", version=f"hybridkv {__version__}",
                   help="print the version and exit")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log output on stderr (-v: info, -vv: debug)")
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    p.add_argument("--log-level", choices=_LEVELS, default=None, type=str.lower,
                   help="log level of the hybridkv loggers (overrides -v/-q; default warning)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default="mimo-v2.5-pro", choices=preset_names(),
                        help="model preset (default: mimo-v2.5-pro)")
        sp.add_argument("--page-size", type=_int_at_least(1), default=64, help="tokens per page (default 64)")
        sp.add_argument("--hf-config", default=None, metavar="PATH",
                        help="your model's Hugging Face config.json (layer kinds, per-layer windows, KV "
                             "shapes); replaces --model (default: none, --model is used)")
        sp.add_argument("--json", action="store_true", help="print one JSON object")

    r = sub.add_parser("replay", help="replay a trace through hybridkv and baselines")
    r.add_argument("trace", nargs="?", default=None,
                   help=f"{FORMATS} (default: the bundled Mooncake sample)")
    common(r)
    r.add_argument("--hbm-gb", type=_positive_float, default=594.0,
                   help="KV budget in GB (10^9 bytes) for the preset (default 594)")
    r.add_argument("--swa-checkpoint", type=_int_at_least(0), default=SWA_CHECKPOINT,
                   help="K: tokens between SWA retention checkpoints, 0 = off")
    r.add_argument("--chunk", type=_int_at_least(1), default=CHUNK, help="prefill chunk size in tokens")
    r.add_argument("--limit", type=_int_at_least(1), default=None, help="replay only the first N requests (default: all)")
    r.add_argument("--block-size", type=_int_at_least(1), default=None,
                   help="tokens per hash id of a jsonl trace (default: from the data; 512 for Mooncake, "
                        "16 for Qwen-Bailian)")
    r.add_argument("--systems", default="hybridkv,naive,tombstone",
                   help="comma-separated subset of hybridkv,naive,tombstone (default: all three)")
    r.add_argument("--no-extension-rule", action="store_true",
                   help="treat a refilled partial block as a divergence (see docs)")
    r.add_argument("--plot", default=None, metavar="PNG",
                   help="write a hit-rate-vs-budget PNG to this path (needs --budgets and matplotlib; "
                        "default: no plot)")
    r.add_argument("--budgets", type=_budgets, default=None,
                   help="budgets to sweep in GB (10^9 bytes), comma-separated, e.g. 59,150,594 "
                        "(default: the one budget of --hbm-gb)")
    r.add_argument("--check-every", type=_int_at_least(0), default=0, help="check invariants every N requests, 0 = never")
    r.add_argument("--eviction-ranking", default="value", choices=("value", "adaptive", "arc", "lru"),
                   help="hybridkv's leaf ranking (default value; see docs/policy.md)")
    r.add_argument("--no-references", action="store_true",
                   help="skip the LRU-full and optimal (Belady) page-level references")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn only when stderr is a terminal)")
    _tier_args(r)
    _verify_parser(sub)

    i = sub.add_parser("info", help="bytes per token and what fits, single vs dual pool")
    common(i)
    i.add_argument("--hbm-gb", type=_positive_float, default=80.0, help="KV budget in GB (10^9 bytes; default 80)")
    from .route_cli import add_route_sim_parser
    add_route_sim_parser(sub)
    return p


def _verify_parser(sub: Any) -> None:
    """The ``verify`` subcommand (mutates ``sub``: adds the parser)."""
    v = sub.add_parser(
        "verify", help="reference model through the cache vs a dense forward",
        description="Run a float64 reference transformer whose KV lives only in hybridkv, under constant "
                    "eviction, and compare every logit with a cache-free forward.  The prompts are the "
                    "first N trace requests, scaled down, plus one branch prompt (a cut of an earlier "
                    "prompt and new tokens) after every third: the default N = 60 runs 80 prompts, "
                    "about 30 s on 2 CPU cores (more on a loaded machine, and with --l2-gb/--l3); "
                    f"--quick runs {_QUICK_REQUESTS} requests ({_QUICK_REQUESTS * 4 // 3} prompts, a few seconds).")
    v.add_argument("trace", nargs="?", default=None, help=f"{FORMATS} (default: the bundled Mooncake sample)")
    n = v.add_mutually_exclusive_group()
    n.add_argument("--requests", type=_int_at_least(1), default=60,
                   help="trace requests to run (default 60); a branch prompt follows every third, "
                        "so 60 runs 80 prompts (about 30 s)")
    n.add_argument("--quick", action="store_const", dest="requests", const=_QUICK_REQUESTS,
                   help=f"a short check: --requests {_QUICK_REQUESTS} ({_QUICK_REQUESTS * 4 // 3} prompts)")
    v.add_argument("--seed", type=int, default=0, help="reference model weights and branch seed (default 0)")
    v.add_argument("--hf-config", default=None, metavar="PATH",
                   help="verify your model's layout: the layer kinds and KV groups of this Hugging Face "
                        "config.json, windows scaled as the prompts are (the largest becomes 16 tokens, "
                        "the others keep their ratio), tiny float64 heads; time grows with the layer count "
                        "(default: none, a scaled-down MiMo layout: 6 layers, full at 0 and 3, window 16)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn only when stderr is a terminal)")
    _tier_args(v)


class _CliLogFormat(logging.Formatter):
    """``hybridkv: WARNING: logger: message``, except that a storage backend going
    unreachable is one plain line naming the URL the user gave (and only the first time:
    a --budgets sweep opens one backend per budget)."""

    def __init__(self, prog: str, l3: str | None) -> None:
        super().__init__("hybridkv: %(levelname)s: %(name)s: %(message)s")
        self._prog, self._l3 = prog, l3

    def format(self, record: logging.LogRecord) -> str:
        why = getattr(record, "l3_unreachable", None)
        if why is None:
            return super().format(record)
        return f"{self._prog}: L3 {self._l3 or 'backend'} is unreachable ({why}); the run continues without it"


def _once_unreachable() -> Callable[[logging.LogRecord], bool]:
    """A handler filter that lets the first ``l3_unreachable`` record through, drops later ones."""
    seen: list[bool] = []

    def keep(record: logging.LogRecord) -> bool:
        if getattr(record, "l3_unreachable", None) is None:
            return True
        if seen:
            return False
        seen.append(True)
        return True

    return keep


def _logging(args: argparse.Namespace) -> Any:
    """Level of the ``hybridkv`` loggers from --log-level / -v / -q and a stderr handler
    for the command's duration; returns the function that restores the previous state."""
    if args.log_level:
        level = getattr(logging, args.log_level.upper())
    elif args.quiet:
        level = logging.ERROR
    else:
        level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    log = logging.getLogger("hybridkv")
    saved = (log.level, log.propagate)
    handler = logging.StreamHandler()
    handler.setFormatter(_CliLogFormat(f"hybridkv {args.command}", getattr(args, "l3", None)))
    handler.addFilter(_once_unreachable())
    log.setLevel(level)
    log.addHandler(handler)
    log.propagate = False  # one copy on stderr, not another through the root logger

    def restore() -> None:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]

    return restore


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status is 0 (done), 1 (a check failed), 2 (bad input).

    A reader that closes stdout early (``hybridkv info | head -1``) ends the command
    quietly with status 1, as Python's documentation on SIGPIPE recommends: stdout is
    pointed at devnull so that the interpreter's final flush cannot fail again.
    """
    try:
        try:
            rc = _run(argv)
        except SystemExit:  # --help, --version, usage errors: flush while the error is still ours
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):  # stdout is not a file (a test's capture)
            pass
        finally:
            os.close(devnull)
        return 1


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    restore_logging = _logging(args)
    try:
        if args.command == "replay":
            return _replay(args)
        if args.command == "route-sim":
            from .route_cli import run_route_sim
            return run_route_sim(args)
        if args.command == "verify":
            return _verify(args)
        return _info(args)
    except (ValueError, ImportError, OSError) as exc:  # bad input, a missing extra, an unusable path
        if isinstance(exc, BrokenPipeError):
            raise
        print(f"hybridkv {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    finally:
        restore_logging()


def _progress(args: argparse.Namespace, label: str) -> Callable[[int, int], None] | None:
    """A progress bar on stderr, only when stderr is a terminal: ``\\r`` redraws would
    litter a pipe or a log file."""
    if args.no_progress or not sys.stderr.isatty():
        return None
    from .replay import stderr_progress
    return stderr_progress(label)


def _load(args: argparse.Namespace) -> tuple[list, str]:
    from .traces import bundled_sample, load_trace

    path = args.trace or str(bundled_sample())
    requests = load_trace(path, limit=getattr(args, "limit", None), block_size=getattr(args, "block_size", None))
    if not requests:
        raise ValueError(f"trace {path} has no requests")
    return requests, path


def _trace_name(trace: str | None, n: int) -> str:
    """What the run replayed, in words: the bundled sample is not the full trace that
    the README's table comes from, and its figures differ."""
    if trace is None:
        return (f"bundled sample of the Mooncake conversation trace (its first 2,000 requests, "
                f"{n:,} replayed; the README's table is the full trace)")
    return trace


def _tier_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--l2-gb", type=_positive_float, default=None,
                    help="L2 host tier budget in GB (10^9 bytes; enables tiers for the hybridkv system; "
                         "default: no tiers)")
    sp.add_argument("--l3", default=None, metavar="URL",
                    help="L3 storage backend URL (file:///dir, redis://host:port/db, "
                         "mooncake://host:port?metadata=http://host:port/metadata, nixl+posix:///dir; "
                         "needs --l2-gb; default: no L3)")
    sp.add_argument("--strict", action="store_true",
                    help="exit 1 if any L3 read or write failed (the run itself degrades to misses)")
    sp.add_argument("--write-policy", default="write_through", choices=("write_through", "write_back"),
                    help="L1 -> L2 write policy (default write_through)")
    sp.add_argument("--l2-eviction", default="own", choices=("own", "tree"),
                    help="the order L2 gives up full pages in: its own, or the L1 tree's evicted runs "
                         "(HiCache's host eviction; write_through only); default own")


def _tier_config(args: argparse.Namespace) -> Any:
    if getattr(args, "l2_gb", None) is None:
        if getattr(args, "l3", None):
            raise ValueError("--l3 needs --l2-gb (L3 loads go through the L2 host tier)")
        return None
    from ..tiers.tiered import TierConfig
    # A replay is not real time: L3 is assumed to keep up with the writes (an engine's
    # bounded queue drops them instead, counted), so the figures do not depend on timing.
    return TierConfig(l2_bytes=int(args.l2_gb * _GB), l3=args.l3, write_policy=args.write_policy,
                      l3_timeout_s=60.0, max_queued_writes=1 << 26, l2_eviction=getattr(args, "l2_eviction", "own"))


def _replay(args: argparse.Namespace) -> int:
    from .replay import SYSTEMS, replay

    spec = _spec(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: unknown system {s!r} (choose from {', '.join(SYSTEMS)})")
    if args.plot and not args.budgets:
        raise ValueError("--plot needs --budgets")
    if args.plot:
        _matplotlib()  # before the sweep, not after it
    requests, path = _load(args)
    budgets = args.budgets or [args.hbm_gb]
    runs = []
    for gb in budgets:
        progress = _progress(args, f"{gb:g} GB")
        out = replay(requests, spec, int(gb * _GB), systems=systems, swa_checkpoint=args.swa_checkpoint,
                     chunk=args.chunk, extension_rule=not args.no_extension_rule, progress=progress,
                     check_every=args.check_every, tiers=_tier_config(args),
                     references=not args.no_references, eviction_ranking=args.eviction_ranking)
        out["trace"] = path
        out["trace_name"] = _trace_name(args.trace, len(requests))
        out["hbm_gb"] = gb
        runs.append(_flatten(out))
    if args.plot:
        _plot(runs, args.plot, spec.name)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=1))
    else:
        for run in runs:
            _print_replay(run)
    return _l3_verdict(args, [(r.get("l3_backend", {}), r.get("l3_last_error")) for r in runs], args.json)


def _l3_verdict(args: argparse.Namespace, runs: list[tuple[dict[str, Any], str | None]], quiet: bool) -> int:
    """Print how many L3 page reads/writes failed and why (stderr under --json); 1 if
    any failed and --strict, else 0."""
    if not getattr(args, "l3", None):
        return 0
    reads = sum(int(b.get("read_keys_failed", 0)) for b, _ in runs)
    writes = sum(int(b.get("write_keys_failed", 0)) for b, _ in runs)
    why = next((e for _, e in reversed(runs) if e), None)
    if reads or writes:
        line = (f"L3 {args.l3}: {reads:,} page reads and {writes:,} page writes failed "
                f"(served as misses; last error: {why or 'none: skipped while the backend was unreachable'})")
    else:
        line = f"L3 {args.l3}: no page read or write failed"
    print(line, file=sys.stderr if quiet else sys.stdout)
    return 1 if args.strict and (reads or writes) else 0


def _flatten(out: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys are hybridkv's figures; baselines go under ``baselines``."""
    systems = out.pop("systems")
    main = systems.get("hybridkv") or next(iter(systems.values()))
    flat = dict(out)
    flat.update(main)
    flat["baselines"] = {k: v for k, v in systems.items() if k != "hybridkv"}
    bound = out["prefix_bound_hit_rate"]
    flat["ratio_vs_prefix_bound"] = main["token_hit_rate"] / bound if bound else 0.0
    for name, res in flat["baselines"].items():
        rate = res["token_hit_rate"]
        flat[f"ratio_vs_{name}"] = main["token_hit_rate"] / rate if rate else float("inf")
    return flat


def _print_replay(run: dict[str, Any]) -> None:
    print(f"trace: {run['trace_name']}")
    print(f"{run['requests']:,} requests, {run['input_tokens']:,} input tokens, "
          f"model {run['model']}, budget {run['hbm_gb']:g} GB (10^9 bytes), page {run['page_size']}, "
          f"checkpoint {run['swa_checkpoint']}, extension rule {run['extension_rule']}, "
          f"trace blocks of {'/'.join(map(str, run.get('trace_block_sizes', [])))} tokens")
    print(f"{'system':<18}{'hit rate':>10}{'hit tokens':>16}{'FLOPs saved':>12}{'match p50 us':>14}"
          f"{'match p99 us':>14}")
    rows = [("hybridkv", run)] + list(run["baselines"].items())
    for name, r in rows:
        print(f"{name:<18}{r['token_hit_rate']:>10.4f}{r['hit_tokens']:>16,}"
              f"{r.get('prefill_flops_saved_fraction', 0.0):>12.4f}{r['match_us_p50']:>14.1f}"
              f"{r['match_us_p99']:>14.1f}")
    for name, r in run.get("references", {}).items():  # upper references: SWA free, page level
        print(f"{name:<18}{r['token_hit_rate']:>10.4f}{r['hit_tokens']:>16,}"
              f"{r['prefill_flops_saved_fraction']:>12.4f}   ({r['label']})")
    print(f"{'bound':<18}{run['prefix_bound_hit_rate']:>10.4f}   (unlimited prefix cache)")
    ratios = [f"hybridkv / prefix bound = {run['ratio_vs_prefix_bound']:.3f}"]
    ratios += [f"hybridkv / {k} = {run['ratio_vs_' + k]:.2f}x" for k in run["baselines"]]
    print("; ".join(ratios + [f"replay {run['elapsed_s']:.1f} s"]))
    if "l1_hit_tokens" in run:  # tiers: where hybridkv's hits came from
        print(f"tier hits (tokens): L1 {run['l1_hit_tokens']:,}, L2 {run['l2_hit_tokens']:,}, "
              f"L3 {run['l3_hit_tokens']:,}; bytes moved {run['bytes_moved'] / _GB:.3f} GB (10^9 bytes)")
        old = run.get("l3_preexisting_hit_tokens", 0)
        if old:
            print(f"note: {old:,} of the L3 hit tokens came from data older than this run (the L3 keeps "
                  f"data between runs), so the hit rate can exceed the prefix bound of this trace alone")


def _matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'hybridkv[plot]')") from None
    return plt


def _plot(runs: list[dict[str, Any]], path: str, model: str) -> None:
    plt = _matplotlib()
    xs = [r["hbm_gb"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["token_hit_rate"] for r in runs], "o-", label="hybridkv")
    for name in runs[0]["baselines"]:
        ax.plot(xs, [r["baselines"][name]["token_hit_rate"] for r in runs], "s--", label=name)
    for name in runs[0].get("references", {}):
        ax.plot(xs, [r["references"][name]["token_hit_rate"] for r in runs], "^:",
                label=f"{name} (upper ref., SWA free)")
    ax.plot(xs, [r["prefix_bound_hit_rate"] for r in runs], ":", color="gray", label="prefix bound")
    ax.set_xscale("log")
    ax.set_xlabel("KV budget (GB = 10^9 bytes)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{model}: hit rate vs budget")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _verify(args: argparse.Namespace) -> int:
    from .model.verify import TOLERANCE, run_verify

    progress = _progress(args, "verify")
    spec = None
    if args.hf_config:
        from .model.reference import scaled_spec
        spec = scaled_spec(_hf_spec(args.hf_config, 64))
    if getattr(args, "l2_gb", None) is not None or getattr(args, "l3", None):
        from .tier_verify import run_tier_verify  # forced evict -> reload through L2/L3
        if args.l2_gb is None:
            raise ValueError("--l3 needs --l2-gb (L3 loads go through the L2 host tier)")
        out = run_tier_verify(args.trace, requests=args.requests, seed=args.seed, l2_gb=args.l2_gb,
                              l3=args.l3, write_policy=args.write_policy, progress=progress, spec=spec,
                              l2_eviction=args.l2_eviction)
    else:
        out = run_verify(args.trace, requests=args.requests, seed=args.seed, progress=progress, spec=spec)
    ok = out["mismatched_requests"] == 0
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    l3 = {"read_keys_failed": out.get("l3_backend_read_keys_failed", 0),
          "write_keys_failed": out.get("l3_backend_write_keys_failed", 0)}
    rc = _l3_verdict(args, [(l3, out.get("l3_last_error"))], args.json)
    verdict = (f"{'PASS' if ok else 'FAIL'}: {out['requests']} prompts ({args.requests} trace requests and "
               f"a branch prompt after every third), {out['mismatched_requests']} with "
               f"logits off the dense forward (max |diff| {out['max_abs_diff']:.3g}, tolerance {TOLERANCE:g}), "
               f"{out['hit_tokens']:,} hit tokens")
    print(verdict, file=sys.stderr if args.json else sys.stdout)
    return 1 if not ok else rc


def _info(args: argparse.Namespace) -> int:
    spec = _spec(args)
    budget = int(args.hbm_gb * _GB)
    f, s = spec.bytes_per_token_full, spec.bytes_per_token_swa
    w = spec.window
    db = spec.dtype_bytes
    # each sliding group keeps its own window: what one retained window costs
    snap = sum(g.window * g.bytes_per_token(db) for g in spec.sliding_groups)
    out: dict[str, Any] = {
        "model": spec.name, "layers": spec.num_layers, "full_layers": len(spec.full_layers),
        "swa_layers": len(spec.swa_layers), "window": w, "dtype": spec.dtype, "page_size": spec.page_size,
        "bytes_per_token_full": f, "bytes_per_token_swa": s, "bytes_per_token_all": f + s,
        "window_snapshot_bytes": snap, "window_snapshot_in_full_tokens": snap / f if f else 0,
        "budget_bytes": budget,
        "single_pool_tokens": budget // (f + s),
        "dual_pool_full_tokens_max": budget // f if f else 0,
        "max_concurrent_windows": budget // snap if snap else 0,
        "concurrent_sequences": {},
        "kv_groups": [{"name": g.name, "window": g.window, "layers": len(g.layers),
                       "bytes_per_token": g.bytes_per_token(spec.dtype_bytes)} for g in spec.groups],
    }
    for ctx in (8192, 32768, 131072):
        single = budget // (ctx * (f + s))
        # decode: each group's window (and a page) only
        dual = budget // (ctx * f + sum(min(ctx, g.window + spec.page_size) * g.bytes_per_token(db)
                                        for g in spec.sliding_groups))
        out["concurrent_sequences"][str(ctx)] = {"single_pool": single, "dual_pool": dual}
    from ..transfer import describe_paths
    out["copy_paths"] = describe_paths()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{spec.name}: {spec.num_layers} layers ({len(spec.full_layers)} full, {len(spec.swa_layers)} SWA), "
          f"W={w}, {spec.dtype}, page {spec.page_size}")
    print("KV groups: " + ", ".join(f"{g['name']} ({g['layers']} layers)" for g in out["kv_groups"]))
    print(f"bytes per token: full layers {f:,}, SWA layers {s:,}, all {f + s:,}")
    if len(spec.sliding_groups) > 1:
        each = ", ".join(f"{g.name} {g.window}" for g in spec.sliding_groups)
        print(f"a retained SWA window (each group its own: {each} tokens) costs {snap / 1e6:.1f} MB = "
              f"{snap / f:.0f} tokens of full KV")
    else:
        print(f"a {w}-token SWA window costs {snap / 1e6:.1f} MB = {snap / f:.0f} tokens of full KV")
    print(f"budget {args.hbm_gb:g} GB: single pool {out['single_pool_tokens']:,} tokens; "
          f"dual pool up to {out['dual_pool_full_tokens_max']:,} tokens of full KV")
    print("concurrent decoding sequences (dual pool keeps SWA for the last window + one page):")
    print(f"{'context':>10}{'single pool seqs':>18}{'dual pool seqs':>16}")
    for ctx, row in out["concurrent_sequences"].items():
        print(f"{ctx:>10}{row['single_pool']:>18,}{row['dual_pool']:>16,}")
    print("copy paths: " + "; ".join(f"{k}: {v}" for k, v in out["copy_paths"].items()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
