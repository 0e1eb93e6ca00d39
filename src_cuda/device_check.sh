#!/usr/bin/env bash
# The one GPU check, for a machine with a CUDA device (about 5 minutes on an H200):
#
#   1. builds the kernels (make -C src_cuda);
#   2. runs the whole core / tiers / routing / transfer suite, the CUDA tests
#      included (pytest-xdist when present), on this machine's Python;
#   3. the transfer benchmark (copy engines and SM kernel, each direction,
#      vs cudaMemcpy of the same bytes);
#   4. the arena check (KV arena on CUDA within its budget; verify on CUDA);
#   5. benchmarks/gpu_layerwise.py (layerwise load beside compute), and the
#      reference measurement beside it when its directory is given
#      (HYBRIDKV_REFERENCE_DIR, default ../shared/tools/gpu);
#   6. compute-sanitizer memcheck on the CUDA tests (fewer examples);
#   7. benchmarks/gpu_summary.py: summary.json and one table.
#
#   OUT=results/ bash src_cuda/device_check.sh     # from the repository root
#
# Writes at most 8 files to $OUT (default .): suite.txt, transfer_bench.json,
# arena_check.json, gpu_layerwise.json, reference_layerwise.json,
# sanitizer.txt, env.txt, summary.json.  Needs: nvcc, a CUDA build of torch,
# pytest + hypothesis; cffi and pycparser come from wheels in .whl/ when the
# Python lacks them (see docs/transfer.md, "Running the GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-.}"
mkdir -p "$out_dir"
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import cffi' 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        site="$(mktemp -d)"
        "$PY" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)' || {
    echo "device_check: torch sees no CUDA device" >&2
    exit 2
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    nvcc --version | tail -2
} > "$out_dir/env.txt"
cat "$out_dir/env.txt"

make -s -C src_cuda || { echo "device_check: make -C src_cuda failed" >&2; exit 1; }
export HYBRIDKV_CUDA_LIB="$PWD/src_cuda/build/libhybridkv_cuda.so"

step() { echo "== $1 ($(date +%T))"; }
status=0
xdist=()
"$PY" -c 'import xdist' 2>/dev/null && xdist=(-n "$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))")

step "suite: tests/ (core, tiers, routing, transfer; CUDA tests included)"
timeout 240 "$PY" -m pytest tests -q -rs -p no:cacheprovider "${xdist[@]}" > "$out_dir/suite.txt" 2>&1 || status=1
tail -n 3 "$out_dir/suite.txt"

step "transfer benchmark"
timeout 90 "$PY" benchmarks/transfer.py --cuda --json --repeats 5 > "$out_dir/transfer_bench.json" || status=1

step "arena check"
timeout 60 "$PY" benchmarks/gpu_arena.py --json > "$out_dir/arena_check.json" || status=1

step "layerwise load beside compute"
timeout 150 "$PY" benchmarks/gpu_layerwise.py --json --repeats 5 > "$out_dir/gpu_layerwise.json" || status=1
ref="${HYBRIDKV_REFERENCE_DIR:-../shared/tools/gpu}"
if [ -f "$ref/layerwise_gpu.py" ]; then
    step "reference measurement ($ref/layerwise_gpu.py --mm 4096)"
    PYTHONPATH="$ref:$PYTHONPATH" timeout 150 "$PY" "$ref/layerwise_gpu.py" --mm 4096 \
        --sizes 4096,16384,65536 > "$out_dir/reference_layerwise.json" 2>&1 || true
fi

step "compute-sanitizer memcheck (CUDA tests)"
if command -v compute-sanitizer >/dev/null; then
    HYBRIDKV_GPU_EXAMPLES=4 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 0 \
        "$PY" -m pytest -q -p no:cacheprovider tests/transfer/test_transfer_cuda.py \
        tests/transfer/test_transfer_plan.py -k "gpu or cuda" > "$out_dir/sanitizer.txt" 2>&1 || status=1
    tail -n 2 "$out_dir/sanitizer.txt"
else
    echo "compute-sanitizer not found" > "$out_dir/sanitizer.txt"
fi

step "summary"
"$PY" benchmarks/gpu_summary.py "$out_dir" || status=1
exit "$status"
