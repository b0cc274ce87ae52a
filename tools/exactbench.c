/* Exact group sums in the AVX512-VNNI decode products: what they would cost (an experiment for
 * issue 52's batch-invariant tiles; docs/notes/performance-history.md "Exact group sums").
 *
 * With power-of-two sub-block activation scales (each 8-column scale m 2^-e / 127, m the weight
 * group's max |x|, 0 <= e <= 7) a group's dot product is one exact int32, S = sum_k (w_k - 8)
 * q_k 2^(7 - e_k), so int8 tiles (15-bit activations Q = q 2^(7 - e) as two int8 halves,
 * gemv_tiles.c) and these VNNI products can give the same bits: y = sum_g fma((float) S_g,
 * s_g c_g, .) with c_g = m_g / 16256. Here each VNNI step's lane sums are shifted (vpsllvd) and
 * 4 steps (g32) or 16 (g128) are summed per group by one transposing reduction, then one convert
 * and FMA per 16 groups. The kernel is checked bit for bit against a scalar mirror of its float
 * operations (the order a tile epilogue would follow), then timed against the W4A8 quad products
 * (gemv_4bit_a8quad_many_avx512) in interleaved rounds, T tokens per pass (1-4), int4, g 32 or 128:
 *
 *   gcc -O3 -std=gnu11 -march=native -fopenmp -I runtime/core/csrc tools/exactbench.c -o /tmp/exactbench -lm
 *   OMP_NUM_THREADS=2 /tmp/exactbench [K 2048] [N 12288] [G 128] [T 1] [copies 8] [rounds 15]
 *
 * copies x N x K / 2 bytes past the last-level cache: from memory; copies 1 and a small N: in cache.
 * K / G must be at most 256 groups (the quad products' limit) and K a multiple of 64. */
#define _POSIX_C_SOURCE 199309L
#include <time.h>

#include "sq.c"
#include "benchlinear.h"

#ifndef SQ_AVX512
#error "exactbench needs an AVX512-VNNI build (-march=native on such a CPU)"
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* one token's activations */
typedef struct {
    int8_t *q;    /* codes in quad order (act.c), K rounded up to 128 */
    int32_t *sh;  /* [K / 128 + 1][16] each lane's shift 7 - e */
    float *c;     /* [16 batches][16] m / 16256 per group, in the kernel's lane order */
    int32_t *qs8; /* the same order: 8 sum_k Q_k (int4's -8 offset) */
    float *cn, *gsum; /* natural order: m / 16256, and the fp32 sum of x, per group */
    int32_t *qsn;
} ex_act;

/* a group's lane within its batch of 16: g32 lane 4c + j holds group 4j + c (red4x4's order) */
static inline int ex_lane(int64_t G, int64_t gi) {
    const int o = (int)(gi % 16);
    return G == 32 ? 4 * (o % 4) + o / 4 : o;
}

/* the largest e <= 7 with am 2^e <= m (positive floats: the exponent field is the log) */
static inline int ex_shift_e(float am, float m) {
    uint32_t a, b;
    memcpy(&a, &am, 4), memcpy(&b, &m, 4);
    const uint32_t d = (b - a) >> 23;
    return d > 7 ? 7 : (int)d;
}

static void ex_quantize(const float *x, const sq_linear *L, ex_act *a) {
    const int64_t K = L->k, G = L->g, ng = K / G, nq = (K + 127) / 128;
    memset(a->q, 0, nq * 128), memset(a->sh, 0, sizeof(int32_t) * 16 * (nq + 1));
    memset(a->c, 0, sizeof(float) * 256), memset(a->qs8, 0, sizeof(int32_t) * 256);
    for (int64_t gi = 0; gi < ng; gi++) {
        const float *xg = x + gi * G;
        float m = 0.f, s = 0.f;
        for (int64_t k = 0; k < G; k++) m = fabsf(xg[k]) > m ? fabsf(xg[k]) : m, s += xg[k];
        const float inv = m > 0.f ? 127.f / m : 0.f;
        int32_t qsum = 0;
        for (int64_t b = gi * G / 32; b < (gi + 1) * G / 32; b++)
            for (int i = 0; i < 4; i++) { /* sub-block i: columns 4i..4i+3, 16+4i..16+4i+3 */
                float am = 0.f;
                for (int j = 0; j < 8; j++) am = fmaxf(am, fabsf(x[32 * b + 4 * i + j % 4 + 16 * (j / 4)]));
                const int e = ex_shift_e(am, m);
                a->sh[16 * (b / 4) + 4 * (b % 4) + i] = 7 - e;
                for (int j = 0; j < 8; j++) {
                    const int col = 4 * i + j % 4 + 16 * (j / 4);
                    long q = lrintf(x[32 * b + col] * (inv * (float)(1 << e)));
                    q = q > 127 ? 127 : q < -127 ? -127 : q;
                    a->q[128 * (b / 4) + 64 * (col / 16) + 16 * (b % 4) + col % 16] = (int8_t)q;
                    qsum += (int32_t)q * (1 << (7 - e));
                }
            }
        a->c[gi / 16 * 16 + ex_lane(G, gi)] = a->cn[gi] = m / 16256.f;
        a->qs8[gi / 16 * 16 + ex_lane(G, gi)] = 8 * qsum;
        a->qsn[gi] = qsum, a->gsum[gi] = s;
    }
}

