/*
 * checksum.c - NH64, the payload checksum of L3 frames (algorithm id 3).
 *
 * Compiled into the host kernel (host_kernel.py appends it to host_copy.c).
 * Why not xxh3: the Python binding holds the GIL and hashes on one core, so a
 * 26 MB batch costs ~1.2 ms per pass here; NH64 runs with the GIL released,
 * on all cores (OpenMP), inside one payload as well as across payloads.
 *
 * Definition (the numpy fallback in hybridkv/tiers/storage/framing.py and the
 * tests reproduce it bit for bit).  The payload is read as 64-byte stripes of
 * eight little-endian uint64 words d[0..7]; the last partial stripe is padded
 * with zeros.  Stripe s (0-based) adds, for every lane i,
 *
 *     k        = d[i] ^ (K[i] + (s + 1) * STEP)          (mod 2^64)
 *     acc[i]  += (k mod 2^32) * (k >> 32)                (mod 2^64)
 *     acc[i^1] += d[i]                                    (mod 2^64)
 *
 * The key depends on the stripe index, so moved or swapped stripes change
 * the products; the plain sum in the neighbour lane makes every single-word
 * change visible even when its product does not change.  Being a sum over
 * stripes, the accumulators of disjoint stripe ranges simply add, which is
 * what makes the hash parallel.  Finally
 *
 *     h = len * STEP ^ SEED;  for i in 0..7: h = fmix64(h ^ (acc[i] + K[i]))
 *
 * with fmix64 the (bijective) MurmurHash3 64-bit finaliser, so a change of
 * any one accumulator always changes h.  NH64 detects corruption, it is not
 * a MAC: nothing here resists a party that chooses the bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HKV_NH_AVX2 1
#else
#define HKV_NH_AVX2 0
#endif

static const uint64_t NH_K[8] = {
    0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL, 0xA4093822299F31D0ULL, 0x082EFA98EC4E6C89ULL,
    0x452821E638D01377ULL, 0xBE5466CF34E90C6CULL, 0xC0AC29B7C97C50DDULL, 0x3F84D5B5B5470917ULL,
};
#define NH_STEP 0x9E3779B97F4A7C15ULL
#define NH_SEED 0x6A09E667F3BCC909ULL
/* Stripes per parallel task: 4096 x 64 B = 256 KiB, large enough that a task
 * costs far more than its scheduling, small enough to balance 2-64 threads. */
#define NH_TASK_STRIPES 4096
/* Below this many bytes per call the hash stays on the calling thread. */
#define NH_PARALLEL_MIN_BYTES (1 << 20)

static inline uint64_t nh_load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Add stripes [first, first + count) of p (p points at stripe `first`). */
static void nh_stripes_generic(const uint8_t *p, uint64_t first, uint64_t count, uint64_t acc[8]) {
    uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint64_t off = (first + 1) * NH_STEP;
    for (uint64_t s = 0; s < count; ++s, p += 64, off += NH_STEP) {
        for (int i = 0; i < 8; ++i) {
            const uint64_t d = nh_load64(p + 8 * i);
            const uint64_t k = d ^ (NH_K[i] + off);
            a[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
            a[i ^ 1] += d;
        }
    }
    for (int i = 0; i < 8; ++i) acc[i] += a[i];
}

#if HKV_NH_AVX2
/* Two stripes per iteration into independent accumulators: the adds of one
 * stripe do not wait for the previous stripe's. */
__attribute__((target("avx2")))
static void nh_stripes_avx2(const uint8_t *p, uint64_t first, uint64_t count, uint64_t acc[8]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
    const __m256i off0 = _mm256_set1_epi64x((long long)((first + 1) * NH_STEP));
    const __m256i off1 = _mm256_set1_epi64x((long long)((first + 2) * NH_STEP));
    const __m256i step2 = _mm256_set1_epi64x((long long)(2 * NH_STEP));
    __m256i ka0 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)NH_K), off0);
    __m256i ka1 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(NH_K + 4)), off0);
    __m256i kb0 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)NH_K), off1);
    __m256i kb1 = _mm256_add_epi64(_mm256_loadu_si256((const __m256i *)(NH_K + 4)), off1);
#define NH_AVX2_STRIPE(q, A0, A1, K0, K1)                                                     \
    do {                                                                                      \
        const __m256i d0 = _mm256_loadu_si256((const __m256i *)(q));                          \
        const __m256i d1 = _mm256_loadu_si256((const __m256i *)((q) + 32));                   \
        const __m256i x0 = _mm256_xor_si256(d0, K0);                                          \
        const __m256i x1 = _mm256_xor_si256(d1, K1);                                          \
        /* (k mod 2^32) * (k >> 32): mul_epu32 multiplies the low halves */                  \
        A0 = _mm256_add_epi64(A0, _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)));           \
        A1 = _mm256_add_epi64(A1, _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32)));           \
        /* lane i^1 += d[i]: swap the 64-bit words of each 128-bit half */                   \
        A0 = _mm256_add_epi64(A0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2)));         \
        A1 = _mm256_add_epi64(A1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2)));         \
    } while (0)
    uint64_t s = 0;
    for (; s + 2 <= count; s += 2, p += 128) {
        NH_AVX2_STRIPE(p, a0, a1, ka0, ka1);
        NH_AVX2_STRIPE(p + 64, b0, b1, kb0, kb1);
        ka0 = _mm256_add_epi64(ka0, step2);
        ka1 = _mm256_add_epi64(ka1, step2);
        kb0 = _mm256_add_epi64(kb0, step2);
        kb1 = _mm256_add_epi64(kb1, step2);
    }
    if (s < count) NH_AVX2_STRIPE(p, a0, a1, ka0, ka1);
