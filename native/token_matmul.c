/* Matmuls on a few input rows, for decode (backends/token_kernels.py): out = x @ W.T with W read as the container
   stores it (float32, bfloat16, float16, FP4 E2M1 + E8M0 scales, MXFP4, Q8_0, FP8 E4M3 + float32 block scales),
   each weight byte read once and turned into float32 in registers; and `moe_token`, a token's routed experts in
   one call. One token reads every weight for a handful of multiply-adds, so this is a memory-bound scan: torch's
   bf16 GEMV reached 5-7 GB/s here against 10-14 GB/s for this loop, and decoding a stored expert to a float32
   matrix first costs a write and a re-read of twice its size.

   Arithmetic: products and sums in float32 (explicit FMAs, -ffp-contract=off elsewhere). Every weight becomes the
   float32 the container's decoders give (FP4: the caller's table of code values per scale byte; Q8_0: f16 scale
   x int8; FP8: the e4m3 value times its block's float32 scale, one float32 product). With round_bf16 the inputs
   are rounded to bfloat16 first (torch's round to nearest even), and moe_token rounds each hidden activation
   once, as the fused FP4 kernel does; the linears' round_bf16 is a set of flags, ROUND_INPUT and ROUND_OUTPUT
   (the results rounded to bfloat16 too, as a bfloat16 layer's are, kept float32).

   FP4 groups of 32 inputs hold 16 bytes: E2M1 puts elements 2j and 2j + 1 in byte j (low nibble first), MXFP4 j
   and j + 16. Both are computed as lows . X[0:16] + highs . X[16:32] of a group, with X the input arranged for the
   layout ("deinterleaved" for E2M1): an input is arranged once per call, not once per row.

   Threads: a pool started on first use (threads - 1 workers; the caller is worker 0), each part a static share
   of the rows, at most one thread per CPU the process may use. Workers spin for a short while between calls (a
   token's calls come back to back), then sleep. */
#if defined(__linux__)
#define _GNU_SOURCE /* sched_getaffinity */
#include <sched.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "token_matmul.h"

enum { ROUND_INPUT = 1, ROUND_OUTPUT = 2 };
#define GROUP 32

static int64_t row_bytes(int64_t kind, int64_t cols) {
    switch (kind) {
    case KIND_F32: return 4 * cols;
    case KIND_BF16: case KIND_F16: return 2 * cols;
    case KIND_FP4_E2M1: return cols / 2;
    case KIND_MXFP4: return cols / GROUP * 17;
    case KIND_FP8_E4M3: return cols;
    default: return cols / GROUP * 34;  /* Q8_0: f16 scale, 32 int8 */
    }
}

static int valid(const matrix_t *m) {
    if (m->kind < 0 || m->kind >= KIND_COUNT || m->rows < 0 || m->cols < 1 || !m->data) return 0;
    if (m->kind == KIND_FP8_E4M3) return m->scale != NULL;
    if (m->kind >= KIND_FP4_E2M1 && m->cols % GROUP) return 0;
    if ((m->kind == KIND_FP4_E2M1 || m->kind == KIND_MXFP4) && !m->table) return 0;
    return m->kind != KIND_FP4_E2M1 || m->scale;
}

static int deinterleaved(int64_t kind) { return kind == KIND_FP4_E2M1; }

static float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff;
    if (exp == 0) {  /* zero or subnormal: man x 2^-24, exact in float32 */
        const float v = ldexpf((float)man, -24);
        return sign ? -v : v;
    }
    if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
    return bits_float(sign | ((exp + 112) << 23) | (man << 13));
}

/* an e4m3fn byte's value (torch's float8_e4m3fn): s eeee mmm, 2^(e - 7) x 1.mmm, e = 0 m x 2^-9, 0x7f NaN */
static float fp8_value(uint8_t b) {
    const uint32_t mag = b & 0x7f;
    float v = mag < 8 ? (float)mag * (1.0f / 512) : bits_float((mag << 20) + (120u << 23));
    if (mag == 0x7f) v = NAN;
    return b & 0x80 ? -v : v;
}

/* row r's block scales of an FP8_E4M3 matrix (one per FP8_BLOCK columns) */
static inline const float *fp8_scales(const matrix_t *m, int64_t r) {
    return (const float *)m->scale + (r / FP8_BLOCK) * ((m->cols + FP8_BLOCK - 1) / FP8_BLOCK);
}

/* the index within its group where an input of logical position j (0..31) goes for a deinterleaved layout */
static int64_t arranged(int64_t k) {
    const int64_t j = k % GROUP;
    return k - j + (j & 1 ? GROUP / 2 + j / 2 : j / 2);
}

/* x [K] -> dst [K] arranged for `kind` (E2M1: each group's even inputs, then its odd ones; such a matrix has
   whole groups), rounded if asked */
static void arrange(const float *x, int64_t K, int64_t kind, int round_bf16, float *dst) {
    const int regroup = deinterleaved(kind) && K % GROUP == 0;
    for (int64_t k = 0; k < K; k++) dst[regroup ? arranged(k) : k] = round_bf16 ? round_to_bf16(x[k]) : x[k];
}

/* --- one row . one arranged input ----------------------------------------------------------------------------- */

static float dot_scalar(const matrix_t *m, int64_t r, const float *x) {
    const int64_t K = m->cols;
    const uint8_t *row = m->data + r * row_bytes(m->kind, K);
    float acc = 0.0f;
    switch (m->kind) {
    case KIND_F32:
        for (int64_t k = 0; k < K; k++) { float w; memcpy(&w, row + 4 * k, 4); acc = fmaf(w, x[k], acc); }
        return acc;
    case KIND_BF16: case KIND_F16:
        for (int64_t k = 0; k < K; k++) {
            uint16_t h;
            memcpy(&h, row + 2 * k, 2);
            acc = fmaf(m->kind == KIND_BF16 ? bits_float((uint32_t)h << 16) : f16_value(h), x[k], acc);
        }
        return acc;
    case KIND_FP8_E4M3: {
        const float *scales = fp8_scales(m, r);
        for (int64_t k = 0; k < K; k++) acc = fmaf(fp8_value(row[k]) * scales[k / FP8_BLOCK], x[k], acc);
        return acc;
    }
    case KIND_Q8_0:
        for (int64_t g = 0; g < K / GROUP; g++) {
            const uint8_t *block = row + 34 * g;
            const float d = f16_value((uint16_t)(block[0] | block[1] << 8));
            for (int j = 0; j < GROUP; j++) acc = fmaf(d * (float)(int8_t)block[2 + j], x[g * GROUP + j], acc);
        }
        return acc;
    default:
        for (int64_t g = 0; g < K / GROUP; g++) {
            const uint8_t *bytes, *s;
            if (m->kind == KIND_MXFP4) { s = row + 17 * g; bytes = s + 1; }
            else { s = m->scale + r * (K / GROUP) + g; bytes = row + 16 * g; }
            const float *values = m->table + 16 * *s, *xg = x + g * GROUP;
            for (int j = 0; j < 16; j++) {
                acc = fmaf(values[bytes[j] & 15], xg[j], acc);
                acc = fmaf(values[bytes[j] >> 4], xg[16 + j], acc);
            }
        }
        return acc;
    }
}

