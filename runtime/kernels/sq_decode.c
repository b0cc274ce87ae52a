/* sparkq's C core: one whole decode step (embedding -> layers -> head, sq_step), a whole
 * prompt (sq_prefill, chunks of tokens through every layer) and the W4A8 GEMM they share.
 *
 * Compiled on the user's machine by sparkq/runtime/kernels.py (gcc/cc -O3 -march=native
 * -fopenmp), loaded with ctypes, called once per generated token and once per prompt. Weights are read
 * in place from the artifact's mapping; nothing is repacked or copied.
 *
 * Int4 linears use the "rows32" layout (formats/layout.py is the contract): row-major,
 * each row K/2 bytes, 32-column blocks of 16 bytes, byte j = q[32b+j] | q[32b+j+16] << 4,
 * with bf16 scales_zeros [K/g, N, 2] and w = (q - 8) * scale + zero.
 *
 * Products are W4A8: the activation vector is quantized to int8 with one scale per 8 columns
 * (scale = max|x| / 127, round to nearest; see quantize_act), the code x activation dot
 * products are exact integers (AVX2 maddubs / AVX512-VNNI vpdpbusd: unsigned codes x signed
 * activations), and
 *   y[n] = sum_g s[g,n] * (sum_{b in g} xs[b] * (dot(q_b, xq_b) - 8 sum(xq_b))) + z[g,n] * sum_{k in g} x[k]
 * (b: the 8-column sub-blocks)
 * The -8 offset must use the quantized sums (it belongs to the codes: using exact sums there
 * leaves an uncancelled 8*s*sum(x^ - x) error, measured 4x the A8 KL); the zero term uses
 * the unquantized x, so it carries no activation error.
 * Int8 linears (per-row scale, e.g. the tied head) use the same activation scales; bf16
 * linears are multiplied in fp32. Everything between the products (norms, RoPE,
 * attention, activations, residual) is fp32; the KV cache is bf16 and shared with the
 * torch model's prefill when that one is used (c_prefill=False, --prefill kernel|dequant).
 *
 * Prompts of >= 32 tokens on CPUs with AVX512-BF16 take a W4A16 GEMM instead (bf16_gemm: row
 * blocks dequantized to bf16, vdpbf16ps), the other prompts the W4A8 GEMM (sq_linear_batch).
 *
 * SQ_SCALAR forces the portable C path (tests build both and compare); -mno-avx512f on an
 * AVX512 machine gives the AVX2 paths (the "avx2" build).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(SQ_SCALAR)
#define SQ_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SQ_AVX512 1 /* int4 products with VNNI (vpdpbusd), 128 columns per instruction pair */
#if defined(__AVX512BF16__)
#define SQ_BF16 1 /* prefill GEMM: int4 row blocks dequantized to bf16, vdpbf16ps (see bf16_gemm) */
#endif
#endif
#include <immintrin.h>
#endif

#define SQ_ABI 5
#define QUAD_MAX_GROUPS 256 /* more weight groups per row: the AVX2 (paired) products instead */

enum { KIND_INT4 = 0, KIND_INT8 = 1, KIND_BF16 = 2 };

/* every field 8 bytes wide so the ctypes mirror has no padding questions */
typedef struct {
    const uint8_t *q;       /* int4: rows32 bytes [N, K/2]; int8: int8 [N, K]; bf16: bf16 [N, K] */
    const uint16_t *sz;     /* int4: bf16 [K/g, N, 2]; int8: bf16 scales [N]; bf16: unused */
    const uint16_t *bias;   /* bf16 [N] or NULL */
    int64_t kind, n, k, g;
    /* a split int4 linear's second plane (formats/constants.py), else NULL: rows32 codes r
     * [N, K/2] and bf16 scales [N, K/g]; stored weight = (q - 8) s + z + (r - 8) rs. Products
     * read the first plane only; refine_split and embed_row add the second. */
    const uint8_t *res;
    const uint16_t *rsc;
} sq_linear;

typedef struct {
    sq_linear qkv, o, gate_up, down;
    const uint16_t *attn_norm, *mlp_norm, *post_attn_norm, *post_mlp_norm, *q_norm, *k_norm;
    const uint16_t *cos, *sin; /* bf16 [rope_len, rot] */
    uint16_t *kcache, *vcache; /* bf16 [kv_heads, cap, head_dim] of this layer */
    int64_t rot, window;       /* window 0 = full attention */
} sq_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, cap, act, norm_offset, refine_top;
    double eps, attn_scale, embed_mult; /* embed_mult 0 = off */
    sq_layer *layer;
    sq_linear head, embed;
    const uint16_t *final_norm;
} sq_model;

static inline float bf(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, like torch */
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

#ifdef SQ_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---- shared vector helpers ------------------------------------------------------------ */

#ifdef SQ_AVX2
/* e^x for x <= 0 (scores minus their max; -g of SiLU is clamped): Cephes' polynomial,
 * ~2 ulp; below -87.3 the result is 0. exp16 (AVX512) runs the same arithmetic on 16 lanes. */
static const float EXP_P[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static inline __m256 load_bf8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#ifdef SQ_AVX512
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P[i]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e));
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* the first `left` of 16 lanes (none when left <= 0): a 16-row vector's rows before N, a tail's keys */
static inline __mmask16 rows_mask(int64_t left) {
    return left <= 0 ? 0 : left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
}
#endif

/* ---- activation blocks --------------------------------------------------------------- */

typedef struct {
    int8_t *q;    /* [K rounded up to 128] codes; natural column order, or "paired"/"quad" (see quantize_act) */
    float *s8;    /* [K/32 * 4] scale per 8 columns: s8[4b + i] for sub-block i of block b */
    float *gsum;  /* [K/g] exact fp32 sum of x per weight group */
    float *gqsum; /* [K/g] sum of the quantized x per weight group */
    const float *x;
    int paired;   /* 0 natural order, 1 paired (AVX2 int4), 2 quad (AVX512 int4) */
    uint64_t epoch;       /* product counter (32 bits), see products() */
    struct sq_slot *slot; /* [SQ_MAXT] work-stealing ranges, one cache line each */
} sq_act;

#define SQ_MAXT 64
typedef struct sq_slot { uint64_t v; char pad[56]; } sq_slot;

/* 64-byte aligned (a whole number of cache lines): the AVX512 products load the codes and the
 * scales 64 bytes at a time, and a load that straddles two lines costs more */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

static int sq_act_alloc(sq_act *a, int64_t maxk) {
    a->q = alloc64((maxk + 127) / 128 * 128);
    a->s8 = alloc64(sizeof(float) * (maxk / 32 + 2) * 4);
    a->gsum = malloc(sizeof(float) * (maxk / 32 + 1));
    a->gqsum = malloc(sizeof(float) * (maxk / 32 + 1));
    a->slot = aligned_alloc(64, sizeof(sq_slot) * SQ_MAXT);
    if (a->slot) memset(a->slot, 0, sizeof(sq_slot) * SQ_MAXT);
    a->epoch = 0;
    return a->q && a->s8 && a->gsum && a->gqsum && a->slot;
}

static void sq_act_free(sq_act *a) {
    free(a->q); free(a->s8); free(a->gsum); free(a->gqsum); free(a->slot);
}

/* Quantize x [k] for a product with L, one int8 scale per 8 columns (a->s8[4b + i]):
 * sub-block i of 32-column block b holds columns 4i..4i+3 and 16+4i..16+4i+3. Those are the
 * eight activations that meet one 32-bit lane of the AVX2 products (int4: the four low and
 * four high nibbles of weight bytes 4i..4i+3; int8: lanes i and i + 4), so the scales cost
 * the products nothing; against one scale per 32 columns they cut the A8 error of a product
 * with an outlier channel from ~1% to ~0.6% and the example's W4A8 KL excess 3-fold
 * (README "Prefill").
 * For an int4 L on AVX2 with K % 64 == 0 and g % 64 == 0 the codes go in "paired" order: for
 * block pair p, bytes 64p..64p+31 hold columns 0..15 of blocks 2p and 2p+1, bytes 64p+32..63
 * their columns 16..31 -- the order in which one 32-byte load of two weight blocks yields its
 * low and high nibbles. With AVX512-VNNI the same holds for 64-byte loads ("quad" order): for
 * block quad p, bytes 128p..128p+63 hold columns 0..15 of blocks 4p..4p+3, bytes 128p+64..127
 * their columns 16..31 (a last quad of two blocks when K % 128 == 64 keeps the same offsets, so
 * the buffer is K rounded up to 128). Lane l of a VNNI product of quad p then covers sub-block
 * l % 4 of block 4p + l / 4, whose scale is s8[16p + l]. */
static void quantize_act(const float *x, const sq_linear *L, sq_act *a) {
    const int64_t k = L->k, G = L->kind == KIND_INT4 ? L->g : 32;
    a->x = x;
#if defined(SQ_AVX512) /* quad where a 16-row chunk's scales fit rows_int4_avx512's buffer */
    a->paired = L->kind == KIND_INT4 && k % 64 == 0 && G % 64 == 0 ? (k / G <= QUAD_MAX_GROUPS ? 2 : 1) : 0;
#elif defined(SQ_AVX2)
    a->paired = L->kind == KIND_INT4 && k % 64 == 0 && G % 64 == 0;
#else
    a->paired = 0;
#endif
    for (int64_t gi = 0; gi < k / G; gi++) a->gsum[gi] = a->gqsum[gi] = 0.f;
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        const int64_t span = a->paired == 2 ? 128 : 64; /* bytes per pair / quad of blocks */
        int8_t *dst = a->q + (a->paired ? span * (b / (span / 32)) + 16 * (b % (span / 32)) : 32 * b);
        float d[4] = {0.f, 0.f, 0.f, 0.f}, sum = 0.f;
        int32_t qs[4] = {0, 0, 0, 0};
#ifdef SQ_AVX2
        /* the same arithmetic as the portable loop below (cvtps rounds half to even, as lrintf) */
        __m256 v[4], ab[4];
        const __m256 sign = _mm256_set1_ps(-0.f), c127 = _mm256_set1_ps(127.f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            ab[i] = _mm256_andnot_ps(sign, v[i]);
        }
        sum = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        /* m02: lanes 0-3 = columns 0-3 and 16-19 (sub-block 0), 4-7 = sub-block 1; m13: 2 and 3 */
        __m256 m02 = _mm256_max_ps(ab[0], ab[2]), m13 = _mm256_max_ps(ab[1], ab[3]);
        m02 = _mm256_max_ps(m02, _mm256_permute_ps(m02, 0x4e));
        m02 = _mm256_max_ps(m02, _mm256_permute_ps(m02, 0xb1));
        m13 = _mm256_max_ps(m13, _mm256_permute_ps(m13, 0x4e));
        m13 = _mm256_max_ps(m13, _mm256_permute_ps(m13, 0xb1));
        const __m256 id02 = _mm256_and_ps(_mm256_div_ps(c127, m02), _mm256_cmp_ps(m02, _mm256_setzero_ps(), _CMP_GT_OQ));
        const __m256 id13 = _mm256_and_ps(_mm256_div_ps(c127, m13), _mm256_cmp_ps(m13, _mm256_setzero_ps(), _CMP_GT_OQ));
        float dv[16];
        _mm256_storeu_ps(dv, _mm256_div_ps(m02, c127));
        _mm256_storeu_ps(dv + 8, _mm256_div_ps(m13, c127));
        d[0] = dv[0], d[1] = dv[4], d[2] = dv[8], d[3] = dv[12];
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id02)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id13));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id02)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id13));
        __m256i s02 = _mm256_add_epi32(i0, i2), s13 = _mm256_add_epi32(i1, i3);
        s02 = _mm256_add_epi32(s02, _mm256_shuffle_epi32(s02, 0x4e));
        s02 = _mm256_add_epi32(s02, _mm256_shuffle_epi32(s02, 0xb1));
        s13 = _mm256_add_epi32(s13, _mm256_shuffle_epi32(s13, 0x4e));
        s13 = _mm256_add_epi32(s13, _mm256_shuffle_epi32(s13, 0xb1));
        int32_t qv[16];
        _mm256_storeu_si256((__m256i *)qv, s02);
        _mm256_storeu_si256((__m256i *)(qv + 8), s13);
        qs[0] = qv[0], qs[1] = qv[4], qs[2] = qv[8], qs[3] = qv[12];
        __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (a->paired) {
            _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(q8));
            _mm_storeu_si128((__m128i *)(dst + span / 2), _mm256_extracti128_si256(q8, 1));
        } else {
            _mm256_storeu_si256((__m256i *)dst, q8);
        }
#else
        float amax[4] = {0.f, 0.f, 0.f, 0.f}, id[4];
        for (int j = 0; j < 32; j++) {
            const int i = (j % 16) / 4;
            float v = fabsf(xb[j]);
            amax[i] = v > amax[i] ? v : amax[i];
            sum += xb[j];
        }
        for (int i = 0; i < 4; i++) {
            d[i] = amax[i] / 127.f;
            id[i] = amax[i] > 0.f ? 127.f / amax[i] : 0.f;
        }
        for (int j = 0; j < 32; j++) {
            const int i = (j % 16) / 4;
            int8_t v = (int8_t)lrintf(xb[j] * id[i]);
            qs[i] += v;
            dst[j] = v;
        }
#endif
        for (int i = 0; i < 4; i++) a->s8[4 * b + i] = d[i];
        a->gsum[32 * b / G] += sum;
        a->gqsum[32 * b / G] += d[0] * (float)qs[0] + d[1] * (float)qs[1] + d[2] * (float)qs[2] + d[3] * (float)qs[3];
    }
}

/* ---- products, rows [r0, r1) --------------------------------------------------------- */

#ifdef SQ_AVX2

/* int4 x paired int8 activations, one row. The bytes `ahead` rows further on are prefetched
 * as they are read: a software stream beside the hardware one. */
/* rows ahead of the current one whose bytes the row loops prefetch: `bytes` worth, at least 2 */
static inline int64_t rows_ahead(int64_t rowbytes, int64_t bytes) {
    const int64_t r = (bytes + rowbytes - 1) / rowbytes;
    return r > 2 ? r : 2;
}

