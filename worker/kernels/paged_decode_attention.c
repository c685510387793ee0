/* Decode attention over the paged KV cache, reading K/V blocks in place.
 *
 * The portable path gathers every sequence's blocks into a padded tensor first; at batch 32
 * and 300-token contexts that copy moves ~450 MB per step on a machine with ~10 GB/s, more
 * than the weights. Here each task walks a sequence's block table directly, a chunk of
 * positions at a time (see CHUNK_POSITIONS): the chunk's scores for every head (K read once,
 * whole rows: all kv heads at a time; a task per (sequence, kv head) read 1/num_kv_heads of
 * each row and was ~20 % slower at batch 16 x 260 tokens), then its V rows accumulated with
 * the weights, 16 positions at a time (their rows stay in L1 while each kv head's sums pass
 * over them).
 *
 * Rows of one sequence at consecutive positions (the proposals a speculative verify step
 * checks, each a row over the same blocks: worker/model_runner.py, rows_as_decodes) are one
 * task: each kv head's K vector is scored against that group's query heads of every row at
 * once, and each 8 values of a V row are added into up to 6 of those queries' sums held in
 * registers (a task per row read the sequence's K/V from the caches once per row, and a
 * 6-row verify step's attention cost 3x a one-token step's). A row's arithmetic is the same
 * code alone and among others (each score one chain of FMAs over the head's 8-lane chunks,
 * then its lanes summed in a fixed tree; each output value summed over the tokens in order,
 * a token past the row's end adding an exact 0 * v; the same chunks), so its numbers do not
 * depend on its company: greedy output is the same with and without speculation.
 *
 * Layout (row-major):
 *   q            [num_seqs, num_heads, head_dim] (float32)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] (float32 or bfloat16)
 *   block_tables [num_seqs, max_blocks] (int32)
 *   seq_lens     [num_seqs] (int32): tokens to attend to, including the newest
 *   window       the last `window` of them only (a sliding-window layer: the blocks out of
 *                reach are not read), or 0: all
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_AVX2 1
#endif
#define ATTN_INLINE static inline __attribute__((always_inline))
/* K/V rows are prefetched into L2 (prefetcht2), not L1. A prefetch into L1 holds one of the
 * core's few L1 miss buffers until its line arrives, so a burst of them (a K row is 12 lines
 * here, and 8 rows' K and V go out at once) stalls the loop as demand misses would; into L2
 * the loop runs on and its loads then hit L2. Measured on a 2-core AVX-512 EPYC (Zen 4), 30
 * layers' K/V cold (`python -m bench.decode_attention`), 2 threads: 1.25-1.35x faster at
 * batch 1 x 2048 tokens and batch 16 x 256 than L1 for K and the V pass (docs/performance.md).
 * LOOM_KERNEL_CFLAGS=-DATTN_PREFETCH_LOCALITY=3 builds the L1 form to compare. */
#ifndef ATTN_PREFETCH_LOCALITY
#define ATTN_PREFETCH_LOCALITY 1
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Rows r and r + 1 read the same K/V, r + 1 one token further (a verify step's rows). */
static int same_run(const int32_t *block_tables, const int32_t *seq_lens, int max_blocks,
                    int r) {
    return seq_lens[r + 1] == seq_lens[r] + 1 &&
           memcmp(block_tables + (int64_t)r * max_blocks,
                  block_tables + (int64_t)(r + 1) * max_blocks,
                  sizeof(int32_t) * (size_t)max_blocks) == 0;
}

/* Scores of W queries (1..4; a constant where inlined) against the K vectors of 1 or 2
 * tokens (k[0], k[1]): out[j][tok] = q[j] . k[tok]. AVX2: each score one chain of FMAs over the
 * 8-value chunks, its lanes summed as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)); 2
 * tokens at a time keep 8 chains going. */
ATTN_INLINE void score_tile(const int W, const int tokens, const float *const *k,
                            const float *const *q, float *const *out, int head_dim) {
#if defined(ATTN_AVX2)
    if (head_dim % 8 == 0) {
        __m256 acc[2][4];
        for (int u = 0; u < 2; u++)
            for (int j = 0; j < 4; j++) acc[u][j] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 8)
            for (int u = 0; u < tokens; u++) {
                const __m256 kv = _mm256_loadu_ps(k[u] + d);
                for (int j = 0; j < W; j++)
                    acc[u][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[j] + d), kv, acc[u][j]);
            }
        for (int u = 0; u < tokens; u++) {
            const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[u][0], acc[u][1]),
                                            _mm256_hadd_ps(acc[u][2], acc[u][3]));
            float r[4];
            _mm_storeu_ps(r, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
            for (int j = 0; j < W; j++) out[j][u] = r[j];
        }
        return;
    }
