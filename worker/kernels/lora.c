/* y[t] += (x[t] a_s) b_s for each row t of a LoRA adapter (slot s): Punica's SGMV, each row
 * with its own adapter, the base model's rows untouched (worker/lora.py says why and how the
 * slots are laid out). decoder.c's one-call decode step adds the deltas with `lora_add`; the
 * Python path (prefill chunks) calls `loom_lora_add` once per projection, after the base
 * product.
 *
 * The rows are grouped by slot and taken LORA_ROWS of one slot at a time, so an adapter's a
 * and b are read once per block of rows, not once per row: at rank 16 on every projection an
 * adapter is about 0.5 MB a layer, more than L2, and reading it once per row cost more than
 * the base model's 4-bit weights at c=16. Each column's sum runs over k in order, as the
 * one-row loops did: the same numbers for any grouping of the rows.
 */
#if !defined(NR) /* (decoder.c may have included packed_linear.c already) */
#include "packed_linear.c"
#endif

#include <stdlib.h>

/* One projection's LoRA adapters, one slot each: a [slots, K, rank] and b [slots, rank, N],
 * float32 or bfloat16 (`dtype`), a fused projection's `parts` side by side (rank / parts
 * columns of a each, zeros where an adapter has a smaller rank or no delta for a part). b is
 * block-diagonal: part p's rows are zero outside columns out_start[p] .. out_start[p + 1], so
 * only those are read. a == NULL: none. */
enum { LORA_F32 = 0, LORA_BF16 = 1 };
typedef struct {
    const void *a, *b;
    int rank, parts, dtype;
    int out_start[4];
} LoRAWeights;
enum { LORA_MAX_SLOTS = 256 }; /* slots beyond are base rows */

/* Rows of one adapter multiplied together: LORA_ROWS x 2 vectors of sums, 2 weight vectors
 * and a broadcast fit AVX2's 16 registers (6 rows: a sixth faster than 4 on a prefill
 * chunk's 64 rows of one adapter, on an AVX2 EPYC). */
enum { LORA_ROWS = 6 };

/* A decode step reads each adapter of the step once from memory (4 rank-16 adapters: 40 MB a
 * step beside the base's 95), a and b in rows that the hardware prefetcher follows late (b's
 * at a stride of its width): a is pulled LORA_PREFETCH_A bytes ahead, b's rows two lines
 * ahead (a fifth off the deltas of 14 rows over 4 adapters on an AVX2 EPYC). */
enum { LORA_PREFETCH_A = 1024, LORA_PREFETCH_B = 128 };

/* The step's adapter rows grouped by slot (a counting sort of row_slots, stable), cut into
 * blocks of at most LORA_ROWS rows: block i is rows order[first[i] .. first[i] + rows[i]) of
 * slot slot[i]. */
typedef struct {
    int blocks;
    int *slot, *first, *rows;
    int order[]; /* [T], then slot, first, rows: [T] each */
} LoRAGroups;