static inline void int4_row(const sq_linear *L, const sq_act *a, float *y, int64_t n, int64_t ahead) {
    const int64_t K = L->k, N = L->n, G = L->g, ppg = G / 64, ngroups = K / G, rb = K / 2;
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float zt = 0.f;
    const uint8_t *w = L->q + n * rb;
    for (int64_t gi = 0; gi < ngroups; gi++) {
        __m256 gacc = _mm256_setzero_ps();
        for (int64_t pp = 0; pp < ppg; pp++) {
            const int64_t p = gi * ppg + pp;
            const __m256i xl = _mm256_loadu_si256((const __m256i *)(a->q + 64 * p));
            const __m256i xh = _mm256_loadu_si256((const __m256i *)(a->q + 64 * p + 32));
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * p));
            _mm_prefetch((const char *)(w + ahead * rb + 32 * p), _MM_HINT_T0);
            const __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            gacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), _mm256_loadu_ps(a->s8 + 8 * p), gacc);
        }
        const uint16_t *p = L->sz + 2 * (gi * N + n);
        const float s = bf(p[0]), z = bf(p[1]);
        acc = _mm256_fmadd_ps(gacc, _mm256_set1_ps(s), acc);
        zt += z * a->gsum[gi] - 8.f * s * a->gqsum[gi];
    }
    y[n] = hsum8(acc) + zt;
}

/* Rows [r0, r1) (one 16-row chunk of the products loop). Decode streams every weight once, so
 * this is about keeping DRAM busy: one row at a time with the bytes of the row 1 KiB further on
 * prefetched (at least 2 rows), and the scales/zeros of the chunk 32 rows on prefetched up
 * front -- they are [K/g, N, 2], one cache line per group every 16 rows, K/g streams that the
 * hardware prefetcher does not follow. Measured, whole decode step (median of 32 steps,
 * interleaved builds, 2-3 rounds): Qwen3-1.7B shape 8.9-10.5 tok/s with the previous 4 rows at a
 * time and a one-block prefetch, 10.3-11.2 one row with 2 rows ahead, 11.2-13.7 adding the
 * scale prefetch; example 88-105 -> 97-105 (2 rows ahead) / 100-111 (4 rows = 1152 bytes). */
static void rows_int4_avx2(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    const int64_t N = L->n, ng = L->k / L->g, rb = L->k / 2;
    const int64_t ahead = rows_ahead(rb, 1024);
    for (int64_t gi = 0; gi < ng && r0 + 32 < N; gi++)
        _mm_prefetch((const char *)(L->sz + 2 * (gi * N + r0 + 32)), _MM_HINT_T0);
    for (int64_t n = r0; n < r1; n++) int4_row(L, a, y, n, ahead);
}

#ifdef SQ_AVX512
/* The weight scales of quad step p (128 columns) from a row's fp32 group scales s: one group
 * (g >= 128; gsh = log2(g / 128)) or two (g = 64, gsh < 0: lanes 0-7, 8-15). */
static inline __m512 step_scales(const float *s, int gsh, int64_t p, int64_t st) { /* s[st * group] */
    if (gsh < 0) return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s[st * 2 * p]), _mm512_set1_ps(s[st * (2 * p + 1)]));
    return _mm512_set1_ps(s[st * (p >> gsh)]);
}

static inline int group_shift(int64_t G) { return G == 64 ? -1 : __builtin_ctzll((uint64_t)G) - 7; }

/* One quad step p (128 columns) of one row w: the 16 lanes' integer dot products (each over
 * the 8 columns of one activation scale), as fp32; the bytes `ahead` of them prefetched. */
static inline __attribute__((always_inline)) __m512 quad_dot(const uint8_t *w, const uint8_t *ahead, __m512i xl,
                                                             __m512i xh, int64_t p) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), wv = _mm512_loadu_si512((const void *)(w + 64 * p));
    _mm_prefetch((const char *)(ahead + 64 * p), _MM_HINT_T0);
    const __m512i lo = _mm512_and_si512(wv, m4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh));
}

/* The half step after the last whole quad (K % 128 == 64, then g = 64: one group): row w's
 * codes of blocks 4p, 4p + 1 against their quad-order activations through 256-bit VNNI, times
 * the activation scales, summed (the weight scale is the caller's). */
static inline float half_step(const uint8_t *w, const int8_t *xq, const float *s8, int64_t p) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), wv = _mm256_loadu_si256((const __m256i *)(w + 64 * p));
    const __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
    __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(xq + 128 * p)));
    d = _mm256_dpbusd_epi32(d, hi, _mm256_loadu_si256((const __m256i *)(xq + 128 * p + 64)));
    return hsum8(_mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(s8 + 16 * p)));
}

/* One row n of int4 x quad int8 activations (VNNI). sc: the row's fp32 weight scales, one every
 * 16 floats (its chunk's scales are group-major: sc[16 gi + row]); zt: its zero and -8 terms.
 * Per 128 columns one 64-byte weight load, two masks, two vpdpbusd, a convert and two FMAs
 * (activation scales, weight scales; g >= 256: the weight scale once per group, through a group
 * accumulator); a last half step (K % 128 == 64, then g = 64) goes through 256-bit VNNI. */
static inline __attribute__((always_inline)) void int4_row512(const sq_linear *L, const sq_act *a, float *y, int64_t n,
                                                              const float *sc, float zt, int64_t ahead) {
    const int64_t K = L->k, G = L->g, rb = K / 2, nq = K / 128, ng = K / G;
    const uint8_t *w = L->q + n * rb, *wa = w + ahead * rb;
    __m512 acc = _mm512_setzero_ps();
    if (G <= 128) { /* one step per scale vector: no group accumulator */
        const int gsh = group_shift(G);
        for (int64_t p = 0; p < nq; p++) {
            const __m512i xl = _mm512_loadu_si512((const void *)(a->q + 128 * p));
            const __m512i xh = _mm512_loadu_si512((const void *)(a->q + 128 * p + 64));
            const __m512 xs = _mm512_loadu_ps(a->s8 + 16 * p);
            acc = _mm512_fmadd_ps(_mm512_mul_ps(quad_dot(w, wa, xl, xh, p), xs), step_scales(sc, gsh, p, 16), acc);
        }
    } else {
        const int64_t spg = G / 128;
        for (int64_t gi = 0; gi < ng; gi++) {
            __m512 gacc = _mm512_setzero_ps();
            for (int64_t p = gi * spg; p < (gi + 1) * spg; p++) {
                const __m512i xl = _mm512_loadu_si512((const void *)(a->q + 128 * p));
                const __m512i xh = _mm512_loadu_si512((const void *)(a->q + 128 * p + 64));
                const __m512 xs = _mm512_loadu_ps(a->s8 + 16 * p);
                gacc = _mm512_fmadd_ps(quad_dot(w, wa, xl, xh, p), xs, gacc);
            }
            acc = _mm512_fmadd_ps(gacc, _mm512_set1_ps(sc[16 * gi]), acc);
        }
    }
    const float t = K % 128 ? half_step(w, a->q, a->s8, nq) * sc[16 * (ng - 1)] : 0.f;
    y[n] = _mm512_reduce_add_ps(acc) + t + zt;
}

/* Rows [r0, r1), 16 at a time. A chunk's scales and zeros are one cache line per group
 * ([K/g, N, 2]); they are converted up front, 16 rows per vector, into group-major scales and
 * per-row zero terms, so the row loop reads only the weights and the activations. Their lines
 * (K/g streams the hardware prefetcher does not follow) are prefetched 3 chunks ahead, a few
 * per row: the same prefetches issued together at the chunk's start (2 and 3 chunks ahead)
 * stalled the weight stream behind them, 5% of the whole decode step (1.7B shape, 4
 * interleaved rounds of 3 x 64 lite steps, scratch A/B script, not kept: 42.2 -> 45.7 tok/s
 * contended, 64.6 -> 66.7 quiet).
 * One row at a time: the weights are then one sequential stream per thread. Two rows sharing
 * the activation loads (before) interleaved two streams 1 row apart, which the prefetchers
 * followed worse: every body product of the 1.7B shape in step order (scratch ctypes script,
 * not kept; 3 interleaved rounds with a streaming-read probe) 27.6 -> 33.0-34.0 GB/s on one
 * thread (probe ~41), 34 -> 40 on two (probe ~49). */
static void rows_int4_avx512(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    if (r1 - r0 > 16) {
        for (int64_t c = r0; c < r1; c += 16) rows_int4_avx512(L, a, y, c, c + 16 < r1 ? c + 16 : r1);
        return;
    }
    const int64_t N = L->n, ng = L->k / L->g, rb = L->k / 2, nr = r1 - r0;
    const int64_t ahead = rows_ahead(rb, 8192);
    float sc[16 * QUAD_MAX_GROUPS] __attribute__((aligned(64))), zt[16];
    const __mmask16 valid = rows_mask(nr);
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000);
    __m512 ztv = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < ng; gi++) {
        const uint16_t *p = L->sz + 2 * (gi * N + r0);
        const __m512i v = _mm512_maskz_loadu_epi32(valid, (const void *)p); /* (scale, zero) per row, scale low */
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), z = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
        _mm512_store_ps(sc + 16 * gi, s);
        ztv = _mm512_add_ps(ztv, _mm512_sub_ps(_mm512_mul_ps(z, _mm512_set1_ps(a->gsum[gi])),
                                               _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(8.f), s), _mm512_set1_ps(a->gqsum[gi]))));
    }
    _mm512_storeu_ps(zt, ztv);
    const int64_t per = (ng + 15) / 16; /* scale lines of the chunk 3 on, spread over the rows */
    for (int64_t i = 0; i < nr; i++) {
        if (r0 + 64 < N)
            for (int64_t gi = i * per; gi < (i + 1) * per && gi < ng; gi++)
                _mm_prefetch((const char *)(L->sz + 2 * (gi * N + r0 + 48)), _MM_HINT_T0);
        int4_row512(L, a, y, r0 + i, sc + i, zt[i], ahead);
    }
}
#endif

static inline __attribute__((always_inline)) void int8_rows_r(const sq_linear *L, const sq_act *a, float *y, int64_t n,
                                                             const int R) {
    const int64_t K = L->k;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *w = (const int8_t *)L->q + n * K;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
        const __m256 xs = _mm256_broadcast_ps((const __m128 *)(a->s8 + 4 * b)); /* lanes i, i + 4: sub-block i */
        for (int r = 0; r < R; r++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * K + 32 * b));
            _mm_prefetch((const char *)(w + (r + 2 * R) * K + 32 * b), _MM_HINT_T0); /* two rows ahead */
            __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), xs, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[n + r] = hsum8(acc[r]) * bf(L->sz[n + r]);
}

static __attribute__((unused)) void rows_int8_avx2(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    /* one row at a time: measured 2x faster than 2 or 4 rows sharing the activation loads */
    for (int64_t n = r0; n < r1; n++) int8_rows_r(L, a, y, n, 1);
}

#ifdef SQ_AVX512
/* Int8 rows (natural activation order) with VNNI. vpdpbusd wants unsigned x signed bytes: the
 * weights go in with their sign bit flipped (w + 128) and each product starts from
 * -128 * (the sum of the activations in its lane), computed per 64 columns.
 * Lane l of 64 columns p covers columns 4(l % 8).. of block 2p + l / 8: sub-block l % 4. */
static inline __attribute__((always_inline)) void int8_row512(const sq_linear *L, const sq_act *a, float *y, int64_t n,
                                                              int64_t ahead) {
    const int64_t K = L->k;
    const int8_t *w = (const int8_t *)L->q + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    const __m512i perm = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
    __m512 acc = _mm512_setzero_ps();
    int64_t p = 0;
    for (; 64 * p + 64 <= K; p++) {
        const __m512i xv = _mm512_loadu_si512((const void *)(a->q + 64 * p));
        const __m512i corr = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(),
                                                                _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, xv)), 7);
        const __m512 xs = _mm512_permutexvar_ps(perm, _mm512_castps256_ps512(_mm256_loadu_ps(a->s8 + 8 * p)));
        const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 64 * p)), flip);
        _mm_prefetch((const char *)(w + ahead * K + 64 * p), _MM_HINT_T0);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, wv, xv)), xs, acc);
    }
    float t = 0.f;
    if (K % 64) { /* the last 32 columns (K % 32 == 0) */
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + 64 * p));
        const __m256i corr = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(),
                             _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), xv)), 7);
        const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * p)), _mm256_set1_epi8((char)0x80));
        t = hsum8(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(corr, wv, xv)),
                                _mm256_broadcast_ps((const __m128 *)(a->s8 + 8 * p))));
    }
    y[n] = (_mm512_reduce_add_ps(acc) + t) * bf(L->sz[n]);
}

/* one row at a time (one sequential stream per thread, as the int4 rows): a 151936 x 2048 int8
 * head alone (scratch ctypes script, not kept; 2 threads, 3 interleaved rounds) 56-57 -> 78 GB/s
 * against two rows sharing the activation loads */
static void rows_int8_avx512(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    const int64_t ahead = rows_ahead(L->k, 8192);
    for (int64_t n = r0; n < r1; n++) int8_row512(L, a, y, n, ahead);
}
#endif
#endif

/* portable versions (natural activation order) */
static void rows_int4_c(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    const int64_t K = L->k, N = L->n, G = L->g, bpg = G / 32, ngroups = K / G;
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *w = L->q + n * (K / 2);
        float acc = 0.f;
        for (int64_t gi = 0; gi < ngroups; gi++) {
            const uint16_t *p = L->sz + 2 * (gi * N + n);
            float s = bf(p[0]), z = bf(p[1]), gacc = 0.f;
            for (int64_t b = gi * bpg; b < (gi + 1) * bpg; b++) {
                const uint8_t *wb = w + 16 * b;
                const int8_t *xb = a->q + 32 * b;
                for (int i = 0; i < 4; i++) { /* sub-block i: its own activation scale */
                    int32_t d = 0;
                    for (int j = 4 * i; j < 4 * i + 4; j++) d += (wb[j] & 15) * xb[j] + (wb[j] >> 4) * xb[j + 16];
                    gacc += (float)d * a->s8[4 * b + i];
                }
            }
            acc += gacc * s + z * a->gsum[gi] - 8.f * s * a->gqsum[gi];
        }
        y[n] = acc;
    }
}

