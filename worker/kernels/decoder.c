/* Every decoder layer of a model of the Llama family (Llama, Mistral, Qwen2, Qwen3) or Gemma 3
 * (float32, bfloat16 or GGUF-quantized weights, computing in float32) for one step, in one
 * call: decodes, and prompt chunks beside them or alone (StepAttention).
 *
 * A decode step of SmolLM2-135M is 30 layers x ~25 small operations; driven from Python each
 * costs a few microseconds of dispatch (ctypes argument conversion, tensor allocation, views),
 * a fifth of a one-token step on a small CPU (docs/performance.md). This runs the same operations, the
 * same kernels (included below), in a C loop. With prompt chunks the arithmetic is larger
 * but so is the Python path's overhead (each kernel its own parallel region): a step of 16
 * decodes and a 48-token chunk of Gemma 3 270M Q4_K_M, alternated, 90.7 -> 70.8 ms.
 *
 * Per layer (as worker/models/llama.py and gemma3.py do it; [..]: where the layer has it):
 *   first layer: residual = x;  h = rmsnorm(x)       later: residual += x;  h = rmsnorm(residual)
 *   qkv = h Wqkv^T (+b); [q, k = rmsnorm per head (Qwen3, Gemma 3)]; rotate q, k with the
 *   layer's tables; store k, v in the cache; attend over the cache [its last `window` tokens]
 *   x = attn Wo^T; [x = rmsnorm(x) (Gemma 3)]; residual += x;  h = rmsnorm(residual)
 *   x = down(act(gate) * up), act SiLU or GELU-tanh; [x = rmsnorm(x) (Gemma 3)]
 * The caller applies the final norm (residual += x; rmsnorm) to the rows it samples from.
 * Norm weights come as the factor they multiply by (Gemma's 1 + w formed by the caller).
 */
#include "layer_ops.c"
#include "paged_decode_attention.c"
#include "paged_prefill_attention.c"
#include "quant_linear.c" /* (includes packed_linear.c) */
#include "lora.c"

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

/* One layer's weights: projections, norms (float32; NULL: the layer has none there), its KV
 * cache (float32 or, in a bfloat16 model, bfloat16), its rotary tables and window, and the
 * LoRA adapters of its qkv, o, gate_up and down projections. */
typedef struct {
    const float *input_norm, *mlp_norm;
    const float *attn_out_norm, *mlp_out_norm; /* Gemma 3's post-attention / -feedforward */
    const float *q_norm, *k_norm;              /* per head (Qwen3, Gemma 3) */
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache;              /* [num_blocks, block_size, kv_heads, head_dim] */
    const float *cos_table, *sin_table;   /* [positions, head_dim] */
    int window;                           /* attend to the last `window` tokens; 0: all */
    LoRAWeights lora[4];
} LayerWeights;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, block_size, act;
    float eps, scale;
} ModelDims;

/* Who attends how in a step (worker/attention.py's groups): `decodes` rows with one query
 * each (the decode kernel; rows `decode_rows`, or NULL: rows 0 .. decodes), and `prefills`
 * prompt chunks (the prefill kernel; their rows from first_rows, q_lens each). The same two
 * kernels as the Python path's groups, so a row's numbers do not depend on the path. */
typedef struct {
    int decodes;
    const int32_t *decode_rows;
    const int32_t *decode_tables, *decode_seq_lens;
    int decode_max_blocks;
    int prefills;
    const int32_t *prefill_tables, *prefill_seq_lens, *prefill_q_lens, *prefill_first_rows;
    int prefill_max_blocks;
} StepAttention;

/* LOOM_DECODE_PROFILE (a build of its own: bench/decode_breakdown.py) adds up the first
 * thread's CPU time in each part of a layer, each part ending at the team's barrier (so with
 * more threads a part's time includes the wait for the slowest). */
#if defined(LOOM_DECODE_PROFILE)
#include <time.h>
enum { PART_NORM, PART_QKV, PART_ROPE_KV, PART_ATTENTION, PART_O, PART_POST_ATTN_NORM,
       PART_GATE_UP, PART_ACT, PART_DOWN, PART_COUNT };
static double profile_seconds[PART_COUNT], profile_last;
static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define PROFILE_START() _Pragma("omp master") profile_last = cpu_now()
#define PROFILE_MARK(part)                                                                  \
    _Pragma("omp master") {                                                                 \
        const double now_ = cpu_now();                                                      \
        profile_seconds[part] += now_ - profile_last;                                       \
        profile_last = now_;                                                                \
    }
