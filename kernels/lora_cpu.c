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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define LORA_MAX_U 1024 /* nseg * R per row on the stack: 4 segments of rank 256 */
#define LORA_COLS 4096  /* expand: columns per pass, a 16 KiB fp32 accumulator row (L1) */
#define LORA_GROUP 4    /* rows of one adapter that share a pass over its A and B */
#define LORA_QPF 16      /* quantized shrinks: A rows prefetched ahead */
#define LORA_PF_BYTES 8192 /* int4 expand: bytes of B^T prefetched ahead */

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

/* 1 where the quantized shrinks quantize x to int8 (VNNI, below), 0 where they widen it exactly */
int pdserve_lora_quantizes_x(void) {
#if defined(__AVX512VNNI__)
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

#if defined(__AVX512VNNI__)
#define LORA_VNNI 1
/* The quantized shrinks with VNNI (vpdpbusd: 64 byte products summed four at a time into int32
 * lanes). x is quantized to int8 once per row, symmetric, one scale per 32 elements (a group), so
 * each 64-byte load of weights costs a few integer ops instead of widening every weight to fp32:
 * with a quarter or half the bytes of bf16 the vector ports, not memory, bound the fp32 loops
 * (int4's A read at 6 GB/s). The error this adds is x's int8 rounding, at most half a step of
 * 1/127 of its group's largest |x|, well under the weights' own int4/int8 rounding.
 * A row of x so prepared, per 128 elements: for int4 weights the even and odd elements' codes
 * (the weights' low and high nibbles pair with them byte for byte), minus 8 x the sum of each
 * int32 lane's codes (the nibbles are stored + 8: sum (q + 8) x - 8 sum x), each lane's group
 * scale; for int8 weights the codes + 128 in memory order (vpdpbusd multiplies unsigned by
 * signed: sum (x + 128) w - 128 sum w, the second sum taken in the loop) and the scales of both
 * 64-element halves. */
typedef struct {
    uint8_t c[2][64];  /* int4: even, odd codes; int8: elements 0-63, 64-127, + 128 */
    int32_t ncorr[16]; /* int4 only */
    float xs[2][16];   /* the group scale of each int32 lane of c[0] (int4: of both) and of c[1] */
} lora_qx;            /* 320 bytes: the shrinks' x buffer holds 512 per 128 elements */

/* 32 elements of x (the mask's; the rest 0) as int8 codes of their group, even and odd elements
 * (even_odd) or the first and second 16; returns the group's scale */
INLINE float quant32(const uint16_t *x, __mmask32 m, int even_odd, __m128i *c0, __m128i *c1) {
    __m512 e, o;
    if (even_odd) {
        widen32m_bf16(x, m, &e, &o);
    } else {
        e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)m, x)), 16));
        o = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)(m >> 16), x + 16)), 16));
    }
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(e), _mm512_abs_ps(o)));
    const __m512 inv = _mm512_set1_ps(mx > 0 ? 127.0f / mx : 0.0f);
    *c0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(e, inv)));
    *c1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(o, inv)));
    return mx / 127.0f;
}

/* x [K] bf16 -> ceil(K / 128) lora_qx for weights in format fmt (int8 or int4) */
INLINE void quant_x(int fmt, const uint16_t *x, int K, lora_qx *q) {
    const __m128i off = _mm_set1_epi8((char)0x80);
    for (int k = 0; k < K; k += 128, q++) {
        for (int g = 0; g < 4; g++) {
            const int kg = k + 32 * g;
            __m128i c0 = _mm_setzero_si128(), c1 = _mm_setzero_si128();
            const float s = kg < K ? quant32(x + kg, tail_mask32(K - kg), fmt == LORA_INT4, &c0, &c1) : 0.0f;
            if (fmt == LORA_INT4) {
                _mm_storeu_si128((__m128i *)(q->c[0] + 16 * g), c0);
                _mm_storeu_si128((__m128i *)(q->c[1] + 16 * g), c1);
                for (int l = 0; l < 4; l++) q->xs[0][4 * g + l] = s;
            } else { /* group g: lanes 8 (g & 1) .. 8 (g & 1) + 7 of half g / 2 */
                uint8_t *dst = q->c[g >> 1] + 32 * (g & 1);
                _mm_storeu_si128((__m128i *)dst, _mm_xor_si128(c0, off));
                _mm_storeu_si128((__m128i *)(dst + 16), _mm_xor_si128(c1, off));
                for (int l = 0; l < 8; l++) q->xs[g >> 1][8 * (g & 1) + l] = s;
            }
        }
        if (fmt == LORA_INT4) {
            const __m512i eight = _mm512_set1_epi8(8);
            __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), eight, _mm512_loadu_si512(q->c[0]));
            c = _mm512_dpbusd_epi32(c, eight, _mm512_loadu_si512(q->c[1]));
            _mm512_storeu_si512(q->ncorr, _mm512_sub_epi32(_mm512_setzero_si512(), c));
        }
    }
}

