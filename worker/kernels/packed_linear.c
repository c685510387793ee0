/* y = x @ W^T (+ bias) with W packed once at load time, for every linear layer of the model.
 *
 * Why not PyTorch's GEMM: MKL's float32 GEMM is tuned for large square products; the shapes a
 * server sees (4-64 rows of 576-1536 features against 576-49152 outputs) run at a fraction of
 * the machine's FMA peak, the wide lm_head worst (figures: docs/performance.md). A decode step
 * is almost all such GEMMs.
 *
 * Layout: W [N, K] is stored as panels of NR output features, each panel [K][NR] contiguous,
 * so the inner loop streams one panel front to back while MR rows of x are broadcast against
 * it: MR x NR accumulators stay in registers for the whole K loop (the GotoBLAS/BLIS
 * micro-kernel shape). N is padded to a multiple of NR with zero columns.
 *
 * Each chunk of work is a block of MC rows against a run of panels, every panel against every
 * MR-row tile, so a panel is read from memory once per row block and the row block stays in
 * L2 across panels.
 *
 * Weights are float32 or bfloat16 (widened to float32 in registers: half the memory traffic,
 * the same float32 accumulation as PyTorch's bf16 GEMM). x and y are float32.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Written with GCC vector extensions, not intrinsics: the same source compiles to AVX-512,
 * AVX2 or NEON code with -march=native, and a test can build a wider machine's configuration
 * here (-DLOOM_VLEN=16 -DLOOM_MR=12) to check its tile logic. */
#ifndef LOOM_VLEN
#if defined(__AVX512F__)
#define LOOM_VLEN 16
#elif defined(__AVX__)
#define LOOM_VLEN 8
#else
#define LOOM_VLEN 4 /* SSE, NEON */
#endif
#endif
/* MR x 2 accumulators + 2 weight vectors + 1 broadcast must fit the vector registers: 16 on
 * AVX2 and SSE, 32 on AVX-512 and aarch64. */
#ifndef LOOM_MR
#if LOOM_VLEN == 16 || defined(__aarch64__)
#define LOOM_MR 12
#else
#define LOOM_MR 6
#endif
#endif
#define VLEN LOOM_VLEN
#define NR (2 * VLEN)
#define MR LOOM_MR
/* Rows per block: 96 x up to 1536 float32 features fit a 1 MiB L2 beside a panel; 96 was
 * 3-5% faster than 48 at 64-512 rows on an AVX2 EPYC (192 and 24 were slower). */
#ifndef LOOM_MC
#define LOOM_MC 96
#endif
#define MC LOOM_MC

typedef float vec __attribute__((vector_size(VLEN * 4)));
typedef float vec_u __attribute__((vector_size(VLEN * 4), aligned(4)));
typedef uint16_t half_u __attribute__((vector_size(VLEN * 2), aligned(2)));
typedef uint32_t uvec __attribute__((vector_size(VLEN * 4)));

static inline vec vzero(void) { return (vec){0}; }
static inline vec vload(const float *p) { return *(const vec_u *)p; }
static inline void vstore(float *p, vec v) { *(vec_u *)p = v; }
static inline vec vbcast(const float *p) { return (vec){0} + *p; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; } /* contracted to an FMA */
static inline vec vadd(vec a, vec b) { return a + b; }
/* bfloat16 is the top half of a float32: widen and shift. */
static inline vec vload_bf16(const uint16_t *p) {
    return (vec)(__builtin_convertvector(*(const half_u *)p, uvec) << 16);
}

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The first row tile of a panel pulls the next panel of its chunk into cache as it goes: one
 * cache line per k step, the rate the tile consumes its own panel. 3-12% faster at 4-64 rows
 * on an AVX2 EPYC; prefetching two panels ahead, into L2 only, or across chunks was slower. */
#define PREFETCH 1
#define PF_DIST 1

int loom_linear_panel_width(void) { return NR; }

/* Stores one row's two accumulators, adding the bias; the last, zero-padded panel stores
 * only its real columns. */
ALWAYS_INLINE void store_row(float *restrict y, vec c0, vec c1, const int cols,
                             const float *restrict bias) {
    if (bias) {
        c0 = vadd(c0, vload(bias));
        c1 = vadd(c1, vload(bias + VLEN));
    }
    if (cols == NR) {
        vstore(y, c0);
        vstore(y + VLEN, c1);
    } else {
        float tmp[NR];
        vstore(tmp, c0);
        vstore(tmp + VLEN, c1);
        memcpy(y, tmp, sizeof(float) * (size_t)cols);
    }
}

/* MR_ rows of x against one panel, the whole K loop in registers. Called with a constant
 * MR_, so the row guards fold away. The accumulators are named scalars, not an array: GCC
 * spilled an acc[][] array to the stack on every iteration. */
#define ROW_DECL(i) vec c##i##a = vzero(), c##i##b = vzero();
#define ROW_FMA(i)                                                                           \
    if (MR_ > i) {                                                                           \
        const vec xi = vbcast(x + i * ldx + k);                                              \
        c##i##a = vfma(xi, w0, c##i##a);                                                     \
        c##i##b = vfma(xi, w1, c##i##b);                                                     \
    }
#define ROW_STORE(i) if (MR_ > i) store_row(y + i * ldy, c##i##a, c##i##b, cols, bias);
#if MR == 12
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#else
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#endif

