/* y = x @ W^T (+ bias) with W kept in its GGUF block format: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q4_K, Q5_K or Q6_K, rows of blocks exactly as the file stores them.
 *
 * Why: decoding one token reads every weight once, so its time is the bytes of the weights
 * over the memory bandwidth. SmolLM2-135M's linear layers are 540 MB in float32 and ~96 MB as
 * its GGUF file stores them (Q4_1, Q8_0 lm_head): dequantizing at load time would throw the
 * difference away.
 *
 * Integer path (loom_quant_linear; what llama.cpp does): each row of x is quantized once per
 * call to 8 bits per 32-element block (x^ = d_x * q_x, |x - x^| <= d_x / 2), so a weight
 * block meets its activations in integer multiply-adds (the SIMD section below) and one float
 * multiply-add per block, instead of widening every weight to float32: several times the
 * float32 kernel's speed at one row, where the weights' bytes decide, and about as fast at
 * hundreds of rows, where the arithmetic does (docs/performance.md). Every format's weights are
 * w = d * q + o per 32 (Q6_K: per 16; q unsigned, Q8_0's signed), so
 *     sum_i w_i x^_i = d d_x sum_i q_i q_x_i  +  o d_x sum_i q_x_i,
 * the first an integer dot product per block, the second the block's offset against the sum
 * of its quantized activations, added after the loop. The result is exactly x^ @ W^T up to
 * float32 rounding, and a row's result does not depend on the other rows of the call.
 *
 * Tiling: an R x C tile of (activation rows x weight rows) walks K once: each weight block is
 * unpacked once for R rows, each activation block loaded once for C weight rows, R x C float
 * accumulators stay in registers. At one row (decode) that is a GEMV reading each weight byte
 * once; at more rows a C-row weight tile stays in L1 while all row tiles of a row block pass
 * over it. OpenMP hands out (row block x run of weight tiles) chunks dynamically, as
 * packed_linear.c does, and quantizes x in the same parallel region.
 *
 * Float32 path (loom_quant_linear_f32, for prefill-sized calls): W dequantized one panel at a
 * time into packed_linear.c's layout and multiplied by its float32 tile; see below.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -- the SIMD operations the kernels are written in ------------------------------------------
 *
 * For each instruction set: AVX2 (with VNNI's dpbusd where the CPU has it: AVX-512 VNNI or
 * AVX-VNNI), NEON (with the dot-product extension where present), and portable C.
 *
 * Everything works on 32 8-bit values at a time (`q32`: one 32-weight block, or the 32
 * quantized activations it multiplies): unpacking 4-, 5- and 6-bit fields into bytes, and
 * integer dot products of unsigned weights (0..63) or signed ones (Q8_0) with signed
 * activations (-127..127) into a vector of int32 partial sums (`isum`), which `facc_fma` turns
 * into float32 and accumulates. Keeping the ISA-specific code here lets the block formats and
 * the tiling be written once.
 *
 * LOOM_QUANT_GENERIC forces the portable path, LOOM_QUANT_EMULATE_VNNI runs the VNNI path
 * with dpbusd computed in C and LOOM_QUANT_NO_VNNI the AVX2 path without it: they let a test
 * check code this CPU would not otherwise run.
 * (One file with the rest, not a header: every source of worker/kernels/ is a kernel.)
 */
#if defined(LOOM_QUANT_GENERIC)
#define QS_GENERIC 1
#elif defined(__AVX2__)
#define QS_AVX2 1
#include <immintrin.h>
#if ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__) || \
     defined(LOOM_QUANT_EMULATE_VNNI)) && !defined(LOOM_QUANT_NO_VNNI)
#define QS_VNNI 1
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define QS_NEON 1
#include <arm_neon.h>
#else
#define QS_GENERIC 1
#endif

#define QS_INLINE static inline __attribute__((always_inline))

/* -- half precision scales ---------------------------------------------------------------- */

QS_INLINE float qs_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2); /* block fields are not aligned (a Q6_K block is 210 bytes) */
#if defined(__F16C__) && !defined(QS_GENERIC)
    return _cvtsh_ss(h);
#elif defined(QS_NEON)
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F,
                   man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else { /* zero or subnormal: man * 2^-24, exactly representable */
        float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Two adjacent half floats (a block's d and m, or d and dmin) in one conversion. */
QS_INLINE void qs_f16x2(const uint8_t *p, float *a, float *b) {
#if defined(__F16C__) && !defined(QS_GENERIC)
    uint32_t u;
    memcpy(&u, p, 4);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128((int)u));
    *a = _mm_cvtss_f32(v);
    *b = _mm_cvtss_f32(_mm_movehdup_ps(v));
#else
    *a = qs_f16(p);
    *b = qs_f16(p + 2);
#endif
}

#if defined(QS_AVX2) /* ============================================================== AVX2 */

typedef __m256i q32;
typedef __m256i isum;
typedef __m256 fvec;

QS_INLINE q32 q_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
QS_INLINE void q_store(void *p, q32 v) { _mm256_storeu_si256((__m256i *)p, v); }
QS_INLINE q32 q_or(q32 a, q32 b) { return _mm256_or_si256(a, b); }

/* 16 bytes of nibble pairs -> [16 low nibbles, 16 high nibbles] (the Q4_0..Q5_1 order). */
QS_INLINE q32 q_nibbles16(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* The low (hi == 0) or high nibbles of 32 bytes (the K-quant order). */
QS_INLINE q32 q_nibbles32(const uint8_t *p, const int hi) {
    const __m256i v = q_load(p);
    return _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

/* Byte i = 16 if bit i of `bits` is set, else 0: the fifth bit of Q5_0 / Q5_1. */
QS_INLINE q32 q_bits32(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(  /* byte i <- byte i / 8 of bits */
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Byte i = 16 if bit j of p[i] is set, else 0: the fifth bit of Q5_K. */
QS_INLINE q32 q_bit_of(const uint8_t *p, const int j) {
    const __m256i bit = _mm256_set1_epi8((char)(1 << j));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(q_load(p), bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Byte i = ((p[i] >> shift) & 3) << 4: the two high bits of Q6_K. (A register shift count:
 * `shift` need not be a compile-time constant.) */
QS_INLINE q32 q_2bits_of(const uint8_t *p, const int shift) {
    const __m256i v = _mm256_srl_epi16(q_load(p), _mm_cvtsi32_si128(shift));
    return _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi8(3)), 4);
}

#if defined(LOOM_QUANT_EMULATE_VNNI)
QS_INLINE __m256i qs_dpbusd(__m256i acc, __m256i u, __m256i s) {
    uint8_t a[32];
    int8_t b[32];
    int32_t c[8];
    memcpy(a, &u, 32);
    memcpy(b, &s, 32);
    memcpy(c, &acc, 32);
    for (int i = 0; i < 32; i++) c[i / 4] += (int32_t)a[i] * b[i];
    return _mm256_loadu_si256((const __m256i *)c);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define qs_dpbusd _mm256_dpbusd_epi32
#elif defined(QS_VNNI)
#define qs_dpbusd _mm256_dpbusd_avx_epi32
#endif

/* Sum of 4 adjacent products of unsigned weights (0..127) and signed activations per lane.
 * maddubs adds pairs into int16: 2 x 63 x 127 cannot saturate. */
QS_INLINE isum dot_u(q32 w, q32 x) {
#if defined(QS_VNNI)
    return qs_dpbusd(_mm256_setzero_si256(), w, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

/* Signed weights: the products are unchanged if the weight's sign moves onto the activation,
 * which makes the weight unsigned (|-128| = 128 still fits a byte; 2 x 128 x 127 does not
 * saturate since activations stay within +-127). */
QS_INLINE isum dot_s(q32 w, q32 x) { return dot_u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

/* Q6_K: unsigned weights whose first and second 16 carry their own integer scales. */
QS_INLINE isum dot_u_scaled(q32 w, q32 x, int sc0, int sc1) {
    const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)sc1), _mm_set1_epi16((short)sc0));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scales);
}

QS_INLINE fvec f_zero(void) { return _mm256_setzero_ps(); }
QS_INLINE fvec f_splat(float v) { return _mm256_set1_ps(v); }
QS_INLINE fvec f_splat_load(const float *p) { return _mm256_broadcast_ss(p); }
QS_INLINE fvec facc_fma(fvec acc, isum s, fvec scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
}
QS_INLINE float f_sum(fvec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Quantize 32 activations: q = round(x / d) with d = max|x| / 127 (round half to even: the
 * MXCSR default), and the sums of q over each half (the offsets' activation side). */
QS_INLINE float quantize32(const float *x, int8_t *q, int32_t sums[2]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f, id = d ? 1.0f / d : 0.0f;
    __m256i n[4];
    for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    /* int32 -> int8: packs interleaves 128-bit lanes; the permute puts them back in order. */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    q_store(q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i lo = _mm256_add_epi32(n[0], n[1]), hi = _mm256_add_epi32(n[2], n[3]);
    const __m256i both = _mm256_hadd_epi32(lo, hi); /* [lo0+lo1, .., hi0+hi1, ..] per lane */
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    sums[0] = _mm_extract_epi32(s, 0) + _mm_extract_epi32(s, 1);
    sums[1] = _mm_extract_epi32(s, 2) + _mm_extract_epi32(s, 3);
    return d;
}

#elif defined(QS_NEON) /* ========================================================== NEON */

typedef struct { int8x16_t lo, hi; } q32;
typedef int32x4_t isum;
typedef float32x4_t fvec;

QS_INLINE q32 q_load(const void *p) {
    return (q32){vld1q_s8((const int8_t *)p), vld1q_s8((const int8_t *)p + 16)};
}
QS_INLINE void q_store(void *p, q32 v) {
    vst1q_s8((int8_t *)p, v.lo);
    vst1q_s8((int8_t *)p + 16, v.hi);
}
QS_INLINE q32 q_or(q32 a, q32 b) { return (q32){vorrq_s8(a.lo, b.lo), vorrq_s8(a.hi, b.hi)}; }

QS_INLINE q32 q_nibbles16(const uint8_t *p) {
    const uint8x16_t t = vld1q_u8(p);
    return (q32){vreinterpretq_s8_u8(vandq_u8(t, vdupq_n_u8(0x0F))),
                 vreinterpretq_s8_u8(vshrq_n_u8(t, 4))};
}

QS_INLINE q32 q_nibbles32(const uint8_t *p, const int hi) {
    const uint8x16_t a = vld1q_u8(p), b = vld1q_u8(p + 16), m = vdupq_n_u8(0x0F);
    if (hi)
        return (q32){vreinterpretq_s8_u8(vshrq_n_u8(a, 4)), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))};
    return (q32){vreinterpretq_s8_u8(vandq_u8(a, m)), vreinterpretq_s8_u8(vandq_u8(b, m))};
}

QS_INLINE int8x16_t qs_bits16(uint32_t bits16) { /* byte i = 16 if bit i of bits16 */
    const uint8x16_t spread = vcombine_u8(vdup_n_u8((uint8_t)bits16), vdup_n_u8((uint8_t)(bits16 >> 8)));
    const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ULL));
    return vreinterpretq_s8_u8(vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(0x10)));
}
QS_INLINE q32 q_bits32(uint32_t bits) { return (q32){qs_bits16(bits & 0xFFFF), qs_bits16(bits >> 16)}; }

QS_INLINE q32 q_bit_of(const uint8_t *p, const int j) {
    const uint8x16_t bit = vdupq_n_u8((uint8_t)(1 << j)), sixteen = vdupq_n_u8(0x10);
    return (q32){vreinterpretq_s8_u8(vandq_u8(vtstq_u8(vld1q_u8(p), bit), sixteen)),
                 vreinterpretq_s8_u8(vandq_u8(vtstq_u8(vld1q_u8(p + 16), bit), sixteen))};
}

QS_INLINE q32 q_2bits_of(const uint8_t *p, const int shift) {
    const int8x16_t right = vdupq_n_s8((int8_t)-shift); /* a negative left shift */
    const uint8x16_t three = vdupq_n_u8(3);
    const uint8x16_t a = vandq_u8(vshlq_u8(vld1q_u8(p), right), three);
    const uint8x16_t b = vandq_u8(vshlq_u8(vld1q_u8(p + 16), right), three);
    return (q32){vreinterpretq_s8_u8(vshlq_n_u8(a, 4)), vreinterpretq_s8_u8(vshlq_n_u8(b, 4))};
}

/* NEON multiplies signed by signed: unsigned weights below 128 are the same bytes. */
QS_INLINE int32x4_t qs_dot16(int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), w, x);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    const int16x8_t hi = vmull_high_s8(w, x);
    return vpadalq_s16(vpaddlq_s16(lo), hi);
#endif
}
QS_INLINE isum dot_u(q32 w, q32 x) { return vaddq_s32(qs_dot16(w.lo, x.lo), qs_dot16(w.hi, x.hi)); }
QS_INLINE isum dot_s(q32 w, q32 x) { return dot_u(w, x); }
QS_INLINE isum dot_u_scaled(q32 w, q32 x, int sc0, int sc1) {
    return vmlaq_n_s32(vmulq_n_s32(qs_dot16(w.lo, x.lo), sc0), qs_dot16(w.hi, x.hi), sc1);
}

QS_INLINE fvec f_zero(void) { return vdupq_n_f32(0.0f); }
QS_INLINE fvec f_splat(float v) { return vdupq_n_f32(v); }
QS_INLINE fvec f_splat_load(const float *p) { return vld1q_dup_f32(p); }
QS_INLINE fvec facc_fma(fvec acc, isum s, fvec scale) { return vfmaq_f32(acc, vcvtq_f32_s32(s), scale); }
QS_INLINE float f_sum(fvec v) { return vaddvq_f32(v); }

QS_INLINE float quantize32(const float *x, int8_t *q, int32_t sums[2]) {
    float32x4_t v[8];
    float32x4_t amax = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; i++) {
        v[i] = vld1q_f32(x + 4 * i);
        amax = vmaxq_f32(amax, vabsq_f32(v[i]));
    }
    const float d = vmaxvq_f32(amax) / 127.0f, id = d ? 1.0f / d : 0.0f;
    int32x4_t n[8];
    for (int i = 0; i < 8; i++) n[i] = vcvtnq_s32_f32(vmulq_n_f32(v[i], id)); /* half to even */
    for (int h = 0; h < 2; h++) {
        const int32x4_t *m = n + 4 * h;
        const int16x8_t a = vcombine_s16(vmovn_s32(m[0]), vmovn_s32(m[1]));
        const int16x8_t b = vcombine_s16(vmovn_s32(m[2]), vmovn_s32(m[3]));
        vst1q_s8(q + 16 * h, vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
        sums[h] = vaddvq_s32(vaddq_s32(vaddq_s32(m[0], m[1]), vaddq_s32(m[2], m[3])));
    }
    return d;
}

#else /* ================================================================== portable C */

typedef struct { int8_t v[32]; } q32;
typedef int32_t isum;
typedef float fvec;

QS_INLINE q32 q_load(const void *p) {
    q32 r;
    memcpy(r.v, p, 32);
    return r;
}
QS_INLINE void q_store(void *p, q32 v) { memcpy(p, v.v, 32); }
QS_INLINE q32 q_or(q32 a, q32 b) {
    for (int i = 0; i < 32; i++) a.v[i] |= b.v[i];
    return a;
}
QS_INLINE q32 q_nibbles16(const uint8_t *p) {
    q32 r;
    for (int i = 0; i < 16; i++) {
        r.v[i] = (int8_t)(p[i] & 0x0F);
        r.v[i + 16] = (int8_t)(p[i] >> 4);
    }
    return r;
}
QS_INLINE q32 q_nibbles32(const uint8_t *p, const int hi) {
    q32 r;
    for (int i = 0; i < 32; i++) r.v[i] = (int8_t)((p[i] >> (hi ? 4 : 0)) & 0x0F);
    return r;
}
QS_INLINE q32 q_bits32(uint32_t bits) {
    q32 r;
    for (int i = 0; i < 32; i++) r.v[i] = (int8_t)(((bits >> i) & 1) << 4);
    return r;
}
QS_INLINE q32 q_bit_of(const uint8_t *p, const int j) {
    q32 r;
    for (int i = 0; i < 32; i++) r.v[i] = (int8_t)(((p[i] >> j) & 1) << 4);
    return r;
}
QS_INLINE q32 q_2bits_of(const uint8_t *p, const int shift) {
    q32 r;
    for (int i = 0; i < 32; i++) r.v[i] = (int8_t)(((p[i] >> shift) & 3) << 4);
    return r;
}
/* (Unsigned weights are below 128: as int8 they are the same numbers.) */
QS_INLINE isum dot_u(q32 w, q32 x) {
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int32_t)w.v[i] * x.v[i];
    return s;
}
QS_INLINE isum dot_s(q32 w, q32 x) { return dot_u(w, x); }
QS_INLINE isum dot_u_scaled(q32 w, q32 x, int sc0, int sc1) {
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 16; i++) {
        s0 += (int32_t)w.v[i] * x.v[i];
        s1 += (int32_t)w.v[i + 16] * x.v[i + 16];
    }
    return s0 * sc0 + s1 * sc1;
}
QS_INLINE fvec f_zero(void) { return 0.0f; }
QS_INLINE fvec f_splat(float v) { return v; }
QS_INLINE fvec f_splat_load(const float *p) { return *p; }
QS_INLINE fvec facc_fma(fvec acc, isum s, fvec scale) { return acc + (float)s * scale; }
QS_INLINE float f_sum(fvec v) { return v; }

