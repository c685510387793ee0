/* Causal attention of prompt chunks over the paged KV cache (float32 or bfloat16; queries and
 * arithmetic float32), flash-attention style.
 *
 * PyTorch's path gathered every sequence's blocks into a padded tensor and ran SDPA with a
 * boolean mask: it computed the masked half of every causal product too, and was 15% of a
 * 512-token prefill step of SmolLM2-135M. Here each task is a tile of TQ query rows of one
 * sequence, for all the query heads that share one kv head; it walks the sequence's KV blocks
 * up to the tile's last position, in place, with an online softmax (running max and sum per
 * row), so nothing is gathered and nothing above the diagonal is computed.
 *
 * The step's own K/V are already in the cache (written with the rotary embedding), so fresh
 * prompts and later chunks of a prompt take the same path.
 *
 * Per key block, scores are computed key-parallel (K transposed into a [head_dim][block]
 * scratch, one broadcast q element times a row of keys per FMA), then V is accumulated
 * dimension-parallel: no horizontal sums in either product.
 *
 * A bfloat16 cache is widened block by block into float32 scratch.
 *
 * Layout: q rows `q_stride` floats apart, each [heads][head_dim]; k/v cache
 * [num_blocks, block_size, kv_heads, head_dim]; out [rows][heads][head_dim] contiguous.
 * Sequence s owns query rows first_rows[s] .. + q_lens[s], at positions
 * seq_lens[s] - q_lens[s] .., and its blocks are block_tables[s][..].
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TQ 16        /* query rows per task */
#define BS 16        /* keys per block: the kernel handles the default block size */
#define MAX_DIM 256  /* largest head_dim handled (a multiple of 8) */
#define MAX_GROUP 16 /* most query heads per kv head handled (m and l below are on the stack) */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) (*(const v8u *)(p))
#define STORE(p, x) (*(v8u *)(p) = (x))

