/*
 * hkv_page_copy.h - the one descriptor shared by the C host kernel
 * (host_copy.c) and the CUDA kernels (src_cuda/page_copy.cu).
 *
 * A "page copy" moves, for every entry i of a page list, every layer in
 * [layer_begin, layer_end) and both tensors t (0 = K, 1 = V), one contiguous
 * run of run_bytes[t] bytes:
 *
 *   src[t] + layer * src_layer_stride[t] + src_idx[i] * src_page_stride[t]
 *     -> dst[t] + layer * dst_layer_stride[t] + dst_idx[i] * dst_page_stride[t]
 *
 * A KV buffer [layers, slots, heads, dim] has layer stride slots*heads*dim*es
 * and page stride = run = page_size*heads*dim*es; a page-major staging buffer
 * has layer stride = run and page stride = bytes of one whole page (K and V
 * of all layers).  Expressing copy, pack and unpack with one descriptor is
 * what lets one kernel (per device kind) serve all three.
 *
 * The text between CDEF-BEGIN and CDEF-END is parsed by cffi at run time, so
 * it must stay plain C declarations (no macros, no #if).
 */
#ifndef HKV_PAGE_COPY_H
#define HKV_PAGE_COPY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF-BEGIN */
typedef struct {
    int64_t n_pages;           /* entries in the page list */
    const int64_t *src_idx;    /* NULL means identity: entry i reads page i */
    const int64_t *dst_idx;    /* NULL means identity: entry i writes page i */
    const uint8_t *mask;       /* NULL means all; else entry i only if mask[i] != 0 */
    int64_t layer_begin;       /* absolute layer numbers, relative to src/dst bases */
    int64_t layer_end;
    int64_t src_limit;         /* src_idx values must lie in [0, src_limit) */
    int64_t dst_limit;         /* dst_idx values must lie in [0, dst_limit) */
    const char *src[2];        /* K base, V base */
    char *dst[2];
    int64_t run_bytes[2];
    int64_t src_layer_stride[2];
    int64_t src_page_stride[2];
    int64_t dst_layer_stride[2];
    int64_t dst_page_stride[2];
} hkv_page_copy_t;

int hkv_check_desc(const hkv_page_copy_t *desc);
int hkv_host_copy_pages(const hkv_page_copy_t *desc, int num_threads);
int hkv_host_copy_pages_mode(const hkv_page_copy_t *desc, int num_threads, int mode);
int hkv_host_stream_supported(int mode);
int hkv_host_openmp_enabled(void);
/* A prepared plan's byte runs (the copy engines' work list) run by memcpy:
 * dsts/srcs/sizes are addresses of count-entry uint64 arrays; flags bit 0 =
 * dry run (validate, copy nothing).  host_copy.c. */
int hkv_host_copy_runs(uint64_t dsts, uint64_t srcs, uint64_t sizes, int64_t count,
                       int num_threads, int flags);
/* NH64 payload checksum (checksum.c; definition there) */
int hkv_nh64_batch(const uint8_t *const *ptrs, const uint64_t *lens, uint64_t *out, int64_t n,
                   int num_threads, int simd);
int hkv_nh64_accumulate(const uint8_t *p, uint64_t n, uint64_t first, uint64_t *acc, int simd);
uint64_t hkv_nh64_finish(const uint64_t *acc, uint64_t len);
int64_t hkv_pread_nh64(int fd, uint8_t *buf, uint64_t n, int64_t offset, uint64_t *csum);
/* CDEF-END */

/* Return codes of the host functions (CUDA functions return cudaError_t). */
#define HKV_OK 0
#define HKV_ERR_INDEX (-1)
#define HKV_ERR_ARG (-2)

#ifdef __cplusplus
}
#endif

#endif /* HKV_PAGE_COPY_H */
