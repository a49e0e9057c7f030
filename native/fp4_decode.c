/* The compiled FP4 lookups of runtime/expert_decode.py. A row of 16 values per scale byte (the values of codes 0..15
   under that scale: 8 KiB in total) is all a kernel needs; byte j of a group gives values 2j (low nibble) and 2j + 1
   (high nibble). Three kernels compute the same thing: plain C; SSSE3 (pshufb, 16 lookups per instruction, every
   x86-64 of the last 15 years); AVX-512 (vpermw/vpermd: a whole group per instruction). Each is compiled for its own
   target and the CPU picks at run time, so every level can be checked on a machine that runs the highest. */
#include <stdint.h>

/* out[32 g + 2 j], out[32 g + 2 j + 1] = nib[scale << 4 | low nibble], nib[scale << 4 | high nibble] of byte j of
   group g: every 16-byte group of `groups`, with the group's scale byte choosing a row of 16 values */
#define ARGS const uint8_t *data, int64_t data_stride, const uint8_t *scale, int64_t scale_stride, \
             const T *nib, T *out, int64_t groups
#define SCALAR(NAME) \
static void NAME(ARGS) { \
    for (int64_t g = 0; g < groups; g++) { \
        const T *row = nib + ((int64_t)scale[g * scale_stride] << 4); \
        const uint8_t *d = data + g * data_stride; \
        T *o = out + g * 32; \
        for (int j = 0; j < 16; j++) { o[2 * j] = row[d[j] & 15]; o[2 * j + 1] = row[d[j] >> 4]; } \
    } \
}
#define T uint16_t
SCALAR(nibbles16_scalar)
#undef T
#define T uint32_t
SCALAR(nibbles32_scalar)
#undef T

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SIMD 1

/* SSSE3: pshufb looks 16 bytes up by nibble, so byte b of the 16 values of a row is its own 16-byte table: the
   table comes split into byte planes (row s: `width` planes of 16 bytes), and the planes are interleaved back */
__attribute__((target("ssse3")))
static inline void planes(const uint8_t *row, int width, __m128i *plane) {
    for (int b = 0; b < width; b++) plane[b] = _mm_loadu_si128((const __m128i *)(row + 16 * b));
}

__attribute__((target("ssse3")))
static inline void nibble_indices(const uint8_t *d, __m128i *first, __m128i *second) {
    const __m128i mask = _mm_set1_epi8(15);
    __m128i x = _mm_loadu_si128((const __m128i *)d);
    __m128i lo = _mm_and_si128(x, mask), hi = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
    *first = _mm_unpacklo_epi8(lo, hi);  /* codes of values 0..15 of the group, in order */
    *second = _mm_unpackhi_epi8(lo, hi);  /* values 16..31 */
}

__attribute__((target("ssse3")))
static void nibbles16_ssse3(const uint8_t *data, int64_t data_stride, const uint8_t *scale, int64_t scale_stride,
                            const uint16_t *nib, uint16_t *out, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        __m128i plane[2], idx[2];
        planes((const uint8_t *)(nib + ((int64_t)scale[g * scale_stride] << 4)), 2, plane);
        nibble_indices(data + g * data_stride, &idx[0], &idx[1]);
        __m128i *o = (__m128i *)(out + g * 32);
        for (int h = 0; h < 2; h++) {
            __m128i b0 = _mm_shuffle_epi8(plane[0], idx[h]), b1 = _mm_shuffle_epi8(plane[1], idx[h]);
            _mm_storeu_si128(o + 2 * h, _mm_unpacklo_epi8(b0, b1));
            _mm_storeu_si128(o + 2 * h + 1, _mm_unpackhi_epi8(b0, b1));
        }
    }
}

