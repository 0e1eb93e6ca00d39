#!/usr/bin/env bash
# In-engine equal-memory benchmark (SGLang 0.5.23): hybridkv's radix backend at
# the SWA/full split it chooses vs SGLang's UnifiedRadixCache at its default and
# best --swa-full-tokens-ratio, same KV bytes, through SGLang's real pools.
#
#   benchmarks/peers/in_engine.sh [--json] [--trace T] [--limit N] [--ratios 0.05,0.1,...] [--details FILE]
#                                 [--systems hybridkv,unified] [--page-size N] [--tiers [--sizes S] [--host-factor F]]
#
# Creates or reuses the SGLang venv of adapters/sglang/run-tests.sh
# (adapters/sglang/.venv or $HYBRIDKV_SGLANG_VENV).  With --json it prints ONE
# JSON object {"sglang": [...]} on stdout; progress goes to stderr.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${HYBRIDKV_SGLANG_VENV:-$ROOT/adapters/sglang/.venv}"
bash "$ROOT/adapters/sglang/run-tests.sh" --install-only >&2
exec "$VENV/bin/python" "$HERE/in_engine.py" "$@"
