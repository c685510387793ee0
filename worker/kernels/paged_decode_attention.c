/* Decode attention over the paged KV cache, reading K/V blocks in place.
 *
 * The portable path gathers every sequence's blocks into a padded tensor first; at batch 32
 * and 300-token contexts that copy moves ~450 MB per step on a machine with ~10 GB/s, more
 * than the weights. Here each sequence is one task that walks its block table directly:
 * pass 1 computes every head's scores, pass 2 accumulates V with the softmax weights. K and
 * V are each read once, whole rows (all kv heads) at a time: a task per (sequence, kv head)
 * read 1/num_kv_heads of each row and was ~20 % slower at batch 16 x 260 tokens. Batches
 * smaller than the thread count still split by kv head so every thread has work.
 *
 * Layout (row-major):
 *   q            [num_seqs, num_heads, head_dim] (float32)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] (float32 or bfloat16)
 *   block_tables [num_seqs, max_blocks] (int32)
 *   seq_lens     [num_seqs] (int32): tokens to attend to, including the newest
 *   window       the last `window` of them only (a sliding-window layer: the blocks out of
 *                reach are not read), or 0: all (the team form takes it; the exported, 0)
 *   out          [num_seqs, num_heads, head_dim] (float32)
 * Returns 0, or -1 if a task's scratch memory could not be had (its rows of `out` are then
 * garbage: the caller fails the step). The indices are trusted: the worker checks every step's
 * block tables and lengths against the cache before any kernel runs (worker/model_runner.py).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* NAME##_team: the work for a team of threads already running (orphaned worksharing, for
 * decoder.c's one parallel region per step); a failed allocation sets *failed. Ends with the
 * team's barrier. NAME runs it in a region of its own. */
#define DEFINE_KERNEL(NAME, T, LOAD)                                                         \
static void NAME##_team(const float *q, const T *k_cache, const T *v_cache,                   \
                        const int32_t *block_tables, const int32_t *seq_lens, float *out,    \
                        int num_seqs, int num_heads, int num_kv_heads, int head_dim,         \
                        int block_size, int max_blocks, int window, float scale,             \
                        int threads, int *failed_out) {                                      \
    const int group = num_heads / num_kv_heads;                                              \
    const int64_t row = (int64_t)num_kv_heads * head_dim;                                    \
    /* Fewer sequences than threads (small batches): split each by query head instead (9   \
     * tasks for SmolLM2's 3 kv heads keep 2 threads busy where 3 tasks left one idle a      \
     * third of the time; each task reads its kv head's rows, from cache after the first). */ \
    const int splits = num_seqs < threads ? num_heads : 1;                                   \
    const int heads_per_task = num_heads / splits;                                           \
    int failed = 0;                                                                          \
    _Pragma("omp for schedule(dynamic, 1)")                                                  \
    for (int task = 0; task < num_seqs * splits; task++) {                                   \
        const int s = task / splits, h0 = (task % splits) * heads_per_task;                  \
        const int end = seq_lens[s];                                                         \
        const int first = window > 0 && end > window ? end - window : 0;                     \
        const int len = end - first;                                                         \
        const int32_t *table = block_tables + (int64_t)s * max_blocks;                       \
        const int nh = heads_per_task;                                                       \
        float *scores = malloc(sizeof(float) * (size_t)nh * (size_t)len);                    \
        float *qf = malloc(sizeof(float) * (size_t)nh * (size_t)head_dim);                   \
        if (!scores || !qf) { /* (no break out of an OpenMP loop: the other tasks finish) */  \
            free(scores);                                                                    \
            free(qf);                                                                        \
            _Pragma("omp atomic write")                                                      \
            failed = 1;                                                                      \
            continue;                                                                        \
        }                                                                                    \
        float *acc = out + ((int64_t)s * num_heads + h0) * head_dim;                         \
        const float *qs = q + ((int64_t)s * num_heads + h0) * head_dim;                      \
        for (int i = 0; i < nh * head_dim; i++) qf[i] = qs[i] * scale;                       \
        for (int t = 0; t < len; t++) {                                                      \
            const int p = first + t;                                                         \
            const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size; \
            const T *krow = k_cache + slot * row;                                            \
            for (int h = 0; h < nh; h++) {                                                   \
                const float *qh = qf + (int64_t)h * head_dim;                                \
                const T *kh = krow + (int64_t)((h0 + h) / group) * head_dim;                 \
                float dot = 0.f;                                                             \
                for (int d = 0; d < head_dim; d++) dot += qh[d] * LOAD(kh[d]);               \
                scores[(int64_t)h * len + t] = dot;                                          \
            }                                                                                \
        }                                                                                    \
        for (int h = 0; h < nh; h++) {                                                       \
            float *sc = scores + (int64_t)h * len;                                           \
            float m = -FLT_MAX, sum = 0.f;                                                   \
            for (int t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;                         \
            for (int t = 0; t < len; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }         \
            const float inv = 1.f / sum;                                                     \
            for (int t = 0; t < len; t++) sc[t] *= inv;                                      \
        }                                                                                    \
        memset(acc, 0, sizeof(float) * (size_t)nh * head_dim);                               \
        for (int t = 0; t < len; t++) {                                                      \
            const int p = first + t;                                                         \
            const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size; \
            const T *vrow = v_cache + slot * row;                                            \
            for (int h = 0; h < nh; h++) {                                                   \
                const float w = scores[(int64_t)h * len + t];                                \
                const T *vh = vrow + (int64_t)((h0 + h) / group) * head_dim;                 \
                float *a = acc + (int64_t)h * head_dim;                                      \
                for (int d = 0; d < head_dim; d++) a[d] += w * LOAD(vh[d]);                  \
            }                                                                                \
        }                                                                                    \
        free(scores);                                                                        \
        free(qf);                                                                            \
    }                                                                                        \
    if (failed) {                                                                            \
        _Pragma("omp atomic write")                                                          \
        *failed_out = 1;                                                                     \
    }                                                                                        \
}                                                                                            \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,       \
         const int32_t *seq_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,  \
         int head_dim, int block_size, int max_blocks, float scale) {                        \
    int failed = 0;                                                                          \
    _Pragma("omp parallel")                                                                  \
    NAME##_team(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads,       \
                num_kv_heads, head_dim, block_size, max_blocks, 0, scale,                    \
                omp_get_num_threads(), &failed);                                             \
    return failed ? -1 : 0;                                                                  \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16)

void loom_set_num_threads(int n) { omp_set_num_threads(n); }