#ifndef SQ_AVX2
static void rows_int8_c(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    const int64_t K = L->k;
    for (int64_t n = r0; n < r1; n++) {
        const int8_t *w = (const int8_t *)L->q + n * K;
        float acc = 0.f;
        for (int64_t b = 0; b < K / 32; b++) {
            for (int i = 0; i < 4; i++) { /* sub-block i: its own activation scale */
                int32_t d = 0;
                for (int j = 4 * i; j < 4 * i + 4; j++) d += w[32 * b + j] * a->q[32 * b + j] + w[32 * b + j + 16] * a->q[32 * b + j + 16];
                acc += (float)d * a->s8[4 * b + i];
            }
        }
        y[n] = acc * bf(L->sz[n]);
    }
}

#endif

/* sum_j bf16(w[j]) * x[j] (bf16 weights, KV cache rows) */
static inline float dot_bf16(const uint16_t *w, const float *x, int64_t K) {
    float acc = 0.f;
    int64_t j = 0;
#ifdef SQ_AVX2
    __m256 v = _mm256_setzero_ps();
    for (; j + 8 <= K; j += 8) {
        __m256i wi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + j))), 16);
        v = _mm256_fmadd_ps(_mm256_castsi256_ps(wi), _mm256_loadu_ps(x + j), v);
    }
    acc = hsum8(v);
#endif
    for (; j < K; j++) acc += bf(w[j]) * x[j];
    return acc;
}

static void rows_bf16(const sq_linear *L, const float *x, float *y, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; n++) y[n] = dot_bf16((const uint16_t *)L->q + n * L->k, x, L->k);
}

/* Row n of L times fp32 x in double, from the stored weights (no A8): the top-k refinement
 * and the SQ_EXACT reference build. */
static double exact_row_dot(const sq_linear *L, int64_t n, const float *x) {
    const int64_t K = L->k;
    double acc = 0.0;
    if (L->kind == KIND_INT4) {
        const uint8_t *w = L->q + n * (K / 2);
        for (int64_t k = 0; k < K; k++) {
            uint8_t byte = w[(k / 32) * 16 + (k % 16)];
            int q = (k % 32) < 16 ? (byte & 15) : (byte >> 4);
            const uint16_t *p = L->sz + 2 * ((k / L->g) * L->n + n);
            acc += (double)((q - 8.f) * bf(p[0]) + bf(p[1])) * x[k];
        }
    } else if (L->kind == KIND_INT8) {
        const int8_t *w = (const int8_t *)L->q + n * K;
        const float s = bf(L->sz[n]);
        for (int64_t k = 0; k < K; k++) acc += (double)(w[k] * s) * x[k];
    } else {
        const uint16_t *w = (const uint16_t *)L->q + n * K;
        for (int64_t k = 0; k < K; k++) acc += (double)bf(w[k]) * x[k];
    }
    return acc;
}

#ifdef SQ_EXACT /* reference build: fp32 activations, no A8 (tests measure the A8 error against it) */
static void rows_exact(const sq_linear *L, const float *x, float *y, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; n++) y[n] = (float)exact_row_dot(L, n, x);
}
#endif

/* Products are split in two so that a whole decode step runs in one parallel region:
 * prep() runs on one thread (inside an `omp single`), products() is entered by every thread of
 * the region and ends in a barrier. */
static void prep(const sq_linear *L, const float *x, sq_act *a) {
    if (L->kind != KIND_BF16) quantize_act(x, L, a);
    a->x = x;
    a->epoch = (a->epoch + 1) & 0xffffffffu;
}

/* rows [r0, r1) of y = L x (+ bias) */
static void rows(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
#ifdef SQ_EXACT
    if (L->kind != KIND_BF16) rows_exact(L, a->x, y, r0, r1);
    else
#endif
    if (L->kind == KIND_INT4) {
#ifdef SQ_AVX512
        if (a->paired == 2) rows_int4_avx512(L, a, y, r0, r1);
        else
#endif
#ifdef SQ_AVX2
        if (a->paired) rows_int4_avx2(L, a, y, r0, r1);
        else
#endif
        rows_int4_c(L, a, y, r0, r1);
    } else if (L->kind == KIND_INT8) {
#ifdef SQ_AVX2
#ifdef SQ_AVX512
        rows_int8_avx512(L, a, y, r0, r1);
#else
        rows_int8_avx2(L, a, y, r0, r1);
#endif
#else
        rows_int8_c(L, a, y, r0, r1);
#endif
    } else {
        rows_bf16(L, a->x, y, r0, r1);
    }
    if (L->bias)
        for (int64_t n = r0; n < r1; n++) y[n] += bf(L->bias[n]);
}

/* Work stealing. The blocks of a product are split into one contiguous range per thread, as a
 * static schedule would; a thread takes blocks from the front of its own range and, when that
 * is empty, from the back of the other threads' ranges. On a quiet machine each thread streams
 * its own contiguous rows (what the hardware prefetcher wants; a dynamic schedule that deals
 * blocks out in turn was measured ~8% slower); on a shared one a thread that loses its core
 * for a while no longer holds up the whole step at the next barrier with its untouched half.
 * A slot packs (epoch:32 | lo:16 | hi:16) in one word changed by compare-and-swap; a slot whose
 * epoch is not the current product's is read as its initial range, so no barrier is needed to
 * reset the slots (every owner rewrites its own slot once per product, so a stale epoch is one
 * product old; only a slot above a later-lowered thread count could wait 2^32 products). */
static int claim(sq_slot *s, uint64_t ep, uint64_t lo0, uint64_t hi0, int back, int64_t *blk, int64_t *cnt) {
    uint64_t cur = __atomic_load_n(&s->v, __ATOMIC_ACQUIRE);
    for (;;) {
        const int fresh = (cur >> 32) == ep;
        const uint64_t lo = fresh ? (cur >> 16) & 0xffff : lo0, hi = fresh ? cur & 0xffff : hi0;
        if (lo >= hi) {
            if (!fresh) __atomic_compare_exchange_n(&s->v, &cur, ep << 32 | lo << 16 | hi, 0, __ATOMIC_ACQ_REL,
                                                    __ATOMIC_ACQUIRE);
            return 0;
        }
        /* the owner takes up to 4 blocks while a quarter of its range is left (fewer compare-and-
         * swaps: each one is a full barrier, ~2% of a decode step at one per block) */
        uint64_t q = back ? 1 : (hi - lo) / 4;
        q = q < 1 ? 1 : q > 8 ? 8 : q;
        const uint64_t nlo = back ? lo : lo + q, nhi = back ? hi - 1 : hi;
        if (__atomic_compare_exchange_n(&s->v, &cur, ep << 32 | nlo << 16 | nhi, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *blk = back ? (int64_t)hi - 1 : (int64_t)lo;
            *cnt = (int64_t)q;
            return 1;
        }
    }
}

static int g_static_sched = 0; /* sq_set_static_schedule(1): the plain static schedule (comparisons) */

static void products(const sq_linear *L, const sq_act *a, float *y) {
    const int64_t N = L->n, chunks = (N + 15) / 16;
#ifdef _OPENMP
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int nt = 1, t = 0;
#endif
    if (nt == 1 || nt > SQ_MAXT || g_static_sched) {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) rows(L, a, y, c * 16, c * 16 + 16 < N ? c * 16 + 16 : N);
        return;
    }
    /* blocks of >= 16 KiB of weights (one compare-and-swap per ~1 us of streaming) */
    const int64_t rowbytes = L->kind == KIND_INT4 ? L->k / 2 : L->kind == KIND_INT8 ? L->k : 2 * L->k;
    int64_t per = (16384 + 16 * rowbytes - 1) / (16 * rowbytes);
    if (per < 1) per = 1;
    if ((chunks + per - 1) / per > 0xffff) per = (chunks + 0xfffe) / 0xffff; /* 16-bit block indices */
    const int64_t nb = (chunks + per - 1) / per, rpb = 16 * per;
    const uint64_t ep = a->epoch;
    int64_t b, q;
    for (int i = 0; i < nt; i++) {
        const int v = (t + i) % nt;
        while (claim(&a->slot[v], ep, (uint64_t)(nb * v / nt), (uint64_t)(nb * (v + 1) / nt), i > 0, &b, &q))
            rows(L, a, y, b * rpb, (b + q) * rpb < N ? (b + q) * rpb : N);
    }
#pragma omp barrier
}

/* y = L x (+ bias), from outside a parallel region */
static void linear(const sq_linear *L, const float *x, sq_act *a, float *y) {
    prep(L, x, a);
#pragma omp parallel
    products(L, a, y);
}

/* ---- many tokens (prefill): Y[M, N] = X[M, K] W^T ------------------------------------------
 * Int4 (paired activations): a GEMM in register tiles of one weight row x TT tokens. The rows
 * of a block of NCB_BYTES of weights stay in L2 while every token tile passes over them, and
 * the columns go in chunks of KC_BYTES so that a tile's int8 activations stay in L1. Per 64
 * columns and token: two maddubs, an add, a madd, a convert and an FMA with the activation
 * block scales into a per-group accumulator, which one FMA per group scales by the weight
 * scale; the zero and -8 terms are added after the tiles, 8 rows at a time, from per-group
 * sums. Measured on the AVX2 box at 512 tokens (`python -m sparkq.cli.gemmbench`): 1.25x the
 * dequantize + fp32 GEMM path at K=384, 1.27-1.28x at K=576, 1.29-1.46x at K >= 1536, 0.96x
 * at K=256 (the runtime uses it from K = 384); 1 x 4 tiles with group accumulators beat 2 x 3
 * tiles with a scale multiply per step by ~10% at g128.
 * Int8 (and the portable build): each weight row is read once and multiplied with the
 * activations of TB tokens at a time. */

#define TB 4
#ifndef TT /* overridable for tuning builds */
#define TT 4
#define NCB_BYTES (128 * 1024)
#define KC_BYTES 4096
#endif
#if TT > 4
#error "int4_tile reduces at most 4 tokens per vector"
#endif

#ifdef SQ_AVX2
/* Y[t * ldy + col] = row n of L times the activations of token t, for tokens t0..t0+T over
 * the weight groups [g0, g1) (stored, or added to what an earlier column chunk stored);
 * s = fp32 weight scales of row n [groups]; PPG = 64-column steps per group (compile-time:
 * g = 64, 128, 256) */
static inline __attribute__((always_inline)) void int4_tile(const sq_linear *L, const sq_act *a, const float *s,
                                                            float *Y, int64_t ldy, int64_t col, int64_t n, int64_t t0,
                                                            int64_t g0, int64_t g1, int add, const int T, const int PPG) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t *xq[TT];
    const float *xs8[TT];
    for (int t = 0; t < T; t++) xq[t] = a[t0 + t].q, xs8[t] = a[t0 + t].s8;
    const uint8_t *w = L->q + n * (L->k / 2);
    __m256 acc[TT];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t gi = g0; gi < g1; gi++) {
        __m256 gacc[TT];
        for (int t = 0; t < T; t++) gacc[t] = _mm256_setzero_ps();
        for (int pp = 0; pp < PPG; pp++) {
            const int64_t p = gi * PPG + pp;
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * p));
            const __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
            for (int t = 0; t < T; t++) {
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(xq[t] + 64 * p));
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(xq[t] + 64 * p + 32));
                const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                gacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)),
                                          _mm256_loadu_ps(xs8[t] + 8 * p), gacc[t]);
            }
        }
        const __m256 sv = _mm256_broadcast_ss(s + gi);
        for (int t = 0; t < T; t++) acc[t] = _mm256_fmadd_ps(gacc[t], sv, acc[t]);
    }
    /* up to four sums in one vector (three hadds instead of four hsum8), in the same order for
     * every T: a token's result does not depend on the tile it falls in, so a prompt gives the
     * same bits whole or in chunks (docs/correctness.md: hsum8 for the tail tokens moved int8
     * codes and diverged chunked prompts by 0.4-0.9% on AVX2) */
    const __m256 z = _mm256_setzero_ps();
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], T > 1 ? acc[1] : z),
                                    _mm256_hadd_ps(T > 2 ? acc[2] : z, T > 3 ? acc[3] : z));
    float r[4];
    _mm_storeu_ps(r, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int t = 0; t < T; t++) {
        float *o = Y + (t0 + t) * ldy + col;
        *o = add ? *o + r[t] : r[t];
    }
}

/* Y[t * ldy + n - n0]: tiles for rows [n0, n1) and all M tokens */
static inline __attribute__((always_inline)) void int4_tiles(const sq_linear *L, const sq_act *a, int64_t M,
                                                             const float *sw, float *Y, int64_t ldy, int64_t n0,
                                                             int64_t n1, int64_t g0, int64_t g1, int add, const int PPG) {
    const int64_t ng = L->k / L->g;
    int64_t t = 0;
    for (; t + TT <= M; t += TT)
        for (int64_t n = n0; n < n1; n++) int4_tile(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, g0, g1, add, TT, PPG);
    for (; t < M; t++)
        for (int64_t n = n0; n < n1; n++) int4_tile(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, g0, g1, add, 1, PPG);
}

#ifdef SQ_AVX512
/* AVX512-VNNI (quad activations): register tiles of R weight rows x T tokens. Per 128 columns
 * each row's 64 weight bytes are unpacked once (and, shift, and) for all T tokens and each
 * token's activations are loaded once for all R rows; per (row, token) two vpdpbusd, a
 * convert, a multiply by the activation scales and an FMA by the row's weight scales. */