int loom_prefill_attention_limits(int block_size, int head_dim, int heads, int kv_heads) {
    return block_size == BS && head_dim % 8 == 0 && head_dim <= MAX_DIM && kv_heads > 0 &&
           heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* mask ? a : b, lane by lane (C has no vector ?:) */
static inline v8 select_v8(v8i mask, v8 a, v8 b) {
    return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* e^x for x <= 0 (Cephes' expf: 2^n times a degree-6 polynomial, ~1e-7 relative error),
 * eight at a time: a scalar expf per score was most of the kernel's time. */
static inline v8 exp_v8(v8 x) {
    x = select_v8(x < -87.f, (v8){0} - 87.f, x);
    const v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 n = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);
    n -= (v8)((v8i)(v8){1, 1, 1, 1, 1, 1, 1, 1} & (n > fx)); /* floor */
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.f;
    const v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
    return y * (v8)e;
}

/* One query vector against one block of BS keys (K transposed: kt[d][BS]), then its weights
 * into the output accumulator o[D] (D/8 vectors, kept in registers when D is a constant). */
static inline __attribute__((always_inline)) void attend_block(
        const int D, const float *restrict qv, const float *restrict kt,
        const float *restrict v_rows, const int64_t v_stride, const int first,
        const int visible, float *restrict m, float *restrict l, float *restrict o) {
    /* Four partial sums per half: one chain of dependent FMAs would wait out each one's
     * latency (head_dim is a multiple of 8). */
    v8 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c0 = {0}, c1 = {0}, e0 = {0}, e1 = {0};
    for (int d = 0; d < D; d += 4) {
        a0 += qv[d] * LOAD(kt + d * BS);
        a1 += qv[d] * LOAD(kt + d * BS + 8);
        b0 += qv[d + 1] * LOAD(kt + (d + 1) * BS);
        b1 += qv[d + 1] * LOAD(kt + (d + 1) * BS + 8);
        c0 += qv[d + 2] * LOAD(kt + (d + 2) * BS);
        c1 += qv[d + 2] * LOAD(kt + (d + 2) * BS + 8);
        e0 += qv[d + 3] * LOAD(kt + (d + 3) * BS);
        e1 += qv[d + 3] * LOAD(kt + (d + 3) * BS + 8);
    }
    v8 s0 = (a0 + b0) + (c0 + e0), s1 = (a1 + b1) + (c1 + e1);
    const v8 index0 = {0, 1, 2, 3, 4, 5, 6, 7}, index1 = index0 + 8;
    const v8 limit = (v8){0} + (float)visible, start = (v8){0} + (float)first;
    const v8i in0 = (index0 < limit) & (index0 >= start), in1 = (index1 < limit) & (index1 >= start);
    const v8 lowest = (v8){0} - FLT_MAX;
    s0 = select_v8(in0, s0, lowest);
    s1 = select_v8(in1, s1, lowest);
    const v8 top = select_v8(s0 > s1, s0, s1);
    float block_max = top[0];
    for (int j = 1; j < 8; j++) block_max = top[j] > block_max ? top[j] : block_max;
    const float new_max = block_max > *m ? block_max : *m;
    /* (no exp of -inf: -ffast-math assumes finite values) */
    const float correction = *m == -FLT_MAX ? 0.f : expf(*m - new_max);
    const v8 p0 = select_v8(in0, exp_v8(s0 - new_max), (v8){0});
    const v8 p1 = select_v8(in1, exp_v8(s1 - new_max), (v8){0});
    const v8 both = p0 + p1;
    float sum = 0.f;
    for (int j = 0; j < 8; j++) sum += both[j];
    float p[BS];
    STORE(p, p0);
    STORE(p + 8, p1);
    v8 acc[MAX_DIM / 8];
    for (int c = 0; c < D / 8; c++) acc[c] = LOAD(o + 8 * c) * correction;
    for (int j = first; j < visible; j++) {
        const float *vr = v_rows + j * v_stride;
        for (int c = 0; c < D / 8; c++) acc[c] += p[j] * LOAD(vr + 8 * c);
    }
    for (int c = 0; c < D / 8; c++) STORE(o + 8 * c, acc[c]);
    *l = *l * correction + sum;
    *m = new_max;
}

static inline float prefill_bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Element i of a float32 (bf16 == 0) or bfloat16 cache, as float32. */
static inline float cache_at(const void *cache, int bf16, int64_t i) {
    return bf16 ? prefill_bf16_to_f32(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

/* Returns 0, or -1 (nothing written) if its scratch memory could not be had. */
static int prefill_tile(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                int bf16, const int32_t *table, int row0, int pos0, int rows, int kv_head,
                int group, int heads, int kv_heads, int head_dim, int window, float scale,
                float *out) {
    const int nq = rows * group; /* query vectors of this tile: (row, head in the group) */
    const int64_t kv_row = (int64_t)kv_heads * head_dim;
    float qs[TQ * 8 * MAX_DIM / 8]; /* up to TQ rows x 8 heads per kv head */
    float *qbuf = nq * head_dim <= (int)(sizeof qs / sizeof *qs)
                      ? qs : malloc(sizeof(float) * (size_t)nq * head_dim);
    float *acc = calloc((size_t)nq * head_dim, sizeof(float));
    if (!qbuf || !acc) {
        if (qbuf != qs) free(qbuf);
        free(acc);
        return -1;
    }
    float m[TQ * MAX_GROUP], l[TQ * MAX_GROUP];
    float kt[MAX_DIM * BS]; /* the K block, transposed: [head_dim][BS] */
    float vf[BS * MAX_DIM]; /* a bfloat16 V block, widened: [BS][head_dim] */
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < group; g++) {
            const float *src = q + (int64_t)(row0 + r) * q_stride +
                               (int64_t)(kv_head * group + g) * head_dim;
            float *dst = qbuf + (int64_t)(r * group + g) * head_dim;
            for (int d = 0; d < head_dim; d++) dst[d] = src[d] * scale;
            m[r * group + g] = -FLT_MAX;
            l[r * group + g] = 0.f;
        }
    const int last_pos = pos0 + rows - 1;
    /* a sliding window: the tile's first row sees keys from pos0 - window + 1 on, and the
     * blocks before that one are not read */
    const int first_pos = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
    for (int b = first_pos / BS; b * BS <= last_pos; b++) {
        const int64_t base = (int64_t)table[b] * BS;
        const int first_key = b * BS;
        const int keys = last_pos - first_key + 1 < BS ? last_pos - first_key + 1 : BS;
        for (int j = 0; j < BS; j++) {
            const int64_t k = (base + (j < keys ? j : 0)) * kv_row + (int64_t)kv_head * head_dim;
            for (int d = 0; d < head_dim; d++) kt[d * BS + j] = cache_at(k_cache, bf16, k + d);
        }
        const int64_t v0 = base * kv_row + (int64_t)kv_head * head_dim;
        if (bf16)
            for (int j = 0; j < keys; j++)
                for (int d = 0; d < head_dim; d++)
                    vf[j * head_dim + d] = cache_at(v_cache, 1, v0 + j * kv_row + d);
        const float *v_rows = bf16 ? vf : (const float *)v_cache + v0;
        const int64_t v_stride = bf16 ? head_dim : kv_row;
        for (int v = 0; v < nq; v++) {
            const int pos = pos0 + v / group;
            const int visible = pos - first_key + 1 < keys ? pos - first_key + 1 : keys;
            const int first = window > 0 && pos - window + 1 - first_key > 0
                                  ? pos - window + 1 - first_key : 0;
            if (visible <= first) continue;
            const float *qv = qbuf + (int64_t)v * head_dim;
            float *o = acc + (int64_t)v * head_dim;
            if (head_dim == 64)
                attend_block(64, qv, kt, v_rows, v_stride, first, visible, &m[v], &l[v], o);
            else if (head_dim == 128)
                attend_block(128, qv, kt, v_rows, v_stride, first, visible, &m[v], &l[v], o);
            else
                attend_block(head_dim, qv, kt, v_rows, v_stride, first, visible, &m[v], &l[v],
                             o);
        }
    }
    for (int v = 0; v < nq; v++) {
        const int r = v / group, g = v % group;
        float *dst = out + ((int64_t)(row0 + r) * heads + kv_head * group + g) * head_dim;
        const float inv = 1.f / l[v];
        for (int d = 0; d < head_dim; d++) dst[d] = acc[(int64_t)v * head_dim + d] * inv;
    }
    if (qbuf != qs) free(qbuf);
    free(acc);
    return 0;
}

/* The work for a team of threads already running (orphaned worksharing: decoder.c's one
 * region a step runs in), ending with the team's barrier; a failed allocation sets *failed.
 * loom_prefill_attention runs it in a region of its own. */
static void prefill_attention_team(const float *q, int64_t q_stride, const void *k_cache,
                                   const void *v_cache, int bf16, const int32_t *block_tables,
                                   int max_blocks, const int32_t *seq_lens,
                                   const int32_t *q_lens, const int32_t *first_rows,
                                   int num_seqs, int heads, int kv_heads, int head_dim,
                                   int block_size, int window, float scale, float *out,
                                   int *failed_out) {
    (void)block_size;
    const int group = heads / kv_heads;
    /* Tasks: (sequence, query tile, kv head), longest tiles (latest rows) first; each thread
     * lists them alike (a few ints). Tiles of TQ rows, or of TQ / 2 where that leaves fewer
     * than 4 tasks a thread: a 48-row chunk of Gemma 3's one kv head is 3 tasks of 16 rows
     * (one thread of two idle a third of the time), 6 of 8 (its fused mixed step, 16
     * decodes beside, alternated: 73.0 -> 70.2 ms, 8 rounds of 8 faster; again 71.9 -> 71.1,
     * 6 of 8). Tiles cover each row's keys as far as the tile's last row, masked past its
     * own: the same numbers. */
    int tq = TQ, tasks = 0;
    for (int s = 0; s < num_seqs; s++) tasks += (q_lens[s] + tq - 1) / tq * kv_heads;
    if (tasks < 4 * omp_get_num_threads()) {
        tq = TQ / 2;
        tasks = 0;
        for (int s = 0; s < num_seqs; s++) tasks += (q_lens[s] + tq - 1) / tq * kv_heads;
    }
    int *task_seq = malloc(sizeof(int) * (size_t)(tasks ? tasks : 1));
    int *task_tile = malloc(sizeof(int) * (size_t)(tasks ? tasks : 1));
    int failed = !task_seq || !task_tile;
    if (!failed) {
        int n = 0;
        for (int s = 0; s < num_seqs; s++)
            for (int t = (q_lens[s] + tq - 1) / tq - 1; t >= 0; t--)
                for (int h = 0; h < kv_heads; h++) {
                    task_seq[n] = s;
                    task_tile[n++] = t * kv_heads + h;
                }
    }
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < tasks; i++) {
        if (!task_seq || !task_tile) {
            failed = 1;
            continue;
        }
        const int s = task_seq[i], t = task_tile[i] / kv_heads, h = task_tile[i] % kv_heads;
        const int start = seq_lens[s] - q_lens[s];
        const int rows = q_lens[s] - t * tq < tq ? q_lens[s] - t * tq : tq;
        if (prefill_tile(q, q_stride, k_cache, v_cache, bf16,
                         block_tables + (int64_t)s * max_blocks, first_rows[s] + t * tq,
                         start + t * tq, rows, h, group, heads, kv_heads, head_dim, window,
                         scale, out) != 0)
            failed = 1;
    }
    free(task_seq);
    free(task_tile);
    if (failed) {
#pragma omp atomic write
        *failed_out = 1;
    }
}

/* bf16: the cache is bfloat16 (q and out are float32 either way). window > 0: each query at
 * position p sees only keys p - window < k <= p (a sliding-window layer), 0: all before it.
 * Returns 0, or -1 if scratch
 * memory could not be had (the caller fails the step). The block tables and lengths are
 * trusted: the worker checks them against the cache every step (worker/model_runner.py). */
int loom_prefill_attention(const float *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int bf16, const int32_t *block_tables,
                           int max_blocks, const int32_t *seq_lens, const int32_t *q_lens,
                           const int32_t *first_rows, int num_seqs, int heads, int kv_heads,
                           int head_dim, int block_size, int window, float scale, float *out) {
    int failed = 0;
#pragma omp parallel
    prefill_attention_team(q, q_stride, k_cache, v_cache, bf16, block_tables, max_blocks,
                           seq_lens, q_lens, first_rows, num_seqs, heads, kv_heads, head_dim,
                           block_size, window, scale, out, &failed);
    return failed ? -1 : 0;
}
