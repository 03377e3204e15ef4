/*
 * Batched LoRA on CPU (kernels/lora.py has the definition and the torch reference):
 * each row t gathers its adapter slot's stacked A and B^T and adds
 *
 *   y[t, seg cols] += (A[slot, seg*R : seg*R + r] . x[t]) @ Bt[slot, 0:r, seg cols]
 *
 * over the output segments (q/k/v of a fused qkv, gate/up of gate_up), in fp32, y rounded
 * to bf16 once. Only the slot's own rank r is read (the stacks are padded to R), so a rank-8
 * adapter costs a quarter of a rank-32 one. Rows go to OpenMP threads.
 *
 * When every row has its own adapter (the case that matters) each row reads its A and B once
 * per step and does two flops per weight: the kernel is bound by memory, not arithmetic
 * (benchmarks/probes/lora_rank.py), so both halves are written to stream their weights in
 * order at the machine's read bandwidth:
 * - shrink: four A rows at a time against x, 32 bf16 per 64-byte load widened to fp32 even
 *   and odd lanes (a shift and an and; the sum does not care about the order), eight
 *   independent accumulator chains so the FMA latency is hidden;
 * - expand: the rows of B^T in order (j outer), each read left to right across every segment
 *   into an fp32 accumulator row in L1, so B^T streams as it is laid out. The first version
 *   walked 16 columns down all r rows (r strided streams, one FMA chain).
 *   Per column the sum is y + u[0] B[0] + u[1] B[1] + ... in that order, as before.
 * Both prefetch what they read next (the next four A rows, B^T two rows down): in a step whose
 * adapters do not fit the cache (rank 64, eight adapters: 312 MB) the LoRA calls went from 3.8
 * to 3.1 ms of CPU per token on this machine's DRAM, the streams ramping up sooner.
 * Consecutive rows of one adapter (a prefill's) share each pass, up to LORA_GROUP at a time: one
 * read of an A row serves four dot products and one of a B^T row four accumulator rows (a
 * 512-row prefill of eight rank-64 adapters: qkv 98 -> 82 ms, gate_up 172 -> 126 ms of CPU over
 * 30 layers).
 *
 * Quantized stacks (--lora-dtype, kernels/lora_quant.py has the layouts and the dequantizing
 * reference): bound by bytes, the kernel reads fewer of them and widens in registers.
 * - int8: A and B^T int8 with one fp32 scale per rank row and segment (a_scale, bt_scale
 *   [S, nseg*R]); both fold into u; weights widen int8 -> int32 -> fp32 in memory order (x
 *   and the expand's accumulators in memory order too), no even/odd shifts;
 * - int4: two elements a byte (element 2i in the low nibble, 2i+1 in the high, stored + 8),
 *   which is the even/odd split of the bf16 loops; one bf16 scale per 32 elements of a row
 *   (a_scale [S, nseg*R, K/32], bt_scale [S, R, N/32]): the shrink scales each group's partial
 *   dot, the expand the group's coefficient. K and every segment bound are multiples of 32
 *   (the store checks). Nibbles are split and offset in 128-bit lanes, which have a third port.
 * The quantized shrinks widen x once per row (widen_x), not once per A row: with a quarter or
 * half the bytes, the vector ports bind sooner than memory. Each loop is compiled once per
 * format (lora_chunk inlined with a constant fmt).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define LORA_MAX_U 1024 /* nseg * R per row on the stack: 4 segments of rank 256 */
#define LORA_COLS 4096  /* expand: columns per pass, a 16 KiB fp32 accumulator row (L1) */
#define LORA_GROUP 4    /* rows of one adapter that share a pass over its A and B */

enum { LORA_BF16 = 0, LORA_INT8 = 1, LORA_INT4 = 2 };
#define INLINE static inline __attribute__((always_inline))
/* row j's int4 scales (n elements a row), NULL for the other formats (never offset a NULL) */
#define Q4ROW(fmt, S, j, n) ((fmt) == LORA_INT4 ? (S) + (int64_t)(j) * ((n) / 32) : NULL)