#ifndef PR /* overridable for tuning builds */
#define PR 2
#define PT 6
#endif
static inline __attribute__((always_inline)) void int4_tile512(const sq_linear *L, const sq_act *a, const float *sw,
                                                               float *Y, int64_t ldy, int64_t col, int64_t n, int64_t t0,
                                                               int64_t q0, int64_t q1, int tail, int add, const int R,
                                                               const int T) {
    const int64_t K = L->k, rb = K / 2, ng = K / L->g;
    const int gsh = group_shift(L->g);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const int8_t *xq[PT];
    const float *xs8[PT];
    for (int t = 0; t < T; t++) xq[t] = a[t0 + t].q, xs8[t] = a[t0 + t].s8;
    __m512 acc[PR][PT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = q0; p < q1; p++) {
        __m512i lo[PR], hi[PR];
        __m512 sv[PR];
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(L->q + (n + r) * rb + 64 * p));
            lo[r] = _mm512_and_si512(wv, m4);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
            sv[r] = step_scales(sw + r * ng, gsh, p, 1);
        }
        for (int t = 0; t < T; t++) {
            const __m512i xl = _mm512_loadu_si512((const void *)(xq[t] + 128 * p));
            const __m512i xh = _mm512_loadu_si512((const void *)(xq[t] + 128 * p + 64));
            const __m512 s8 = _mm512_loadu_ps(xs8[t] + 16 * p);
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xl);
                d = _mm512_dpbusd_epi32(d, hi[r], xh);
                acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), s8), sv[r], acc[r][t]);
            }
        }
    }
    float tl[PR][PT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) tl[r][t] = 0.f;
    if (tail) /* K % 128 == 64: the last 64 columns, one group (g = 64) */
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                tl[r][t] = half_step(L->q + (n + r) * rb, xq[t], xs8[t], q1) * sw[r * ng + ng - 1];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            float *o = Y + (t0 + t) * ldy + col + r;
            const float v = _mm512_reduce_add_ps(acc[r][t]) + tl[r][t];
            *o = add ? *o + v : v;
        }
}

/* Y[t * ldy + n - n0]: tiles for rows [n0, n1) and all M tokens over quad steps [q0, q1) */
static void int4_tiles512(const sq_linear *L, const sq_act *a, int64_t M, const float *sw, float *Y, int64_t ldy,
                          int64_t n0, int64_t n1, int64_t q0, int64_t q1, int tail, int add) {
    const int64_t ng = L->k / L->g;
    int64_t t = 0;
    for (; t + PT <= M; t += PT) {
        int64_t n = n0;
        for (; n + PR <= n1; n += PR) int4_tile512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, PR, PT);
        for (; n < n1; n++) int4_tile512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, 1, PT);
    }
    for (; t < M; t++) {
        int64_t n = n0;
        for (; n + PR <= n1; n += PR) int4_tile512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, PR, 1);
        for (; n < n1; n++) int4_tile512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, 1, 1);
    }
}
#endif

/* 8 fp32 -> 8 bf16, round to nearest even (NaN stays NaN), as to_bf */
static inline __m128i to_bf8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* rows [n0, n1) of the output for all M tokens: fp32 into Y [M, N], or, with ybf, bf16 into
 * ybf [M, N] through yblk [M, n1 - n0] (fp32 scratch); buf: (n1 - n0) * 3 * groups floats.
 * Columns go in chunks of KC_BYTES of int8 activations per token. The zero and -8 terms are
 * added after the tiles, 8 rows at a time (per token: 2 FMAs per group for 8 outputs). */
static void int4_gemm_block(const sq_linear *L, const sq_act *a, int64_t M, float *Y, uint16_t *ybf, int64_t n0,
                            int64_t n1, float *buf, float *yblk) {
    const int64_t N = L->n, ng = L->k / L->g, ppg = L->g / 64, nb = n1 - n0;
    float *sw = buf, *zt = buf + nb * ng; /* zt: [2 ng][nb], z[g] rows then -8 s[g] rows */
    float *Yw = ybf ? yblk : Y + n0; /* row t of the block's output at Yw + t * ldy */
    const int64_t ldy = ybf ? nb : N;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t g = 0; g < ng; g++) {
            const float s = bf(L->sz[2 * (g * N + n)]), z = bf(L->sz[2 * (g * N + n) + 1]);
            sw[(n - n0) * ng + g] = s;
            zt[g * nb + n - n0] = z;
            zt[(ng + g) * nb + n - n0] = -8.f * s;
        }
#ifdef SQ_AVX512
    if (a[0].paired == 2) {
        const int64_t nq = L->k / 128, qc = KC_BYTES / 128; /* quad steps, per column chunk */
        for (int64_t q0 = 0; q0 < nq || (q0 == 0 && L->k % 128); q0 += qc) {
            const int64_t q1 = q0 + qc < nq ? q0 + qc : nq;
            int4_tiles512(L, a, M, sw, Yw, ldy, n0, n1, q0, q1, q1 == nq && L->k % 128, q0 > 0);
        }
    } else
#endif
    {
    const int64_t gc = KC_BYTES / L->g > 0 ? KC_BYTES / L->g : 1; /* groups per column chunk */
    for (int64_t g0 = 0; g0 < ng; g0 += gc) {
        const int64_t g1 = g0 + gc < ng ? g0 + gc : ng;
        if (ppg == 1) int4_tiles(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 1);
        else if (ppg == 2) int4_tiles(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 2);
        else int4_tiles(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 4);
    }
    }
    for (int64_t t = 0; t < M; t++) {
        const float *gs = a[t].gsum, *gq = a[t].gqsum;
        float *y = Yw + t * ldy;
        int64_t j = 0;
        for (; j + 8 <= nb; j += 8) {
            __m256 v = _mm256_loadu_ps(y + j);
            for (int64_t g = 0; g < ng; g++) {
                v = _mm256_fmadd_ps(_mm256_loadu_ps(zt + g * nb + j), _mm256_broadcast_ss(gs + g), v);
                v = _mm256_fmadd_ps(_mm256_loadu_ps(zt + (ng + g) * nb + j), _mm256_broadcast_ss(gq + g), v);
            }
            if (ybf) _mm_storeu_si128((__m128i *)(ybf + t * N + n0 + j), to_bf8(v));
            else _mm256_storeu_ps(y + j, v);
        }
        for (; j < nb; j++) {
            float acc = y[j];
            for (int64_t g = 0; g < ng; g++) acc += zt[g * nb + j] * gs[g] + zt[(ng + g) * nb + j] * gq[g];
            if (ybf) ybf[t * N + n0 + j] = to_bf(acc);
            else y[j] = acc;
        }
    }
}

static inline __attribute__((always_inline)) void int8_row_tokens(const sq_linear *L, const sq_act *a, float *Y,
                                                                  int64_t n, int64_t t0, const int T) {
    const int64_t K = L->k, N = L->n;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *w = (const int8_t *)L->q + n * K;
    __m256 acc[TB];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * b));
        __m256i aw = _mm256_sign_epi8(wv, wv);
        for (int t = 0; t < T; t++) {
            const sq_act *x = a + t0 + t;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
            __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_broadcast_ps((const __m128 *)(x->s8 + 4 * b)), acc[t]);
        }
    }
    const float sc = bf(L->sz[n]);
    for (int t = 0; t < T; t++) Y[(t0 + t) * N + n] = hsum8(acc[t]) * sc;
}
#endif

#ifdef SQ_BF16
/* ---- prefill GEMM on CPUs with AVX512-BF16: W4A16 -------------------------------------------
 * Many tokens at once amortize a dequantization: each block of NBR weight rows is dequantized
 * (w = q * s + (z - 8 s) in fp32, as sq_dequant_rows, rounded to bf16) into a per-thread scratch
 * of K/2 x NBR dwords -- dword (c, r) holds the bf16 pair (w[r][2c], w[r][2c+1]), 16 rows per
 * cache line -- and every tile of BT tokens multiplies it with vdpbf16ps: per column pair, RV
 * weight loads and, per token, a dword broadcast of its two bf16 activations and RV vdpbf16ps
 * (fp32 accumulators, one lane per row, RV x BT in registers). The activations are rounded
 * to bf16 (vcvtne2ps2bf16: nearest even) once per call into tiles of [K/32][BT][16] pairs. No
 * int8 activations: the prefill then carries no A8 error (its products differ from the decode
 * step's W4A8 ones within that budget). The scratch is transient, per call, per thread
 * (K * 2 * NBR bytes); nothing is kept. Measured on the AVX512-BF16 box (Zen 5, 2 threads,
 * `python -m sparkq.cli.gemmbench`): README "AVX512 CPUs". */
#ifndef BT
#define BT 8  /* tokens per tile */
#endif
#ifndef RV
#define RV 2  /* 16-row vectors per weight block: RV x BT accumulators */
#endif
#define NBR (16 * RV) /* rows per weight block */
#define BF16_GEMM_MIN_M 32 /* fewer tokens: the W4A8 GEMM (no dequantization to amortize) */
static int g_no_bf16 = 0;  /* sq_set_prefill_bf16(0): the W4A8 GEMM for every M (tests, comparisons) */

/* bf16 pairs (a in the low half, b in the high half of each lane), RNE by vcvtne2ps2bf16 */
static inline __m512i bf16_pairs(__m512 a, __m512 b) {
    static const uint16_t ilv16[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i ilv = _mm512_loadu_si512((const void *)ilv16);
    return _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(b, a)); /* [a0..a15 | b0..b15] -> a0 b0 a1 b1 .. */
}

/* rows [n0, n0 + NBR) of L (rows >= N as zeros) -> wp [K/2][NBR] bf16 pairs */
static void dequant_pairs(const sq_linear *L, int64_t n0, uint32_t *wp) {
    const int64_t K = L->k, N = L->n, G = L->g, rb = K / 2;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i pick[4]; /* byte i of each dword -> the dword's low byte, other bytes 0 (vpshufb works
                      * within 16-byte lanes: indices are lane-relative) */
    for (int i = 0; i < 4; i++) {
        char c[64];
        for (int j = 0; j < 64; j++) c[j] = j % 4 == 0 ? (char)(j % 16 + i) : (char)0x80;
        pick[i] = _mm512_loadu_si512((const void *)c);
    }
    const __m512i rowoff = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)rb));
    for (int h = 0; h < RV; h++) {
        const int64_t r0 = n0 + 16 * h;
        const __mmask16 valid = rows_mask(N - r0);
        if (!valid) {
            for (int64_t c = 0; c < K / 2; c++) _mm512_storeu_si512((void *)(wp + c * NBR + 16 * h), _mm512_setzero_si512());
            continue;
        }
        const uint8_t *base = L->q + r0 * rb;
        for (int64_t gi = 0; gi < K / G; gi++) {
            /* (scale, zero) of 16 rows: one dword each, scale in the low half */
            const __m512i p = _mm512_maskz_loadu_epi32(valid, (const void *)(L->sz + 2 * (gi * N + r0)));
            const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
            const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000)));
            const __m512 cv = _mm512_sub_ps(zv, _mm512_mul_ps(_mm512_set1_ps(8.f), sv));
            for (int64_t b = gi * (G / 32); b < (gi + 1) * (G / 32); b++) {
                __m512i ub[4]; /* dword j / 4 of block b of each of the 16 rows, lane = row */
                if (valid == 0xffff) {
                    /* a 16 x 4 dword transpose of plain loads (a gather is microcoded: 4 of them
                     * cost more than the 16 loads and 8 shuffles): zm holds rows m, 4 + m, 8 + m,
                     * 12 + m in its 128-bit lanes, so the unpacks leave row r in lane r */
                    __m512i z[4];
                    for (int mm = 0; mm < 4; mm++) {
                        const uint8_t *rp = base + mm * rb + 16 * b;
                        z[mm] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)rp));
                        z[mm] = _mm512_inserti32x4(z[mm], _mm_loadu_si128((const __m128i *)(rp + 4 * rb)), 1);
                        z[mm] = _mm512_inserti32x4(z[mm], _mm_loadu_si128((const __m128i *)(rp + 8 * rb)), 2);
                        z[mm] = _mm512_inserti32x4(z[mm], _mm_loadu_si128((const __m128i *)(rp + 12 * rb)), 3);
                    }
                    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
                    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
                    ub[0] = _mm512_unpacklo_epi64(t0, t2);
                    ub[1] = _mm512_unpackhi_epi64(t0, t2);
                    ub[2] = _mm512_unpacklo_epi64(t1, t3);
                    ub[3] = _mm512_unpackhi_epi64(t1, t3);
                } else {
                    for (int j = 0; j < 4; j++)
                        ub[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid,
                                                            _mm512_add_epi32(rowoff, _mm512_set1_epi32((int)(16 * b + 4 * j))),
                                                            (const void *)base, 1);
                }
                for (int j = 0; j < 16; j += 4) {
                    /* bytes 16b + j .. + 3 of each row: columns 32b + j + i (low nibbles) and
                     * 32b + 16 + j + i (high nibbles), i < 4 */
                    const __m512i u = ub[j / 4];
                    const __m512i lo = _mm512_and_si512(u, m4), hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), m4);
                    __m512 f[8];
                    for (int i = 0; i < 4; i++) {
                        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(lo, pick[i])), sv, cv);
                        f[4 + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(hi, pick[i])), sv, cv);
                    }
                    uint32_t *d0 = wp + (16 * b + j / 2) * NBR + 16 * h, *d1 = wp + (16 * b + 8 + j / 2) * NBR + 16 * h;
                    _mm512_storeu_si512((void *)d0, bf16_pairs(f[0], f[1]));
                    _mm512_storeu_si512((void *)(d0 + NBR), bf16_pairs(f[2], f[3]));
                    _mm512_storeu_si512((void *)d1, bf16_pairs(f[4], f[5]));
                    _mm512_storeu_si512((void *)(d1 + NBR), bf16_pairs(f[6], f[7]));
                }
            }
        }
    }
}

/* NBR rows (wp) x BT tokens (xt: the tile's pairs, [K/32][BT][16]: 16 column pairs of one
 * token in one cache line) -> Y / ybf rows t0.. (first nt valid), columns n0.. (m[h]: the valid
 * rows of vector h) */
