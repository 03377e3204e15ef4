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
 * Loop nest (x is widened to fp32 and packed once per call, into a per-thread buffer):
 *
 *     for each chunk of MC rows of x          (x chunk stays in L2)
 *       parallel for each panel p             (a thread's panels stay in its L2)
 *         for each MR rows of the chunk       (micro-kernel: MR x 32 accumulators
 *           acc[MR][2] += x[r][k] * wp[p][k]   in registers over the whole K)
 *
 * Needs AVX-512F; pdserve_linear_available() says whether it was compiled in.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"

#define MR 12   /* rows per micro-kernel: 24 accumulators + 2 weight vectors + 1 broadcast <= 32 zmm */
#define MC 192  /* rows per chunk */
/* weights are prefetched this many bf16 (8 KiB) ahead of the loads: the hardware prefetcher
 * alone left one core at ~10 GB/s on a stream it can read at ~20 */
#define PREFETCH 4096

int pdserve_linear_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)

static __thread float *xbuf;
static __thread size_t xbuf_len;

/* x as fp32 in blocks of MR rows, each stored k-major: block b holds rows
 * [MR*b, MR*b + mr) as xp[b*MR*K + k*mr + r], so a micro-kernel's broadcasts for one
 * k are adjacent (one stream instead of MR) */
static float *pack_rows(const void *x, int x_bf16, int64_t ldx, int M, int K) {
    const size_t need = (size_t)M * (size_t)K;
    if (xbuf_len < need) {
        free(xbuf);
        xbuf = aligned_alloc(64, ((need * sizeof(float) + 63) / 64) * 64);
        xbuf_len = xbuf ? need : 0;
        if (!xbuf) return NULL;
    }
    for (int m = 0; m < M; m++) {
        const int b = m / MR, r = m % MR, mr = M - b * MR < MR ? M - b * MR : MR;
        float *dst = xbuf + (size_t)b * MR * K + r;
        /* 16 consecutive k of this row land mr floats apart: one scatter */
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(mr));
        int k = 0;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + m * ldx;
            for (; k + 16 <= K; k += 16) _mm512_i32scatter_ps(dst + (size_t)k * mr, at, load16_bf16(src + k), 4);
            for (; k < K; k++) {
                const uint32_t u = (uint32_t)src[k] << 16;
                memcpy(dst + (size_t)k * mr, &u, 4);
            }
        } else {
            const float *src = (const float *)x + m * ldx;
            for (; k + 16 <= K; k += 16) _mm512_i32scatter_ps(dst + (size_t)k * mr, at, _mm512_loadu_ps(src + k), 4);
            for (; k < K; k++) dst[(size_t)k * mr] = src[k];
        }
    }
    return xbuf;
}

static inline void store16(void *y, int y_bf16, int64_t off, __m512 v, __mmask16 mask) {
    if (y_bf16)
        _mm256_mask_storeu_epi16((uint16_t *)y + off, mask, narrow16_bf16(v));
    else
        _mm512_mask_storeu_ps((float *)y + off, mask, v);
}

/* one packed block of mr rows of x (see pack_rows) times one panel -> 32 columns of y. The panel is
 * either the packed bf16 weights (widened per k) or an fp32 copy of them (wide == 1). */
static inline __attribute__((always_inline)) void micro(
        const int mr, const int wide, const float *x, const void *panel, int K, const float *bias,
        void *y, int y_bf16, int64_t ldy, int64_t col, int ncols, const uint16_t *pf) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int k = 0;
    if (mr <= 4 && !wide) {
        /* few rows (decode at small batch): streaming the weights is the whole cost, and with
         * 2 * mr accumulators the FMA latency chain paces the loads; a second set of
         * accumulators for odd k lets two k run at once */
        __m512 odd[4][2];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) odd[r][0] = odd[r][1] = _mm512_setzero_ps();
        for (; k + 2 <= K; k += 2) {
            const uint16_t *w = (const uint16_t *)panel + (int64_t)k * 32;
            _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH + 32), _MM_HINT_T0);
            const __m512 w0 = load16_bf16(w), w1 = load16_bf16(w + 16);
            const __m512 w2 = load16_bf16(w + 32), w3 = load16_bf16(w + 48);
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
        __m512 w0, w1;
        if (wide) {
            /* the next panel's bf16 weights, one cache line per k, reach L2 while this one computes */
            if (pf) _mm_prefetch((const char *)(pf + (int64_t)k * 32), _MM_HINT_T1);
            w0 = _mm512_load_ps((const float *)panel + (int64_t)k * 32);
            w1 = _mm512_load_ps((const float *)panel + (int64_t)k * 32 + 16);
        } else {
            _mm_prefetch((const char *)((const uint16_t *)panel + (int64_t)k * 32 + PREFETCH), _MM_HINT_T0);
            w0 = load16_bf16((const uint16_t *)panel + (int64_t)k * 32);
            w1 = load16_bf16((const uint16_t *)panel + (int64_t)k * 32 + 16);
        }
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[(int64_t)k * mr + r]);
            acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    const __mmask16 m0 = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
    const __mmask16 m1 = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1u);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_maskz_loadu_ps(m0, bias + col);
        b1 = _mm512_maskz_loadu_ps(m1, bias + col + 16);
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        store16(y, y_bf16, r * ldy + col, _mm512_add_ps(acc[r][0], b0), m0);
        store16(y, y_bf16, r * ldy + col + 16, _mm512_add_ps(acc[r][1], b1), m1);
    }
}

