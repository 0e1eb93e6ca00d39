/*
 * hkv_transfer_cuda.h - C ABI of libhybridkv_cuda.so (no torch headers).
 *
 * Loaded by hybridkv/transfer/cuda_kernel.py with cffi ABI mode (dlopen).
 * All functions return a cudaError_t as int (0 = cudaSuccess).  The library
 * links the CUDA runtime statically, so it keeps its own "current device":
 * every entry point that touches a device takes the device index and sets
 * it first (the primary context, and so torch's streams, are shared).  The text in
 * the CDEF block must equal cuda_kernel.CUDA_CDEF (a test checks it).
 */
#ifndef HKV_TRANSFER_CUDA_H
#define HKV_TRANSFER_CUDA_H

#include "hkv_page_copy.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF-BEGIN */
int hkv_cuda_copy_pages(const hkv_page_copy_t *desc, int device, void *stream, int *vec_bytes);
int hkv_cuda_device_count(int *count);
int hkv_cuda_host_device_pointer(int device, void *host, void **device_ptr);
const char *hkv_cuda_error_string(int err);
int hkv_cuda_abi_version(void);
/* CDEF-END */

#ifdef __cplusplus
}
#endif

#endif /* HKV_TRANSFER_CUDA_H */