QS_INLINE float quantize32(const float *x, int8_t *q, int32_t sums[2]) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = x[i] > amax ? x[i] : -x[i] > amax ? -x[i] : amax;
    const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
    sums[0] = sums[1] = 0;
    for (int i = 0; i < 32; i++) {
        /* round half to even, as the SIMD paths do (no libm: rint is not inlined everywhere) */
        const float v = x[i] * id, f = __builtin_floorf(v), r = v - f;
        int n = (int)f + (r > 0.5f || (r == 0.5f && ((int)f & 1)));
        q[i] = (int8_t)n;
        sums[i / 16] += n;
    }
    return d;
}

#endif


/* GGML's type numbers (gguf.GGMLQuantizationType). */
enum { QL_Q4_0 = 2, QL_Q4_1 = 3, QL_Q5_0 = 6, QL_Q5_1 = 7, QL_Q8_0 = 8,
       QL_Q4_K = 12, QL_Q5_K = 13, QL_Q6_K = 14 };

/* Tile shape: R x C accumulators plus C unpacked weight blocks and their scales must fit the
 * vector registers (16 on AVX2, 32 with AVX-512 or on aarch64). 4 x 2 was the fastest of
 * 4x2, 3x2, 2x2, 4x1, 2x3, 2x4 at 16-64 rows on the AVX2 EPYC here. (A test builds the other
 * machines' shapes here: -DLOOM_QUANT_R=4 -DLOOM_QUANT_C=4.) */
#ifndef LOOM_QUANT_R
#if defined(QS_GENERIC)
#define LOOM_QUANT_R 2 /* (scalar code: bigger tiles only make the build slower) */
#else
#define LOOM_QUANT_R 4
#endif
#endif
#ifndef LOOM_QUANT_C
#if defined(QS_GENERIC)
#define LOOM_QUANT_C 1
#elif defined(__AVX512F__) || defined(QS_NEON)
#define LOOM_QUANT_C 4
#else
#define LOOM_QUANT_C 2
#endif
#endif
#define QL_R LOOM_QUANT_R
#define QL_C LOOM_QUANT_C
/* Prefetch distance (bytes) in the weight stream: a one-row GEMV does too little work per
 * byte for the hardware prefetcher alone to hide DRAM latency (which stops at every 4 KiB
 * page). 1.2-1.5x faster one-row passes over the whole model on AVX2; 1 KiB and 4 KiB were no
 * better. */
#ifndef LOOM_QUANT_PF
#define LOOM_QUANT_PF 2048
#endif
/* Activation rows per block of work: 64 rows x 1536 int8 features stay in L2. */
#ifndef LOOM_QUANT_MC
#define LOOM_QUANT_MC 64
#endif

/* Bytes per block and 32-element blocks per block (the K-quants' 256-element super-blocks). */
QS_INLINE int ql_block_bytes(const int qt) {
    switch (qt & 0xFF) { /* (the low byte: without ql_x8's layout flag) */
    case QL_Q4_0: return 18;
    case QL_Q4_1: return 20;
    case QL_Q5_0: return 22;
    case QL_Q5_1: return 24;
    case QL_Q8_0: return 34;
    case QL_Q4_K: return 144;
    case QL_Q5_K: return 176;
    case QL_Q6_K: return 210;
    default: return 0;
    }
}
QS_INLINE int ql_subblocks(const int qt) { return (qt & 0xFF) >= QL_Q4_K ? 8 : 1; }
QS_INLINE int ql_has_offset(const int qt) { return qt != QL_Q8_0; }
/* Offsets per block: one (per 32 weights), or two for Q6_K's scales per 16. */
QS_INLINE int ql_offsets(const int qt) { return qt == QL_Q6_K ? 2 : 1; }

/* One 32-weight block, unpacked: w_i = d * sc(i) * q_i + o(i), sc(i) / o(i) the first values
 * for i < 16 and the second for the rest (only Q6_K's differ: o1 is only set for Q6_K, and sc
 * is 1 elsewhere). */
