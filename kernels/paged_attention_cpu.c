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
 * they read, so each row is loaded from memory once per item. A thread takes all of a
 * sequence's items at once when there are enough sequences to go round.
 *
 * Two implementations of the same function:
 *   - AVX-512 (compiled where the build machine has it, used when D % 32 == 0):
 *     positions go in tiles of up to 256. A tile's scores are computed 16 at a
 *     time (16 dot-product vectors summed by one shuffle tree, hsum16), then one
 *     online-softmax update covers the whole tile (vector exp2), then its V rows.
 *     The per-position work is loads, FMAs and a few shuffles; the once-per-tile
 *     work (horizontal max and sum, rescaling) is amortised over 256 positions.
 *     1.5x the previous per-16-position version on SmolLM2's decode steps
 *     (BENCHMARKS.md);
 *   - portable C (every other case), which gcc vectorises where it can.
 * Scores are kept in the log2 domain (q is pre-scaled by scale * log2(e)), so
 * exp(x - m) becomes exp2(x' - m').
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
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
#define TILE 256 /* positions whose scores are computed before one softmax update */

/* 32 consecutive elements of a row as two fp32 vectors. bf16: the even elements and the odd
 * ones (a shift and an and: no shuffle); fp32: the first 16 and the last 16. q, K, V and the
 * accumulators all use this order, so only the output store undoes it. */
static inline __attribute__((always_inline)) void load32(const int bf16, const char *p, __m512 *lo, __m512 *hi) {
    if (bf16) {
        widen32_bf16(p, lo, hi);
    } else {
        *lo = _mm512_loadu_ps((const float *)p);
        *hi = _mm512_loadu_ps((const float *)p + 16);
    }
}

/* 32 int8 of a K/V row (int8 cache: the row's scale is applied elsewhere) in the even/odd split
 * of bf16 rows: sign-extended to 16-bit lanes pairwise, even elements by a shift left then an
 * arithmetic shift right, odd ones by the shift right alone. */
static inline __attribute__((always_inline)) void load32_i8(const char *p, __m512 *even, __m512 *odd) {
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    *even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
    *odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
}

/* a K/V row's 32 elements from p: int8 (kv8) or as the query's dtype */
static inline __attribute__((always_inline)) void load32_kv(const int kv8, const int bf16, const char *p, __m512 *lo,
                                                            __m512 *hi) {
    if (kv8) load32_i8(p, lo, hi); else load32(bf16, p, lo, hi);
}

/* the fp32 scale stored after the D int8 of an int8 cache row */
static inline float row_scale(const char *row, int D) {
    float s;
    memcpy(&s, row + D, 4);
    return s;
}

static inline __attribute__((always_inline)) void store32(const int bf16, char *p, __m512 lo, __m512 hi) {
    if (bf16) {
        _mm512_storeu_si512(p, narrow32_bf16(lo, hi));
    } else {
        _mm512_storeu_ps((float *)p, lo);
        _mm512_storeu_ps((float *)p + 16, hi);
    }
}

/* The sums of 16 vectors as one vector: lane i holds the sum of v[4 * (i % 4) + i / 4] (that
 * map is its own inverse, so position t's vector goes to slot 4 * (t % 4) + t / 4). A tree of
 * 15 merges, two shuffles and an add each, where 16 horizontal sums cost four of each. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 v[16]) {
    __m512 u[8], w[4], z[2];
    for (int j = 0; j < 8; j++)
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)
        z[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

/* Row addresses (bytes) of positions [pos, pos + n), n <= 16, for one kv head. With
 * block_size % 16 == 0 a group of 16 never crosses a block: one table lookup. */
static inline __attribute__((always_inline)) void rows16(
        const char *base, int64_t sb, int64_t st, const int32_t *bt, int BS, int pos, int n, const char **rows) {
    if (BS % 16 == 0) {
        const char *r = base + (int64_t)bt[pos / BS] * sb + (int64_t)(pos % BS) * st;
        for (int t = 0; t < n; t++) rows[t] = r + t * st;
    } else {
        for (int t = 0; t < n; t++) rows[t] = base + (int64_t)bt[(pos + t) / BS] * sb + (int64_t)((pos + t) % BS) * st;
    }
}

