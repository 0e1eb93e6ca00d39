#!/usr/bin/env bash
# The whole test suite on a fresh machine.  Installs what the tests need under a
# torch==2.13.0 constraint (a version pin: it keeps pip from replacing the torch
# that is installed; it does not choose the CPU build, which comes from PyTorch's
# CPU index), then runs every suite; exits non-zero if any fails.
#
# Each phase starts with a "== ..." header.  pip and apt-get write to
# .ci-out/install.log (in the checkout, ignored by git), printed only when an
# install fails; the docs are built into .ci-out/docs.  pytest prints why each
# test was skipped (-rs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1
OUT="$ROOT/.ci-out"
mkdir -p "$OUT"
CONSTRAINT="$OUT/torch-constraint.txt"
LOG="$OUT/install.log"
: > "$LOG"
echo "torch==2.13.0" > "$CONSTRAINT"

# Run an install command with its output in $LOG; on failure show the log and stop.
quietly() {
    echo "\$ $*" >> "$LOG"
    if ! "$@" >> "$LOG" 2>&1; then
        echo "install failed: $*" >&2
        echo "---- $LOG" >&2
        tail -n 200 "$LOG" >&2
        exit 1
    fi
}

echo "== install (torch==2.13.0 constraint; pip output in .ci-out/install.log)"
# system packages for the redis and mooncake backends (root only; skipped if present)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    need=()
    command -v redis-server >/dev/null || need+=(redis-server)
    ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
    if [ ${#need[@]} -gt 0 ]; then
        echo "   apt-get install ${need[*]}"
        quietly apt-get update -qq
        quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
    fi
fi
quietly python3 -m pip install -q -c "$CONSTRAINT" torch==2.13.0
quietly python3 -m pip install -q -c "$CONSTRAINT" -e ".[test,redis,mooncake,nixl,plot,docs]"
echo "   torch $(python3 -c 'import torch; print(torch.__version__)'), hybridkv installed editable"

# the CUDA page-copy library (loads without a GPU; its kernel tests need one)
if command -v nvcc >/dev/null; then
    echo "== CUDA copy library (make -C src_cuda)"
    make -s -C src_cuda
fi

SUITES=()
for suite in adapters/sglang/run-tests.sh adapters/vllm/run-tests.sh; do
    [ -f "$suite" ] && SUITES+=("$suite")
done
# The adapters' virtual environments are made while the core suite runs (mostly
# downloads and unpacking); their output goes to .ci-out/adapter-venvs.log, shown
# if one fails.  Each suite then finds its venv ready (its stamp file).
VENVS_LOG="$OUT/adapter-venvs.log"
: > "$VENVS_LOG"
(for suite in "${SUITES[@]}"; do bash "$suite" --install-only || exit 1; done) >> "$VENVS_LOG" 2>&1 &
VENVS_PID=$!

echo "== core suite (pytest tests; the adapters' venvs are made meanwhile)"
core=0
python3 -m pytest -q -rs -p no:cacheprovider tests || core=$?
if ! wait "$VENVS_PID"; then
    echo "making an adapter's virtual environment failed:" >&2
    tail -n 200 "$VENVS_LOG" >&2
    exit 1
fi
[ "$core" = 0 ] || exit "$core"

for suite in "${SUITES[@]}"; do
    echo "== $(dirname "$suite") suite ($suite, its own virtual environment)"
    bash "$suite"
done
if [ -f docs/build.sh ]; then
    echo "== docs (sphinx-build -W)"
    rm -rf "$OUT/docs"
    HYBRIDKV_DOCS_NO_INSTALL=1 bash docs/build.sh "$OUT/docs"  # the docs extra is installed above
fi
echo "== all suites passed"