/* 4 vectors -> lane 4c + j: the sum of v_j's lanes 4c..4c+3 */
static inline __m512i red4x4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* 4 red4x4 results (of 16 vectors) -> lane i: the sum of vector i's 16 lanes */
static inline __m512i red16_of4(const __m512i *z) {
    const __m512i y0 = _mm512_add_epi32(_mm512_shuffle_i32x4(z[0], z[1], 0x88), _mm512_shuffle_i32x4(z[0], z[1], 0xdd));
    const __m512i y1 = _mm512_add_epi32(_mm512_shuffle_i32x4(z[2], z[3], 0x88), _mm512_shuffle_i32x4(z[2], z[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(y0, y1, 0x88), _mm512_shuffle_i32x4(y0, y1, 0xdd));
}

/* step p's codes of row w (zeros past the row; the half step K % 128 == 64 masked to its 32 bytes) */
static inline __attribute__((always_inline)) void ex_codes(const uint8_t *w, const uint8_t *wa, int64_t p, int64_t nq,
                                                           int half, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    if (p > nq || (p == nq && !half)) {
        *lo = *hi = _mm512_setzero_si512();
        return;
    }
    const __m512i wv = p == nq ? _mm512_maskz_loadu_epi8(0xffffffffull, (const void *)(w + 64 * p))
                               : _mm512_loadu_si512((const void *)(w + 64 * p));
    _mm_prefetch((const char *)(wa + 64 * p), _MM_HINT_T1);
    _mm_prefetch((const char *)(w + 64 * p + NEAR_L1), _MM_HINT_T0);
    *lo = _mm512_and_si512(wv, m4), *hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
}

/* token a's shifted lane sums of step p */
static inline __attribute__((always_inline)) __m512i ex_dot(const ex_act *a, int64_t p, __m512i lo, __m512i hi) {
    const __m512i xl = _mm512_loadu_si512((const void *)(a->q + 128 * p)), xh = _mm512_loadu_si512((const void *)(a->q + 128 * p + 64));
    const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
    return _mm512_sllv_epi32(d, _mm512_loadu_si512((const void *)(a->sh + 16 * p)));
}

/* rows [r0, r1) of y + t * ldy = L x_t for T tokens (1..4), int4, g 32 or 128 */
static inline __attribute__((always_inline)) void ex_rows(const sq_linear *L, const ex_act *a, const int T, float *y,
                                                          int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t K = L->k, N = L->n, G = L->g, ng = K / G, rb = K / 2, nq = K / 128, nb = (ng + 15) / 16;
    const int half = K % 128 != 0;
    const int64_t ahead = rows_ahead(rb, 8192), per = (ng + 15) / 16;
    float scr[16][256] __attribute__((aligned(64))); /* [row][group], each batch of 16 in lane order */
    int32_t sg[256 * 16] __attribute__((aligned(64)));  /* [group][row]: the scales' bits */
    for (int64_t c0 = r0; c0 < r1; c0 += 16) {
        const int64_t nr = r1 - c0 < 16 ? r1 - c0 : 16;
        const __mmask16 valid = rows_mask(nr);
        float zt[4][16] __attribute__((aligned(64)));
        __m512 ztv[4];
        for (int t = 0; t < T; t++) ztv[t] = _mm512_setzero_ps();
        for (int64_t gi = 0; gi < nb * 16; gi++) { /* scales group-major; zero terms: groups in order, fma(z, gsum, zt) */
            const __m512i v = gi < ng ? _mm512_maskz_loadu_epi32(valid, (const void *)(L->sz + 2 * (gi * N + c0))) : _mm512_setzero_si512();
            _mm512_store_si512((void *)(sg + 16 * gi), _mm512_slli_epi32(v, 16));
            const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)));
            for (int t = 0; t < T && gi < ng; t++) ztv[t] = _mm512_fmadd_ps(z, _mm512_set1_ps(a[t].gsum[gi]), ztv[t]);
        }
        for (int64_t b = 0; b < nb; b++) { /* the chunk's scales row-major, each batch in lane order */
            __m512i v[16];
            for (int l = 0; l < 16; l++) v[l] = _mm512_load_si512((const void *)(sg + 16 * (16 * b + (G == 32 ? 4 * (l % 4) + l / 4 : l))));
            tr16x16(v);
            for (int r = 0; r < 16; r++) _mm512_store_si512((void *)&scr[r][16 * b], v[r]);
        }
        for (int t = 0; t < T; t++) _mm512_store_ps(zt[t], ztv[t]);
        for (int64_t i = 0; i < nr; i++) {
            const int64_t n = c0 + i;
            if (c0 + 64 < N)
                for (int64_t gi = i * per; gi < (i + 1) * per && gi < ng; gi++)
                    _mm_prefetch((const char *)(L->sz + 2 * (gi * N + c0 + 48)), _MM_HINT_T0);
            const uint8_t *w = L->q + n * rb, *wa = w + ahead * rb;
            __m512 acc[4];
            for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m512i r[4];
                if (G == 32) {
                    __m512i lo[4], hi[4];
                    for (int j = 0; j < 4; j++) ex_codes(w, wa, 4 * b + j, nq, half, &lo[j], &hi[j]);
                    for (int t = 0; t < T; t++)
                        r[t] = red4x4(ex_dot(&a[t], 4 * b, lo[0], hi[0]), ex_dot(&a[t], 4 * b + 1, lo[1], hi[1]),
                                      ex_dot(&a[t], 4 * b + 2, lo[2], hi[2]), ex_dot(&a[t], 4 * b + 3, lo[3], hi[3]));
                } else {
                    __m512i z[4][4];
                    for (int j = 0; j < 4; j++) {
                        __m512i lo[4], hi[4];
                        for (int s = 0; s < 4; s++) ex_codes(w, wa, 16 * b + 4 * j + s, nq, 0, &lo[s], &hi[s]);
                        const int64_t p = 16 * b + 4 * j;
                        for (int t = 0; t < T; t++)
                            z[t][j] = red4x4(ex_dot(&a[t], p, lo[0], hi[0]), ex_dot(&a[t], p + 1, lo[1], hi[1]),
                                             ex_dot(&a[t], p + 2, lo[2], hi[2]), ex_dot(&a[t], p + 3, lo[3], hi[3]));
                    }
                    for (int t = 0; t < T; t++) r[t] = red16_of4(z[t]);
                }
                const __m512 s = _mm512_load_ps(&scr[i][16 * b]);
                for (int t = 0; t < T; t++) {
                    const __m512i S = _mm512_sub_epi32(r[t], _mm512_loadu_si512((const void *)(a[t].qs8 + 16 * b)));
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(s, _mm512_loadu_ps(a[t].c + 16 * b)), acc[t]);
                }
            }
            for (int t = 0; t < T; t++) y[t * ldy + n] = _mm512_reduce_add_ps(acc[t]) + zt[t][i];
        }
    }
}