/* dot4q with VNNI against rows of x prepared by quant_x (xq_i): per 64 bytes of weights (int4:
 * 128 elements, low and high nibbles; int8: 64 elements) one or two vpdpbusd into int32 lanes,
 * each lane then scaled by its group's x scale (and int4's weight scale) into fp32 */
INLINE void dot4v(int fmt, const uint8_t *const a[4], const uint16_t *const s[4], const lora_qx *const xq[4], int K,
                  int64_t pf, float *d) {
    __m512 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15), c128 = _mm512_set1_epi8((char)0x80);
    const __m512i rep = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int step = fmt == LORA_INT4 ? 128 : 64; /* elements in 64 bytes */
    __m512 ws[4]; /* int4: the rows' weight scales of 512 elements (16 groups), widened once */
    for (int k = 0; k < K; k += step) {
        if (fmt == LORA_INT4 && (k & 511) == 0)
            for (int i = 0; i < 4; i++) ws[i] = load16m_bf16(s[i] + k / 32, mask16((K - k + 31) / 32));
        const int left = K - k, nbytes = fmt == LORA_INT4 ? left / 2 : left;
        const __mmask64 mb = nbytes >= 64 ? ~0ULL : (1ULL << nbytes) - 1;
        const int half = fmt == LORA_INT4 ? 0 : (k / 64) & 1;
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(a[i] + wbytes(fmt, k + pf)), _MM_HINT_T1);
        for (int i = 0; i < 4; i++) {
            const lora_qx *q = xq[i] + k / 128;
            const __m512i b = _mm512_maskz_loadu_epi8(mb, a[i] + wbytes(fmt, k));
            __m512 sv = _mm512_loadu_ps(q->xs[half]);
            __m512i t;
            if (fmt == LORA_INT4) {
                t = _mm512_dpbusd_epi32(_mm512_loadu_si512(q->ncorr), _mm512_and_si512(b, low), _mm512_loadu_si512(q->c[0]));
                t = _mm512_dpbusd_epi32(t, _mm512_and_si512(_mm512_srli_epi16(b, 4), low), _mm512_loadu_si512(q->c[1]));
                sv = _mm512_mul_ps(sv, _mm512_permutexvar_ps(_mm512_add_epi32(rep, _mm512_set1_epi32((k & 511) / 32)), ws[i]));
            } else {
                t = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(q->c[half]), b),
                                     _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, b));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sv, acc[i]);
        }
    }
    for (int i = 0; i < 4; i++) d[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

/* dot4 over quantized rows against widened xf_i: int8 as 2 x 16 int8 -> int32 -> fp32 in memory
 * order (no even/odd shifts); int4 nibbles split and offset in 128-bit lanes, each 32-element
 * group's partial dot scaled once */
INLINE void dot4q(int fmt, const uint8_t *const a[4], const uint16_t *const s[4], const float *const xf[4], int K,
                  int64_t pf, float *d) {
#if defined(LORA_VNNI)
    const lora_qx *const q[4] = {(const lora_qx *)xf[0], (const lora_qx *)xf[1], (const lora_qx *)xf[2],
                                 (const lora_qx *)xf[3]};
    dot4v(fmt, a, s, q, K, pf, d);
    return;
#endif
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
            dot4q(fmt, a, s, xfs, K, LORA_QPF * K, u + j); /* LORA_QPF rows ahead */
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

#if defined(LORA_VNNI)
/* The int4 expand with VNNI. y[n] += sum_j u_j s_j[g] q_j[n] (g = n's group of 32 columns) sums over
 * the rank j, down B^T's rows, while vpdpbusd sums four adjacent bytes: so four rows' codes are
 * interleaved in registers (two rounds of byte/word unpacks give dword k = rows j..j+3 of one
 * column) and multiply the four coefficients c_j,g = u_j s_j[g], quantized to int8 per group over
 * j (one scale t_g: half a step of 1/127 of the group's largest |c| is the error, under int4's
 * own). The int32 sums run over every j; y[n] += t_g (sum - 8 sum_j cq_j,g), the nibbles being
 * stored + 8. Per 64 bytes of a row: a quarter of a load, three nibble ops, four unpacks, two
 * vpdpbusd, instead of widening 128 weights to fp32 (int4's expand read at 4-5 GB/s).
 * Work per x row (wk): the coefficients [r4 / 4][ng] dwords, cs [ng] (8 sum cq), ts [ng] (t_g), and
 * the int32 sums of a pass, per 128 columns eight vectors: nibble half h (even / odd columns) and
 * unpack output q, lane l = group, dword k = byte position 4q + k of the group's 16. */
#define LORA_Q4COLS 4096 /* int4 expand: columns per pass (16 KiB of sums per row), B^T read whole rows at a time */

INLINE int64_t q4_work_ints(int R, int N) { /* int32s of wk per x row */
    return (int64_t)(R / 4 + 2) * (N / 32 + 16) + LORA_Q4COLS / 128 * 8 * 16 + 16;
}

/* row i's coefficients from its u (u_s,j at u[s * R + j]) and B^T's scales Bsc [R, ng]: per 16 groups
 * one pass computing c_j = u_j s_j (kept in c, 16 KiB at rank 256) with four independent max chains,
 * one quantizing and packing them. The first version recomputed c_j in both passes and chained every
 * max on the last: ~10% of int4's kernel time, most at the small projections (o, down: 18 groups) */
INLINE void q4_coefficients(const float *u, const uint16_t *Bsc, int r, int R, int N, int nseg, const int32_t *bounds,
                            int32_t *cq, int32_t *cs, float *ts) {
    const int ng = N / 32, r4 = (r + 3) & ~3;
    __m512 c[LORA_MAX_U]; /* r4 <= R <= LORA_MAX_U / nseg: 64 KiB of stack at most */
    for (int s = 0; s < nseg; s++)
        for (int g = bounds[s] / 32; g < bounds[s + 1] / 32; g += 16) {
            const __mmask16 m = mask16(bounds[s + 1] / 32 - g);
            __m512 mx[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int j = 0; j < r4; j++) { /* rows r..r4 (padding) get c = 0 */
                c[j] = j < r ? _mm512_mul_ps(_mm512_set1_ps(u[s * R + j]), load16m_bf16(Bsc + (int64_t)j * ng + g, m))
                             : _mm512_setzero_ps();
                mx[j & 3] = _mm512_max_ps(mx[j & 3], _mm512_abs_ps(c[j]));
            }
            const __m512 top = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
            const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(top, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                   _mm512_set1_ps(127.0f), top);
            _mm512_mask_storeu_ps(ts + g, m, _mm512_div_ps(top, _mm512_set1_ps(127.0f)));
            __m512i sum = _mm512_setzero_si512();
            const __m512i byte = _mm512_set1_epi32(255);
            for (int j = 0; j < r4; j += 4) {
                const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(c[j], inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(c[j + 1], inv));
                const __m512i q2 = _mm512_cvtps_epi32(_mm512_mul_ps(c[j + 2], inv)), q3 = _mm512_cvtps_epi32(_mm512_mul_ps(c[j + 3], inv));
                sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_add_epi32(q0, q1), _mm512_add_epi32(q2, q3)));
                const __m512i packed = _mm512_or_si512(
                    _mm512_or_si512(_mm512_and_si512(q0, byte), _mm512_slli_epi32(_mm512_and_si512(q1, byte), 8)),
                    _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(q2, byte), 16), _mm512_slli_epi32(q3, 24)));
                _mm512_mask_storeu_epi32(cq + (int64_t)(j / 4) * ng + g, m, packed);
            }
            _mm512_mask_storeu_epi32(cs + g, m, _mm512_slli_epi32(sum, 3));
        }
}