#undef NH_AVX2_STRIPE
    uint64_t t[8], u[8];
    _mm256_storeu_si256((__m256i *)t, a0);
    _mm256_storeu_si256((__m256i *)(t + 4), a1);
    _mm256_storeu_si256((__m256i *)u, b0);
    _mm256_storeu_si256((__m256i *)(u + 4), b1);
    for (int i = 0; i < 8; ++i) acc[i] += t[i] + u[i];
}

/* One stripe is one 512-bit vector; four stripes per iteration. */
__attribute__((target("avx512f")))
static void nh_stripes_avx512(const uint8_t *p, uint64_t first, uint64_t count, uint64_t acc[8]) {
    __m512i a[4], k[4];
    const __m512i key = _mm512_loadu_si512((const void *)NH_K);
    const __m512i step4 = _mm512_set1_epi64((long long)(4 * NH_STEP));
    for (int j = 0; j < 4; ++j) {
        a[j] = _mm512_setzero_si512();
        k[j] = _mm512_add_epi64(key, _mm512_set1_epi64((long long)((first + 1 + j) * NH_STEP)));
    }
#define NH_AVX512_STRIPE(q, A, K)                                                              \
    do {                                                                                       \
        const __m512i d = _mm512_loadu_si512((const void *)(q));                               \
        const __m512i x = _mm512_xor_si512(d, K);                                              \
        A = _mm512_add_epi64(A, _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32)));                \
        A = _mm512_add_epi64(A, _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2))); \
    } while (0)
    uint64_t s = 0;
    for (; s + 4 <= count; s += 4, p += 256) {
        NH_AVX512_STRIPE(p, a[0], k[0]);
        NH_AVX512_STRIPE(p + 64, a[1], k[1]);
        NH_AVX512_STRIPE(p + 128, a[2], k[2]);
        NH_AVX512_STRIPE(p + 192, a[3], k[3]);
        for (int j = 0; j < 4; ++j) k[j] = _mm512_add_epi64(k[j], step4);
    }
    for (int j = 0; s < count; ++s, ++j, p += 64) NH_AVX512_STRIPE(p, a[j], k[j]);
#undef NH_AVX512_STRIPE
    uint64_t t[8];
    _mm512_storeu_si512((void *)t, _mm512_add_epi64(_mm512_add_epi64(a[0], a[1]),
                                                    _mm512_add_epi64(a[2], a[3])));
    for (int i = 0; i < 8; ++i) acc[i] += t[i];
}
#endif

/* SIMD level for this CPU: 2 = AVX-512F, 1 = AVX2, 0 = portable loop. */
static int nh_simd_level(void) {
#if HKV_NH_AVX2 && !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    return cached;
#else
    return 0;
#endif
}

/* simd: the level to use (see nh_simd_level; callers cap it by the CPU's). */
static void nh_stripes(const uint8_t *p, uint64_t first, uint64_t count, uint64_t acc[8], int simd) {
#if HKV_NH_AVX2
    if (simd >= 2) {
        nh_stripes_avx512(p, first, count, acc);
        return;
    }
    if (simd == 1) {
        nh_stripes_avx2(p, first, count, acc);
        return;
    }
#endif
    (void)simd;
    nh_stripes_generic(p, first, count, acc);
}

static int nh_cap(int simd) {
    const int have = nh_simd_level();
    if (simd < 0) return have;
    return simd < have ? simd : have;
}

/* Accumulate the whole stripes of n bytes starting at stripe index `first`
 * (n must be a multiple of 64).  The streaming hasher feeds chunks through
 * this; the batch function below uses the same stripe routine. */
int hkv_nh64_accumulate(const uint8_t *p, uint64_t n, uint64_t first, uint64_t *acc, int simd) {
    if ((n & 63) != 0 || acc == NULL || (n && p == NULL)) return -2;
    nh_stripes(p, first, n / 64, acc, nh_cap(simd));
    return 0;
}

static uint64_t nh_fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

uint64_t hkv_nh64_finish(const uint64_t *acc, uint64_t len) {
    uint64_t h = (len * NH_STEP) ^ NH_SEED;
    for (int i = 0; i < 8; ++i) h = nh_fmix64(h ^ (acc[i] + NH_K[i]));
    return h;
}

