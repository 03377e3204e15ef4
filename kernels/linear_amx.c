/*
 * y = (x @ W^T) * scale + bias on the AMX tile unit (the amx level), for calls with many rows
 * (prefill chunks, large decode batches): one TDPBF16PS multiplies a 16 x 32 bf16 tile of x by
 * a 32 x 16 tile of W, 8,192 multiply-adds, where an AVX-512 FMA does 16.
 *
 * The weights stay in the packed panels of linear_cpu.c (bf16, or int8 with per-column scales:
 * int8 values are exact in bf16). Each panel of 32 columns is rearranged once per row chunk
 * into the pair layout the tile unit reads (VNNI-2: two consecutive k of one column side by
 * side), 16 columns per tile:
 *
 *     bp[kp][j][e] = W[32p + j][2kp + e]      kp < Kp / 2, j < 32, e < 2   (bf16)
 *     B tile (cols 16h .. 16h + 15, k 32i .. 32i + 31) = rows kp = 16i .. 16i + 15 of
 *                                              bp, 64 bytes from byte 64h, row stride 128
 *
 * x is copied into a zero-padded bf16 buffer (rows to a multiple of 32, K to a multiple of 32)
 * so every tile is full. Per 32 rows x 32 columns: 4 accumulator tiles (C), 2 of x (A), 2 of W
 * (B), the 8 tiles the unit has. Accumulation is fp32, like the FMA kernel's, in another order.
 *
 * Tile state needs the kernel's permission, asked by kernels/cpu_isa.py before this runs. Each
 * OpenMP thread loads the tile configuration at the start of its share (the tiles are per
 * thread, and other libraries in the process, oneDNN under torch, configure them their own way)
 * and releases them at the end.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"
#include "linear_pack.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#define AMX_MC 256 /* rows per chunk: the chunk's x (256 x K bf16) stays in L2 across panels */

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { /* every tile 16 rows of 64 bytes */
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

static __thread uint16_t *abuf; /* the caller's padded x */
static __thread size_t abuf_len;
static __thread uint16_t *bbuf; /* each OpenMP thread's rearranged panel */
static __thread size_t bbuf_len;

static void *grow(void *buf, size_t *len, size_t need) {
    if (*len >= need) return buf;
    free(buf);
    buf = aligned_alloc(64, (need + 63) / 64 * 64);
    *len = buf ? need : 0;
    return buf;
}

/* One row of 32 weights (k) of a panel as bf16 in column order. */
static inline __m512i panel_row(const void *panel, int wkind, int k, int K) {
    if (k >= K) return _mm512_setzero_si512();
    if (wkind == WK_BF16) return _mm512_loadu_si512((const uint16_t *)panel + (int64_t)k * 32);
    const int8_t *p = (const int8_t *)panel + (int64_t)k * 32;
    const __m256i lo = narrow16_bf16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
    const __m256i hi = narrow16_bf16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* panel -> bp (see the top): two k rows interleaved per column, 16 columns per 64 bytes */
static void pair_panel(const void *panel, int wkind, int K, int Kp, uint16_t *bp) {
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int j = 0; j < 16; j++) {
            lo[2 * j] = (uint16_t)j, lo[2 * j + 1] = (uint16_t)(32 + j);
            hi[2 * j] = (uint16_t)(16 + j), hi[2 * j + 1] = (uint16_t)(48 + j);
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    for (int kp = 0; kp < Kp / 2; kp++) {
        const __m512i r0 = panel_row(panel, wkind, 2 * kp, K), r1 = panel_row(panel, wkind, 2 * kp + 1, K);
        _mm512_store_si512(bp + (int64_t)kp * 64, _mm512_permutex2var_epi16(r0, lo_idx, r1));
        _mm512_store_si512(bp + (int64_t)kp * 64 + 32, _mm512_permutex2var_epi16(r0, hi_idx, r1));
    }
}

/* 32 x 32 fp32 results (row stride 32) -> y rows [row, row + rows), columns [col, col + ncols) */
static void store_block(const float *c, int rows, int ncols, int64_t col, const float *scale, const float *bias,
                        void *y, int y_bf16, int64_t ldy, int64_t row) {
    const __mmask16 m0 = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
    const __mmask16 m1 = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1u);
    const __m512 s0 = scale ? _mm512_maskz_loadu_ps(m0, scale + col) : _mm512_set1_ps(1.f);
    const __m512 s1 = scale ? _mm512_maskz_loadu_ps(m1, scale + col + 16) : _mm512_set1_ps(1.f);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + col) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + col + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v0 = _mm512_fmadd_ps(_mm512_load_ps(c + 32 * r), s0, b0);
        const __m512 v1 = _mm512_fmadd_ps(_mm512_load_ps(c + 32 * r + 16), s1, b1);
        const int64_t off = (row + r) * ldy + col;
        if (y_bf16) {
            _mm256_mask_storeu_epi16((uint16_t *)y + off, m0, narrow16_bf16(v0));
            _mm256_mask_storeu_epi16((uint16_t *)y + off + 16, m1, narrow16_bf16(v1));
        } else {
            _mm512_mask_storeu_ps((float *)y + off, m0, v0);
            _mm512_mask_storeu_ps((float *)y + off + 16, m1, v1);
        }
    }
}