static LoRAGroups *lora_groups(const int32_t *row_slots, int T) {
    LoRAGroups *g = malloc(sizeof(LoRAGroups) + sizeof(int) * 4 * (size_t)T);
    if (!g)
        return NULL;
    g->slot = g->order + T;
    g->first = g->slot + T;
    g->rows = g->first + T;
    int count[LORA_MAX_SLOTS] = {0}, start[LORA_MAX_SLOTS];
    for (int t = 0; t < T; t++)
        if (row_slots[t] >= 0 && row_slots[t] < LORA_MAX_SLOTS)
            count[row_slots[t]]++;
    int at = 0;
    g->blocks = 0;
    for (int s = 0; s < LORA_MAX_SLOTS; s++) {
        start[s] = at;
        for (int r = 0; r < count[s]; r += LORA_ROWS) {
            g->slot[g->blocks] = s;
            g->first[g->blocks] = at + r;
            g->rows[g->blocks++] = count[s] - r < LORA_ROWS ? count[s] - r : LORA_ROWS;
        }
        at += count[s];
    }
    for (int t = 0; t < T; t++)
        if (row_slots[t] >= 0 && row_slots[t] < LORA_MAX_SLOTS)
            g->order[start[row_slots[t]]++] = t;
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

/* u[r][c .. c + NV * VLEN) = x[r] a over those columns for the block's R rows, the sums in
 * registers (u: [R, rank]). */
ALWAYS_INLINE void shrink_block(const void *a, const float *const *x, int K, int rank, int c,
                                float *u, const int R, const int NV, const int dtype) {
    vec acc[LORA_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = vzero();
    const int64_t elem = dtype == LORA_BF16 ? 2 : 4;
    for (int j = 0; j < K; j++) {
        vec w[2];
        if (c == 0) /* (the first columns' pass brings a in for the others) */
            __builtin_prefetch((const char *)a + ((int64_t)j * rank) * elem + LORA_PREFETCH_A);
        for (int v = 0; v < NV; v++)
            w[v] = lora_vload(a, (int64_t)j * rank + c + v * VLEN, dtype);
        for (int r = 0; r < R; r++) {
            const vec xr = vbcast(x[r] + j);
            for (int v = 0; v < NV; v++)
                acc[r][v] = vfma(xr, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            vstore(u + (int64_t)r * rank + c + v * VLEN, acc[r][v]);
}

/* y[r][n .. n + NV * VLEN) += u[r][k0 .. k1) b over those columns, for the block's R rows. */
ALWAYS_INLINE void expand_block(const void *b, const float *u, int rank, int N, int k0, int k1,
                                int n, float *const *y, const int R, const int NV,
                                const int dtype) {
    vec acc[LORA_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = vload(y[r] + n + v * VLEN);
    const int64_t elem = dtype == LORA_BF16 ? 2 : 4;
    for (int k = k0; k < k1; k++) {
        vec w[2];
        __builtin_prefetch((const char *)b + ((int64_t)k * N + n) * elem + LORA_PREFETCH_B);
        for (int v = 0; v < NV; v++)
            w[v] = lora_vload(b, (int64_t)k * N + n + v * VLEN, dtype);
        for (int r = 0; r < R; r++) {
            const vec ur = vbcast(u + (int64_t)r * rank + k);
            for (int v = 0; v < NV; v++)
                acc[r][v] = vfma(ur, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++)
            vstore(y[r] + n + v * VLEN, acc[r][v]);
}

/* u = x a for the block's R rows (a: [K, rank] of one slot), then y += u b (b: [rank, N]),
 * each part's rank columns only over its own output columns. */
ALWAYS_INLINE void lora_block_of(const LoRAWeights *l, const void *a, const void *b,
                                 const float *const *x, int K, int N, float *u,
                                 float *const *y, const int R, const int dtype) {
    const int rank = l->rank, part_rank = rank / l->parts;
    int c = 0;
    for (; c + 2 * VLEN <= rank; c += 2 * VLEN)
        shrink_block(a, x, K, rank, c, u, R, 2, dtype);
    for (; c + VLEN <= rank; c += VLEN)
        shrink_block(a, x, K, rank, c, u, R, 1, dtype);
    for (; c < rank; c++)
        for (int r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int j = 0; j < K; j++)
                sum += x[r][j] * lora_load(a, (int64_t)j * rank + c, dtype);
            u[(int64_t)r * rank + c] = sum;
        }
    for (int p = 0; p < l->parts; p++) {
        const int k0 = p * part_rank, k1 = k0 + part_rank;
        const int n1 = l->out_start[p + 1];
        int n = l->out_start[p];
        for (; n + 2 * VLEN <= n1; n += 2 * VLEN)
            expand_block(b, u, rank, N, k0, k1, n, y, R, 2, dtype);
        for (; n + VLEN <= n1; n += VLEN)
            expand_block(b, u, rank, N, k0, k1, n, y, R, 1, dtype);
        for (; n < n1; n++)
            for (int r = 0; r < R; r++)
                for (int k = k0; k < k1; k++)
                    y[r][n] += u[(int64_t)r * rank + k] * lora_load(b, (int64_t)k * N + n, dtype);
    }
}

#define LORA_BLOCK_CASE(R)                                                                 \
    case R:                                                                                \
        if (dtype == LORA_BF16)                                                            \
            lora_block_of(l, a, b, x, K, N, u, y, R, LORA_BF16);                           \
        else                                                                               \
            lora_block_of(l, a, b, x, K, N, u, y, R, LORA_F32);                            \
        break;

static void lora_block(const LoRAWeights *l, const void *a, const void *b,
                       const float *const *x, int K, int N, float *u, float *const *y, int R,
                       int dtype) {
    switch (R) {
        LORA_BLOCK_CASE(1)
        LORA_BLOCK_CASE(2)
        LORA_BLOCK_CASE(3)
        LORA_BLOCK_CASE(4)
        LORA_BLOCK_CASE(5)
        LORA_BLOCK_CASE(6)
    }
}

/* The deltas of g's rows, by the team (orphaned worksharing: one barrier, at its end; on a
 * busy machine each barrier costs more than the arithmetic). The team splits the blocks in
 * slot order, so a thread's blocks mostly share one adapter, read from its cache after the
 * first. */
static void lora_add(const LoRAWeights *l, const LoRAGroups *g, const float *x, int64_t ldx,
                     float *y, int64_t ldy, int N, int K) {
    if (!l->a || !g)
        return;
    const int rank = l->rank;
    const int64_t elem = l->dtype == LORA_BF16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int i = 0; i < g->blocks; i++) {
        const int64_t slot = g->slot[i];
        const void *a = (const char *)l->a + slot * K * rank * elem;
        const void *b = (const char *)l->b + slot * rank * N * elem;
        const float *xr[LORA_ROWS];
        float *yr[LORA_ROWS], u[LORA_ROWS * rank];
        for (int r = 0; r < g->rows[i]; r++) {
            const int t = g->order[g->first[i] + r];
            xr[r] = x + (int64_t)t * ldx;
            yr[r] = y + (int64_t)t * ldy;
        }
        lora_block(l, a, b, xr, K, N, u, yr, g->rows[i], l->dtype);
    }
}

/* y [T, N] += the deltas of the rows of x [T, K] whose row_slots[t] >= 0 (the Python path's
 * call, after the base product wrote y). Returns 0, or -2 if memory could not be had. */
int loom_lora_add(const LoRAWeights *l, const int32_t *row_slots, int T, const float *x,
                  int64_t ldx, float *y, int64_t ldy, int N, int K) {
    LoRAGroups *g = lora_groups(row_slots, T);
    if (!g)
        return -2;
#pragma omp parallel if (g->blocks > 1)
    lora_add(l, g, x, ldx, y, ldy, N, K);
    free(g);
    return 0;
}