typedef struct {
    q32 q;
    float d, o0, o1;
    int sc0, sc1;
} ql_block;

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 packed bytes). */
QS_INLINE void ql_scale_min_k4(const uint8_t *s, const int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Block j (0 for the 32-element formats, 0..7 within a K-quant super-block) starting at blk. */
QS_INLINE ql_block ql_decode(const int qt, const uint8_t *blk, const int j) {
    ql_block b;
    b.sc0 = b.sc1 = 1;
    switch (qt) {
    case QL_Q4_0:
        b.d = qs_f16(blk);
        b.q = q_nibbles16(blk + 2);
        b.o0 = -8.0f * b.d;
        break;
    case QL_Q4_1:
        qs_f16x2(blk, &b.d, &b.o0);
        b.q = q_nibbles16(blk + 4);
        break;
    case QL_Q5_0: {
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        b.d = qs_f16(blk);
        b.q = q_or(q_nibbles16(blk + 6), q_bits32(qh));
        b.o0 = -16.0f * b.d;
        break;
    }
    case QL_Q5_1: {
        uint32_t qh;
        memcpy(&qh, blk + 4, 4);
        qs_f16x2(blk, &b.d, &b.o0);
        b.q = q_or(q_nibbles16(blk + 8), q_bits32(qh));
        break;
    }
    case QL_Q8_0:
        b.d = qs_f16(blk);
        b.q = q_load(blk + 2);
        b.o0 = 0.0f;
        break;
    case QL_Q4_K:
    case QL_Q5_K: { /* d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of fifth bits), nibbles */
        int sc, m;
        float d, dmin;
        ql_scale_min_k4(blk + 4, j, &sc, &m);
        qs_f16x2(blk, &d, &dmin);
        b.d = d * (float)sc;
        b.o0 = -dmin * (float)m;
        if (qt == QL_Q4_K)
            b.q = q_nibbles32(blk + 16 + 32 * (j / 2), j & 1);
        else
            b.q = q_or(q_nibbles32(blk + 48 + 32 * (j / 2), j & 1), q_bit_of(blk + 16, j));
        break;
    }
    case QL_Q6_K: { /* 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d */
        const int half = j / 4, part = j % 4;
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + 2 * part;
        const float d = qs_f16(blk + 208);
        b.q = q_or(q_nibbles32(blk + 64 * half + 32 * (part & 1), part >= 2),
                   q_2bits_of(blk + 128 + 32 * half, 2 * part));
        b.d = d;
        b.sc0 = sc[0];
        b.sc1 = sc[1];
        b.o0 = -32.0f * d * (float)sc[0]; /* q is 0..63 for -32..31 */
        b.o1 = -32.0f * d * (float)sc[1];
        break;
    }
    default:
        __builtin_unreachable();
    }
    return b;
}

QS_INLINE isum ql_dot(const int qt, const ql_block *b, q32 x) {
    if (qt == QL_Q8_0) return dot_s(b->q, x);
    if (qt == QL_Q6_K) return dot_u_scaled(b->q, x, b->sc0, b->sc1);
    return dot_u(b->q, x);
}

/* -- activations ------------------------------------------------------------------------- */

/* x quantized per 32-element block: q [M][K], d [M][K/32], and the offsets' activation side:
 * d times the sum of q over each 32 (s32 [M][K/32]) and each 16 (s16 [M][K/16]). */
typedef struct {
    int8_t *q;
    float *d, *s32, *s16;
    int64_t K, nb;
    /* Two-block layout (ql_pairs below): q's pairs of blocks interleaved by halves, d8 [M][4 nb]
     * = 4 copies of each block's d, s4 [M][2 nb] = each pair's offset factors. */
    int pairs, qt;
    float *d8, *s4;
    /* Interleaved weights (QL_X8): dx8 [M][8 nb] = 8 copies of each block's d and s8 [M][8 nb]
     * of its s32, which the x8 tile's multiply-adds read as memory operands. */
    int x8;
    float *dx8, *s8;
} ql_acts;

static void ql_interleave_pairs(const ql_acts *a, int8_t *q, const float *d, const float *s32,
                                const int64_t row);

static void ql_quantize_row(const float *x, const ql_acts *a, const int64_t row) {
    int8_t *q = a->q + row * a->K;
    float *d = a->d + row * a->nb, *s32 = a->s32 + row * a->nb, *s16 = a->s16 + row * 2 * a->nb;
    for (int64_t b = 0; b < a->nb; b++) {
        int32_t sums[2];
        d[b] = quantize32(x + 32 * b, q + 32 * b, sums);
        s16[2 * b] = d[b] * (float)sums[0];
        s16[2 * b + 1] = d[b] * (float)sums[1];
        s32[b] = d[b] * (float)(sums[0] + sums[1]);
    }
    if (a->pairs) ql_interleave_pairs(a, q, d, s32, row);
    if (a->x8) {
        float *dx8 = a->dx8 + row * 8 * a->nb, *s8 = a->s8 + row * 8 * a->nb;
        for (int64_t b = 0; b < a->nb; b++)
            for (int i = 0; i < 8; i++) {
                dx8[8 * b + i] = d[b];
                s8[8 * b + i] = s32[b];
            }
    }
}

/* -- two blocks at a time (AVX2, 4- and 5-bit formats) ------------------------------------- */

/* A 4/5-bit block's 16 bytes hold its values in two halves (low nibbles: values 0..15, high:
 * 16..31). Two consecutive blocks loaded into one register unpack to [first halves of both],
 * [second halves of both]: with the activations stored in that order, two multiply-adds and
 * one int16 add give each block's sums in its own 128-bit lane, and the conversion, scaling
 * and accumulation that follow are shared by the two blocks (2 x 31 x 127 x 2 fits int16).
 * Per weight row and pair: 25 instructions instead of 34. */
#if defined(QS_AVX2)
QS_INLINE int ql_pairs(const int qt) {
    return qt == QL_Q4_0 || qt == QL_Q4_1 || qt == QL_Q5_0 || qt == QL_Q5_1;
}
#else
QS_INLINE int ql_pairs(const int qt) { (void)qt; return 0; }
#endif

#if defined(QS_AVX2)
/* The weights' offset against the activation sums, in the lanes of the [d, m, d', m'] vector
 * ql_pair carries: Q4_0 / Q5_0 subtract 8 / 16 times d, Q4_1 / Q5_1 add m. */
QS_INLINE void ql_pair_offset_factors(const int qt, float *kd, float *km) {
    *kd = qt == QL_Q4_0 ? -8.0f : qt == QL_Q5_0 ? -16.0f : 0.0f;
    *km = qt == QL_Q4_1 || qt == QL_Q5_1 ? 1.0f : 0.0f;
}

/* Row `row`'s quantized blocks (plain order) -> pairs interleaved by halves, and the pair
 * scale (d8) and offset (s4) vectors. An odd last block stays as it is. */
static void ql_interleave_pairs(const ql_acts *a, int8_t *q, const float *d, const float *s32,
                                const int64_t row) {
    float kd, km;
    ql_pair_offset_factors(a->qt, &kd, &km);
    float *d8 = a->d8 + row * 4 * a->nb, *s4 = a->s4 + row * 2 * a->nb;
    for (int64_t p = 0; p < a->nb / 2; p++) {
        const __m256i b0 = q_load(q + 64 * p), b1 = q_load(q + 64 * p + 32);
        q_store(q + 64 * p, _mm256_permute2x128_si256(b0, b1, 0x20));
        q_store(q + 64 * p + 32, _mm256_permute2x128_si256(b0, b1, 0x31));
        _mm256_storeu_ps(d8 + 8 * p, _mm256_setr_m128(_mm_set1_ps(d[2 * p]), _mm_set1_ps(d[2 * p + 1])));
        const float s0 = s32[2 * p], s1 = s32[2 * p + 1];
        _mm_storeu_ps(s4 + 4 * p, _mm_setr_ps(kd * s0, km * s0, kd * s1, km * s1));
    }
}

typedef struct {
    __m256i lo, hi; /* first halves of both blocks, second halves of both */
    __m128 dm;      /* d, m, d', m' (m = 0 for Q4_0 / Q5_0) */
} ql_pair;

/* Byte i of lane L = 16 if bit (i + 16 h) of the lane's 32-bit word is set: a fifth bit. */
QS_INLINE __m256i ql_pair_bits(__m256i words, const int h) {
    const __m256i pick = h ? _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                               0x0303030303030303, 0x0202020202020202)
                           : _mm256_set_epi64x(0x0101010101010101, 0, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(words, pick), bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

QS_INLINE ql_pair ql_decode_pair(const int qt, const uint8_t *b0, const int bytes) {
    const uint8_t *b1 = b0 + bytes;
    const int has_m = qt == QL_Q4_1 || qt == QL_Q5_1, five = qt == QL_Q5_0 || qt == QL_Q5_1;
    const int qs = 2 + 2 * has_m + 4 * five;
    ql_pair p;
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + qs))),
        _mm_loadu_si128((const __m128i *)(b1 + qs)), 1);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    p.lo = _mm256_and_si256(raw, nibble);
    p.hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    if (five) {
        uint32_t h0, h1;
        memcpy(&h0, b0 + 2 + 2 * has_m, 4);
        memcpy(&h1, b1 + 2 + 2 * has_m, 4);
        const __m256i words = _mm256_set_m128i(_mm_set1_epi32((int)h1), _mm_set1_epi32((int)h0));
        p.lo = _mm256_or_si256(p.lo, ql_pair_bits(words, 0));
        p.hi = _mm256_or_si256(p.hi, ql_pair_bits(words, 1));
    }
    uint32_t s0 = 0, s1 = 0; /* d (and m) of each block, as 2 halves of a 32-bit word */
    memcpy(&s0, b0, has_m ? 4 : 2);
    memcpy(&s1, b1, has_m ? 4 : 2);
    p.dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)s0), (int)s1, 1));
    return p;
}

QS_INLINE __m256i ql_pair_dot(const ql_pair *w, __m256i x_lo, __m256i x_hi) {
#if defined(QS_VNNI)
    return qs_dpbusd(qs_dpbusd(_mm256_setzero_si256(), w->lo, x_lo), w->hi, x_hi);
#else
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w->lo, x_lo),
                                       _mm256_maddubs_epi16(w->hi, x_hi));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* ql_tile for the two-block formats: pairs, then an odd last block on its own. woff holds
 * each weight row's [d, m, d', m'] per pair (4 per pair: 2 nb floats). */
QS_INLINE void ql_tile_pairs(const int qt, const int R, const int C, const uint8_t *w,
                             const int64_t wrow, const ql_acts *a, const int64_t r0, float *y,
                             const int64_t ldy, const float *bias, float *restrict woff) {
    const int bytes = ql_block_bytes(qt);
    const int64_t nb = a->nb, np = nb / 2;
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    __m256 acc[QL_R][QL_C];
    float tail[QL_C]; /* the odd block's offset */
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        ql_pair wp[QL_C];
        __m256 wd[QL_C];
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) {
            if (LOOM_QUANT_PF) __builtin_prefetch(w + c * wrow + 2 * p * bytes + LOOM_QUANT_PF, 0, 3);
            wp[c] = ql_decode_pair(qt, w + c * wrow + 2 * p * bytes, bytes);
            wd[c] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(wp[c].dm), spread);
            _mm_storeu_ps(woff + c * 2 * nb + 4 * p, wp[c].dm);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int8_t *xq = a->q + (r0 + r) * a->K + 64 * p;
            const __m256i x_lo = q_load(xq), x_hi = q_load(xq + 32);
            const __m256 xd = _mm256_loadu_ps(a->d8 + (r0 + r) * 4 * nb + 8 * p);
#pragma GCC unroll 16
            for (int c = 0; c < C; c++)
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ql_pair_dot(&wp[c], x_lo, x_hi)),
                                            _mm256_mul_ps(wd[c], xd), acc[r][c]);
        }
    }
    if (nb & 1) {
        const int64_t b = nb - 1;
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) {
            const ql_block blk = ql_decode(qt, w + c * wrow + b * bytes, 0);
            tail[c] = blk.o0;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const isum s = ql_dot(qt, &blk, q_load(a->q + (r0 + r) * a->K + 32 * b));
                acc[r][c] = facc_fma(acc[r][c], s, f_splat(blk.d * a->d[(r0 + r) * nb + b]));
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        const float *s4 = a->s4 + (r0 + r) * 2 * nb;
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) {
            const float *o = woff + c * 2 * nb;
            float v = f_sum(acc[r][c]);
            for (int64_t i = 0; i < 4 * np; i++) v += o[i] * s4[i];
            if (nb & 1) v += tail[c] * a->s32[(r0 + r) * nb + nb - 1];
            y[r * ldy + c] = bias ? v + bias[c] : v;
        }
    }
}
#else
static void ql_interleave_pairs(const ql_acts *a, int8_t *q, const float *d, const float *s32,
                                const int64_t row) {
    (void)a, (void)q, (void)d, (void)s32, (void)row;
}
QS_INLINE void ql_tile_pairs(const int qt, const int R, const int C, const uint8_t *w,
                             const int64_t wrow, const ql_acts *a, const int64_t r0, float *y,
                             const int64_t ldy, const float *bias, float *restrict woff) {
    (void)qt, (void)R, (void)C, (void)w, (void)wrow, (void)a, (void)r0, (void)y, (void)ldy,
        (void)bias, (void)woff;
}
#endif

/* -- the R x C tile ---------------------------------------------------------------------- */

/* y[r][c] for R activation rows (from row r0) and C weight rows (w, wrow bytes apart).
 * woff [C][2 nb] is scratch for the weights' offsets (ql_offsets(qt) per block). */
