#!/usr/bin/env bash
# One-shot GPU check for the transfer layer, for a machine with a CUDA device:
# builds the kernels, runs every transfer test (the CUDA ones included, which
# skip on CPU-only machines) and the GPU benchmark (page copies H2D / D2H /
# D2D vs cudaMemcpy of the same bytes; target ratio >= 0.8).
#
#   bash src_cuda/device_check.sh            # from the repository root
#
# Needs: nvcc, a CUDA build of torch, pytest + hypothesis (nixl optional).
# Writes transfer_tests.txt, transfer_bench.json and arena_check.json (the KV
# arena on CUDA: memory_allocated vs the budget, verify on CUDA buffers) to
# $OUT (default: .).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-.}"
mkdir -p "$out_dir"

python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)' || {
    echo "device_check: torch sees no CUDA device" >&2
    exit 2
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

make -C src_cuda
export HYBRIDKV_CUDA_LIB="$PWD/src_cuda/build/libhybridkv_cuda.so"

status=0
python -m pytest tests/transfer -q -rs 2>&1 | tee "$out_dir/transfer_tests.txt" || status=1
python benchmarks/transfer.py --cuda --json --repeats 5 | tee "$out_dir/transfer_bench.json" || status=1
python benchmarks/gpu_arena.py --json | tee "$out_dir/arena_check.json" || status=1
exit "$status"
