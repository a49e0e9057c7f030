/* One FP4 group's 32 values by AVX-512, shared by the lookup library (fp4_decode.c) and the fused kernel's
   (fp4_linear.c); each is compiled on its own. Include it only where the compiler targets x86-64.
   vpermw indices: one 32-bit lane per data byte, byte | byte << 12, whose low 16 bits hold the low code in bits 0-3
   and whose high 16 bits are the high code: values 2j and 2j + 1. vpermw reads 5 bits of an index; the low half's
   bit 4 (the high code's first bit) picks the row's second copy in a register holding it twice, so no masking is
   needed. */
#ifndef MOEPACK_NIBBLE_GROUP_H
#define MOEPACK_NIBBLE_GROUP_H

#include <immintrin.h>
#include <stdint.h>

/* the 32 values of one group: its scale's row of 16 values (`row`), its 16 data bytes */
__attribute__((target("avx512f,avx512bw"), always_inline))
static inline __m512i nibble_group(const uint16_t *row, const uint8_t *bytes) {
    __m512i twice = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)row));
    __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    return _mm512_permutexvar_epi16(_mm512_or_si512(x, _mm512_slli_epi32(x, 12)), twice);
}

#endif
