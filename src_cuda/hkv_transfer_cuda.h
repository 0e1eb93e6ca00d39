/*
 * hkv_transfer_cuda.h - C ABI of libhybridkv_cuda.so (no torch headers).
 *
 * Loaded by hybridkv/transfer/cuda_kernel.py with cffi ABI mode (dlopen).
 * All functions return a cudaError_t as int (0 = cudaSuccess).  The library
 * links the CUDA runtime statically, so it keeps its own "current device":
 * every entry point that touches a device takes the device index and sets
 * it first (the primary context, and so torch's streams, are shared).  The text in
 * the CDEF block must equal cuda_kernel.CUDA_CDEF (a test checks it).
 *
 * Streams and events cross the ABI as uint64_t handles (cudaStream_t /
 * cudaEvent_t values; 0 = the legacy default stream / no event), and the run
 * arrays of hkv_cuda_copy_runs as uint64_t addresses of host arrays of count
 * entries (void *dst[], const void *src[], size_t size[]): cffi passes Python
 * ints for them without building a pointer object, which keeps the per-layer
 * issue cost down.  flags: bit 0 = dry run (validate, no CUDA call), bit 1 =
 * one cudaMemcpyAsync per run instead of the batch.
 */
#ifndef HKV_TRANSFER_CUDA_H
#define HKV_TRANSFER_CUDA_H

#include "hkv_page_copy.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF-BEGIN */
int hkv_cuda_copy_pages(const hkv_page_copy_t *desc, int device, void *stream, int *vec_bytes);
int hkv_cuda_copy_pages_ex(const hkv_page_copy_t *desc, int device, uint64_t stream,
                           int max_blocks, uint64_t event, int flags, int *vec_bytes);
int hkv_cuda_copy_runs(uint64_t dsts, uint64_t srcs, uint64_t sizes, int64_t count,
                       int device, uint64_t stream, uint64_t event, int flags);
int hkv_cuda_batch_state(void);
int hkv_cuda_event_create(int device, uint64_t *event);
int hkv_cuda_event_destroy(uint64_t event);
int hkv_cuda_stream_wait_event(int device, uint64_t stream, uint64_t event);
int hkv_cuda_event_query(uint64_t event);
int hkv_cuda_device_count(int *count);
int hkv_cuda_host_device_pointer(int device, void *host, void **device_ptr);
int hkv_cuda_runtime_version(int *version);
const char *hkv_cuda_error_string(int err);
int hkv_cuda_abi_version(void);
/* CDEF-END */

#ifdef __cplusplus
}
#endif

#endif /* HKV_TRANSFER_CUDA_H */