int pdserve_lora_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
static inline __mmask32 tail_mask32(int left) { return left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1u); }

/* bytes of n elements of a row in format fmt */
INLINE int64_t wbytes(int fmt, int64_t n) { return fmt == LORA_BF16 ? 2 * n : fmt == LORA_INT8 ? n : n / 2; }

/* the mask's lanes of 32 bf16 (others 0) as fp32 even and odd elements, as widen32_bf16 */
static inline void widen32m_bf16(const uint16_t *p, __mmask32 m, __m512 *even, __m512 *odd) {
    const __m512i v = _mm512_maskz_loadu_epi16(m, p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* d[i] = a_i . x_i over K for four pairs of bf16 rows (the same row may appear in several),
 * prefetching each a_i pf elements ahead */
INLINE void dot4(const uint8_t *const a[4], const uint16_t *const x[4], int K,
                 int64_t pf, float *d) {
    __m512 e[4], o[4]; /* eight independent FMA chains (the loops over i unroll into registers) */
    for (int i = 0; i < 4; i++) e[i] = o[i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        const __mmask32 m = tail_mask32(K - k);
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(a[i] + 2 * (k + pf)), _MM_HINT_T0);
        for (int i = 0; i < 4; i++) {
            __m512 xe, xo, ae, ao;
            widen32m_bf16(x[i] + k, m, &xe, &xo);
            widen32m_bf16((const uint16_t *)a[i] + k, m, &ae, &ao);
            e[i] = _mm512_fmadd_ps(ae, xe, e[i]), o[i] = _mm512_fmadd_ps(ao, xo, o[i]);
        }
    }
    for (int i = 0; i < 4; i++) d[i] = _mm512_reduce_add_ps(_mm512_add_ps(e[i], o[i]));
}

static inline __mmask16 mask16(int left) { return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u); }

/* x [K] bf16 -> xf fp32 for the quantized shrinks, zero up to a multiple of 32: in memory order
 * (int8) or even/odd per 32 as the int4 bytes hold them. Widened once per row instead of once
 * per A row: the shrink's vector ports are what bound it once the weights are a quarter the
 * bytes */
INLINE void widen_x(int fmt, const uint16_t *x, int K, float *xf) {
    for (int k = 0; k < K; k += 32) {
        __m512 e, o;
        if (fmt == LORA_INT4) {
            widen32m_bf16(x + k, tail_mask32(K - k), &e, &o);
        } else {
            e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask16(K - k), x + k)), 16));
            o = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask16(K - k - 16), x + k + 16)), 16));
        }
        _mm512_store_ps(xf + k, e), _mm512_store_ps(xf + k + 16, o);
    }
}

/* dot4 over quantized rows against widened xf_i: int8 as 2 x 16 int8 -> int32 -> fp32 in memory
 * order (no even/odd shifts); int4 nibbles split and offset in 128-bit lanes, each 32-element
 * group's partial dot scaled once */
INLINE void dot4q(int fmt, const uint8_t *const a[4], const uint16_t *const s[4], const float *const xf[4], int K,
                  int64_t pf, float *d) {
    __m512 e[4], o[4];
    for (int i = 0; i < 4; i++) e[i] = o[i] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    for (int k = 0; k < K; k += 32) {
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(a[i] + wbytes(fmt, k + pf)), _MM_HINT_T0);
        if (fmt == LORA_INT8) {
            const __mmask16 m0 = mask16(K - k), m1 = mask16(K - k - 16);
            for (int i = 0; i < 4; i++) {
                const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, a[i] + k)));
                const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, a[i] + k + 16)));
                e[i] = _mm512_fmadd_ps(w0, _mm512_load_ps(xf[i] + k), e[i]);
                o[i] = _mm512_fmadd_ps(w1, _mm512_load_ps(xf[i] + k + 16), o[i]);
            }
        } else {
            for (int i = 0; i < 4; i++) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(a[i] + k / 2));
                const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, low), eight);
                const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight);
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), _mm512_load_ps(xf[i] + k));
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), _mm512_load_ps(xf[i] + k + 16), t);
                if (k & 32)
                    o[i] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(s[i][k / 32])), t, o[i]);
                else
                    e[i] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(s[i][k / 32])), t, e[i]);
            }
        }
    }
    for (int i = 0; i < 4; i++) d[i] = _mm512_reduce_add_ps(_mm512_add_ps(e[i], o[i]));
}

