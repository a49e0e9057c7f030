/* What token_matmul.c shares with kernels compiled elsewhere (a model family's own operations, in its package):
   the weight descriptor, bfloat16 rounding, FP8 e4m3's widening, RoPE's rotation of a row, a part's share of the
   rows, and the types of the library's two entries such a kernel calls through pointers it is handed once
   (`token_matmul_dot`, one row of a matrix times an input, in the library's vector or plain loop;
   `token_matmul_parallel`, a call split over the library's one pool of threads), so that it computes as this
   library does and on the same threads. native/fp8_decode.c includes it for the rounding and the widening. */
#ifndef MOEPACK_TOKEN_MATMUL_H
#define MOEPACK_TOKEN_MATMUL_H

#include <stdint.h>
#include <string.h>

enum { KIND_F32, KIND_BF16, KIND_F16, KIND_FP4_E2M1, KIND_MXFP4, KIND_Q8_0, KIND_FP8_E4M3, KIND_COUNT };
#define FP8_BLOCK 128  /* an FP8_E4M3 matrix's scales: one float32 per FP8_BLOCK x FP8_BLOCK block */

typedef struct {
    int64_t kind;
    const uint8_t *data;   /* row r at data + r * row_bytes(kind, cols) */
    const uint8_t *scale;  /* FP4_E2M1: row r's E8M0 bytes at scale + r * cols / 32; FP8_E4M3: float32
                              [ceil(rows / FP8_BLOCK)][ceil(cols / FP8_BLOCK)] */
    const float *table;    /* FP4 kinds: [256][16], row s = the values of codes 0..15 under scale byte s */
    int64_t rows, cols;
} matrix_t;

typedef void (*part_fn)(void *args, int part, int parts);
typedef float (*row_dot_fn)(const matrix_t *m, int64_t r, const float *x);
typedef void (*parallel_fn)(part_fn fn, void *args, int64_t multiply_adds, int threads);

static inline float bits_float(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }

static inline float round_to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return bits_float(bits | 0x00400000u);  /* NaN stays (quiet) NaN */
    bits += 0x7fffu + ((bits >> 16) & 1);
    return bits_float(bits & 0xffff0000u);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <math.h>
/* 16 e4m3fn bytes as float32 over 256, exactly (fp8_value / 256): each byte's bits placed as a float16's, the sign
   to bit 15 and eeee mmm to bits 13..7 (a float16's exponent is e4m3's with 8 more bias, and its subnormals are
   e4m3's, m x 2^-17), which the conversion widens exactly; the NaN codes (0x7f, 0xff) made NaN after, rarely */
static inline __attribute__((always_inline)) __m512 fp8_e4m3_ps_over_256(__m128i bytes) {
    const __m256i signed16 = _mm256_cvtepi8_epi16(bytes);  /* the sign copied into bits 15..8 */
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(signed16, 7), _mm256_set1_epi16((short)0xbf80));
    const __m512 v = _mm512_cvtph_ps(half);
    const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_or_si128(bytes, _mm_set1_epi8((char)0x80)), _mm_set1_epi8(-1));
    return nan ? _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN)) : v;
}
#endif

/* the pairs (x[nope + 2i], x[nope + 2i + 1]) of a head times cos + i sin (sign -1: the conjugate), as the complex
   product torch computes */
static inline void rotate(float *x, int64_t dim, int64_t rope_dim, const float *rot, float sign) {
    float *pairs = x + dim - rope_dim;
    for (int64_t i = 0; i < rope_dim / 2; i++) {
        const float a = pairs[2 * i], b = pairs[2 * i + 1], c = rot[2 * i], s = sign * rot[2 * i + 1];
        pairs[2 * i] = a * c - b * s;
        pairs[2 * i + 1] = a * s + b * c;
    }
}

/* part `part` of `parts`' rows [a, b) of n */
static inline void share(int64_t n, int part, int parts, int64_t *a, int64_t *b) {
    *a = n * part / parts;
    *b = n * (part + 1) / parts;
}

#endif
