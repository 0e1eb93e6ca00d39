#!/usr/bin/env bash
# In-engine replay through vLLM 0.32's real Scheduler (no model; the driver
# plays the model runner): vLLM's KVCacheManager at retention 0 (vllm serve's
# default) and swept, vs the hybridkv scheduler class, same KV blocks, on the
# Mooncake conversation trace or the kv-cache-tester sessions.
#
#   benchmarks/peers/in_engine_vllm.sh [--json] [--trace T] [--limit N] [--budgets 59,594]
#                                      [--systems vllm_default,vllm,hybridkv] [--retention 0,4096,16384,none]
#                                      [--hybridkv-scheduler-cls MOD.CLS] [--hybridkv-options JSON]
#                                      [--details FILE]
#
# Creates or reuses the vLLM adapter's venv (adapters/vllm/run-tests.sh
# --install-only; adapters/vllm/.venv or $HYBRIDKV_VLLM_VENV).  With --json it
# prints ONE JSON object {"vllm": [...]} on stdout; progress goes to stderr.
# Exits 1 if the content oracle saw a wrong hit.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${HYBRIDKV_VLLM_VENV:-$ROOT/adapters/vllm/.venv}"
bash "$ROOT/adapters/vllm/run-tests.sh" --install-only >&2
exec "$VENV/bin/python" "$HERE/in_engine_vllm.py" "$@"