/* u[j] = A[j] . x for the r rows of A [r, K] (As: their int4 scales, K/32 a row): four A rows
 * per pass over x */
INLINE void shrink(int fmt, const uint16_t *x, const float *xf, const uint8_t *A, const uint16_t *As, int r, int K,
                   float *u) {
    const int64_t row = wbytes(fmt, K);
    const uint16_t *const xs[4] = {x, x, x, x};
    const float *const xfs[4] = {xf, xf, xf, xf};
    int j = 0;
    for (; j + 4 <= r; j += 4) {
        const uint8_t *const a[4] = {A + j * row, A + (j + 1) * row, A + (j + 2) * row, A + (j + 3) * row};
        const uint16_t *const s[4] = {Q4ROW(fmt, As, j, K), Q4ROW(fmt, As, j + 1, K), Q4ROW(fmt, As, j + 2, K),
                                      Q4ROW(fmt, As, j + 3, K)};
        if (fmt == LORA_BF16)
            dot4(a, xs, K, 4 * K, u + j);
        else
            dot4q(fmt, a, s, xfs, K, 4 * K, u + j);
    }
    for (; j < r; j++) {
        const uint8_t *const a[4] = {A + j * row, A + j * row, A + j * row, A + j * row};
        const uint16_t *sj = Q4ROW(fmt, As, j, K);
        const uint16_t *const s[4] = {sj, sj, sj, sj};
        float d[4];
        if (fmt == LORA_BF16)
            dot4(a, xs, K, K, d);
        else
            dot4q(fmt, a, s, xfs, K, K, d);
        u[j] = d[0];
    }
}

/* u_i[j] = A[j] . x_i for m (2-4) rows x_i (stride ldx) sharing A: each A row read once for all
 * of them (a prefill's rows of one adapter); u_i at u + i * LORA_MAX_U */
INLINE void shrink_group(int fmt, const uint16_t *x, int64_t ldx, const float *xf, int64_t ldxf, int m, const uint8_t *A,
                         const uint16_t *As, int r, int K, float *u) {
    const uint16_t *const xs[4] = {x, x + ldx, x + (m > 2 ? 2 : 1) * ldx, x + (m > 3 ? 3 : 1) * ldx};
    const float *const xfs[4] = {xf, xf + ldxf, xf + (m > 2 ? 2 : 1) * ldxf, xf + (m > 3 ? 3 : 1) * ldxf};
    for (int j = 0; j < r; j++) {
        const uint8_t *aj = A + j * wbytes(fmt, K);
        const uint16_t *sj = Q4ROW(fmt, As, j, K);
        const uint8_t *const a[4] = {aj, aj, aj, aj};
        const uint16_t *const s[4] = {sj, sj, sj, sj};
        float d[4];
        if (fmt == LORA_BF16)
            dot4(a, xs, K, 2 * K, d);
        else
            dot4q(fmt, a, s, xfs, K, 2 * K, d);
        for (int i = 0; i < m; i++) u[i * LORA_MAX_U + j] = d[i];
    }
}

/* acc_i[0:w] (even/odd per 32 columns) += u[i] * B[col:col+w] for the m rows sharing B's row
 * (acc_i at acc + i * LORA_COLS; B: the row's first byte, Bs its int4 scales, ldb the row's bytes) */
