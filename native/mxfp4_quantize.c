/* MXFP4 quantizer (format_spec/quant_fp4.py's mxfp4_quantize_chunk in C, the same bytes): 16 blocks at a time so
   that the compiler vectorises each step. The block max is taken on the float bits with the sign cleared (integer
   order is float order there; inf/NaN sort above), and floor(log2(amax)) is the float's exponent field except for
   maxima within 4096 ulps below a power of two (where a correctly rounded log2f may round up to it) and subnormal
   ones: those take the torch kernel's float64 log2 path. */
#include "block_prelude.h"
#include <math.h>

static inline float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

/* t2 = 2|v|/d = |v| * s1 * s2 (exact) -> e2m1 code: n = ceil(t2) counts the doubled midpoints 1 3 5 7 10 14 20
   below t2 (a tie goes to the smaller magnitude), plus 8 for a negative v with a nonzero magnitude */
static inline int32_t e2m1_code(float v, float s1, float s2) {
    float t2 = fabsf(v) * s1 * s2;
    if (!(t2 <= 32.0f)) t2 = 0.0f; /* only for inf/NaN input, which the caller rejects */
    int32_t n = (int32_t)t2;       /* t2 >= 0: truncation is the floor */
    n += (float)n < t2;
    int32_t h = n >> 1;
    int32_t code = (h < 4 ? h : 4) + (n > 10) + (n > 14) + (n > 20);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return code | ((int32_t)((bits >> 28) & 8u) & (h > 0 ? 8 : 0));
}

static int quantize_group(const float *restrict x, uint8_t *restrict out, int64_t n) {
    uint32_t amax_bits[GROUP];
    float scale[GROUP], scale_low[GROUP];
    uint8_t exponent[GROUP];
    int nonfinite = 0;
    block_amax_bits(x, amax_bits, n);
    for (int64_t b = 0; b < n; b++) {
        uint32_t m = amax_bits[b];
        int e = 0;
        if (m >= 0x7f800000u) {
            nonfinite = 1;
        } else if (m) {
            int lg = (int)(m >> 23) - 127;
            if ((m >> 23) == 0 || (m & 0x7fffffu) >= 0x7ff000u)
                lg = (int)floorf((float)log2((double)from_bits(m)));
            e = (lg + 125) & 255; /* wraps for maxima below 2^-125, as ggml's cast does */
        }
        exponent[b] = (uint8_t)e;
        /* 2/d = 2^(129-e); for e < 2 that is not a float: 2^127, then 4 or 2 */
        scale[b] = from_bits((uint32_t)(e < 2 ? 254 : 256 - e) << 23);
        scale_low[b] = (e < 2 && m) ? (e == 0 ? 4.0f : 2.0f) : 1.0f;
    }
    for (int64_t b = 0; b < n; b++) {
        const float s1 = scale[b], s2 = scale_low[b];
        const float *restrict xb = x + b * QK;
        uint8_t *restrict block = out + b * (QK / 2 + 1);
        block[0] = exponent[b];
        for (int j = 0; j < QK / 2; j++)
            block[1 + j] = (uint8_t)(e2m1_code(xb[j], s1, s2) | e2m1_code(xb[j + QK / 2], s1, s2) << 4);
    }
    return nonfinite;
}

/* x: nb * 32 floats; out: nb * 17 bytes. Returns 1 when x holds inf or NaN. */
int mxfp4_quantize(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    int nonfinite = 0;
    for (int64_t b = 0; b < nb; b += GROUP)
        nonfinite |= quantize_group(x + b * QK, out + b * (QK / 2 + 1), nb - b < GROUP ? nb - b : GROUP);
    return nonfinite;
}
