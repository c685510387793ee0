/* FLUX's joint attention, float32: every query row attends to every key (no mask, no cache),
 * out = softmax(scale * q k^T) v per sample and head. (worker/pixels/flux_attention.py)
 *
 * A FLUX step on a CPU spends about half its time here: at 768 keys and head_dim 64, PyTorch's
 * CPU flash kernel runs at ~37 GMAC/s on one Zen 4 core, where a blocked sgemm reaches ~50.
 * This kernel is two small GEMMs per block of query rows, with the whole row of scores in
 * between (a FLUX sequence is short: a block's scores, the head's K^T and V stay in L2):
 *
 *   1. S = (scale q) K^T for up to QB rows: K packed transposed once per sample and head
 *      ([head_dim][keys], keys padded to 32), tiles of 8 rows x 32 keys (16 accumulators):
 *      a step of the inner loop is 2 loads, 8 broadcasts, 16 FMAs;
 *   2. each row's softmax over the keys, exactly (max, exp, sum; the row is all there);
 *   3. O = P V: tiles of 6 rows x 64 columns (24 accumulators), V read where it is (a key's
 *      head is a contiguous row): a key is 4 loads, 6 broadcasts, 24 FMAs; rows divided by
 *      their sums on the way out.
 *
 * Tasks are (sample, head, block of rows), split across threads. AVX-512 only (the build
 * reports whether it has it: loom_flux_attention_available); elsewhere PyTorch's kernel runs.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 48     /* query rows a task */
#define KEY_PAD 32 /* keys are packed in multiples of this (phase 1's tile width) */

#ifdef __AVX512F__
#include <immintrin.h>

