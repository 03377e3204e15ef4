/*
 * y = x @ W^T (+ bias) for bf16 weights on CPU, computed with fp32 FMAs.
 *
 * Why not torch's bf16 matmul: on CPUs without AMX, oneDNN's bf16 GEMM is built on
 * vdpbf16ps, which issues at half the rate of fp32 FMAs on the machines we measured
 * (see BENCHMARKS.md), so a bf16 model would run its matmuls at half the speed of
 * the same model in fp32. Here the weights stay bf16 in memory (half the bytes to
 * stream, which is what decode at small batch is bound by) and are widened to fp32
 * in registers, where one loaded weight vector feeds MR FMAs.
 *
 * Packed weight layout (kernels/linear_cpu.py packs once at load time):
 *
 *     wp[p][k][j] = W[32 * p + j][k]     p < ceil(N / 32), k < K, j < 32
 *
 * i.e. panels of 32 output columns, each panel K rows of 32 contiguous bf16
 * (64 bytes: two fp32 vectors after widening). Columns past N are zero.
 *
 * Each k's 32 bf16 weights become two fp32 vectors, the even columns and the odd ones (a
 * shift and an and; no shuffle), and the accumulators keep that split until the store.
 *
 * Loop nest (x is widened to fp32 and packed once per call, into a per-thread buffer):
 *
 *     for each chunk of MC rows of x          (x chunk stays in L2)
 *       parallel for each panel p             (a thread's panels stay in its L2)
 *         for each MR rows of the chunk       (micro-kernel: MR x 32 accumulators
 *           acc[MR][2] += x[r][k] * wp[p][k]   in registers over the whole K)
 *
 * int8 weights (pdserve_linear_i8w, weight-only quantization) use the same panels with one
 * int8 per weight and a per-column fp32 scale applied at the store: y = scale * (x @ Q^T).
 * They widen in column order (cvtepi8_epi32), not the even/odd split of bf16.
 *
 * Rows of many tokens go to the AMX tiles where the library is built for them (linear_amx.c).
 * Without AVX-512 (the avx2 and generic levels) a portable C loop over the same panels runs,
 * which gcc vectorises for the level. pdserve_linear_available() says whether the AVX-512
 * kernel was compiled in.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"
#include "linear_pack.h"

#define MR 12   /* rows per micro-kernel: 24 accumulators + 2 weight vectors + 1 broadcast <= 32 zmm */
#define MC 192  /* rows per chunk */
#define WIDEN_MIN 96 /* rows from which a panel is widened to fp32 once (widen_panel) */
/* weights are prefetched this many bytes ahead of the loads: the hardware prefetcher alone left
 * one core at ~10 GB/s on a stream it can read at ~20 */
#define PREFETCH 8192

int pdserve_linear_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

static int weight_bytes(int wkind) { return wkind == WK_I8 ? 1 : 2; }

#if defined(__AVX512F__)

/* 16 rows of 16 floats -> 16 columns of 16 floats (r[c][i] = old r[i][c]) */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
    }
}

static __thread float *xbuf; /* the calling thread's; the OpenMP threads fill it */
static __thread size_t xbuf_len;

/* x as fp32 in blocks of MR rows, each stored k-major: block b holds rows [MR*b, MR*b + mr)
 * as xp[b*MR*K + k*mr + r], so a micro-kernel's broadcasts for one k are adjacent (one stream
 * instead of MR). Built 16 k at a time by an in-register transpose, the blocks split between
 * the threads: a scatter per row on one thread took a quarter of a 512 x 1536 projection. */
