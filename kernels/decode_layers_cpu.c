/* Every decoder layer of a CPU step in one call (kernels/decode_layers_cpu.py): decode rows,
 * prefill chunks, or both.
 *
 * At batch 1 a CPU decode step is ~30 layers x ~12 small kernel calls, and each call made
 * from Python (the module call, argument checks, ctypes conversions, a fresh output tensor)
 * costs a few microseconds: about a fifth of the step on a 2-core machine, serial, so the
 * second thread cannot hide it. A step that computes a cached prompt's last few tokens is
 * as small, and paid it twice over (a decode step's 9 ms of CPU against 18.6 on the Python
 * path; benchmarks/probes/cached_tail_step.py). This driver makes the same kernel calls,
 * with the same arguments and in the same order as the model's Python code
 * (services/engine/model.py), so its output is bitwise the same; Python only checks, once
 * per model, that every layer fits.
 */
#include <stddef.h>
#include <stdint.h>

/* the kernels it drives (fused_cpu.c, linear_cpu.c, linear_quant.c, paged_attention_cpu.c) */
int pdserve_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *res, int64_t ldr, const uint16_t *w,
                          uint16_t *out, int64_t ldo, uint16_t *res_out, int64_t ldro, int M, int H, float eps);
int pdserve_rotary_bf16(uint16_t *x, int64_t ldt, int64_t ldh, int T, int H, int D, const int64_t *positions,
                        const float *cos_sin, int64_t ldc);
int pdserve_silu_and_mul_bf16(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int M, int I);
void pdserve_write_kv(const char *k, int64_t k_st, const char *v, int64_t v_st, char *kc, char *vc,
                      int64_t c_sb, int64_t c_so, const int64_t *slots, int T, int row, int block_size,
                      int elem_bytes);
void pdserve_write_kv_int8(const void *k, int64_t k_st, const void *v, int64_t v_st, int src_bf16, int8_t *kc,
                           int8_t *vc, int64_t c_sb, int64_t c_so, const int64_t *slots, int T, int HKV, int D,
                           int block_size);
int pdserve_linear_packed(const void *x, int x_bf16, int64_t ldx, const void *wp, int wkind, const float *scale,
                          const float *bias, void *y, int y_bf16, int64_t ldy, int M, int N, int K);
int pdserve_linear_gguf(const void *x, int x_bf16, int64_t ldx, const uint8_t *wp, int kind, void *y, int y_bf16,
                        int64_t ldy, int M, int N, int K);
void paged_decode_attention_bf16(const uint16_t *q, int64_t q_ss, int64_t q_sh, const uint16_t *k, int64_t k_sb,
                                 int64_t k_st, int64_t k_sh, const uint16_t *v, int64_t v_sb, int64_t v_st,
                                 int64_t v_sh, const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *context_lens, uint16_t *out, int64_t o_ss, int64_t o_sh, int S, int H,
                                 int HKV, int D, int BS, float scale);
int paged_decode_attention_bf16_i8kv(const uint16_t *q, int64_t q_ss, int64_t q_sh, const int8_t *k, int64_t k_sb,
                                     int64_t k_st, int64_t k_sh, const int8_t *v, int64_t v_sb, int64_t v_st,
                                     int64_t v_sh, const int32_t *block_tables, int64_t bt_stride,
                                     const int32_t *context_lens, uint16_t *out, int64_t o_ss, int64_t o_sh, int S,
                                     int H, int HKV, int D, int BS, float scale);
int paged_prefill_attention_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, const uint16_t *k, int64_t k_sb,
                                 int64_t k_st, int64_t k_sh, const uint16_t *v, int64_t v_sb, int64_t v_st,
                                 int64_t v_sh, const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *cu_seqlens_q, const int32_t *context_lens, uint16_t *out, int64_t o_st,
                                 int64_t o_sh, int S, int H, int HKV, int D, int BS, float scale);
int paged_prefill_attention_bf16_i8kv(const uint16_t *q, int64_t q_st, int64_t q_sh, const int8_t *k, int64_t k_sb,
                                      int64_t k_st, int64_t k_sh, const int8_t *v, int64_t v_sb, int64_t v_st,
                                      int64_t v_sh, const int32_t *block_tables, int64_t bt_stride,
                                      const int32_t *cu_seqlens_q, const int32_t *context_lens, uint16_t *out,
                                      int64_t o_st, int64_t o_sh, int S, int H, int HKV, int D, int BS, float scale);

/* one projection: a PackedLinear (bf16 or int8 weights, optional bias) or a GGUFLinear (no bias) */
typedef struct {
    int32_t gguf;  /* 0: pdserve_linear_packed, 1: pdserve_linear_gguf */
    int32_t kind;  /* the weight kind of that kernel */
    const void *weight;
    const float *scale; /* int8 packed: per output channel; else NULL */
    const float *bias;  /* packed only; else NULL */
    int32_t n, k;
} pd_linear;