#define DEFINE_TILE(NAME, WT, WLOAD)                                                          \
ALWAYS_INLINE void NAME(const int MR_, const int K, const float *restrict x, const int64_t ldx, \
                        const WT *restrict w, float *restrict y, const int64_t ldy,          \
                        const int cols, const float *restrict bias, const char *prefetch) {  \
    FOR_ROWS(ROW_DECL)                                                                       \
    for (int k = 0; k < K; k++) {                                                            \
        const vec w0 = WLOAD(w + (int64_t)k * NR), w1 = WLOAD(w + (int64_t)k * NR + VLEN);  \
        if (PREFETCH && prefetch) {                                                          \
            const char *line = prefetch + (int64_t)k * NR * sizeof(WT);                      \
            __builtin_prefetch(line, 0, 3);                                                 \
            if (NR * sizeof(WT) > 64) __builtin_prefetch(line + 64, 0, 3);                  \
        }                                                                                    \
        FOR_ROWS(ROW_FMA)                                                                    \
    }                                                                                        \
    FOR_ROWS(ROW_STORE)                                                                      \
}

#define WLOAD_F32(p) vload(p)
#define WLOAD_BF16(p) vload_bf16(p)
DEFINE_TILE(tile_f32, float, WLOAD_F32)
DEFINE_TILE(tile_bf16, uint16_t, WLOAD_BF16)

/* Dispatch a row count to a tile specialised for it (1..MR). */
#define DEFINE_ROWS(NAME, TILE, WT)                                                           \
static void NAME(int rows, int K, const float *x, int64_t ldx, const WT *w, float *y,       \
                 int64_t ldy, int cols, const float *bias, const char *pf) {                                 \
    switch (rows) {                                                                          \
    case 1: TILE(1, K, x, ldx, w, y, ldy, cols, bias, pf); break;                                \
    case 2: TILE(2, K, x, ldx, w, y, ldy, cols, bias, pf); break;                                \
    case 3: TILE(3, K, x, ldx, w, y, ldy, cols, bias, pf); break;                                \
    case 4: TILE(4, K, x, ldx, w, y, ldy, cols, bias, pf); break;                                \
    case 5: TILE(5, K, x, ldx, w, y, ldy, cols, bias, pf); break;                                \
    case 6: TILE(6, K, x, ldx, w, y, ldy, cols, bias, pf); break;                                \
    ROWS_7_TO_12(TILE)                                                                       \
    }                                                                                        \
}
#if MR == 12
#define ROWS_7_TO_12(TILE)                                                                   \
    case 7: TILE(7, K, x, ldx, w, y, ldy, cols, bias, pf); break;                            \
    case 8: TILE(8, K, x, ldx, w, y, ldy, cols, bias, pf); break;                            \
    case 9: TILE(9, K, x, ldx, w, y, ldy, cols, bias, pf); break;                            \
    case 10: TILE(10, K, x, ldx, w, y, ldy, cols, bias, pf); break;                          \
    case 11: TILE(11, K, x, ldx, w, y, ldy, cols, bias, pf); break;                          \
    case 12: TILE(12, K, x, ldx, w, y, ldy, cols, bias, pf); break;
#else
#define ROWS_7_TO_12(TILE)
#endif
DEFINE_ROWS(rows_f32, tile_f32, float)
DEFINE_ROWS(rows_bf16, tile_bf16, uint16_t)

/* x [M, K] (row stride ldx), packed w [ceil(N/NR)][K][NR], bias [N padded to NR] or NULL,
 * y [M, N] (row stride ldy).
 *
 * Work is handed out in chunks (a block of rows x a run of panels), dynamically: the API and
 * scheduler processes share these cores, and a thread the OS preempts then holds up the step
 * by one chunk rather than by its whole static share. */
/* NAME##_team: the same work for a team of threads already running (orphaned worksharing:
 * decoder.c runs a decode step in one parallel region); `threads` is the team's size. Ends
 * with the team's barrier. NAME runs it in a region of its own. */
#define DEFINE_LINEAR(NAME, ROWS, WT)                                                         \
static void NAME##_team(const float *x, int64_t ldx, const WT *w, const float *bias, float *y, \
                        int64_t ldy, int M, int N, int K, int threads) {                     \
    const int panels = (N + NR - 1) / NR;                                                    \
    const int per_chunk = panels / (threads * 8) > 1 ? panels / (threads * 8) : 1;           \
    const int runs = (panels + per_chunk - 1) / per_chunk;                                   \
    const int row_blocks = (M + MC - 1) / MC;                                                \
    _Pragma("omp for schedule(dynamic, 1)")                                                  \
    for (int chunk = 0; chunk < row_blocks * runs; chunk++) {                                \
        const int m0 = chunk / runs * MC, mc = M - m0 < MC ? M - m0 : MC;                    \
        const int pa = chunk % runs * per_chunk;                                             \
        const int pb = pa + per_chunk < panels ? pa + per_chunk : panels;                    \
        for (int p = pa; p < pb; p++) {                                                      \
            const WT *wp = w + (int64_t)p * K * NR;                                          \
            const int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;                         \
            const float *bp = bias ? bias + n0 : NULL;                                       \
            for (int i = 0; i < mc; i += MR) {                                               \
                const int rows = mc - i < MR ? mc - i : MR;                                  \
                const char *pf = i == 0 && p + PF_DIST < pb ? (const char *)(wp + (int64_t)PF_DIST * K * NR) \
                                                      : NULL;                                \
                ROWS(rows, K, x + (int64_t)(m0 + i) * ldx, ldx, wp,                          \
                     y + (int64_t)(m0 + i) * ldy + n0, ldy, cols, bp, pf);                   \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
void NAME(const float *x, int64_t ldx, const WT *w, const float *bias, float *y, int64_t ldy, \
          int M, int N, int K) {                                                             \
    _Pragma("omp parallel")                                                                  \
    NAME##_team(x, ldx, w, bias, y, ldy, M, N, K, omp_get_num_threads());                    \
}
DEFINE_LINEAR(loom_linear_f32, rows_f32, float)
DEFINE_LINEAR(loom_linear_bf16, rows_bf16, uint16_t)
