/*
 * Paged decode attention for CPU: one query token per sequence, reading K/V in
 * place through the block table (no gather copy), fp32 accumulation, online
 * softmax. Built by kernels/native.py with -O3 -march=native -fopenmp.
 *
 * Layouts (element strides; the last dim of q, caches and out is contiguous):
 *   q, out   [S, H, D]
 *   k, v     [num_blocks, block_size, HKV, D]  (strided views of the big KV tensor)
 *   block_tables int32 [S, bt_stride], context_lens int32 [S]
 * Work item = (sequence, kv head): its G = H / HKV query heads share every K/V row
 * they read, so each row is loaded from memory once per item.
 *
 * Two implementations of the same function:
 *   - AVX-512 (compiled where the build machine has it, used when D % 16 == 0):
 *     a K/V row is D/16 vectors; scores of 16 consecutive positions form one
 *     vector, so the softmax of a tile (max, exp2, sum) is vector code and the
 *     kernel runs at memory speed instead of being bound by scalar expf;
 *   - portable C (every other case), which gcc vectorises where it can.
 * Scores are kept in the log2 domain (q is pre-scaled by scale * log2(e)), so
 * exp(x - m) becomes exp2(x' - m').
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define MAX_G 16
#define MAX_D 256
#define MAX_BS 64
#define LOG2E 1.4426950408889634f

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                           \
static void NAME(const T *q, int64_t q_ss, int64_t q_sh,                                                    \
          const T *k, int64_t k_sb, int64_t k_st, int64_t k_sh,                                      \
          const T *v, int64_t v_sb, int64_t v_st, int64_t v_sh,                                      \
          const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,                \
          T *out, int64_t o_ss, int64_t o_sh,                                                         \
          int S, int H, int HKV, int D, int BS, float scale) {                                        \
    const int G = H / HKV;                                                                            \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                      \
    for (int s = 0; s < S; s++) {                                                                     \
        for (int kh = 0; kh < HKV; kh++) {                                                            \
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G];                            \
            float kf[MAX_D], score[MAX_G][MAX_BS];                                                    \
            const int ctx = context_lens[s];                                                          \
            for (int g = 0; g < G; g++) {                                                             \
                const T *qp = q + s * q_ss + (int64_t)(kh * G + g) * q_sh;                            \
                for (int d = 0; d < D; d++) { qf[g][d] = LOAD(qp[d]) * scale; acc[g][d] = 0.f; }      \
                m[g] = -INFINITY; l[g] = 0.f;                                                         \
            }                                                                                         \
            for (int start = 0; start < ctx; start += BS) {                                           \
                const int64_t blk = block_tables[s * bt_stride + start / BS];                         \
                const int n = ctx - start < BS ? ctx - start : BS;                                    \
                for (int t = 0; t < n; t++) {                                                         \
                    const T *kp = k + blk * k_sb + t * k_st + kh * k_sh;                              \
                    for (int d = 0; d < D; d++) kf[d] = LOAD(kp[d]);                                  \
                    for (int g = 0; g < G; g++) {                                                     \
                        float dot = 0.f;                                                              \
                        _Pragma("omp simd reduction(+:dot)")                                          \
                        for (int d = 0; d < D; d++) dot += qf[g][d] * kf[d];                          \
                        score[g][t] = dot;                                                            \
                    }                                                                                 \
                }                                                                                     \
                for (int g = 0; g < G; g++) {                                                         \
                    float bmax = m[g];                                                                \
                    for (int t = 0; t < n; t++) bmax = score[g][t] > bmax ? score[g][t] : bmax;       \
                    const float correction = expf(m[g] - bmax);                                       \
                    l[g] *= correction;                                                               \
                    for (int d = 0; d < D; d++) acc[g][d] *= correction;                              \
                    float sum = 0.f;                                                                  \
                    _Pragma("omp simd reduction(+:sum)")                                              \
                    for (int t = 0; t < n; t++) { score[g][t] = expf(score[g][t] - bmax); sum += score[g][t]; } \
                    l[g] += sum;                                                                      \
                    m[g] = bmax;                                                                      \
                }                                                                                     \
                for (int t = 0; t < n; t++) {                                                         \
                    const T *vp = v + blk * v_sb + t * v_st + kh * v_sh;                              \
                    for (int d = 0; d < D; d++) kf[d] = LOAD(vp[d]);                                  \
                    for (int g = 0; g < G; g++) {                                                     \
                        const float p = score[g][t];                                                  \
                        for (int d = 0; d < D; d++) acc[g][d] += p * kf[d];                           \
                    }                                                                                 \
                }                                                                                     \
            }                                                                                         \
            for (int g = 0; g < G; g++) {                                                             \
                T *op = out + s * o_ss + (int64_t)(kh * G + g) * o_sh;                                \
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;                                      \
                for (int d = 0; d < D; d++) op[d] = STORE(acc[g][d] * inv);                           \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
}


#if defined(__AVX512F__)
/* One (sequence, kv head) item. ND = D / 16 vectors per row. Positions are taken
 * in tiles of 16 (a tile never crosses a block when block_size % 16 == 0; with
 * smaller blocks each position finds its own block). Always inlined into callers
 * that pass compile-time G and ND for the common head layouts, so the query and
 * accumulator vectors live in registers (with runtime bounds they live on the
 * stack and every FMA round-trips through memory: 3x slower). */