#endif
    for (int u = 0; u < tokens; u++)
        for (int j = 0; j < W; j++) {
            float dot = 0.f;
            for (int d = 0; d < head_dim; d++) dot += q[j][d] * k[u][d];
            out[j][u] = dot;
        }
}

static void score_tile_any(int W, int tokens, const float *const *k, const float *const *q,
                           float *const *out, int head_dim) {
#define ATTN_SCORE_CASE(w)                                                                   \
    case w:                                                                                  \
        if (tokens == 2)                                                                     \
            score_tile(w, 2, k, q, out, head_dim);                                           \
        else                                                                                 \
            score_tile(w, 1, k, q, out, head_dim);                                           \
        break;
    switch (W) {
    ATTN_SCORE_CASE(1)
    ATTN_SCORE_CASE(2)
    ATTN_SCORE_CASE(3)
    default: ATTN_SCORE_CASE(4)
    }
}

/* One query's scores against the K vectors of 8 tokens, out[0 .. 8) (contiguous): the same
 * arithmetic per score as score_tile (one chain of FMAs over the 8-value chunks, its lanes
 * summed in the same tree), the 8 trees done side by side and stored as one vector: fewer
 * shuffles and stores per score than score_tile's 4 queries x 2 tokens (a verify step's 18
 * queries per kv head: its scores ~1.1x faster; one row's 3 queries stay with score_tile). */
static void score_tile8(const float *const *k, const float *q, float *out, int head_dim) {
#if defined(ATTN_AVX2)
    if (head_dim % 8 == 0) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int u = 0; u < 8; u++)
                acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[u] + d), acc[u]);
        }
        /* lane j of t0 / t1: token j's / 4 + j's ((x0 + x1) + (x2 + x3)) in the low half,
         * ((x4 + x5) + (x6 + x7)) in the high half: as score_tile's, low + high */
        const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]),
                                         _mm256_hadd_ps(acc[2], acc[3]));
        const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]),
                                         _mm256_hadd_ps(acc[6], acc[7]));
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                            _mm256_permute2f128_ps(t0, t1, 0x31)));
        return;
    }
#endif
    for (int u = 0; u < 8; u += 2) {
        float *o[1] = {out + u};
        score_tile_any(1, 2, k + u, &q, o, head_dim);
    }
}

/* W (1..3) queries' scores against the K vectors of 8 tokens, out[j][0 .. 8): score_tile8's
 * arithmetic for each query (the same chains, the same trees), K loaded once for all W. Its
 * 8 W accumulators, W query chunks and a K chunk need AVX-512's 32 registers (a row's 3 query
 * heads per kv head: its scores ~1.4x faster than score_tile8 query by query). */
#if defined(ATTN_AVX2) && defined(__AVX512VL__)
ATTN_INLINE void score_tile8_w(const int W, const float *const *k, const float *const *q,
                               float *const *out, const int head_dim) {
    __m256 acc[3][8];
    for (int j = 0; j < W; j++)
        for (int u = 0; u < 8; u++) acc[j][u] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d += 8) {
        __m256 qv[3];
        for (int j = 0; j < W; j++) qv[j] = _mm256_loadu_ps(q[j] + d);
        for (int u = 0; u < 8; u++) {
            const __m256 kv = _mm256_loadu_ps(k[u] + d);
            for (int j = 0; j < W; j++) acc[j][u] = _mm256_fmadd_ps(qv[j], kv, acc[j][u]);
        }
    }
    for (int j = 0; j < W; j++) {
        const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]),
                                         _mm256_hadd_ps(acc[j][2], acc[j][3]));
        const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][4], acc[j][5]),
                                         _mm256_hadd_ps(acc[j][6], acc[j][7]));
        _mm256_storeu_ps(out[j], _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                               _mm256_permute2f128_ps(t0, t1, 0x31)));
    }
}

