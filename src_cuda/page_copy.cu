/*
 * page_copy.cu - copy a list of KV pages for all layers of one attention kind
 * in a single launch (device<->device, device<->mapped pinned host).
 *
 * Grid: x = page-list entry, y = layer, z = tensor (0 = K, 1 = V); one block
 * copies one contiguous run (page_size*heads*dim elements).  Entries whose
 * mask byte is 0 exit at once: that is how SWA layers copy only the pages of
 * the window with the same page list as the full layers.
 *
 * Vector width: 16-byte accesses when every base, stride and run length is a
 * multiple of 16, else the widest of 8/4/2/1 that all of them allow.
 *
 * Host memory: the kernel dereferences pinned host memory through its mapped
 * device address (zero-copy over PCIe/C2C), so a D2H/H2D page copy is one
 * kernel, not one cudaMemcpy per page.  The launcher passes device pointers
 * for everything in the descriptor (index arrays, mask, bases).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "hkv_page_copy.h"
#include "hkv_transfer_cuda.h"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // loads in flight per thread before the stores

template <typename V>
__global__ void __launch_bounds__(kThreads) page_copy_kernel(hkv_page_copy_t d) {
    const int64_t i = blockIdx.x;
    const int64_t layer = d.layer_begin + blockIdx.y;
    const int t = blockIdx.z;
    if (d.mask != nullptr && d.mask[i] == 0) return;
    const int64_t s = d.src_idx ? d.src_idx[i] : i;
    const int64_t q = d.dst_idx ? d.dst_idx[i] : i;
    const V *__restrict__ src = reinterpret_cast<const V *>(
        d.src[t] + layer * d.src_layer_stride[t] + s * d.src_page_stride[t]);
    V *__restrict__ dst = reinterpret_cast<V *>(
        d.dst[t] + layer * d.dst_layer_stride[t] + q * d.dst_page_stride[t]);
    const int64_t n = d.run_bytes[t] / (int64_t)sizeof(V);
    const int64_t step = (int64_t)kThreads * kUnroll;
    int64_t j = threadIdx.x;
    // Issue kUnroll independent loads before storing: with host memory on the
    // other side of PCIe, latency (not width) bounds a one-load-at-a-time loop.
    for (; j + (kUnroll - 1) * kThreads < n; j += step) {
        V r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) r[u] = src[j + u * kThreads];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) dst[j + u * kThreads] = r[u];
    }
    for (; j < n; j += kThreads) dst[j] = src[j];
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

template <typename V>
cudaError_t launch(const hkv_page_copy_t &d, cudaStream_t stream) {
    const dim3 grid((unsigned)d.n_pages, (unsigned)(d.layer_end - d.layer_begin), 2);
    page_copy_kernel<V><<<grid, kThreads, 0, stream>>>(d);
    return cudaGetLastError();
}

}  // namespace

extern "C" int hkv_cuda_copy_pages(const hkv_page_copy_t *desc, int device, void *stream,
                                   int *vec_bytes) {
    if (desc == nullptr || desc->n_pages < 0 || desc->layer_end < desc->layer_begin) {
        return (int)cudaErrorInvalidValue;
    }
    // Grid limits: x < 2^31, y < 2^16.
    if (desc->n_pages > 0x7fffffffLL || desc->layer_end - desc->layer_begin > 65535) {
        return (int)cudaErrorInvalidValue;
    }
    const int w = common_alignment(desc);
    if (vec_bytes != nullptr) *vec_bytes = w;
    if (desc->n_pages == 0 || desc->layer_end == desc->layer_begin) return (int)cudaSuccess;
    // This library's (static) runtime has its own current device; launch on
    // the device that owns the caller's stream.
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (w) {
        case 16: return (int)launch<uint4>(*desc, s);
        case 8: return (int)launch<uint2>(*desc, s);
        case 4: return (int)launch<uint32_t>(*desc, s);
        case 2: return (int)launch<uint16_t>(*desc, s);
        default: return (int)launch<uint8_t>(*desc, s);
    }
}

extern "C" int hkv_cuda_device_count(int *count) {
    return (int)cudaGetDeviceCount(count);
}

extern "C" int hkv_cuda_host_device_pointer(int device, void *host, void **device_ptr) {
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return (int)set;
    return (int)cudaHostGetDevicePointer(device_ptr, host, 0);
}

extern "C" const char *hkv_cuda_error_string(int err) {
    return cudaGetErrorString(static_cast<cudaError_t>(err));
}

extern "C" int hkv_cuda_abi_version(void) { return 1; }