/* y_i[0:N] += the LoRA expand of the m rows sharing B (y_i at y + i * ldy, u_i at u + i * LORA_MAX_U),
 * B [R, N / 2] packed int4 with scales Bsc [R, N / 32] */
INLINE void expand4v(uint16_t *y, int64_t ldy, int m, const uint8_t *B, const uint16_t *Bsc, int N, int r, int R,
                     int nseg, const int32_t *bounds, const float *u, int32_t *wk) {
    const int ng = N / 32, r4 = (r + 3) & ~3;
    const int64_t ldb = N / 2, per = q4_work_ints(R, N);
    const int64_t pf = ldb ? ((LORA_PF_BYTES / ldb + 3) & ~3) * ldb : 0; /* whole blocks of four rows, LORA_PF_BYTES or more ahead */
    const int64_t lcq = (int64_t)(R / 4 + 2) * (ng + 16) - 2 * (ng + 16); /* cq's ints, then cs, ts */
    for (int i = 0; i < m; i++) {
        int32_t *w = wk + i * per;
        q4_coefficients(u + i * LORA_MAX_U, Bsc, r, R, N, nseg, bounds, w, w + lcq, (float *)(w + lcq + ng + 16));
    }
    const __m512i low = _mm512_set1_epi8(15), rep = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int c0 = bounds[0]; c0 < N; c0 += LORA_Q4COLS) {
        const int c1 = c0 + LORA_Q4COLS < N ? c0 + LORA_Q4COLS : N, nblk = (c1 - c0 + 127) / 128;
        for (int i = 0; i < m; i++) memset(wk + i * per + lcq + 2 * (ng + 16), 0, (size_t)nblk * 8 * 64);
        for (int j = 0; j < r4; j += 4) {
            const uint8_t *rows[4] = {B + j * ldb, B + (j + 1) * ldb, B + (j + 2) * ldb, B + (j + 3) * ldb};
            for (int cb = c0, blk = 0; cb < c1; cb += 128, blk++) {
                const int nb = (c1 - cb) / 2;
                const __mmask64 mb = nb >= 64 ? ~0ULL : (1ULL << nb) - 1;
                /* the four rows' bytes interleaved first (dword k = rows j..j+3 at byte position 4q + k),
                 * then each byte's low and high nibble: unpacks commute with bytewise and / shift, so
                 * this is the same Q as nibbles first, with 8 unpacks (port 5 only) instead of 16 */
                __m512i X[4], Q[8];
                for (int k = 0; k < 4; k++) {
                    _mm_prefetch((const char *)(rows[k] + pf + cb / 2), _MM_HINT_T1);
                    X[k] = _mm512_maskz_loadu_epi8(mb, rows[k] + cb / 2);
                }
                const __m512i a01 = _mm512_unpacklo_epi8(X[0], X[1]), b01 = _mm512_unpackhi_epi8(X[0], X[1]);
                const __m512i a23 = _mm512_unpacklo_epi8(X[2], X[3]), b23 = _mm512_unpackhi_epi8(X[2], X[3]);
                const __m512i P[4] = {_mm512_unpacklo_epi16(a01, a23), _mm512_unpackhi_epi16(a01, a23),
                                      _mm512_unpacklo_epi16(b01, b23), _mm512_unpackhi_epi16(b01, b23)};
                for (int q = 0; q < 4; q++)
                    Q[q] = _mm512_and_si512(P[q], low), Q[4 + q] = _mm512_and_si512(_mm512_srli_epi16(P[q], 4), low);
                const int g = cb / 32;
                const __mmask8 mg = (__mmask8)((1u << ((c1 - cb + 31) / 32 > 4 ? 4 : (c1 - cb + 31) / 32)) - 1u);
                for (int i = 0; i < m; i++) {
                    int32_t *w = wk + i * per;
                    const __m512i coef = _mm512_permutexvar_epi32(
                        rep, _mm512_castsi128_si512(_mm_maskz_loadu_epi32(mg, w + (int64_t)(j / 4) * ng + g)));
                    int32_t *acc = w + lcq + 2 * (ng + 16) + blk * 128;
                    for (int q = 0; q < 8; q++)
                        _mm512_storeu_si512(acc + 16 * q, _mm512_dpbusd_epi32(_mm512_loadu_si512(acc + 16 * q), Q[q], coef));
                }
            }
        }
        for (int i = 0; i < m; i++) { /* the sums back to columns (a 4 x 4 transpose of 128-bit lanes), into y */
            const int32_t *w = wk + i * per, *cs = w + lcq;
            const float *ts = (const float *)(w + lcq + ng + 16);
            const int32_t *acc = w + lcq + 2 * (ng + 16);
            uint16_t *yi = y + i * ldy;
            for (int cb = c0, blk = 0; cb < c1; cb += 128, blk++) {
                __m512i G[2][4];
                for (int h = 0; h < 2; h++) {
                    const int32_t *p = acc + blk * 128 + 64 * h;
                    const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 16);
                    const __m512i a2 = _mm512_loadu_si512(p + 32), a3 = _mm512_loadu_si512(p + 48);
                    const __m512i t0 = _mm512_shuffle_i32x4(a0, a1, 0x44), t1 = _mm512_shuffle_i32x4(a2, a3, 0x44);
                    const __m512i t2 = _mm512_shuffle_i32x4(a0, a1, 0xEE), t3 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
                    G[h][0] = _mm512_shuffle_i32x4(t0, t1, 0x88), G[h][1] = _mm512_shuffle_i32x4(t0, t1, 0xDD);
                    G[h][2] = _mm512_shuffle_i32x4(t2, t3, 0x88), G[h][3] = _mm512_shuffle_i32x4(t2, t3, 0xDD);
                }
                for (int l = 0; l < 4 && cb + 32 * l < c1; l++) {
                    const int g = cb / 32 + l;
                    const __m512i corr = _mm512_set1_epi32(cs[g]);
                    const __m512 t = _mm512_set1_ps(ts[g]);
                    __m512 e, o;
                    widen32m_bf16(yi + cb + 32 * l, 0xffffffffu, &e, &o);
                    e = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(G[0][l], corr)), t, e);
                    o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(G[1][l], corr)), t, o);
                    _mm512_storeu_si512(yi + cb + 32 * l, narrow32_bf16(e, o));
                }
            }
        }
    }
}
#endif