#define DOTS_MAX 8  /* inputs a weight vector is decoded once for (dots_rows) */
#define DOTS_ROWS 4  /* an FP4 matrix's rows side by side on one input */
#define DOTS_SHARED 4  /* inputs two rows take side by side */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
/* row r's E8M0 scale bytes of an E2M1 matrix (NULL for MXFP4, whose scales are in its rows) */
static inline const uint8_t *fp4_scales(const matrix_t *m, int64_t r) {
    return m->kind == KIND_FP4_E2M1 ? m->scale + r * (m->cols / GROUP) : NULL;
}

/* group g of an FP4 row (E2M1 or MXFP4) as float32: *lo its inputs 0..15 of the arranged order, *hi 16..31; `row`
   the row's bytes, `scales` its E8M0 bytes (E2M1) */
static inline __attribute__((always_inline)) void fp4_group(const matrix_t *m, const uint8_t *row,
                                                            const uint8_t *scales, int64_t g, __m512 *lo, __m512 *hi) {
    const uint8_t *bytes, *s;
    if (m->kind == KIND_MXFP4) { s = row + 17 * g; bytes = s + 1; }
    else { s = scales + g; bytes = row + 16 * g; }
    const __m512 values = _mm512_loadu_ps(m->table + 16 * *s);
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    *lo = _mm512_permutexvar_ps(codes, values);  /* (the permute reads an index's low 4 bits only) */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), values);
}

/* 16 e4m3fn bytes' values times their block's scale, each one rounding as fp8_value(b) x scale: (value / 256) x
   (scale x 256), unless scale x 256 would overflow where value x scale need not */
static inline __attribute__((always_inline)) __m512 fp8_scaled(__m128i bytes, float scale) {
    const __m512 over_256 = fp8_e4m3_ps_over_256(bytes);
    if (fabsf(scale) < 0x1p119f) return _mm512_mul_ps(over_256, _mm512_set1_ps(scale * 256.0f));
    return _mm512_mul_ps(_mm512_mul_ps(over_256, _mm512_set1_ps(256.0f)), _mm512_set1_ps(scale));
}

/* R rows side by side are R streams the hardware prefetchers lose between blocks: each row's bytes at `offset`
   asked for in the next block of R rows while this one computes (one row alone streams as it is) */
static inline __attribute__((always_inline)) void ahead(const uint8_t *row, int R, int64_t bytes, int64_t offset) {
    if (R > 1) _mm_prefetch((const char *)row + R * bytes + offset, _MM_HINT_T0);
}

/* acc[j] += v * xs[j][k : k + 16] (the lanes of `mask`) for j < n: one 16-wide chunk of weights, decoded, into
   each input's accumulator */
static inline __attribute__((always_inline)) void chunk_fma(__m512 *acc, __m512 v, const float *const *xs, int n,
                                                            int64_t k, __mmask16 mask) {
    _Pragma("GCC unroll 8")
    for (int j = 0; j < n; j++) acc[j] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(mask, xs[j] + k), acc[j]);
}

/* out[i * stride + j] = row r + i of m . xs[j] for i < R <= DOTS_ROWS, j < n, R x n <= DOTS_MAX, each weight vector
   decoded once for all n and each input chunk loaded once for all R rows; each (row, input)'s accumulators take the
   same operations in the same order whatever R and n, so a result is, to the bit, the one-input dot's (dot_avx512:
   R = n = 1), as decode's batched step needs */
static inline __attribute__((always_inline)) void dots_avx512(const matrix_t *m, int64_t r, int R,
                                                              const float *const *xs, int n, float *out,
                                                              int64_t stride) {
    const int64_t K = m->cols, bytes = row_bytes(m->kind, K);
    const uint8_t *rows[DOTS_ROWS];
    __m512 a0[DOTS_MAX], a1[DOTS_MAX];  /* (row i, input j)'s at i * n + j: R x n <= DOTS_MAX */
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++) {
        rows[i] = m->data + (r + i) * bytes;
        _Pragma("GCC unroll 8")
        for (int j = 0; j < n; j++) a0[i * n + j] = a1[i * n + j] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    switch (m->kind) {
    case KIND_F32:
        for (; k + 32 <= K; k += 32)
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                const float *w = (const float *)rows[i];
                ahead(rows[i], R, bytes, 4 * k);
                ahead(rows[i], R, bytes, 4 * k + 64);
                const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < n; j++) {
                    a0[i * n + j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[j] + k), a0[i * n + j]);
                    a1[i * n + j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[j] + k + 16), a1[i * n + j]);
                }
            }
        for (; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                chunk_fma(a0 + i * n, _mm512_maskz_loadu_ps(mask, (const float *)rows[i] + k), xs, n, k, mask);
            }
        }
        break;
    case KIND_BF16: case KIND_F16: {
        const int bf16 = m->kind == KIND_BF16;
        for (; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                if (!((k / 16) & 1)) ahead(rows[i], R, bytes, 2 * k);
                const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)rows[i] + k);
                const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                      : _mm512_cvtph_ps(h);
                if ((k / 16) & 1)
                    chunk_fma(a1 + i * n, v, xs, n, k, mask);
                else
                    chunk_fma(a0 + i * n, v, xs, n, k, mask);
            }
        }
        break;
    }
    case KIND_FP8_E4M3: {
        const float *scales[DOTS_ROWS];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) scales[i] = fp8_scales(m, r + i);
        for (; k + 32 <= K; k += 32)  /* two whole chunks, a0's and a1's (32 divides FP8_BLOCK: both in one block) */
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                if (!((k / 32) & 1)) ahead(rows[i], R, bytes, k);
                const float scale = scales[i][k / FP8_BLOCK];
                chunk_fma(a0 + i * n, fp8_scaled(_mm_loadu_si128((const __m128i *)(rows[i] + k)), scale), xs, n, k,
                          0xffff);
                chunk_fma(a1 + i * n, fp8_scaled(_mm_loadu_si128((const __m128i *)(rows[i] + k + 16)), scale), xs, n,
                          k + 16, 0xffff);
            }
        for (; k < K; k += 16) {  /* the tail (16 divides FP8_BLOCK: a chunk lies in one block) */
            const __mmask16 mask = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                const __m512 v = fp8_scaled(_mm_maskz_loadu_epi8(mask, rows[i] + k), scales[i][k / FP8_BLOCK]);
                if ((k / 16) & 1)
                    chunk_fma(a1 + i * n, v, xs, n, k, mask);
                else
                    chunk_fma(a0 + i * n, v, xs, n, k, mask);
            }
        }
        break;
    }
    case KIND_Q8_0:
        for (int64_t g = 0; g < K / GROUP; g++)
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                const uint8_t *block = rows[i] + 34 * g;
                ahead(rows[i], R, bytes, 34 * g);
                const __m512 d = _mm512_set1_ps(f16_value((uint16_t)(block[0] | block[1] << 8)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 2))));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 18))));
                const __m512 wl = _mm512_mul_ps(d, lo), wh = _mm512_mul_ps(d, hi);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < n; j++) {
                    a0[i * n + j] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xs[j] + g * GROUP), a0[i * n + j]);
                    a1[i * n + j] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xs[j] + g * GROUP + 16), a1[i * n + j]);
                }
            }
        break;
    default: {
        const uint8_t *scales[DOTS_ROWS];
        _Pragma("GCC unroll 8")
        for (int i = 0; i < R; i++) scales[i] = fp4_scales(m, r + i);
        for (int64_t g = 0; g < K / GROUP; g++)
            _Pragma("GCC unroll 8")
            for (int i = 0; i < R; i++) {
                __m512 lo, hi;
                if (!(g & 3)) ahead(rows[i], R, bytes, m->kind == KIND_MXFP4 ? 17 * g : 16 * g);
                fp4_group(m, rows[i], scales[i], g, &lo, &hi);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < n; j++) {
                    a0[i * n + j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xs[j] + g * GROUP), a0[i * n + j]);
                    a1[i * n + j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xs[j] + g * GROUP + 16), a1[i * n + j]);
                }
            }
        break;
    }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 8")
        for (int j = 0; j < n; j++) out[i * stride + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i * n + j], a1[i * n + j]));
}