/* The seconds of each part since the last call (PART_COUNT of them, in the enum's order),
 * then zeroed. Returns PART_COUNT. */
int loom_decode_profile(double *out) {
    for (int i = 0; i < PART_COUNT; i++) {
        out[i] = profile_seconds[i];
        profile_seconds[i] = 0.0;
    }
    return PART_COUNT;
}
#else
#define PROFILE_START()
#define PROFILE_MARK(part)
#endif

/* x = rmsnorm(x) * w for one row, through `tmp` (norm_row's arguments must not alias). */
static void norm_in_place(float *x, const float *w, float *tmp, int dim, float eps) {
    norm_row(x, w, tmp, dim, eps);
    memcpy(x, tmp, sizeof(float) * (size_t)dim);
}

/* y = x W^T (+ bias) by the team running the step (the kernels' _team forms: orphaned
 * worksharing that ends with the team's barrier). Quantized projections take the integer or
 * float32 path by row count exactly as QuantLinear.forward does, so a sequence's numbers do
 * not depend on which path (this one or Python's) ran its step. `mem`: the integer path's
 * scratch, shared by the team. */
static void linear_part(const Projection *p, const float *x, int64_t ldx, float *y, int64_t ldy,
                        int M, int N, int K, char *mem, int threads, int *failed) {
    if (p->kind == PROJ_F32)
        loom_linear_f32_team(x, ldx, p->w, p->bias, y, ldy, M, N, K, threads);
    else if (p->kind == PROJ_BF16)
        loom_linear_bf16_team(x, ldx, p->w, p->bias, y, ldy, M, N, K, threads);
    else if (p->float_rows > 0 && M >= p->float_rows)
        ql_linear_f32_team(p->kind, x, ldx, p->w, p->row_bytes, p->bias, y, ldy, M, N, K,
                           failed);
    else
        ql_linear_team(p->kind, x, ldx, p->w, p->row_bytes, p->bias, y, ldy, M, N, K, mem,
                       threads);
}

static void linear(const Projection *p, const float *x, int64_t ldx, float *y, int64_t ldy,
                   int M, int N, int K, char *mem, int threads, int *failed) {
    for (; p->next; p = p->next) { /* a stack: each part writes its own columns */
        linear_part(p, x, ldx, y, ldy, M, p->rows, K, mem, threads, failed);
        y += p->rows;
        N -= p->rows;
    }
    linear_part(p, x, ldx, y, ldy, M, N, K, mem, threads, failed);
}

/* Whether every quantized part of p has a kernel here for inputs of K. */
static int projection_ok(const Projection *p, int K) {
    for (; p; p = p->next)
        if (p->kind > PROJ_BF16 &&
            (ql_kernel_for(p->kind) == NULL || K % (32 * ql_subblocks(p->kind)) != 0))
            return 0;
    return 1;
}

/* x [T, hidden] in: the embeddings, or with `embedding` (a quantized table's rows: kind, w,
 * row_bytes, rows = its row count) the rows ids[T] of it, looked up here by the function
 * QuantEmbedding's lookup calls (an id outside the table: -3, nothing run); out: the last layer's MLP output, or with final_norm
 * (its factors, [hidden]) the model's final norm of it: rmsnorm(residual + x), the rows the
 * output layer reads (the same function as the Python path's norm: the same numbers, and a
 * step's Python calls fewer). residual [T, hidden] out.
 * positions, slots [T]; block_tables [T, max_blocks]; seq_lens [T] (tokens to attend to,
 * this one included). bf16: the cache is bfloat16 (activations stay float32).
 *
 * One parallel region for the whole step: its ~150 operations are worksharing loops of one
 * team, each ending at a barrier (a spinning wait of a microsecond or so), instead of ~150
 * parallel regions, each a fork/join that woke the other threads. Element-wise operations
 * are split by rows (at one row, one thread does them while the others wait at the barrier).
 * Returns 0, -1 for a projection without a kernel, or -2 if scratch memory could not be had
 * (or an attention or float32-path buffer could not). */
