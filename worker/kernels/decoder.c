/* Every decoder layer of a model of the Llama family (Llama, Mistral, Qwen2, Qwen3) or Gemma 3
 * (float32, bfloat16 or GGUF-quantized weights, computing in float32) for one decode step, in
 * one call.
 *
 * A decode step of SmolLM2-135M is 30 layers x ~25 small operations; driven from Python each
 * costs a few microseconds of dispatch (ctypes argument conversion, tensor allocation, views),
 * a fifth of a one-token step on a small CPU (docs/performance.md). This runs the same operations, the
 * same kernels (included below), in a C loop. Only steps whose sequences all feed one token
 * come here: prefill chunks, where the arithmetic dwarfs the dispatch, stay in Python.
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

/* One projection's LoRA adapters (worker/lora.py), one slot each: a [slots, K, rank] and
 * b [slots, rank, N], float32 or bfloat16 (`dtype`), a fused projection's `parts` side by
 * side (rank / parts columns of a each, zeros where an adapter has a smaller rank or no delta
 * for a part). b is block-diagonal: part p's rows are zero outside columns out_start[p] ..
 * out_start[p + 1], so only those are read. a == NULL: none. */
enum { LORA_F32 = 0, LORA_BF16 = 1 };
typedef struct {
    const void *a, *b;
    int rank, parts, dtype;
    int out_start[4];
} LoRAWeights;
enum { LORA_MAX_SLOTS = 256 }; /* slots beyond are base rows */

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

/* The step's adapter rows grouped by slot (a counting sort of row_slots): group g is slot
 * slot[g], rows order[start[g] .. start[g + 1]). */
typedef struct {
    int groups;
    int slot[LORA_MAX_SLOTS], start[LORA_MAX_SLOTS + 1];
    int order[]; /* [T] */
} LoRAGroups;

static LoRAGroups *lora_groups(const int32_t *row_slots, int T) {
    LoRAGroups *g = malloc(sizeof(LoRAGroups) + sizeof(int) * (size_t)T);
    if (!g)
        return NULL;
    int count[LORA_MAX_SLOTS] = {0};
    for (int t = 0; t < T; t++)
        if (row_slots[t] >= 0 && row_slots[t] < LORA_MAX_SLOTS)
            count[row_slots[t]]++;
    g->groups = 0;
    int at = 0;
    for (int s = 0; s < LORA_MAX_SLOTS; s++) {
        if (!count[s])
            continue;
        g->slot[g->groups] = s;
        g->start[g->groups++] = at;
        for (int t = 0; t < T; t++)
            if (row_slots[t] == s)
                g->order[at++] = t;
    }
    g->start[g->groups] = at;
    return g;
}

/* VLEN adapter weights from p[i] on, widened to float32 (dtype: a constant where inlined). */
ALWAYS_INLINE vec lora_vload(const void *p, int64_t i, const int dtype) {
    if (dtype == LORA_BF16)
        return vload_bf16((const uint16_t *)p + i);
    return vload((const float *)p + i);
}