QS_INLINE void ql_tile(const int qt, const int R, const int C, const uint8_t *w,
                       const int64_t wrow, const ql_acts *a, const int64_t r0, float *y,
                       const int64_t ldy, const float *bias, float *restrict woff) {
    if (ql_pairs(qt)) {
        ql_tile_pairs(qt, R, C, w, wrow, a, r0, y, ldy, bias, woff);
        return;
    }
    const int sub = ql_subblocks(qt), bytes = ql_block_bytes(qt);
    const int64_t nb = a->nb, nsuper = nb / sub;
    fvec acc[QL_R][QL_C];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) acc[r][c] = f_zero();
    for (int64_t s = 0; s < nsuper; s++) {
#pragma GCC unroll 8
        for (int j = 0; j < sub; j++) {
            const int64_t b = s * sub + j;
            ql_block wb[QL_C];
            fvec wd[QL_C];
#pragma GCC unroll 16
            for (int c = 0; c < C; c++) {
                if (LOOM_QUANT_PF && (bytes < 64 || j % 2 == 0))
                    __builtin_prefetch(w + c * wrow + s * bytes + 32 * j + LOOM_QUANT_PF, 0, 3);
                wb[c] = ql_decode(qt, w + c * wrow + s * bytes, j);
                wd[c] = f_splat(wb[c].d);
                if (ql_offsets(qt) == 2) {
                    woff[c * 2 * nb + 2 * b] = wb[c].o0;
                    woff[c * 2 * nb + 2 * b + 1] = wb[c].o1;
                } else if (ql_has_offset(qt)) {
                    woff[c * nb + b] = wb[c].o0;
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const q32 xq = q_load(a->q + (r0 + r) * a->K + 32 * b);
                const fvec xd = f_splat_load(a->d + (r0 + r) * nb + b);
#pragma GCC unroll 16
                for (int c = 0; c < C; c++)
                    acc[r][c] = facc_fma(acc[r][c], ql_dot(qt, &wb[c], xq), wd[c] * xd);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        const int64_t n_off = ql_offsets(qt) * nb;
        const float *xs = (ql_offsets(qt) == 2 ? a->s16 : a->s32) + (r0 + r) * n_off;
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) {
            float v = f_sum(acc[r][c]);
            if (ql_has_offset(qt)) {
                const float *o = woff + c * n_off;
                float off = 0.0f;
                for (int64_t i = 0; i < n_off; i++) off += o[i] * xs[i];
                v += off;
            }
            y[r * ldy + c] = bias ? v + bias[c] : v;
        }
    }
}

/* Rows r0 .. r0 + rows of the row block against C weight rows: full R-row tiles, then one
 * tile for the remainder, each a specialised (constant R, C) copy of ql_tile. */
#define QL_CASE(n) case n: ql_tile(qt, n, C, w, wrow, a, r, y + (r - r0) * ldy, ldy, bias, woff); break;
QS_INLINE void ql_row_block(const int qt, const int C, const uint8_t *w, const int64_t wrow,
                            const ql_acts *a, const int64_t r0, const int rows, float *y,
                            const int64_t ldy, const float *bias, float *woff) {
    if (C < QL_C) { /* the narrow last tile of an odd width: rare, so one row at a time */
        for (int64_t r = r0; r < r0 + rows; r++)
            ql_tile(qt, 1, C, w, wrow, a, r, y + (r - r0) * ldy, ldy, bias, woff);
        return;
    }
    for (int64_t r = r0; r < r0 + rows; r += QL_R) {
        const int n = r0 + rows - r < QL_R ? (int)(r0 + rows - r) : QL_R;
        switch (n) {
        QL_CASE(1)
#if QL_R > 1
        QL_CASE(2)
#endif
#if QL_R > 2
        QL_CASE(3)
#endif
#if QL_R > 3
        QL_CASE(4)
#endif
#if QL_R > 4
        QL_CASE(5)
#endif
#if QL_R > 5
        QL_CASE(6)
#endif
#if QL_R > 6
#error "LOOM_QUANT_R above 6: add cases"
#endif
        }
    }
}

/* Chunk `chunk` of the work: a block of activation rows against a run of C-row weight tiles
 * (the last tile of the matrix may be narrower: done one weight row at a time). */
QS_INLINE void ql_chunk(const int qt, const uint8_t *w, const int64_t wrow, const ql_acts *a,
                        const float *bias, float *y, const int64_t ldy, const int M, const int N,
                        const int tiles_per_run, const int runs, const int chunk,
                        float *woff) {
    const int64_t m0 = (int64_t)(chunk / runs) * LOOM_QUANT_MC;
    const int rows = M - m0 < LOOM_QUANT_MC ? (int)(M - m0) : LOOM_QUANT_MC;
    const int n0 = chunk % runs * tiles_per_run * QL_C;
    const int n1 = n0 + tiles_per_run * QL_C < N ? n0 + tiles_per_run * QL_C : N;
    for (int n = n0; n < n1; n += QL_C) {
        float *yt = y + m0 * ldy + n;
        const float *bt = bias ? bias + n : NULL;
        if (n1 - n >= QL_C) {
            ql_row_block(qt, QL_C, w + n * wrow, wrow, a, m0, rows, yt, ldy, bt, woff);
        } else {
            for (int c = n; c < n1; c++)
                ql_row_block(qt, 1, w + c * wrow, wrow, a, m0, rows, y + m0 * ldy + c, ldy,
                             bias ? bias + c : NULL, woff);
        }
    }
}

#define QL_DEFINE_CHUNK(QT)                                                                  \
    static void ql_chunk_##QT(const uint8_t *w, int64_t wrow, const ql_acts *a,             \
                              const float *bias, float *y, int64_t ldy, int M, int N,       \
                              int tiles_per_run, int runs, int chunk, float *woff) {        \
        ql_chunk(QT, w, wrow, a, bias, y, ldy, M, N, tiles_per_run, runs, chunk, woff);     \
    }
QL_DEFINE_CHUNK(QL_Q4_0)
QL_DEFINE_CHUNK(QL_Q4_1)
QL_DEFINE_CHUNK(QL_Q5_0)
QL_DEFINE_CHUNK(QL_Q5_1)
QL_DEFINE_CHUNK(QL_Q8_0)
QL_DEFINE_CHUNK(QL_Q4_K)
QL_DEFINE_CHUNK(QL_Q5_K)
QL_DEFINE_CHUNK(QL_Q6_K)

typedef void (*ql_chunk_fn)(const uint8_t *, int64_t, const ql_acts *, const float *, float *,
                            int64_t, int, int, int, int, int, float *);

static ql_chunk_fn ql_chunk_for(const int qt) {
    switch (qt) {
    case QL_Q4_0: return ql_chunk_QL_Q4_0;
    case QL_Q4_1: return ql_chunk_QL_Q4_1;
    case QL_Q5_0: return ql_chunk_QL_Q5_0;
    case QL_Q5_1: return ql_chunk_QL_Q5_1;
    case QL_Q8_0: return ql_chunk_QL_Q8_0;
    case QL_Q4_K: return ql_chunk_QL_Q4_K;
    case QL_Q5_K: return ql_chunk_QL_Q5_K;
    case QL_Q6_K: return ql_chunk_QL_Q6_K;
    default: return NULL;
    }
}

/* -- eight weight rows interleaved (AVX2: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) --------
 *
 * In the GGUF layout a weight row's blocks follow each other, so a tile multiplies a block
 * with its activations into a vector of partial sums and must add the vector's lanes up at
 * the end, and each block's one or two float16 scales are converted on their own. Here each
 * group of 8 weight rows is stored block by block, a block of the group (`gblock`) holding
 * the 8 rows' float16 d (then m, for Q4_1) side by side and then their quants, 4 bytes of
 * each row in turn:
 *     Q4_0 / Q4_1: [d x 8][m x 8][4 x (4 quant bytes x 8 rows)]   144 / 160 bytes
 *     Q5_0:        [d x 8][qh x 8][4 x (4 quant bytes x 8 rows)]    176 bytes
 *     Q8_0:        [d x 8][8 x (4 quants x 8 rows)]                 272 bytes
 *     Q4_K (a super-block of 256):
 *                  [d x 8][dmin x 8][12 x (scale byte k x 8 rows)][32 x (4 quant bytes x 8 rows)]
 *                                                                   1152 bytes
 *     Q5_K:        Q4_K's 1152, then [8 x (4 fifth-bit bytes x 8 rows)]    1408 bytes
 *                  (fifth-bit byte i holds bit j for weight i of sub-block j: the word of
 *                  each row that its quant word k needs is its k-th)
 *     Q6_K:        [d x 8][16 x (scale k x 8 rows)][32 x (4 low-nibble bytes x 8 rows)]
 *                  [16 x (4 high-bit bytes x 8 rows)]                1680 bytes
 * (a sub-block's 8 scales and mins, or scales, then unpack as 8 lanes at once).
 * (the bytes of 8 GGUF blocks, rearranged). A 256-bit load is then 4 quant bytes of each row,
 * lane i being row i: multiply-added with 4 activations broadcast to every lane, each lane
 * sums its own row, and the block's 8 scales are one conversion. llama.cpp's repacked
 * Q4_0 x 8 (ggml-cpu/repack.cpp) uses the same idea. Per 256 weights that is ~45 instructions
 * against ~80 for the two-block path; a row's result is the same number as in the GGUF
 * layout up to float32 summation order.
 *
 * QuantLinear interleaves a weight at load time (loom_quant_interleave) when the format has
 * this layout here and its rows are a multiple of 8; a kernel call says so by adding QL_X8 to
 * the type number. Only AVX2 builds have it (the others keep the GGUF layout). */
#define QL_X8 0x100

#if defined(QS_AVX2)
QS_INLINE int ql_x8_format(const int qt) {
    return qt == QL_Q4_0 || qt == QL_Q4_1 || qt == QL_Q5_0 || qt == QL_Q8_0 || qt == QL_Q4_K ||
           qt == QL_Q5_K || qt == QL_Q6_K;
}
#else
QS_INLINE int ql_x8_format(const int qt) { (void)qt; return 0; }
#endif

/* Bytes of a gblock before its quants, and the GGUF block's header (scales; Q5_0's high
 * bits). The header's second field (Q4_1's m, Q5_0's qh) follows the 8 d's. */
QS_INLINE int ql_x8_scale_bytes(const int qt) {
    return qt == QL_Q4_1 ? 32 : qt == QL_Q5_0 ? 48 : 16;
}
QS_INLINE int ql_x8_head(const int qt) { return qt == QL_Q4_1 ? 4 : qt == QL_Q5_0 ? 6 : 2; }

/* Q5_0's fifth bits in a gblock: GGUF keeps a 32-bit word per row (bit k: weight k's);
 * interleaved, word j holds quant vector j's (ql_x8_decode's q[j]: weights 4j .. 4j + 3 of
 * each row, row r's in bytes 4r .. 4r + 3): bit 4r + i is row r's weight 4j + i's. One word
 * is then one vector's bits in byte order, a mask register's load on AVX-512. In place: the
 * 8 row words in, the 8 vector words out (the transposition is its own inverse). */
static void ql_x8_transpose_q5_high_bits(uint8_t *qh) {
    uint32_t in[8], out[8] = {0};
    memcpy(in, qh, sizeof in);
    for (int r = 0; r < 8; r++)
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++)
                out[j] |= (in[r] >> (4 * j + i) & 1u) << (4 * r + i);
    memcpy(qh, out, sizeof out);
}

/* Weight row `row`'s block b (a K-quant: its super-block) as GGUF stores it: in place, or
 * gathered from its group into buf (ql_block_bytes(qt) bytes). */
QS_INLINE const uint8_t *ql_block_at(const int kind, const uint8_t *w, const int64_t wrow,
                                     const int64_t row, const int64_t b, uint8_t *buf) {
    const int qt = kind & 0xFF, bytes = ql_block_bytes(qt);
    if (!(kind & QL_X8)) return w + row * wrow + b / ql_subblocks(qt) * bytes;
    const uint8_t *g = w + row / 8 * 8 * wrow + b / ql_subblocks(qt) * 8 * bytes;
    const int lane = (int)(row % 8), head = ql_x8_head(qt), sb = ql_x8_scale_bytes(qt);
    if (qt == QL_Q4_K || qt == QL_Q5_K) { /* GGUF: d, dmin, scales [12], (qh [32]), qs */
        const int qs = qt == QL_Q5_K ? 48 : 16;
        memcpy(buf, g + 2 * lane, 2);
        memcpy(buf + 2, g + 16 + 2 * lane, 2);
        for (int k = 0; k < 12; k++) buf[4 + k] = g[32 + 8 * k + lane];
        for (int c = 0; c < 32; c++) memcpy(buf + qs + 4 * c, g + 128 + 32 * c + 4 * lane, 4);
        if (qt == QL_Q5_K)
            for (int c = 0; c < 8; c++) memcpy(buf + 16 + 4 * c, g + 1152 + 32 * c + 4 * lane, 4);
        return buf;
    }
    if (qt == QL_Q6_K) { /* GGUF: ql [128], qh [64], scales [16], d */
        memcpy(buf + 208, g + 2 * lane, 2);
        for (int k = 0; k < 16; k++) buf[192 + k] = g[16 + 8 * k + lane];
        for (int c = 0; c < 48; c++) memcpy(buf + 4 * c, g + 144 + 32 * c + 4 * lane, 4);
        return buf;
    }
    memcpy(buf, g + 2 * lane, 2);
    if (qt == QL_Q5_0) { /* the row's high-bit word, from the vectors' words */
        uint8_t qh[32];
        memcpy(qh, g + 16, sizeof qh);
        ql_x8_transpose_q5_high_bits(qh);
        memcpy(buf + 2, qh + 4 * lane, 4);
    } else if (head > 2) {
        memcpy(buf + 2, g + 16 + (head - 2) * lane, head - 2);
    }
    for (int j = 0; j < (bytes - head) / 4; j++) memcpy(buf + head + 4 * j, g + sb + 32 * j + 4 * lane, 4);
    return buf;
}