/* m queries (each query j: out[j][0 .. 8)) against 8 tokens' K, 3 at a time. */
static void score_tile8_many(int m, const float *const *k, const float *const *q,
                             float *const *out, int head_dim) {
    int j = 0;
    for (; j + 3 <= m; j += 3) score_tile8_w(3, k, q + j, out + j, head_dim);
    if (m - j == 2) score_tile8_w(2, k, q + j, out + j, head_dim);
    else if (m - j == 1) score_tile8_w(1, k, q + j, out + j, head_dim);
}
#define SCORE_TILE8_ALL(m, k, qs, outs, head_dim) score_tile8_many(m, k, qs, outs, head_dim)
#define ATTN_TILE8_FROM 0 /* every group of 8 tokens, one row's 3 queries too */
#else
#define SCORE_TILE8_ALL(m, k, qs, outs, head_dim)                                            \
    for (int j = 0; j < m; j++) score_tile8(k, qs[j], outs[j], head_dim)
#define ATTN_TILE8_FROM 4 /* (16 registers: one row's queries stay with score_tile) */
#endif

/* V_TILE_##S: out[j][0 .. 8 C) += sum over t < span of w[j][t] v_t[0 .. 8 C), in order of t,
 * for W queries (W, C constants where inlined), v_t = v + slots[t] * row: W x C chains of
 * FMAs in registers (8 to 12: fewer wait on the FMA's latency; a verify step's 6 rows x 3
 * queries of a kv head as 3 tiles of 6 x 2 chunks, where 8 x 1 and 6 x 1 chains made its V
 * sums 1.3x slower). */
#if defined(ATTN_AVX2)
ATTN_INLINE __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
ATTN_INLINE __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define DEFINE_V_TILE(S, T, LOAD8)                                                           \
ATTN_INLINE void v_tile_##S(const int W, const int C, const T *v, const int64_t *slots,      \
                            int64_t row, int span, const float *const *w, float *const *out) { \
    __m256 acc[8][8];                                                                        \
    for (int j = 0; j < W; j++)                                                              \
        for (int c = 0; c < C; c++) acc[j][c] = _mm256_loadu_ps(out[j] + 8 * c);             \
    for (int t = 0; t < span; t++) {                                                         \
        const T *vt = v + slots[t] * row;                                                    \
        __m256 vc[8];                                                                        \
        for (int c = 0; c < C; c++) vc[c] = LOAD8(vt + 8 * c);                               \
        for (int j = 0; j < W; j++) {                                                        \
            const __m256 wj = _mm256_set1_ps(w[j][t]);                                       \
            for (int c = 0; c < C; c++) acc[j][c] = _mm256_fmadd_ps(wj, vc[c], acc[j][c]);   \
        }                                                                                    \
    }                                                                                        \
    for (int j = 0; j < W; j++)                                                              \
        for (int c = 0; c < C; c++) _mm256_storeu_ps(out[j] + 8 * c, acc[j][c]);             \
}                                                                                            \
/* The whole head_dim (a multiple of 8) of W queries, 8 / W chunks of 8 values at a time.  \
 * (+=, as v_tile) */                                                                        \
static void v_tile_any_##S(int W, const T *v, const int64_t *slots, int64_t row, int span,   \
                           const float *const *w, float *const *out, int head_dim) {         \
    float *o[8];                                                                             \
    const int width = W == 1 ? 64 : W <= 3 ? 32 : 16; /* (8 C values) */                     \
    int d = 0;                                                                               \
    for (; W <= 6 && d + width <= head_dim; d += width) {                                    \
        for (int j = 0; j < W; j++) o[j] = out[j] + d;                                       \
        switch (W) {                                                                         \
        case 1: v_tile_##S(1, 8, v + d, slots, row, span, w, o); break;                      \
        case 2: v_tile_##S(2, 4, v + d, slots, row, span, w, o); break;                      \
        case 3: v_tile_##S(3, 4, v + d, slots, row, span, w, o); break;                      \
        case 4: v_tile_##S(4, 2, v + d, slots, row, span, w, o); break;                      \
        case 5: v_tile_##S(5, 2, v + d, slots, row, span, w, o); break;                      \
        default: v_tile_##S(6, 2, v + d, slots, row, span, w, o); break;                     \
        }                                                                                    \
    }                                                                                        \
    for (; d < head_dim; d += 8) {                                                           \
        for (int j = 0; j < W; j++) o[j] = out[j] + d;                                       \
        switch (W) {                                                                         \
        case 1: v_tile_##S(1, 1, v + d, slots, row, span, w, o); break;                      \
        case 2: v_tile_##S(2, 1, v + d, slots, row, span, w, o); break;                      \
        case 3: v_tile_##S(3, 1, v + d, slots, row, span, w, o); break;                      \
        case 4: v_tile_##S(4, 1, v + d, slots, row, span, w, o); break;                      \
        case 5: v_tile_##S(5, 1, v + d, slots, row, span, w, o); break;                      \
        case 6: v_tile_##S(6, 1, v + d, slots, row, span, w, o); break;                      \
        case 7: v_tile_##S(7, 1, v + d, slots, row, span, w, o); break;                      \
        default: v_tile_##S(8, 1, v + d, slots, row, span, w, o); break;                     \
        }                                                                                    \
    }                                                                                        \
}
DEFINE_V_TILE(f32, float, load8_f32)
DEFINE_V_TILE(bf16, uint16_t, load8_bf16)
#endif

