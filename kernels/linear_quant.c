/*
 * y = x @ W^T for W in a GGUF file's own quantized blocks (Q4_0, Q4_1, Q8_0), as llama.cpp
 * computes it: x is quantized per block of 32 to int8 with one scale (llama.cpp's Q8_0 /
 * Q8_1 activations), the block's integer dot products are exact, and the scales combine
 * them in fp32:
 *
 *     Q4_0: w = d (q - 8)       block: d, q[32] in 0..15
 *     Q4_1: w = d q + m         block: d, m, q[32] in 0..15
 *     Q8_0: w = d q             block: d, q[32] in -127..127
 *
 *     y[n] += d_w[n] d_x (sum_k q[n][k] qx[k])   (+ m_w[n] d_x sum_k qx[k]   for Q4_1)
 *                                                 (- 8 d_w[n] d_x sum_k qx[k] for Q4_0)
 *
 * Packed layout (kernels/gguf_linear.py repacks the file's blocks once at load, keeping their
 * bits): panels of 16 output columns; per panel, per block of 32 k, one record
 *
 *     Q4_0: d[16] fp16 | qs[256]                     288 bytes (the file's 18 per block)
 *     Q4_1: d[16] fp16 | m[16] fp16 | qs[256]        320 bytes (the file's 20 per block)
 *     Q8_0: d[16] fp16 | sum_k q[16] int16 | qs[512] 576 bytes (the file's 34, + 2 for the sum)
 *
 * where qs is vectors of 64 bytes, byte 4c + i of vector v holding column c:
 *     Q4: low nibble q[c][4v + i], high nibble q[c][16 + 4v + i]      (v < 4)
 *     Q8: q[c][4v + i]                                                 (v < 8)
 * so one VNNI vpdpbusd (64 unsigned x signed byte products summed in fours into 16 int32
 * lanes) takes a vector against 4 bytes of x broadcast: the 16 columns accumulate in the
 * lanes, no horizontal sums. Q4 nibbles are the unsigned operand; Q8_0 weights are signed,
 * so x goes in as the unsigned operand (qx + 128, i.e. qx ^ 0x80) and 128 sum_k q comes off.
 *
 * VNNI (avx512_vnni level and up); below it the same integer arithmetic in portable C.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define GK_Q4_0 0
#define GK_Q4_1 1
#define GK_Q8_0 2
#define QB 32  /* weights per block */
#define QMR 8  /* rows per micro-kernel */

static int record_bytes(int kind) { return kind == GK_Q4_0 ? 288 : kind == GK_Q4_1 ? 320 : 576; }

/* four int8 of x as one int32 (memcpy: no aliasing assumptions) */
static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Activations of one call, quantized: xq[r][k] int8, per block: dx[r][b] (scale), sx[r][b]
 * (sum of the block's xq). The caller's thread's buffers. */
static __thread int8_t *xq_buf;
static __thread float *dx_buf;
static __thread int32_t *sx_buf;
static __thread size_t xq_len, xs_len;

static int quantize_rows(const void *x, int x_bf16, int64_t ldx, int M, int K) {
    const int nb = K / QB;
    const size_t need = (size_t)M * K, need_s = (size_t)M * nb;
    if (xq_len < need) {
        free(xq_buf);
        xq_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        xq_len = xq_buf ? need : 0;
    }
    if (xs_len < need_s) {
        free(dx_buf);
        free(sx_buf);
        dx_buf = malloc(need_s * sizeof(float));
        sx_buf = malloc(need_s * sizeof(int32_t));
        xs_len = dx_buf && sx_buf ? need_s : 0;
    }
    if (!xq_buf || !dx_buf || !sx_buf) return -1;
    int8_t *const xq = xq_buf;
    float *const dx = dx_buf;
    int32_t *const sx = sx_buf;
#pragma omp parallel for schedule(static) if (M * nb >= 256)
    for (int64_t i = 0; i < (int64_t)M * nb; i++) {
        const int r = (int)(i / nb), b = (int)(i % nb);
        float v[QB], amax = 0.f;
        for (int k = 0; k < QB; k++) {
            const int64_t off = r * ldx + b * QB + k;
            v[k] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[off]) : ((const float *)x)[off];
            amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
        }
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int k = 0; k < QB; k++) {
            const int q = (int)nearbyintf(v[k] * inv);
            xq[(int64_t)r * K + b * QB + k] = (int8_t)q;
            sum += q;
        }
        dx[i] = d;
        sx[i] = sum;
    }
    return 0;
}

