/* The element-wise parts of a FLUX transformer block (worker/pixels/flux_forward.py), float32,
 * each one pass over memory.
 *
 * A FLUX step on a CPU is compute-bound in its matmuls and attention, but in PyTorch the ops
 * between them were a quarter of it: LayerNorm then the modulation (two passes and a fresh
 * tensor), the q/k RMSNorm (pow, mean, rsqrt, two muls: five passes) then rope (a complex
 * multiply), tanh-GELU (four passes). Here each is one pass over rows that are still in cache,
 * written in place where the input is not needed again. The math is diffusers'.
 *
 * Rows are independent; calls split rows across threads (a FLUX call has thousands of rows).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* Rows times features below which one thread does it all (a fork costs more than the work). */
#define PARALLEL_MIN 65536

/* out[s, r] = LayerNorm(x[s, r]) * (1 + scale[s]) + shift[s]: diffusers' AdaLayerNorm(Zero)
 * with an affine-free LayerNorm. x and out [samples, rows, dim] contiguous; shift and scale
 * rows `mod_ld` floats apart (views into the modulation's [samples, k * dim] output). */
void loom_flux_modulated_norm(const float *x, float *out, int samples, int rows, int dim,
                              const float *shift, const float *scale, int64_t mod_ld,
                              float eps) {
    const int64_t total = (int64_t)samples * rows;
#pragma omp parallel for if (total * dim >= PARALLEL_MIN)
    for (int64_t i = 0; i < total; i++) {
        const float *restrict xr = x + i * dim;
        float *restrict o = out + i * dim;
        const float *restrict sh = shift + (i / rows) * mod_ld;
        const float *restrict sc = scale + (i / rows) * mod_ld;
        float sum = 0.f;
        for (int c = 0; c < dim; c++) sum += xr[c];
        const float mean = sum / (float)dim;
        float var = 0.f;
        for (int c = 0; c < dim; c++) {
            const float d = xr[c] - mean;
            var += d * d;
        }
        const float inv = 1.f / sqrtf(var / (float)dim + eps);
        for (int c = 0; c < dim; c++) o[c] = (xr[c] - mean) * inv * (1.f + sc[c]) + sh[c];
    }
}

/* In place, every head of every row: RMSNorm over head_dim times the norm's weight (w_text for
 * the first `text_rows` rows of a sample, w_image for the rest), then the image rows rotated:
 * consecutive pairs (a, b) by rope[j] = (cos, sin) of row j - text_rows, as complex products
 * (diffusers' apply_rotary_emb, use_real_unbind_dim=-1). Rows `ld` floats apart, samples
 * `sample_ld` apart; a row's heads are contiguous. rope: [rows - text_rows][head_dim / 2][2]. */
void loom_flux_qk_norm_rope(float *x, int samples, int rows, int64_t sample_ld, int64_t ld,
                            int heads, int head_dim, int text_rows, const float *w_text,
                            const float *w_image, const float *rope, float eps) {
    const int64_t total = (int64_t)samples * rows;
    const int half = head_dim / 2;
#pragma omp parallel for if (total * heads * head_dim >= PARALLEL_MIN)
    for (int64_t i = 0; i < total; i++) {
        const int r = (int)(i % rows);
        float *row = x + (i / rows) * sample_ld + r * ld;
        const float *restrict w = r < text_rows ? w_text : w_image;
        const float *restrict turn = r < text_rows ? 0 : rope + (int64_t)(r - text_rows) * head_dim;
        for (int h = 0; h < heads; h++) {
            float *restrict v = row + (int64_t)h * head_dim;
            float sum = 0.f;
            for (int c = 0; c < head_dim; c++) sum += v[c] * v[c];
            const float inv = 1.f / sqrtf(sum / (float)head_dim + eps);
            for (int c = 0; c < head_dim; c++) v[c] = v[c] * inv * w[c];
            if (turn == 0) continue;
            for (int p = 0; p < half; p++) {
                const float a = v[2 * p], b = v[2 * p + 1];
                const float cs = turn[2 * p], sn = turn[2 * p + 1];
                v[2 * p] = a * cs - b * sn;
                v[2 * p + 1] = b * cs + a * sn;
            }
        }
    }
}

/* dst = 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), x = src: torch's
 * gelu(approximate="tanh") (the sigmoid form: expf vectorises, tanhf does not everywhere).
 * `rows` rows of `cols`, each matrix's rows `ld` floats apart (column slices of wider ones);
 * dst may be src. */
void loom_flux_gelu_tanh(const float *src, int64_t ld_src, float *dst, int64_t ld_dst,
                         int64_t rows, int cols) {
    const float k = 1.5957691216057308f; /* 2 sqrt(2 / pi) */
#pragma omp parallel for if (rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = src + r * ld_src;
        float *y = dst + r * ld_dst;
        for (int c = 0; c < cols; c++) {
            const float a = x[c];
            /* (the exponent capped: past 80 the result is 0 either way, and no inf appears
               where -ffast-math assumes there is none) */
            y[c] = a / (1.f + expf(fminf(-k * (a + 0.044715f * a * a * a), 80.f)));
        }
    }
}
