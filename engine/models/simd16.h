/* 16 float32 lanes of AVX-512 over float32 or bf16 arrays: masked loads and stores that widen
 * bf16 exactly and round to it as torch does (to nearest even), shared by the native kernels. */
#ifndef SPECDEC_SIMD16_H
#define SPECDEC_SIMD16_H

#include <immintrin.h>
#include <stdint.h>

/* The first min(left, 16) lanes. */
static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* Up to 16 values from p + i as float32 (lanes past `left` read as 0). */
static inline __m512 load16(const void *p, int64_t i, int64_t left, int bf16) {
    __mmask16 m = lanes(left);
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Up to 16 values to p + i, rounded to nearest even where p holds bf16. */
static inline void store16(void *p, int64_t i, __m512 v, int64_t left, int bf16) {
    __mmask16 m = lanes(left);
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)p + i, m, v);
        return;
    }
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    __m256i rounded = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, rounded);
}

#endif
