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
#include <stdint.h>
#include <string.h>
#include "hkv_page_copy.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HKV_HAVE_STREAM 1
#else
#define HKV_HAVE_STREAM 0
#endif

/* Below this many bytes per call, waking an OpenMP team costs more than the
 * copy itself (a few microseconds), so small copies stay single-threaded. */
#define HKV_PARALLEL_MIN_BYTES (1 << 20)

/* At and above this many bytes per call the destination cannot stay in
 * cache anyway, so runs are written with non-temporal (streaming) stores:
 * an ordinary store first reads the destination line (read-for-ownership),
 * so a cached copy moves 3 bytes over the memory bus per byte copied and a
 * streaming copy 2.  glibc's memcpy only streams above ~3/4 of the LLC per
 * call, which our 100-200 KiB runs never reach. */
#define HKV_STREAM_MIN_BYTES (4 << 20)

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

#if HKV_HAVE_STREAM
/* memcpy with 32-byte streaming stores (AVX, chosen at run time so the
 * build stays portable across x86-64 CPUs); the caller fences. */
__attribute__((target("avx"))) static void copy_stream_avx(char *dst, const char *src,
                                                             size_t n) {
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (size_t b = n / 128; b > 0; --b) {
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)(src + 0));
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        const __m256i a2 = _mm256_loadu_si256((const __m256i *)(src + 64));
        const __m256i a3 = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)(dst + 0), a0);
        _mm256_stream_si256((__m256i *)(dst + 32), a1);
        _mm256_stream_si256((__m256i *)(dst + 64), a2);
        _mm256_stream_si256((__m256i *)(dst + 96), a3);
        src += 128;
        dst += 128;
    }
    memcpy(dst, src, n & 127);
}

/* The SSE2 (baseline x86-64) variant of copy_stream_avx. */
static void copy_stream_sse2(char *dst, const char *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (size_t b = n / 64; b > 0; --b) {
        const __m128i a0 = _mm_loadu_si128((const __m128i *)(src + 0));
        const __m128i a1 = _mm_loadu_si128((const __m128i *)(src + 16));
        const __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 32));
        const __m128i a3 = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a0);
        _mm_stream_si128((__m128i *)(dst + 16), a1);
        _mm_stream_si128((__m128i *)(dst + 32), a2);
        _mm_stream_si128((__m128i *)(dst + 48), a3);
        src += 64;
        dst += 64;
    }
    memcpy(dst, src, n & 63);
}
#endif

static inline void copy_one_run(const hkv_page_copy_t *d, int t, int64_t layer,
                                int64_t i, int stream) {
    const int64_t s = d->src_idx ? d->src_idx[i] : i;
    const int64_t q = d->dst_idx ? d->dst_idx[i] : i;
    char *dst = d->dst[t] + layer * d->dst_layer_stride[t] + q * d->dst_page_stride[t];
    const char *src = d->src[t] + layer * d->src_layer_stride[t] + s * d->src_page_stride[t];
#if HKV_HAVE_STREAM
    if (stream == 2) {
        copy_stream_avx(dst, src, (size_t)d->run_bytes[t]);
        return;
    }
    if (stream == 1) {
        copy_stream_sse2(dst, src, (size_t)d->run_bytes[t]);
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)d->run_bytes[t]);
}

int hkv_host_stream_supported(int mode) {
#if HKV_HAVE_STREAM
    if (mode == 1) return 1;
    if (mode == 2) return __builtin_cpu_supports("avx") ? 1 : 0;
#endif
    return mode == 0;
}

int hkv_host_copy_pages(const hkv_page_copy_t *d, int num_threads) {
    return hkv_host_copy_pages_mode(d, num_threads, -1);
}

int hkv_host_copy_pages_mode(const hkv_page_copy_t *d, int num_threads, int mode) {
    const int rc = hkv_check_desc(d);
    if (rc != HKV_OK) return rc;
    const int64_t n = d->n_pages;
    const int64_t n_layers = d->layer_end - d->layer_begin;
    /* Dynamic chunks of 4 runs: on a shared machine one thread may lose its
     * core for a while, and a static split would make the call wait for it.
     * Items ordered (tensor, layer, entry): consecutive items of one thread
     * walk one layer's pages, which is sequential memory when the page list
     * is sorted, so the hardware prefetcher keeps helping. */
    const int64_t per_tensor = n_layers * n;
    const int64_t total = 2 * per_tensor;
    const int64_t bytes = n_layers * n * (d->run_bytes[0] + d->run_bytes[1]);
    if (num_threads < 1) num_threads = 1;
    const int parallel = num_threads > 1 && bytes >= HKV_PARALLEL_MIN_BYTES;
    /* mode -1 = choose (streaming for large calls, AVX when present);
     * 0 = memcpy, 1 = SSE2 streaming, 2 = AVX streaming (tests pin these). */
    int stream = mode;
    if (mode < 0) {
        stream = bytes >= HKV_STREAM_MIN_BYTES;
        if (stream && hkv_host_stream_supported(2)) stream = 2;
    } else if (!hkv_host_stream_supported(mode)) {
        return HKV_ERR_ARG;
    }
    (void)parallel;

#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads) if (parallel)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
        for (int64_t item = 0; item < total; ++item) {
            const int t = (int)(item / per_tensor);
            const int64_t rest = item - t * per_tensor;
            const int64_t layer = d->layer_begin + rest / n;
            const int64_t i = rest - (rest / n) * n;
            if (d->mask != NULL && d->mask[i] == 0) continue;
            if (d->run_bytes[t] == 0) continue;
            copy_one_run(d, t, layer, i, stream);
        }
#if HKV_HAVE_STREAM
        /* Streaming stores are weakly ordered: each thread fences its own
         * before the call returns, so the data is visible to any reader. */
        if (stream) _mm_sfence();
#endif
    }
    return HKV_OK;
}

int hkv_host_copy_runs(uint64_t dsts, uint64_t srcs, uint64_t sizes, int64_t count,
                       int num_threads, int flags) {
    if (count < 0 || (count > 0 && (dsts == 0 || srcs == 0 || sizes == 0))) return HKV_ERR_ARG;
    if (flags & 1) return HKV_OK;
    char *const *dst = (char *const *)(uintptr_t)dsts;
    const char *const *src = (const char *const *)(uintptr_t)srcs;
    const uint64_t *size = (const uint64_t *)(uintptr_t)sizes;
    uint64_t bytes = 0;
    for (int64_t i = 0; i < count; ++i) bytes += size[i];
    if (num_threads < 1) num_threads = 1;
    const int parallel = num_threads > 1 && bytes >= HKV_PARALLEL_MIN_BYTES;
    (void)parallel;
#ifdef _OPENMP
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(dynamic, 4)
#endif
    for (int64_t i = 0; i < count; ++i) memcpy(dst[i], src[i], (size_t)size[i]);
    return HKV_OK;
}
