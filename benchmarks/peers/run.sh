#!/usr/bin/env bash
# Side-by-side peer benchmark.  Creates the peers' venvs on first use (see
# envs.sh), then replays the shared Mooncake trace (or --trace PATH) through
# hybridkv, the naive pool, SGLang 0.5.23 / 0.5.20 and vLLM 0.32 at the same
# byte budget.
#
#   benchmarks/peers/run.sh [--json] [--trace PATH] [--limit N] [--max-sessions N] [--budgets 59,594]
#                           [--systems ...] [--peer-settings sweep|default]
#                           [--vllm-retention 0,4096,16384,none] [--sglang-ratios 0.05,...,1.0]
#
# Each peer replays every value of its own knob (vLLM prefix_cache_retention_interval,
# SGLang swa_full_tokens_ratio), its default among them, unless --peer-settings default.
# With --json it prints ONE JSON object {"results": [...], "comparison": [...], ...} on
# stdout; progress goes to stderr.  Other options: python run.py --help.
# Only the venvs of the systems asked for (--systems, default all) are created.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
systems="hybridkv,sglang-0.5.23,sglang-0.5.20,vllm-0.32"
prev=""
for a in "$@"; do
    case "$a" in --systems=*) systems="${a#--systems=}" ;; esac
    [ "$prev" = "--systems" ] && systems="$a"
    prev="$a"
done
targets=()
case ",$systems," in *,sglang-0.5.23,*) targets+=(sglang0523) ;; esac
case ",$systems," in *,sglang-0.5.20,*) targets+=(sglang0520) ;; esac
case ",$systems," in *,vllm-0.32,*) targets+=(vllm) ;; esac
[ ${#targets[@]} -eq 0 ] && exec "$PYTHON" "$HERE/run.py" "$@"  # envs.sh with no target means all
while IFS='=' read -r name path; do
    case "$name" in
        sglang0523) export PYTHON_SGLANG0523="${PYTHON_SGLANG0523:-$path/bin/python}" ;;
        sglang0520) export PYTHON_SGLANG0520="${PYTHON_SGLANG0520:-$path/bin/python}" ;;
        vllm) export PYTHON_VLLM="${PYTHON_VLLM:-$path/bin/python}" ;;
    esac
done < <(bash "$HERE/envs.sh" "${targets[@]}")
exec "$PYTHON" "$HERE/run.py" "$@"