typedef struct {
    const uint16_t *input_norm, *post_norm; /* bf16 RMSNorm weights */
    pd_linear qkv, o, gate_up, down;
    char *k_cache, *v_cache; /* this layer's [blocks, block_size, kv_heads, head_dim] views */
    /* LoRA stacks of qkv, o, gate_up, down (lora_cpu.c): A [S, nseg*R, K], Bt [S, R, N] and their
     * scales (quantized stacks; else NULL); NULL before the engine's first adapter */
    const void *lora_a[4], *lora_bt[4], *lora_as[4], *lora_bs[4];
} pd_layer;

typedef struct {
    int32_t layers, heads, kv_heads, head_dim, hidden, inter, block_size, kv_int8;
    float eps, scale;
    int64_t c_sb, c_st, c_sh; /* the cache views' strides in elements: block, token, head */
    const float *cos_sin;
    int64_t ldc;
    /* this step's adapters: a slot per row (-1: none), the slots' ranks, the stacks' padded rank;
     * lora_idx NULL: no row has one */
    const int32_t *lora_idx, *lora_ranks;
    int32_t lora_rank, lora_fmt; /* the stacks' format: lora_cpu.c's LORA_BF16 / INT8 / INT4 */
} pd_model;

int pdserve_lora(const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int T, int K, int N, const void *A,
                 const void *Bt, int R, int nseg, const int32_t *bounds, const int32_t *idx, const int32_t *ranks,
                 int fmt, const void *a_scale, const void *bt_scale);

/* y += LoRA(x) for projection p of layer L when this step has adapters (the call the model's
 * Python path makes after the same projection: LoRABatch.apply) */
static int lora(const pd_model *m, const pd_layer *L, int p, const uint16_t *x, int64_t ldx, uint16_t *y,
                int64_t ldy, int M, int K, int nseg, const int32_t *bounds) {
    if (!m->lora_idx) return 0;
    return pdserve_lora(x, ldx, y, ldy, M, K, bounds[nseg], L->lora_a[p], L->lora_bt[p], m->lora_rank, nseg, bounds,
                        m->lora_idx, m->lora_ranks, m->lora_fmt, L->lora_as[p], L->lora_bs[p]);
}

static int linear(const pd_linear *l, const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int M) {
    if (l->gguf)
        return pdserve_linear_gguf(x, 1, ldx, (const uint8_t *)l->weight, l->kind, y, 1, ldy, M, l->n, l->k);
    return pdserve_linear_packed(x, 1, ldx, l->weight, l->kind, l->scale, l->bias, y, 1, ldy, M, l->n, l->k);
}

/* One step's rows, as services/engine/attention_metadata.py orders them: ``nd`` decode rows (one
 * query each: block_tables / context_lens), then the prefill chunks of ``pf_seqs`` sequences
 * (rows nd..M-1: pf_block_tables / pf_cu_seqlens_q, offsets from row nd / pf_context_lens). */
typedef struct {
    int32_t nd;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *context_lens;
    int32_t pf_seqs;
    const int32_t *pf_block_tables;
    int64_t pf_bt_stride;
    const int32_t *pf_cu_seqlens_q, *pf_context_lens;
} pd_rows;

/* The attention of layer L over this step's rows, as the model's Attention.forward calls it: the
 * decode kernel on the decode rows, the prefill kernel on the rest. */
static int attention(const pd_model *m, const pd_layer *L, const pd_rows *r, int M, const uint16_t *q,
                     int64_t ld_qkv, uint16_t *attn) {
    const int D = m->head_dim, q_size = m->heads * D;
    const int64_t sb = m->c_sb, st = m->c_st, sh = m->c_sh;
    int rc = 0;
    if (r->nd && m->kv_int8)
        rc = paged_decode_attention_bf16_i8kv(q, ld_qkv, D, (const int8_t *)L->k_cache, sb, st, sh,
                                              (const int8_t *)L->v_cache, sb, st, sh, r->block_tables, r->bt_stride,
                                              r->context_lens, attn, q_size, D, r->nd, m->heads, m->kv_heads, D,
                                              m->block_size, m->scale);
    else if (r->nd)
        paged_decode_attention_bf16(q, ld_qkv, D, (const uint16_t *)L->k_cache, sb, st, sh,
                                    (const uint16_t *)L->v_cache, sb, st, sh, r->block_tables, r->bt_stride,
                                    r->context_lens, attn, q_size, D, r->nd, m->heads, m->kv_heads, D, m->block_size,
                                    m->scale);
    if (rc || r->nd == M) return rc;
    const uint16_t *pq = q + (int64_t)r->nd * ld_qkv;
    uint16_t *po = attn + (int64_t)r->nd * q_size;
    if (m->kv_int8)
        return paged_prefill_attention_bf16_i8kv(pq, ld_qkv, D, (const int8_t *)L->k_cache, sb, st, sh,
                                                 (const int8_t *)L->v_cache, sb, st, sh, r->pf_block_tables,
                                                 r->pf_bt_stride, r->pf_cu_seqlens_q, r->pf_context_lens, po, q_size,
                                                 D, r->pf_seqs, m->heads, m->kv_heads, D, m->block_size, m->scale);
    return paged_prefill_attention_bf16(pq, ld_qkv, D, (const uint16_t *)L->k_cache, sb, st, sh,
                                        (const uint16_t *)L->v_cache, sb, st, sh, r->pf_block_tables, r->pf_bt_stride,
                                        r->pf_cu_seqlens_q, r->pf_context_lens, po, q_size, D, r->pf_seqs, m->heads,
                                        m->kv_heads, D, m->block_size, m->scale);
}

