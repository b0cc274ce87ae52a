/* The prompt GEMM on AVX2 (Y[M, N] = X[M, K] W^T), and the tile sizes the GEMM dispatch uses.
 * Int4 (paired activations): a GEMM in register tiles of one weight row x TT tokens. The rows
 * of a block of NCB_BYTES of weights stay in L2 while every token tile passes over them, and
 * the columns go in chunks of KC_BYTES so that a tile's int8 activations stay in L1. Per 64
 * columns and token: two maddubs, an add, a madd, a convert and an FMA with the activation
 * block scales into a per-group accumulator, which one FMA per group scales by the weight
 * scale; the zero and -8 terms are added after the tiles, 8 rows at a time, from per-group
 * sums. Measured on the AVX2 box at 512 tokens (`python tools/gemmbench.py`): 1.25x the
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
#error "tile_q4_a8pair_avx2 reduces at most 4 tokens per vector"
#endif

#ifdef SQ_AVX2
/* Y[t * ldy + col] = row n of L times the activations of token t, for tokens t0..t0+T over
 * the weight groups [g0, g1) (stored, or added to what an earlier column chunk stored);
 * s = fp32 weight scales of row n [groups]; PPG = 64-column steps per group (compile-time:
 * g = 64, 128, 256), or 0 for g = 32 (a step spans two groups, g0 and g1 even) */
static inline __attribute__((always_inline)) void tile_q4_a8pair_avx2(const sq_linear *L, const sq_act *a, const float *s,
                                                            float *Y, int64_t ldy, int64_t col, int64_t n, int64_t t0,
                                                            int64_t g0, int64_t g1, int add, const int T, const int PPG,
                                                            const int LUT) {
    const __m256i tab = LUT ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(L->lut + 16 * n)))
                            : _mm256_setzero_si256(); /* lut4: the row's levels (gemv_avx2.c) */
    const int8_t *xq[TT];
    const float *xs8[TT];
    for (int t = 0; t < T; t++) xq[t] = a[t0 + t].q, xs8[t] = a[t0 + t].s8;
    const uint8_t *w = L->q + n * (L->k / 2);
    __m256 acc[TT];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t p = g0 / 2; PPG == 0 && p < g1 / 2; p++) { /* g32: two groups per step, a scale per lane */
        __m256i lo, hi, tl = tab, th = tab;
        wstep_avx2(w, p, tab, &lo, &hi, &tl, &th, LUT);
        const __m256 sv = _mm256_set_m128(_mm_set1_ps(s[2 * p + 1]), _mm_set1_ps(s[2 * p]));
        for (int t = 0; t < T; t++) {
            const __m256i d = xstep_avx2(xq[t], p, lo, hi, tl, th, LUT);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(xs8[t] + 8 * p)), sv, acc[t]);
        }
    }
    for (int64_t gi = g0; PPG > 0 && gi < g1; gi++) {
        __m256 gacc[TT];
        for (int t = 0; t < T; t++) gacc[t] = _mm256_setzero_ps();
        for (int pp = 0; pp < PPG; pp++) {
            const int64_t p = gi * PPG + pp;
            __m256i lo, hi, tl = tab, th = tab;
            wstep_avx2(w, p, tab, &lo, &hi, &tl, &th, LUT);
            for (int t = 0; t < T; t++)
                gacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(xstep_avx2(xq[t], p, lo, hi, tl, th, LUT)),
                                          _mm256_loadu_ps(xs8[t] + 8 * p), gacc[t]);
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
static inline __attribute__((always_inline)) void gemm_q4_a8pair_avx2(const sq_linear *L, const sq_act *a, int64_t M,
                                                             const float *sw, float *Y, int64_t ldy, int64_t n0,
                                                             int64_t n1, int64_t g0, int64_t g1, int add, const int PPG,
                                                             const int LUT) {
    const int64_t ng = L->k / L->g;
    int64_t t = 0;
    for (; t + TT <= M; t += TT)
        for (int64_t n = n0; n < n1; n++)
            tile_q4_a8pair_avx2(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, g0, g1, add, TT, PPG, LUT);
    for (; t < M; t++)
        for (int64_t n = n0; n < n1; n++)
            tile_q4_a8pair_avx2(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, g0, g1, add, 1, PPG, LUT);
}


static inline __attribute__((always_inline)) void gemm_q8_a8_avx2(const sq_linear *L, const sq_act *a, float *Y,
                                                                  int64_t n, int64_t t0, const int T) {
    const int64_t K = L->k, N = L->n;
    const int8_t *w = (const int8_t *)L->q + n * K;
    __m256 acc[TB];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 32 * b));
        __m256i aw = _mm256_sign_epi8(wv, wv);
        for (int t = 0; t < T; t++) {
            const sq_act *x = a + t0 + t;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
            const __m256i p = dot4_u8s8(aw, _mm256_sign_epi8(xv, wv));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ps((const __m128 *)(x->s8 + 4 * b)), acc[t]);
        }
    }
    const float sc = bf(L->sz[n]);
    for (int t = 0; t < T; t++) Y[(t0 + t) * N + n] = hsum8(acc[t]) * sc;
}
#endif