ALWAYS_INLINE float lora_load(const void *p, int64_t i, const int dtype) {
    if (dtype == LORA_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

/* u[c .. c + NV * VLEN) = x a over those columns, the sums in registers. */
ALWAYS_INLINE void shrink_columns(const void *a, const float *x, int K, int rank, int c,
                                  float *u, const int NV, const int dtype) {
    vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
    for (int j = 0; j < K; j++) {
        const vec xj = vbcast(x + j);
        for (int v = 0; v < NV; v++)
            acc[v] = vfma(xj, lora_vload(a, (int64_t)j * rank + c + v * VLEN, dtype), acc[v]);
    }
    for (int v = 0; v < NV; v++)
        vstore(u + c + v * VLEN, acc[v]);
}

/* y[n .. n + NV * VLEN) += u[k0 .. k1) b over those columns, the sums in registers. */
ALWAYS_INLINE void expand_columns(const void *b, const float *u, int N, int k0, int k1, int n,
                                  float *y, const int NV, const int dtype) {
    vec acc[4];
    for (int v = 0; v < NV; v++)
        acc[v] = vload(y + n + v * VLEN);
    for (int k = k0; k < k1; k++) {
        const vec uk = vbcast(u + k);
        for (int v = 0; v < NV; v++)
            acc[v] = vfma(uk, lora_vload(b, (int64_t)k * N + n + v * VLEN, dtype), acc[v]);
    }
    for (int v = 0; v < NV; v++)
        vstore(y + n + v * VLEN, acc[v]);
}

/* u = x a for one row (a: [K, rank] of one slot), then y += u b (b: [rank, N]), each part's
 * rank columns only over its own output columns. Four vectors of sums at a time stay in
 * registers (the compiler's own vectorization of the plain loops kept them in memory: the
 * deltas cost about twice as much). */
ALWAYS_INLINE void lora_row(const LoRAWeights *l, const void *a, const void *b,
                            const float *x, int K, int N, float *u, float *y, const int dtype) {
    const int rank = l->rank, part_rank = rank / l->parts;
    int c = 0;
    for (; c + 4 * VLEN <= rank; c += 4 * VLEN)
        shrink_columns(a, x, K, rank, c, u, 4, dtype);
    switch ((rank - c) / VLEN) {
    case 3: shrink_columns(a, x, K, rank, c, u, 3, dtype); break;
    case 2: shrink_columns(a, x, K, rank, c, u, 2, dtype); break;
    case 1: shrink_columns(a, x, K, rank, c, u, 1, dtype); break;
    }
    for (c += (rank - c) / VLEN * VLEN; c < rank; c++) {
        float sum = 0.0f;
        for (int j = 0; j < K; j++)
            sum += x[j] * lora_load(a, (int64_t)j * rank + c, dtype);
        u[c] = sum;
    }
    for (int p = 0; p < l->parts; p++) {
        const int k0 = p * part_rank, k1 = k0 + part_rank;
        const int n1 = l->out_start[p + 1];
        int n = l->out_start[p];
        for (; n + 4 * VLEN <= n1; n += 4 * VLEN)
            expand_columns(b, u, N, k0, k1, n, y, 4, dtype);
        for (; n + VLEN <= n1; n += VLEN)
            expand_columns(b, u, N, k0, k1, n, y, 1, dtype);
        for (; n < n1; n++)
            for (int k = k0; k < k1; k++)
                y[n] += u[k] * lora_load(b, (int64_t)k * N + n, dtype);
    }
}

/* y[t] += (x[t] a_s) b_s for each row t of an adapter (slot s), by the team: Punica's
 * BGMV, each row its own adapter. The team splits the rows in slot order, so a thread's rows
 * mostly share one adapter's a and b, read from its cache after the first. One worksharing
 * loop: one barrier per projection (on a busy machine each costs more than the arithmetic).
 * `u`: [T, rank] scratch. */
static void lora_add(const LoRAWeights *l, const LoRAGroups *g, const float *x, int64_t ldx,
                     float *y, int64_t ldy, int N, int K, float *u) {
    if (!l->a || !g)
        return;
    const int rank = l->rank, rows = g->start[g->groups];
    const int64_t elem = l->dtype == LORA_BF16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const int t = g->order[r];
        int gi = 0;
        while (r >= g->start[gi + 1])
            gi++;
        const int64_t slot = g->slot[gi];
        const void *a = (const char *)l->a + slot * K * rank * elem;
        const void *b = (const char *)l->b + slot * rank * N * elem;
        const float *xt = x + (int64_t)t * ldx;
        float *ut = u + (int64_t)t * rank, *yt = y + (int64_t)t * ldy;
        if (l->dtype == LORA_BF16)
            lora_row(l, a, b, xt, K, N, ut, yt, LORA_BF16);
        else
            lora_row(l, a, b, xt, K, N, ut, yt, LORA_F32);
    }
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
                       const int64_t *slots, const int32_t *block_tables,
                       const int32_t *seq_lens, int max_blocks, const int32_t *lora_slots,
                       int lora_rank, const float *final_norm, const Projection *embedding,
                       const int64_t *ids) {
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
    /* lora_rank: the widest of the projections' (0: no adapter rows this step) */
    float *xa = malloc(sizeof(float) * (size_t)T * (lora_rank > 0 ? lora_rank : 1));
    LoRAGroups *lg = lora_rank > 0 && lora_slots ? lora_groups(lora_slots, T) : NULL;
    const int head_dim = d->head_dim;
    char *mem = ql_scratch_for(ql_acts_bytes(T, widest));
    int failed = 0;
    if (!h || !qkv || !q || !attn || !gate_up || !act || !xa || !mem ||
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
                    loom_rms_norm(xt, hidden, L->input_norm, h + (int64_t)t * hidden, 1, hidden,
                                  d->eps);
                } else {
                    loom_add_rms_norm(rt, xt, L->input_norm, h + (int64_t)t * hidden, 1, hidden,
                                      d->eps);
                }
            }
            PROFILE_MARK(PART_NORM);
            linear(&L->qkv, h, hidden, qkv, qkv_width, T, qkv_width, hidden, mem, threads,
                   &failed);
            lora_add(&L->lora[0], lg, h, hidden, qkv, qkv_width, qkv_width, hidden, xa);
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
                    loom_rope_store_kv_bf16(row, 1, d->heads, d->kv_heads, head_dim,
                                            positions + t, L->cos_table, L->sin_table,
                                            L->k_cache, L->v_cache, slots + t);
                else
                    loom_rope_store_kv(row, 1, d->heads, d->kv_heads, head_dim, positions + t,
                                       L->cos_table, L->sin_table, L->k_cache, L->v_cache,
                                       slots + t);
                memcpy(q + (int64_t)t * q_size, row, sizeof(float) * q_size);
            }
            PROFILE_MARK(PART_ROPE_KV);
            if (bf16)
                paged_decode_attention_bf16_team(q, L->k_cache, L->v_cache, block_tables,
                                                 seq_lens, attn, T, d->heads, d->kv_heads,
                                                 head_dim, d->block_size, max_blocks,
                                                 L->window, d->scale, threads, &failed);
            else
                paged_decode_attention_f32_team(q, L->k_cache, L->v_cache, block_tables,
                                                seq_lens, attn, T, d->heads, d->kv_heads,
                                                head_dim, d->block_size, max_blocks,
                                                L->window, d->scale, threads, &failed);
            PROFILE_MARK(PART_ATTENTION);
            linear(&L->o, attn, q_size, x, hidden, T, hidden, q_size, mem, threads, &failed);
            lora_add(&L->lora[1], lg, attn, q_size, x, hidden, hidden, q_size, xa);
            PROFILE_MARK(PART_O);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *xt = x + (int64_t)t * hidden, *ht = h + (int64_t)t * hidden;
                const float *delta = xt;
                if (L->attn_out_norm) { /* normed into h, then added: h is free here */
                    norm_row(xt, L->attn_out_norm, ht, hidden, d->eps);
                    delta = ht;
                }
                loom_add_rms_norm(residual + (int64_t)t * hidden, delta, L->mlp_norm, ht, 1,
                                  hidden, d->eps);
            }
            PROFILE_MARK(PART_POST_ATTN_NORM);
            linear(&L->gate_up, h, hidden, gate_up, 2 * inter, T, 2 * inter, hidden, mem,
                   threads, &failed);
            lora_add(&L->lora[2], lg, h, hidden, gate_up, 2 * inter, 2 * inter, hidden, xa);
            PROFILE_MARK(PART_GATE_UP);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                if (d->act == ACT_GELU_TANH)
                    loom_gelu_tanh_mul(gate_up + (int64_t)t * 2 * inter,
                                       act + (int64_t)t * inter, 1, inter);
                else
                    loom_silu_mul(gate_up + (int64_t)t * 2 * inter, act + (int64_t)t * inter, 1,
                                  inter);
            }
            PROFILE_MARK(PART_ACT);
            linear(&L->down, act, inter, x, hidden, T, hidden, inter, mem, threads, &failed);
            lora_add(&L->lora[3], lg, act, inter, x, hidden, hidden, inter, xa);
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
                loom_add_rms_norm(residual + (int64_t)t * hidden, xt, final_norm, ht, 1, hidden,
                                  d->eps);
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
    free(xa);
    free(lg);
    return failed ? -2 : 0;
}