static void bf16_tile(const uint32_t *wp, const uint32_t *xt, int64_t K, int64_t N, int64_t t0, int64_t nt, int64_t n0,
                      const __mmask16 *m, float *Y, uint16_t *ybf) {
    __m512 acc[RV][BT];
    for (int h = 0; h < RV; h++)
        for (int t = 0; t < BT; t++) acc[h][t] = _mm512_setzero_ps();
    for (int64_t cb = 0; cb < K / 32; cb++) {
        const uint32_t *xb = xt + cb * BT * 16, *wb = wp + cb * 16 * NBR;
        for (int ci = 0; ci < 16; ci++) {
            __m512bh w[RV];
            for (int h = 0; h < RV; h++) w[h] = (__m512bh)_mm512_loadu_si512((const void *)(wb + ci * NBR + 16 * h));
            for (int t = 0; t < BT; t++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[t * 16 + ci]);
                for (int h = 0; h < RV; h++) acc[h][t] = _mm512_dpbf16_ps(acc[h][t], w[h], xv);
            }
        }
    }
    for (int64_t t = 0; t < nt; t++)
        for (int h = 0; h < RV; h++) {
            if (!m[h]) continue;
            const int64_t o = (t0 + t) * N + n0 + 16 * h;
            if (ybf) {
                const __m256i v = _mm256_setr_m128i(to_bf8(_mm512_castps512_ps256(acc[h][t])), to_bf8(_mm512_extractf32x8_ps(acc[h][t], 1)));
                _mm256_mask_storeu_epi16((void *)(ybf + o), m[h], v);
            } else {
                _mm512_mask_storeu_ps(Y + o, m[h], acc[h][t]);
            }
        }
}

/* xtbuf: room for the activation tiles ((M rounded up to BT) x K bf16), or NULL to allocate them
 * here (sq_prefill passes one buffer for all its products: a fresh multi-MiB allocation per
 * product is mmapped and page-faulted anew, 6% of a 1.7B prefill in `perf`). Returns 0, or -1
 * when out of memory. */
static int bf16_gemm(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf,
                     uint32_t *xtbuf) {
    const int64_t K = L->k, N = L->n, ntiles = (M + BT - 1) / BT, nblk = (N + NBR - 1) / NBR;
    uint32_t *xt = xtbuf ? xtbuf : malloc(sizeof(uint32_t) * ntiles * BT * (K / 2));
    if (!xt) return -1;
    int oom = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < ntiles; tile++) {
            uint32_t *d = xt + tile * BT * (K / 2);
            for (int t = 0; t < BT; t++) {
                const int64_t row = tile * BT + t;
                for (int64_t cb = 0; cb < K / 32; cb++) {
                    __m512i v = _mm512_setzero_si512(); /* 32 columns = 16 pairs (bf16 in memory order) */
                    if (row < M && x_bf16) {
                        v = _mm512_loadu_si512((const void *)((const uint16_t *)X + row * K + 32 * cb));
                    } else if (row < M) {
                        const float *xf = (const float *)X + row * K + 32 * cb;
                        v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + 16), _mm512_loadu_ps(xf));
                    }
                    _mm512_storeu_si512((void *)(d + cb * BT * 16 + t * 16), v);
                }
            }
        }
        uint32_t *wp = aligned_alloc(64, sizeof(uint32_t) * NBR * (K / 2));
        if (!wp) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t blk = 0; blk < nblk; blk++) {
            if (!wp) continue;
            const int64_t n0 = NBR * blk;
            __mmask16 m[RV];
            for (int h = 0; h < RV; h++) m[h] = rows_mask(N - n0 - 16 * h);
            dequant_pairs(L, n0, wp);
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t t0 = tile * BT, nt = M - t0 < BT ? M - t0 : BT;
                bf16_tile(wp, xt + tile * BT * (K / 2), K, N, t0, nt, n0, m, ybf ? NULL : Y, ybf);
            }
        }
        free(wp);
    }
    if (!xtbuf) free(xt);
    return oom ? -1 : 0;
}
#endif

/* Y [M, N] = X [M, K] times L (no bias). X is fp32, or bf16 when x_bf16 (converted row by row
 * as it is quantized). The result goes to Y (fp32) or, when ybf is not NULL, to ybf as bf16
 * (round to nearest even, as torch); Y may then be NULL: the int4 GEMM converts each row
 * block from a per-thread scratch, the other paths from an [M, N] fp32 buffer they allocate
 * (a given Y is used as that buffer). Returns 0, or -1 when out of memory. */
static int linear_batch(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf,
                        void *xtbuf) {
    const int64_t K = L->k, N = L->n;
    if (L->kind == KIND_BF16 || (!Y && !ybf)) return -2;
#ifdef SQ_BF16
    if (L->kind == KIND_INT4 && M >= BF16_GEMM_MIN_M && !g_no_bf16) return bf16_gemm(L, X, x_bf16, M, Y, ybf, xtbuf);
#else
    (void)xtbuf;
#endif
    sq_act *a = calloc(M, sizeof(sq_act));
    const int64_t Kp = (K + 127) / 128 * 128; /* quad order pads the codes to 128 columns */
    /* per token: gsum, gqsum, s8, each starting on a cache line */
    const int64_t g16 = (K / 32 + 1 + 15) / 16 * 16, fs = 2 * g16 + ((K / 32 + 2) * 4 + 15) / 16 * 16;
    int8_t *qbuf = alloc64(M * Kp);
    float *fbuf = alloc64(sizeof(float) * M * fs);
    if (!a || !qbuf || !fbuf) { free(a); free(qbuf); free(fbuf); return -1; }
    int oom = 0;
#pragma omp parallel
    {
        float *row = x_bf16 ? malloc(sizeof(float) * K) : NULL;
        if (x_bf16 && !row) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M; t++) {
            float *f = fbuf + t * fs;
            a[t].q = qbuf + t * Kp;
            a[t].gsum = f;
            a[t].gqsum = f + g16;
            a[t].s8 = f + 2 * g16;
            const float *x = (const float *)X + t * K;
            if (x_bf16) {
                if (!row) continue;
                const uint16_t *xb = (const uint16_t *)X + t * K;
                for (int64_t k = 0; k < K; k++) row[k] = bf(xb[k]);
                x = row;
            }
            quantize_act(x, L, &a[t]);
        }
        free(row);
    }
    if (oom) { free(a); free(qbuf); free(fbuf); return -1; }
    int fused = 0; /* the int4 GEMM writes ybf itself */
#ifdef SQ_AVX2
    if (L->kind == KIND_INT4 && a[0].paired) {
        /* blocks of at most NCB_BYTES of weights (16-row multiples), as many as a multiple of
         * the thread count so that every thread gets the same number of rows */
        int64_t nc = NCB_BYTES / (K / 2), nthr = 1;
#ifdef _OPENMP
        nthr = omp_get_max_threads();
#endif
        nc = nc < 16 ? 16 : nc - nc % 16;
        int64_t nblocks = (N + nc - 1) / nc;
        nblocks = (nblocks + nthr - 1) / nthr * nthr;
        nc = ((N + nblocks - 1) / nblocks + 15) / 16 * 16;
        nblocks = (N + nc - 1) / nc;
#pragma omp parallel
        {
            float *buf = malloc(sizeof(float) * nc * 3 * (K / L->g));
            float *yblk = ybf ? malloc(sizeof(float) * M * nc) : NULL;
            if (!buf || (ybf && !yblk)) {
#pragma omp atomic write
                oom = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < nblocks; b++)
                if (buf && (yblk || !ybf))
                    int4_gemm_block(L, a, M, Y, ybf, b * nc, (b + 1) * nc < N ? (b + 1) * nc : N, buf, yblk);
            free(buf);
            free(yblk);
        }
        fused = 1;
    }
#endif
    float *own = NULL; /* the fp32 result buffer of the other paths when only ybf was given */
    if (!fused && !Y && !(Y = own = malloc(sizeof(float) * M * N))) oom = 1;
    if (!fused && Y) {
#ifdef SQ_AVX2
        if (L->kind == KIND_INT8) {
#pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                int64_t t = 0;
                for (; t + TB <= M; t += TB) int8_row_tokens(L, a, Y, n, t, TB);
                for (; t < M; t++) int8_row_tokens(L, a, Y, n, t, 1);
            }
        } else
#endif
        {
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < M; t++) {
#ifndef SQ_AVX2
                if (L->kind == KIND_INT8) rows_int8_c(L, &a[t], Y + t * N, 0, N);
                else
#endif
                rows_int4_c(L, &a[t], Y + t * N, 0, N);
            }
        }
        if (ybf) {
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < M * N; i++) ybf[i] = to_bf(Y[i]);
        }
    }
    free(own); free(a); free(qbuf); free(fbuf);
    return oom ? -1 : 0;
}

int sq_linear_batch(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf) {
    return linear_batch(L, X, x_bf16, M, Y, ybf, NULL);
}

/* W rows [r0, r1) of an int4 rows32 linear, dequantized to fp32 [r1 - r0, K] (prefill: the
 * caller multiplies with a dense GEMM). */
int sq_dequant_rows(const sq_linear *L, int64_t r0, int64_t r1, float *out) {
    const int64_t K = L->k, N = L->n, G = L->g;
    if (L->kind != KIND_INT4 || r0 < 0 || r1 > N || r0 > r1) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *w = L->q + n * (K / 2);
        float *o = out + (n - r0) * K;
        for (int64_t gi = 0; gi < K / G; gi++) {
            const uint16_t *p = L->sz + 2 * (gi * N + n);
            const float s = bf(p[0]), c = bf(p[1]) - 8.f * s;
            for (int64_t b = gi * (G / 32); b < (gi + 1) * (G / 32); b++) {
                const uint8_t *wb = w + 16 * b;
                float *ob = o + 32 * b;
#ifdef SQ_AVX2
                const __m256 sv = _mm256_set1_ps(s), cv = _mm256_set1_ps(c);
                __m128i raw = _mm_loadu_si128((const __m128i *)wb);
                __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
                _mm256_storeu_ps(ob, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sv, cv));
                _mm256_storeu_ps(ob + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sv, cv));
                _mm256_storeu_ps(ob + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sv, cv));
                _mm256_storeu_ps(ob + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sv, cv));
#else
                for (int j = 0; j < 16; j++) {
                    ob[j] = (wb[j] & 15) * s + c;
                    ob[j + 16] = (wb[j] >> 4) * s + c;
                }
#endif
            }
        }
    }
    return 0;
}

/* ---- the pointwise parts --------------------------------------------------------------- */

static void rms_norm(const float *x, const uint16_t *w, int64_t d, double eps, int offset, float *out) {
    double ss = 0.0;
    int64_t i0 = 0;
#ifdef SQ_AVX512
    { /* the sum of squares in fp64 on 8 lanes x 2 chains (a serial fp64 sum waits on each add) */
        __m512d a = _mm512_setzero_pd(), b = a;
        for (; i0 + 16 <= d; i0 += 16) {
            const __m512d u = _mm512_cvtps_pd(_mm256_loadu_ps(x + i0)), v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i0 + 8));
            a = _mm512_fmadd_pd(u, u, a);
            b = _mm512_fmadd_pd(v, v, b);
        }
        ss = _mm512_reduce_add_pd(_mm512_add_pd(a, b));
    }
#endif
    for (int64_t i = i0; i < d; i++) ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / d + eps));
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * r * (offset ? 1.f + bf(w[i]) : bf(w[i]));
}

static void rope(float *v, const uint16_t *cos, const uint16_t *sin, int64_t rot) {
    int64_t h = rot / 2, i = 0;
#ifdef SQ_AVX512
    for (; i + 16 <= h; i += 16) {
        const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + i + h);
        _mm512_storeu_ps(v + i, _mm512_sub_ps(_mm512_mul_ps(a, load_bf16x16(cos + i)), _mm512_mul_ps(b, load_bf16x16(sin + i))));
        _mm512_storeu_ps(v + i + h, _mm512_add_ps(_mm512_mul_ps(b, load_bf16x16(cos + i + h)), _mm512_mul_ps(a, load_bf16x16(sin + i + h))));
    }
#endif
    for (; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * bf(cos[i]) - b * bf(sin[i]);
        v[i + h] = b * bf(cos[i + h]) + a * bf(sin[i + h]);
    }
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* ---- workspace ---------------------------------------------------------------------- */

typedef struct {
    float *xn, *qkv, *att, *h, *gu, *mid, *scores, *logits_tmp;
    sq_act a;
    int64_t maxk;
    int32_t *cand, *tie; /* refine_split: the candidate rows, and a bucket's members while selecting */
    float *gsum;         /* refine_split: per-group sums of the activations */
    int64_t ncand;
} sq_work;

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

void *sq_work_new(const sq_model *m) {
    sq_work *w = calloc(1, sizeof(sq_work));
    if (!w) return NULL;
    int64_t qd = m->heads * m->head_dim, kvd = m->kv_heads * m->head_dim;
    int64_t maxk = max3(m->hidden, m->inter, qd);
    w->maxk = maxk;
    w->xn = malloc(sizeof(float) * maxk);
    w->qkv = malloc(sizeof(float) * (qd + 2 * kvd));
    w->att = malloc(sizeof(float) * qd);
    w->h = malloc(sizeof(float) * m->hidden);
    w->gu = malloc(sizeof(float) * 2 * m->inter);
    w->mid = malloc(sizeof(float) * m->inter);
    w->scores = malloc(sizeof(float) * m->heads * m->cap);
    if (!sq_act_alloc(&w->a, maxk) || !w->xn || !w->qkv || !w->att || !w->h || !w->gu || !w->mid || !w->scores)
        return NULL;
    if (m->head.res) {
        w->cand = malloc(sizeof(int32_t) * (m->refine_top > 0 ? m->refine_top : 1));
        w->tie = malloc(sizeof(int32_t) * 2 * m->head.n); /* candidates, then a bucket of them */
        w->gsum = malloc(sizeof(float) * (m->head.k / m->head.g));
        if (!w->cand || !w->tie || !w->gsum) return NULL;
    }
    return w;
}

void sq_work_free(void *p) {
    sq_work *w = p;
    if (!w) return;
    free(w->xn); free(w->qkv); free(w->att); free(w->h); free(w->gu); free(w->mid); free(w->scores);
    free(w->cand); free(w->tie); free(w->gsum);
    sq_act_free(&w->a);
    free(w);
}

/* n floats -> bf16 (to_bf on 16 lanes where AVX512 is: the same rounding, the same NaN) */
static inline void to_bf_n(const float *x, uint16_t *out, int64_t n) {
    int64_t j = 0;
#ifdef SQ_AVX512
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), absm = _mm512_set1_epi32(0x7fffffff);
    for (; j + 16 <= n; j += 16) {
        const __m512i u = _mm512_loadu_si512((const void *)(x + j));
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), _mm512_set1_epi32(0x7f800000));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), 16);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)(out + j), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; j < n; j++) out[j] = to_bf(x[j]);
}