#define DEFINE_AVX512_ITEM(NAME, T, LOADV, STORE)                                                     \
static inline __attribute__((always_inline)) void NAME(                                              \
        const int G, const int ND, int s, int kh,                                                    \
        const T *q, int64_t q_ss, int64_t q_sh,                                                      \
        const T *k, int64_t k_sb, int64_t k_st, int64_t k_sh,                                        \
        const T *v, int64_t v_sb, int64_t v_st, int64_t v_sh,                                        \
        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,                 \
        T *out, int64_t o_ss, int64_t o_sh, int D, int BS, float qscale) {                           \
    __m512 qv[MAX_G][MAX_D / 16], acc[MAX_G][MAX_D / 16];                                             \
    float m[MAX_G], l[MAX_G];                                                                         \
    float sc[MAX_G][16] __attribute__((aligned(64)));                                                 \
    const int ctx = context_lens[s];                                                                  \
    const int32_t *bt = block_tables + s * bt_stride;                                                 \
    for (int g = 0; g < G; g++) {                                                                     \
        const T *qp = q + s * q_ss + (int64_t)(kh * G + g) * q_sh;                                    \
        for (int i = 0; i < ND; i++) {                                                                \
            qv[g][i] = _mm512_mul_ps(LOADV(qp + 16 * i), _mm512_set1_ps(qscale));                     \
            acc[g][i] = _mm512_setzero_ps();                                                          \
        }                                                                                             \
        m[g] = -INFINITY; l[g] = 0.f;                                                                 \
    }                                                                                                 \
    for (int start = 0; start < ctx; start += 16) {                                                   \
        const int n = ctx - start < 16 ? ctx - start : 16;                                            \
        const __mmask16 live = (__mmask16)((1u << n) - 1u);                                           \
        const T *kp[16], *vp[16];                                                                     \
        for (int t = 0; t < n; t++) {                                                                 \
            const int pos = start + t;                                                                \
            const int64_t blk = bt[pos / BS];                                                         \
            kp[t] = k + blk * k_sb + (pos % BS) * k_st + kh * k_sh;                                   \
            vp[t] = v + blk * v_sb + (pos % BS) * v_st + kh * v_sh;                                   \
        }                                                                                             \
        /* the next tile's rows are fetched while this one computes: one core alone does          \
         * not keep enough misses in flight to reach memory bandwidth otherwise */                 \
        for (int pos = start + 16; pos < start + 32 && pos < ctx; pos++) {                           \
            const int64_t blk = bt[pos / BS];                                                         \
            const char *kn = (const char *)(k + blk * k_sb + (pos % BS) * k_st + kh * k_sh);          \
            const char *vn = (const char *)(v + blk * v_sb + (pos % BS) * v_st + kh * v_sh);          \
            for (int b = 0; b < D * (int)sizeof(T); b += 64) {                                        \
                _mm_prefetch(kn + b, _MM_HINT_T0);                                                    \
                _mm_prefetch(vn + b, _MM_HINT_T0);                                                    \
            }                                                                                         \
        }                                                                                             \
        for (int t = 0; t < n; t++) {                                                                 \
            __m512 kf[MAX_D / 16];                                                                    \
            for (int i = 0; i < ND; i++) kf[i] = LOADV(kp[t] + 16 * i);                               \
            for (int g = 0; g < G; g++) {                                                             \
                __m512 d = _mm512_mul_ps(qv[g][0], kf[0]);                                            \
                for (int i = 1; i < ND; i++) d = _mm512_fmadd_ps(qv[g][i], kf[i], d);                 \
                sc[g][t] = _mm512_reduce_add_ps(d);                                                   \
            }                                                                                         \
        }                                                                                             \
        for (int g = 0; g < G; g++) {                                                                 \
            const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc[g]);            \
            const float tmax = _mm512_reduce_max_ps(x);                                               \
            const float mnew = tmax > m[g] ? tmax : m[g];                                             \
            const float corr = exp2f(m[g] - mnew); /* 0 on the first tile: m = -inf */                \
            const __m512 p = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(x, _mm512_set1_ps(mnew)))); \
            l[g] = l[g] * corr + _mm512_reduce_add_ps(p);                                             \
            m[g] = mnew;                                                                              \
            if (corr != 1.f) {                                                                        \
                const __m512 c = _mm512_set1_ps(corr);                                                \
                for (int i = 0; i < ND; i++) acc[g][i] = _mm512_mul_ps(acc[g][i], c);                 \
            }                                                                                         \
            _mm512_store_ps(sc[g], p);                                                                \
        }                                                                                             \
        for (int t = 0; t < n; t++) {                                                                 \
            __m512 vf[MAX_D / 16];                                                                    \
            for (int i = 0; i < ND; i++) vf[i] = LOADV(vp[t] + 16 * i);                               \
            for (int g = 0; g < G; g++) {                                                             \
                const __m512 p = _mm512_set1_ps(sc[g][t]);                                            \
                for (int i = 0; i < ND; i++) acc[g][i] = _mm512_fmadd_ps(p, vf[i], acc[g][i]);        \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    for (int g = 0; g < G; g++) {                                                                     \
        T *op = out + s * o_ss + (int64_t)(kh * G + g) * o_sh;                                        \
        const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);                             \
        float o[MAX_D] __attribute__((aligned(64)));                                                  \
        for (int i = 0; i < ND; i++) _mm512_store_ps(o + 16 * i, _mm512_mul_ps(acc[g][i], inv));      \
        for (int d = 0; d < D; d++) op[d] = STORE(o[d]);                                              \
    }                                                                                                 \
}

