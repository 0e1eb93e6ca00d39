#!/usr/bin/env bash
# Create (or refresh) the adapter's own virtual environment and run its tests.
#
#   adapters/sglang/run-tests.sh [pytest args...]
#   adapters/sglang/run-tests.sh --install-only     # create/refresh the venv, run nothing
#
# SGLang 0.5.23 pins a CUDA torch, so its pure-Python dependencies are installed
# first under a torch==2.13.0 constraint (keeping the CPU torch installed here),
# then sglang itself with --no-deps: in that order pip never checks sglang's own
# pins (CUDA torch, flashinfer, ...), which this venv deliberately leaves out.
# pip's output goes to $VENV/install.log, printed only if an install fails.  The venv lives in adapters/sglang/.venv (gitignored, or
# $HYBRIDKV_SGLANG_VENV); a stamp file makes a second run skip all installs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${HYBRIDKV_SGLANG_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.hybridkv-sglang-stamp"
# Bump the suffix whenever the dependency list below changes.
WANT="sglang==0.5.23 torch==2.13.0 deps-3 root=$ROOT"
SGLANG_DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
             pydantic pyzmq tqdm IPython aiohttp apache-tvm-ffi transformers dill sentencepiece
             compressed-tensors gguf openai partial_json_parser einops)
CORE_DEPS=(sortedcontainers cffi pytest hypothesis)

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
    echo "[run-tests] installing sglang 0.5.23 and deps into $VENV (first run: ~2-3 min; log $LOG)"
    : > "$LOG"
    CONSTRAINT="$VENV/torch-constraint.txt"
    echo "torch==2.13.0" > "$CONSTRAINT"
    pip_quietly install -c "$CONSTRAINT" "torch==2.13.0"
    pip_quietly install -c "$CONSTRAINT" "${SGLANG_DEPS[@]}" "${CORE_DEPS[@]}"
    pip_quietly install --no-deps "sglang==0.5.23"
    # The core and the adapter, editable, without letting pip touch torch again.
    pip_quietly install -c "$CONSTRAINT" --no-deps --no-build-isolation -e "$ROOT" -e "$HERE"
    echo "$WANT" > "$STAMP"
fi
if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi
cd "$HERE"
exec "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider tests "$@"