#if defined(__AVX512VNNI__)
/* one panel (16 columns) times mr rows of quantized x, all K: 16 fp32 results per row */
static inline __attribute__((always_inline)) void gguf_micro(
        const int kind, const int mr, const uint8_t *panel, int nb, const int8_t *xq, const float *dx,
        const int32_t *sx, int K, int64_t r0, __m512 *out) {
    const int rb = record_bytes(kind);
    __m512 acc[QMR];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = panel + (int64_t)b * rb;
        _mm_prefetch((const char *)rec + 4 * rb, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4 * rb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4 * rb + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4 * rb + 192, _MM_HINT_T0);
        _mm_prefetch((const char *)rec + 4 * rb + 256, _MM_HINT_T0);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
        if (kind == GK_Q8_0) {
            const __m512i comp = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(rec + 32))), 7);
            __m512i w[8];
            for (int v = 0; v < 8; v++) w[v] = _mm512_loadu_si512(rec + 64 + 64 * v);
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = xq + (r0 + r) * K + b * QB;
                __m512i a = _mm512_sub_epi32(_mm512_setzero_si512(), comp);
                for (int v = 0; v < 8; v++)
                    a = _mm512_dpbusd_epi32(a, _mm512_xor_si512(_mm512_set1_epi32(load4(xr + 4 * v)), flip), w[v]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dw, _mm512_set1_ps(dx[(r0 + r) * nb + b])),
                                         acc[r]);
            }
        } else {
            const int qs_off = kind == GK_Q4_1 ? 64 : 32;
            const __m512 mw = kind == GK_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32)))
                                              : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
            __m512i lo[4], hi[4];
            for (int v = 0; v < 4; v++) {
                const __m512i q = _mm512_loadu_si512(rec + qs_off + 64 * v);
                lo[v] = _mm512_and_si512(q, nib);
                hi[v] = _mm512_and_si512(_mm512_srli_epi16(q, 4), nib);
            }
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = xq + (r0 + r) * K + b * QB;
                __m512i a = _mm512_setzero_si512();
                for (int v = 0; v < 4; v++) {
                    a = _mm512_dpbusd_epi32(a, lo[v], _mm512_set1_epi32(load4(xr + 4 * v)));
                    a = _mm512_dpbusd_epi32(a, hi[v], _mm512_set1_epi32(load4(xr + 16 + 4 * v)));
                }
                const float d = dx[(r0 + r) * nb + b];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dw, _mm512_set1_ps(d)), acc[r]);
                /* the offset term: m_w (Q4_1) or -8 d_w (Q4_0), times d_x sum qx */
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(d * (float)sx[(r0 + r) * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r];
}

static void gguf_rows(int kind, int mr, const uint8_t *panel, int nb, const int8_t *xq, const float *dx,
                      const int32_t *sx, int K, int64_t r0, __m512 *out) {
#define GCASE(R) case R:                                                                  \
        if (kind == GK_Q4_1) gguf_micro(GK_Q4_1, R, panel, nb, xq, dx, sx, K, r0, out);    \
        else if (kind == GK_Q4_0) gguf_micro(GK_Q4_0, R, panel, nb, xq, dx, sx, K, r0, out); \
        else gguf_micro(GK_Q8_0, R, panel, nb, xq, dx, sx, K, r0, out);                    \
        break;
    switch (mr) {
        GCASE(8) GCASE(7) GCASE(6) GCASE(5) GCASE(4) GCASE(3) GCASE(2) GCASE(1)
        default: break;
    }
#undef GCASE
}
#endif

/* the same sums in portable C (levels below avx512_vnni; the integer parts are exact, so it
 * differs from the vector kernel only in the order of the fp32 additions) */
static void gguf_portable_panel(int kind, int mr, const uint8_t *panel, int nb, const int8_t *xq, const float *dx,
                                const int32_t *sx, int K, int64_t r0, float out[][16]) {
    const int rb = record_bytes(kind);
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < 16; c++) out[r][c] = 0.f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = panel + (int64_t)b * rb;
        float dw[16], mw[16];
        int32_t comp[16];
        for (int c = 0; c < 16; c++) {
            uint16_t h;
            memcpy(&h, rec + 2 * c, 2);
            dw[c] = half_to_float(h);
            if (kind == GK_Q4_1) {
                memcpy(&h, rec + 32 + 2 * c, 2);
                mw[c] = half_to_float(h);
            } else {
                mw[c] = -8.f * dw[c];
            }
            if (kind == GK_Q8_0) {
                int16_t s;
                memcpy(&s, rec + 32 + 2 * c, 2);
                comp[c] = s;
            }
        }
        for (int r = 0; r < mr; r++) {
            const int8_t *xr = xq + (r0 + r) * K + b * QB;
            const float d = dx[(r0 + r) * nb + b];
            int32_t dot[16] = {0};
            if (kind == GK_Q8_0) {
                const int8_t *qs = (const int8_t *)(rec + 64);
                for (int v = 0; v < 8; v++)
                    for (int c = 0; c < 16; c++)
                        for (int i = 0; i < 4; i++) dot[c] += qs[64 * v + 4 * c + i] * xr[4 * v + i];
                (void)comp;
                for (int c = 0; c < 16; c++) out[r][c] += (float)dot[c] * (dw[c] * d);
            } else {
                const uint8_t *qs = rec + (kind == GK_Q4_1 ? 64 : 32);
                for (int v = 0; v < 4; v++)
                    for (int c = 0; c < 16; c++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t q = qs[64 * v + 4 * c + i];
                            dot[c] += (q & 15) * xr[4 * v + i] + (q >> 4) * xr[16 + 4 * v + i];
                        }
                for (int c = 0; c < 16; c++) {
                    out[r][c] += (float)dot[c] * (dw[c] * d);
                    out[r][c] += mw[c] * (d * (float)sx[(r0 + r) * nb + b]);
                }
            }
        }
    }
}

