#!/usr/bin/env bash
# Side-by-side peer benchmark.  Creates the peers' venvs on first use (see
# envs.sh), then replays the shared Mooncake trace (or --trace PATH) through
# hybridkv, the naive pool, SGLang 0.5.23 / 0.5.20 and vLLM 0.32 at the same
# byte budget.
#
#   benchmarks/peers/run.sh [--json] [--trace PATH] [--limit N] [--budgets 59,594] [--systems ...]
#
# With --json it prints ONE JSON object {"results": [...], ...} on stdout;
# progress goes to stderr.  Other options: python run.py --help.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
while IFS='=' read -r name path; do
    case "$name" in
        sglang0523) export PYTHON_SGLANG0523="${PYTHON_SGLANG0523:-$path/bin/python}" ;;
        sglang0520) export PYTHON_SGLANG0520="${PYTHON_SGLANG0520:-$path/bin/python}" ;;
        vllm) export PYTHON_VLLM="${PYTHON_VLLM:-$path/bin/python}" ;;
    esac
done < <(bash "$HERE/envs.sh")
exec "$PYTHON" "$HERE/run.py" "$@"