/* Each row's attention is computed over fixed chunks of positions (CHUNK_POSITIONS, rounded
 * up to whole KV blocks, aligned to position 0): per chunk and query head, the scores' max m,
 * the sum s of exp(score - m) and the sum of exp(score - m) v; then the chunks are combined in
 * order (flash-decoding's split). A chunk is a task of its own when the batch has fewer runs
 * than threads (one user: both threads stream their part of the K/V, whole rows of every kv
 * head, where a task per query head read a third of each row, each kv head's rows once per
 * query head, and 2 threads were no faster than 1); otherwise a task takes a run's chunks
 * together, in one pass over K and one over V (chunk by chunk, a pass each cost batch 16
 * ~10 % more). The chunks are the same either way and each row's arithmetic is its own (a
 * row's positions in a chunk start where they start alone, positions outside them weigh an
 * exact 0), so a row's numbers depend neither on its company nor on the thread count.
 * 128 positions: 64 made batch 16's attention ~10 % slower than one chunk per row (2 threads,
 * SmolLM2's shape, 256 tokens), 128 splits a 256-token context in two as well. */
#define CHUNK_POSITIONS 128

static int chunk_size(int block_size) {
    return (CHUNK_POSITIONS + block_size - 1) / block_size * block_size;
}

/* The chunk partials of one row's query head: m, s, then head_dim sums. */
static inline float *partial_at(float *partials, int64_t query, int chunks, int c, int head_dim) {
    return partials + (query * chunks + c) * (int64_t)(head_dim + 2);
}

/* out[0 .. head_dim) = the row's attention from its chunks' partials, in chunk order; a chunk
 * with none of the row's positions (s = 0) is skipped. */
static void combine_chunks(const float *first, int chunks, int head_dim, float *out) {
    float mx = -FLT_MAX;
    for (int c = 0; c < chunks; c++) {
        const float *p = first + (int64_t)c * (head_dim + 2);
        if (p[1] > 0.f && p[0] > mx) mx = p[0];
    }
    float den = 0.f;
    memset(out, 0, sizeof(float) * (size_t)head_dim);
    for (int c = 0; c < chunks; c++) {
        const float *p = first + (int64_t)c * (head_dim + 2);
        if (!(p[1] > 0.f)) continue;
        const float a = expf(p[0] - mx);
        den += a * p[1];
        for (int d = 0; d < head_dim; d++) out[d] += a * p[2 + d];
    }
    const float inv = 1.f / den;
    for (int d = 0; d < head_dim; d++) out[d] *= inv;
}

/* A run: rows r0 .. r0 + n of one sequence's block table, row i attending to positions
 * first[i] .. end[i] (both grow with i). */
typedef struct {
    int r0, n, lo, hi, c0, chunks; /* positions lo .. hi; chunks c0 .. c0 + chunks */
} AttnRun;

static AttnRun attn_run(const int32_t *seq_lens, int r0, int n, int window, int chunk) {
    AttnRun run = {r0, n, 0, seq_lens[r0 + n - 1], 0, 0};
    const int e0 = seq_lens[r0];
    run.lo = window > 0 && e0 > window ? e0 - window : 0;
    run.c0 = run.lo / chunk;
    run.chunks = (run.hi - 1) / chunk - run.c0 + 1;
    return run;
}

/* A task's working memory, for chunks of up to `chunk` positions of a run of nq queries
 * (rows x heads): one allocation. qf holds the run's queries times the softmax scale. */
typedef struct {
    int64_t *slots;
    const float **qs;
    float **outs;
    float *scores, *qf, *kf;
} AttnScratch;

static int scratch_alloc(AttnScratch *s, int nq, int chunk, int head_dim) {
    const size_t floats = (size_t)nq * chunk + (size_t)nq * head_dim + 8 * (size_t)head_dim;
    char *mem = malloc(sizeof(int64_t) * (size_t)chunk + 2 * sizeof(float *) * (size_t)nq +
                       sizeof(float) * floats);
    if (!mem) return -1;
    s->slots = (int64_t *)mem;
    s->qs = (const float **)(s->slots + chunk);
    s->outs = (float **)(s->qs + nq);
    s->scores = (float *)(s->outs + nq);
    s->qf = s->scores + (size_t)nq * chunk;
    s->kf = s->qf + (size_t)nq * head_dim;
    return 0;
}