/* Head h of one token's q/k/v row (q heads, k heads, v heads, contiguous) at position pos: a
 * query (h < H) or key head normed and rotated in place; a key head's K and its V row then go
 * to the layer's bf16 cache. */
static void qk_rope_head(const sq_model *m, const sq_layer *L, float *q, int64_t pos, int64_t h) {
    const int64_t H = m->heads, KV = m->kv_heads, D = m->head_dim;
    float *hv = q + h * D; /* q heads then k heads are contiguous */
    if (L->q_norm) rms_norm(hv, h < H ? L->q_norm : L->k_norm, D, m->eps, (int)m->norm_offset, hv);
    rope(hv, L->cos + pos * L->rot, L->sin + pos * L->rot, L->rot);
    if (h >= H) {
        const int64_t g = h - H;
        to_bf_n(hv, L->kcache + (g * m->cap + pos) * D, D);
        to_bf_n(q + (H + KV + g) * D, L->vcache + (g * m->cap + pos) * D, D);
    }
}

/* every head of one token (the prefill; the decode step spreads the heads over its threads) */
static void qk_rope_cache(const sq_model *m, const sq_layer *L, float *q, int64_t pos) {
    for (int64_t h = 0; h < m->heads + m->kv_heads; h++) qk_rope_head(m, L, q, pos, h);
}

/* x += h (one token's residual stream), h normed first where the layer has a post-norm (gemma) */
static void add_residual(const sq_model *m, const uint16_t *post_norm, float *h, float *x) {
    if (post_norm) rms_norm(h, post_norm, m->hidden, m->eps, (int)m->norm_offset, h);
    for (int64_t i = 0; i < m->hidden; i++) x[i] += h[i];
}

/* ---- attention for one query token -------------------------------------------------------- */

#ifdef SQ_AVX512
/* One head over keys [start, end) with head_dim 16 NV: the (scaled) query and then the output
 * in NV registers each; scores by one horizontal sum per key, exp on 16 keys at a time */
static inline __attribute__((always_inline)) void attention_head512(const float *q, const uint16_t *K, const uint16_t *V,
                                                                    int64_t start, int64_t end, float scale, float *sc,
                                                                    float *o, const int NV) {
    const int64_t D = 16 * NV;
    __m512 qv[16], ov[16];
    for (int v = 0; v < NV; v++) qv[v] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * v), _mm512_set1_ps(scale));
    float mx = -INFINITY;
    for (int64_t t = start; t < end; t++) {
        __m512 a = _mm512_mul_ps(load_bf16x16(K + t * D), qv[0]);
        for (int v = 1; v < NV; v++) a = _mm512_fmadd_ps(load_bf16x16(K + t * D + 16 * v), qv[v], a);
        const float d = _mm512_reduce_add_ps(a);
        sc[t] = d;
        mx = d > mx ? d : mx;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = start; t < end; t += 16) {
        const __mmask16 k = rows_mask(end - t);
        const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), _mm512_set1_ps(mx))));
        _mm512_mask_storeu_ps(sc + t, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (int v = 0; v < NV; v++) ov[v] = _mm512_setzero_ps();
    for (int64_t t = start; t < end; t++) {
        const __m512 p = _mm512_set1_ps(sc[t]);
        for (int v = 0; v < NV; v++) ov[v] = _mm512_fmadd_ps(load_bf16x16(V + t * D + 16 * v), p, ov[v]);
    }
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(ov[v], _mm512_set1_ps(inv)));
}
#endif

static void attention(const sq_model *m, const sq_layer *L, sq_work *w, int64_t pos) {
    const int64_t H = m->heads, KV = m->kv_heads, D = m->head_dim, cap = m->cap, grp = H / KV;
    int64_t end = pos + 1, start = L->window > 0 && end > L->window ? end - L->window : 0;
    const float scale = (float)m->attn_scale;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++) {
        const float *q = w->qkv + h * D;
        const uint16_t *K = L->kcache + (h / grp) * cap * D, *V = L->vcache + (h / grp) * cap * D;
#ifdef SQ_AVX512
        if (D == 64 || D == 128 || D == 256) { /* registers for the query and the output */
            float *sc = w->scores + h * cap, *o = w->att + h * D;
            if (D == 64) attention_head512(q, K, V, start, end, scale, sc, o, 4);
            else if (D == 128) attention_head512(q, K, V, start, end, scale, sc, o, 8);
            else attention_head512(q, K, V, start, end, scale, sc, o, 16);
            continue;
        }
#endif
        float *sc = w->scores + h * cap, mx = -INFINITY;
        for (int64_t t = start; t < end; t++) {
            const float d = dot_bf16(K + t * D, q, D) * scale;
            sc[t] = d;
            mx = d > mx ? d : mx;
        }
        float sum = 0.f;
        for (int64_t t = start; t < end; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
        float inv = 1.f / sum, *o = w->att + h * D;
        for (int64_t j = 0; j < D; j++) o[j] = 0.f;
        for (int64_t t = start; t < end; t++) {
            const uint16_t *vr = V + t * D;
            float p = sc[t] * inv;
            int64_t j = 0;
#ifdef SQ_AVX2
            __m256 pv = _mm256_set1_ps(p);
            for (; j + 8 <= D; j += 8) {
                __m256i vi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vr + j))), 16);
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(_mm256_castsi256_ps(vi), pv, _mm256_loadu_ps(o + j)));
            }
#endif
            for (; j < D; j++) o[j] += p * bf(vr[j]);
        }
    }
}

/* ---- public entry points ------------------------------------------------------------------- */

int sq_abi(void) { return SQ_ABI; }

int sq_simd(void) { /* 3 AVX512-VNNI, 2 AVX2, 0 portable */
#if defined(SQ_AVX512)
    return 3;
#elif defined(SQ_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* 1: decode products in a static schedule; 0 (default): work stealing (see claim) */
void sq_set_static_schedule(int on) { g_static_sched = on != 0; }

/* 1 (default): int4 products of >= 32 tokens dequantize to bf16 where the CPU has AVX512-BF16;
 * 0: always the W4A8 GEMM. Returns whether this build has the bf16 GEMM. */
int sq_set_prefill_bf16(int on) {
#ifdef SQ_BF16
    g_no_bf16 = !on;
    return 1;
#else
    (void)on;
    return 0;
#endif
}

/* Whether int4 products of >= 32 tokens take the bf16 GEMM (built for this CPU and not off) */
int sq_prefill_bf16(void) {
#ifdef SQ_BF16
    return !g_no_bf16;
#else
    return 0;
#endif
}

void sq_set_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* y[N] = W x for one linear (tests and tools); x fp32 [K] */
int sq_linear_f32(const sq_linear *L, const float *x, float *y) {
    sq_act a;
    int ok = sq_act_alloc(&a, L->k);
    if (ok) linear(L, x, &a, y);
    sq_act_free(&a);
    if (!ok) return -1;
    return 0;
}

/* embedding row -> fp32 */
static void embed_row(const sq_linear *E, int64_t id, float *x) {
    const int64_t K = E->k;
    if (E->kind == KIND_INT4) {
        const uint8_t *w = E->q + id * (K / 2);
        for (int64_t b = 0; b < K / 32; b++)
            for (int j = 0; j < 16; j++) {
                int64_t k0 = 32 * b + j, k1 = k0 + 16;
                const uint16_t *p0 = E->sz + 2 * ((k0 / E->g) * E->n + id), *p1 = E->sz + 2 * ((k1 / E->g) * E->n + id);
                x[k0] = ((w[16 * b + j] & 15) - 8.f) * bf(p0[0]) + bf(p0[1]);
                x[k1] = ((w[16 * b + j] >> 4) - 8.f) * bf(p1[0]) + bf(p1[1]);
                if (E->res) { /* a split embedding: add the second plane */
                    const uint8_t r = E->res[id * (K / 2) + 16 * b + j];
                    const uint16_t *rs = E->rsc + id * (K / E->g);
                    x[k0] += ((r & 15) - 8.f) * bf(rs[k0 / E->g]);
                    x[k1] += ((r >> 4) - 8.f) * bf(rs[k1 / E->g]);
                }
                x[k0] = bf(to_bf(x[k0]));
                x[k1] = bf(to_bf(x[k1]));
            }
    } else if (E->kind == KIND_INT8) {
        const int8_t *w = (const int8_t *)E->q + id * K;
        float s = bf(E->sz[id]);
        for (int64_t k = 0; k < K; k++) x[k] = bf(to_bf(w[k] * s));
    } else {
        const uint16_t *w = (const uint16_t *)E->q + id * K;
        for (int64_t k = 0; k < K; k++) x[k] = bf(w[k]);
    }
}

/* Recompute the k largest logits exactly (fp32 activations, no A8), so that greedy picks
 * and near-ties do not depend on the activation rounding (the torch path does the same). */
static void refine_top(const sq_linear *H, const float *x, float *logits, int64_t k) {
    int64_t idx[16];
    float val[16];
    int cnt = 0;
    if (k > 16) k = 16;
    if (k <= 0) return;
    for (int64_t i = 0; i < H->n; i++) {
        float v = logits[i];
        if (cnt == k && v <= val[cnt - 1]) continue;
        int j = cnt < k ? cnt++ : (int)k - 1;
        while (j > 0 && val[j - 1] < v) { val[j] = val[j - 1]; idx[j] = idx[j - 1]; j--; }
        val[j] = v;
        idx[j] = i;
    }
    for (int c = 0; c < cnt; c++) logits[idx[c]] = (float)exact_row_dot(H, idx[c], x);
}

/* ---- a split head's refinement --------------------------------------------------------------
 * The head product read the first (int4) plane only; the k largest of those logits are
 * recomputed in fp32 from both planes (fp32 activations, no A8) -- the set torch's topk gives
 * (up to ties). Selection in ~3 passes: the max; a threshold from a histogram of every 8th
 * logit (buckets of 1/32 below the max) that leaves somewhat more than k above it; every
 * logit at or above it (lowered until there are >= k); among those, the same histogram to find
 * the k-th, and of its bucket the largest (value, then lower index). Row dots per group g:
 * with D_q = sum x q, D_r = sum x r, X = sum x over the group, the stored row gives
 *   s D_q + rs D_r + (z - 8 s - 8 rs) X. */
#define SEL_BUCKETS 4096

static __thread const float *g_sel_logits; /* qsort has no context argument in C11 */
static int cmp_desc(const void *a, const void *b) {
    const float *l = g_sel_logits;
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    return l[i] > l[j] ? -1 : l[i] < l[j] ? 1 : (i > j) - (i < j);
}

static inline int sel_bucket(float mx, float v) { /* NaN and everything 128 below the max: the last */
    const float d = (mx - v) * 32.f;
    return d < (float)(SEL_BUCKETS - 1) ? (int)d : SEL_BUCKETS - 1;
}

static float max_of(const float *v, int64_t n) {
    float mx = -INFINITY;
    int64_t i = 0;
#ifdef SQ_AVX512
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(v + i)); /* a NaN lane keeps m */
    mx = _mm512_reduce_max_ps(m);
#endif
    for (; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    return mx;
}

/* indices i with v[i] >= t, in order */
static int64_t at_or_above(const float *v, int64_t n, float t, int32_t *out) {
    int64_t c = 0, i = 0;
#ifdef SQ_AVX512
    const __m512 tv = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), tv, _CMP_GE_OQ);
        _mm512_mask_compressstoreu_epi32(out + c, k, idx);
        c += __builtin_popcount(k);
    }
#endif
    for (; i < n; i++)
        if (v[i] >= t) out[c++] = (int32_t)i;
    return c;
}

/* the k largest of v[cand[0..c)] (c >= k) into out */
static int64_t top_of(const float *v, const int32_t *cand, int64_t c, int64_t k, float mx, int32_t *out,
                      int32_t *tie) {
    uint32_t hist[SEL_BUCKETS] = {0};
    for (int64_t i = 0; i < c; i++) hist[sel_bucket(mx, v[cand[i]])]++;
    int64_t above = 0, o = 0, t = 0;
    int b = 0;
    while (above + (int64_t)hist[b] < k) above += hist[b++];
    for (int64_t i = 0; i < c; i++) {
        const int bi = sel_bucket(mx, v[cand[i]]);
        if (bi < b) out[o++] = cand[i];
        else if (bi == b) tie[t++] = cand[i];
    }
    g_sel_logits = v;
    qsort(tie, (size_t)t, sizeof(int32_t), cmp_desc);
    for (int64_t i = 0; o < k && i < t; i++) out[o++] = tie[i];
    return o;
}

/* tie: room for n indices */
static int64_t select_top(const float *v, int64_t n, int64_t k, int32_t *out, int32_t *tie) {
    if (k <= 0) return 0;
    if (k >= n) {
        for (int64_t i = 0; i < n; i++) out[i] = (int32_t)i;
        return n;
    }
    const float mx = max_of(v, n);
    if (!(mx > -INFINITY)) return 0; /* every logit NaN or -inf: nothing to refine */
    uint32_t hist[SEL_BUCKETS] = {0};
    for (int64_t i = 0; i < n; i += 8) hist[sel_bucket(mx, v[i])]++;
    const int64_t want = k / 8 + k / 32 + 8; /* sampled logits above the threshold */
    int64_t above = 0;
    int b = 0;
    while (b < SEL_BUCKETS - 1 && above + (int64_t)hist[b] < want) above += hist[b++];
    float t = b < SEL_BUCKETS - 1 ? mx - (float)(b + 1) / 32.f : -INFINITY;
    int64_t c;
    for (;;) {
        c = at_or_above(v, n, t, tie);
        if (c >= k || t == -INFINITY) break;
        const float d = 2.f * (mx - t);
        t = d > 128.f ? -INFINITY : mx - d;
    }
    if (c <= k) { /* NaN logits are never candidates */
        memcpy(out, tie, sizeof(int32_t) * (size_t)c);
        return c;
    }
    return top_of(v, tie, c, k, mx, out, tie + c);
}

