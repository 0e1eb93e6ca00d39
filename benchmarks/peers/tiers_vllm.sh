#!/usr/bin/env bash
# vLLM 0.32's own KV offload (OffloadingConnector: CPU spec, and tiering CPU + fs)
# vs hybridkv's L1/L2/L3 tiers at equal device and host bytes, on the shared
# traces.  Runs tiers_vllm.py with the vLLM venv's python (created on first
# use by envs.sh; hybridkv is installed editable into it).
#
#   benchmarks/peers/tiers_vllm.sh [--json] [--mooncake-limit 3000] [--sessions 16]
#                                  [--l1-gb 59] [--host-gb 594] [--retention 0,16384,none]
#
# The L3 / fs tiers write hundreds of thousands of small files into the
# temporary folder; TMPDIR=/dev/shm makes that (and their removal) fast.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$(bash "$HERE/envs.sh" vllm | sed -n 's/^vllm=//p')"
exec "$VENV/bin/python" "$HERE/tiers_vllm.py" "$@"