static void scale_queries(const float *q, const AttnRun *run, int num_heads, int head_dim,
                          float scale, float *qf) {
    const int64_t size = (int64_t)run->n * num_heads * head_dim;
    const float *src = q + (int64_t)run->r0 * num_heads * head_dim;
    for (int64_t j = 0; j < size; j++) qf[j] = src[j] * scale;
}

/* NAME##_chunks: the partials of chunks c .. c + count of `run` for every row and query head,
 * into partial_at(partials, i * num_heads + h, run->chunks, c - run->c0 + k, head_dim): the
 * scores of all their positions (one pass over K), each chunk's softmax terms, then the V sums
 * chunk after chunk (one pass over V); the numbers are those of each chunk alone. */
#define DEFINE_CHUNKS(NAME, S, T)                                                            \
static void NAME##_chunks(const T *k_cache, const T *v_cache, const int32_t *table,         \
                          const int32_t *seq_lens, const AttnRun *run, int c, int count,     \
                          int chunk, int num_heads, int num_kv_heads, int head_dim,          \
                          int block_size, int window, const AttnScratch *scratch,           \
                          float *partials) {                                                 \
    const int group = num_heads / num_kv_heads, n = run->n;                                  \
    const int64_t row = (int64_t)num_kv_heads * head_dim;                                    \
    const int cs = c * chunk > run->lo ? c * chunk : run->lo;                                \
    const int ce = (c + count) * chunk < run->hi ? (c + count) * chunk : run->hi;            \
    const int span = ce - cs;                                                                \
    float *scores = scratch->scores, *kf = scratch->kf;                                      \
    const float *qf = scratch->qf;                                                           \
    int64_t *slots = scratch->slots;                                                         \
    const float **qs = scratch->qs;                                                          \
    float **outs = scratch->outs;                                                            \
    for (int p = cs; p < ce;) { /* (block by block: no division per position) */            \
        const int b = p / block_size;                                                        \
        const int upto = (b + 1) * block_size < ce ? (b + 1) * block_size : ce;             \
        const int64_t base = (int64_t)table[b] * block_size - (int64_t)b * block_size;       \
        for (; p < upto; p++) slots[p - cs] = base + p;                                      \
    }                                                                                        \
    /* scores: whole K rows (every kv head) of 8 positions at a time, each kv head's vector  \
     * against each of its query heads of every row. The K and V rows 16 positions ahead are \
     * prefetched into L2 (the chunk's V pass comes next and then hits it). K/V come from   \
     * memory, not the caches, in a step: 8 rows ahead and V unprefetched left this loop     \
     * ~1.2x slower (bench.decode_attention, docs/performance.md). */                        \
    for (int t = 0; t < span; t += 8) {                                                      \
        const int tokens = span - t < 8 ? span - t : 8;                                      \
        for (int u = t + 16; u < t + 24 && u < span; u++)                                    \
            for (int64_t b = 0; b < row * (int64_t)sizeof(T); b += 64) {                     \
                __builtin_prefetch((const char *)(k_cache + slots[u] * row) + b, 0,          \
                                   ATTN_PREFETCH_LOCALITY);                                  \
                __builtin_prefetch((const char *)(v_cache + slots[u] * row) + b, 0,          \
                                   ATTN_PREFETCH_LOCALITY);                                  \
            }                                                                                \
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                       \
            const float *k[8];                                                               \
            for (int u = 0; u < tokens; u++)                                                 \
                k[u] = WIDEN_##S(k_cache + slots[t + u] * row + (int64_t)kvh * head_dim,     \
                                 kf + u * head_dim, head_dim);                               \
            int m = 0;                                                                       \
            for (int i = 0; i < n; i++)                                                      \
                for (int h = kvh * group; h < (kvh + 1) * group; h++) {                      \
                    qs[m] = qf + ((int64_t)i * num_heads + h) * head_dim;                    \
                    outs[m++] = scores + ((int64_t)i * num_heads + h) * span + t;            \
                }                                                                            \
            if (tokens == 8 && m > ATTN_TILE8_FROM) {                                        \
                SCORE_TILE8_ALL(m, k, qs, outs, head_dim);                                   \
                continue;                                                                    \
            }                                                                                \
            for (int u = 0; u < tokens; u += 2) {                                            \
                float *o[m];                                                                 \
                for (int j = 0; j < m; j++) o[j] = outs[j] + u;                              \
                for (int j = 0; j < m; j += 4)                                               \
                    score_tile_any(m - j < 4 ? m - j : 4, tokens - u < 2 ? 1 : 2, k + u,     \
                                   qs + j, o + j, head_dim);                                 \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (int k = 0; k < count; k++) { /* each chunk's positions s0 .. s1 of the span */      \
        const int s0 = (c + k) * chunk - cs > 0 ? (c + k) * chunk - cs : 0;                  \
        const int s1 = (c + k + 1) * chunk - cs < span ? (c + k + 1) * chunk - cs : span;    \
        const int len = s1 - s0;                                                             \
        /* weights exp(score - m) over each row's own positions of the chunk (from where    \
         * they start, as alone), an exact 0 elsewhere */                                    \
        for (int i = 0; i < n; i++) {                                                        \
            const int e = seq_lens[run->r0 + i] - cs - s0;                                   \
            const int f = (window > 0 && seq_lens[run->r0 + i] > window                      \
                           ? seq_lens[run->r0 + i] - window : 0) - cs - s0;                  \
            const int a = f <= 0 ? 0 : f >= len ? len : f;                                   \
            const int z = e >= len ? len : e <= a ? a : e;                                   \
            for (int h = 0; h < num_heads; h++) {                                            \
                float *sc = scores + ((int64_t)i * num_heads + h) * span + s0;               \
                float *p = partial_at(partials, (int64_t)i * num_heads + h, run->chunks,     \
                                      c - run->c0 + k, head_dim);                            \
                float m = -FLT_MAX, sum = 0.f;                                               \
                for (int t = a; t < z; t++) m = sc[t] > m ? sc[t] : m;                       \
                for (int t = a; t < z; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }       \
                if (a > 0) memset(sc, 0, sizeof(float) * (size_t)a);                         \
                memset(sc + z, 0, sizeof(float) * (size_t)(len - z));                        \
                p[0] = m;                                                                    \
                p[1] = sum;                                                                  \
            }                                                                                \
        }                                                                                    \
        /* the sums of w v: each kv head's V values 8 at a time into up to 8 queries' sums  \
         * (the next chunk's first rows prefetched at this one's end) */                     \
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                       \
            int m = 0;                                                                       \
            for (int i = 0; i < n; i++)                                                      \
                for (int h = kvh * group; h < (kvh + 1) * group; h++) {                      \
                    qs[m] = scores + ((int64_t)i * num_heads + h) * span + s0;               \
                    outs[m++] = partial_at(partials, (int64_t)i * num_heads + h, run->chunks, \
                                           c - run->c0 + k, head_dim) + 2;                   \
                }                                                                            \
            SUM_V_##S(v_cache + (int64_t)kvh * head_dim, slots + s0, row, len, span - s1,    \
                      qs, outs, m, head_dim);                                                \
        }                                                                                    \
    }                                                                                        \
}