static float *pack_rows(const void *x, int x_bf16, int64_t ldx, int M, int K) {
    const int blocks = (M + MR - 1) / MR;
    const size_t need = (size_t)M * (size_t)K;
    if (xbuf_len < need) {
        free(xbuf);
        xbuf = aligned_alloc(64, need * sizeof(float));
        xbuf_len = xbuf ? need : 0;
        if (!xbuf) return NULL;
    }
    float *const out = xbuf;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int b = 0; b < blocks; b++) {
        const int mr = M - b * MR < MR ? M - b * MR : MR;
        float *dst = out + (size_t)b * MR * K;
        const __mmask16 rows = (__mmask16)((1u << mr) - 1u);
        for (int k0 = 0; k0 < K; k0 += 16) {
            const int kc = K - k0 < 16 ? K - k0 : 16;
            const __mmask16 live = (__mmask16)((1u << kc) - 1u);
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t off = (int64_t)(b * MR + i) * ldx + k0;
                if (i >= mr)
                    r[i] = _mm512_setzero_ps();
                else if (x_bf16)
                    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, (const uint16_t *)x + off)), 16));
                else
                    r[i] = _mm512_maskz_loadu_ps(live, (const float *)x + off);
            }
            transpose16(r);
            for (int c = 0; c < kc; c++) _mm512_mask_storeu_ps(dst + (size_t)(k0 + c) * mr, rows, r[c]);
        }
    }
    return out;
}

/* Weight vectors of one k, as the micro-kernel takes them: bf16 panels and the fp32 copies of
 * any panel (widen_panel) hold the even columns and the odd ones (split order); int8 panels
 * widen to columns 0-15 and 16-31 (two sign extensions, cheaper than splitting on every load).
 * The accumulators keep the order until the store. */
#define WV_BF16 0 /* bf16 panel, split order */
#define WV_F32_SPLIT 1 /* fp32 copy of a panel (widen_panel), split order */
#define WV_I8 2 /* int8 panel, column order */
static inline __attribute__((always_inline)) void load_w(const int wv, const void *panel, int64_t k, __m512 *w0,
                                                         __m512 *w1) {
    if (wv == WV_BF16) {
        widen32_bf16((const uint16_t *)panel + k * 32, w0, w1);
    } else if (wv == WV_I8) {
        const int8_t *p = (const int8_t *)panel + k * 32;
        *w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        *w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    } else {
        *w0 = _mm512_load_ps((const float *)panel + k * 32);
        *w1 = _mm512_load_ps((const float *)panel + k * 32 + 16);
    }
}

static inline __mmask16 cols_mask(int ncols, int half) {
    const int n = ncols - 16 * half;
    return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
}

/* 32 columns starting at col of a per-column vector (scale or bias) in the accumulators' order */
static inline __attribute__((always_inline)) void load_cols(const int split, const float *v, int64_t col, int ncols,
                                                            __m512 *a0, __m512 *a1) {
    const __m512 lo = _mm512_maskz_loadu_ps(cols_mask(ncols, 0), v + col);
    const __m512 hi = _mm512_maskz_loadu_ps(cols_mask(ncols, 1), v + col + 16);
    if (split) {
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        *a0 = _mm512_permutex2var_ps(lo, ev, hi);
        *a1 = _mm512_permutex2var_ps(lo, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), hi);
    } else {
        *a0 = lo;
        *a1 = hi;
    }
}

/* y[0:ncols] = the two accumulator vectors (in split or column order), ncols <= 32 */
static inline __attribute__((always_inline)) void store32(const int split, void *y, int y_bf16, int64_t off,
                                                          __m512 a0, __m512 a1, int ncols) {
    const __mmask16 m0 = cols_mask(ncols, 0), m1 = cols_mask(ncols, 1);
    if (!split) {
        if (y_bf16) {
            _mm256_mask_storeu_epi16((uint16_t *)y + off, m0, narrow16_bf16(a0));
            _mm256_mask_storeu_epi16((uint16_t *)y + off + 16, m1, narrow16_bf16(a1));
        } else {
            _mm512_mask_storeu_ps((float *)y + off, m0, a0);
            _mm512_mask_storeu_ps((float *)y + off + 16, m1, a1);
        }
    } else if (y_bf16) {
        const __mmask32 m = ncols >= 32 ? 0xffffffffu : (__mmask32)((1u << ncols) - 1u);
        _mm512_mask_storeu_epi16((uint16_t *)y + off, m, narrow32_bf16(a0, a1));
    } else {
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        _mm512_mask_storeu_ps((float *)y + off, m0, _mm512_permutex2var_ps(a0, lo, a1));
        _mm512_mask_storeu_ps((float *)y + off + 16, m1, _mm512_permutex2var_ps(a0, hi, a1));
    }
}