INLINE void expand_rows(int fmt, float *acc, int m, const uint8_t *B, const uint16_t *Bs, int64_t ldb, int col, int w,
                        const float *u) {
    __m512 uv[LORA_GROUP];
    for (int i = 0; i < m; i++) uv[i] = _mm512_set1_ps(u[i]);
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    for (int n = 0; n < w; n += 32) {
        __m512 be, bo;
        _mm_prefetch((const char *)(B + wbytes(fmt, col + n) + 2 * ldb), _MM_HINT_T0);
        if (fmt == LORA_BF16) {
            widen32m_bf16((const uint16_t *)B + col + n, tail_mask32(w - n), &be, &bo);
        } else if (fmt == LORA_INT8) { /* memory order (acc too, see acc_load) */
            be = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask16(w - n), B + col + n)));
            bo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask16(w - n - 16), B + col + n + 16)));
        } else { /* int4: the group's scale goes into the coefficients below, not onto the weights */
            const __m128i b = _mm_loadu_si128((const __m128i *)(B + (col + n) / 2));
            be = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(b, low), eight)));
            bo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight)));
        }
        for (int i = 0; i < m; i++) {
            const __m512 c = fmt == LORA_INT4 ? _mm512_mul_ps(uv[i], _mm512_set1_ps(bf16_to_f32(Bs[(col + n) / 32])))
                                              : uv[i];
            float *ai = acc + i * LORA_COLS + n;
            _mm512_store_ps(ai, _mm512_fmadd_ps(c, be, _mm512_load_ps(ai)));
            _mm512_store_ps(ai + 16, _mm512_fmadd_ps(c, bo, _mm512_load_ps(ai + 16)));
        }
    }
}

/* y's 32 columns (the mask's) into an accumulator block and back: even/odd (bf16, int4: their
 * weights widen that way) or memory order (int8) */
INLINE void acc_load(int fmt, const uint16_t *y, __mmask32 m, float *a) {
    __m512 e, o;
    if (fmt == LORA_INT8) {
        e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)m, y)), 16));
        o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)(m >> 16), y + 16)), 16));
    } else {
        widen32m_bf16(y, m, &e, &o);
    }
    _mm512_store_ps(a, e), _mm512_store_ps(a + 16, o);
}

INLINE void acc_store(int fmt, uint16_t *y, __mmask32 m, const float *a) {
    if (fmt == LORA_INT8) {
        _mm256_mask_storeu_epi16(y, (__mmask16)m, narrow16_bf16(_mm512_load_ps(a)));
        _mm256_mask_storeu_epi16(y + 16, (__mmask16)(m >> 16), narrow16_bf16(_mm512_load_ps(a + 16)));
    } else {
        _mm512_mask_storeu_epi16(y, m, narrow32_bf16(_mm512_load_ps(a), _mm512_load_ps(a + 16)));
    }
}

/* A run of one segment's columns in an expand pass: columns col..col+w of y and B, at acc + off
 * (off a multiple of 32, so the even/odd split lines up with the segment's columns) */
typedef struct {
    int col, w, off, seg;
} lora_piece;

#define LORA_MAX_PIECES 16

/* y_i[all segments] += u_i,s @ B[0:r, segment s's columns] for the m rows i sharing B (y_i at
 * y + i * ldy, u_i at u + i * LORA_MAX_U; Bsc: B's int4 scales), in passes of at most LORA_COLS
 * columns: each pass walks B's rows in order, each row left to right across every segment in the
 * pass, so B streams from memory in the order it is laid out (a qkv row is q, k, v) */
