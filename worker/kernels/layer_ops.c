/* The element-wise parts of a float32 decoder layer (a bfloat16 model's too: it computes in
 * float32), each one pass over memory.
 *
 * In PyTorch each of these is 4-8 small ops (RMSNorm: float, pow, mean, add, rsqrt, mul, to,
 * mul), every one a dispatch of a few microseconds and a fresh tensor; at decode sizes the
 * dispatches, not the arithmetic, are the cost (about a third of a one-token step of
 * SmolLM2-135M's 30 layers; docs/performance.md). The math is Hugging Face Llama's.
 *
 * Rows are independent; large calls (prefill) split rows across threads. decoder.c calls the
 * one-row functions (`*_row`) from inside its parallel region: an exported function's own
 * `omp parallel for`, even one its `if` turns off, opens a nested region there, ~0.6 us a call
 * (4 calls a row and layer: 0.07 ms a row in a 30-layer decode step).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Rows times features below which one thread does it all (a fork costs more than the work). */
#define PARALLEL_MIN 65536

static inline void norm_row(const float *restrict x, const float *restrict w,
                            float *restrict out, int dim, float eps) {
    float sum = 0.f;
    for (int i = 0; i < dim; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

/* out = rmsnorm(x) * w; x rows `ldx` apart, out contiguous. */
void loom_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int rows, int dim,
                   float eps) {
#pragma omp parallel for if ((int64_t)rows * dim >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++)
        norm_row(x + r * ldx, w, out + (int64_t)r * dim, dim, eps);
}

/* residual += delta; out = rmsnorm(residual) * w (the residual add of one sub-layer fused with
 * the norm that opens the next). */
static inline void add_norm_row(float *h, const float *d, const float *w, float *out, int dim,
                                float eps) { /* (d may be out: read before out is written) */
    for (int i = 0; i < dim; i++) h[i] += d[i];
    norm_row(h, w, out, dim, eps);
}

void loom_add_rms_norm(float *residual, const float *delta, const float *w, float *out, int rows,
                       int dim, float eps) {
#pragma omp parallel for if ((int64_t)rows * dim >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++)
        add_norm_row(residual + (int64_t)r * dim, delta + (int64_t)r * dim, w,
                     out + (int64_t)r * dim, dim, eps);
}

static inline void rotate(float *restrict x, const float *restrict c, const float *restrict s,
                          int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* float32 -> bfloat16, rounded to nearest even (as PyTorch's .to(torch.bfloat16)). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* qkv rows are [q heads | k heads | v heads] of head_dim each. Rotates q and k in place
 * (rotate-half convention; cos/sin tables [positions, head_dim]) and copies k and v into the
 * cache slot of each row (cache [slots, kv_heads, head_dim]), as float32 or rounded to
 * bfloat16 (a bfloat16 model computes in float32 but keeps its cache in bfloat16). */
#define DEFINE_ROPE_STORE_KV(NAME, CT, STORE)                                                \
static inline void NAME##_row(float *row, int heads, int kv_heads, int head_dim,             \
                              int64_t position, const float *cos_table,                      \
                              const float *sin_table, CT *k_cache, CT *v_cache,              \
                              int64_t slot) {                                                \
    const int64_t kv_row = (int64_t)kv_heads * head_dim;                                     \
    const float *c = cos_table + position * head_dim, *s = sin_table + position * head_dim;  \
    for (int h = 0; h < heads + kv_heads; h++)                                               \
        rotate(row + (int64_t)h * head_dim, c, s, head_dim / 2);                             \
    CT *k_dst = k_cache + slot * kv_row, *v_dst = v_cache + slot * kv_row;                   \
    const float *k = row + (int64_t)heads * head_dim, *v = k + kv_row;                       \
    for (int64_t i = 0; i < kv_row; i++) {                                                   \
        k_dst[i] = STORE(k[i]);                                                              \
        v_dst[i] = STORE(v[i]);                                                              \
    }                                                                                        \
}                                                                                            \
void NAME(float *qkv, int rows, int heads, int kv_heads, int head_dim,                       \
          const int64_t *positions, const float *cos_table, const float *sin_table,          \
          CT *k_cache, CT *v_cache, const int64_t *slots) {                                  \
    const int64_t width = (int64_t)(heads + 2 * kv_heads) * head_dim;                        \
    _Pragma("omp parallel for if ((int64_t)rows * width >= PARALLEL_MIN)")                   \
    for (int r = 0; r < rows; r++)                                                           \
        NAME##_row(qkv + r * width, heads, kv_heads, head_dim, positions[r], cos_table,      \
                   sin_table, k_cache, v_cache, slots[r]);                                   \
}
#define STORE_F32(x) (x)
DEFINE_ROPE_STORE_KV(loom_rope_store_kv, float, STORE_F32)
DEFINE_ROPE_STORE_KV(loom_rope_store_kv_bf16, uint16_t, f32_to_bf16)

/* out = silu(gate) * up, gate_up rows [gate | up] of `inter` each. */
static inline void silu_mul_row(const float *restrict g, float *restrict o, int inter) {
    const float *u = g + inter;
    for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

void loom_silu_mul(const float *gate_up, float *out, int rows, int inter) {
#pragma omp parallel for if ((int64_t)rows * inter >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++)
        silu_mul_row(gate_up + (int64_t)r * 2 * inter, out + (int64_t)r * inter, inter);
}

/* out = gelu_tanh(gate) * up (Gemma's MLP), gate_up rows [gate | up] of `inter` each:
   0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as torch's gelu(approximate="tanh"). */
static inline void gelu_tanh_mul_row(const float *restrict g, float *restrict o, int inter) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    const float *u = g + inter;
    for (int i = 0; i < inter; i++) {
        float x = g[i];
        o[i] = 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x))) * u[i];
    }
}

void loom_gelu_tanh_mul(const float *gate_up, float *out, int rows, int inter) {
#pragma omp parallel for if ((int64_t)rows * inter >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++)
        gelu_tanh_mul_row(gate_up + (int64_t)r * 2 * inter, out + (int64_t)r * inter, inter);
}
