/* y = x @ W^T (+ bias) with W packed once at load time, for every linear layer of the model.
 *
 * Why not PyTorch's GEMM: on the CPUs here its float32 GEMM runs the shapes a server sees
 * (4-64 rows of 576-1536 features against 576-49152 outputs) at a third to a half of the
 * machine's FMA peak, and the 49,152-wide lm_head at a quarter of it (measured with torch 2.13
 * / MKL 2024.2 on a 2-core EPYC: 16 rows x lm_head 21.7 ms, compute alone allows ~5 ms).
 * A decode step is almost all such GEMMs.
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
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define NR 32
#define MR 12
#define MC 96
typedef __m512 vec;
#define VLEN 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vbcast(p) _mm512_set1_ps(*(p))
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
static inline vec vload_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define NR 16
#define MR 6
#define MC 48
typedef __m256 vec;
#define VLEN 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vbcast(p) _mm256_broadcast_ss(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
static inline vec vload_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
#error "packed_linear needs AVX2+FMA or AVX-512"
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The first row tile of a panel pulls the next panel of its chunk into cache as it goes: one
 * cache line per k step, the rate the tile consumes its own panel. 3-12% faster at 4-64 rows
 * on the EPYC here; prefetching two panels ahead, into L2 only, or across chunks was slower. */
#define PREFETCH 1
#define PF_HINT _MM_HINT_T0
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
            _mm_prefetch(line, PF_HINT);                                                 \
            if (NR * sizeof(WT) > 64) _mm_prefetch(line + 64, PF_HINT);                  \
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
#define DEFINE_LINEAR(NAME, ROWS, WT)                                                         \
void NAME(const float *x, int64_t ldx, const WT *w, const float *bias, float *y, int64_t ldy, \
          int M, int N, int K) {                                                             \
    const int panels = (N + NR - 1) / NR;                                                    \
    const int per_chunk = panels / (omp_get_max_threads() * 8) > 1                           \
                          ? panels / (omp_get_max_threads() * 8) : 1;                        \
    const int runs = (panels + per_chunk - 1) / per_chunk;                                   \
    const int row_blocks = (M + MC - 1) / MC;                                                \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                         \
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
}
DEFINE_LINEAR(loom_linear_f32, rows_f32, float)
DEFINE_LINEAR(loom_linear_bf16, rows_bf16, uint16_t)