INLINE void expand_group(int fmt, uint16_t *y, int64_t ldy, int m, const uint8_t *Bs, const uint16_t *Bsc, int64_t N,
                         int r, int R, int nseg, const int32_t *bounds, const float *u, float *acc) {
    const int cols = LORA_COLS / m / 32 * 32; /* the m accumulator rows stay in L1 together */
    const int64_t ldb = wbytes(fmt, N);
    int s = 0, c = bounds[0];
    while (s < nseg && c == bounds[s + 1]) c = bounds[++s];  /* empty leading segments */
    while (s < nseg) {
        lora_piece p[LORA_MAX_PIECES];
        int np = 0, used = 0;
        while (s < nseg && np < LORA_MAX_PIECES && used < cols) {
            const int w = bounds[s + 1] - c < cols - used ? bounds[s + 1] - c : cols - used;
            p[np++] = (lora_piece){c, w, used, s};
            used += (w + 31) & ~31;
            c += w;
            while (s < nseg && c == bounds[s + 1]) c = ++s < nseg ? bounds[s] : c;
        }
        for (int i = 0; i < m; i++)
            for (int q = 0; q < np; q++)
                for (int n = 0; n < p[q].w; n += 32)
                    acc_load(fmt, y + i * ldy + p[q].col + n, tail_mask32(p[q].w - n), acc + i * LORA_COLS + p[q].off + n);
        for (int j = 0; j < r; j++)
            for (int q = 0; q < np; q++) {
                float uj[LORA_GROUP];
                for (int i = 0; i < m; i++) uj[i] = u[i * LORA_MAX_U + p[q].seg * R + j];
                expand_rows(fmt, acc + p[q].off, m, Bs + j * ldb, Q4ROW(fmt, Bsc, j, N), ldb, p[q].col, p[q].w, uj);
            }
        for (int i = 0; i < m; i++)
            for (int q = 0; q < np; q++)
                for (int n = 0; n < p[q].w; n += 32)
                    acc_store(fmt, y + i * ldy + p[q].col + n, tail_mask32(p[q].w - n), acc + i * LORA_COLS + p[q].off + n);
    }
}

/* The rows of chunk c (G rows from c * G): runs of one adapter share a pass over its A and B */
INLINE void lora_chunk(int fmt, int c, int G, const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int T, int K,
                       int N, const uint8_t *A, const uint8_t *Bt, int R, int nseg, const int32_t *bounds,
                       const int32_t *idx, const int32_t *ranks, const void *a_scale, const void *bt_scale,
                       float *xf) {
    float u[LORA_GROUP * LORA_MAX_U];
    const int64_t ldxf = (K + 31) & ~31;
    float acc[LORA_GROUP * LORA_COLS] __attribute__((aligned(64)));
    const int end = (c + 1) * G < T ? (c + 1) * G : T;
    for (int t = c * G, m; t < end; t += m) {
        const int slot = idx[t];
        for (m = 1; t + m < end && idx[t + m] == slot;) m++;
        if (slot < 0 || ranks[slot] <= 0) continue;
        const int r = ranks[slot];
        const uint16_t *xr = x + (int64_t)t * ldx;
        if (fmt != LORA_BF16)
            for (int i = 0; i < m; i++) widen_x(fmt, xr + i * ldx, K, xf + i * ldxf);
        const uint8_t *As = A + wbytes(fmt, (int64_t)slot * nseg * R * K);
        const uint16_t *q4a = fmt == LORA_INT4 ? (const uint16_t *)a_scale + (int64_t)slot * nseg * R * (K / 32) : NULL;
        const uint16_t *q4b = fmt == LORA_INT4 ? (const uint16_t *)bt_scale + (int64_t)slot * R * (N / 32) : NULL;
        for (int s = 0; s < nseg; s++) {
            const uint8_t *Aseg = As + wbytes(fmt, (int64_t)s * R * K);
            const uint16_t *Sseg = Q4ROW(fmt, q4a, s * R, K);
            if (m == 1)
                shrink(fmt, xr, xf, Aseg, Sseg, r, K, u + s * R);
            else
                shrink_group(fmt, xr, ldx, xf, ldxf, m, Aseg, Sseg, r, K, u + s * R);
        }
        if (fmt == LORA_INT8) { /* both per-row scales fold into u */
            const float *sa = (const float *)a_scale + (int64_t)slot * nseg * R;
            const float *sb = (const float *)bt_scale + (int64_t)slot * nseg * R;
            for (int i = 0; i < m; i++)
                for (int s = 0; s < nseg; s++)
                    for (int j = 0; j < r; j++) u[i * LORA_MAX_U + s * R + j] *= sa[s * R + j] * sb[s * R + j];
        }
        expand_group(fmt, y + (int64_t)t * ldy, ldy, m, Bt + wbytes(fmt, (int64_t)slot * R * N), q4b, N, r, R, nseg,
                     bounds, u, acc);
    }
}
#endif

