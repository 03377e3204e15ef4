/*
 * The model's small bf16 ops on CPU, one pass over memory each, with the rounding
 * of their torch references (kernels/rmsnorm.py, rotary.py, activation.py,
 * kv_write.py), so results agree with them to the last bit or within one bf16 ulp
 * where fp32 evaluation order differs:
 *
 *   rms_norm      x (+ residual, rounded) -> weight * bf16(x * rsqrt(mean(x^2) + eps))
 *   rotary        q, k in place: rotate_half with the fp32 cos/sin table
 *   silu_and_mul  bf16(silu(gate)) * up
 *   write_kv      scatter each token's K/V row into its cache slot
 *
 * Each is one call for the whole batch instead of the 3-8 torch ops (and fp32
 * temporaries) of its reference. Rows are split across OpenMP threads when a
 * call has enough of them to pay for it. Needs AVX-512F (pdserve_fused_available).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define PAR_MIN_ELEMS (1 << 15) /* below this, one thread: the fork/join costs more than it saves */

int pdserve_fused_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
static inline void store16_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, narrow16_bf16(v));
}
/* round an fp32 vector to bf16 and back: the value a bf16 temporary would hold */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16_bf16(v)), 16));
}
#endif

/* res may be NULL (then res_out is unused). Row length H; rows M. */
int pdserve_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *res, int64_t ldr, const uint16_t *w,
                          uint16_t *out, int64_t ldo, uint16_t *res_out, int64_t ldro, int M, int H, float eps) {
#if defined(__AVX512F__)
#pragma omp parallel for schedule(static) if ((int64_t)M * H >= PAR_MIN_ELEMS)
    for (int m = 0; m < M; m++) {
        const uint16_t *xr = x + m * ldx;
        uint16_t *ro = res ? res_out + m * ldro : NULL;
        __m512 ss = _mm512_setzero_ps();
        /* pass 1: the (rounded) sum with the residual, and the sum of squares */
        for (int j = 0; j < H; j += 16) {
            const __mmask16 mk = tail_mask(H - j);
            __m512 v = load16m_bf16(xr + j, mk);
            if (res) {
                v = round_bf16(_mm512_add_ps(v, load16m_bf16(res + m * ldr + j, mk)));
                store16_bf16(ro + j, v, mk);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        const uint16_t *src = res ? ro : xr;
        /* pass 2: weight * bf16(x * inv), rounded */
        for (int j = 0; j < H; j += 16) {
            const __mmask16 mk = tail_mask(H - j);
            const __m512 h = round_bf16(_mm512_mul_ps(load16m_bf16(src + j, mk), inv));
            store16_bf16(out + m * ldo + j, _mm512_mul_ps(h, load16m_bf16(w + j, mk)), mk);
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)res; (void)ldr; (void)w; (void)out; (void)ldo; (void)res_out; (void)ldro;
    (void)M; (void)H; (void)eps;
    return -1;
#endif
}

/* x: [T, H, D] bf16 with strides (ldt, ldh, 1), rotated in place; cos_sin: fp32 [max_pos, D]
 * = cat(cos, sin) per position. D even, D / 2 <= 256. */
int pdserve_rotary_bf16(uint16_t *x, int64_t ldt, int64_t ldh, int T, int H, int D, const int64_t *positions,
                        const float *cos_sin, int64_t ldc) {
#if defined(__AVX512F__)
    const int half = D / 2;
#pragma omp parallel for schedule(static) if ((int64_t)T * H * D >= PAR_MIN_ELEMS)
    for (int t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * ldc;
        for (int h = 0; h < H; h++) {
            uint16_t *row = x + t * ldt + h * ldh;
            for (int j = 0; j < half; j += 16) {
                const __mmask16 mk = tail_mask(half - j);
                const __m512 c = _mm512_maskz_loadu_ps(mk, cs + j), s = _mm512_maskz_loadu_ps(mk, cs + half + j);
                const __m512 x1 = load16m_bf16(row + j, mk), x2 = load16m_bf16(row + half + j, mk);
                /* as the reference: each product rounded to fp32, then the sum */
                const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s));
                const __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s));
                store16_bf16(row + j, o1, mk);
                store16_bf16(row + half + j, o2, mk);
            }
        }
    }
    return 0;