/* dst = src [N rows of wrow bytes] interleaved by 8 rows. Returns 0, or -1 where this build
 * has no such layout for qtype, or N is not a multiple of 8. */
int loom_quant_interleave(int qtype, const uint8_t *src, int64_t wrow, int N, int K,
                          uint8_t *dst) {
    const int per_block = 32 * ql_subblocks(qtype);
    if (!ql_x8_format(qtype) || N % 8 || K % per_block ||
        wrow != K / per_block * ql_block_bytes(qtype))
        return -1;
    const int bytes = ql_block_bytes(qtype), head = ql_x8_head(qtype);
    const int sb = ql_x8_scale_bytes(qtype);
    const int64_t nb = K / per_block;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + g * 8 * wrow + b * 8 * bytes;
            for (int lane = 0; lane < 8; lane++) {
                const uint8_t *blk = src + (8 * g + lane) * wrow + b * bytes;
                if (qtype == QL_Q4_K || qtype == QL_Q5_K) {
                    const int qs = qtype == QL_Q5_K ? 48 : 16;
                    memcpy(o + 2 * lane, blk, 2);
                    memcpy(o + 16 + 2 * lane, blk + 2, 2);
                    for (int k = 0; k < 12; k++) o[32 + 8 * k + lane] = blk[4 + k];
                    for (int c = 0; c < 32; c++)
                        memcpy(o + 128 + 32 * c + 4 * lane, blk + qs + 4 * c, 4);
                    if (qtype == QL_Q5_K) /* the fifth bits, 4 bytes of each row in turn */
                        for (int c = 0; c < 8; c++)
                            memcpy(o + 1152 + 32 * c + 4 * lane, blk + 16 + 4 * c, 4);
                    continue;
                }
                if (qtype == QL_Q6_K) {
                    memcpy(o + 2 * lane, blk + 208, 2);
                    for (int k = 0; k < 16; k++) o[16 + 8 * k + lane] = blk[192 + k];
                    for (int c = 0; c < 48; c++) /* ql's 32 chunks, then qh's 16 */
                        memcpy(o + 144 + 32 * c + 4 * lane, blk + 4 * c, 4);
                    continue;
                }
                memcpy(o + 2 * lane, blk, 2);
                if (head > 2) memcpy(o + 16 + (head - 2) * lane, blk + 2, head - 2);
                for (int j = 0; j < (bytes - head) / 4; j++)
                    memcpy(o + sb + 32 * j + 4 * lane, blk + head + 4 * j, 4);
            }
            if (qtype == QL_Q5_0) ql_x8_transpose_q5_high_bits(o + 16);
        }
    return 0;
}

#if defined(QS_AVX2)
/* Activation rows per x8 tile: the gblock is unpacked once for all of them (its 8 quant
 * vectors and 2 scale vectors in registers). 6: a speculative verify step's rows (the last
 * token and 5 proposals) are one tile, where 4 unpacked every gblock twice (4 + 2 rows); its
 * accumulators spill past 4 rows, which costs less (1.1-1.15x faster projections and lm_head
 * at 6 rows on the AVX2 EPYC here, the same at 1-4). With AVX-512VL's 32 vector registers,
 * 8 where the block decodes into few registers (16-row calls: two tiles of 8, not 6 + 6 + 4;
 * one thread, best of 31 alternated, on the Zen 4 EPYC: Q8_0 / Q4_1 / Q5_0 / Q6_K 1.06-1.10x
 * faster at 16 rows, the same at 6 and 64); Q4_K and Q5_K keep 6 (0.81-0.86x at 8: spills).
 * LOOM_QUANT_X8_R sets one count for every format. */
#if defined(LOOM_QUANT_X8_R)
#define QL_X8_R LOOM_QUANT_X8_R
#define QL_X8_ROWS(qt) QL_X8_R
#elif defined(__AVX512VL__)
#define QL_X8_R 8
#define QL_X8_ROWS(qt) ((qt) == QL_Q4_K || (qt) == QL_Q5_K ? 6 : 8)
#else
#define QL_X8_R 6
#define QL_X8_ROWS(qt) QL_X8_R
#endif
#if defined(QS_VNNI)
#define QS_X8_Q8_OFFSET 1 /* Q8_0's quants read as unsigned: a -128 d offset */
#else
#define QS_X8_Q8_OFFSET 0
#endif

/* A gblock unpacked: q[j] holds weights 4j..4j+3 of each row (lane), the ones activation word
 * j multiplies; unsigned except Q8_0 without VNNI (signed: see ql_x8_dot). Per row (lane):
 * w = d q + o, o folding Q4_0's -8, Q5_0's -16, Q8_0's -128 (VNNI: its quants read as
 * q + 128), Q4_1's m. */
typedef struct {
    __m256i q[8];
    const uint8_t *signs; /* Q8_0 without VNNI: q holds |quants|, their signs read from here */
    __m256 d, o;
    __m256 d1, o1; /* Q6_K: weights 16..31's own scale (the first 16's: d, o) */
} ql_x8_block;

/* The 8 rows' byte k of a Q4_K super-block's scales, one per lane. */
QS_INLINE __m256i ql_x8_scale_byte(const uint8_t *s, const int k) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + 8 * k)));
}

/* Sub-block j of a Q4_K group (as ql_scale_min_k4, 8 rows at once); of a Q5_K group with
 * `fifth`: each weight's fifth bit, bit j of its byte of the group's fifth-bit words. */
QS_INLINE ql_x8_block ql_x8_decode_q4_k(const uint8_t *g, const int j, const int fifth) {
    ql_x8_block b;
    const uint8_t *s = g + 32;
    const __m256i low6 = _mm256_set1_epi32(63), low4 = _mm256_set1_epi32(15);
    __m256i sc, m;
    if (j < 4) {
        sc = _mm256_and_si256(ql_x8_scale_byte(s, j), low6);
        m = _mm256_and_si256(ql_x8_scale_byte(s, j + 4), low6);
    } else {
        const __m256i hi = ql_x8_scale_byte(s, j + 4);
        sc = _mm256_or_si256(_mm256_and_si256(hi, low4),
                             _mm256_slli_epi32(_mm256_srli_epi32(ql_x8_scale_byte(s, j - 4), 6), 4));
        m = _mm256_or_si256(_mm256_srli_epi32(hi, 4),
                            _mm256_slli_epi32(_mm256_srli_epi32(ql_x8_scale_byte(s, j), 6), 4));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
    b.d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    b.o = _mm256_mul_ps(_mm256_mul_ps(dmin, _mm256_set1_ps(-1.0f)), _mm256_cvtepi32_ps(m));
    /* sub-blocks 2p and 2p + 1: the low and high nibbles of quant bytes 32p .. 32p + 31 */
    const uint8_t *q = g + 128 + 256 * (j / 2);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m256i v = q_load(q + 32 * k);
        b.q[k] = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, nibble);
        if (fifth) { /* (a 16-bit shift: the mask keeps each byte's own bit j) */
            const __m256i h = _mm256_and_si256(_mm256_srli_epi16(q_load(g + 1152 + 32 * k), j),
                                               _mm256_set1_epi8(1));
            b.q[k] = _mm256_or_si256(b.q[k], _mm256_slli_epi16(h, 4));
        }
    }
    return b;
}

/* Sub-block j of a Q6_K group (as ql_decode): q = 0..63 for -32..31, a scale per 16. */
QS_INLINE ql_x8_block ql_x8_decode_q6_k(const uint8_t *g, const int j) {
    ql_x8_block b;
    const int half = j / 4, part = j % 4;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 sc0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64((const __m128i *)(g + 16 + 8 * (8 * half + 2 * part)))));
    const __m256 sc1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64((const __m128i *)(g + 16 + 8 * (8 * half + 2 * part + 1)))));
    b.d = _mm256_mul_ps(d, sc0);
    b.d1 = _mm256_mul_ps(d, sc1);
    b.o = _mm256_mul_ps(b.d, _mm256_set1_ps(-32.0f));
    b.o1 = _mm256_mul_ps(b.d1, _mm256_set1_ps(-32.0f));
    const uint8_t *ql = g + 144 + 32 * (16 * half + 8 * (part & 1));
    const uint8_t *qh = g + 144 + 1024 + 32 * (8 * half);
    const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m256i v = q_load(ql + 32 * k);
        const __m256i low = _mm256_and_si256(part >= 2 ? _mm256_srli_epi16(v, 4) : v, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(q_load(qh + 32 * k), 2 * part), two);
        b.q[k] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    return b;
}

/* Block j of the group at g (j: the sub-block of a K-quant super-block; 0 otherwise). */
QS_INLINE ql_x8_block ql_x8_decode(const int qt, const uint8_t *g, const int j) {
    if (qt == QL_Q4_K || qt == QL_Q5_K) return ql_x8_decode_q4_k(g, j, qt == QL_Q5_K);
    if (qt == QL_Q6_K) return ql_x8_decode_q6_k(g, j);
    ql_x8_block b;
    b.d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    if (qt == QL_Q4_1)
        b.o = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
    else if (qt == QL_Q4_0)
        b.o = _mm256_mul_ps(b.d, _mm256_set1_ps(-8.0f));
    else if (qt == QL_Q5_0)
        b.o = _mm256_mul_ps(b.d, _mm256_set1_ps(-16.0f));
    else
#if defined(QS_VNNI)
        b.o = _mm256_mul_ps(b.d, _mm256_set1_ps(-128.0f));
#else
        b.o = _mm256_setzero_ps();
#endif
    const uint8_t *q = g + ql_x8_scale_bytes(qt);
    if (qt == QL_Q8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
#if defined(QS_VNNI) /* signed -> unsigned: q ^ 0x80 = q + 128, dpbusd's unsigned side */
            b.q[j] = _mm256_xor_si256(q_load(q + 32 * j), _mm256_set1_epi8((char)0x80));
#else
            b.q[j] = q_load(q + 32 * j);
#endif
        }
    } else {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i v = q_load(q + 32 * j);
            b.q[j] = _mm256_and_si256(v, nibble);
            b.q[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        if (qt == QL_Q5_0) { /* q[j]'s fifth bits: word j, bit k for byte k (the layout
                               * ql_x8_transpose_q5_high_bits makes) */
            const uint8_t *qh = g + 16;
            const __m256i sixteen = _mm256_set1_epi8(16);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                uint32_t bits;
                memcpy(&bits, qh + 4 * j, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
                b.q[j] = _mm256_mask_add_epi8(b.q[j], (__mmask32)bits, b.q[j], sixteen);
#else           /* each byte picks its word byte (k / 8) and tests its bit (k % 8) */
                const __m256i pick = _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
                const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
                const __m256i set = _mm256_cmpeq_epi8(
                    _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick),
                                     bit), bit);
                b.q[j] = _mm256_or_si256(b.q[j], _mm256_and_si256(set, sixteen));
#endif
            }
        }
    }
    return b;
}

QS_INLINE __m256i ql_x8_word(const int8_t *xq, const int j) {
    int32_t v;
    memcpy(&v, xq + 4 * j, 4);
    return _mm256_set1_epi32(v);
}

/* Each row's (lane's) integer dot product of words j0 .. j0 + 3 (weights 4 j0 .. 4 j0 + 15)
 * with their activations: Q6_K's halves, each with its own scale. Unsigned 6-bit weights:
 * int16 sums of 2 words (2 x 2 x 63 x 127 = 32004). */