#ifdef SQ_AVX512
typedef __m512 nibv; /* nib_dot's accumulator */
#define nib_zero _mm512_setzero_ps
#define nib_sum _mm512_reduce_add_ps
#define nib_fma(v, c, acc) _mm512_fmadd_ps(v, _mm512_set1_ps(c), acc)
static inline __m512 nib_dot(__m128i b, const float *xb, __m512 acc) { /* 32 codes of a rows32 block */
    const __m128i m = _mm_set1_epi8(15);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m))), _mm512_loadu_ps(xb), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m))),
                           _mm512_loadu_ps(xb + 16), acc);
}
#elif defined(SQ_AVX2)
typedef __m256 nibv;
#define nib_zero _mm256_setzero_ps
#define nib_sum hsum8
#define nib_fma(v, c, acc) _mm256_fmadd_ps(v, _mm256_set1_ps(c), acc)
static inline __m256 nib_dot(__m128i b, const float *xb, __m256 acc) {
    const __m128i m = _mm_set1_epi8(15), lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xb), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xb + 8), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xb + 16), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xb + 24), acc);
}
#endif

static float split_row_dot(const sq_linear *L, int64_t n, const float *x, const float *gsum) {
    const int64_t K = L->k, g = L->g, G = K / g;
    const uint8_t *w = L->q + n * (K / 2), *r = L->res + n * (K / 2);
    const uint16_t *rs = L->rsc + n * G;
    float acc = 0.f;
#ifdef SQ_AVX2
    /* the planes' group dots stay in vectors, scaled there: one horizontal sum per row */
    nibv av = nib_zero();
    for (int64_t gi = 0; gi < G; gi++) {
        nibv aq = nib_zero(), ar = nib_zero();
        for (int64_t b = gi * g / 32; b < (gi + 1) * g / 32; b++) {
            aq = nib_dot(_mm_loadu_si128((const __m128i *)(w + 16 * b)), x + 32 * b, aq);
            ar = nib_dot(_mm_loadu_si128((const __m128i *)(r + 16 * b)), x + 32 * b, ar);
        }
        const uint16_t *p = L->sz + 2 * (gi * L->n + n);
        const float s = bf(p[0]), z = bf(p[1]), q = bf(rs[gi]);
        av = nib_fma(aq, s, nib_fma(ar, q, av));
        acc += (z - 8.f * s - 8.f * q) * gsum[gi];
    }
    return nib_sum(av) + acc;
#else
    for (int64_t gi = 0; gi < G; gi++) {
        float dq = 0.f, dr = 0.f;
        for (int64_t b = gi * g / 32; b < (gi + 1) * g / 32; b++) {
            const uint8_t *wb = w + 16 * b, *rb = r + 16 * b;
            const float *xb = x + 32 * b;
            for (int j = 0; j < 16; j++) {
                dq += (float)(wb[j] & 15) * xb[j] + (float)(wb[j] >> 4) * xb[j + 16];
                dr += (float)(rb[j] & 15) * xb[j] + (float)(rb[j] >> 4) * xb[j + 16];
            }
        }
        const uint16_t *p = L->sz + 2 * (gi * L->n + n);
        const float s = bf(p[0]), z = bf(p[1]), q = bf(rs[gi]);
        acc += s * dq + q * dr + (z - 8.f * s - 8.f * q) * gsum[gi];
    }
    return acc;
#endif
}

/* the candidates (one thread, then a barrier) ... */
static void split_select(const sq_linear *H, sq_work *w, const float *x, const float *logits, int64_t k) {
    w->ncand = select_top(logits, H->n, k, w->cand, w->tie);
    /* in row order (through a bitmap in the tie buffer, free again): consecutive candidates
     * then share the pages of the [K/g, N, 2] scales, K/g lines far apart per row */
    uint64_t *bits = (uint64_t *)w->tie;
    const int64_t nw = (H->n + 63) / 64;
    memset(bits, 0, sizeof(uint64_t) * (size_t)nw);
    for (int64_t i = 0; i < w->ncand; i++) bits[w->cand[i] >> 6] |= 1ull << (w->cand[i] & 63);
    int64_t o = 0;
    for (int64_t wi = 0; wi < nw; wi++)
        for (uint64_t b = bits[wi]; b; b &= b - 1) w->cand[o++] = (int32_t)(wi * 64 + __builtin_ctzll(b));
    for (int64_t gi = 0; gi < H->k / H->g; gi++) {
        float s = 0.f;
        for (int64_t j = gi * H->g; j < (gi + 1) * H->g; j++) s += x[j];
        w->gsum[gi] = s;
    }
}

/* Every cache line split_row_dot reads for row n requested ahead: both planes' bytes, the
 * residual scales and one (scale, zero) line per group. The first line of each plane and of
 * the residual scales by a demand load: the rows are scattered over ~300 MB of 4 KiB pages and
 * a software prefetch that misses the TLB is dropped (prefetches alone measured no faster);
 * the loads walk the page tables early. */
static inline void touch(const void *p) {
    const uint8_t v = *(const volatile uint8_t *)p;
    __asm__ volatile("" ::"r"(v));
}

static inline void split_row_prefetch(const sq_linear *L, int64_t n) {
    const int64_t K = L->k, G = K / L->g;
    touch(L->q + n * (K / 2));
    touch(L->res + n * (K / 2));
    touch(L->rsc + n * G);
    for (int64_t o = 64; o < K / 2; o += 64) {
        __builtin_prefetch(L->q + n * (K / 2) + o);
        __builtin_prefetch(L->res + n * (K / 2) + o);
    }
    for (int64_t gi = 0; gi < G; gi++) __builtin_prefetch(L->sz + 2 * (gi * L->n + n));
}

/* ... and their rows, by every thread of the region, each requested SPLIT_AHEAD rows before it
 * is read. Split head of the 1.7B shape, 2048 rows (per-step timers in a scratch build, not
 * kept; medians of 192 steps, 2 rounds): 618-639 us -> 450-455 with the candidates in row
 * order and these requests (the row order alone, or software prefetches alone: no change) */
#define SPLIT_AHEAD 4
static void split_rows(const sq_linear *H, sq_work *w, const float *x, float *logits) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < w->ncand; i++) {
        if (i + SPLIT_AHEAD < w->ncand) split_row_prefetch(H, w->cand[i + SPLIT_AHEAD]);
        logits[w->cand[i]] = split_row_dot(H, w->cand[i], x, w->gsum);
    }
}

static inline void silu_mul(const float *gu, int64_t I, int act, float *out) {
    int64_t i = 0;
#ifdef SQ_AVX512
    if (act == 0)
        for (; i + 16 <= I; i += 16) { /* the AVX2 loop below on 16 lanes */
            const __m512 g = _mm512_loadu_ps(gu + i);
            const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(87.f)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                                    _mm512_loadu_ps(gu + I + i)));
        }
#endif
#ifdef SQ_AVX2
    if (act == 0)
        for (; i + 8 <= I; i += 8) {
            const __m256 g = _mm256_loadu_ps(gu + i);
            /* g / (1 + e^-g); e^-g for g < -87 is clamped (the quotient is then -0 or tiny) */
            const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(87.f)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                                    _mm256_loadu_ps(gu + I + i)));
        }
#endif
    for (; i < I; i++) {
        const float g = gu[i];
        out[i] = (act == 0 ? g / (1.f + expf(-g)) : gelu_tanh(g)) * gu[I + i];
    }
}

/* One decode step: token at position pos -> logits fp32 [vocab]. x is fp32 [hidden] scratch.
 * Returns 0, or -1 if pos is outside the cache. */
int sq_step(const sq_model *m, void *work, int64_t token, int64_t pos, float *x, float *logits) {
    sq_work *w = work;
    if (pos < 0 || pos >= m->cap) return -1;
    const int64_t E = m->hidden, I = m->inter;
    const int off = (int)m->norm_offset;
    /* one parallel region per token: `single` blocks for the serial parts, worksharing loops
     * for the products and attention (each ends in a barrier), no fork/join per product */
#pragma omp parallel
    {
#pragma omp single
        {
            embed_row(&m->embed, token, x);
            if (m->embed_mult != 0.0)
                for (int64_t i = 0; i < E; i++) x[i] = bf(to_bf(x[i] * (float)m->embed_mult));
        }
        for (int64_t li = 0; li < m->layers; li++) {
            const sq_layer *L = &m->layer[li];
#pragma omp single
            {
                rms_norm(x, L->attn_norm, E, m->eps, off, w->xn);
                prep(&L->qkv, w->xn, &w->a);
            }
            products(&L->qkv, &w->a, w->qkv);
#pragma omp for schedule(static)
            for (int64_t h = 0; h < m->heads + m->kv_heads; h++) qk_rope_head(m, L, w->qkv, pos, h);
            attention(m, L, w, pos);
#pragma omp single
            prep(&L->o, w->att, &w->a);
            products(&L->o, &w->a, w->h);
#pragma omp single
            {
                add_residual(m, L->post_attn_norm, w->h, x);
                rms_norm(x, L->mlp_norm, E, m->eps, off, w->xn);
                prep(&L->gate_up, w->xn, &w->a);
            }
            products(&L->gate_up, &w->a, w->gu);
#pragma omp single
            {
                silu_mul(w->gu, I, (int)m->act, w->mid);
                prep(&L->down, w->mid, &w->a);
            }
            products(&L->down, &w->a, w->h);
#pragma omp single
            {
                add_residual(m, L->post_mlp_norm, w->h, x);
            }
        }
#pragma omp single
        {
            rms_norm(x, m->final_norm, E, m->eps, off, w->xn);
            prep(&m->head, w->xn, &w->a);
        }
        products(&m->head, &w->a, logits); /* a final softcap, if any, is applied by the caller */
        if (m->head.res) {
#pragma omp single
            split_select(&m->head, w, w->xn, logits, m->refine_top);
            split_rows(&m->head, w, w->xn, logits);
        } else {
#pragma omp single
            refine_top(&m->head, w->xn, logits, m->refine_top);
        }
    }
    return 0;
}

/* Logits fp32 [vocab] from a final-normed hidden state xn [hidden] (what sq_prefill returns):
 * the tail of sq_step (head product, top logits recomputed exactly). */
int sq_head(const sq_model *m, void *work, const float *xn, float *logits) {
    sq_work *w = work;
    prep(&m->head, xn, &w->a);
#pragma omp parallel
    products(&m->head, &w->a, logits);
    if (m->head.res) {
        split_select(&m->head, w, xn, logits, m->refine_top);
#pragma omp parallel
        split_rows(&m->head, w, xn, logits);
    } else {
        refine_top(&m->head, xn, logits, m->refine_top);
    }
    return 0;
}

/* ---- prefill: many tokens through every layer ----------------------------------------------
 * The same arithmetic as sq_step, for a chunk of tokens at a time: fp32 residual stream and
 * pointwise parts, W4A8 products through the GEMM (sq_linear_batch), bf16 KV cache, and a
 * causal (optionally sliding-window) attention over the cache in fp32. */

#ifdef SQ_AVX512
#define PQB 16 /* queries per attention work item: one lane each */
#else
#define PQB 8
#endif

/* pt[(j - klo) * PQB + i] = scale * q_i . K_j for queries i < nq (rows of q, stride ldq) and
 * keys j in [klo, khi) of one KV head, read from Kf (fp32 [*, D], the head's bf16 cache rows
 * converted once per chunk by attention_many): the scores of one key for all PQB queries are
 * contiguous, so the softmax runs across queries in one vector and P.V reads one cache line per
 * key. AVX2 (8 queries) and AVX512 (16): the (scaled) queries transposed to qt [D][PQB], so one
 * FMA multiplies one key element (broadcast) with all PQB queries; 4 keys x 2 accumulators in
 * registers, no horizontal sums. Lanes i >= nq get 0 (masked by the softmax). */
static void scores_t(const sq_model *m, const float *Kf, const float *q, int64_t ldq, int64_t nq, int64_t klo,
                     int64_t khi, float scale, float *pt) {
    const int64_t D = m->head_dim;
#ifdef SQ_AVX512
    if (D % 2 == 0 && D <= 512) { /* the AVX2 loop below on 16 lanes */
        float qt[512 * PQB] __attribute__((aligned(64)));
        for (int64_t d = 0; d < D; d++)
            for (int64_t i = 0; i < PQB; i++) qt[d * PQB + i] = i < nq ? q[i * ldq + d] * scale : 0.f;
        int64_t j = klo;
        for (; j + 4 <= khi; j += 4) {
            const float *k0 = Kf + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t d = 0; d < D; d += 2) {
                const __m512 q0 = _mm512_load_ps(qt + d * PQB), q1 = _mm512_load_ps(qt + (d + 1) * PQB);
                a0 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k0[d]), a0);
                b0 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k0[d + 1]), b0);
                a1 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k1[d]), a1);
                b1 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k1[d + 1]), b1);
                a2 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k2[d]), a2);
                b2 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k2[d + 1]), b2);
                a3 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k3[d]), a3);
                b3 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k3[d + 1]), b3);
            }
            float *o = pt + (j - klo) * PQB;
            _mm512_storeu_ps(o, _mm512_add_ps(a0, b0));
            _mm512_storeu_ps(o + PQB, _mm512_add_ps(a1, b1));
            _mm512_storeu_ps(o + 2 * PQB, _mm512_add_ps(a2, b2));
            _mm512_storeu_ps(o + 3 * PQB, _mm512_add_ps(a3, b3));
        }
        for (; j < khi; j++) {
            const float *kr = Kf + j * D;
            __m512 a = _mm512_setzero_ps(), b = a;
            for (int64_t d = 0; d < D; d += 2) {
                a = _mm512_fmadd_ps(_mm512_load_ps(qt + d * PQB), _mm512_set1_ps(kr[d]), a);
                b = _mm512_fmadd_ps(_mm512_load_ps(qt + (d + 1) * PQB), _mm512_set1_ps(kr[d + 1]), b);
            }
            _mm512_storeu_ps(pt + (j - klo) * PQB, _mm512_add_ps(a, b));
        }
        return;
    }