/* NAME##_run_chunks: NAME##_chunks with its working memory (the run's queries scaled once);
 * -1 if that memory could not be had. */
#define DEFINE_RUN_CHUNKS(NAME, S, T)                                                        \
static int NAME##_run_chunks(const float *q, const T *k_cache, const T *v_cache,            \
                             const int32_t *table, const int32_t *seq_lens,                  \
                             const AttnRun *run, int c, int count, int chunk, int num_heads, \
                             int num_kv_heads, int head_dim, int block_size, int window,     \
                             float scale, float *partials) {                                 \
    AttnScratch scratch;                                                                     \
    if (scratch_alloc(&scratch, run->n * num_heads, count * chunk, head_dim) != 0) return -1; \
    scale_queries(q, run, num_heads, head_dim, scale, scratch.qf);                           \
    NAME##_chunks(k_cache, v_cache, table, seq_lens, run, c, count, chunk, num_heads,        \
                  num_kv_heads, head_dim, block_size, window, &scratch, partials);           \
    free(scratch.slots); /* (the allocation's start) */                                     \
    return 0;                                                                                \
}

/* NAME##_team: the work for a team of threads already running (orphaned worksharing, for
 * decoder.c's one parallel region per step); a failed allocation sets *failed. Ends with the
 * team's barrier. NAME runs it in a region of its own. */