static void ex_rows_many(const sq_linear *L, const ex_act *a, int64_t T, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    switch (T) {
    case 1: ex_rows(L, a, 1, y, ldy, r0, r1); break;
    case 2: ex_rows(L, a, 2, y, ldy, r0, r1); break;
    case 3: ex_rows(L, a, 3, y, ldy, r0, r1); break;
    default: ex_rows(L, a, 4, y, ldy, r0, r1); break;
    }
}

/* the scalar mirror: exact S per group, then the kernel's float operations in its order (per
 * lane accumulators, groups in order; _mm512_reduce_add_ps's tree: lane i + i + 8, + 4, + 2, + 1) */
static float ex_row_ref(const sq_linear *L, const ex_act *a, int64_t n) {
    const int64_t K = L->k, N = L->n, G = L->g;
    float acc[16] = {0.f}, zt = 0.f;
    for (int64_t gi = 0; gi < K / G; gi++) {
        const float s = bf(L->sz[2 * (gi * N + n)]), z = bf(L->sz[2 * (gi * N + n) + 1]);
        zt = fmaf(z, a->gsum[gi], zt);
        int32_t S = -8 * a->qsn[gi];
        for (int64_t k = gi * G; k < (gi + 1) * G; k++) {
            const int64_t b = k / 32, col = k % 32;
            const uint8_t byte = L->q[n * (K / 2) + 16 * b + col % 16];
            const int qa = a->q[128 * (b / 4) + 64 * (col / 16) + 16 * (b % 4) + col % 16];
            S += (col < 16 ? byte & 15 : byte >> 4) * qa * (1 << a->sh[16 * (b / 4) + 4 * (b % 4) + (col % 16) / 4]);
        }
        const int l = ex_lane(G, gi);
        acc[l] = fmaf((float)S, s * a->cn[gi], acc[l]);
    }
    for (int h = 8; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) acc[i] += acc[i + h];
    return acc[0] + zt;
}