#if defined(LORA_VNNI)
/* The int8 expand with VNNI, as expand4v: four B^T rows interleaved into vpdpbusd's dwords (codes
 * + 128, unsigned) against the coefficients u_s,j (both per-row scales already folded in, lora_chunk)
 * quantized to int8 per segment over j; y[n] += t_s (sum - 128 sum_j cq_s,j). Segment bounds must be
 * multiples of 64 (a 64-byte block in one segment; else the fp32 expand runs). Work per x row: the
 * coefficient dwords [R / 4][16], cs [16], ts [16], then the sums of a pass, per 64 columns four
 * vectors: unpack output q, lane l, dword k = column 16 l + 4 q + k. */
INLINE int64_t q8_work_ints(int R) { return (int64_t)(R / 4 + 2) * 16 + LORA_Q4COLS + 16; }

INLINE void expand8v(uint16_t *y, int64_t ldy, int m, const uint8_t *B, int N, int r, int R, int nseg,
                     const int32_t *bounds, const float *u, int32_t *wk) {
    const int r4 = (r + 3) & ~3;
    const int64_t ldb = N, per = q8_work_ints(R), lcq = (int64_t)(R / 4) * 16;
    const int64_t pf = ldb ? ((LORA_PF_BYTES / ldb + 3) & ~3) * ldb : 0;
    for (int i = 0; i < m; i++) { /* coefficients, 16 segments at most */
        int32_t *w = wk + i * per, *cs = w + lcq;
        float *ts = (float *)(w + lcq + 16);
        const float *ui = u + i * LORA_MAX_U;
        for (int s = 0; s < nseg; s++) {
            float mx = 0;
            for (int j = 0; j < r; j++) mx = fabsf(ui[s * R + j]) > mx ? fabsf(ui[s * R + j]) : mx;
            const float inv = mx > 0 ? 127.0f / mx : 0.0f;
            int sum = 0;
            ts[s] = mx / 127.0f;
            for (int j = 0; j < r4; j += 4) {
                uint32_t packed = 0;
                for (int jj = 0; jj < 4 && j + jj < r; jj++) {
                    const int q = (int)nearbyintf(ui[s * R + j + jj] * inv);
                    sum += q;
                    packed |= (uint32_t)(q & 255) << (8 * jj);
                }
                w[(j / 4) * 16 + s] = (int32_t)packed;
            }
            cs[s] = 128 * sum;
        }
    }
    const __m512i off = _mm512_set1_epi8((char)0x80);
    for (int c0 = bounds[0]; c0 < N; c0 += LORA_Q4COLS) {
        const int c1 = c0 + LORA_Q4COLS < N ? c0 + LORA_Q4COLS : N, nblk = (c1 - c0 + 63) / 64;
        for (int i = 0; i < m; i++) memset(wk + i * per + lcq + 32, 0, (size_t)nblk * 4 * 64);
        for (int j = 0; j < r4; j += 4) {
            const uint8_t *rows[4] = {B + j * ldb, B + (j + 1) * ldb, B + (j + 2) * ldb, B + (j + 3) * ldb};
            for (int cb = c0, blk = 0, s = 0; cb < c1; cb += 64, blk++) {
                while (cb >= bounds[s + 1]) s++;
                __m512i X[4], Q[4];
                for (int k = 0; k < 4; k++) {
                    _mm_prefetch((const char *)(rows[k] + pf + cb), _MM_HINT_T0);
                    X[k] = _mm512_xor_si512(_mm512_loadu_si512(rows[k] + cb), off);
                }
                const __m512i a01 = _mm512_unpacklo_epi8(X[0], X[1]), b01 = _mm512_unpackhi_epi8(X[0], X[1]);
                const __m512i a23 = _mm512_unpacklo_epi8(X[2], X[3]), b23 = _mm512_unpackhi_epi8(X[2], X[3]);
                Q[0] = _mm512_unpacklo_epi16(a01, a23), Q[1] = _mm512_unpackhi_epi16(a01, a23);
                Q[2] = _mm512_unpacklo_epi16(b01, b23), Q[3] = _mm512_unpackhi_epi16(b01, b23);
                for (int i = 0; i < m; i++) {
                    int32_t *w = wk + i * per, *acc = w + lcq + 32 + blk * 64;
                    const __m512i coef = _mm512_set1_epi32(w[(j / 4) * 16 + s]);
                    for (int q = 0; q < 4; q++)
                        _mm512_storeu_si512(acc + 16 * q, _mm512_dpbusd_epi32(_mm512_loadu_si512(acc + 16 * q), Q[q], coef));
                }
            }
        }
        for (int i = 0; i < m; i++) {
            const int32_t *w = wk + i * per, *cs = w + lcq, *acc = w + lcq + 32;
            const float *ts = (const float *)(w + lcq + 16);
            uint16_t *yi = y + i * ldy;
            for (int cb = c0, blk = 0, s = 0; cb < c1; cb += 64, blk++) {
                while (cb >= bounds[s + 1]) s++;
                const int32_t *p = acc + blk * 64;
                const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 16);
                const __m512i a2 = _mm512_loadu_si512(p + 32), a3 = _mm512_loadu_si512(p + 48);
                const __m512i t0 = _mm512_shuffle_i32x4(a0, a1, 0x44), t1 = _mm512_shuffle_i32x4(a2, a3, 0x44);
                const __m512i t2 = _mm512_shuffle_i32x4(a0, a1, 0xEE), t3 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
                const __m512i G[4] = {_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xDD),
                                      _mm512_shuffle_i32x4(t2, t3, 0x88), _mm512_shuffle_i32x4(t2, t3, 0xDD)};
                const __m512i corr = _mm512_set1_epi32(cs[s]);
                const __m512 t = _mm512_set1_ps(ts[s]);
                for (int l = 0; l < 4; l++) {
                    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(G[l], corr)), t,
                                                     load16m_bf16(yi + cb + 16 * l, 0xffff));
                    _mm256_storeu_si256((__m256i *)(yi + cb + 16 * l), narrow16_bf16(v));
                }
            }
        }
    }
}
#endif