#define DEFINE_KERNEL(NAME, S, T)                                                            \
DEFINE_CHUNKS(NAME, S, T)                                                                     \
DEFINE_RUN_CHUNKS(NAME, S, T)                                                                 \
static void NAME##_team(const float *q, const T *k_cache, const T *v_cache,                   \
                        const int32_t *block_tables, const int32_t *seq_lens, float *out,    \
                        int num_seqs, int num_heads, int num_kv_heads, int head_dim,         \
                        int block_size, int max_blocks, int window, float scale,             \
                        int threads, int *failed_out) {                                      \
    const int chunk = chunk_size(block_size);                                                \
    const int64_t stride = head_dim + 2;                                                     \
    int run_start[num_seqs + 1], runs = 0; /* (each thread its own copy: a few ints) */      \
    for (int s = 0; s < num_seqs; s++)                                                       \
        if (s == 0 || !same_run(block_tables, seq_lens, max_blocks, s - 1))                  \
            run_start[runs++] = s;                                                           \
    run_start[runs] = num_seqs;                                                              \
    int failed = 0;                                                                          \
    if (runs >= threads) { /* a task per run, its chunks together */                        \
        _Pragma("omp for schedule(dynamic, 1)")                                              \
        for (int r = 0; r < runs; r++) {                                                     \
            const AttnRun run = attn_run(seq_lens, run_start[r], run_start[r + 1] - run_start[r], \
                                         window, chunk);                                     \
            const int nq = run.n * num_heads;                                                \
            float *partials = malloc(sizeof(float) * (size_t)nq * run.chunks * stride);      \
            if (!partials ||                                                                 \
                NAME##_run_chunks(q, k_cache, v_cache,                                       \
                                  block_tables + (int64_t)run.r0 * max_blocks, seq_lens,     \
                                  &run, run.c0, run.chunks, chunk, num_heads, num_kv_heads,  \
                                  head_dim, block_size, window, scale, partials) != 0) {     \
                free(partials);                                                              \
                _Pragma("omp atomic write")                                                  \
                failed = 1;                                                                  \
                continue;                                                                    \
            }                                                                                \
            for (int j = 0; j < nq; j++)                                                     \
                combine_chunks(partial_at(partials, j, run.chunks, 0, head_dim), run.chunks, \
                               head_dim, out + ((int64_t)run.r0 * num_heads + j) * head_dim); \
            free(partials);                                                                  \
        }                                                                                    \
    } else { /* a task per chunk of every run, then each row's chunks combined */            \
        AttnRun all[runs];                                                                   \
        int64_t at[runs + 1]; /* where each run's partials start */                          \
        int task_start[runs + 1];                                                            \
        at[0] = 0;                                                                           \
        task_start[0] = 0;                                                                   \
        for (int r = 0; r < runs; r++) {                                                     \
            all[r] = attn_run(seq_lens, run_start[r], run_start[r + 1] - run_start[r], window, \
                              chunk);                                                        \
            at[r + 1] = at[r] + (int64_t)all[r].n * num_heads * all[r].chunks * stride;      \
            task_start[r + 1] = task_start[r] + all[r].chunks;                               \
        }                                                                                    \
        float *partials = NULL;                                                              \
        _Pragma("omp single copyprivate(partials)")                                          \
        partials = malloc(sizeof(float) * (size_t)at[runs]);                                 \
        if (!partials) { /* (every thread sees the same NULL) */                             \
            _Pragma("omp atomic write")                                                      \
            *failed_out = 1;                                                                 \
            return;                                                                          \
        }                                                                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                              \
        for (int task = 0; task < task_start[runs]; task++) {                                \
            int r = 0;                                                                       \
            while (task >= task_start[r + 1]) r++;                                           \
            if (NAME##_run_chunks(q, k_cache, v_cache,                                       \
                                  block_tables + (int64_t)all[r].r0 * max_blocks, seq_lens,  \
                                  &all[r], all[r].c0 + task - task_start[r], 1, chunk,       \
                                  num_heads, num_kv_heads, head_dim, block_size, window,     \
                                  scale, partials + at[r]) != 0) {                           \
                _Pragma("omp atomic write")                                                  \
                failed = 1;                                                                  \
            }                                                                                \
        }                                                                                    \
        int queries = 0;                                                                     \
        for (int r = 0; r < runs; r++) queries += all[r].n * num_heads;                      \
        _Pragma("omp for schedule(static)")                                                  \
        for (int j = 0; j < queries; j++) {                                                  \
            int r = 0, k = j;                                                                \
            while (k >= all[r].n * num_heads) k -= all[r].n * num_heads, r++;                \
            combine_chunks(partial_at(partials + at[r], k, all[r].chunks, 0, head_dim),      \
                           all[r].chunks, head_dim,                                          \
                           out + ((int64_t)all[r].r0 * num_heads + k) * head_dim);           \
        }                                                                                    \
        _Pragma("omp single nowait") /* (after the loop's barrier: every row combined) */    \
        free(partials);                                                                      \
    }                                                                                        \
    if (failed) {                                                                            \
        _Pragma("omp atomic write")                                                          \
        *failed_out = 1;                                                                     \
    }                                                                                        \
}                                                                                            \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,       \
         const int32_t *seq_lens, float *out, int num_seqs, int num_heads, int num_kv_heads,  \
         int head_dim, int block_size, int max_blocks, int window, float scale) {            \
    int failed = 0;                                                                          \
    _Pragma("omp parallel")                                                                  \
    NAME##_team(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads,       \
                num_kv_heads, head_dim, block_size, max_blocks, window, scale,               \
                omp_get_num_threads(), &failed);                                             \
    return failed ? -1 : 0;                                                                  \
}