int pdserve_amx_linear(const void *x, int64_t ldx, const void *wp, int wkind, const float *scale, const float *bias,
                       void *y, int y_bf16, int64_t ldy, int M, int N, int K) {
    const int Kp = (K + 31) / 32 * 32, Mp = (M + 31) / 32 * 32, panels = (N + 31) / 32;
    const int wb = wkind == WK_I8 ? 1 : 2;
    abuf = grow(abuf, &abuf_len, (size_t)Mp * Kp * sizeof(uint16_t));
    if (!abuf) return -1;
    uint16_t *const a = abuf;
#pragma omp parallel for schedule(static) if (M >= 128)
    for (int r = 0; r < Mp; r++) {
        uint16_t *dst = a + (int64_t)r * Kp;
        if (r < M) {
            memcpy(dst, (const uint16_t *)x + (int64_t)r * ldx, (size_t)K * sizeof(uint16_t));
            memset(dst + K, 0, (size_t)(Kp - K) * sizeof(uint16_t));
        } else {
            memset(dst, 0, (size_t)Kp * sizeof(uint16_t));
        }
    }
    int failed = 0;
    for (int m0 = 0; m0 < Mp; m0 += AMX_MC) {
        const int mc = Mp - m0 < AMX_MC ? Mp - m0 : AMX_MC;
#pragma omp parallel
        {
            bbuf = grow(bbuf, &bbuf_len, (size_t)Kp * 32 * sizeof(uint16_t));
            float c[32 * 32] __attribute__((aligned(64)));
            load_tile_config();
#pragma omp for schedule(dynamic, 1)
            for (int p = 0; p < panels; p++) {
                if (!bbuf) { failed = 1; continue; }
                pair_panel((const char *)wp + (int64_t)p * K * 32 * wb, wkind, K, Kp, bbuf);
                const int ncols = N - 32 * p < 32 ? N - 32 * p : 32;
                for (int r = m0; r < m0 + mc; r += 32) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    const uint16_t *a0 = a + (int64_t)r * Kp, *a1 = a0 + 16 * (int64_t)Kp;
                    for (int k = 0; k < Kp; k += 32) {
                        _tile_loadd(4, a0 + k, Kp * 2);
                        _tile_loadd(5, a1 + k, Kp * 2);
                        _tile_loadd(6, bbuf + (int64_t)k * 32, 128);
                        _tile_loadd(7, bbuf + (int64_t)k * 32 + 32, 128);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c, 128);
                    _tile_stored(1, c + 16, 128);
                    _tile_stored(2, c + 16 * 32, 128);
                    _tile_stored(3, c + 16 * 32 + 16, 128);
                    const int rows = M - r < 32 ? M - r : 32;
                    if (rows > 0) store_block(c, rows, ncols, 32 * (int64_t)p, scale, bias, y, y_bf16, ldy, r);
                }
            }
            _tile_release();
        }
    }
    return failed ? -1 : 0;
}

#else
int pdserve_amx_linear(const void *x, int64_t ldx, const void *wp, int wkind, const float *scale, const float *bias,
                       void *y, int y_bf16, int64_t ldy, int M, int N, int K) {
    (void)x; (void)ldx; (void)wp; (void)wkind; (void)scale; (void)bias; (void)y; (void)y_bf16; (void)ldy;
    (void)M; (void)N; (void)K;
    return -2;
}
#endif
