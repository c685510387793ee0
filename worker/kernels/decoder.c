/* Every decoder layer of a Llama-family model (float32, bfloat16 or GGUF-quantized weights,
 * computing in float32) for one decode step, in one call.
 *
 * A decode step of SmolLM2-135M is 30 layers x ~25 small operations; driven from Python each
 * costs a few microseconds of dispatch (ctypes argument conversion, tensor allocation, views),
 * ~6 ms of a 29 ms one-token step on the 2-core EPYC here. This runs the same operations, the
 * same kernels (included below), in a C loop. Only steps whose sequences all feed one token
 * come here: prefill chunks, where the arithmetic dwarfs the dispatch, stay in Python.
 *
 * Per layer (as worker/models/llama.py does it):
 *   first layer: residual = x;  h = rmsnorm(x)       later: residual += h;  h = rmsnorm(residual)
 *   qkv = h Wqkv^T (+b); rotate q, k; store k, v in the cache; attend over the cache
 *   residual += attn Wo^T;  h = rmsnorm(residual);  h = down(silu(gate) * up)
 * The caller applies the final norm (residual += h; rmsnorm) to the rows it samples from.
 */
#include "layer_ops.c"
#include "paged_decode_attention.c"
#include "quant_linear.c" /* (includes packed_linear.c) */

#include <stdlib.h>

/* One projection's weight: packed float32 or bfloat16 panels (packed_linear.c's layout), or
 * rows of GGUF blocks (quant_linear.c) of a GGML type. */
enum { PROJ_F32 = 0, PROJ_BF16 = 1 }; /* otherwise: the GGML type number (>= 2) */

typedef struct Projection {
    int kind;
    const void *w;
    int64_t row_bytes; /* quantized rows */
    const float *bias; /* may be NULL */
    int float_rows;    /* quantized: from this many rows on, the float32 path (0: never) */
    /* A stacked projection (parts in different block formats: StackedQuantLinear): this
     * part's output columns, and the next part, which writes the columns after them. */
    int rows;
    const struct Projection *next;
} Projection;

/* One layer's weights: projections, norms (float32), its KV cache (float32 or, in a bfloat16
 * model, bfloat16). */
typedef struct {
    const float *input_norm, *post_norm;
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
} LayerWeights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} ModelDims;

/* y = x W^T (+ bias); 0, or the quantized kernel's error. Quantized projections take the
 * integer or float32 path by row count exactly as QuantLinear.forward does, so a sequence's
 * numbers do not depend on which path (this one or Python's) ran its step. */
static int linear_part(const Projection *p, const float *x, int64_t ldx, float *y,
                       int64_t ldy, int M, int N, int K) {
    if (p->kind == PROJ_F32) {
        loom_linear_f32(x, ldx, p->w, p->bias, y, ldy, M, N, K);
        return 0;
    }
    if (p->kind == PROJ_BF16) {
        loom_linear_bf16(x, ldx, p->w, p->bias, y, ldy, M, N, K);
        return 0;
    }
    if (p->float_rows > 0 && M >= p->float_rows)
        return loom_quant_linear_f32(p->kind, x, ldx, p->w, p->row_bytes, p->bias, y, ldy, M, N,
                                     K);
    return loom_quant_linear(p->kind, x, ldx, p->w, p->row_bytes, p->bias, y, ldy, M, N, K);
}

static int linear(const Projection *p, const float *x, int64_t ldx, float *y, int64_t ldy,
                  int M, int N, int K) {
    for (; p->next; p = p->next) {
        int rc = linear_part(p, x, ldx, y, ldy, M, p->rows, K);
        if (rc)
            return rc;
        y += p->rows;
        N -= p->rows;
    }
    return linear_part(p, x, ldx, y, ldy, M, N, K);
}

/* x [T, hidden] in: the embeddings; out: the last layer's MLP output. residual [T, hidden] out.
 * positions, slots [T]; block_tables [T, max_blocks]; seq_lens [T] (tokens to attend to,
 * this one included). bf16: the cache is bfloat16 (activations stay float32).
 * Returns 0, or non-zero if scratch memory could not be had (or a projection failed). */
int loom_decode_layers(const LayerWeights *layers, int num_layers, const ModelDims *d, int bf16,
                       float *x, float *residual, int T, const int64_t *positions,
                       const float *cos_table, const float *sin_table, const int64_t *slots,
                       const int32_t *block_tables, const int32_t *seq_lens, int max_blocks) {
    const int q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
    const int qkv_width = q_size + 2 * kv_size;
    float *h = malloc(sizeof(float) * (size_t)T * d->hidden);
    float *qkv = malloc(sizeof(float) * (size_t)T * qkv_width);
    float *q = malloc(sizeof(float) * (size_t)T * q_size);
    float *attn = malloc(sizeof(float) * (size_t)T * q_size);
    float *gate_up = malloc(sizeof(float) * (size_t)T * 2 * d->intermediate);
    float *act = malloc(sizeof(float) * (size_t)T * d->intermediate);
    int rc = 0;
    if (!h || !qkv || !q || !attn || !gate_up || !act) {
        rc = -1;
        goto done;
    }
    for (int i = 0; i < num_layers; i++) {
        const LayerWeights *L = &layers[i];
        if (i == 0) {
            memcpy(residual, x, sizeof(float) * (size_t)T * d->hidden);
            loom_rms_norm(x, d->hidden, L->input_norm, h, T, d->hidden, d->eps);
        } else {
            loom_add_rms_norm(residual, x, L->input_norm, h, T, d->hidden, d->eps);
        }
        if ((rc = linear(&L->qkv, h, d->hidden, qkv, qkv_width, T, qkv_width, d->hidden)))
            goto done;
        if (bf16)
            loom_rope_store_kv_bf16(qkv, T, d->heads, d->kv_heads, d->head_dim, positions,
                                    cos_table, sin_table, L->k_cache, L->v_cache, slots);
        else
            loom_rope_store_kv(qkv, T, d->heads, d->kv_heads, d->head_dim, positions,
                               cos_table, sin_table, L->k_cache, L->v_cache, slots);
        for (int t = 0; t < T; t++)
            memcpy(q + (int64_t)t * q_size, qkv + (int64_t)t * qkv_width, sizeof(float) * q_size);
        rc = bf16 ? paged_decode_attention_bf16(q, L->k_cache, L->v_cache, block_tables,
                                                seq_lens, attn, T, d->heads, d->kv_heads,
                                                d->head_dim, d->block_size, max_blocks, d->scale)
                  : paged_decode_attention_f32(q, L->k_cache, L->v_cache, block_tables,
                                               seq_lens, attn, T, d->heads, d->kv_heads,
                                               d->head_dim, d->block_size, max_blocks, d->scale);
        if (rc != 0)
            goto done;
        if ((rc = linear(&L->o, attn, q_size, x, d->hidden, T, d->hidden, q_size)))
            goto done;
        loom_add_rms_norm(residual, x, L->post_norm, h, T, d->hidden, d->eps);
        if ((rc = linear(&L->gate_up, h, d->hidden, gate_up, 2 * d->intermediate, T,
                         2 * d->intermediate, d->hidden)))
            goto done;
        loom_silu_mul(gate_up, act, T, d->intermediate);
        if ((rc = linear(&L->down, act, d->intermediate, x, d->hidden, T, d->hidden,
                         d->intermediate)))
            goto done;
    }
done:
    free(h);
    free(qkv);
    free(q);
    free(attn);
    free(gate_up);
    free(act);
    return rc;
}
