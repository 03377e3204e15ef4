/*
 * Paged decode attention for CPU: one query token per sequence, reading K/V in
 * place through the block table (no gather copy), fp32 accumulation, online
 * softmax one block at a time. Built by kernels/native.py with -O3 -march=native
 * -fopenmp; the inner loops over head_dim are plain C that gcc vectorises.
 *
 * Layouts (element strides; the last dim of q, caches and out is contiguous):
 *   q, out   [S, H, D]
 *   k, v     [num_blocks, block_size, HKV, D]  (strided views of the big KV tensor)
 *   block_tables int32 [S, bt_stride], context_lens int32 [S]
 * Work item = (sequence, kv head): its G = H / HKV query heads share every K/V row
 * they read, so each row is loaded from memory once per item.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256
#define MAX_BS 64

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                           \
void NAME(const T *q, int64_t q_ss, int64_t q_sh,                                                    \
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

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_KERNEL(paged_decode_attention_f32, float, F32_LOAD, F32_STORE)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int pdserve_limits(int which) { return which == 0 ? MAX_G : which == 1 ? MAX_D : MAX_BS; }