#else
    (void)x; (void)ldt; (void)ldh; (void)T; (void)H; (void)D; (void)positions; (void)cos_sin; (void)ldc;
    return -1;
#endif
}

/* x: [M, 2 I] = cat(gate, up) per row; out: [M, I] */
int pdserve_silu_and_mul_bf16(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int M, int I) {
#if defined(__AVX512F__)
    const __m512 nlog2e = _mm512_set1_ps(-1.4426950408889634f), one = _mm512_set1_ps(1.f);
#pragma omp parallel for schedule(static) if ((int64_t)M * I >= PAR_MIN_ELEMS)
    for (int m = 0; m < M; m++) {
        const uint16_t *g = x + m * ldx, *u = g + I;
        for (int j = 0; j < I; j += 16) {
            const __mmask16 mk = tail_mask(I - j);
            const __m512 gv = load16m_bf16(g + j, mk);
            /* silu(g) = g / (1 + e^-g), rounded to bf16 as F.silu's output is */
            const __m512 act = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, exp2_ps(_mm512_mul_ps(gv, nlog2e)))));
            store16_bf16(out + m * ldo + j, _mm512_mul_ps(act, load16m_bf16(u + j, mk)), mk);
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)out; (void)ldo; (void)M; (void)I;
    return -1;
#endif
}

/* k, v: [T, row] (row = Hkv * D contiguous elements per token, token stride k_st / v_st);
 * caches: [blocks, block_size, row] with block stride c_sb and slot stride c_so
 * (elements of elem_bytes). Copies, so any 16-bit or 32-bit dtype works. */
void pdserve_write_kv(const char *k, int64_t k_st, const char *v, int64_t v_st, char *kc, char *vc,
                      int64_t c_sb, int64_t c_so, const int64_t *slots, int T, int row, int block_size,
                      int elem_bytes) {
    const size_t bytes = (size_t)row * elem_bytes;
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        const int64_t off = ((slot / block_size) * c_sb + (slot % block_size) * c_so) * elem_bytes;
        memcpy(kc + off, k + t * k_st * elem_bytes, bytes);
        memcpy(vc + off, v + t * v_st * elem_bytes, bytes);
    }
}

/* The int8 cache's write: each (token, kv head) row of D values (bf16 or fp32 at k / v, token
 * stride k_st / v_st elements, heads contiguous) quantized symmetrically, scale = max |x| / 127
 * (1 for an all-zero row), q = round(x / scale) to nearest even, and stored as D int8 followed by
 * the fp32 scale: the layout services/engine/kv_cache.py gives int8 caches (rows of D + 4 bytes;
 * block stride c_sb and slot stride c_so in bytes). kernels/kv_int8.py is the reference. */
void pdserve_write_kv_int8(const void *k, int64_t k_st, const void *v, int64_t v_st, int src_bf16, int8_t *kc,
                           int8_t *vc, int64_t c_sb, int64_t c_so, const int64_t *slots, int T, int HKV, int D,
                           int block_size) {
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        const int64_t off = (slot / block_size) * c_sb + (slot % block_size) * c_so;
        for (int which = 0; which < 2; which++) {
            const void *src = which ? v : k;
            const int64_t st = which ? v_st : k_st;
            int8_t *dst = (which ? vc : kc) + off;
            for (int h = 0; h < HKV; h++) {
                float x[512];
                float amax = 0.f;
                for (int d = 0; d < D; d++) {
                    const int64_t i = t * st + (int64_t)h * D + d;
                    x[d] = src_bf16 ? bf16_to_f32(((const uint16_t *)src)[i]) : ((const float *)src)[i];
                    amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
                }
                const float scale = amax > 0.f ? amax / 127.f : 1.f;
                int8_t *row = dst + (int64_t)h * (D + 4);
                for (int d = 0; d < D; d++) row[d] = (int8_t)nearbyintf(x[d] / scale);
                memcpy(row + D, &scale, 4);
            }
        }
    }
}