int loom_decode_layers(const LayerWeights *layers, int num_layers, const ModelDims *d, int bf16,
                       float *x, float *residual, int T, const int64_t *positions,
                       const int64_t *slots, const StepAttention *att,
                       const int32_t *lora_slots, int lora_rank, const float *final_norm,
                       const Projection *embedding, const int64_t *ids) {
    const int hidden = d->hidden, inter = d->intermediate;
    const int q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
    const int qkv_width = q_size + 2 * kv_size;
    if (embedding) {
        for (int t = 0; t < T; t++)
            if (ids[t] < 0 || ids[t] >= embedding->rows)
                return -3;
        if (loom_quant_dequantize_rows(embedding->kind, embedding->w, embedding->row_bytes, ids,
                                       T, hidden, x) != 0)
            return -1;
    }
    for (int i = 0; i < num_layers; i++) {
        const LayerWeights *L = &layers[i];
        if (!projection_ok(&L->qkv, hidden) || !projection_ok(&L->o, q_size) ||
            !projection_ok(&L->gate_up, hidden) || !projection_ok(&L->down, inter))
            return -1;
    }
    int widest = hidden > q_size ? hidden : q_size;
    widest = widest > inter ? widest : inter;
    float *h = malloc(sizeof(float) * (size_t)T * hidden);
    float *qkv = malloc(sizeof(float) * (size_t)T * qkv_width);
    float *q = malloc(sizeof(float) * (size_t)T * q_size);
    float *attn = malloc(sizeof(float) * (size_t)T * q_size);
    float *gate_up = malloc(sizeof(float) * (size_t)T * 2 * inter);
    float *act = malloc(sizeof(float) * (size_t)T * inter);
    /* The decode kernel reads its rows' queries from q, by decode index (q_row[t]: row t's
     * place there, -1: a chunk's row, which the prefill kernel reads from qkv). Decode rows
     * not at the step's first rows are gathered so, and their output scattered back from
     * dec_out. */
    const int gathered = att->decodes > 0 && att->decode_rows != NULL;
    int *q_row = malloc(sizeof(int) * (size_t)(T ? T : 1));
    float *dec_out = gathered ? malloc(sizeof(float) * (size_t)att->decodes * q_size) : NULL;
    if (q_row) {
        for (int t = 0; t < T; t++) q_row[t] = !gathered && t < att->decodes ? t : -1;
        if (gathered)
            for (int i = 0; i < att->decodes; i++) q_row[att->decode_rows[i]] = i;
    }
    LoRAGroups *lg = lora_rank > 0 && lora_slots ? lora_groups(lora_slots, T) : NULL;
    const int head_dim = d->head_dim;
    char *mem = ql_scratch_for(ql_acts_bytes(T, widest));
    int failed = 0;
    if (!h || !qkv || !q || !attn || !gate_up || !act || !mem || !q_row ||
        (gathered && !dec_out) ||
        (lora_rank > 0 && lora_slots && !lg)) {
        failed = 1;
        goto done;
    }
#pragma omp parallel
    {
        const int threads = omp_get_num_threads();
        PROFILE_START();
        for (int i = 0; i < num_layers; i++) {
            const LayerWeights *L = &layers[i];
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *xt = x + (int64_t)t * hidden, *rt = residual + (int64_t)t * hidden;
                if (i == 0) {
                    memcpy(rt, xt, sizeof(float) * (size_t)hidden);
                    norm_row(xt, L->input_norm, h + (int64_t)t * hidden, hidden, d->eps);
                } else {
                    add_norm_row(rt, xt, L->input_norm, h + (int64_t)t * hidden, hidden, d->eps);
                }
            }
            PROFILE_MARK(PART_NORM);
            linear(&L->qkv, h, hidden, qkv, qkv_width, T, qkv_width, hidden, mem, threads,
                   &failed);
            lora_add(&L->lora[0], lg, h, hidden, qkv, qkv_width, qkv_width, hidden);
            PROFILE_MARK(PART_QKV);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *row = qkv + (int64_t)t * qkv_width;
                if (L->q_norm) {
                    float tmp[head_dim];
                    for (int j = 0; j < d->heads; j++)
                        norm_in_place(row + (int64_t)j * head_dim, L->q_norm, tmp, head_dim,
                                      d->eps);
                    for (int j = 0; j < d->kv_heads; j++)
                        norm_in_place(row + q_size + (int64_t)j * head_dim, L->k_norm, tmp,
                                      head_dim, d->eps);
                }
                if (bf16)
                    loom_rope_store_kv_bf16_row(row, d->heads, d->kv_heads, head_dim,
                                                positions[t], L->cos_table, L->sin_table,
                                                L->k_cache, L->v_cache, slots[t]);
                else
                    loom_rope_store_kv_row(row, d->heads, d->kv_heads, head_dim, positions[t],
                                           L->cos_table, L->sin_table, L->k_cache, L->v_cache,
                                           slots[t]);
                if (q_row[t] >= 0)
                    memcpy(q + (int64_t)q_row[t] * q_size, row, sizeof(float) * q_size);
            }
            PROFILE_MARK(PART_ROPE_KV);
            float *dec_attn = gathered ? dec_out : attn;
            if (att->decodes > 0 && bf16)
                paged_decode_attention_bf16_team(q, L->k_cache, L->v_cache, att->decode_tables,
                                                 att->decode_seq_lens, dec_attn, att->decodes,
                                                 d->heads, d->kv_heads, head_dim,
                                                 d->block_size, att->decode_max_blocks,
                                                 L->window, d->scale, threads, &failed);
            else if (att->decodes > 0)
                paged_decode_attention_f32_team(q, L->k_cache, L->v_cache, att->decode_tables,
                                                att->decode_seq_lens, dec_attn, att->decodes,
                                                d->heads, d->kv_heads, head_dim,
                                                d->block_size, att->decode_max_blocks,
                                                L->window, d->scale, threads, &failed);
            if (att->prefills > 0) /* (rotated q in place in qkv: its rows, strided) */
                prefill_attention_team(qkv, qkv_width, L->k_cache, L->v_cache, bf16,
                                       att->prefill_tables, att->prefill_max_blocks,
                                       att->prefill_seq_lens, att->prefill_q_lens,
                                       att->prefill_first_rows, att->prefills, d->heads,
                                       d->kv_heads, head_dim, d->block_size, L->window,
                                       d->scale, attn, &failed);
            if (gathered) {
#pragma omp for schedule(static)
                for (int i = 0; i < att->decodes; i++)
                    memcpy(attn + (int64_t)att->decode_rows[i] * q_size,
                           dec_out + (int64_t)i * q_size, sizeof(float) * q_size);
            }
            PROFILE_MARK(PART_ATTENTION);
            linear(&L->o, attn, q_size, x, hidden, T, hidden, q_size, mem, threads, &failed);
            lora_add(&L->lora[1], lg, attn, q_size, x, hidden, hidden, q_size);
            PROFILE_MARK(PART_O);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *xt = x + (int64_t)t * hidden, *ht = h + (int64_t)t * hidden;
                const float *delta = xt;
                if (L->attn_out_norm) { /* normed into h, then added: h is free here */
                    norm_row(xt, L->attn_out_norm, ht, hidden, d->eps);
                    delta = ht;
                }
                add_norm_row(residual + (int64_t)t * hidden, delta, L->mlp_norm, ht, hidden,
                             d->eps);
            }
            PROFILE_MARK(PART_POST_ATTN_NORM);
            linear(&L->gate_up, h, hidden, gate_up, 2 * inter, T, 2 * inter, hidden, mem,
                   threads, &failed);
            lora_add(&L->lora[2], lg, h, hidden, gate_up, 2 * inter, 2 * inter, hidden);
            PROFILE_MARK(PART_GATE_UP);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                if (d->act == ACT_GELU_TANH)
                    gelu_tanh_mul_row(gate_up + (int64_t)t * 2 * inter,
                                      act + (int64_t)t * inter, inter);
                else
                    silu_mul_row(gate_up + (int64_t)t * 2 * inter, act + (int64_t)t * inter,
                                 inter);
            }
            PROFILE_MARK(PART_ACT);
            linear(&L->down, act, inter, x, hidden, T, hidden, inter, mem, threads, &failed);
            lora_add(&L->lora[3], lg, act, inter, x, hidden, hidden, inter);
            if (L->mlp_out_norm) {
#pragma omp for schedule(static)
                for (int t = 0; t < T; t++)
                    norm_in_place(x + (int64_t)t * hidden, L->mlp_out_norm,
                                  h + (int64_t)t * hidden, hidden, d->eps);
            }
            PROFILE_MARK(PART_DOWN);
        }
        if (final_norm) {
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *xt = x + (int64_t)t * hidden, *ht = h + (int64_t)t * hidden;
                add_norm_row(residual + (int64_t)t * hidden, xt, final_norm, ht, hidden, d->eps);
                memcpy(xt, ht, sizeof(float) * (size_t)hidden);
            }
        }
    }
done:
    free(h);
    free(qkv);
    free(q);
    free(attn);
    free(gate_up);
    free(act);
    free(q_row);
    free(dec_out);
    free(lg);
    return failed ? -2 : 0;
}
