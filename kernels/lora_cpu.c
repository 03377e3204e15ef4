/*
 * Batched LoRA on CPU (kernels/lora.py has the definition and the torch reference):
 * each row t gathers its adapter slot's stacked A and B^T and adds
 *
 *   y[t, seg cols] += (A[slot, seg*R : seg*R + r] . x[t]) @ Bt[slot, 0:r, seg cols]
 *
 * over the output segments (q/k/v of a fused qkv, gate/up of gate_up), in fp32, y rounded
 * to bf16 once. Only the slot's own rank r is read (the stacks are padded to R), so a rank-8
 * adapter costs a quarter of a rank-32 one. Shrink: r dot products of length K per segment;
 * expand: 16 output columns at a time in a register, r FMAs each (Bt rows are contiguous in
 * the output dimension, which is why B is stored transposed). Rows go to OpenMP threads.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define LORA_MAX_U 1024 /* nseg * R per row on the stack: 4 segments of rank 256 */

int pdserve_lora_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* x [T, K] (ldx), y [T, N] (ldy), bf16; A [S, nseg*R, K], Bt [S, R, N] bf16 contiguous;
 * bounds [nseg + 1] column offsets; idx [T] slot or -1; ranks [S]. Returns 0, or -1 when
 * this build cannot run it (the caller then uses the reference). */
int pdserve_lora_bf16(const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int T, int K, int N,
                      const uint16_t *A, const uint16_t *Bt, int R, int nseg, const int32_t *bounds,
                      const int32_t *idx, const int32_t *ranks) {
#if defined(__AVX512F__)
    if (nseg * R > LORA_MAX_U) return -1;
#pragma omp parallel for schedule(static) if (T > 1)
    for (int t = 0; t < T; t++) {
        const int slot = idx[t];
        if (slot < 0) continue;
        const int r = ranks[slot];
        if (r <= 0) continue;
        const uint16_t *xr = x + (int64_t)t * ldx;
        const uint16_t *As = A + (int64_t)slot * nseg * R * K;
        const uint16_t *Bs = Bt + (int64_t)slot * R * N;
        float u[LORA_MAX_U];
        for (int s = 0; s < nseg; s++) {
            for (int j = 0; j < r; j++) {
                const uint16_t *ar = As + (int64_t)(s * R + j) * K;
                __m512 acc = _mm512_setzero_ps();
                for (int k = 0; k < K; k += 16) {
                    const __mmask16 m = tail_mask(K - k);
                    acc = _mm512_fmadd_ps(load16m_bf16(ar + k, m), load16m_bf16(xr + k, m), acc);
                }
                u[s * R + j] = _mm512_reduce_add_ps(acc);
            }
        }
        uint16_t *yr = y + (int64_t)t * ldy;
        for (int s = 0; s < nseg; s++) {
            const float *us = u + s * R;
            for (int n = bounds[s]; n < bounds[s + 1]; n += 16) {
                const __mmask16 m = tail_mask(bounds[s + 1] - n);
                __m512 acc = load16m_bf16(yr + n, m);
                for (int j = 0; j < r; j++)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(us[j]), load16m_bf16(Bs + (int64_t)j * N + n, m), acc);
                _mm256_mask_storeu_epi16(yr + n, m, narrow16_bf16(acc));
            }
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)y; (void)ldy; (void)T; (void)K; (void)N; (void)A; (void)Bt; (void)R; (void)nseg;
    (void)bounds; (void)idx; (void)ranks;
    return -1;
#endif
}