#elif defined(SQ_AVX2)
    if (D % 2 == 0 && D <= 512 && PQB == 8) {
        float qt[512 * PQB] __attribute__((aligned(32)));
        for (int64_t d = 0; d < D; d++)
            for (int64_t i = 0; i < PQB; i++) qt[d * PQB + i] = i < nq ? q[i * ldq + d] * scale : 0.f;
        int64_t j = klo;
        for (; j + 4 <= khi; j += 4) {
            const float *k0 = Kf + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t d = 0; d < D; d += 2) {
                const __m256 q0 = _mm256_load_ps(qt + d * PQB), q1 = _mm256_load_ps(qt + (d + 1) * PQB);
                a0 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k0 + d), a0);
                b0 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k0 + d + 1), b0);
                a1 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k1 + d), a1);
                b1 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k1 + d + 1), b1);
                a2 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k2 + d), a2);
                b2 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k2 + d + 1), b2);
                a3 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k3 + d), a3);
                b3 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k3 + d + 1), b3);
            }
            float *o = pt + (j - klo) * PQB;
            _mm256_storeu_ps(o, _mm256_add_ps(a0, b0));
            _mm256_storeu_ps(o + PQB, _mm256_add_ps(a1, b1));
            _mm256_storeu_ps(o + 2 * PQB, _mm256_add_ps(a2, b2));
            _mm256_storeu_ps(o + 3 * PQB, _mm256_add_ps(a3, b3));
        }
        for (; j < khi; j++) {
            const float *kr = Kf + j * D;
            __m256 a = _mm256_setzero_ps(), b = a;
            for (int64_t d = 0; d < D; d += 2) {
                a = _mm256_fmadd_ps(_mm256_load_ps(qt + d * PQB), _mm256_broadcast_ss(kr + d), a);
                b = _mm256_fmadd_ps(_mm256_load_ps(qt + (d + 1) * PQB), _mm256_broadcast_ss(kr + d + 1), b);
            }
            _mm256_storeu_ps(pt + (j - klo) * PQB, _mm256_add_ps(a, b));
        }
        return;
    }
#endif
    for (int64_t j = klo; j < khi; j++)
        for (int64_t i = 0; i < PQB; i++) {
            float acc = 0.f;
            if (i < nq)
                for (int64_t d = 0; d < D; d++) acc += q[i * ldq + d] * Kf[j * D + d];
            pt[(j - klo) * PQB + i] = acc * scale;
        }
}

/* att[t, h*D..] for the queries t in [0, T) at positions p0 + t, head by head, over the cache.
 * qkv: [T, ldq] rows whose first H*D values are the (normed, rotated) queries. scratch: per
 * thread PQB * cap floats. Query t sees keys (p - window, p], all of [0, p] without one. */
static void attention_many(const sq_model *m, const sq_layer *L, const float *qkv, int64_t ldq, int64_t p0,
                           int64_t T, float *att, float *scratch, float *kf) {
    const int64_t H = m->heads, D = m->head_dim, cap = m->cap, grp = H / m->kv_heads, nqb = (T + PQB - 1) / PQB;
    const float scale = (float)m->attn_scale;
    /* keys any query of the chunk sees: [kbeg, p0 + T) */
    const int64_t kbeg = L->window > 0 && p0 + 1 > L->window ? p0 + 1 - L->window : 0;
#pragma omp parallel
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *pt = scratch + (int64_t)tid * PQB * cap;
        for (int64_t g = 0; g < m->kv_heads; g++) { /* one KV head at a time: its keys in fp32, then its queries */
            const uint16_t *Kb = L->kcache + g * cap * D;
#pragma omp for schedule(static)
            for (int64_t j = kbeg; j < p0 + T; j++)
                for (int64_t d = 0; d < D; d++) kf[j * D + d] = bf(Kb[j * D + d]);
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < grp * nqb; it++) {
                /* largest blocks first: the causal cost grows with the query position */
                const int64_t h = g * grp + it % grp, qb = nqb - 1 - it / grp, t0 = qb * PQB, t1 = t0 + PQB < T ? t0 + PQB : T;
                const int64_t nq = t1 - t0;
                const uint16_t *V = L->vcache + g * cap * D;
                int32_t lo[PQB], hi[PQB]; /* visible keys [lo, hi) per query; empty for i >= nq */
                int64_t klo = p0 + t1, khi = 0;
                for (int64_t i = 0; i < PQB; i++) {
                    const int64_t p = p0 + t0 + i;
                    hi[i] = i < nq ? (int32_t)(p + 1) : 0;
                    lo[i] = i < nq && L->window > 0 && p + 1 > L->window ? (int32_t)(p + 1 - L->window) : 0;
                    if (i < nq) {
                        klo = lo[i] < klo ? lo[i] : klo;
                        khi = hi[i] > khi ? hi[i] : khi;
                    }
                }
                scores_t(m, kf, qkv + t0 * ldq + h * D, ldq, nq, klo, khi, scale, pt);
                /* softmax across the keys, all PQB queries in one vector (masked lanes give 0) */
                float inv[PQB];
    #if defined(SQ_AVX512)
                {
                    const __m512i vlo = _mm512_loadu_si512((const void *)lo), vhi = _mm512_loadu_si512((const void *)hi);
                    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    #define SQ_VALID(j) (_mm512_cmpgt_epi32_mask(vhi, _mm512_set1_epi32((int32_t)(j))) & \
                         _mm512_cmple_epi32_mask(vlo, _mm512_set1_epi32((int32_t)(j))))
                    for (int64_t j = klo; j < khi; j++)
                        mx = _mm512_mask_max_ps(mx, SQ_VALID(j), mx, _mm512_loadu_ps(pt + (j - klo) * PQB));
                    for (int64_t j = klo; j < khi; j++) {
                        float *pj = pt + (j - klo) * PQB;
                        const __m512 e = _mm512_maskz_mov_ps(SQ_VALID(j), exp16(_mm512_sub_ps(_mm512_loadu_ps(pj), mx)));
                        _mm512_storeu_ps(pj, e);
                        sum = _mm512_add_ps(sum, e);
                    }
    #undef SQ_VALID
                    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
                }
    #elif defined(SQ_AVX2)
                {
                    const __m256i vlo = _mm256_loadu_si256((const __m256i *)lo), vhi = _mm256_loadu_si256((const __m256i *)hi);
                    const __m256 ninf = _mm256_set1_ps(-INFINITY);
                    __m256 mx = ninf, sum = _mm256_setzero_ps();
    #define SQ_VALID(j) _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(vlo, _mm256_set1_epi32((int32_t)(j))), \
                                                                _mm256_cmpgt_epi32(vhi, _mm256_set1_epi32((int32_t)(j)))))
                    for (int64_t j = klo; j < khi; j++)
                        mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(pt + (j - klo) * PQB), SQ_VALID(j)));
                    for (int64_t j = klo; j < khi; j++) {
                        float *pj = pt + (j - klo) * PQB;
                        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(pj), mx)), SQ_VALID(j));
                        _mm256_storeu_ps(pj, e);
                        sum = _mm256_add_ps(sum, e);
                    }
    #undef SQ_VALID
                    _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.f), sum));
                }
    #else
                for (int i = 0; i < PQB; i++) {
                    float mx = -INFINITY, sum = 0.f;
                    for (int64_t j = lo[i]; j < hi[i]; j++) mx = pt[(j - klo) * PQB + i] > mx ? pt[(j - klo) * PQB + i] : mx;
                    for (int64_t j = klo; j < khi; j++) {
                        float *e = pt + (j - klo) * PQB + i;
                        *e = j >= lo[i] && j < hi[i] ? expf(*e - mx) : 0.f;
                        sum += *e;
                    }
                    inv[i] = sum > 0.f ? 1.f / sum : 0.f;
                }
    #endif
                /* out = P V / sum: per 16 (AVX512) or 8 columns, the PQB outputs stay in registers
                 * over the keys */
                int64_t dbeg = 0;
    #ifdef SQ_AVX512
                for (; dbeg + 16 <= D; dbeg += 16) {
                    __m512 acc[PQB];
                    for (int i = 0; i < PQB; i++) acc[i] = _mm512_setzero_ps();
                    for (int64_t j = klo; j < khi; j++) {
                        const __m512 v = load_bf16x16(V + j * D + dbeg);
                        const float *pj = pt + (j - klo) * PQB;
                        for (int i = 0; i < PQB; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(pj[i]), v, acc[i]);
                    }
                    for (int i = 0; i < PQB; i++)
                        if (i < nq) _mm512_storeu_ps(att + (t0 + i) * H * D + h * D + dbeg, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv[i])));
                }
    #endif
                for (int64_t d0 = dbeg; d0 < D; d0 += 8) {
    #ifdef SQ_AVX2
                    if (d0 + 8 <= D) {
                        __m256 acc[PQB];
                        for (int i = 0; i < PQB; i++) acc[i] = _mm256_setzero_ps();
                        for (int64_t j = klo; j < khi; j++) {
                            const __m256 v = load_bf8(V + j * D + d0);
                            const float *pj = pt + (j - klo) * PQB;
                            for (int i = 0; i < PQB; i++) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(pj + i), v, acc[i]);
                        }
                        for (int i = 0; i < PQB; i++) /* a constant bound keeps acc[] in registers */
                            if (i < nq)
                                _mm256_storeu_ps(att + (t0 + i) * H * D + h * D + d0,
                                                 _mm256_mul_ps(acc[i], _mm256_set1_ps(inv[i])));
                        continue;
                    }
    #endif
                    const int64_t d1 = d0 + 8 < D ? d0 + 8 : D;
                    for (int64_t i = 0; i < nq; i++)
                        for (int64_t d = d0; d < d1; d++) {
                            float acc = 0.f;
                            for (int64_t j = klo; j < khi; j++) acc += pt[(j - klo) * PQB + i] * bf(V[j * D + d]);
                            att[(t0 + i) * H * D + h * D + d] = acc * inv[i];
                        }
                }
            }
        }
    }
}

/* Y [M, N] = X [M, K] L^T (+ bias), fp32 in and out */
static int linear_many(const sq_linear *L, const float *X, int64_t M, float *Y, void *xtbuf) {
    const int64_t K = L->k, N = L->n;
#ifdef SQ_EXACT
    const int exact = 1;
#else
    const int exact = 0;
#endif
    if (exact || L->kind == KIND_BF16) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < M; t++) {
#ifdef SQ_EXACT
            if (L->kind != KIND_BF16) { rows_exact(L, X + t * K, Y + t * N, 0, N); continue; }
#endif
            rows_bf16(L, X + t * K, Y + t * N, 0, N);
        }
    } else if (linear_batch(L, X, 0, M, Y, NULL, xtbuf)) {
        return -1;
    }
    if (L->bias)
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < M; t++)
            for (int64_t n = 0; n < N; n++) Y[t * N + n] += bf(L->bias[n]);
    return 0;
}

/* Tokens [pos0, pos0 + T) of a prompt through every layer, `chunk` tokens at a time (their
 * K/V go to the cache). out: the final-normed hidden state (fp32 [E]) of every token
 * (all != 0, out [T, E]) or of the last one. Returns 0, -1 out of memory, -2 beyond the cache. */
int sq_prefill(const sq_model *m, const int64_t *tokens, int64_t T, int64_t pos0, int64_t chunk, float *out,
               int64_t all) {
    if (T <= 0 || pos0 < 0 || pos0 + T > m->cap) return -2;
    if (chunk <= 0 || chunk > T) chunk = T;
    const int64_t E = m->hidden, H = m->heads, KV = m->kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qd = H * D, nqkv = qd + 2 * KV * D, maxk = max3(E, I, qd), wide = 2 * I > nqkv ? 2 * I : nqkv;
    const int off = (int)m->norm_offset;
    int nthr = 1;
#ifdef _OPENMP
    nthr = omp_get_max_threads();
#endif
    float *x = malloc(sizeof(float) * chunk * E), *xn = malloc(sizeof(float) * chunk * maxk);
    float *big = malloc(sizeof(float) * chunk * wide), *att = malloc(sizeof(float) * chunk * qd);
    float *scr = malloc(sizeof(float) * nthr * PQB * m->cap);
    float *kf = malloc(sizeof(float) * (pos0 + T) * D); /* one KV head's keys in fp32 (attention_many) */
    void *xt = NULL; /* the bf16 GEMM's activation tiles, shared by every product */
#ifdef SQ_BF16
    xt = alloc64(sizeof(uint16_t) * ((chunk + BT - 1) / BT * BT) * maxk);
    int rc = (x && xn && big && att && scr && kf && xt) ? 0 : -1;
#else
    int rc = (x && xn && big && att && scr && kf) ? 0 : -1;
#endif
    for (int64_t c0 = 0; c0 < T && !rc; c0 += chunk) {
        const int64_t n = c0 + chunk < T ? chunk : T - c0, p0 = pos0 + c0;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            embed_row(&m->embed, tokens[c0 + t], x + t * E);
            if (m->embed_mult != 0.0)
                for (int64_t i = 0; i < E; i++) x[t * E + i] = bf(to_bf(x[t * E + i] * (float)m->embed_mult));
        }
        for (int64_t li = 0; li < m->layers && !rc; li++) {
            const sq_layer *L = &m->layer[li];
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) rms_norm(x + t * E, L->attn_norm, E, m->eps, off, xn + t * E);
            if ((rc = linear_many(&L->qkv, xn, n, big, xt))) break;
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) qk_rope_cache(m, L, big + t * nqkv, p0 + t);
            attention_many(m, L, big, nqkv, p0, n, att, scr, kf);
            if ((rc = linear_many(&L->o, att, n, xn, xt))) break;
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) {
                add_residual(m, L->post_attn_norm, xn + t * E, x + t * E);
                rms_norm(x + t * E, L->mlp_norm, E, m->eps, off, xn + t * E);
            }
            if ((rc = linear_many(&L->gate_up, xn, n, big, xt))) break;
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) silu_mul(big + t * 2 * I, I, (int)m->act, xn + t * I);
            if ((rc = linear_many(&L->down, xn, n, big, xt))) break;
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) add_residual(m, L->post_mlp_norm, big + t * E, x + t * E);
        }
        if (rc) break;
        if (all) {
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) rms_norm(x + t * E, m->final_norm, E, m->eps, off, out + (c0 + t) * E);
        } else if (c0 + n == T) {
            rms_norm(x + (n - 1) * E, m->final_norm, E, m->eps, off, out);
        }
    }
    free(x); free(xn); free(big); free(att); free(scr); free(kf); free(xt);
    return rc;
}
