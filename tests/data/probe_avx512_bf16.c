/* Does the C compiler build a function for AVX512-BF16? (an old one does not know the target) */
#include <immintrin.h>

__attribute__((target("avx512f,avx512bw,avx512bf16")))
__m512 probe(__m512 a, __m512i b) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)b); }