/* one packed block of mr rows of x (see pack_rows) times one panel -> 32 columns of y */
static inline __attribute__((always_inline)) void micro(
        const int mr, const int wv, const float *x, const void *panel, int K, const float *scale, const float *bias,
        void *y, int y_bf16, int64_t ldy, int64_t col, int ncols, const char *pf, const int pf_bytes) {
    const int split = wv != WV_I8;
    const int wb = wv == WV_I8 ? 1 : wv == WV_BF16 ? 2 : 4; /* bytes per weight */
    const int pfb = pf_bytes; /* bytes per weight of the packed panel pf */
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int k = 0;
    if (mr <= 4 && wv != WV_F32_SPLIT) {
        /* few rows (decode at small batch): streaming the weights is the whole cost, and with
         * 2 * mr accumulators the FMA latency chain paces the loads; a second set of
         * accumulators for odd k lets two k run at once */
        __m512 odd[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) odd[r][0] = odd[r][1] = _mm512_setzero_ps();
        for (; k + 2 <= K; k += 2) {
            const char *w = (const char *)panel + (int64_t)k * 32 * wb;
            _mm_prefetch(w + PREFETCH, _MM_HINT_T0);
            if (wb == 2) _mm_prefetch(w + PREFETCH + 64, _MM_HINT_T0);
            __m512 w0, w1, w2, w3;
            load_w(wv, panel, k, &w0, &w1);
            load_w(wv, panel, k + 1, &w2, &w3);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const __m512 a = _mm512_set1_ps(x[(int64_t)k * mr + r]);
                const __m512 b = _mm512_set1_ps(x[(int64_t)(k + 1) * mr + r]);
                acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
                odd[r][0] = _mm512_fmadd_ps(b, w2, odd[r][0]);
                odd[r][1] = _mm512_fmadd_ps(b, w3, odd[r][1]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            acc[r][0] = _mm512_add_ps(acc[r][0], odd[r][0]);
            acc[r][1] = _mm512_add_ps(acc[r][1], odd[r][1]);
        }
    }
    for (; k < K; k++) {
        /* the next panel's weights reach L2 while this one computes */
        if (pf && (pfb == 2 || (k & 1) == 0)) _mm_prefetch(pf + (int64_t)k * 32 * pfb, _MM_HINT_T1);
        __m512 w0, w1;
        load_w(wv, panel, k, &w0, &w1);
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[(int64_t)k * mr + r]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    __m512 s0 = _mm512_set1_ps(1.f), s1 = s0, b0 = _mm512_setzero_ps(), b1 = b0;
    if (scale) load_cols(split, scale, col, ncols, &s0, &s1);
    if (bias) load_cols(split, bias, col, ncols, &b0, &b1);
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++)
        store32(split, y, y_bf16, r * ldy + col, _mm512_fmadd_ps(acc[r][0], s0, b0),
                _mm512_fmadd_ps(acc[r][1], s1, b1), ncols);
}

static void rows_times_panel(int mr, int wv, const float *x, const void *panel, int K, const float *scale,
                             const float *bias, void *y, int y_bf16, int64_t ldy, int64_t col, int ncols,
                             const char *pf, int pf_bytes) {
    /* each case is the micro-kernel specialised for that many rows and weight form */
#define CASE(R) case R:                                                                              \
        if (wv == WV_BF16) micro(R, WV_BF16, x, panel, K, scale, bias, y, y_bf16, ldy, col, ncols, pf, 2);   \
        else if (wv == WV_I8) micro(R, WV_I8, x, panel, K, scale, bias, y, y_bf16, ldy, col, ncols, pf, 1);  \
        else micro(R, WV_F32_SPLIT, x, panel, K, scale, bias, y, y_bf16, ldy, col, ncols, pf, pf_bytes);      \
        break;
    switch (mr) {
        CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
        default: break;
    }
#undef CASE
}

/* fp32 copy of one panel in split order (int8 widened to 32-bit lanes, the even columns by a
 * shift left then an arithmetic shift right, the odd ones by the shift right alone), reused by
 * every MR-row block of a chunk: at WIDEN_MIN rows and more, widening once per panel instead of
 * once per block leaves the FMA ports to the FMAs; below it the copy costs more than it saves. */
static __thread float *wbuf;
static __thread size_t wbuf_len;

static const float *widen_panel(const void *panel, int wkind, int K) {
    const size_t need = (size_t)K * 32;
    if (wbuf_len < need) {
        free(wbuf);
        wbuf = aligned_alloc(64, need * sizeof(float));
        wbuf_len = wbuf ? need : 0;
        if (!wbuf) return NULL;
    }
    for (int k = 0; k < K; k++) {
        __m512 a, b;
        if (wkind == WK_I8) {
            const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)panel + k * 32)));
            a = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
            b = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
        } else {
            load_w(WV_BF16, panel, k, &a, &b);
        }
        _mm512_store_ps(wbuf + 32 * k, a);
        _mm512_store_ps(wbuf + 32 * k + 16, b);
    }
    return wbuf;
}

