/* The fused FP4 matmul of runtime/expert_decode.py, for an expert's few tokens on a CPU with AVX512-BF16:
   out = x @ w.T with w decoded 4 rows at a time into a small scratch (L1-sized) and multiplied straight away
   (vdpbf16ps, float32 sums), so the decoded matrix never goes to memory. At a few dozen tokens per expert, decoding
   the whole matrix first costs as much as the matmul (a 2 MiB bf16 write and re-read per matrix, beside the lookup
   itself). Its own library: a compiler without AVX512-BF16 intrinsics loses this kernel only. */
#include <stdint.h>

#define LINEAR_SIGNATURE \
int fp4_linear_bf16(const uint16_t *x, int64_t T, int64_t K, const uint8_t *data, int64_t data_stride, \
                    const uint8_t *scale, int64_t scale_stride, const uint16_t *nib, int64_t N, float *out, \
                    int64_t out_stride, uint16_t *scratch)
#define EXPERT_SIGNATURE \
int fp4_expert_bf16(const uint16_t *x, int64_t T, int64_t H, int64_t I, \
                    const uint8_t *d1, int64_t ds1, const uint8_t *s1, int64_t ss1, \
                    const uint8_t *d3, int64_t ds3, const uint8_t *s3, int64_t ss3, \
                    const uint8_t *d2, int64_t ds2, const uint8_t *s2, int64_t ss2, \
                    const uint16_t *nib, float limit, const int64_t *hidden_order, \
                    float *work, uint16_t *hidden, uint16_t *scratch, float *out)

int fp4_linear_supported(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ROWS 4    /* weight rows per tile: 4 x 32 values in registers */
#define TOKENS 6  /* tokens per tile: 24 accumulators, 29 of the 32 registers with the weights and one input */
#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#include "nibble_group.h"

/* The four horizontal sums of a, b, c, d: lanes added pairwise within each 128-bit quarter, then the quarters.
   A fifth of the shuffles of four separate reductions: 12-20% of a 24-token matmul on AMD Zen 5. */
TARGET __attribute__((always_inline))
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* out[t][r] = dot(x[t], w[r]) for rows < ROWS and toks < TOKENS tokens; constant bounds once inlined */
TARGET __attribute__((always_inline))
static inline void tile(const uint16_t *x, int64_t K, const uint16_t *w, int rows, int toks, float *out,
                        int64_t out_stride) {
    __m512 acc[TOKENS][ROWS];
    for (int t = 0; t < TOKENS; t++)
        for (int r = 0; r < ROWS; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i wv[ROWS];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < ROWS; r++) if (r < rows) wv[r] = _mm512_loadu_si512(w + r * K + k);
        _Pragma("GCC unroll 6")
        for (int t = 0; t < TOKENS; t++) {
            if (t < toks) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * K + k);
                _Pragma("GCC unroll 4")
                for (int r = 0; r < ROWS; r++)
                    if (r < rows) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, (__m512bh)wv[r]);
            }
        }
    }
    for (int t = 0; t < TOKENS; t++) {
        if (t >= toks) continue;
        if (rows == ROWS)  /* a token's 4 sums at once, one store */
            _mm_storeu_ps(out + t * out_stride, reduce4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
        else
            for (int r = 0; r < rows; r++) out[t * out_stride + r] = _mm512_reduce_add_ps(acc[t][r]);
    }
}
#define TILE(R, T) tile(x + t0 * K, K, scratch, R, T, out + t0 * out_stride + n0, out_stride)

/* out[t][n] (float32, rows out_stride apart) = sum_k x[t][k] w[n][k] for T tokens x (bf16 [T][K], contiguous) and
   the N x K FP4 matrix w: row n is K / 32 groups, group g = n * K / 32 + g' at data + g * data_stride (16 code
   bytes, low nibble first) with its scale byte at scale + g * scale_stride choosing a row of nib (16 bf16 values
   per scale byte). scratch: ROWS * K bf16. Returns -1 where not built or K is not a multiple of 32. */
