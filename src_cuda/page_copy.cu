/*
 * page_copy.cu - the CUDA side of hybridkv's page copies, two mechanisms:
 *
 * 1. Copy engines (DMA), for host <-> device: a prepared plan hands over a
 *    list of byte runs (dst, src, size), already coalesced on the host, and
 *    hkv_cuda_copy_runs issues them as ONE cudaMemcpyBatchAsync (CUDA 12.8+,
 *    flag PreferOverlapWithCompute) or, where the runtime refuses the batch,
 *    one cudaMemcpyAsync per run from C.  The SMs stay with the model: a
 *    kernel that reads pinned host memory from the SMs keeps the model's
 *    kernels on other streams from running beside it (measured: no overlap),
 *    a DMA copy does not.
 *
 * 2. The SM page-copy kernel, for device <-> device (and, on request, mapped
 *    pinned host memory): a grid-stride loop over fixed-size chunks of every
 *    (entry, layer, tensor) run, so the grid can be capped to a few blocks
 *    (max_blocks) where it runs beside compute, and a full grid balances runs
 *    of any size.  Entries whose mask byte is 0 are skipped (prepared plans
 *    compact them away on the host instead).
 *
 * Vector width: 16-byte accesses when every base, stride and run length is a
 * multiple of 16, else the widest of 8/4/2/1 that all of them allow.
 *
 * Every entry point takes the device index and sets it first: the library
 * links the CUDA runtime statically and keeps its own current device (the
 * primary context, and so torch's streams, events and pinned memory, are
 * shared).  Flag HKV_FLAG_DRY_RUN (bit 0) validates and returns before any
 * CUDA call: the same issue path with the launch stubbed, for measuring the
 * host cost of issuing on machines without a GPU.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#include "hkv_page_copy.h"
#include "hkv_transfer_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;              // loads in flight per thread before the stores
constexpr int64_t kChunkBytes = 64 << 10;  // one grid-stride work item
constexpr int kMaxDevices = 64;
constexpr int kFlagDryRun = 1;
constexpr int kFlagNoBatch = 2;
constexpr size_t kMaxBatch = 1 << 14;   // runs per cudaMemcpyBatchAsync call

template <typename V>
__global__ void __launch_bounds__(kThreads)
page_copy_kernel(hkv_page_copy_t d, int64_t chunks_per_run, int64_t total) {
    const int64_t n_layers = d.layer_end - d.layer_begin;
    const int64_t chunk = kChunkBytes / (int64_t)sizeof(V);
    for (int64_t w = blockIdx.x; w < total; w += gridDim.x) {
        // w = ((entry * n_layers + layer) * 2 + tensor) * chunks_per_run + c:
        // neighbouring blocks copy neighbouring chunks of one run.
        const int64_t c = w % chunks_per_run;
        int64_t r = w / chunks_per_run;
        const int t = (int)(r & 1);
        r >>= 1;
        const int64_t layer = d.layer_begin + r % n_layers;
        const int64_t i = r / n_layers;
        if (d.mask != nullptr && d.mask[i] == 0) continue;
        const int64_t n = d.run_bytes[t] / (int64_t)sizeof(V);
        const int64_t begin = c * chunk;
        if (begin >= n) continue;
        const int64_t end = begin + chunk < n ? begin + chunk : n;
        const int64_t s = d.src_idx ? d.src_idx[i] : i;
        const int64_t q = d.dst_idx ? d.dst_idx[i] : i;
        const V *__restrict__ src = reinterpret_cast<const V *>(
            d.src[t] + layer * d.src_layer_stride[t] + s * d.src_page_stride[t]);
        V *__restrict__ dst = reinterpret_cast<V *>(
            d.dst[t] + layer * d.dst_layer_stride[t] + q * d.dst_page_stride[t]);
        const int64_t step = (int64_t)kThreads * kUnroll;
        int64_t j = begin + threadIdx.x;
        // kUnroll independent loads before the stores: latency, not width,
        // bounds a one-load-at-a-time loop (most of all across PCIe).
        for (; j + (kUnroll - 1) * kThreads < end; j += step) {
            V reg[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) reg[u] = src[j + u * kThreads];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) dst[j + u * kThreads] = reg[u];
        }
        for (; j < end; j += kThreads) dst[j] = src[j];
    }
}

int common_alignment(const hkv_page_copy_t *d) {
    uint64_t bits = 0;
    for (int t = 0; t < 2; ++t) {
        bits |= (uint64_t)(uintptr_t)d->src[t] | (uint64_t)(uintptr_t)d->dst[t];
        bits |= (uint64_t)d->run_bytes[t];
        bits |= (uint64_t)d->src_layer_stride[t] | (uint64_t)d->src_page_stride[t];
        bits |= (uint64_t)d->dst_layer_stride[t] | (uint64_t)d->dst_page_stride[t];
    }
    for (int w = 16; w > 1; w >>= 1) {
        if ((bits & (uint64_t)(w - 1)) == 0) return w;
    }
    return 1;
}

// Multiprocessors of each device, read once (cudaDeviceGetAttribute is cheap
// but not free, and the launch path runs once per layer).
int g_sm_count[kMaxDevices];

int sm_count(int device) {
    if (device < 0 || device >= kMaxDevices) return 132;
    if (g_sm_count[device] == 0) {
        int n = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
            n <= 0) {
            n = 132;
        }
        g_sm_count[device] = n;
    }
    return g_sm_count[device];
}

template <typename V>
cudaError_t launch(const hkv_page_copy_t &d, int max_blocks, int device, cudaStream_t stream) {
    const int64_t chunk = kChunkBytes;
    const int64_t longest = d.run_bytes[0] > d.run_bytes[1] ? d.run_bytes[0] : d.run_bytes[1];
    const int64_t chunks_per_run = longest > 0 ? (longest + chunk - 1) / chunk : 1;
    const int64_t total = d.n_pages * (d.layer_end - d.layer_begin) * 2 * chunks_per_run;
    // A full grid: enough resident blocks to cover every SM several times.
    int64_t grid = (int64_t)sm_count(device) * 8;
    if (max_blocks > 0 && grid > max_blocks) grid = max_blocks;
    if (grid > total) grid = total;
    page_copy_kernel<V><<<(unsigned)grid, kThreads, 0, stream>>>(d, chunks_per_run, total);
    return cudaGetLastError();
}

cudaError_t launch_any(const hkv_page_copy_t &d, int w, int max_blocks, int device,
                       cudaStream_t s) {
    switch (w) {
        case 16: return launch<uint4>(d, max_blocks, device, s);
        case 8: return launch<uint2>(d, max_blocks, device, s);
        case 4: return launch<uint32_t>(d, max_blocks, device, s);
        case 2: return launch<uint16_t>(d, max_blocks, device, s);
        default: return launch<uint8_t>(d, max_blocks, device, s);
    }
}

// cudaMemcpyBatchAsync refuses the legacy default stream: batches issued
// there run on a library side stream fenced by events both ways.
struct Fence {
    cudaStream_t side = nullptr;
    cudaEvent_t before = nullptr;
    cudaEvent_t after = nullptr;
};
Fence g_fence[kMaxDevices];
std::mutex g_fence_mutex;
int g_batch_state = 0;  // 0 = untried, 1 = works, -1 = refused by this runtime/driver

cudaError_t fence_setup(int device, Fence **out) {
    if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
    Fence &f = g_fence[device];
    if (f.side == nullptr) {
        cudaError_t e = cudaStreamCreateWithFlags(&f.side, cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&f.before, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&f.after, cudaEventDisableTiming);
        if (e != cudaSuccess) return e;
    }
    *out = &f;
    return cudaSuccess;
}

cudaError_t memcpy_loop(void *const *dst, const void *const *src, const size_t *size,
                        size_t count, cudaStream_t s) {
    for (size_t i = 0; i < count; ++i) {
        const cudaError_t e = cudaMemcpyAsync(dst[i], src[i], size[i], cudaMemcpyDefault, s);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t memcpy_batch(void *const *dst, const void *const *src, const size_t *size,
                         size_t count, cudaStream_t s) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
    for (size_t at = 0; at < count; at += kMaxBatch) {
        const size_t n = count - at < kMaxBatch ? count - at : kMaxBatch;
        // The API takes non-const size arrays; it does not write them.
        const cudaError_t e = cudaMemcpyBatchAsync(
            dst + at, src + at, const_cast<size_t *>(size + at), n, &attr, &first, 1, s);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

// One batch (or the per-run loop where the batch is refused) on stream s.
cudaError_t issue_runs(void *const *dst, const void *const *src, const size_t *size,
                       size_t count, cudaStream_t s, int flags) {
    if ((flags & kFlagNoBatch) || g_batch_state < 0) return memcpy_loop(dst, src, size, count, s);
    const cudaError_t e = memcpy_batch(dst, src, size, count, s);
    if (e == cudaSuccess) {
        g_batch_state = 1;
        return e;
    }
    if (g_batch_state == 0 && (e == cudaErrorNotSupported || e == cudaErrorInvalidValue ||
                               e == cudaErrorCallRequiresNewerDriver)) {
        // Never worked here (older driver): remember, and copy run by run.
        // Runs the batch may have queued already are copied again: the same
        // bytes to the same place, so the result is unchanged.
        (void)cudaGetLastError();
        g_batch_state = -1;
        return memcpy_loop(dst, src, size, count, s);
    }
    return e;
}

}  // namespace

extern "C" int hkv_cuda_copy_pages(const hkv_page_copy_t *desc, int device, void *stream,
                                   int *vec_bytes) {
    return hkv_cuda_copy_pages_ex(desc, device, (uint64_t)(uintptr_t)stream, 0, 0, 0, vec_bytes);
}

extern "C" int hkv_cuda_copy_pages_ex(const hkv_page_copy_t *desc, int device, uint64_t stream,
                                      int max_blocks, uint64_t event, int flags,
                                      int *vec_bytes) {
    if (desc == nullptr || desc->n_pages < 0 || desc->layer_end < desc->layer_begin ||
        max_blocks < 0) {
        return (int)cudaErrorInvalidValue;
    }
    const int w = common_alignment(desc);
    if (vec_bytes != nullptr) *vec_bytes = w;
    if (flags & kFlagDryRun) return (int)cudaSuccess;
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    if (desc->n_pages > 0 && desc->layer_end > desc->layer_begin) {
        const cudaError_t e = launch_any(*desc, w, max_blocks, device, s);
        if (e != cudaSuccess) return (int)e;
    }
    if (event != 0) return (int)cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), s);
    return (int)cudaSuccess;
}

extern "C" int hkv_cuda_copy_runs(uint64_t dsts, uint64_t srcs, uint64_t sizes, int64_t count,
                                  int device, uint64_t stream, uint64_t event, int flags) {
    if (count < 0 || (count > 0 && (dsts == 0 || srcs == 0 || sizes == 0))) {
        return (int)cudaErrorInvalidValue;
    }
    if (flags & kFlagDryRun) return (int)cudaSuccess;
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    void *const *dst = reinterpret_cast<void *const *>(dsts);
    const void *const *src = reinterpret_cast<const void *const *>(srcs);
    const size_t *size = reinterpret_cast<const size_t *>(sizes);
    const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    cudaError_t e = cudaSuccess;
    if (count > 0) {
        if (s == nullptr && !(flags & kFlagNoBatch) && g_batch_state >= 0) {
            // Legacy default stream: run the batch on the side stream, ordered
            // after everything queued before it and before everything after.
            std::lock_guard<std::mutex> hold(g_fence_mutex);
            Fence *f = nullptr;
            e = fence_setup(device, &f);
            if (e == cudaSuccess) e = cudaEventRecord(f->before, s);
            if (e == cudaSuccess) e = cudaStreamWaitEvent(f->side, f->before, 0);
            if (e == cudaSuccess) e = issue_runs(dst, src, size, (size_t)count, f->side, flags);
            if (e == cudaSuccess) e = cudaEventRecord(f->after, f->side);
            if (e == cudaSuccess) e = cudaStreamWaitEvent(s, f->after, 0);
        } else {
            e = issue_runs(dst, src, size, (size_t)count, s, flags);
        }
    }
    if (e == cudaSuccess && event != 0) e = cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), s);
    return (int)e;
}

extern "C" int hkv_cuda_batch_state(void) { return g_batch_state; }

extern "C" int hkv_cuda_event_create(int device, uint64_t *event) {
    if (event == nullptr) return (int)cudaErrorInvalidValue;
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    cudaEvent_t e = nullptr;
    const cudaError_t rc = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *event = (uint64_t)(uintptr_t)e;
    return (int)rc;
}

extern "C" int hkv_cuda_event_destroy(uint64_t event) {
    // Destroying an event still pending is allowed: CUDA releases it once done.
    return event == 0 ? (int)cudaSuccess
                      : (int)cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

extern "C" int hkv_cuda_stream_wait_event(int device, uint64_t stream, uint64_t event) {
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    return (int)cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                    reinterpret_cast<cudaEvent_t>(event), 0);
}

extern "C" int hkv_cuda_event_query(uint64_t event) {
    return (int)cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
}

extern "C" int hkv_cuda_device_count(int *count) {
    return (int)cudaGetDeviceCount(count);
}

extern "C" int hkv_cuda_host_device_pointer(int device, void *host, void **device_ptr) {
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    return (int)cudaHostGetDevicePointer(device_ptr, host, 0);
}

extern "C" int hkv_cuda_runtime_version(int *version) {
    return (int)cudaRuntimeGetVersion(version);
}

extern "C" const char *hkv_cuda_error_string(int err) {
    return cudaGetErrorString(static_cast<cudaError_t>(err));
}

extern "C" int hkv_cuda_abi_version(void) { return 2; }
