"""The evaluation harness: what measures and checks the library, kept apart from it.

The library (``spec``, ``pools``, ``radix``, ``cache``, ``tiers``, ``transfer``,
``routing``) is what an engine embeds; this package is what drives it from
outside to measure hit rates and to check correctness.  It imports the library;
the library never imports it (``tests/core/test_architecture.py`` checks this),
so an engine that embeds hybridkv loads none of it.

==================  ============================================================
``traces``          trace loaders (Mooncake jsonl, kv-cache-tester sessions) and
                    the token materializer; ``data/`` holds the bundled sample
``replay``          replays a trace through hybridkv and the baselines
``references``      reference policies (LRU over full KV, Belady) and the
                    prefill-FLOPs model
``soak``            bounded memory over repeated replays
                    (``python -m hybridkv.eval.soak``)
``model/``          a tiny hybrid-SWA reference transformer and ``verify``: every
                    logit of the cached path equals a dense forward
``tier_verify``     the same check through the L2/L3 tiers
``route_sim``       N workers behind a router, fed a timed trace
``route_cli``       the ``hybridkv route-sim`` command
``cli``             the ``hybridkv`` command line (``python -m hybridkv``)
``cli_parsing``     the CLI's argparse conventions
==================  ============================================================

Nothing is imported here: ``import hybridkv.eval`` costs nothing until a module
of it is used.
"""
