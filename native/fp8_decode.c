/* FP8 block decode (format_spec/source_formats.py's fp8_block_dequantize as compiled loops). 16-bit outputs: one
   lookup per weight in the row of the 65,536-entry table its block's scale byte picks; one pass, no index tensor;
   where the CPU has AVX-512 (BW), 32 weights per step: 0.35 ms per 8 M weights against 2.2 ms. */
#include <stdint.h>
#include <string.h>
#include "token_matmul.h"  /* round_to_bf16, fp8_e4m3_ps_over_256 */

void fp8_block_decode16(const uint8_t *w, const uint8_t *scale, int64_t rows, int64_t cols, int64_t block,
                        int64_t scale_cols, const uint16_t *table, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *s = scale + (r / block) * scale_cols, *wr = w + r * cols;
        uint16_t *o = out + r * cols;
        for (int64_t b = 0; b < scale_cols; b++) {
            const uint16_t *t = table + ((int64_t)s[b] << 8);
            int64_t end = (b + 1) * block < cols ? (b + 1) * block : cols;
            for (int64_t c = b * block; c < end; c++) o[c] = t[wr[c]];
        }
    }
}

int fp8_avx512_supported(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* 16-bit outputs, 32 weights per step: a scale's 256-entry row in 8 registers; vpermi2w looks each byte up in
   four 64-entry halves-of-quarters at once (byte bits 0-5), bits 6 and 7 pick among the four results */
__attribute__((target("avx512f,avx512bw")))
void fp8_block_decode16_avx512(const uint8_t *w, const uint8_t *scale, int64_t rows, int64_t cols, int64_t block,
                               int64_t scale_cols, const uint16_t *table, uint16_t *out) {
    const __m512i bit6 = _mm512_set1_epi16(64), bit7 = _mm512_set1_epi16(128);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *s = scale + (r / block) * scale_cols, *wr = w + r * cols;
        uint16_t *o = out + r * cols;
        for (int64_t b = 0; b < scale_cols; b++) {
            const uint16_t *t = table + ((int64_t)s[b] << 8);
            __m512i q[8];
            for (int i = 0; i < 8; i++) q[i] = _mm512_loadu_si512(t + 32 * i);
            int64_t c = b * block, end = (b + 1) * block < cols ? (b + 1) * block : cols;
            for (; c + 32 <= end; c += 32) {
                __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wr + c)));
                __m512i v01 = _mm512_permutex2var_epi16(q[0], idx, q[1]);
                __m512i v23 = _mm512_permutex2var_epi16(q[2], idx, q[3]);
                __m512i v45 = _mm512_permutex2var_epi16(q[4], idx, q[5]);
                __m512i v67 = _mm512_permutex2var_epi16(q[6], idx, q[7]);
                __mmask32 m6 = _mm512_test_epi16_mask(idx, bit6), m7 = _mm512_test_epi16_mask(idx, bit7);
                __m512i low = _mm512_mask_blend_epi16(m6, v01, v23), high = _mm512_mask_blend_epi16(m6, v45, v67);
                _mm512_storeu_si512(o + c, _mm512_mask_blend_epi16(m7, low, high));
            }
            for (; c < end; c++) o[c] = t[wr[c]];
        }
    }
}
#endif

/* FP8 under float32 block scales (Qwen3's `-FP8` releases store them as BF16; an E8M0 byte is one too), decoded in
   one pass: out = value(code) x its block's scale, one float32 product rounded once (bits equal to torch's float
   multiply), then, for 16-bit outputs, rounded to bfloat16 as torch's .to(torch.bfloat16) does (NaN aside: any
   NaN). `unit`: the 256 codes' values. With AVX-512, 16 weights a step (the FP8 bytes widened exactly, no table):
   bound by the stores, not by a lookup per weight. */

static inline void store_bf16(uint16_t *o, float v) {
    uint32_t bits;
    v = round_to_bf16(v);
    memcpy(&bits, &v, 4);
    *o = (uint16_t)(bits >> 16);
}

void fp8_float_block_decode(const uint8_t *w, const float *scale, int64_t rows, int64_t cols, int64_t block,
                            int64_t scale_cols, const float *unit, int64_t out_itemsize, void *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *s = scale + (r / block) * scale_cols;
        const uint8_t *wr = w + r * cols;
        float *o32 = (float *)out + r * cols;
        uint16_t *o16 = (uint16_t *)out + r * cols;
        for (int64_t b = 0; b < scale_cols; b++) {
            int64_t c = b * block, end = (b + 1) * block < cols ? (b + 1) * block : cols;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
            /* value / 256 x (scale x 256) is value x scale, one rounding, unless scale x 256 would overflow */
            const int wide = fabsf(s[b]) < 0x1p119f;
            const __m512 by = _mm512_set1_ps(wide ? s[b] * 256.0f : s[b]);
            const __m512i round_bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
            for (; c < end; c += 16) {
                const __mmask16 lanes = end - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (end - c)) - 1);
                __m512 v = fp8_e4m3_ps_over_256(_mm_maskz_loadu_epi8(lanes, wr + c));
                v = _mm512_mul_ps(wide ? v : _mm512_mul_ps(v, _mm512_set1_ps(256.0f)), by);
                if (out_itemsize == 4) {
                    _mm512_mask_storeu_ps(o32 + c, lanes, v);
                    continue;
                }
                __m512i bits = _mm512_castps_si512(v);  /* round to nearest even; a NaN stays a (quiet) NaN */
                const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                bits = _mm512_add_epi32(bits, _mm512_add_epi32(round_bias,
                                                               _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
                bits = _mm512_mask_mov_epi32(bits, nan, _mm512_or_si512(_mm512_castps_si512(v),
                                                                         _mm512_set1_epi32(0x00400000)));
                _mm256_mask_storeu_epi16(o16 + c, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
            }
#endif
            for (; c < end; c++) {
                const float v = unit[wr[c]] * s[b];
                if (out_itemsize == 4) o32[c] = v;
                else store_bf16(o16 + c, v);
            }
        }
    }
}