int loom_flux_attention_available(void) { return 1; }

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* The lanes of a 16-key vector that are real keys, `left` of them remaining. */
static inline __mmask16 real_keys(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* S[r][j] (r < 8, j < keys_pad) = sum_c qs[r][c] kt[c][j]. (Taking the rows' maxima here
 * too cost more than a pass over the row later: the tile's 16 accumulators need the registers.) */
static void scores_8(const float *restrict qs, const float *restrict kt, float *restrict s,
                     int head_dim, int64_t keys_pad) {
    for (int64_t j = 0; j < keys_pad; j += 32) {
        __m512 a[8][2];
        for (int r = 0; r < 8; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
        const float *col = kt + j;
        for (int c = 0; c < head_dim; c++, col += keys_pad) {
            const __m512 k0 = _mm512_load_ps(col), k1 = _mm512_load_ps(col + 16);
            for (int r = 0; r < 8; r++) {
                const __m512 q = _mm512_set1_ps(qs[r * head_dim + c]);
                a[r][0] = _mm512_fmadd_ps(q, k0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(q, k1, a[r][1]);
            }
        }
        for (int r = 0; r < 8; r++) {
            _mm512_store_ps(s + r * keys_pad + j, a[r][0]);
            _mm512_store_ps(s + r * keys_pad + j + 16, a[r][1]);
        }
    }
}

/* exp(x) for x <= 0 (softmax's arguments): x = n ln2 + f, |f| <= ln2 / 2 (ln2 in two parts,
 * so f is exact to float rounding), exp(f) by its Taylor series to f^6 (relative error
 * < 2e-7), times 2^n by vscalefps (which underflows to 0 gracefully). libm's vectorised expf
 * was 15% of this kernel's time. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* A row of scores (keys_pad of them, the first `keys` real) to exp(s - max), the padding to
 * zero (its zero scores are left out of the max too: a max above every real score would push
 * their exponentials toward underflow); returns 1 / sum. */
static float softmax_row(float *restrict s, int64_t keys_pad, int keys) {
    __m512 mx = _mm512_set1_ps(-FLT_MAX);
    for (int64_t j = 0; j < keys_pad; j += 16)
        mx = _mm512_mask_max_ps(mx, real_keys(keys - j), mx, _mm512_load_ps(s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys_pad; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(real_keys(keys - j),
                                             exp_ps(_mm512_sub_ps(_mm512_load_ps(s + j), m)));
        _mm512_store_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.f / _mm512_reduce_add_ps(sum);
}

/* out rows r < rows (6-row tile, `width` = 16 * W columns from column c0) = P V. */
#define DEFINE_PV(NAME, W)                                                                     \
    static void NAME(const float *restrict p, int64_t keys_pad, int keys,                      \
                     const float *restrict v, int64_t v_ld, int c0, const float *inv,          \
                     float *out, int64_t out_ld, int rows) {                                   \
        __m512 a[6][W];                                                                        \
        for (int r = 0; r < 6; r++)                                                            \
            for (int w = 0; w < W; w++) a[r][w] = _mm512_setzero_ps();                         \
        const float *vr = v + c0;                                                              \
        for (int j = 0; j < keys; j++, vr += v_ld) {                                           \
            __m512 x[W];                                                                       \
            for (int w = 0; w < W; w++) x[w] = _mm512_loadu_ps(vr + 16 * w);                   \
            for (int r = 0; r < 6; r++) {                                                      \
                const __m512 b = _mm512_set1_ps(p[r * keys_pad + j]);                          \
                for (int w = 0; w < W; w++) a[r][w] = _mm512_fmadd_ps(b, x[w], a[r][w]);       \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < rows; r++) {                                                       \
            const __m512 scale = _mm512_set1_ps(inv[r]);                                       \
            for (int w = 0; w < W; w++)                                                        \
                _mm512_storeu_ps(out + r * out_ld + c0 + 16 * w,                               \
                                 _mm512_mul_ps(a[r][w], scale));                               \
        }                                                                                      \
    }
DEFINE_PV(pv_6x64, 4)
DEFINE_PV(pv_6x16, 1)

/* One task: rows [i0, i0 + n) of sample b, head h. s: (QB + 8) x keys_pad scratch, zeroed
 * once (rows past n are read by the tiles, never stored). */
static void attend_block(const float *q, int64_t q_sb, int64_t q_si, const float *kt,
                         const float *v, int64_t v_ld, float *out, int64_t out_ld, int Sq,
                         int keys, int64_t keys_pad, int head_dim, int b, int h, int i0,
                         int n, float scale, float *qs, float *s) {
    for (int r = 0; r < round_up(n, 8); r++) {
        float *dst = qs + (int64_t)r * head_dim;
        if (r >= n) {
            memset(dst, 0, sizeof(float) * head_dim);
            continue;
        }
        const float *src = q + b * q_sb + (int64_t)(i0 + r) * q_si + (int64_t)h * head_dim;
        for (int c = 0; c < head_dim; c++) dst[c] = src[c] * scale;
    }
    for (int r = 0; r < n; r += 8)
        scores_8(qs + (int64_t)r * head_dim, kt, s + r * keys_pad, head_dim, keys_pad);
    float inv[QB];
    for (int r = 0; r < n; r++) inv[r] = softmax_row(s + r * keys_pad, keys_pad, keys);
    float *o = out + ((int64_t)b * Sq + i0) * out_ld + (int64_t)h * head_dim;
    for (int r = 0; r < n; r += 6) {
        const int rows = n - r < 6 ? n - r : 6;
        int c = 0;
        for (; c + 64 <= head_dim; c += 64)
            pv_6x64(s + r * keys_pad, keys_pad, keys, v, v_ld, c, inv + r, o + r * out_ld,
                    out_ld, rows);
        for (; c < head_dim; c += 16)
            pv_6x16(s + r * keys_pad, keys_pad, keys, v, v_ld, c, inv + r, o + r * out_ld,
                    out_ld, rows);
    }
}

/* q [B, Sq, H, d], k and v [B, S, H, d] (rows and samples strided, each row's heads
 * contiguous); out [B, Sq, H, d], rows out_ld floats apart (>= H d: a column slice of a wider
 * tensor), samples Sq rows apart. head_dim a multiple of 16. Returns 0, or -1 if
 * its scratch memory could not be had (out is then not to be used). */
int loom_flux_attention(const float *q, int64_t q_sb, int64_t q_si, const float *k,
                        int64_t k_sb, int64_t k_sj, const float *v, int64_t v_sb, int64_t v_sj,
                        float *out, int64_t out_ld, int B, int Sq, int S, int H, int head_dim,
                        float scale) {
    const int64_t keys_pad = round_up(S, KEY_PAD);
    const int64_t per_head = keys_pad * head_dim;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(B * H) * per_head);
    if (!kt) return -1;
    /* Pack each sample and head's K transposed, keys zero-padded: 16 keys at a time, so the
     * rows read stay in L1 and each write is a 64-byte run. */
#pragma omp parallel for
    for (int bh = 0; bh < B * H; bh++) {
        const int b = bh / H, h = bh % H;
        float *t = kt + bh * per_head;
        const float *kh = k + b * k_sb + (int64_t)h * head_dim;
        for (int64_t j0 = 0; j0 < keys_pad; j0 += 16) {
            const int n = S - j0 < 16 ? (int)(S - j0 > 0 ? S - j0 : 0) : 16;
            for (int c = 0; c < head_dim; c++) {
                float *dst = t + c * keys_pad + j0;
                for (int jj = 0; jj < 16; jj++)
                    dst[jj] = jj < n ? kh[(j0 + jj) * k_sj + c] : 0.f;
            }
        }
    }
    const int blocks = (Sq + QB - 1) / QB;
    int failed = 0;
#pragma omp parallel
    {
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(QB + 8) * keys_pad);
        float *qs = aligned_alloc(64, sizeof(float) * (size_t)(QB + 8) * head_dim);
        if (s) memset(s, 0, sizeof(float) * (size_t)(QB + 8) * keys_pad);
#pragma omp for schedule(dynamic)
        for (int task = 0; task < B * H * blocks; task++) {
            if (!s || !qs) {
                failed = 1;
                continue;
            }
            const int bh = task / blocks, i0 = (task % blocks) * QB;
            const int n = Sq - i0 < QB ? Sq - i0 : QB;
            const int b = bh / H, h = bh % H;
            attend_block(q, q_sb, q_si, kt + bh * per_head,
                         v + b * v_sb + (int64_t)h * head_dim, v_sj, out, out_ld, Sq, S,
                         keys_pad, head_dim, b, h, i0, n, scale, qs, s);
        }
        free(s);
        free(qs);
    }
    free(kt);
    return failed ? -1 : 0;
}

#else
int loom_flux_attention_available(void) { return 0; }

int loom_flux_attention(const float *q, int64_t q_sb, int64_t q_si, const float *k,
                        int64_t k_sb, int64_t k_sj, const float *v, int64_t v_sb, int64_t v_sj,
                        float *out, int64_t out_ld, int B, int Sq, int S, int H, int head_dim,
                        float scale) {
    return -2; /* (never called: loom_flux_attention_available says so) */
}
#endif