static int linear_avx512(const void *x, int x_bf16, int64_t ldx, const void *wp, int wkind, const float *scale,
                         const float *bias, void *y, int y_bf16, int64_t ldy, int M, int N, int K) {
    const float *xf = pack_rows(x, x_bf16, ldx, M, K);
    if (!xf) return -1;
    const int panels = (N + 31) / 32, wb = weight_bytes(wkind);
    /* panels are handed out in small chunks, not in one static share per thread: cores do not
     * always run at one speed (a shared VM's cores differ by up to 30% for seconds at a time;
     * another process may take part of one), and a static split waits for the slowest. About
     * 8 chunks per thread keep the dispatch cost low; fewer than MR rows make a panel too
     * little work for that, so they get 2. With a 30% load on one of two cores: 18-20% faster
     * at 34-512 rows than a static split, the same at 1 row. */
    const int per_chunk = panels / ((M < MR ? 2 : 8) * omp_get_max_threads());
    const int chunk = per_chunk > 1 ? per_chunk : 1;
    int failed = 0;
    for (int m0 = 0; m0 < M; m0 += MC) {
        const int mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel for schedule(dynamic, chunk)
        for (int p = 0; p < panels; p++) {
            const char *panel = (const char *)wp + (int64_t)p * K * 32 * wb;
            const int ncols = N - 32 * p < 32 ? N - 32 * p : 32;
            const float *wide = mc >= WIDEN_MIN ? widen_panel(panel, wkind, K) : NULL;
            if (mc >= WIDEN_MIN && !wide) { failed = 1; continue; }
            const int wv = wide ? WV_F32_SPLIT : wkind == WK_I8 ? WV_I8 : WV_BF16;
            for (int r = 0; r < mc; r += MR) {
                const int mr = mc - r < MR ? mc - r : MR;
                const int64_t row = m0 + r;
                void *yrow = y_bf16 ? (void *)((uint16_t *)y + row * ldy) : (void *)((float *)y + row * ldy);
                /* the first block of rows prefetches the next panel (the one this thread most likely takes next) */
                const char *pf = r == 0 && p + 1 < panels ? panel + (int64_t)K * 32 * wb : NULL;
                rows_times_panel(mr, wv, xf + row * (int64_t)K, wide ? (const void *)wide : (const void *)panel, K,
                                 scale, bias, yrow, y_bf16, ldy, 32 * (int64_t)p, ncols, pf, wb);
            }
        }
    }
    return failed ? -1 : 0;
}
#endif

