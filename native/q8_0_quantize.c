/* Q8_0 quantizer (format_spec/quant_q8_0.py's quantize_chunk in C, the same bytes): 16 blocks at a time so that the
   compiler vectorises each step across elements. The block max is taken on the float bits with the sign cleared
   (for non-negative floats, and inf/NaN above them, integer order is float order), which also flags a non-finite
   block. The float -> int conversion truncates. */
#include "block_prelude.h"

#define FLT_MAX_F 3.4028234663852886e38f
#define HALF_DOWN 0.49999997f /* 0.5 - 2^-25 */

static int quantize_group(const float *restrict x, uint8_t *restrict out, int64_t n) {
    uint32_t amax_bits[GROUP];
    float inv[GROUP];
    _Float16 d16[GROUP];
    int nonfinite = 0;
    block_amax_bits(x, amax_bits, n);
    for (int64_t b = 0; b < n; b++) {
        float amax;
        memcpy(&amax, &amax_bits[b], 4);
        float d = amax / 127.0f;
        float id = 1.0f / d;
        inv[b] = id <= FLT_MAX_F ? id : 0.0f; /* d == 0, or 1/d overflowing: codes 0 */
        d16[b] = (_Float16)d;
    }
    for (int64_t b = 0; b < n; b++) {
        uint8_t *restrict block = out + b * (QK + 2);
        if (amax_bits[b] >= 0x7f800000u) {
            nonfinite = 1;
            memset(block, 0, QK + 2);
            continue;
        }
        memcpy(block, &d16[b], 2);
        int8_t *restrict q = (int8_t *)(block + 2);
        for (int j = 0; j < QK; j++) {
            float v = x[b * QK + j] * inv[b];
            q[j] = (int8_t)(int32_t)(v + __builtin_copysignf(HALF_DOWN, v));
        }
    }
    return nonfinite;
}

/* x: nb * 32 floats; out: nb * 34 bytes. Returns 1 when x holds inf or NaN (those blocks are zeroed). */
int q8_0_quantize(const float *restrict x, uint8_t *restrict out, int64_t nb) {
    int nonfinite = 0;
    for (int64_t b = 0; b < nb; b += GROUP)
        nonfinite |= quantize_group(x + b * QK, out + b * (QK + 2), nb - b < GROUP ? nb - b : GROUP);
    return nonfinite;
}