QS_INLINE __m256i ql_x8_dot16(const ql_x8_block *w, const int8_t *xq, const int j0) {
#if defined(QS_VNNI)
    __m256i s0 = qs_dpbusd(_mm256_setzero_si256(), w->q[j0], ql_x8_word(xq, j0));
    __m256i s1 = qs_dpbusd(_mm256_setzero_si256(), w->q[j0 + 1], ql_x8_word(xq, j0 + 1));
    s0 = qs_dpbusd(s0, w->q[j0 + 2], ql_x8_word(xq, j0 + 2));
    s1 = qs_dpbusd(s1, w->q[j0 + 3], ql_x8_word(xq, j0 + 3));
    return _mm256_add_epi32(s0, s1);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(w->q[j0], ql_x8_word(xq, j0)),
                                       _mm256_maddubs_epi16(w->q[j0 + 1], ql_x8_word(xq, j0 + 1)));
    const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(w->q[j0 + 2], ql_x8_word(xq, j0 + 2)),
                                       _mm256_maddubs_epi16(w->q[j0 + 3], ql_x8_word(xq, j0 + 3)));
    return _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones));
#endif
}

/* Each row's (lane's) integer dot product of the gblock with one activation block. */
QS_INLINE __m256i ql_x8_dot(const int qt, const ql_x8_block *w, const int8_t *xq) {
#if defined(QS_VNNI)
    (void)qt;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) { /* two chains: dpbusd's latency */
        s0 = qs_dpbusd(s0, w->q[j], ql_x8_word(xq, j));
        s1 = qs_dpbusd(s1, w->q[4 + j], ql_x8_word(xq, 4 + j));
    }
    return _mm256_add_epi32(s0, s1);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (qt == QL_Q8_0) { /* signed: the sign moves onto the activations (see dot_s); w->q
                          * holds |q| (ql_x8_tile), the signs are read from the gblock */
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i x = _mm256_sign_epi8(ql_x8_word(xq, j), q_load(w->signs + 32 * j));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w->q[j], x), ones));
        }
        return s;
    }
    if (qt == QL_Q5_0 || qt == QL_Q5_K) { /* 5-bit: int16 sums of 4 words (4 x 2 x 31 x 127 = 31496) */
        __m256i lo = _mm256_maddubs_epi16(w->q[0], ql_x8_word(xq, 0));
        __m256i hi = _mm256_maddubs_epi16(w->q[4], ql_x8_word(xq, 4));
#pragma GCC unroll 3
        for (int j = 1; j < 4; j++) {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w->q[j], ql_x8_word(xq, j)));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w->q[4 + j], ql_x8_word(xq, 4 + j)));
        }
        return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
    }
    /* 4-bit: 8 x 2 x 15 x 127 = 30480 fits the int16 sums */
    __m256i s = _mm256_maddubs_epi16(w->q[0], ql_x8_word(xq, 0));
#pragma GCC unroll 7
    for (int j = 1; j < 8; j++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w->q[j], ql_x8_word(xq, j)));
    return _mm256_madd_epi16(s, ones);
#endif
}

/* acc + each row's (lane's) integer dot s of a block, scaled: s d dx + o sx (dx, sx: the
 * activation block's 8 copies of d and of d times its sum). The one formula of both x8 tiles,
 * so a row's result is the same whichever ran it. */
QS_INLINE __m256 ql_x8_accumulate(const ql_x8_block *w, const __m256i s, const float *dx,
                                  const float *sx, const int has_o, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w->d, _mm256_loadu_ps(dx)), acc);
    return has_o ? _mm256_fmadd_ps(w->o, _mm256_loadu_ps(sx), acc) : acc;
}

/* y[r][0..8) for R activation rows from r0 against the group at g (8 weight rows). */
QS_INLINE void ql_x8_tile(const int qt, const int R, const uint8_t *g, const ql_acts *a,
                          const int64_t r0, float *y, const int64_t ldy, const float *bias) {
    const int64_t nb = a->nb;
    const int gbytes = 8 * ql_block_bytes(qt), sub = ql_subblocks(qt);
    const int has_o = qt != QL_Q8_0 || QS_X8_Q8_OFFSET;
    __m256 acc[QL_X8_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b / sub * gbytes; /* (its super-block's group) */
        if (LOOM_QUANT_PF && b % sub == 0)
            for (int o = 0; o < gbytes; o += 64) __builtin_prefetch(gb + LOOM_QUANT_PF + o, 0, 3);
        ql_x8_block w = ql_x8_decode(qt, gb, (int)(b % sub));
#if !defined(QS_VNNI)
        if (qt == QL_Q8_0) { /* |q| once for all rows; ql_x8_dot moves the signs onto x */
            w.signs = gb + ql_x8_scale_bytes(qt);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) w.q[j] = _mm256_abs_epi8(w.q[j]);
        }
#endif
        if (qt == QL_Q6_K) { /* two scales a block: its halves summed apart */
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int64_t row = r0 + r;
                const int8_t *xq = a->q + row * a->K + 32 * b;
                const __m256 dx = _mm256_broadcast_ss(a->d + row * nb + b);
                const float *s16 = a->s16 + row * 2 * nb + 2 * b;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ql_x8_dot16(&w, xq, 0)),
                                         _mm256_mul_ps(w.d, dx), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ql_x8_dot16(&w, xq, 4)),
                                         _mm256_mul_ps(w.d1, dx), acc[r]);
                acc[r] = _mm256_fmadd_ps(w.o, _mm256_broadcast_ss(s16), acc[r]);
                acc[r] = _mm256_fmadd_ps(w.o1, _mm256_broadcast_ss(s16 + 1), acc[r]);
            }
            continue;
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const __m256i s = ql_x8_dot(qt, &w, a->q + row * a->K + 32 * b);
            const float *dx = a->dx8 + (row * nb + b) * 8, *sx = a->s8 + (row * nb + b) * 8;
            acc[r] = ql_x8_accumulate(&w, s, dx, sx, has_o, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const __m256 v = bias ? _mm256_add_ps(acc[r], _mm256_loadu_ps(bias)) : acc[r];
        _mm256_storeu_ps(y + r * ldy, v);
    }
}

#if defined(QS_VNNI) && !defined(LOOM_X8_NO_PAIRS)
#define QL_X8_PAIRS 1
/* ql_x8_tile for two adjacent groups at once (g and g + gstride: 16 weight rows), each
 * activation word broadcast once for both: per activation row and block 8 broadcasts feed 16
 * vpdpbusd instead of 8. Each group's arithmetic is ql_x8_tile's (the same two chains, the
 * same order), so its rows' results are the same numbers whichever tile ran them. Taken for
 * prefill-sized calls (LOOM_X8_PAIRS_FROM rows on) of the formats whose blocks decode in a few
 * instructions (Q4_0, Q4_1, Q8_0, and Q5_0 where AVX-512 masks add its fifth bits): with the
 * K-quants' decoding too, two blocks' registers spill (no faster: Q4_K 4096 x 768 at 64 rows,
 * one thread), and at decode sizes the two weight streams read no faster than one
 * (SmolLM2's batch-1 step 4.06 -> 5.44 ms with pairs there). One 512-token SmolLM2 Q4_1
 * prefill step on the Zen 4 EPYC, alternated: 500 / 408 -> 404 / 360 ms. Q5_0 at 64 rows,
 * one thread, best of 31 alternated: 1.72 -> 1.60 ms (4096 x 640). */
#ifndef LOOM_QUANT_X8_R2
#define LOOM_QUANT_X8_R2 4 /* activation rows a pair tile (2 x 8 accumulators) */
#endif
#ifndef LOOM_X8_PAIRS_FROM
#define LOOM_X8_PAIRS_FROM 32
#endif
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define QL_X8_Q5_PAIRS (qt == QL_Q5_0)
#else
#define QL_X8_Q5_PAIRS 0
#endif
QS_INLINE void ql_x8_tile2(const int qt, const int R, const uint8_t *g, const int64_t gstride,
                           const ql_acts *a, const int64_t r0, float *y, const int64_t ldy,
                           const float *bias) {
    const int64_t nb = a->nb;
    const int gbytes = 8 * ql_block_bytes(qt), sub = ql_subblocks(qt);
    const int has_o = qt != QL_Q8_0 || QS_X8_Q8_OFFSET;
    __m256 acc0[LOOM_QUANT_X8_R2], acc1[LOOM_QUANT_X8_R2];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b / sub * gbytes;
        if (LOOM_QUANT_PF && b % sub == 0)
            for (int o = 0; o < gbytes; o += 64) {
                __builtin_prefetch(gb + LOOM_QUANT_PF + o, 0, 3);
                __builtin_prefetch(gb + gstride + LOOM_QUANT_PF + o, 0, 3);
            }
        const ql_x8_block w0 = ql_x8_decode(qt, gb, (int)(b % sub));
        const ql_x8_block w1 = ql_x8_decode(qt, gb + gstride, (int)(b % sub));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const int8_t *xq = a->q + row * a->K + 32 * b;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m256i xa = ql_x8_word(xq, j), xb = ql_x8_word(xq, 4 + j);
                s0 = qs_dpbusd(s0, w0.q[j], xa);
                s1 = qs_dpbusd(s1, w0.q[4 + j], xb);
                t0 = qs_dpbusd(t0, w1.q[j], xa);
                t1 = qs_dpbusd(t1, w1.q[4 + j], xb);
            }
            const float *dx = a->dx8 + (row * nb + b) * 8, *sx = a->s8 + (row * nb + b) * 8;
            acc0[r] = ql_x8_accumulate(&w0, _mm256_add_epi32(s0, s1), dx, sx, has_o, acc0[r]);
            acc1[r] = ql_x8_accumulate(&w1, _mm256_add_epi32(t0, t1), dx, sx, has_o, acc1[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + r * ldy, bias ? _mm256_add_ps(acc0[r], _mm256_loadu_ps(bias)) : acc0[r]);
        _mm256_storeu_ps(y + r * ldy + 8,
                         bias ? _mm256_add_ps(acc1[r], _mm256_loadu_ps(bias + 8)) : acc1[r]);
    }
}
#define QL_X8_TILE2_CASE(n)                                                                  \
    case n: ql_x8_tile2(qt, n, wg, 8 * wrow, a, r, y + r * ldy + 8 * grp, ldy, bg); break;
#endif

#if defined(QS_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    !defined(LOOM_X16_OFF)
#define QL_X16 1
/* Two adjacent 8-row groups in one 512-bit register (16 weight rows): per activation row and
 * block, 8 words broadcast once (one load each) feed 8 512-bit vpdpbusd; the 256-bit tiles
 * load 8 words and 2 scale vectors for 8 weight rows, and are bound by those loads. Each
 * lane's arithmetic is ql_x8_tile's (the same two chains in the same order, the same scaling),
 * so a row's results are the same numbers whichever tile ran them. For Q4_0, Q4_1, Q5_0,
 * Q4_K and Q5_K, from LOOM_X16_FROM rows (the Zen 4 EPYC, alternated in one process,
 * 2026-11-28: Gemma 3's fused step of 16 decodes and a 48-row chunk 62.8 -> 60.9 ms with the
 * first three, 65.9 -> 62.4 with the K-quants too; one thread, 16 / 64 rows, Q5_0 4096 x 640
 * 1.05 / 1.13x, Q4_1 1536 x 576 1.10 / 1.12x, Q4_0 1.04-1.13x, Q4_K 640 x 1024 1.19 / 1.21x,
 * 14336 x 4096 1.50 / 1.59x). Not Q8_0: its 262,144-row output layer at 16 rows 0.86x (its
 * blocks, 34 bytes a row, decode into two groups' registers slower than the tile saves), nor
 * Q6_K (two scales a block: a row loop of its own). 16 rows a tile were no better than 8
 * (0.90-1.18x by shape). */