/* A kv head's K vector as float32: in place, or widened into buf. */
static inline const float *WIDEN_f32(const float *k, float *buf, int head_dim) {
    (void)buf;
    (void)head_dim;
    return k;
}
static inline const float *WIDEN_bf16(const uint16_t *k, float *buf, int head_dim) {
    for (int d = 0; d < head_dim; d++) buf[d] = bf16_to_f32(k[d]);
    return buf;
}

/* outs[j][0 .. head_dim) = sum over t < span of w[j][t] v_t (v_t = v + slots[t] * row) for m
 * queries, in order of t. */
#define DEFINE_SUM_V(S, T, LOAD)                                                             \
static void SUM_V_##S(const T *v, const int64_t *slots, int64_t row, int span, int ahead,    \
                      const float *const *w, float *const *outs, int m, int head_dim) {      \
    SUM_V_AVX2_##S                                                                           \
    for (int j = 0; j < m; j++) {                                                            \
        float *acc = outs[j];                                                                \
        memset(acc, 0, sizeof(float) * (size_t)head_dim);                                    \
        for (int t = 0; t < span; t++) {                                                     \
            const T *vt = v + slots[t] * row;                                                \
            for (int d = 0; d < head_dim; d++) acc[d] += w[j][t] * LOAD(vt[d]);              \
        }                                                                                    \
    }                                                                                        \
}
#if defined(ATTN_AVX2)
#define SUM_V_AVX2(S)                                                                        \
    if (head_dim % 8 == 0) {                                                                 \
        for (int j = 0; j < m; j++) memset(outs[j], 0, sizeof(float) * (size_t)head_dim);    \
        /* 16 positions at a time (a 16-token KV block is contiguous: its rows stay in L1    \
         * while every tile passes over them), tiles of up to 6 queries, as even as can be */ \
        const int tiles = (m + 5) / 6;                                                       \
        const float *wt[m];                                                                  \
        for (int t = 0; t < span; t += 16) {                                                 \
            const int len = span - t < 16 ? span - t : 16;                                   \
            for (int u = t + 16; u < t + 32 && u < span + ahead; u++) /* the next 16 rows */ \
                for (int64_t b = 0; b < (int64_t)sizeof(*v) * head_dim; b += 64)          \
                    __builtin_prefetch((const char *)(v + slots[u] * row) + b, 0,            \
                                       ATTN_PREFETCH_LOCALITY);                              \
            for (int j = 0; j < m; j++) wt[j] = w[j] + t;                                    \
            for (int j = 0, tile = 0; tile < tiles; tile++) {                                \
                const int W = (m - j + tiles - tile - 1) / (tiles - tile);                   \
                v_tile_any_##S(W, v, slots + t, row, len, wt + j, outs + j, head_dim);       \
                j += W;                                                                      \
            }                                                                                \
        }                                                                                    \
        return;                                                                              \
    }
#define SUM_V_AVX2_f32 SUM_V_AVX2(f32)
#define SUM_V_AVX2_bf16 SUM_V_AVX2(bf16)
#else
#define SUM_V_AVX2_f32
#define SUM_V_AVX2_bf16
#endif

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_SUM_V(f32, float, LOAD_F32)
DEFINE_SUM_V(bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(paged_decode_attention_f32, f32, float)
DEFINE_KERNEL(paged_decode_attention_bf16, bf16, uint16_t)

void loom_set_num_threads(int n) { omp_set_num_threads(n); }