/* One (sequence, kv head) item: its G = H / HKV query heads share every K/V row. NP = D / 32.
 * Positions go in tiles of TILE: all scores of a tile (16 at a time, through hsum16), then one
 * online-softmax update, then the tile's V rows. Always inlined into callers that pass
 * compile-time flags, G and NP for the common head layouts, so the query and accumulator
 * vectors live in registers (with runtime bounds they live on the stack: 3x slower).
 * Strides are in bytes. */
static inline __attribute__((always_inline)) void decode_item(
        const int bf16, const int kv8, const int G, const int NP, int s, int kh,
        const char *q, int64_t q_ss, int64_t q_sh,
        const char *k, int64_t k_sb, int64_t k_st, int64_t k_sh,
        const char *v, int64_t v_sb, int64_t v_st, int64_t v_sh,
        const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
        char *out, int64_t o_ss, int64_t o_sh, int BS, float qscale) {
    /* es: bytes per q / out element; kvs: per K/V element (int8 rows end in their fp32 scale) */
    const int es = bf16 ? 2 : 4, kvs = kv8 ? 1 : es, row_bytes = 32 * NP * kvs + (kv8 ? 4 : 0);
    __m512 qv[MAX_G][MAX_D / 16], acc[MAX_G][MAX_D / 16];
    float m[MAX_G], l[MAX_G];
    float sc[MAX_G][TILE] __attribute__((aligned(64)));
    const int ctx = context_lens[s];
    const int32_t *bt = block_tables + s * bt_stride;
    const char *kbase = k + kh * k_sh, *vbase = v + kh * v_sh;
    for (int g = 0; g < G; g++) {
        const char *qp = q + s * q_ss + (int64_t)(kh * G + g) * q_sh;
        for (int i = 0; i < NP; i++) {
            load32(bf16, qp + 32 * i * es, &qv[g][2 * i], &qv[g][2 * i + 1]);
            qv[g][2 * i] = _mm512_mul_ps(qv[g][2 * i], _mm512_set1_ps(qscale));
            qv[g][2 * i + 1] = _mm512_mul_ps(qv[g][2 * i + 1], _mm512_set1_ps(qscale));
        }
        for (int i = 0; i < 2 * NP; i++) acc[g][i] = _mm512_setzero_ps();
        m[g] = -INFINITY; l[g] = 0.f;
    }
    for (int start = 0; start < ctx; start += TILE) {
        const int n = ctx - start < TILE ? ctx - start : TILE;
        __m512 vmax[MAX_G];
        for (int g = 0; g < G; g++) vmax[g] = _mm512_set1_ps(-INFINITY);
        /* scores */
        for (int j = 0; j < n; j += 16) {
            const int nj = n - j < 16 ? n - j : 16;
            const char *kr[16], *vr[16];
            rows16(kbase, k_sb, k_st, bt, BS, start + j, nj, kr);
            /* while this group computes: the next group's K rows into L1, this group's V rows
             * into L2 for the value pass (one core alone does not keep enough misses in flight
             * to reach memory bandwidth otherwise) */
            if (start + j + 16 < ctx) {
                const int nn = ctx - start - j - 16 < 16 ? ctx - start - j - 16 : 16;
                const char *kn[16];
                rows16(kbase, k_sb, k_st, bt, BS, start + j + 16, nn, kn);
                for (int t = 0; t < nn; t++)
                    for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(kn[t] + b, _MM_HINT_T0);
            }
            rows16(vbase, v_sb, v_st, bt, BS, start + j, nj, vr);
            for (int t = 0; t < nj; t++)
                for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(vr[t] + b, _MM_HINT_T1);
            __m512 d[MAX_G][16];
            for (int t = 0; t < 16; t++) {
                const int slot = 4 * (t % 4) + t / 4;
                if (t < nj) {
                    __m512 kf[MAX_D / 16];
                    for (int i = 0; i < NP; i++) load32_kv(kv8, bf16, kr[t] + 32 * i * kvs, &kf[2 * i], &kf[2 * i + 1]);
                    for (int g = 0; g < G; g++) {
                        __m512 x = _mm512_mul_ps(qv[g][0], kf[0]);
                        for (int i = 1; i < 2 * NP; i++) x = _mm512_fmadd_ps(qv[g][i], kf[i], x);
                        d[g][slot] = x;
                    }
                } else {
                    for (int g = 0; g < G; g++) d[g][slot] = _mm512_setzero_ps();
                }
            }
            const __mmask16 live = (__mmask16)((1u << nj) - 1u);
            __m512 kscale = _mm512_set1_ps(1.f);
            if (kv8) { /* lane t of hsum16's result is position t: scale it by K row t's scale */
                float ks[16] __attribute__((aligned(64)));
                for (int t = 0; t < 16; t++) ks[t] = t < nj ? row_scale(kr[t], 32 * NP) : 0.f;
                kscale = _mm512_load_ps(ks);
            }
            for (int g = 0; g < G; g++) {
                const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(hsum16(d[g]), kscale));
                _mm512_store_ps(&sc[g][j], x);
                vmax[g] = _mm512_max_ps(vmax[g], x);
            }
        }
        /* online softmax, once per tile */
        for (int g = 0; g < G; g++) {
            const float tmax = _mm512_reduce_max_ps(vmax[g]);
            const float mnew = tmax > m[g] ? tmax : m[g];
            const float corr = exp2f(m[g] - mnew); /* 0 on the first tile: m = -inf */
            const __m512 mv = _mm512_set1_ps(mnew);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < n; j += 16) { /* masked lanes hold -inf: exp2 gives 0 */
                const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_load_ps(&sc[g][j]), mv));
                _mm512_store_ps(&sc[g][j], p);
                sum = _mm512_add_ps(sum, p);
            }
            l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
            m[g] = mnew;
            const __m512 c = _mm512_set1_ps(corr);
            for (int i = 0; i < 2 * NP; i++) acc[g][i] = _mm512_mul_ps(acc[g][i], c);
        }
        /* values */
        for (int j = 0; j < n; j += 16) {
            const int nj = n - j < 16 ? n - j : 16;
            const char *vr[16];
            rows16(vbase, v_sb, v_st, bt, BS, start + j, nj, vr);
            for (int t = 0; t < nj; t++) {
                __m512 vf[MAX_D / 16];
                for (int i = 0; i < NP; i++) load32_kv(kv8, bf16, vr[t] + 32 * i * kvs, &vf[2 * i], &vf[2 * i + 1]);
                const float vscale = kv8 ? row_scale(vr[t], 32 * NP) : 1.f;
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(sc[g][j + t] * vscale);
                    for (int i = 0; i < 2 * NP; i++) acc[g][i] = _mm512_fmadd_ps(p, vf[i], acc[g][i]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++) {
        char *op = out + s * o_ss + (int64_t)(kh * G + g) * o_sh;
        const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);
        for (int i = 0; i < NP; i++)
            store32(bf16, op + 32 * i * es, _mm512_mul_ps(acc[g][2 * i], inv), _mm512_mul_ps(acc[g][2 * i + 1], inv));
    }
}

