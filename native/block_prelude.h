/* What the compiled block quantizers share (q8_0_quantize.c, mxfp4_quantize.c): 32-element blocks, handled GROUP at
   a time, and each block's largest |x| as float bits (sign cleared), compared as integers, which orders finite floats
   like their magnitudes (inf and NaN sort above them). */
#ifndef MOEPACK_BLOCK_PRELUDE_H
#define MOEPACK_BLOCK_PRELUDE_H

#include <stdint.h>
#include <string.h>

#define QK 32
#define GROUP 16

static inline void block_amax_bits(const float *restrict x, uint32_t *restrict amax_bits, int64_t n) {
    for (int64_t b = 0; b < n; b++) {
        uint32_t m = 0;
        for (int j = 0; j < QK; j++) {
            uint32_t bits;
            memcpy(&bits, x + b * QK + j, 4);
            bits &= 0x7fffffffu;
            m = bits > m ? bits : m;
        }
        amax_bits[b] = m;
    }
}

#endif