static float dot_avx512(const matrix_t *m, int64_t r, const float *x) {
    float y;
    dots_avx512(m, r, 1, &x, 1, &y, 1);
    return y;
}
#endif

static int use_vector = 1;  /* token_matmul_set_level(0): the scalar loop (self-checks compare both) */

static inline float dot(const matrix_t *m, int64_t r, const float *x) {
#ifdef HAVE_AVX512
    if (use_vector) return dot_avx512(m, r, x);
#endif
    return dot_scalar(m, r, x);
}

#ifdef HAVE_AVX512
/* dots_avx512 with constant counts (the accumulators stay in registers) */
static void dots_fixed(const matrix_t *m, int64_t r, int R, const float *const *xs, int n, float *out,
                       int64_t stride) {
    switch (R * 16 + n) {
    case 4 * 16 + 1: dots_avx512(m, r, 4, xs, 1, out, stride); break;
    case 2 * 16 + 1: dots_avx512(m, r, 2, xs, 1, out, stride); break;
    case 2 * 16 + 2: dots_avx512(m, r, 2, xs, 2, out, stride); break;
    case 2 * 16 + 3: dots_avx512(m, r, 2, xs, 3, out, stride); break;
    case 2 * 16 + 4: dots_avx512(m, r, 2, xs, 4, out, stride); break;
    case 16 + 2: dots_avx512(m, r, 1, xs, 2, out, stride); break;
    case 16 + 3: dots_avx512(m, r, 1, xs, 3, out, stride); break;
    case 16 + 4: dots_avx512(m, r, 1, xs, 4, out, stride); break;
    default: dots_avx512(m, r, 1, xs, 1, out, stride); break;
    }
}
#endif

/* out[i * n + j] = dot(m, r + i, xs[j]) for i < R, j < n (any R, n). One input of a float or Q8_0 matrix: row by
   row, the one-token loop (at memory speed there). Of an FP4 matrix (an expert chosen by one row of a batched
   step): DOTS_ROWS rows side by side, one row's dot being a chain of FMAs bound by their latency (about 5 cycles a
   group of 32 weights; the batched step's experts at 2 threads 10-25 % faster side by side). Several inputs:
   DOTS_SHARED at a time, two rows side by side, so that each input chunk loaded feeds two rows' FMAs (one row of
   eight inputs was bound by loading them: the batched step's dense weights ran at a third of the FMA rate). */