/* (G, NP) pairs with a specialised item: the layouts of the supported model families
 * (G = query heads per KV head, NP = head_dim / 32); others run the generic item. */
#define FOR_COMMON_LAYOUTS(X) X(1, 2) X(2, 2) X(3, 2) X(4, 2) X(5, 2) X(7, 2) X(8, 2) \
                              X(1, 4) X(2, 4) X(4, 4) X(6, 4) X(7, 4) X(8, 4)

/* One sequence per task (its kv heads share cache lines), or one (sequence, kv head) when
 * there are too few sequences to keep every thread busy. */
#define DEFINE_AVX512_KERNEL(NAME, T, KVT, BF16, KV8)                                                 \
static void NAME(const T *q, int64_t q_ss, int64_t q_sh,                                             \
                 const KVT *k, int64_t k_sb, int64_t k_st, int64_t k_sh,                             \
                 const KVT *v, int64_t v_sb, int64_t v_st, int64_t v_sh,                             \
                 const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,         \
                 T *out, int64_t o_ss, int64_t o_sh,                                                  \
                 int S, int H, int HKV, int D, int BS, float scale) {                                 \
    const int G = H / HKV, NP = D / 32, es = sizeof(T), kvs = sizeof(KVT), bf16 = BF16, kv8 = KV8;             \
    const float qscale = scale * LOG2E;                                                               \
    const int per = S >= 4 * omp_get_max_threads() ? HKV : 1; /* kv heads per task */                \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                  \
    for (int task = 0; task < S * HKV / per; task++) {                                                \
        for (int item = task * per; item < (task + 1) * per; item++) {                                \
            const int s = item / HKV, kh = item % HKV;                                                \
            switch (G * 64 + NP) {                                                                    \
                FOR_COMMON_LAYOUTS(ITEM_CASE)                                                         \
                default: decode_item(bf16, kv8, G, NP, ITEM_ARGS); break;                             \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
}
#define ITEM_ARGS s, kh, (const char *)q, q_ss * es, q_sh * es, (const char *)k, k_sb * kvs, k_st * kvs, k_sh * kvs, \
                  (const char *)v, v_sb * kvs, v_st * kvs, v_sh * kvs, block_tables, bt_stride, context_lens,      \
                  (char *)out, o_ss * es, o_sh * es, BS, qscale
#define ITEM_CASE(g, np) case g * 64 + np: decode_item(bf16, kv8, g, np, ITEM_ARGS); break;
#endif

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
#if defined(__AVX512F__)
#endif
DEFINE_KERNEL(decode_f32_generic, float, F32_LOAD, F32_STORE)
DEFINE_KERNEL(decode_bf16_generic, uint16_t, bf16_to_f32, f32_to_bf16)
#if defined(__AVX512F__)
DEFINE_AVX512_KERNEL(decode_f32_avx512, float, float, 0, 0)
DEFINE_AVX512_KERNEL(decode_bf16_avx512, uint16_t, uint16_t, 1, 0)
DEFINE_AVX512_KERNEL(decode_bf16_i8kv_avx512, uint16_t, int8_t, 1, 1)
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
    if (HAVE_AVX512 && D % 32 == 0)                                                                   \
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

/* bf16 queries over an int8 cache (rows of D int8 + their fp32 scale; strides in bytes).
 * Returns -2 where not compiled in (no AVX-512) or D % 32 != 0: the caller uses the reference. */
int paged_decode_attention_bf16_i8kv(const uint16_t *q, int64_t q_ss, int64_t q_sh,
                                     const int8_t *k, int64_t k_sb, int64_t k_st, int64_t k_sh,
                                     const int8_t *v, int64_t v_sb, int64_t v_st, int64_t v_sh,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                                     uint16_t *out, int64_t o_ss, int64_t o_sh,
                                     int S, int H, int HKV, int D, int BS, float scale) {
#if HAVE_AVX512
    if (D % 32) return -2;
    decode_bf16_i8kv_avx512(q, q_ss, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh, block_tables, bt_stride,
                            context_lens, out, o_ss, o_sh, S, H, HKV, D, BS, scale);
    return 0;
#else
    (void)q; (void)q_ss; (void)q_sh; (void)k; (void)k_sb; (void)k_st; (void)k_sh; (void)v; (void)v_sb; (void)v_st;
    (void)v_sh; (void)block_tables; (void)bt_stride; (void)context_lens; (void)out; (void)o_ss; (void)o_sh; (void)S;
    (void)H; (void)HKV; (void)D; (void)BS; (void)scale;
    return -2;
#endif
}

/* which == 0: max G, 1: max D, else max block size */
int pdserve_limits(int which) { return which == 0 ? MAX_G : which == 1 ? MAX_D : MAX_BS; }

/*
 * Paged prefill attention: sequence s's q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s] queries
 * are the last q_len of its context_lens[s] tokens; query i sees the keys up to its own
 * position. q, out: [T, H, D] (token stride, head stride; D contiguous).
 *
 * Work item = (sequence, kv head, block of QB queries). Its R = QB * G rows (query i, head g
 * as row i * G + g; R <= 32) sit in the lanes of two vectors, so every softmax quantity (row
 * max, sum, rescale) is elementwise: no horizontal reduction anywhere. Keys go 16 at a time:
 *     S^T[key][rows] = sum_d K[key][d] * Q^T[d][rows]     (a K element broadcast, 2 FMAs)
 *     O^T[d][rows]  += sum_key V[key][d] * P^T[key][rows]  (a V element broadcast, 2 FMAs)
 * with K and V rows widened to fp32 once per tile and Q^T, O^T in per-item buffers.
 * The torch path (gather, then fp32 flash SDPA) ran at ~58 GFLOP/s here.
 */
#define PF_ROWS 32
/* Returns 0, -1 when out of memory, -2 where not compiled in (no AVX-512). Needs
 * H % HKV == 0, H / HKV <= PF_ROWS, D % 16 == 0, D <= MAX_D (the Python side checks). */
#define PREFILL_SIGNATURE(NAME, T, KVT)                                                                \
int NAME(const T *q, int64_t q_st, int64_t q_sh,                                                       \
         const KVT *k, int64_t k_sb, int64_t k_st, int64_t k_sh,                                      \
         const KVT *v, int64_t v_sb, int64_t v_st, int64_t v_sh,                                      \
         const int32_t *block_tables, int64_t bt_stride, const int32_t *cu_seqlens_q,                  \
         const int32_t *context_lens, T *out, int64_t o_st, int64_t o_sh,                              \
         int S, int H, int HKV, int D, int BS, float scale)
#if defined(__AVX512F__)

static inline __attribute__((always_inline)) void widen_row(const int bf16, const int kv8, const char *src, float *dst,
                                                             int D) {
    if (kv8) { /* int8 row, then its fp32 scale */
        const __m512 sc = _mm512_set1_ps(row_scale(src, D));
        for (int d = 0; d < D; d += 16)
            _mm512_store_ps(dst + d, _mm512_mul_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                           _mm_loadu_si128((const __m128i *)(src + d))))));
        return;
    }
    for (int d = 0; d < D; d += 16)
        _mm512_store_ps(dst + d, bf16 ? load16_bf16((const uint16_t *)src + d) : _mm512_loadu_ps((const float *)src + d));
}