static int cmpd(const void *u, const void *v) {
    const double a = *(const double *)u, b = *(const double *)v;
    return a < b ? -1 : a > b;
}

int main(int argc, char **argv) {
    const int64_t d[6] = {2048, 12288, 128, 1, 8, 15};
    int64_t v[6];
    for (int i = 0; i < 6; i++) v[i] = argc > i + 1 ? atoll(argv[i + 1]) : d[i];
    const int64_t K = v[0], N = v[1], G = v[2], T = v[3], copies = v[4], rounds = v[5];
    if ((G != 32 && G != 128) || K % G || K % 64 || K / G > 256 || N % 16 || T < 1 || T > 4 || copies < 1 || rounds < 1 || rounds > 99) {
        fprintf(stderr, "need G 32 or 128, K a multiple of G and 64 with K / G <= 256, N a multiple of 16, T 1-4, rounds 1-99\n");
        return 2;
    }
    sq_linear *L = bench_linears(copies, K, N, G, 0);
    /* activations with a few outlier channels (x20 every 97th), each token its own */
    float *x = malloc(sizeof(float) * K * T), *Y0 = malloc(sizeof(float) * N * T), *Y1 = malloc(sizeof(float) * N * T);
    for (int64_t i = 0; i < K * T; i++) x[i] = (float)(rand() % 2001 - 1000) / 1000.f * (i % 97 == 0 ? 20.f : 1.f);
    sq_act *a = acts_new(T, K);
    ex_act e[4];
    const int64_t nq = (K + 127) / 128;
    for (int64_t t = 0; t < T; t++) {
        e[t] = (ex_act){aligned_alloc(64, nq * 128), aligned_alloc(64, 64 * (nq + 1)), aligned_alloc(64, 1024), aligned_alloc(64, 1024),
                        malloc(4 * 256), malloc(4 * 256), malloc(4 * 256)};
        prep(&L[0], x + t * K, &a[t]);
        ex_quantize(x + t * K, &L[0], &e[t]);
    }
    /* checks: the kernel against its mirror (bits), both against fp64 (the A8 error) */
    ex_rows_many(&L[0], e, T, Y1, N, 0, N);
    gemv_4bit_a8quad_many_avx512(&L[0], a, T, Y0, N, 0, N);
    int64_t differ = 0;
    double e0 = 0, e1 = 0, ref = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            const float r = ex_row_ref(&L[0], &e[t], n);
            differ += memcmp(&r, &Y1[t * N + n], 4) != 0;
            const double ex = exact_row_dot(&L[0], n, x + t * K);
            e0 += (Y0[t * N + n] - ex) * (Y0[t * N + n] - ex), e1 += (Y1[t * N + n] - ex) * (Y1[t * N + n] - ex), ref += ex * ex;
        }
    double t0[99], t1[99];
    for (int64_t r = 0; r < rounds; r++)
        for (int k = 0; k < 2; k++) {
            const int arm = (int)((r + k) % 2); /* alternate which arm goes first */
            const double s = now();
            for (int64_t c = 0; c < copies; c++) {
#pragma omp parallel for schedule(static)
                for (int64_t ch = 0; ch < N / 16; ch++) {
                    if (arm == 0) gemv_4bit_a8quad_many_avx512(&L[c], a, T, Y0, N, 16 * ch, 16 * ch + 16);
                    else ex_rows_many(&L[c], e, T, Y1, N, 16 * ch, 16 * ch + 16);
                }
            }
            (arm == 0 ? t0 : t1)[r] = now() - s;
        }
    qsort(t0, rounds, sizeof(double), cmpd), qsort(t1, rounds, sizeof(double), cmpd);
    printf("K=%lld N=%lld g=%lld T=%lld copies=%lld rounds=%lld: exact vs its mirror: %lld rows differ; error vs fp64 a8 %.3g exact %.3g\n"
           "  a8quad %.3f ms [%.3f..%.3f]  exact %.3f ms [%.3f..%.3f]  exact / a8quad %.3f (medians [min..max])\n",
           (long long)K, (long long)N, (long long)G, (long long)T, (long long)copies, (long long)rounds, (long long)differ,
           sqrt(e0 / ref), sqrt(e1 / ref), t0[rounds / 2] * 1e3, t0[0] * 1e3, t0[rounds - 1] * 1e3, t1[rounds / 2] * 1e3,
           t1[0] * 1e3, t1[rounds - 1] * 1e3, t1[rounds / 2] / t0[rounds / 2]);
    return differ != 0;
}