#ifndef LOOM_X16_FROM
#define LOOM_X16_FROM 8
#endif
QS_INLINE __m512i ql_x16_join(const __m256i lo, const __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
QS_INLINE __m512 ql_x16_joinf(const __m256 lo, const __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
QS_INLINE void ql_x16_tile(const int qt, const int R, const uint8_t *g, const int64_t gstride,
                           const ql_acts *a, const int64_t r0, float *y, const int64_t ldy,
                           const float *bias) {
    const int64_t nb = a->nb;
    const int gbytes = 8 * ql_block_bytes(qt), sub = ql_subblocks(qt);
    const int has_o = qt != QL_Q8_0 || QS_X8_Q8_OFFSET;
    __m512 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = g + b / sub * gbytes;
        if (LOOM_QUANT_PF && b % sub == 0)
            for (int o = 0; o < gbytes; o += 64) {
                __builtin_prefetch(gb + LOOM_QUANT_PF + o, 0, 3);
                __builtin_prefetch(gb + gstride + LOOM_QUANT_PF + o, 0, 3);
            }
        __m512i q[8];
        __m512 wd, wo;
        {
            const ql_x8_block w0 = ql_x8_decode(qt, gb, (int)(b % sub));
            const ql_x8_block w1 = ql_x8_decode(qt, gb + gstride, (int)(b % sub));
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) q[j] = ql_x16_join(w0.q[j], w1.q[j]);
            wd = ql_x16_joinf(w0.d, w1.d);
            wo = ql_x16_joinf(w0.o, w1.o);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const int8_t *xq = a->q + row * a->K + 32 * b;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) { /* ql_x8_dot's two chains */
                int32_t v0, v1;
                memcpy(&v0, xq + 4 * j, 4);
                memcpy(&v1, xq + 4 * (4 + j), 4);
                s0 = _mm512_dpbusd_epi32(s0, q[j], _mm512_set1_epi32(v0));
                s1 = _mm512_dpbusd_epi32(s1, q[4 + j], _mm512_set1_epi32(v1));
            }
            const float *dx = a->dx8 + (row * nb + b) * 8, *sx = a->s8 + (row * nb + b) * 8;
            /* ql_x8_accumulate, 16 lanes */
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                     _mm512_mul_ps(wd, _mm512_broadcast_f32x8(_mm256_loadu_ps(dx))),
                                     acc[r]);
            if (has_o)
                acc[r] = _mm512_fmadd_ps(wo, _mm512_broadcast_f32x8(_mm256_loadu_ps(sx)), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(y + r * ldy, bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)) : acc[r]);
}
#define QL_X16_CASE(n)                                                                       \
    case n: ql_x16_tile(qt, n, wg, 8 * wrow, a, r, y + r * ldy + 8 * grp, ldy, bg); break;
#endif

/* As ql_chunk, over groups of 8 weight rows (`tiles_per_run` groups a run). */
#define QL_X8_CASE(n) case n: ql_x8_tile(qt, n, wg, a, r, y + r * ldy + 8 * grp, ldy, bg); break;
QS_INLINE void ql_x8_chunk(const int qt, const uint8_t *w, const int64_t wrow, const ql_acts *a,
                           const float *bias, float *y, const int64_t ldy, const int M,
                           const int N, const int tiles_per_run, const int runs, const int chunk) {
    const int64_t m0 = (int64_t)(chunk / runs) * LOOM_QUANT_MC;
    const int64_t m1 = M - m0 < LOOM_QUANT_MC ? M : m0 + LOOM_QUANT_MC;
    const int g0 = chunk % runs * tiles_per_run;
    const int g1 = g0 + tiles_per_run < N / 8 ? g0 + tiles_per_run : N / 8;
    int grp = g0;
#if defined(QL_X16)
    if ((qt == QL_Q4_0 || qt == QL_Q4_1 || qt == QL_Q5_0 || qt == QL_Q4_K || qt == QL_Q5_K) &&
        m1 - m0 >= LOOM_X16_FROM)
        for (; grp + 1 < g1; grp += 2) {
            const uint8_t *wg = w + (int64_t)grp * 8 * wrow;
            const float *bg = bias ? bias + 8 * grp : NULL;
            for (int64_t r = m0; r < m1; r += 8) { /* (8 activation rows a tile) */
                switch (m1 - r < 8 ? (int)(m1 - r) : 8) {
                QL_X16_CASE(1) QL_X16_CASE(2) QL_X16_CASE(3) QL_X16_CASE(4)
                QL_X16_CASE(5) QL_X16_CASE(6) QL_X16_CASE(7) default: QL_X16_CASE(8)
                }
            }
        }
#endif
#if defined(QL_X8_PAIRS)
    if ((qt == QL_Q4_0 || qt == QL_Q4_1 || qt == QL_Q8_0 || QL_X8_Q5_PAIRS) &&
        m1 - m0 >= LOOM_X8_PAIRS_FROM)
        for (; grp + 1 < g1; grp += 2) {
            const uint8_t *wg = w + (int64_t)grp * 8 * wrow;
            const float *bg = bias ? bias + 8 * grp : NULL;
            for (int64_t r = m0; r < m1; r += LOOM_QUANT_X8_R2) {
                switch (m1 - r < LOOM_QUANT_X8_R2 ? (int)(m1 - r) : LOOM_QUANT_X8_R2) {
                QL_X8_TILE2_CASE(1)
                QL_X8_TILE2_CASE(2)
                QL_X8_TILE2_CASE(3)
                default: QL_X8_TILE2_CASE(4)
                }
            }
        }
#endif
    for (; grp < g1; grp++) {
        const uint8_t *wg = w + (int64_t)grp * 8 * wrow;
        const float *bg = bias ? bias + 8 * grp : NULL;
        const int rows = QL_X8_ROWS(qt);
        for (int64_t r = m0; r < m1; r += rows) {
            switch (m1 - r < rows ? (int)(m1 - r) : rows) {
            QL_X8_CASE(1)
#if QL_X8_R > 1
            QL_X8_CASE(2)
#endif
#if QL_X8_R > 2
            QL_X8_CASE(3)
#endif
#if QL_X8_R > 3
            QL_X8_CASE(4)
#endif
#if QL_X8_R > 4
            QL_X8_CASE(5)
#endif
#if QL_X8_R > 5
            QL_X8_CASE(6)
#endif
#if QL_X8_R > 6
            QL_X8_CASE(7)
#endif
#if QL_X8_R > 7
            QL_X8_CASE(8)
#endif
#if QL_X8_R > 8
#error "LOOM_QUANT_X8_R above 8: add cases"
#endif
            }
        }
    }
}

#define QL_DEFINE_X8_CHUNK(QT)                                                               \
    static void ql_x8_chunk_##QT(const uint8_t *w, int64_t wrow, const ql_acts *a,          \
                                 const float *bias, float *y, int64_t ldy, int M, int N,    \
                                 int tiles_per_run, int runs, int chunk, float *woff) {     \
        (void)woff;                                                                          \
        ql_x8_chunk(QT, w, wrow, a, bias, y, ldy, M, N, tiles_per_run, runs, chunk);        \
    }
QL_DEFINE_X8_CHUNK(QL_Q4_0)
QL_DEFINE_X8_CHUNK(QL_Q4_1)
QL_DEFINE_X8_CHUNK(QL_Q5_0)
QL_DEFINE_X8_CHUNK(QL_Q8_0)
QL_DEFINE_X8_CHUNK(QL_Q4_K)
QL_DEFINE_X8_CHUNK(QL_Q5_K)
QL_DEFINE_X8_CHUNK(QL_Q6_K)
#endif

/* The integer path's chunk function for a type number (QL_X8 added: the interleaved layout),
 * or NULL. */
static ql_chunk_fn ql_kernel_for(const int kind) {
    if (!(kind & QL_X8)) return ql_chunk_for(kind);
#if defined(QS_AVX2)
    switch (kind & 0xFF) {
    case QL_Q4_0: return ql_x8_chunk_QL_Q4_0;
    case QL_Q4_1: return ql_x8_chunk_QL_Q4_1;
    case QL_Q5_0: return ql_x8_chunk_QL_Q5_0;
    case QL_Q4_K: return ql_x8_chunk_QL_Q4_K;
    case QL_Q5_K: return ql_x8_chunk_QL_Q5_K;
    case QL_Q6_K: return ql_x8_chunk_QL_Q6_K;
    case QL_Q8_0: return ql_x8_chunk_QL_Q8_0;
    }
#endif
    return NULL;
}

/* The quantized activations live in a per-thread buffer that only grows: a decode step calls
 * this ~200 times, and a fresh allocation of a prefill chunk's size would be fresh pages. */
static __thread void *ql_scratch;
static __thread size_t ql_scratch_bytes;

static void *ql_scratch_for(size_t bytes) {
    if (bytes > ql_scratch_bytes) {
        free(ql_scratch);
        bytes = (bytes + 4095) & ~(size_t)4095;
        ql_scratch = aligned_alloc(64, bytes);
        ql_scratch_bytes = ql_scratch ? bytes : 0;
    }
    return ql_scratch;
}

/* -- float32 activations: dequantized panels ---------------------------------------------- */

/* At hundreds of rows (a prefill chunk) the arithmetic, not the weight traffic, is what
 * counts, and on AVX2 without VNNI packed_linear.c's float32 FMA tile does it faster than the
 * integer path (docs/performance.md, "Quantized linear kernels"): each panel of NR weight rows is
 * dequantized once per call into packed_linear.c's panel layout and multiplied with all rows
 * by its tile. The output is x @ W^T to float32 rounding, with no activation quantization:
 * different numbers from the integer path, so a caller picks one path per kind of call. */
#if !defined(NR) /* (decoder.c may have included packed_linear.c already) */
#include "packed_linear.c"
#endif

static __thread float *ql_panel;
static __thread size_t ql_panel_floats;

static float *ql_panel_for(size_t floats) {
    if (floats > ql_panel_floats) {
        free(ql_panel);
        ql_panel = aligned_alloc(64, (floats * sizeof(float) + 63) & ~(size_t)63);
        ql_panel_floats = ql_panel ? floats : 0;
    }
    return ql_panel;
}

#if defined(QS_AVX2)
/* Block b of an interleaved group (8 weight rows) into 8 columns of a panel: p = the panel
 * at row 32 b, first column of the group; g its (super-)block, j the sub-block. Lane i of
 * q[j] holds row i's weights 4j..4j+3. */
QS_INLINE void ql_x8_dequantize(const int qt, const uint8_t *g, const int j,
                                float *restrict p) {
    const ql_x8_block w = ql_x8_decode(qt, g, j);
    const __m256i byte = _mm256_set1_epi32(0xFF);
#define QL_X8_WEIGHT(j, t)                                                                   \
    do {                                                                                     \
        const __m256i v = qt == QL_Q8_0 && !QS_X8_Q8_OFFSET                                  \
            ? _mm256_srai_epi32(_mm256_slli_epi32(w.q[j], 24 - 8 * (t)), 24)                 \
            : _mm256_and_si256(_mm256_srli_epi32(w.q[j], 8 * (t)), byte);                    \
        _mm256_storeu_ps(p + (4 * (j) + (t)) * NR, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v),    \
                         qt == QL_Q6_K && (j) >= 4 ? w.d1 : w.d,                             \
                         qt == QL_Q6_K && (j) >= 4 ? w.o1 : w.o));                           \
    } while (0)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        QL_X8_WEIGHT(j, 0);
        QL_X8_WEIGHT(j, 1);
        QL_X8_WEIGHT(j, 2);
        QL_X8_WEIGHT(j, 3);
    }
#undef QL_X8_WEIGHT
}
#endif

/* cols (<= NR) weight rows from row n0 of w as a panel [K][NR], columns past cols zero. */
QS_INLINE void ql_dequantize_panel(const int kind, const uint8_t *w, const int64_t wrow,
                                   const int n0, const int cols, const int K,
                                   float *restrict panel) {
    const int qt = kind & 0xFF, sub = ql_subblocks(qt);
    if (cols < NR) memset(panel, 0, sizeof(float) * (size_t)K * NR);
#if defined(QS_AVX2)
    if (kind & QL_X8) { /* n0 and cols are multiples of 8 (NR is 16) */
        for (int c = 0; c < cols; c += 8) {
            const uint8_t *g = w + (int64_t)(n0 + c) * wrow;
            for (int b = 0; b < K / 32; b++)
                ql_x8_dequantize(qt, g + (int64_t)(b / sub) * 8 * ql_block_bytes(qt), b % sub,
                                 panel + (int64_t)32 * b * NR + c);
        }
        return;
    }
#endif
    uint8_t buf[256];
    for (int c = 0; c < cols; c++) {
        for (int b = 0; b < K / 32; b++) {
            const ql_block blk = ql_decode(qt, ql_block_at(kind, w, wrow, n0 + c, b, buf), b % sub);
            int8_t q[32];
            q_store(q, blk.q);
            const float d0 = blk.d * (float)blk.sc0, d1 = blk.d * (float)blk.sc1;
            const float o0 = ql_has_offset(qt) ? blk.o0 : 0.0f;
            const float o1 = ql_offsets(qt) == 2 ? blk.o1 : o0;
            float *p = panel + (int64_t)32 * b * NR + c;
            for (int k = 0; k < 16; k++) {
                p[k * NR] = d0 * (float)q[k] + o0;
                p[(16 + k) * NR] = d1 * (float)q[16 + k] + o1;
            }
        }
    }
}