static void store16(void *y, int y_bf16, int64_t off, const float *v, int ncols) {
    for (int c = 0; c < ncols; c++) {
        if (y_bf16) ((uint16_t *)y)[off + c] = f32_to_bf16(v[c]);
        else ((float *)y)[off + c] = v[c];
    }
}

static int gguf_linear(int vector, const void *x, int x_bf16, int64_t ldx, const uint8_t *wp, int kind, void *y,
                       int y_bf16, int64_t ldy, int M, int N, int K) {
    if (K % QB) return -2;
    if (quantize_rows(x, x_bf16, ldx, M, K)) return -1;
    const int8_t *xq = xq_buf;
    const float *dx = dx_buf;
    const int32_t *sx = sx_buf;
    const int nb = K / QB, panels = (N + 15) / 16, blocks = (M + QMR - 1) / QMR;
    const int64_t panel_bytes = (int64_t)nb * record_bytes(kind);
    const int per_chunk = panels / (4 * omp_get_max_threads());
    const int chunk = per_chunk > 1 ? per_chunk : 1;
#pragma omp parallel for collapse(2) schedule(dynamic, chunk)
    for (int p = 0; p < panels; p++) {
        for (int rb = 0; rb < blocks; rb++) {
            const uint8_t *panel = wp + p * panel_bytes;
            const int ncols = N - 16 * p < 16 ? N - 16 * p : 16;
            const int64_t r0 = (int64_t)rb * QMR;
            const int mr = M - r0 < QMR ? (int)(M - r0) : QMR;
            float out[QMR][16] __attribute__((aligned(64)));
#if defined(__AVX512VNNI__)
            if (vector) {
                __m512 v[QMR];
                gguf_rows(kind, mr, panel, nb, xq, dx, sx, K, r0, v);
                for (int r = 0; r < mr; r++) _mm512_store_ps(out[r], v[r]);
            } else
#endif
                gguf_portable_panel(kind, mr, panel, nb, xq, dx, sx, K, r0, out);
            for (int r = 0; r < mr; r++) store16(y, y_bf16, (r0 + r) * ldy + 16 * (int64_t)p, out[r], ncols);
        }
    }
    (void)vector;
    return 0;
}

/* Returns 0, -1 if memory ran out, -2 if K is not a multiple of 32. */
int pdserve_linear_gguf(const void *x, int x_bf16, int64_t ldx, const uint8_t *wp, int kind, void *y, int y_bf16,
                        int64_t ldy, int M, int N, int K) {
#if defined(__AVX512VNNI__)
    return gguf_linear(1, x, x_bf16, ldx, wp, kind, y, y_bf16, ldy, M, N, K);
#else
    return gguf_linear(0, x, x_bf16, ldx, wp, kind, y, y_bf16, ldy, M, N, K);
#endif
}

/* The portable loop at any level (tests compare it with the VNNI kernel). */
int pdserve_linear_gguf_portable(const void *x, int x_bf16, int64_t ldx, const uint8_t *wp, int kind, void *y,
                                 int y_bf16, int64_t ldy, int M, int N, int K) {
    return gguf_linear(0, x, x_bf16, ldx, wp, kind, y, y_bf16, ldy, M, N, K);
}

/* The packed records' weights as fp32 rows [N][K] (tests, and the torch reference path). */
void pdserve_gguf_dequantize(const uint8_t *wp, int kind, float *w, int N, int K) {
    const int nb = K / QB, rb = record_bytes(kind);
    for (int p = 0; p < (N + 15) / 16; p++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *rec = wp + ((int64_t)p * nb + b) * rb;
            for (int c = 0; c < 16 && 16 * p + c < N; c++) {
                uint16_t h;
                memcpy(&h, rec + 2 * c, 2);
                const float d = half_to_float(h);
                float m = -8.f * d;
                if (kind == GK_Q4_1) { memcpy(&h, rec + 32 + 2 * c, 2); m = half_to_float(h); }
                float *row = w + (int64_t)(16 * p + c) * K + b * QB;
                if (kind == GK_Q8_0) {
                    for (int v = 0; v < 8; v++)
                        for (int i = 0; i < 4; i++) row[4 * v + i] = d * (float)((const int8_t *)rec)[64 + 64 * v + 4 * c + i];
                } else {
                    const uint8_t *qs = rec + (kind == GK_Q4_1 ? 64 : 32);
                    for (int v = 0; v < 4; v++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t q = qs[64 * v + 4 * c + i];
                            row[4 * v + i] = d * (float)(q & 15) + m;
                            row[16 + 4 * v + i] = d * (float)(q >> 4) + m;
                        }
                }
            }
        }
}