static void dots_rows(const matrix_t *m, int64_t r, int64_t R, const float *const *xs, int64_t n, float *out) {
    if (n == 1 && m->kind != KIND_FP4_E2M1 && m->kind != KIND_MXFP4) {
        for (int64_t i = 0; i < R; i++) out[i] = dot(m, r + i, xs[0]);
        return;
    }
#ifdef HAVE_AVX512
    if (use_vector) {
        for (int64_t j = 0; j < n; j += DOTS_SHARED) {
            const int count = n - j < DOTS_SHARED ? (int)(n - j) : DOTS_SHARED;
            for (int64_t i = 0, rows; i < R; i += rows) {
                for (rows = count == 1 ? DOTS_ROWS : 2; rows > R - i; rows /= 2) {}
                dots_fixed(m, r + i, (int)rows, xs + j, count, out + i * n + j, n);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < n; j++) out[i * n + j] = dot_scalar(m, r + i, xs[j]);
}

int token_matmul_vector_level(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

void token_matmul_set_level(int vector) { use_vector = vector; }

/* --- the pool ---------------------------------------------------------------------------------------------------- */

#define MAX_THREADS 256
#define SPIN_NS 2000000  /* a worker polls this long after its last part before it sleeps: a decoded token's
                                 torch ops between two calls take up to a few hundred us, and a sleeping
                                 worker's wake-up costs more than the spin */

static struct {
    pthread_mutex_t busy;  /* one caller at a time; others run their parts inline */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;
    part_fn fn;
    void *args;
    int parts;
    atomic_uint generation;
    atomic_int pending;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

/* arg: the worker's id | the generation it was started in << 16 (it may first run after that one began) */
static void *worker(void *arg) {
    const int id = (int)((intptr_t)arg & 0xffff);
    unsigned seen = (unsigned)((uintptr_t)arg >> 16);
    for (;;) {
        unsigned gen;
        const int64_t since = now_ns();
        for (int polls = 0; (gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen; polls++) {
            if (polls % 64 || now_ns() - since < SPIN_NS) { relax(); continue; }
            pthread_mutex_lock(&pool.lock);
            while ((gen = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
            break;
        }
        seen = gen;
        if (id < pool.parts) pool.fn(pool.args, id, pool.parts);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void forget_workers(void) {  /* in a forked child: the parent's workers do not exist there */
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = 0;
}

/* The CPUs this process may run on. More threads than that only take turns on them, and a worker spinning for
   the next call then holds a CPU that a part (or torch, between calls) needs: a pool grown to 3 threads on 2 CPUs
   made every later call of 2 several times slower, as each call waits for every worker. */
static int usable_cpus(void) {
#if defined(__linux__)
    cpu_set_t set;
    if (!sched_getaffinity(0, sizeof set, &set) && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

/* fn(args, part, parts) for every part < parts, on the pool (parts - 1 workers and the caller); parts above the
   usable CPUs are fewer parts (a part is a static share of rows: the results are the same) */
static void run_parts(part_fn fn, void *args, int parts) {
    static int cpus;
    if (!cpus) cpus = usable_cpus();
    if (parts > cpus) parts = cpus;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    if (parts <= 1 || pthread_mutex_trylock(&pool.busy)) {
        for (int p = 0; p < parts; p++) fn(args, p, parts);
        return;
    }
    static int fork_handler;
    if (!fork_handler) fork_handler = !pthread_atfork(NULL, NULL, forget_workers);
    while (pool.workers < parts - 1) {
        pthread_t t;
        const uintptr_t arg = (uintptr_t)atomic_load(&pool.generation) << 16 | (uintptr_t)(pool.workers + 1);
        if (pthread_create(&t, NULL, worker, (void *)arg)) break;
#if defined(__linux__)
        pthread_setname_np(t, "moepack-kernel");  /* as `top -H` and /proc/PID/task/TID/comm show it */
#endif
        pthread_detach(t);
        pool.workers++;
    }
    const int pooled = pool.workers + 1 < parts ? pool.workers + 1 : parts;  /* fewer when a thread failed */
    pool.fn = fn;
    pool.args = args;
    pool.parts = pooled;
    atomic_store(&pool.pending, pool.workers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(args, 0, pooled);
    for (int p = pooled; p < parts; p++) fn(args, p, parts);  /* never reached unless a thread failed to start */
    while (atomic_load_explicit(&pool.pending, memory_order_acquire)) relax();
    pthread_mutex_unlock(&pool.busy);
}

/* how many parts a call of this many multiply-adds takes: a part of under 64K (64 rows of 1024) costs more than its
   thread; by work, not rows, so a few long rows (the mHC mixes: 24 of 16K on V4-Flash) still split */
static int parts_for(int64_t multiply_adds, int threads) {
    const int64_t most = multiply_adds / 65536 + 1;
    return (int)(threads < most ? threads : most);
}

/* --- out = x @ W.T --------------------------------------------------------------------------------------------- */

typedef struct {
    const float *x;  /* [T, K] arranged */
    int64_t T;
    const matrix_t *w;
    float *out;
    int64_t out_stride;
    int64_t group_rows;  /* > 0: row r takes input row r / group_rows only (of each token's groups) */
    int64_t tokens;  /* group_rows > 0: the tokens, each [groups, K] of x, token t's results at out + t * out_stride */
    int round_out;  /* results rounded to bfloat16 (kept as float32): a bfloat16 layer's output */
} linear_args;

static void linear_part(void *p, int part, int parts) {
    const linear_args *a = p;
    const int64_t K = a->w->cols;
    const int64_t tokens = a->group_rows ? a->tokens : a->T;
    const int64_t groups = a->group_rows ? a->w->rows / a->group_rows : 1;
    int64_t r0, r1;
    share(a->w->rows, part, parts, &r0, &r1);
    for (int64_t r = r0, R = 1; r < r1; r += R) {
        const int64_t group = a->group_rows ? r / a->group_rows : 0;
        if (tokens == 1) {  /* one token: the one-input loop */
            const float y = dot(a->w, r, a->x + group * K);
            a->out[r] = a->round_out ? round_to_bf16(y) : y;
            continue;
        }
        const int64_t end = a->group_rows && (group + 1) * a->group_rows < r1 ? (group + 1) * a->group_rows : r1;
        R = end - r < DOTS_ROWS ? end - r : DOTS_ROWS;  /* rows of one group side by side */
        for (int64_t t = 0; t < tokens; t += DOTS_MAX) {  /* the rows decoded once per DOTS_MAX tokens */
            const int n = tokens - t < DOTS_MAX ? (int)(tokens - t) : DOTS_MAX;
            const float *xs[DOTS_MAX];
            float y[DOTS_ROWS * DOTS_MAX];
            for (int j = 0; j < n; j++) xs[j] = a->x + ((t + j) * groups + group) * K;
            dots_rows(a->w, r, R, xs, n, y);
            for (int64_t i = 0; i < R; i++)
                for (int j = 0; j < n; j++) {
                    const float v = y[i * n + j];
                    a->out[(t + j) * a->out_stride + r + i] = a->round_out ? round_to_bf16(v) : v;
                }
        }
    }
}

/* T input rows x (row stride x_stride); grouped (group_rows > 0): T = tokens x groups rows, token t's groups
   rows t * groups ... (t + 1) * groups - 1, W's rows g * group_rows ... taking group g */
static int linear(const float *x, int64_t T, int64_t x_stride, const matrix_t *w, float *out, int64_t out_stride,
                  int64_t group_rows, int64_t tokens, int round_bf16, int threads) {
    if (!valid(w) || T < 0 || (group_rows && (group_rows < 0 || tokens < 1 || T % tokens
                                              || w->rows != T / tokens * group_rows))) return 1;
    float *arranged_x = malloc(sizeof(float) * (size_t)(T * w->cols + 1));
    if (!arranged_x) return 2;
    for (int64_t t = 0; t < T; t++)
        arrange(x + t * x_stride, w->cols, w->kind, round_bf16 & ROUND_INPUT, arranged_x + t * w->cols);
    linear_args args = {arranged_x, T, w, out, out_stride, group_rows, tokens, round_bf16 & ROUND_OUTPUT};
    run_parts(linear_part, &args, parts_for((group_rows ? w->rows * tokens : w->rows * T) * w->cols, threads));
    free(arranged_x);
    return 0;
}

/* out [T, rows] (row stride out_stride) = x [T, cols] (row stride x_stride) @ W.T */
int token_linear(const float *x, int64_t T, int64_t x_stride, const matrix_t *w, float *out, int64_t out_stride,
                 int round_bf16, int threads) {
    return linear(x, T, x_stride, w, out, out_stride, 0, 1, round_bf16, threads);
}

/* G groups: out [G * R] = for each g, W[g * R: (g + 1) * R] @ x[g] (x [G, cols], row stride x_stride; W [G * R,
   cols]): a grouped projection (model.grouped_output's wo_a) of one token */
int token_linear_grouped(const float *x, int64_t G, int64_t x_stride, const matrix_t *w, float *out,
                         int round_bf16, int threads) {
    return G < 1 || w->rows % G ? 1 : linear(x, G, x_stride, w, out, 0, w->rows / G, 1, round_bf16, threads);
}

/* token_linear_grouped of T tokens in one scan of W: x [T, G, cols] (row stride x_stride), out [T, G * R] (token
   t's at out + t * out_stride); each token's results are those token_linear_grouped gives it alone */
int token_linear_grouped_rows(const float *x, int64_t T, int64_t G, int64_t x_stride, const matrix_t *w, float *out,
                              int64_t out_stride, int round_bf16, int threads) {
    return T < 1 || G < 1 || w->rows % G ? 1
         : linear(x, T * G, x_stride, w, out, out_stride, w->rows / G, T, round_bf16, threads);
}

/* --- several matrices on one token ------------------------------------------------------------------------------- */

typedef struct {
    const float *x;  /* [T, n, K]: each token's input arranged (and rounded) for each matrix */
    int64_t T;
    const matrix_t *ws;
    int n;
    int64_t rows;  /* all the matrices' rows, one after another */
    float *out;  /* token t's results of matrix i at out + t * out_stride + offsets[i] */
    int64_t out_stride;
    const int64_t *offsets;
    const int *flags;
} many_args;

static void many_part(void *p, int part, int parts) {
    const many_args *a = p;
    int64_t r0, r1;
    share(a->rows, part, parts, &r0, &r1);
    int64_t first = 0;
    for (int i = 0; i < a->n && first < r1; first += a->ws[i++].rows) {
        const matrix_t *w = &a->ws[i];
        const int64_t lo = r0 > first ? r0 - first : 0, hi = r1 - first < w->rows ? r1 - first : w->rows;
        for (int64_t r = lo, R = 1; r < hi; r += R) {
            if (a->T == 1) {  /* one token: the one-input loop */
                const float y = dot(w, r, a->x + i * w->cols);
                a->out[a->offsets[i] + r] = a->flags[i] & ROUND_OUTPUT ? round_to_bf16(y) : y;
                continue;
            }
            R = hi - r < DOTS_ROWS ? hi - r : DOTS_ROWS;
            for (int64_t t = 0; t < a->T; t += DOTS_MAX) {
                const int n = a->T - t < DOTS_MAX ? (int)(a->T - t) : DOTS_MAX;
                const float *xs[DOTS_MAX];
                float y[DOTS_ROWS * DOTS_MAX];
                for (int j = 0; j < n; j++) xs[j] = a->x + ((t + j) * a->n + i) * w->cols;
                dots_rows(w, r, R, xs, n, y);
                for (int64_t q = 0; q < R; q++)
                    for (int j = 0; j < n; j++)
                        a->out[(t + j) * a->out_stride + a->offsets[i] + r + q] =
                            a->flags[i] & ROUND_OUTPUT ? round_to_bf16(y[q * n + j]) : y[q * n + j];
            }
        }
    }
}

/* token_linear_many of T tokens x [T, K] (row stride x_stride) in one scan of the matrices: token t's results at
   out + t * out_stride + offsets[i], each token's those token_linear_many gives it alone */
int token_linear_many_rows(const float *x, int64_t T, int64_t x_stride, int64_t K, const matrix_t *ws, int n,
                           float *out, int64_t out_stride, const int64_t *offsets, const int *flags, int threads) {
    int64_t rows = 0;
    if (!out || T < 1 || n < 1) return 1;
    for (int i = 0; i < n; i++) {
        if (!valid(&ws[i]) || ws[i].cols != K || offsets[i] < 0) return 1;
        rows += ws[i].rows;
    }
    float *arranged_x = malloc(sizeof(float) * (size_t)(T * n * K + 1));
    if (!arranged_x) return 2;
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < n; i++)
            arrange(x + t * x_stride, K, ws[i].kind, flags[i] & ROUND_INPUT, arranged_x + (t * n + i) * K);
    many_args args = {arranged_x, T, ws, n, rows, out, out_stride, offsets, flags};
    run_parts(many_part, &args, parts_for(rows * K * T, threads));
    free(arranged_x);
    return 0;
}

/* out[offsets[i] ...] [rows_i] = ws[i] @ x for one token x [K] and n matrices of K columns each, in one call, the
   rows of all split over the threads; flags[i]: ROUND_INPUT / ROUND_OUTPUT for matrix i, as token_linear's */
int token_linear_many(const float *x, int64_t K, const matrix_t *ws, int n, float *out, const int64_t *offsets,
                      const int *flags, int threads) {
    return token_linear_many_rows(x, 1, K, K, ws, n, out, 0, offsets, flags, threads);
}

/* --- a token's routed experts ---------------------------------------------------------------------------------- */

typedef struct {
    const float *x[4];  /* the input arranged: [deinterleaved + 2 x rounded] */
    int64_t H, n, hidden_rows;
    const matrix_t *w1, *w3, *w2;
    const float *weights;
    float limit;
    const int *flags;  /* per expert: ROUND_INPUT / ROUND_OUTPUT */
    const int64_t *first;  /* expert e's hidden rows start at first[e] (its w1's rows: its intermediate size) */
    float *hidden;  /* [hidden_rows], each expert's arranged for its w2 */
    float *out;
} moe_args;

/* an expert's hidden activation from its gate and up projections: the clamped SwiGLU (flags: its roundings) */
static float swiglu(float gate, float up, float limit, int flags) {
    if (flags & ROUND_OUTPUT) { gate = round_to_bf16(gate); up = round_to_bf16(up); }
    gate = fminf(gate, limit);  /* torch's clamp: NaN stays NaN */
    up = up != up ? up : fmaxf(fminf(up, limit), -limit);
    const float h = gate / (1.0f + expf(-gate)) * up;
    return flags & ROUND_INPUT ? round_to_bf16(h) : h;
}

static const float *input_for(const moe_args *a, int64_t kind, int flags) {
    return a->x[deinterleaved(kind) + 2 * !!(flags & ROUND_INPUT)];
}

static void hidden_part(void *p, int part, int parts) {
    const moe_args *a = p;
    int64_t i0, i1, e = 0;
    share(a->hidden_rows, part, parts, &i0, &i1);
    for (int64_t k = i0; k < i1; k++) {
        while (k >= a->first[e + 1]) e++;
        const int64_t i = k - a->first[e];
        const matrix_t *w1 = a->w1 + e, *w3 = a->w3 + e;
        const int flags = a->flags[e];
        const float h = swiglu(dot(w1, i, input_for(a, w1->kind, flags)), dot(w3, i, input_for(a, w3->kind, flags)),
                               a->limit, flags);
        a->hidden[a->first[e] + (deinterleaved(a->w2[e].kind) ? arranged(i) : i)] = h;
    }
}

static void output_part(void *p, int part, int parts) {
    const moe_args *a = p;
    int64_t r0, r1;
    share(a->H, part, parts, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        float acc = 0.0f;
        for (int64_t e = 0; e < a->n; e++) {
            const float y = dot(a->w2 + e, r, a->hidden + a->first[e]);
            acc = fmaf(a->weights[e], a->flags[e] & ROUND_OUTPUT ? round_to_bf16(y) : y, acc);
        }
        a->out[r] = acc;
    }
}

/* whether an expert's w1, w3 [I, H] and w2 [H, I] are valid matrices of those shapes */
static int expert_fits(const matrix_t *w1, const matrix_t *w3, const matrix_t *w2, int64_t H) {
    const int64_t I = w1->rows;
    const matrix_t *m[3] = {w1, w3, w2};
    for (int j = 0; j < 3; j++)
        if (!valid(m[j]) || m[j]->rows != (j < 2 ? I : H) || m[j]->cols != (j < 2 ? H : I)) return 0;
    return 1;
}

/* out [H] = sum over e, in order, of weights[e] * expert e (x [H]), the clamped SwiGLU of model.expert_forward:
   w1[e], w3[e] [I_e, H], w2[e] [H, I_e] (each expert its own intermediate size and kinds). Two passes over the
   pool: every expert's hidden rows, then the output rows. flags[e] & ROUND_INPUT: expert e's input and hidden
   activation rounded to bfloat16; & ROUND_OUTPUT: its gate, up projection and output too (an expert of bfloat16
   linears, as the shared expert is computed: appended last with weight 1, out = routed sum + shared). */
int moe_token(const float *x, int64_t H, int64_t n, const matrix_t *w1, const matrix_t *w3, const matrix_t *w2,
              const float *weights, float limit, const int *flags, float *out, int threads) {
    if (H < 1 || n < 0 || n > 4096) return 1;
    int64_t first[4097];
    first[0] = 0;
    for (int64_t e = 0; e < n; e++) {
        if (!expert_fits(w1 + e, w3 + e, w2 + e, H)) return 1;
        first[e + 1] = first[e] + w1[e].rows;
    }
    float *scratch = malloc(sizeof(float) * (size_t)(4 * H + first[n] + 1));
    if (!scratch) return 2;
    moe_args args = {{0}, H, n, first[n], w1, w3, w2, weights, limit, flags, first, scratch + 4 * H, out};
    for (int v = 0; v < 4; v++) {
        arrange(x, H, v & 1 ? KIND_FP4_E2M1 : KIND_F32, v & 2, scratch + v * H);
        args.x[v] = scratch + v * H;
    }
    run_parts(hidden_part, &args, threads);
    run_parts(output_part, &args, threads);
    free(scratch);
    return 0;
}

/* --- several tokens' routed experts ------------------------------------------------------------------------------ */

typedef struct {
    const float *x;  /* [4][T][H]: the inputs arranged, variant deinterleaved + 2 x rounded */
    int64_t T, H, n;
    const matrix_t *w1, *w3, *w2;
    const int *flags;
    const int64_t *starts, *rows;  /* expert e's (token, weight) pairs: starts[e] ... starts[e + 1] - 1 */
    const float *weights;
    float limit;
    const int64_t *cost_first;  /* hidden rows x tokens of the experts before e: the hidden pass's work */
    const int64_t *hidden_first;  /* pair p's hidden activations (arranged for its w2) at hidden + hidden_first[p] */
    float *hidden;
    float *out;
} rows_args;

static const float *row_input(const rows_args *a, int64_t kind, int flags, int64_t t) {
    return a->x + ((deinterleaved(kind) + 2 * !!(flags & ROUND_INPUT)) * a->T + t) * a->H;
}

/* hidden row i of expert e for each of its tokens (w1's and w3's row i read once for all of them), the parts split
   by work: row i of an expert chosen by c tokens costs c */
static void rows_hidden_part(void *p, int part, int parts) {
    const rows_args *a = p;
    int64_t c0, c1;
    share(a->cost_first[a->n], part, parts, &c0, &c1);
    for (int64_t e = 0; e < a->n; e++) {
        const int64_t count = a->starts[e + 1] - a->starts[e], base = a->cost_first[e], I = a->w1[e].rows;
        if (!count || base + I * count <= c0 || base >= c1) continue;
        const int64_t i0 = c0 > base ? (c0 - base + count - 1) / count : 0;
        const int64_t i1 = (c1 - base + count - 1) / count < I ? (c1 - base + count - 1) / count : I;
        const matrix_t *w1 = a->w1 + e, *w3 = a->w3 + e;
        const int flags = a->flags[e], spread = deinterleaved(a->w2[e].kind);
        for (int64_t i = i0, R; i < i1; i += R) {  /* up to DOTS_ROWS rows side by side */
            R = i1 - i < DOTS_ROWS ? i1 - i : DOTS_ROWS;
            for (int64_t q0 = a->starts[e]; q0 < a->starts[e + 1]; q0 += DOTS_MAX) {  /* rows i decoded once */
                const int n = a->starts[e + 1] - q0 < DOTS_MAX ? (int)(a->starts[e + 1] - q0) : DOTS_MAX;
                const float *x1[DOTS_MAX], *x3[DOTS_MAX];
                float gate[DOTS_ROWS * DOTS_MAX], up[DOTS_ROWS * DOTS_MAX];
                for (int j = 0; j < n; j++) {
                    x1[j] = row_input(a, w1->kind, flags, a->rows[q0 + j]);
                    x3[j] = row_input(a, w3->kind, flags, a->rows[q0 + j]);
                }
                dots_rows(w1, i, R, x1, n, gate);
                dots_rows(w3, i, R, x3, n, up);
                for (int64_t q = 0; q < R; q++)
                    for (int j = 0; j < n; j++)
                        a->hidden[a->hidden_first[q0 + j] + (spread ? arranged(i + q) : i + q)] =
                            swiglu(gate[q * n + j], up[q * n + j], a->limit, flags);
            }
        }
    }
}

/* output row r of every token: its experts' w2 row r (read once for all their tokens) added in the experts' order.
   The rows go in blocks of OUT_BLOCK, each expert's block of rows read in one run: a part going row by row over
   every expert would read dozens of matrices a row at a time (a step of 8 tokens chooses ~36 on V4-like routing),
   more streams than the prefetchers follow (the batched step ran at half the one-token path's bytes per second).
   Each output still adds its experts in order. */
enum { OUT_BLOCK = 64 };

static void rows_output_part(void *p, int part, int parts) {
    const rows_args *a = p;
    int64_t r0, r1;
    share(a->H, part, parts, &r0, &r1);
    for (int64_t b0 = r0; b0 < r1; b0 += OUT_BLOCK) {
        const int64_t b1 = b0 + OUT_BLOCK < r1 ? b0 + OUT_BLOCK : r1;
        for (int64_t t = 0; t < a->T; t++)
            for (int64_t r = b0; r < b1; r++) a->out[t * a->H + r] = 0.0f;
        for (int64_t e = 0; e < a->n; e++)
            for (int64_t q0 = a->starts[e]; q0 < a->starts[e + 1]; q0 += DOTS_MAX) {
                const int n = a->starts[e + 1] - q0 < DOTS_MAX ? (int)(a->starts[e + 1] - q0) : DOTS_MAX;
                const float *xs[DOTS_MAX];
                float y[DOTS_ROWS * DOTS_MAX];
                for (int j = 0; j < n; j++) xs[j] = a->hidden + a->hidden_first[q0 + j];
                for (int64_t r = b0, R; r < b1; r += R) {  /* up to DOTS_ROWS rows side by side */
                    R = b1 - r < DOTS_ROWS ? b1 - r : DOTS_ROWS;
                    dots_rows(a->w2 + e, r, R, xs, n, y);
                    for (int64_t q = 0; q < R; q++)
                        for (int j = 0; j < n; j++) {
                            const float v = y[q * n + j];
                            float *acc = a->out + a->rows[q0 + j] * a->H + r + q;
                            *acc = fmaf(a->weights[q0 + j], a->flags[e] & ROUND_OUTPUT ? round_to_bf16(v) : v, *acc);
                        }
                }
            }
    }
}

/* moe_token for T tokens x [T, H] in one scan of each expert: out [T, H]. Expert e (w1, w3, w2, flags as
   moe_token's) runs on the tokens rows[starts[e] ... starts[e + 1] - 1], with weights weights[same]; a token's
   sum adds its experts in the order given (routed ascending by id, then the shared expert, appended with every
   token and weight 1), so each token's out is bit for bit what moe_token gives it with its own experts alone. Two
   passes over the pool: the (expert, token) pairs' hidden rows, then the output rows. */
int moe_rows(const float *x, int64_t T, int64_t H, int64_t n, const matrix_t *w1, const matrix_t *w3,
             const matrix_t *w2, const int *flags, const int64_t *starts, const int64_t *rows, const float *weights,
             float limit, float *out, int threads) {
    if (T < 1 || H < 1 || n < 0 || n > 4096 || starts[0] != 0) return 1;
    int64_t cost_first[4097];
    cost_first[0] = 0;
    for (int64_t e = 0; e < n; e++) {
        if (!expert_fits(w1 + e, w3 + e, w2 + e, H) || starts[e + 1] < starts[e]) return 1;
        for (int64_t q = starts[e]; q < starts[e + 1]; q++)
            if (rows[q] < 0 || rows[q] >= T) return 1;
        cost_first[e + 1] = cost_first[e] + w1[e].rows * (starts[e + 1] - starts[e]);
    }
    const int64_t pairs = starts[n];
    float *scratch = malloc(sizeof(float) * (size_t)(4 * T * H + cost_first[n] + 1));
    int64_t *hidden_first = malloc(sizeof(int64_t) * (size_t)(pairs + 1));
    if (!scratch || !hidden_first) { free(scratch); free(hidden_first); return 2; }
    for (int64_t e = 0, at = 0; e < n; e++)
        for (int64_t q = starts[e]; q < starts[e + 1]; at += w1[e].rows) hidden_first[q++] = at;
    for (int v = 0; v < 4; v++)
        for (int64_t t = 0; t < T; t++)
            arrange(x + t * H, H, v & 1 ? KIND_FP4_E2M1 : KIND_F32, v & 2, scratch + (v * T + t) * H);
    rows_args args = {scratch, T, H, n, w1, w3, w2, flags, starts, rows, weights, limit, cost_first, hidden_first,
                      scratch + 4 * T * H, out};
    run_parts(rows_hidden_part, &args, threads);
    run_parts(rows_output_part, &args, threads);
    free(scratch);
    free(hidden_first);
    return 0;
}

/* --- a token's router (model.moe_route) -------------------------------------------------------------------------- */

enum { SCORE_SQRTSOFTPLUS, SCORE_SIGMOID, SCORE_SOFTMAX };

/* one token's choice from its gate logits `scores` [E] (turned into scores in place): route_token's */
static int choose(float *scores, int64_t E, const float *bias, int score_func, int64_t top_k,
                  const int64_t *hash_ids, float scale, int64_t *chosen, float *weights) {
    float top = -INFINITY, total = 0.0f;
    if (score_func == SCORE_SOFTMAX) {
        for (int64_t e = 0; e < E; e++) top = fmaxf(top, scores[e]);
        for (int64_t e = 0; e < E; e++) total += (scores[e] = expf(scores[e] - top));
    }
    for (int64_t e = 0; e < E; e++) {
        const float v = scores[e];
        scores[e] = score_func == SCORE_SQRTSOFTPLUS ? sqrtf(v > 20.0f ? v : log1pf(expf(v)))  /* torch's threshold */
                  : score_func == SCORE_SIGMOID ? 1.0f / (1.0f + expf(-v)) : v / total;
    }
    int64_t ids[4096];
    for (int64_t j = 0; j < top_k; j++) {
        if (hash_ids) {
            if (hash_ids[j] < 0 || hash_ids[j] >= E) return -1;
            ids[j] = hash_ids[j];
            continue;
        }
        int64_t best = -1;
        float best_v = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++) taken = ids[i] == e;
            const float v = scores[e] + (bias ? bias[e] : 0.0f);
            if (!taken && (best < 0 || v > best_v)) { best = e; best_v = v; }
        }
        ids[j] = best;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; j++) sum += scores[ids[j]];
    int64_t n = 0;
    for (int64_t j = 0; j < top_k; j++) {  /* insertion by id; a repeated id adds its weight */
        const float w = scores[ids[j]] / (sum + 1e-20f) * scale;
        int64_t at = 0;
        while (at < n && chosen[at] < ids[j]) at++;
        if (at < n && chosen[at] == ids[j]) { weights[at] += w; continue; }
        for (int64_t i = n; i > at; i--) { chosen[i] = chosen[i - 1]; weights[i] = weights[i - 1]; }
        chosen[at] = ids[j];
        weights[at] = w;
        n++;
    }
    return (int)n;
}

/* One token's choice of experts: scores = score_func(gate @ x) over the gate's rows (the experts); the top_k by
   score + bias (bias may be NULL), or the given hash_ids [top_k] (a hash layer); their scores renormalised over
   the k, times `scale`. Out: `chosen` [top_k] expert ids ascending, an expert picked twice once (its weights
   added, as decode's token_choice adds them), their weights in `weights`; returns how many, or -1 on bad input.
   Ties in the top-k go to the lower expert id. */
int route_token(const float *x, const matrix_t *gate, const float *bias, int score_func, int64_t top_k,
                const int64_t *hash_ids, float scale, int64_t *chosen, float *weights, int threads) {
    const int64_t E = gate->rows;
    if (top_k < 1 || top_k > E || top_k > 4096 || score_func < SCORE_SQRTSOFTPLUS || score_func > SCORE_SOFTMAX)
        return -1;
    float *scores = malloc(sizeof(float) * (size_t)E);
    if (!scores || linear(x, 1, gate->cols, gate, scores, E, 0, 1, 0, threads)) { free(scores); return -1; }
    const int n = choose(scores, E, bias, score_func, top_k, hash_ids, scale, chosen, weights);
    free(scores);
    return n;
}

/* route_token for T tokens x [T, H] in one scan of the gate: token t's choice in chosen[t * top_k ...],
   weights[t * top_k ...] (hash_ids: [T, top_k]), counts[t] how many; each token's what route_token gives it
   alone. Returns 0, or -1 on bad input. */
int route_rows(const float *x, int64_t T, const matrix_t *gate, const float *bias, int score_func, int64_t top_k,
               const int64_t *hash_ids, float scale, int64_t *chosen, float *weights, int64_t *counts, int threads) {
    const int64_t E = gate->rows;
    if (T < 1 || top_k < 1 || top_k > E || top_k > 4096 || score_func < SCORE_SQRTSOFTPLUS
        || score_func > SCORE_SOFTMAX)
        return -1;
    float *scores = malloc(sizeof(float) * (size_t)(E * T));
    if (!scores || linear(x, T, gate->cols, gate, scores, E, 0, 1, 0, threads)) { free(scores); return -1; }
    for (int64_t t = 0; t < T; t++) {
        counts[t] = choose(scores + t * E, E, bias, score_func, top_k, hash_ids ? hash_ids + t * top_k : NULL, scale,
                           chosen + t * top_k, weights + t * top_k);
        if (counts[t] < 0) { free(scores); return -1; }
    }
    free(scores);
    return 0;
}

/* --- one decoded token's attention core (model.attention_token) ------------------------------------------------ */

typedef struct {
    const float *q;  /* [heads, D] as wq_b gives it */
    int64_t heads, dim, rope_dim;
    const float *rot;  /* [rope_dim / 2][2]: cos, sin of the token's angle (times the attention factor) */
    float eps, scale;
    const float *const *sets;  /* n_sets key sets [count, D], float32 values already rounded for the products */
    const int64_t *counts;
    int n_sets;
    const float *sink;  /* [heads] */
    int round_low;
    float *scratch;  /* per head: its query [D], its part of a set's sum [D], its logits [all keys] */
    int64_t keys;
    float *out;  /* [heads, D] */
} attend_args;

/* out [cols] = in RMS-normed (times weight where given), then its last rope_dim channels rotated by rot: as
   model.rms_norm and apply_rope compute a row */
static void norm_rope_row(const float *in, int64_t cols, const float *weight, float eps, int64_t rope_dim,
                          const float *rot, float *out) {
    float square = 0.0f;
    for (int64_t c = 0; c < cols; c++) square += in[c] * in[c];
    const float inverse = 1.0f / sqrtf(square / (float)cols + eps);
    for (int64_t c = 0; c < cols; c++) out[c] = weight ? in[c] * inverse * weight[c] : in[c] * inverse;
    if (rope_dim) rotate(out, cols, rope_dim, rot, 1.0f);
}

/* one head of one token's attention */
static void attend_head(const attend_args *a, int64_t h) {
    const int64_t D = a->dim;
    float *q = a->scratch + h * (2 * D + a->keys), *sum = q + D, *logits = sum + D, *o = a->out + h * D;
    norm_rope_row(a->q + h * D, D, NULL, a->eps, a->rope_dim, a->rot, q);  /* the per-head norm, no weight */
    if (a->round_low)
        for (int64_t d = 0; d < D; d++) q[d] = round_to_bf16(q[d]);
    float peak = a->sink[h];
    for (int s = 0, at = 0; s < a->n_sets; at += a->counts[s++]) {
        const matrix_t keys = {KIND_F32, (const uint8_t *)a->sets[s], NULL, NULL, a->counts[s], D};
        for (int64_t k = 0; k < a->counts[s]; k++) {
            const float y = dot(&keys, k, q);
            logits[at + k] = (a->round_low ? round_to_bf16(y) : y) * a->scale;
            peak = fmaxf(peak, logits[at + k]);
        }
    }
    float total = expf(a->sink[h] - peak);
    for (int64_t k = 0; k < a->keys; k++) total += (logits[k] = expf(logits[k] - peak));
    const float inverse = 1.0f / total;
    for (int s = 0, at = 0; s < a->n_sets; at += a->counts[s++]) {
        const float *keys = a->sets[s];
        for (int64_t d = 0; d < D; d++) sum[d] = 0.0f;
        for (int64_t k = 0; k < a->counts[s]; k++) {
            const float weight = a->round_low ? round_to_bf16(logits[at + k] * inverse) : logits[at + k] * inverse;
            for (int64_t d = 0; d < D; d++) sum[d] += weight * keys[k * D + d];
        }
        for (int64_t d = 0; d < D; d++) {
            const float v = a->round_low ? round_to_bf16(sum[d]) : sum[d];
            o[d] = s ? o[d] + v : v;
        }
    }
    if (!a->n_sets)
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    rotate(o, D, a->rope_dim, a->rot, -1.0f);
}

static void attend_part(void *p, int part, int parts) {
    const attend_args *a = p;
    int64_t h0, h1;
    share(a->heads, part, parts, &h0, &h1);
    for (int64_t h = h0; h < h1; h++) attend_head(a, h);
}

/* q [heads, D] -> out [heads, D]: each head RMS-normed (no weight) and rotated, its softmax over every key of the
   sets (q . k x scale) and its sink logit, the keys weighted by it and summed set by set, rotated back. round_low:
   the query, the logits, the probabilities and each set's sum rounded to bfloat16, where bfloat16 matmuls round. */
int attend_token(const float *q, int64_t heads, int64_t dim, int64_t rope_dim, const float *rot, float eps,
                 const float *const *sets, const int64_t *counts, int n_sets, const float *sink, float scale,
                 int round_low, float *out, int threads)
{
    if (heads < 1 || dim < 1 || rope_dim < 0 || rope_dim > dim || rope_dim % 2 || n_sets < 0) return 1;
    int64_t keys = 0;
    for (int s = 0; s < n_sets; s++) {
        if (counts[s] < 0 || (counts[s] && !sets[s])) return 1;
        keys += counts[s];
    }
    float *scratch = malloc(sizeof(float) * heads * (2 * dim + keys));
    if (!scratch) return 2;
    attend_args a = {q, heads, dim, rope_dim, rot, eps, scale, sets, counts, n_sets, sink, round_low, scratch, keys,
                     out};
    run_parts(attend_part, &a, threads < heads ? threads : (int)heads);
    free(scratch);
    return 0;
}

typedef struct {
    const attend_args *rows;
    int64_t count, heads;
} attend_rows_args;

static void attend_rows_part(void *p, int part, int parts) {
    const attend_rows_args *a = p;
    int64_t u0, u1;
    share(a->count * a->heads, part, parts, &u0, &u1);
    for (int64_t u = u0; u < u1; u++) attend_head(&a->rows[u / a->heads], u % a->heads);
}

/* attend_token for T tokens in one call, their (token, head) pairs split over the threads: token t's query at
   q + t * q_stride, its rotation at rot + t * rope_dim, its n_sets[t] key sets next in sets / counts, its out
   [heads, D] at out + t * heads * D; each token's what attend_token gives it alone */
int attend_rows(const float *q, int64_t T, int64_t q_stride, int64_t heads, int64_t dim, int64_t rope_dim,
                const float *rot, float eps, const float *const *sets, const int64_t *counts, const int *n_sets,
                const float *sink, float scale, int round_low, float *out, int threads)
{
    if (T < 1 || heads < 1 || dim < 1 || rope_dim < 0 || rope_dim > dim || rope_dim % 2) return 1;
    attend_args *rows = malloc(sizeof(attend_args) * (size_t)T);
    int64_t scratch_floats = 0, first_set = 0;
    if (!rows) return 2;
    for (int64_t t = 0; t < T; t++) {
        int64_t keys = 0;
        if (n_sets[t] < 0) { free(rows); return 1; }
        for (int s = 0; s < n_sets[t]; s++) {
            const int64_t count = counts[first_set + s];
            if (count < 0 || (count && !sets[first_set + s])) { free(rows); return 1; }
            keys += count;
        }
        rows[t] = (attend_args){q + t * q_stride, heads, dim, rope_dim, rot + t * rope_dim, eps, scale,
                                sets + first_set, counts + first_set, n_sets[t], sink, round_low, NULL, keys,
                                out + t * heads * dim};
        scratch_floats += heads * (2 * dim + keys);
        first_set += n_sets[t];
    }
    float *scratch = malloc(sizeof(float) * (size_t)(scratch_floats + 1));
    if (!scratch) { free(rows); return 2; }
    for (int64_t t = 0, at = 0; t < T; at += heads * (2 * dim + rows[t++].keys)) rows[t].scratch = scratch + at;
    attend_rows_args a = {rows, T, heads};
    run_parts(attend_rows_part, &a, threads < T * heads ? threads : (int)(T * heads));
    free(scratch);
    free(rows);
    return 0;
}

/* --- RMS norm (and RoPE) of a decoded token's rows ----------------------------------------------------------- */

/* out [rows, cols] = x RMS-normed per row (times weight [cols] where given), then (rot given) the last rope_dim
   channels of each row rotated by rot [rope_dim / 2][2] (cos, sin), as model.rms_norm and apply_rope compute */
int token_norm_rope(const float *x, int64_t rows, int64_t cols, const float *weight, float eps, int64_t rope_dim,
                    const float *rot, float *out, float *out_low)
{
    if (rows < 0 || cols < 1 || rope_dim < 0 || rope_dim > cols || rope_dim % 2 || (rope_dim && !rot)) return 1;
    for (int64_t r = 0; r < rows; r++) norm_rope_row(x + r * cols, cols, weight, eps, rope_dim, rot, out + r * cols);
    if (out_low)  /* a copy rounded to bfloat16 (decode's window keeps one beside its rows) */
        for (int64_t i = 0; i < rows * cols; i++) out_low[i] = round_to_bf16(out[i]);
    return 0;
}

/* token_norm_rope for several tokens' rows wherever they lie (a batched decode step's: its query norms into one
   buffer, its keys straight into each sequence's window): row r read at x + r * stride, rotated by rots[r] (rots:
   NULL where rope_dim is 0), written to outs[r] and, where outs_low and outs_low[r] are not NULL, rounded to
   bfloat16 into outs_low[r]; each row's arithmetic token_norm_rope's. */
int token_norm_rope_rows(const float *x, int64_t rows, int64_t stride, int64_t cols, const float *weight, float eps,
                         int64_t rope_dim, const float *const *rots, float *const *outs, float *const *outs_low)
{
    if (rows < 0 || cols < 1 || stride < cols || rope_dim < 0 || rope_dim > cols || rope_dim % 2 || !outs
        || (rope_dim && !rots))
        return 1;
    for (int64_t r = 0; r < rows; r++)
        if (!outs[r] || (rope_dim && !rots[r])) return 1;
    for (int64_t r = 0; r < rows; r++) {
        norm_rope_row(x + r * stride, cols, weight, eps, rope_dim, rope_dim ? rots[r] : NULL, outs[r]);
        if (outs_low && outs_low[r])
            for (int64_t c = 0; c < cols; c++) outs_low[r][c] = round_to_bf16(outs[r][c]);
    }
    return 0;
}

/* --- for kernels compiled elsewhere (token_matmul.h): this library's row dot and threads ------------------------ */

float token_matmul_dot(const matrix_t *m, int64_t r, const float *x) { return dot(m, r, x); }

void token_matmul_parallel(part_fn fn, void *args, int64_t multiply_adds, int threads) {
    run_parts(fn, args, parts_for(multiply_adds, threads));
}