QS_INLINE void ql_f32_panel(const int kind, const float *x, const int64_t ldx, const uint8_t *w,
                            const int64_t wrow, const float *bias, float *y, const int64_t ldy,
                            const int M, const int N, const int K, const int p, float *panel) {
    const int n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    float bp[NR]; /* the tile reads a whole panel of bias */
    if (bias) {
        memset(bp, 0, sizeof bp);
        memcpy(bp, bias + n0, sizeof(float) * (size_t)cols);
    }
    ql_dequantize_panel(kind, w, wrow, n0, cols, K, panel);
    for (int m = 0; m < M; m += MR)
        rows_f32(M - m < MR ? M - m : MR, K, x + (int64_t)m * ldx, ldx, panel,
                 y + (int64_t)m * ldy + n0, ldy, cols, bias ? bp : NULL, NULL);
}

#define QL_DEFINE_F32_PANEL(NAME, KIND)                                                      \
    static void ql_f32_panel_##NAME(const float *x, int64_t ldx, const uint8_t *w, int64_t wrow, \
                                    const float *bias, float *y, int64_t ldy, int M, int N,   \
                                    int K, int p, float *panel) {                             \
        ql_f32_panel(KIND, x, ldx, w, wrow, bias, y, ldy, M, N, K, p, panel);                 \
    }
QL_DEFINE_F32_PANEL(Q4_0, QL_Q4_0)
QL_DEFINE_F32_PANEL(Q4_1, QL_Q4_1)
QL_DEFINE_F32_PANEL(Q5_0, QL_Q5_0)
QL_DEFINE_F32_PANEL(Q5_1, QL_Q5_1)
QL_DEFINE_F32_PANEL(Q8_0, QL_Q8_0)
QL_DEFINE_F32_PANEL(Q4_K, QL_Q4_K)
QL_DEFINE_F32_PANEL(Q5_K, QL_Q5_K)
QL_DEFINE_F32_PANEL(Q6_K, QL_Q6_K)
#if defined(QS_AVX2)
QL_DEFINE_F32_PANEL(Q4_0_X8, QL_Q4_0 | QL_X8)
QL_DEFINE_F32_PANEL(Q4_1_X8, QL_Q4_1 | QL_X8)
QL_DEFINE_F32_PANEL(Q5_0_X8, QL_Q5_0 | QL_X8)
QL_DEFINE_F32_PANEL(Q4_K_X8, QL_Q4_K | QL_X8)
QL_DEFINE_F32_PANEL(Q5_K_X8, QL_Q5_K | QL_X8)
QL_DEFINE_F32_PANEL(Q6_K_X8, QL_Q6_K | QL_X8)
QL_DEFINE_F32_PANEL(Q8_0_X8, QL_Q8_0 | QL_X8)
#endif

typedef void (*ql_f32_panel_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *,
                                float *, int64_t, int, int, int, int, float *);

static ql_f32_panel_fn ql_f32_panel_for(const int kind) {
    switch (kind) {
    case QL_Q4_0: return ql_f32_panel_Q4_0;
    case QL_Q4_1: return ql_f32_panel_Q4_1;
    case QL_Q5_0: return ql_f32_panel_Q5_0;
    case QL_Q5_1: return ql_f32_panel_Q5_1;
    case QL_Q8_0: return ql_f32_panel_Q8_0;
    case QL_Q4_K: return ql_f32_panel_Q4_K;
    case QL_Q5_K: return ql_f32_panel_Q5_K;
    case QL_Q6_K: return ql_f32_panel_Q6_K;
#if defined(QS_AVX2)
    case QL_Q4_0 | QL_X8: return ql_f32_panel_Q4_0_X8;
    case QL_Q4_1 | QL_X8: return ql_f32_panel_Q4_1_X8;
    case QL_Q5_0 | QL_X8: return ql_f32_panel_Q5_0_X8;
    case QL_Q4_K | QL_X8: return ql_f32_panel_Q4_K_X8;
    case QL_Q5_K | QL_X8: return ql_f32_panel_Q5_K_X8;
    case QL_Q6_K | QL_X8: return ql_f32_panel_Q6_K_X8;
    case QL_Q8_0 | QL_X8: return ql_f32_panel_Q8_0_X8;
#endif
    default: return NULL;
    }
}

/* -- entry points ------------------------------------------------------------------------ */

/* Which block formats this build multiplies (1) or not (0). */
int loom_quant_supported(int qtype) { return ql_kernel_for(qtype) != NULL; }

/* The instruction set this build uses: 0 portable C, 1 AVX2, 2 AVX2 + VNNI, 3 NEON. */
int loom_quant_isa(void) {
#if defined(QS_AVX2) && defined(QS_VNNI)
    return 2;
#elif defined(QS_AVX2)
    return 1;
#elif defined(QS_NEON)
    return 3;
#else
    return 0;
#endif
}

/* x [M, K] (row stride ldx) float32; w [N] rows of wrow bytes of `qtype` blocks covering K
 * (a multiple of the block's elements); bias [N] or NULL; y [M, N] (row stride ldy).
 * Returns 0, -1 for an unsupported qtype or K, -2 when scratch memory could not be had. */
/* Scratch bytes the integer path needs for M rows of K activations. */
static size_t ql_acts_bytes(const int M, const int K) {
    const size_t qbytes = ((size_t)M * K + 63) & ~(size_t)63;
    return qbytes + sizeof(float) * (size_t)M * 20 * (K / 32);
}

/* The integer path's work, shared by the team of threads running it: orphaned worksharing
 * loops, so that decoder.c can run a whole decode step in one parallel region (a region per
 * call cost ~150 fork/joins per step), while loom_quant_linear wraps it in a region of its
 * own. `mem`: ql_acts_bytes(M, K) of scratch shared by the team; `threads`: the team's size.
 * The caller has checked qtype and K. Ends with the team's barrier: y is complete. */
static void ql_linear_team(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                           int64_t wrow, const float *bias, float *y, int64_t ldy, int M, int N,
                           int K, char *mem, int threads) {
    const ql_chunk_fn run = ql_kernel_for(qtype);
    const int x8 = qtype & QL_X8, qt = qtype & 0xFF;
    const int64_t nb = K / 32;
    const size_t qbytes = ((size_t)M * K + 63) & ~(size_t)63;
    float *f = (float *)(mem + qbytes);
    const ql_acts a = {.q = (int8_t *)mem, .d = f, .s32 = f + M * nb, .s16 = f + 2 * M * nb,
                       .K = K, .nb = nb, .pairs = !x8 && ql_pairs(qt), .qt = qt,
                       .d8 = f + 4 * M * nb, .s4 = f + 8 * M * nb,
                       .x8 = x8 != 0, .dx8 = f + 4 * M * nb, .s8 = f + 12 * M * nb};
    const int width = x8 ? 8 : QL_C; /* weight rows a tile covers */
    const int tiles = (N + width - 1) / width;
    /* One run of contiguous weight rows per thread (for each block of activation rows): each
     * thread streams one region, which the hardware prefetcher follows to its end. Eight runs
     * per thread, taken dynamically, balanced the load better but restarted the stream every
     * 1/16 of a matrix: on a 2-core Zen 4 EPYC a decode step's layers read their weights at
     * 22-26 GB/s that way against 25-32 GB/s now, and served SmolLM2 Q4_1 at c=1 had ITL p50
     * 5.3-6.0 ms against 4.5-5.0 (docs/performance.md). */
    const int tiles_per_run = (tiles + threads - 1) / threads;
    const int runs = (tiles + tiles_per_run - 1) / tiles_per_run;
    const int chunks = (M + LOOM_QUANT_MC - 1) / LOOM_QUANT_MC * runs;
    float woff[QL_C * 2 * nb];
#pragma omp for schedule(static)
    for (int r = 0; r < M; r++) ql_quantize_row(x + (int64_t)r * ldx, &a, r);
#pragma omp for schedule(dynamic, 1)
    for (int chunk = 0; chunk < chunks; chunk++)
        run(w, wrow, &a, bias, y, ldy, M, N, tiles_per_run, runs, chunk, woff);
}

/* x [M, K] (row stride ldx) float32; w [N] rows of wrow bytes of `qtype` blocks covering K
 * (a multiple of the block's elements); bias [N] or NULL; y [M, N] (row stride ldy).
 * Returns 0, -1 for an unsupported qtype or K, -2 when scratch memory could not be had. */
int loom_quant_linear(int qtype, const float *x, int64_t ldx, const uint8_t *w, int64_t wrow,
                      const float *bias, float *y, int64_t ldy, int M, int N, int K) {
    if (ql_kernel_for(qtype) == NULL || K % (32 * ql_subblocks(qtype)) != 0) return -1;
    if ((qtype & QL_X8) && N % 8) return -1;
    if (M <= 0 || N <= 0) return 0;
    char *mem = ql_scratch_for(ql_acts_bytes(M, K));
    if (mem == NULL) return -2;
#pragma omp parallel
    ql_linear_team(qtype, x, ldx, w, wrow, bias, y, ldy, M, N, K, mem, omp_get_num_threads());
    return 0;
}

/* out [n, K] = the rows ids[0..n) of W, dequantized (an embedding lookup from a quantized
 * table). Returns 0, or -1 for an unsupported qtype or K. */
int loom_quant_dequantize_rows(int qtype, const uint8_t *w, int64_t wrow, const int64_t *ids,
                               int n, int K, float *out) {
    if (ql_kernel_for(qtype) == NULL || K % (32 * ql_subblocks(qtype)) != 0) return -1;
    const int qt = qtype & 0xFF, sub = ql_subblocks(qt);
    uint8_t buf[256];
    for (int i = 0; i < n; i++) {
        float *o = out + (int64_t)i * K;
        for (int b = 0; b < K / 32; b++) {
            const ql_block blk = ql_decode(qt, ql_block_at(qtype, w, wrow, ids[i], b, buf), b % sub);
            int8_t q[32];
            q_store(q, blk.q);
            const float d0 = blk.d * (float)blk.sc0, d1 = blk.d * (float)blk.sc1;
            const float o0 = ql_has_offset(qt) ? blk.o0 : 0.0f;
            const float o1 = ql_offsets(qt) == 2 ? blk.o1 : o0;
            for (int k = 0; k < 16; k++) {
                o[32 * b + k] = d0 * (float)q[k] + o0;
                o[32 * b + 16 + k] = d1 * (float)q[16 + k] + o1;
            }
        }
    }
    return 0;
}

/* The float32 path's work for a team already running (as ql_linear_team); a thread whose
 * panel buffer could not be had sets *failed. Ends with the team's barrier. */
static void ql_linear_f32_team(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                               int64_t wrow, const float *bias, float *y, int64_t ldy, int M,
                               int N, int K, int *failed) {
    const ql_f32_panel_fn run = ql_f32_panel_for(qtype);
    const int panels = (N + NR - 1) / NR;
    float *panel = ql_panel_for((size_t)K * NR);
    if (panel == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int p = 0; p < panels; p++)
        if (panel) run(x, ldx, w, wrow, bias, y, ldy, M, N, K, p, panel);
}

/* As loom_quant_linear, with float32 activations: W dequantized panel by panel (see above).
 * Returns 0, -1 for an unsupported qtype or K, -2 when scratch memory could not be had. */
int loom_quant_linear_f32(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                          int64_t wrow, const float *bias, float *y, int64_t ldy, int M, int N,
                          int K) {
    if (ql_f32_panel_for(qtype) == NULL || K % (32 * ql_subblocks(qtype)) != 0) return -1;
    if ((qtype & QL_X8) && N % 8) return -1;
    if (M <= 0 || N <= 0) return 0;
    int failed = 0;
#pragma omp parallel
    ql_linear_f32_team(qtype, x, ldx, w, wrow, bias, y, ldy, M, N, K, &failed);
    return failed ? -2 : 0;
}