TARGET
LINEAR_SIGNATURE {
    if (K % 32) return -1;
    const int64_t groups = K / 32;
    for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
        int rows = N - n0 < ROWS ? (int)(N - n0) : ROWS;
        for (int r = 0; r < rows; r++) {
            for (int64_t g = 0; g < groups; g++) {  /* as the AVX-512 lookup: a group per vpermw */
                int64_t i = (n0 + r) * groups + g;
                /* the next rows' bytes, on their way from memory while these rows multiply: with more than one
                   token tile the multiplying outlasts the hardware prefetcher's reach (from DRAM, 24 tokens:
                   165 -> 135 us per 1024 x 1024 matrix); with one, the stream it sees is enough */
                if (T > TOKENS && (g & 3) == 0 && n0 + r + ROWS < N) {
                    _mm_prefetch((const char *)(data + (i + ROWS * groups) * data_stride), _MM_HINT_T0);
                    if ((g & 63) == 0)
                        _mm_prefetch((const char *)(scale + (i + ROWS * groups) * scale_stride), _MM_HINT_T0);
                }
                _mm512_storeu_si512(scratch + r * K + g * 32, nibble_group(
                    nib + ((int64_t)scale[i * scale_stride] << 4), data + i * data_stride));
            }
        }
        for (int64_t t0 = 0; t0 < T; t0 += TOKENS) {
            int toks = T - t0 < TOKENS ? (int)(T - t0) : TOKENS;
            if (rows == ROWS) {
                switch (toks) {
                    case 6: TILE(4, 6); break;
                    case 5: TILE(4, 5); break;
                    case 4: TILE(4, 4); break;
                    case 3: TILE(4, 3); break;
                    case 2: TILE(4, 2); break;
                    default: TILE(4, 1);
                }
            } else {  /* the last rows of a matrix whose rows are not a multiple of 4 */
                switch (rows) {
                    case 3: TILE(3, toks); break;
                    case 2: TILE(2, toks); break;
                    default: TILE(1, toks);
                }
            }
        }
    }
    return 0;
}

/* exp(x) for x <= 88 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n) */
TARGET
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* A whole clamped SwiGLU expert on T tokens x (bf16 [T][H]): gate = x w1^T clamped above at limit, up = x w3^T
   clamped to +-limit, hidden = silu(gate) up rounded to bf16 once (its columns permuted by hidden_order when not
   NULL: w2 stored in MXFP4 pair order), out (float32 [T][H]) = hidden w2^T. w1, w3: I x H, w2: H x I, each as
   fp4_linear_bf16 takes it. work: 2 T I + I floats; hidden: T I bf16; scratch: ROWS max(H, I) bf16. */
TARGET
EXPERT_SIGNATURE {
    if (H % 32 || I % 32) return -1;
    float *gate = work, *up = work + T * I, *row = work + 2 * T * I;
    fp4_linear_bf16(x, T, H, d1, ds1, s1, ss1, nib, I, gate, I, scratch);
    fp4_linear_bf16(x, T, H, d3, ds3, s3, ss3, nib, I, up, I, scratch);
    const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.0f);
    for (int64_t t = 0; t < T; t++) {
        float *dst = hidden_order ? row : gate + t * I;
        for (int64_t i = 0; i < I; i += 16) {
            /* min/max return their second operand where one is NaN: a NaN stays NaN, as torch's clamp keeps it */
            __m512 g = _mm512_min_ps(hi, _mm512_loadu_ps(gate + t * I + i));
            __m512 u = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_loadu_ps(up + t * I + i)));
            __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu, u));
        }
        if (hidden_order)
            for (int64_t i = 0; i < I; i++) gate[t * I + i] = row[hidden_order[i]];
        for (int64_t i = 0; i < I; i += 16)
            _mm256_storeu_si256((__m256i *)(hidden + t * I + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(gate + t * I + i)));
    }
    fp4_linear_bf16(hidden, T, I, d2, ds2, s2, ss2, nib, H, out, H, scratch);
    return 0;
}
#else
LINEAR_SIGNATURE {
    return -1;
}
EXPERT_SIGNATURE {
    return -1;
}
#endif