__attribute__((target("ssse3")))
static void nibbles32_ssse3(const uint8_t *data, int64_t data_stride, const uint8_t *scale, int64_t scale_stride,
                            const uint32_t *nib, uint32_t *out, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        __m128i plane[4], idx[2];
        planes((const uint8_t *)(nib + ((int64_t)scale[g * scale_stride] << 4)), 4, plane);
        nibble_indices(data + g * data_stride, &idx[0], &idx[1]);
        __m128i *o = (__m128i *)(out + g * 32);
        for (int h = 0; h < 2; h++) {
            __m128i b[4];
            for (int k = 0; k < 4; k++) b[k] = _mm_shuffle_epi8(plane[k], idx[h]);
            __m128i lo01 = _mm_unpacklo_epi8(b[0], b[1]), lo23 = _mm_unpacklo_epi8(b[2], b[3]);
            __m128i hi01 = _mm_unpackhi_epi8(b[0], b[1]), hi23 = _mm_unpackhi_epi8(b[2], b[3]);
            _mm_storeu_si128(o + 4 * h, _mm_unpacklo_epi16(lo01, lo23));
            _mm_storeu_si128(o + 4 * h + 1, _mm_unpackhi_epi16(lo01, lo23));
            _mm_storeu_si128(o + 4 * h + 2, _mm_unpacklo_epi16(hi01, hi23));
            _mm_storeu_si128(o + 4 * h + 3, _mm_unpackhi_epi16(hi01, hi23));
        }
    }
}

#include "nibble_group.h"

/* AVX-512: the row is one register; vpermw / vpermd look all 32 values of a group up at once */
__attribute__((target("avx512f,avx512bw")))
static void nibbles16_avx512(const uint8_t *data, int64_t data_stride, const uint8_t *scale, int64_t scale_stride,
                             const uint16_t *nib, uint16_t *out, int64_t groups) {
    for (int64_t g = 0; g < groups; g++) {
        _mm512_storeu_si512(out + g * 32, nibble_group(nib + ((int64_t)scale[g * scale_stride] << 4),
                                                       data + g * data_stride));
    }
}

__attribute__((target("avx512f")))
static void nibbles32_avx512(const uint8_t *data, int64_t data_stride, const uint8_t *scale, int64_t scale_stride,
                             const uint32_t *nib, uint32_t *out, int64_t groups) {
    const __m512i low = _mm512_set1_epi32(15);
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int64_t g = 0; g < groups; g++) {
        __m512i row = _mm512_loadu_si512(nib + ((int64_t)scale[g * scale_stride] << 4));
        __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(data + g * data_stride)));
        __m512i lo = _mm512_permutexvar_epi32(_mm512_and_si512(x, low), row);
        __m512i hi = _mm512_permutexvar_epi32(_mm512_srli_epi32(x, 4), row);
        _mm512_storeu_si512(out + g * 32, _mm512_permutex2var_epi32(lo, first, hi));
        _mm512_storeu_si512(out + g * 32 + 16, _mm512_permutex2var_epi32(lo, second, hi));
    }
}
#endif

/* kernel levels: 0 scalar, 1 SSSE3, 2 AVX-512; the highest this CPU runs */
int fp4_best_level(void) {
#ifdef SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
    if (__builtin_cpu_supports("ssse3")) return 1;
#endif
    return 0;
}

/* decode with the kernel of `level` for `itemsize`-byte values (2: bf16, 4: f32); -1 for a level not built here */
typedef void (*kernel16)(const uint8_t *, int64_t, const uint8_t *, int64_t, const uint16_t *, uint16_t *, int64_t);
typedef void (*kernel32)(const uint8_t *, int64_t, const uint8_t *, int64_t, const uint32_t *, uint32_t *, int64_t);
int fp4_decode_nibbles(int level, int itemsize, const uint8_t *data, int64_t data_stride, const uint8_t *scale,
                       int64_t scale_stride, const void *nib, void *out, int64_t groups) {
    kernel16 k16 = 0;
    kernel32 k32 = 0;
    if (level == 0) { k16 = nibbles16_scalar; k32 = nibbles32_scalar; }
#ifdef SIMD
    if (level == 1) { k16 = nibbles16_ssse3; k32 = nibbles32_ssse3; }
    if (level == 2) { k16 = nibbles16_avx512; k32 = nibbles32_avx512; }
#endif
    if (!k16 || (itemsize != 2 && itemsize != 4)) return -1;
    if (itemsize == 2) k16(data, data_stride, scale, scale_stride, nib, out, groups);
    else k32(data, data_stride, scale, scale_stride, nib, out, groups);
    return 0;
}