static void rows_times_panel(int mr, int wide, const float *x, const void *panel, int K, const float *bias,
                             void *y, int y_bf16, int64_t ldy, int64_t col, int ncols, const uint16_t *pf) {
    /* each case is the micro-kernel specialised for that many rows and weight type */
#define CASE(R) case R: if (wide) { micro(R, 1, x, panel, K, bias, y, y_bf16, ldy, col, ncols, pf); } \
                        else { micro(R, 0, x, panel, K, bias, y, y_bf16, ldy, col, ncols, NULL); } break;
    switch (mr) {
        CASE(12) CASE(11) CASE(10) CASE(9) CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1)
        default: break;
    }
#undef CASE
}

/* fp32 copy of one panel, reused by every MR-row block of a chunk: widening once per
 * panel instead of once per block leaves the FMA ports to the FMAs */
static __thread float *wbuf;
static __thread size_t wbuf_len;

static const float *widen_panel(const uint16_t *panel, int K) {
    const size_t need = (size_t)K * 32;
    if (wbuf_len < need) {
        free(wbuf);
        wbuf = aligned_alloc(64, need * sizeof(float));
        wbuf_len = wbuf ? need : 0;
        if (!wbuf) return NULL;
    }
    for (size_t i = 0; i < need; i += 16) _mm512_store_ps(wbuf + i, load16_bf16(panel + i));
    return wbuf;
}

#endif

/* Returns 0 on success, -1 if the kernel is not compiled in or memory ran out. */
int pdserve_linear_bf16w(const void *x, int x_bf16, int64_t ldx, const uint16_t *wp, const float *bias,
                         void *y, int y_bf16, int64_t ldy, int M, int N, int K) {
#if defined(__AVX512F__)
    const float *xf = pack_rows(x, x_bf16, ldx, M, K);
    if (!xf) return -1;
    const int panels = (N + 31) / 32;
    /* panels are handed out in small chunks, not in one static share per thread: cores do not
     * always run at one speed (a shared VM's cores differ by up to 30% for seconds at a time;
     * another process may take part of one), and a static split waits for the slowest. About
     * 8 chunks per thread keep the dispatch cost low; fewer than MR rows make a panel too
     * little work for that, so they get 2. With a 30% load on one of two cores: 18-20% faster
     * at 34-512 rows than a static split, the same at 1 row. */
    const int per_chunk = panels / ((M < MR ? 2 : 8) * omp_get_max_threads());
    const int chunk = per_chunk > 1 ? per_chunk : 1;
    for (int m0 = 0; m0 < M; m0 += MC) {
        const int mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel for schedule(dynamic, chunk)
        for (int p = 0; p < panels; p++) {
            const uint16_t *panel = wp + (int64_t)p * K * 32;
            const int ncols = N - 32 * p < 32 ? N - 32 * p : 32;
            /* a widened copy pays off once the panel feeds several blocks of rows */
            const float *wide = mc >= 2 * MR ? widen_panel(panel, K) : NULL;
            for (int r = 0; r < mc; r += MR) {
                const int mr = mc - r < MR ? mc - r : MR;
                const int64_t row = m0 + r;
                void *yrow = y_bf16 ? (void *)((uint16_t *)y + row * ldy) : (void *)((float *)y + row * ldy);
                /* the first block of rows prefetches the next panel (the one this thread most likely takes next) */
                const uint16_t *pf = r == 0 && p + 1 < panels ? panel + (int64_t)K * 32 : NULL;
                rows_times_panel(mr, wide != NULL, xf + row * K, wide ? (const void *)wide : (const void *)panel,
                                 K, bias, yrow, y_bf16, ldy, 32 * (int64_t)p, ncols, pf);
            }
        }
    }
    return 0;
#else
    (void)x; (void)x_bf16; (void)ldx; (void)wp; (void)bias; (void)y; (void)y_bf16; (void)ldy;
    (void)M; (void)N; (void)K;
    return -1;
#endif
}