/* x: [M, hidden] the embeddings; on return, the hidden states after the final RMSNorm
 * (``final_norm``), as LlamaForCausalLM.forward returns them. Scratch (bf16, row-major):
 * res [M, hidden], h [M, hidden], qkv [M, q + 2 kv], attn [M, heads * head_dim],
 * gu [M, 2 inter], act [M, inter]. Returns 0, or the first kernel's error code (the prefill
 * attention's -1: no memory for its work list). */
int pdserve_decode_layers(const pd_model *m, const pd_layer *layers, const uint16_t *final_norm, int M,
                          uint16_t *x, const int64_t *positions, const int64_t *slots, const pd_rows *rows,
                          uint16_t *res, uint16_t *h, uint16_t *qkv, uint16_t *attn, uint16_t *gu, uint16_t *act) {
    const int H = m->hidden, D = m->head_dim, q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t ld_qkv = q_size + 2 * kv_size;
    const int32_t b_qkv[4] = {0, q_size, q_size + kv_size, q_size + 2 * kv_size}, b_h[2] = {0, H},
                  b_gu[3] = {0, m->inter, 2 * m->inter};
    int rc;
    for (int i = 0; i < m->layers; i++) {
        const pd_layer *L = &layers[i];
        /* the input norm: layer 0 starts the residual stream, the others add to it (x: the
         * previous layer's MLP output) */
        if (i == 0) {
            for (int64_t j = 0; j < (int64_t)M * H; j++) res[j] = x[j];
            rc = pdserve_rms_norm_bf16(x, H, NULL, 0, L->input_norm, h, H, NULL, H, M, H, m->eps);
        } else {
            rc = pdserve_rms_norm_bf16(x, H, res, H, L->input_norm, h, H, res, H, M, H, m->eps);
        }
        if (rc) return rc;
        if ((rc = linear(&L->qkv, h, H, qkv, ld_qkv, M))) return rc;
        if ((rc = lora(m, L, 0, h, H, qkv, ld_qkv, M, H, 3, b_qkv))) return rc;
        uint16_t *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;
        if ((rc = pdserve_rotary_bf16(q, ld_qkv, D, M, m->heads, D, positions, m->cos_sin, m->ldc))) return rc;
        if ((rc = pdserve_rotary_bf16(k, ld_qkv, D, M, m->kv_heads, D, positions, m->cos_sin, m->ldc))) return rc;
        if (m->kv_int8)
            pdserve_write_kv_int8(k, ld_qkv, v, ld_qkv, 1, (int8_t *)L->k_cache, (int8_t *)L->v_cache, m->c_sb,
                                  m->c_st, slots, M, m->kv_heads, D, m->block_size);
        else
            pdserve_write_kv((const char *)k, ld_qkv, (const char *)v, ld_qkv, L->k_cache, L->v_cache, m->c_sb,
                             m->c_st, slots, M, kv_size, m->block_size, 2);
        if ((rc = attention(m, L, rows, M, q, ld_qkv, attn))) return rc;
        if ((rc = linear(&L->o, attn, q_size, x, H, M))) return rc;
        if ((rc = lora(m, L, 1, attn, q_size, x, H, M, q_size, 1, b_h))) return rc;
        if ((rc = pdserve_rms_norm_bf16(x, H, res, H, L->post_norm, h, H, res, H, M, H, m->eps))) return rc;
        if ((rc = linear(&L->gate_up, h, H, gu, 2 * m->inter, M))) return rc;
        if ((rc = lora(m, L, 2, h, H, gu, 2 * m->inter, M, H, 2, b_gu))) return rc;
        if ((rc = pdserve_silu_and_mul_bf16(gu, 2 * m->inter, act, m->inter, M, m->inter))) return rc;
        if ((rc = linear(&L->down, act, m->inter, x, H, M))) return rc;
        if ((rc = lora(m, L, 3, act, m->inter, x, H, M, m->inter, 1, b_h))) return rc;
    }
    return pdserve_rms_norm_bf16(x, H, res, H, final_norm, x, H, res, H, M, H, m->eps);
}
