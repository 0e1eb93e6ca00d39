#!/usr/bin/env bash
# The whole test suite on a fresh machine.  Installs what the tests need
# (torch pinned to the CPU build), then runs every suite; exits non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1
CONSTRAINT=$(mktemp)
echo "torch==2.13.0" > "$CONSTRAINT"

# system packages for the redis and mooncake backends (root only; skipped if present)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    need=()
    command -v redis-server >/dev/null || need+=(redis-server)
    ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
    if [ ${#need[@]} -gt 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    fi
fi

python3 -m pip install -q -c "$CONSTRAINT" torch==2.13.0
python3 -m pip install -q -c "$CONSTRAINT" -e ".[test,redis,mooncake,nixl,plot,docs]"

# the CUDA page-copy library (loads without a GPU; its kernel tests need one)
if command -v nvcc >/dev/null; then
    make -s -C src_cuda
fi

python3 -m pytest -q -rs -p no:cacheprovider tests

for suite in adapters/sglang/run-tests.sh adapters/vllm/run-tests.sh; do
    if [ -f "$suite" ]; then
        echo "== $suite"
        bash "$suite"
    fi
done
if [ -f docs/build.sh ]; then
    echo "== docs"
    bash docs/build.sh "$(mktemp -d)"
fi
