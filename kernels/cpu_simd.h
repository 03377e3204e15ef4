/* Helpers shared by the CPU kernels (one library, see kernels/native.py). */
#ifndef PDSERVE_CPU_SIMD_H
#define PDSERVE_CPU_SIMD_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
/* 2^x; lanes below -126 flush to 0, lanes above 128 become inf.
 * x = n + f with n = round(x), f in [-0.5, 0.5]; 2^f = e^(f ln 2) by its Taylor
 * series to degree 7 (remainder < 6e-9, below fp32 rounding), then scaled by 2^n
 * exactly with vscalefps. */
static inline __m512 exp2_ps(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.525273380e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.540353039e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355815e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129108e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265070e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471806e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000000e+00f));
    return _mm512_maskz_scalef_ps(~tiny, p, n);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* fp32 bits rounded to nearest even at bf16 precision (as torch's cast; inputs here are never
 * NaN): the bf16 is the upper 16 bits */
static inline __m512i round_bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

/* fp32 -> bf16, round to nearest even */
static inline __m256i narrow16_bf16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16));
}

/* 32 bf16 (64 bytes) as two fp32 vectors: the even elements and the odd ones (a shift and an
 * and, no shuffle). Kernels whose arithmetic does not care about element order keep this
 * split and undo it only when they store (narrow32_bf16). */
static inline void widen32_bf16(const void *p, __m512 *even, __m512 *odd) {
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The inverse of widen32_bf16, rounding to nearest even: lane j = bf16(odd[j]) << 16 |
 * bf16(even[j]), i.e. elements 2j and 2j + 1 in memory order. */
static inline __m512i narrow32_bf16(__m512 even, __m512 odd) {
    return _mm512_or_si512(_mm512_srli_epi32(round_bf16_bits(even), 16),
                           _mm512_and_si512(round_bf16_bits(odd), _mm512_set1_epi32((int)0xffff0000u)));
}

/* the lanes of a row's last, partial vector of 16 */
static inline __mmask16 tail_mask(int left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u); }

/* up to 16 bf16 (the mask's lanes) widened to fp32; other lanes 0 */
static inline __m512 load16m_bf16(const uint16_t *p, __mmask16 m) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

#endif