static inline __attribute__((always_inline)) void prefill_item(
        const int bf16, const int kv8, const int D, int G, int q0, int nq, int qpos0, int kh,
        const char *q, int64_t q_st, int64_t q_sh,
        const char *k, int64_t k_sb, int64_t k_st, int64_t k_sh,
        const char *v, int64_t v_sb, int64_t v_st, int64_t v_sh,
        const int32_t *bt, char *out, int64_t o_st, int64_t o_sh, int BS, float qscale) {
    const int R = nq * G;
    float qt[MAX_D][PF_ROWS] __attribute__((aligned(64)));
    float ot[MAX_D][PF_ROWS] __attribute__((aligned(64)));
    float kf[16][MAX_D] __attribute__((aligned(64)));
    float vf[16][MAX_D] __attribute__((aligned(64)));
    __m512 p[16][2];
    /* Q^T, scaled into the log2 domain; lanes past R are zero */
    for (int d = 0; d < D; d++) {
        _mm512_store_ps(qt[d], _mm512_setzero_ps());
        _mm512_store_ps(qt[d] + 16, _mm512_setzero_ps());
        _mm512_store_ps(ot[d], _mm512_setzero_ps());
        _mm512_store_ps(ot[d] + 16, _mm512_setzero_ps());
    }
    for (int r = 0; r < R; r++) {
        const char *qp = q + (int64_t)(q0 + r / G) * q_st + (int64_t)(kh * G + r % G) * q_sh;
        for (int d = 0; d < D; d++)
            qt[d][r] = (bf16 ? bf16_to_f32(((const uint16_t *)qp)[d]) : ((const float *)qp)[d]) * qscale;
    }
    /* each row's position; padding lanes see every key (finite scores, never written out) */
    int32_t pos[PF_ROWS] __attribute__((aligned(64)));
    for (int r = 0; r < PF_ROWS; r++) pos[r] = r < R ? qpos0 + r / G : 1 << 30;
    const __m512i pos0 = _mm512_load_si512(pos), pos1 = _mm512_load_si512(pos + 16);
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, l0 = _mm512_setzero_ps(), l1 = l0;
    const int last = qpos0 + nq - 1; /* the last key any row sees */
    for (int start = 0; start <= last; start += 16) {
        const int n = last + 1 - start < 16 ? last + 1 - start : 16;
        const char *kr[16], *vr[16];
        rows16(k + kh * k_sh, k_sb, k_st, bt, BS, start, n, kr);
        rows16(v + kh * v_sh, v_sb, v_st, bt, BS, start, n, vr);
        for (int t = 0; t < n; t++) widen_row(bf16, kv8, kr[t], kf[t], D);
        for (int t = n; t < 16; t++) memset(kf[t], 0, D * sizeof(float));
        /* S^T, 8 keys at a time: 16 accumulators */
        for (int t0 = 0; t0 < 16; t0 += 8) {
            __m512 a[8][2];
            for (int t = 0; t < 8; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
            for (int d = 0; d < D; d++) {
                const __m512 x0 = _mm512_load_ps(qt[d]), x1 = _mm512_load_ps(qt[d] + 16);
                for (int t = 0; t < 8; t++) {
                    const __m512 b = _mm512_set1_ps(kf[t0 + t][d]);
                    a[t][0] = _mm512_fmadd_ps(b, x0, a[t][0]);
                    a[t][1] = _mm512_fmadd_ps(b, x1, a[t][1]);
                }
            }
            for (int t = 0; t < 8; t++) { p[t0 + t][0] = a[t][0]; p[t0 + t][1] = a[t][1]; }
        }
        /* causal mask (keys past the tile's end are masked for every row), new running max */
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 t0max = m0, t1max = m1;
        for (int t = 0; t < 16; t++) {
            const __m512i kp = _mm512_set1_epi32(t < n ? start + t : 1 << 30 | 1);
            p[t][0] = _mm512_mask_mov_ps(ninf, _mm512_cmp_epi32_mask(kp, pos0, _MM_CMPINT_LE), p[t][0]);
            p[t][1] = _mm512_mask_mov_ps(ninf, _mm512_cmp_epi32_mask(kp, pos1, _MM_CMPINT_LE), p[t][1]);
            t0max = _mm512_max_ps(t0max, p[t][0]);
            t1max = _mm512_max_ps(t1max, p[t][1]);
        }
        const __m512 c0 = exp2_ps(_mm512_sub_ps(m0, t0max)), c1 = exp2_ps(_mm512_sub_ps(m1, t1max));
        m0 = t0max; m1 = t1max;
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int t = 0; t < 16; t++) {
            p[t][0] = exp2_ps(_mm512_sub_ps(p[t][0], m0));
            p[t][1] = exp2_ps(_mm512_sub_ps(p[t][1], m1));
            s0 = _mm512_add_ps(s0, p[t][0]);
            s1 = _mm512_add_ps(s1, p[t][1]);
        }
        l0 = _mm512_fmadd_ps(l0, c0, s0);
        l1 = _mm512_fmadd_ps(l1, c1, s1);
        for (int t = 0; t < n; t++) widen_row(bf16, kv8, vr[t], vf[t], D);
        /* O^T = O^T * c + V^T P^T, 8 dims at a time */
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m512 a[8][2];
            for (int i = 0; i < 8; i++) {
                a[i][0] = _mm512_mul_ps(_mm512_load_ps(ot[d0 + i]), c0);
                a[i][1] = _mm512_mul_ps(_mm512_load_ps(ot[d0 + i] + 16), c1);
            }
            for (int t = 0; t < n; t++)
                for (int i = 0; i < 8; i++) {
                    const __m512 b = _mm512_set1_ps(vf[t][d0 + i]);
                    a[i][0] = _mm512_fmadd_ps(b, p[t][0], a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(b, p[t][1], a[i][1]);
                }
            for (int i = 0; i < 8; i++) {
                _mm512_store_ps(ot[d0 + i], a[i][0]);
                _mm512_store_ps(ot[d0 + i] + 16, a[i][1]);
            }
        }
    }
    float inv[PF_ROWS] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l0));
    _mm512_store_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.f), l1));
    for (int r = 0; r < R; r++) {
        char *op = out + (int64_t)(q0 + r / G) * o_st + (int64_t)(kh * G + r % G) * o_sh;
        for (int d = 0; d < D; d++) {
            const float x = ot[d][r] * inv[r];
            if (bf16) ((uint16_t *)op)[d] = f32_to_bf16(x); else ((float *)op)[d] = x;
        }
    }
}