/* x [T, K] (ldx), y [T, N] (ldy), bf16; A [S, nseg*R, K], Bt [S, R, N] contiguous in format fmt
 * (LORA_BF16 / INT8 / INT4, the scales as above, NULL for bf16); bounds [nseg + 1] column offsets;
 * idx [T] slot or -1; ranks [S]. Returns 0; -1 when this build cannot run it (the caller then
 * uses the reference); -2 for a layout the format does not take. */
int pdserve_lora(const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int T, int K, int N, const void *A,
                 const void *Bt, int R, int nseg, const int32_t *bounds, const int32_t *idx, const int32_t *ranks,
                 int fmt, const void *a_scale, const void *bt_scale) {
#if defined(__AVX512F__)
    if (nseg * R > LORA_MAX_U || fmt < LORA_BF16 || fmt > LORA_INT4) return -1;
    if (fmt != LORA_BF16 && (!a_scale || !bt_scale)) return -2;
    if (fmt == LORA_INT4) {
        if (K % 32) return -2;
        for (int s = 0; s <= nseg; s++)
            if (bounds[s] % 32) return -2;
    }
    /* rows in chunks of LORA_GROUP once there are enough to share among threads: a chunk's runs
     * of one adapter (a prefill's rows) read its A and B once; a decode batch's rows, each its own
     * adapter, are runs of one */
    const int G = T >= 16 ? LORA_GROUP : 1, chunks = (T + G - 1) / G;
    /* the quantized shrinks' widened rows: LORA_GROUP per thread */
    const size_t xf_bytes = (size_t)LORA_GROUP * (((K + 31) & ~31) * sizeof(float));
    int failed = 0;
#define LORA_LOOP(F)                                                                                           \
    _Pragma("omp parallel if (T > 1)") {                                                                      \
        float *xf = F == LORA_BF16 ? NULL : aligned_alloc(64, xf_bytes);                                      \
        _Pragma("omp for schedule(static)") for (int c = 0; c < chunks; c++) {                                 \
            if (F != LORA_BF16 && !xf)                                                                          \
                failed = 1; /* every thread still reaches the loop's barrier */                                \
            else                                                                                                \
                lora_chunk(F, c, G, x, ldx, y, ldy, T, K, N, A, Bt, R, nseg, bounds, idx, ranks, a_scale, bt_scale, \
                           xf);                                                                                 \
        }                                                                                                      \
        free(xf);                                                                                              \
    }
    if (fmt == LORA_BF16)
        LORA_LOOP(LORA_BF16)
    else if (fmt == LORA_INT8)
        LORA_LOOP(LORA_INT8)
    else
        LORA_LOOP(LORA_INT4)
#undef LORA_LOOP
    return failed ? -3 : 0;
#else
    (void)x; (void)ldx; (void)y; (void)ldy; (void)T; (void)K; (void)N; (void)A; (void)Bt; (void)R; (void)nseg;
    (void)bounds; (void)idx; (void)ranks; (void)fmt; (void)a_scale; (void)bt_scale;
    return -1;
#endif
}