/* The rows of chunk c (G rows from c * G): runs of one adapter share a pass over its A and B */
INLINE void lora_chunk(int fmt, int c, int G, const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int T, int K,
                       int N, const uint8_t *A, const uint8_t *Bt, int R, int nseg, const int32_t *bounds,
                       const int32_t *idx, const int32_t *ranks, const void *a_scale, const void *bt_scale,
                       float *xf, int32_t *wk) {
    float u[LORA_GROUP * LORA_MAX_U];
    const int64_t ldxf = (K + 127) & ~127; /* widen_x's fp32 row or quant_x's lora_qx per 128 */
    float acc[LORA_GROUP * LORA_COLS] __attribute__((aligned(64)));
    const int end = (c + 1) * G < T ? (c + 1) * G : T;
    for (int t = c * G, m; t < end; t += m) {
        const int slot = idx[t];
        for (m = 1; t + m < end && idx[t + m] == slot;) m++;
        if (slot < 0 || ranks[slot] <= 0) continue;
        const int r = ranks[slot];
        const uint16_t *xr = x + (int64_t)t * ldx;
        if (fmt != LORA_BF16)
            for (int i = 0; i < m; i++)
#if defined(LORA_VNNI)
                quant_x(fmt, xr + i * ldx, K, (lora_qx *)(xf + i * ldxf));
#else
                widen_x(fmt, xr + i * ldx, K, xf + i * ldxf);
#endif
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
#if defined(LORA_VNNI)
        if (fmt == LORA_INT4 && wk) {
            expand4v(y + (int64_t)t * ldy, ldy, m, Bt + wbytes(fmt, (int64_t)slot * R * N), q4b, N, r, R, nseg, bounds,
                     u, wk);
            continue;
        }
        if (fmt == LORA_INT8 && wk) {
            expand8v(y + (int64_t)t * ldy, ldy, m, Bt + (int64_t)slot * R * N, N, r, R, nseg, bounds, u, wk);
            continue;
        }
#endif
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
    const size_t xf_bytes = (size_t)LORA_GROUP * (((K + 127) & ~127) * sizeof(float));
    /* the VNNI expands' coefficients and sums: LORA_GROUP rows per thread (R a multiple of 4: they
     * read B^T four rows at a time) */
#if defined(LORA_VNNI)
    int seg64 = nseg <= 16; /* int8: every segment bound a multiple of 64, at most 16 segments */
    for (int s = 0; s <= nseg; s++) seg64 &= bounds[s] % 64 == 0;
    const int64_t wk_ints = R % 4 ? 0 : fmt == LORA_INT4 ? q4_work_ints(R, N) : fmt == LORA_INT8 && seg64 ? q8_work_ints(R) : 0;
    const size_t wk_bytes = (LORA_GROUP * wk_ints * 4 + 63) & ~(size_t)63;
#else
    const size_t wk_bytes = 0;
#endif
    int failed = 0;
#define LORA_LOOP(F)                                                                                           \
    _Pragma("omp parallel if (T > 1)") {                                                                      \
        float *xf = F == LORA_BF16 ? NULL : aligned_alloc(64, xf_bytes);                                      \
        int32_t *wk = wk_bytes ? aligned_alloc(64, wk_bytes) : NULL;                                          \
        _Pragma("omp for schedule(static)") for (int c = 0; c < chunks; c++) {                                 \
            if ((F != LORA_BF16 && !xf) || (wk_bytes && !wk))                                                   \
                failed = 1; /* every thread still reaches the loop's barrier */                                \
            else                                                                                                \
                lora_chunk(F, c, G, x, ldx, y, ldy, T, K, N, A, Bt, R, nseg, bounds, idx, ranks, a_scale, bt_scale, \
                           xf, wk);                                                                             \
        }                                                                                                      \
        free(xf);                                                                                              \
        free(wk);                                                                                              \
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