#define DEFINE_PREFILL(NAME, T, KVT, BF16, KV8)                                                        \
PREFILL_SIGNATURE(NAME, T, KVT) {                                                                      \
    const int G = H / HKV, QB = PF_ROWS / G, es = sizeof(T), kvs = sizeof(KVT);                        \
    int n = 0;                                                                                         \
    for (int s = 0; s < S; s++) n += (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + QB - 1) / QB;            \
    int *items = malloc(2 * sizeof(int) * (size_t)(n > 0 ? n : 1));                                    \
    if (!items) return -1;                                                                             \
    /* query blocks end-aligned, the last (which see the most keys) first: a short block, if \
     * any, is a sequence's first */                                                                   \
    n = 0;                                                                                             \
    for (int s = 0; s < S; s++)                                                                        \
        for (int q0 = cu_seqlens_q[s + 1] - QB; q0 > cu_seqlens_q[s] - QB; q0 -= QB) {                 \
            items[2 * n] = s; items[2 * n + 1] = q0 > cu_seqlens_q[s] ? q0 : cu_seqlens_q[s]; n++;     \
        }                                                                                              \
    const float qscale = scale * LOG2E;                                                                \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                   \
    for (int it = 0; it < n * HKV; it++) {                                                             \
        const int s = items[2 * (it / HKV)], q0 = items[2 * (it / HKV) + 1], kh = it % HKV;            \
        const int qs = cu_seqlens_q[s], qe = cu_seqlens_q[s + 1];                                      \
        const int nq = q0 == qs && (qe - qs) % QB ? (qe - qs) % QB : QB;                               \
        const int qpos0 = context_lens[s] - (qe - qs) + (q0 - qs);                                     \
        const int32_t *bt = block_tables + s * bt_stride;                                              \
        switch (D) { /* compile-time head sizes for the common models */                              \
            case 64: PREFILL_CALL(BF16, KV8, 64); break;                                               \
            case 128: PREFILL_CALL(BF16, KV8, 128); break;                                             \
            default: PREFILL_CALL(BF16, KV8, D); break;                                                \
        }                                                                                              \
    }                                                                                                  \
    free(items);                                                                                       \
    return 0;                                                                                          \
}
#define PREFILL_CALL(BF16, KV8, DD) prefill_item(BF16, KV8, DD, G, q0, nq, qpos0, kh, (const char *)q, q_st * es,  \
        q_sh * es, (const char *)k, k_sb * kvs, k_st * kvs, k_sh * kvs, (const char *)v, v_sb * kvs, v_st * kvs,   \
        v_sh * kvs, bt, (char *)out, o_st * es, o_sh * es, BS, qscale)
DEFINE_PREFILL(paged_prefill_attention_f32, float, float, 0, 0)
DEFINE_PREFILL(paged_prefill_attention_bf16, uint16_t, uint16_t, 1, 0)
/* bf16 queries over an int8 cache (as paged_decode_attention_bf16_i8kv) */
DEFINE_PREFILL(paged_prefill_attention_bf16_i8kv, uint16_t, int8_t, 1, 1)
#else
#define PREFILL_STUB(NAME, T, KVT) PREFILL_SIGNATURE(NAME, T, KVT) { return -2; }
PREFILL_STUB(paged_prefill_attention_f32, float, float)
PREFILL_STUB(paged_prefill_attention_bf16, uint16_t, uint16_t)
PREFILL_STUB(paged_prefill_attention_bf16_i8kv, uint16_t, int8_t)
#endif