/* The tail stripe (zero padded) of payload p of n bytes, if any. */
static void nh_tail(const uint8_t *p, uint64_t n, uint64_t acc[8], int simd) {
    const uint64_t full = n / 64, rest = n & 63;
    if (!rest) return;
    uint8_t pad[64];
    memset(pad, 0, sizeof pad);
    memcpy(pad, p + full * 64, rest);
    nh_stripes(pad, full, 1, acc, simd);
}

/*
 * out[j] = NH64 of the lens[j] bytes at ptrs[j], for j < n, on up to
 * num_threads threads (0 or 1: the calling thread).  simd: -1 = the best
 * this CPU has, 0 = portable loop, 1 = at most AVX2, 2 = at most AVX-512
 * (tests compare all levels; they give identical results).  Returns 0, or -2 on a bad argument
 * (nothing written), -3 if scratch memory could not be allocated.
 */
int hkv_nh64_batch(const uint8_t *const *ptrs, const uint64_t *lens, uint64_t *out, int64_t n,
                   int num_threads, int simd) {
    if (n < 0 || (n > 0 && (ptrs == NULL || lens == NULL || out == NULL))) return -2;
    for (int64_t j = 0; j < n; ++j)
        if (lens[j] && ptrs[j] == NULL) return -2;
    simd = nh_cap(simd);
    uint64_t total = 0, tasks = 0;
    for (int64_t j = 0; j < n; ++j) {
        total += lens[j];
        tasks += (lens[j] / 64 + NH_TASK_STRIPES - 1) / NH_TASK_STRIPES;
    }
    if (num_threads < 1) num_threads = 1;
    if (total < NH_PARALLEL_MIN_BYTES || tasks < 2) num_threads = 1;
    if (num_threads == 1) {
        for (int64_t j = 0; j < n; ++j) {
            uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            nh_stripes(ptrs[j], 0, lens[j] / 64, acc, simd);
            nh_tail(ptrs[j], lens[j], acc, simd);
            out[j] = hkv_nh64_finish(acc, lens[j]);
        }
        return 0;
    }
    /* One task = up to NH_TASK_STRIPES whole stripes of one payload; each
     * task has its own accumulators, summed per payload afterwards. */
    int64_t *task_payload = (int64_t *)malloc(tasks * sizeof(int64_t));
    uint64_t *task_first = (uint64_t *)malloc(tasks * sizeof(uint64_t));
    uint64_t *task_acc = (uint64_t *)calloc(tasks * 8, sizeof(uint64_t));
    if (!task_payload || !task_first || !task_acc) {
        free(task_payload);
        free(task_first);
        free(task_acc);
        return -3;
    }
    uint64_t t = 0;
    for (int64_t j = 0; j < n; ++j)
        for (uint64_t s = 0; s < lens[j] / 64; s += NH_TASK_STRIPES, ++t) {
            task_payload[t] = j;
            task_first[t] = s;
        }
    const int64_t ntasks = (int64_t)tasks;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
#endif
    for (int64_t i = 0; i < ntasks; ++i) {
        const int64_t j = task_payload[i];
        const uint64_t first = task_first[i], stripes = lens[j] / 64;
        const uint64_t count = stripes - first < NH_TASK_STRIPES ? stripes - first : NH_TASK_STRIPES;
        nh_stripes(ptrs[j] + first * 64, first, count, task_acc + 8 * i, simd);
    }
    t = 0;
    for (int64_t j = 0; j < n; ++j) {
        uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (; t < tasks && task_payload[t] == j; ++t)
            for (int i = 0; i < 8; ++i) acc[i] += task_acc[8 * t + i];
        nh_tail(ptrs[j], lens[j], acc, simd);
        out[j] = hkv_nh64_finish(acc, lens[j]);
    }
    free(task_payload);
    free(task_first);
    free(task_acc);
    return 0;
}

/*
 * Read up to n bytes at `offset` of file `fd` into buf and NH64 them on the
 * way: each chunk is hashed right after it lands, while it is still in cache,
 * instead of a second pass over the whole payload later (the file backend's
 * read path; one call per payload, GIL released).  Returns the bytes read
 * (short at end of file) and stores their NH64 in *csum, or -errno.
 */
#include <errno.h>
#include <unistd.h>
#define NH_READ_CHUNK (1u << 20) /* a multiple of 64; fits in L2 */

int64_t hkv_pread_nh64(int fd, uint8_t *buf, uint64_t n, int64_t offset, uint64_t *csum) {
    if (csum == NULL || (n && buf == NULL) || offset < 0) return -EINVAL;
    const int simd = nh_simd_level();
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint64_t got = 0, hashed = 0;
    while (got < n) {
        const uint64_t want = n - got < NH_READ_CHUNK ? n - got : NH_READ_CHUNK;
        const ssize_t r = pread(fd, buf + got, (size_t)want, (off_t)(offset + (int64_t)got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) break;
        got += (uint64_t)r;
        const uint64_t upto = got & ~(uint64_t)63;
        if (upto > hashed) {
            nh_stripes(buf + hashed, hashed / 64, (upto - hashed) / 64, acc, simd);
            hashed = upto;
        }
    }
    nh_tail(buf, got, acc, simd);
    *csum = hkv_nh64_finish(acc, got);
    return (int64_t)got;
}
