/* What every C-core file shares: the instruction-set switches and the vector helpers.
 *
 * SQ_AVX2 (AVX2 + FMA), SQ_AVXVNNI (AVX2 + AVX-VNNI), SQ_AVX512 (AVX512 F/BW/VL + VNNI), SQ_BF16
 * (AVX512-BF16) and SQ_AMX (AMX tiles, INT8 and BF16) follow the compiler's target (each build's
 * explicit ISA flags, runtime/core/builds.py); SQ_SCALAR forces
 * the portable C everywhere and SQ_EXACT (with it) fp32 activations (the tests' A8-free reference). */
#ifndef SQ_SIMD_H
#define SQ_SIMD_H
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
#define SQ_BF16 1 /* prefill GEMM: int4 row blocks dequantized to bf16, vdpbf16ps (gemm_bf16.c) */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && !defined(SQ_NO_AMX)
#define SQ_AMX 1 /* prefill GEMM on AMX-BF16 tiles, int4 and lut4 (gemm_tiles.c, gemm_amx.c) */
#endif
#endif
#elif defined(__AVXVNNI__) || (defined(SQ_VNNI_EVEX) && defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define SQ_AVXVNNI 1 /* AVX2 + AVX-VNNI (Alder Lake on, no AVX512): the AVX2 byte dots in VEX vpdpbusd
                      * (SQ_VNNI_EVEX: the tests' avx2-vnni-evex build, the EVEX form) */
#endif
#include <immintrin.h>
#endif
/* Arm: SQ_NEON (armv8.2-a+dotprod: sdot decode products and prompt GEMM, gemv_neon.c / gemm_neon.c;
 * decode attention, attention_neon.c)
 * and SQ_I8MM (with +i8mm: the prompt GEMM on smmla, gemm_i8mm_neon.c); explicit -march flags
 * per build (runtime/core/builds.py), never -march=native, so a wheel's library is what the tests ran */
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(SQ_SCALAR)
#define SQ_NEON 1
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define SQ_I8MM 1
#endif
#include <arm_neon.h>
#endif
#include "sq_abi.h"

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

/* a linear with 4-bit rows32 codes and per-group (scale, zero): int4 or lut4 */
static inline int is_q4(const sq_linear *L) { return L->kind == KIND_INT4 || L->kind == KIND_LUT4; }
/* row n's row of a split linear's second plane, or -1 where that plane does not cover it */
static inline int64_t res_row(const sq_linear *L, int64_t n) { return L->rmap ? (int64_t)L->rmap[n] : n; }

static inline int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

#ifdef SQ_AVX2
/* acc + per int32 lane the sum of 4 products u (unsigned bytes) x s (signed bytes), one vpdpbusd
 * where VNNI is: EVEX on 8 lanes (AVX512-VNNI + VL: the AVX2 products of AVX512 builds, and
 * avx2-vnni-evex) or VEX (avx2-vnni). Without it, callers pair maddubs + madd: the same int32 sums, as their u <= 128
 * (codes 0..15, |levels|, |int8 weights|) keep maddubs' int16 pair sums within +-32768. */
#if defined(SQ_AVX512) || (defined(SQ_AVXVNNI) && defined(SQ_VNNI_EVEX))
#define SQ_DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(SQ_AVXVNNI)
#define SQ_DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

/* per int32 lane the 4-byte dot of u (unsigned, <= 128) and s (signed): exact either way */
static inline __m256i dot4_u8s8(__m256i u, __m256i s) {
#ifdef SQ_DPBUSD256
    return SQ_DPBUSD256(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

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

/* a 16 x 16 dword transpose in registers: r[i] lane j <-> r[j] lane i */
static inline void tr16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int q = 0; q < 4; q++) { /* u[4k + q]: lane L holds column 4L + k of rows 4q..4q+3 */
        u[q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 + q] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[8 + q] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[12 + q] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int k = 0; k < 4; k++) { /* a 4 x 4 transpose of 128-bit lanes */
        const __m512i *v = u + 4 * k;
        const __m512i v0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), v1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), v3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
        r[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* the first `left` of 16 lanes (none when left <= 0): a 16-row vector's rows before N, a tail's keys */
static inline __mmask16 rows_mask(int64_t left) {
    return left <= 0 ? 0 : left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
}
#endif

#ifdef SQ_AVX2
/* rows ahead of the current one whose bytes the row loops prefetch: `bytes` worth, at least 2 */
/* The batched decode products (AVX512 int4/lut4, T >= 2 tokens a pass): activation bytes (codes
 * and scales) are 1 + 4 / 8 per token and column. Past SPAN_L1 bytes for the pass's tokens (the
 * 6144-column `down` of the 1.7B shape at T = 4: 36 KiB, more than a Zen 4 core's 32 KiB L1) a
 * 16-row chunk runs in column spans of ~SPAN_L1 / T bytes of activations, all its rows span by
 * span, two rows at a time sharing each token's activation loads, each row's accumulators kept
 * between spans: the same arithmetic in the same order, the same bits. One token, and rows whose
 * activations fit one span, keep one sequential stream per row (docs/serving.md). */
#ifndef SPAN_L1
#define SPAN_L1 (16 * 1024)
#endif

/* The AVX512 decode products prefetch their weight stream twice: rows_ahead(rb, 8192) rows on
 * into L2 (T1), and NEAR_L1 bytes on into L1 (T0). The single T0 prefetch 8 KiB on they had
 * before left a 1.7B-shape linear (2048 x 12288 g128, from memory, 2 threads) at 21-22 GB/s for
 * one token where the two reach 29-43; docs/performance.md "Prefetch hints". */
#define NEAR_L1 2048
static inline int64_t rows_ahead(int64_t rowbytes, int64_t bytes) {
    const int64_t r = (bytes + rowbytes - 1) / rowbytes;
    return r > 2 ? r : 2;
}


/* 8 fp32 -> 8 bf16, round to nearest even (NaN stays NaN), as to_bf */
static inline __m128i to_bf8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

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

#endif
