/*
 * host_copy.c - page gather/scatter in host memory (L2 staging, CPU pools).
 *
 * Built on first use by hybridkv/transfer/host_kernel.py through cffi API
 * mode (with -fopenmp when the compiler has it).  Every call validates the
 * whole page list before the first byte is written, so a bad index never
 * leaves a half-written destination.
 *
 * Why memcpy per run: a run is page_size*heads*dim*elem bytes (96-192 KiB for
 * MiMo-sized 64-token pages), large enough that libc's memcpy streams at the
 * machine's copy bandwidth; a hand-written loop cannot beat it.
 */
#include <string.h>
#include "hkv_page_copy.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this many bytes per call, waking an OpenMP team costs more than the
 * copy itself (a few microseconds), so small copies stay single-threaded. */
#define HKV_PARALLEL_MIN_BYTES (1 << 20)

int hkv_host_openmp_enabled(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int hkv_check_desc(const hkv_page_copy_t *d) {
    if (d == NULL || d->n_pages < 0 || d->layer_begin < 0 ||
        d->layer_end < d->layer_begin) {
        return HKV_ERR_ARG;
    }
    for (int t = 0; t < 2; ++t) {
        if (d->run_bytes[t] < 0) return HKV_ERR_ARG;
        if (d->n_pages > 0 && d->run_bytes[t] > 0 &&
            (d->src[t] == NULL || d->dst[t] == NULL)) {
            return HKV_ERR_ARG;
        }
    }
    for (int64_t i = 0; i < d->n_pages; ++i) {
        const int64_t s = d->src_idx ? d->src_idx[i] : i;
        const int64_t q = d->dst_idx ? d->dst_idx[i] : i;
        if (s < 0 || s >= d->src_limit || q < 0 || q >= d->dst_limit) {
            return HKV_ERR_INDEX;
        }
    }
    return HKV_OK;
}

static inline void copy_one_run(const hkv_page_copy_t *d, int t, int64_t layer,
                                int64_t i) {
    const int64_t s = d->src_idx ? d->src_idx[i] : i;
    const int64_t q = d->dst_idx ? d->dst_idx[i] : i;
    memcpy(d->dst[t] + layer * d->dst_layer_stride[t] + q * d->dst_page_stride[t],
           d->src[t] + layer * d->src_layer_stride[t] + s * d->src_page_stride[t],
           (size_t)d->run_bytes[t]);
}

int hkv_host_copy_pages(const hkv_page_copy_t *d, int num_threads) {
    const int rc = hkv_check_desc(d);
    if (rc != HKV_OK) return rc;
    const int64_t n = d->n_pages;
    const int64_t n_layers = d->layer_end - d->layer_begin;
    /* Items ordered (tensor, layer, entry): consecutive items of one thread
     * walk one layer's pages, which is sequential memory when the page list
     * is sorted, so the hardware prefetcher keeps helping. */
    const int64_t per_tensor = n_layers * n;
    const int64_t total = 2 * per_tensor;
    const int64_t bytes = n_layers * n * (d->run_bytes[0] + d->run_bytes[1]);
    if (num_threads < 1) num_threads = 1;
    const int parallel = num_threads > 1 && bytes >= HKV_PARALLEL_MIN_BYTES;
    (void)parallel;

#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
#endif
    for (int64_t item = 0; item < total; ++item) {
        const int t = (int)(item / per_tensor);
        const int64_t rest = item - t * per_tensor;
        const int64_t layer = d->layer_begin + rest / n;
        const int64_t i = rest - (rest / n) * n;
        if (d->mask != NULL && d->mask[i] == 0) continue;
        if (d->run_bytes[t] == 0) continue;
        copy_one_run(d, t, layer, i);
    }
    return HKV_OK;
}