/* The same product in portable C over the same panels (the avx2 and generic levels): rows in
 * fours, 32 columns of accumulators each, which gcc vectorises for the level's registers. */
static int linear_portable(const void *x, int x_bf16, int64_t ldx, const void *wp, int wkind, const float *scale,
                           const float *bias, void *y, int y_bf16, int64_t ldy, int M, int N, int K) {
    const int panels = (N + 31) / 32, blocks = (M + 3) / 4, wb = weight_bytes(wkind);
    float *xs = malloc(sizeof(float) * 4 * (size_t)K * (size_t)blocks);
    if (!xs) return -1;
    for (int r = 0; r < M; r++) /* x as fp32, row r at xs[r * K] */
        for (int k = 0; k < K; k++)
            xs[(int64_t)r * K + k] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * ldx + k])
                                            : ((const float *)x)[r * ldx + k];
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int p = 0; p < panels; p++) {
        for (int b = 0; b < blocks; b++) {
            const char *panel = (const char *)wp + (int64_t)p * K * 32 * wb;
            const int rows = M - 4 * b < 4 ? M - 4 * b : 4, ncols = N - 32 * p < 32 ? N - 32 * p : 32;
            float acc[4][32] = {{0}};
            for (int k = 0; k < K; k++) {
                float w[32];
                if (wkind == WK_I8)
                    for (int j = 0; j < 32; j++) w[j] = (float)((const int8_t *)panel)[k * 32 + j];
                else
                    for (int j = 0; j < 32; j++) w[j] = bf16_to_f32(((const uint16_t *)panel)[k * 32 + j]);
                for (int r = 0; r < rows; r++) {
                    const float a = xs[(int64_t)(4 * b + r) * K + k];
                    for (int j = 0; j < 32; j++) acc[r][j] += a * w[j];
                }
            }
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < ncols; j++) {
                    const int64_t c = 32 * (int64_t)p + j;
                    const float v = acc[r][j] * (scale ? scale[c] : 1.f) + (bias ? bias[c] : 0.f);
                    if (y_bf16) ((uint16_t *)y)[(4 * b + r) * ldy + c] = f32_to_bf16(v);
                    else ((float *)y)[(4 * b + r) * ldy + c] = v;
                }
        }
    }
    free(xs);
    return 0;
}

/* y = (x @ W^T) * scale + bias over packed panels of bf16 (WK_BF16) or int8 (WK_I8) weights;
 * scale (per column) may be NULL for bf16, bias may be NULL. Returns 0, or -1 if memory ran out. */
int pdserve_linear_packed(const void *x, int x_bf16, int64_t ldx, const void *wp, int wkind, const float *scale,
                          const float *bias, void *y, int y_bf16, int64_t ldy, int M, int N, int K) {
    if (M >= AMX_MIN_ROWS && x_bf16) {
        const int rc = pdserve_amx_linear(x, ldx, wp, wkind, scale, bias, y, y_bf16, ldy, M, N, K);
        if (rc != -2) return rc; /* -2: not compiled in (no AMX at this level) */
    }
#if defined(__AVX512F__)
    return linear_avx512(x, x_bf16, ldx, wp, wkind, scale, bias, y, y_bf16, ldy, M, N, K);
#else
    return linear_portable(x, x_bf16, ldx, wp, wkind, scale, bias, y, y_bf16, ldy, M, N, K);
#endif
}

/* The portable loop at any level (tests compare it with the vector kernels). */
int pdserve_linear_packed_portable(const void *x, int x_bf16, int64_t ldx, const void *wp, int wkind,
                                   const float *scale, const float *bias, void *y, int y_bf16, int64_t ldy,
                                   int M, int N, int K) {
    return linear_portable(x, x_bf16, ldx, wp, wkind, scale, bias, y, y_bf16, ldy, M, N, K);
}