/* (G, ND) pairs with a specialised item: the layouts of the supported model families
 * (G = query heads per KV head, ND = head_dim / 16); others run the generic item. */
#define FOR_COMMON_LAYOUTS(X) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(5, 4) X(7, 4) X(8, 4) \
                              X(1, 8) X(2, 8) X(4, 8) X(6, 8) X(7, 8) X(8, 8)

#define DEFINE_AVX512_KERNEL(NAME, ITEM, T)                                                           \
static void NAME(const T *q, int64_t q_ss, int64_t q_sh,                                             \
                 const T *k, int64_t k_sb, int64_t k_st, int64_t k_sh,                               \
                 const T *v, int64_t v_sb, int64_t v_st, int64_t v_sh,                               \
                 const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,         \
                 T *out, int64_t o_ss, int64_t o_sh,                                                  \
                 int S, int H, int HKV, int D, int BS, float scale) {                                 \
    const int G = H / HKV, ND = D / 16;                                                               \
    const float qscale = scale * LOG2E;                                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                      \
    for (int s = 0; s < S; s++) {                                                                     \
        for (int kh = 0; kh < HKV; kh++) {                                                            \
            switch (G * 64 + ND) {                                                                    \
                FOR_COMMON_LAYOUTS(ITEM_CASE_##ITEM)                                                  \
                default: ITEM(G, ND, s, kh, q, q_ss, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh,  \
                              block_tables, bt_stride, context_lens, out, o_ss, o_sh, D, BS, qscale); \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
}
#endif

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
#if defined(__AVX512F__)
DEFINE_AVX512_ITEM(item_f32, float, load16_f32, F32_STORE)
DEFINE_AVX512_ITEM(item_bf16, uint16_t, load16_bf16, f32_to_bf16)
#define ITEM_ARGS s, kh, q, q_ss, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh, block_tables, bt_stride, \
                  context_lens, out, o_ss, o_sh, D, BS, qscale
#define ITEM_CASE_item_f32(g, nd) case g * 64 + nd: item_f32(g, nd, ITEM_ARGS); break;
#define ITEM_CASE_item_bf16(g, nd) case g * 64 + nd: item_bf16(g, nd, ITEM_ARGS); break;
#endif
DEFINE_KERNEL(decode_f32_generic, float, F32_LOAD, F32_STORE)
DEFINE_KERNEL(decode_bf16_generic, uint16_t, bf16_to_f32, f32_to_bf16)
#if defined(__AVX512F__)
DEFINE_AVX512_KERNEL(decode_f32_avx512, item_f32, float)
DEFINE_AVX512_KERNEL(decode_bf16_avx512, item_bf16, uint16_t)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#define DEFINE_ENTRY(NAME, T, SUFFIX)                                                                 \
void NAME(const T *q, int64_t q_ss, int64_t q_sh,                                                    \
          const T *k, int64_t k_sb, int64_t k_st, int64_t k_sh,                                      \
          const T *v, int64_t v_sb, int64_t v_st, int64_t v_sh,                                      \
          const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,                \
          T *out, int64_t o_ss, int64_t o_sh,                                                         \
          int S, int H, int HKV, int D, int BS, float scale) {                                        \
    if (HAVE_AVX512 && D % 16 == 0)                                                                   \
        SUFFIX##_avx512_or_generic(q, q_ss, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh,           \
                                   block_tables, bt_stride, context_lens, out, o_ss, o_sh,            \
                                   S, H, HKV, D, BS, scale);                                          \
    else                                                                                              \
        SUFFIX##_generic(q, q_ss, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh,                     \
                         block_tables, bt_stride, context_lens, out, o_ss, o_sh, S, H, HKV, D, BS, scale); \
}
#if HAVE_AVX512
#define decode_f32_avx512_or_generic decode_f32_avx512
#define decode_bf16_avx512_or_generic decode_bf16_avx512
#else
#define decode_f32_avx512_or_generic decode_f32_generic
#define decode_bf16_avx512_or_generic decode_bf16_generic
#endif
DEFINE_ENTRY(paged_decode_attention_f32, float, decode_f32)
DEFINE_ENTRY(paged_decode_attention_bf16, uint16_t, decode_bf16)

/* which == 0: max G, 1: max D, else max block size */
int pdserve_limits(int which) { return which == 0 ? MAX_G : which == 1 ? MAX_D : MAX_BS; }
