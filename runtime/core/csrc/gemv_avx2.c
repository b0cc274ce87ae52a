/* The decode products (GEMV, rows [r0, r1) of y = W x) on AVX2: int4 and lut4 x paired int8
 * activations (maddubs, or vpdpbusd where VNNI is: SQ_DPBUSD256), int8 x int8 (sign trick). The
 * portable reference is gemv.c. */
#ifdef SQ_AVX2
/* one 64-column step p of a weight row (the decode products and the prompt GEMM, gemm_avx2.c): the
 * unsigned operands (lo, hi: the nibbles, or for lut4 the |levels| they pick from tab) and for
 * lut4 the levels whose signs the activations take */
static inline __attribute__((always_inline)) void wstep_avx2(const uint8_t *w, int64_t p, __m256i tab, __m256i *lo,
                                                             __m256i *hi, __m256i *tl, __m256i *th, const int LUT) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), wv = _mm256_loadu_si256((const __m256i *)(w + 32 * p));
    *lo = _mm256_and_si256(wv, m4), *hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
    if (LUT) {
        *tl = _mm256_shuffle_epi8(tab, *lo), *th = _mm256_shuffle_epi8(tab, *hi);
        *lo = _mm256_sign_epi8(*tl, *tl), *hi = _mm256_sign_epi8(*th, *th);
    }
}

/* step p of one token's paired activations xq times a wstep_avx2 result: 8 int32 sums (lanes 0-3
 * the first 32-column block, 4-7 the second; lut4: each half widened by its own madd, as two
 * products of up to 127 x 127 overflow int16 together) */
static inline __attribute__((always_inline)) __m256i xstep_avx2(const int8_t *xq, int64_t p, __m256i lo, __m256i hi,
                                                                __m256i tl, __m256i th, const int LUT) {
    const __m256i xl = _mm256_loadu_si256((const __m256i *)(xq + 64 * p));
    const __m256i xh = _mm256_loadu_si256((const __m256i *)(xq + 64 * p + 32));
#ifdef SQ_DPBUSD256 /* int32 accumulation: no int16 step, the same sums */
    if (LUT) return SQ_DPBUSD256(dot4_u8s8(lo, _mm256_sign_epi8(xl, tl)), hi, _mm256_sign_epi8(xh, th));
    return SQ_DPBUSD256(dot4_u8s8(lo, xl), hi, xh);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (LUT)
        return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_sign_epi8(xl, tl)), ones),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_sign_epi8(xh, th)), ones));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)), ones);
#endif
}

/* int4 (LUT = 0) or lut4 (LUT = 1) x paired int8 activations, one row (g32: a scale per lane), for
 * T tokens (1..4): each 64-column step's weight operands unpacked once (wstep_avx2) for all T (the
 * batched decode step, batch.c). A lut4 row's codes pick its levels by a byte shuffle (its 16 levels
 * in both lanes), multiplied with the sign trick (|t| and x with t's sign: maddubs wants an unsigned
 * operand). The bytes `ahead` rows further on are prefetched as they are read: a software stream
 * beside the hardware one. A token's arithmetic does not depend on T, so its result is the
 * single-token product's bit for bit. gT (the batched products): the T tokens' group sums
 * interleaved, [group][gsum x 4, gqsum x 4], so each group's zero terms are one 128-bit vector for
 * all T, the scalar chain's operations in its order (the same bits); NULL: the scalar chain. PPG:
 * 64-column steps per group fixed at compile time (0: L->g / 64). */
static inline __attribute__((always_inline)) void row_x4_a8pair_many_avx2(const sq_linear *L, const sq_act *a, float *y,
                                                                          int64_t ldy, int64_t n, int64_t ahead,
                                                                          const int T, const int LUT, const float *gT,
                                                                          const int PPG) {
    const int64_t K = L->k, N = L->n, G = L->g, ppg = PPG ? PPG : G / 64, ngroups = K / G, rb = K / 2;
    const __m256i tab = LUT ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(L->lut + 16 * n)))
                            : _mm256_setzero_si256();
    __m256 acc[4];
    float zt[4];
    __m128 zt4 = _mm_setzero_ps();
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), zt[t] = 0.f;
    const uint8_t *w = L->q + n * rb;
    const int8_t *xq[4];
    const float *xs[4], *xg[4], *xgq[4];
    for (int t = 0; t < T; t++) xq[t] = a[t].q, xs[t] = a[t].s8, xg[t] = a[t].gsum, xgq[t] = a[t].gqsum;
    const uint16_t *szp = L->sz + 2 * n;
    if (G == 32) {
        for (int64_t p = 0; p < K / 64; p++) {
            _mm_prefetch((const char *)(w + ahead * rb + 32 * p), _MM_HINT_T0);
            __m256i lo, hi, tl = tab, th = tab;
            wstep_avx2(w, p, tab, &lo, &hi, &tl, &th, LUT);
            const uint16_t *p0 = szp + 4 * p * N, *p1 = p0 + 2 * N;
            const float s0 = bf(p0[0]), z0 = bf(p0[1]), s1 = bf(p1[0]), z1 = bf(p1[1]);
            const __m256 sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
            for (int t = 0; t < T; t++) {
                const __m256i d = xstep_avx2(xq[t], p, lo, hi, tl, th, LUT);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(xs[t] + 8 * p)), sv, acc[t]);
            }
            if (gT) {
                const float *g0 = gT + 16 * p, *g1 = g0 + 8;
                const __m128 a0 = _mm_mul_ps(_mm_set1_ps(z0), _mm_load_ps(g0)), a1 = _mm_mul_ps(_mm_set1_ps(z1), _mm_load_ps(g1));
                zt4 = _mm_add_ps(zt4, LUT ? _mm_add_ps(a0, a1)
                                          : _mm_sub_ps(_mm_add_ps(_mm_sub_ps(a0, _mm_mul_ps(_mm_set1_ps(8.f * s0), _mm_load_ps(g0 + 4))), a1),
                                                       _mm_mul_ps(_mm_set1_ps(8.f * s1), _mm_load_ps(g1 + 4))));
            } else
                for (int t = 0; t < T; t++)
                    zt[t] += LUT ? z0 * xg[t][2 * p] + z1 * xg[t][2 * p + 1]
                                 : z0 * xg[t][2 * p] - 8.f * s0 * xgq[t][2 * p] + z1 * xg[t][2 * p + 1] -
                                       8.f * s1 * xgq[t][2 * p + 1];
        }
        if (gT) _mm_storeu_ps(zt, zt4);
        for (int t = 0; t < T; t++) y[t * ldy + n] = hsum8(acc[t]) + zt[t];
        return;
    }
    for (int64_t gi = 0; gi < ngroups; gi++) {
        __m256 gacc[4];
        for (int t = 0; t < T; t++) gacc[t] = _mm256_setzero_ps();
        for (int64_t pp = 0; pp < ppg; pp++) {
            const int64_t p = gi * ppg + pp;
            _mm_prefetch((const char *)(w + ahead * rb + 32 * p), _MM_HINT_T0);
            __m256i lo, hi, tl = tab, th = tab;
            wstep_avx2(w, p, tab, &lo, &hi, &tl, &th, LUT);
            for (int t = 0; t < T; t++)
                gacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(xstep_avx2(xq[t], p, lo, hi, tl, th, LUT)),
                                          _mm256_loadu_ps(xs[t] + 8 * p), gacc[t]);
        }
        const uint16_t *p = szp + 2 * gi * N;
        const float s = bf(p[0]), z = bf(p[1]);
        for (int t = 0; t < T; t++) acc[t] = _mm256_fmadd_ps(gacc[t], _mm256_set1_ps(s), acc[t]);
        if (gT) {
            const __m128 zg = _mm_mul_ps(_mm_set1_ps(z), _mm_load_ps(gT + 8 * gi));
            zt4 = _mm_add_ps(zt4, LUT ? zg : _mm_sub_ps(zg, _mm_mul_ps(_mm_set1_ps(8.f * s), _mm_load_ps(gT + 8 * gi + 4))));
        } else
            for (int t = 0; t < T; t++) zt[t] += LUT ? z * xg[t][gi] : z * xg[t][gi] - 8.f * s * xgq[t][gi];
    }
    if (gT) _mm_storeu_ps(zt, zt4);
    for (int t = 0; t < T; t++) y[t * ldy + n] = hsum8(acc[t]) + zt[t];
}

/* one row, one token (the decode step) */
static inline __attribute__((always_inline)) void row_x4_a8pair_avx2(const sq_linear *L, const sq_act *a, float *y,
                                                                     int64_t n, int64_t ahead, const int LUT) {
    row_x4_a8pair_many_avx2(L, a, y, 0, n, ahead, 1, LUT, NULL, 0);
}

/* Rows [r0, r1) (one 16-row chunk of the products loop). Decode streams every weight once, so
 * this is about keeping DRAM busy: one row at a time with the bytes of the row 1 KiB further on
 * prefetched (at least 2 rows), and the scales/zeros of the chunk 32 rows on prefetched up
 * front -- they are [K/g, N, 2], one cache line per group every 16 rows, K/g streams that the
 * hardware prefetcher does not follow. Measured, whole decode step (median of 32 steps,
 * interleaved builds, 2-3 rounds): Qwen3-1.7B shape 8.9-10.5 tok/s with the previous 4 rows at a
 * time and a one-block prefetch, 10.3-11.2 one row with 2 rows ahead, 11.2-13.7 adding the
 * scale prefetch; example 88-105 -> 97-105 (2 rows ahead) / 100-111 (4 rows = 1152 bytes). */
static inline __attribute__((always_inline)) void rows_x4_a8pair_avx2(const sq_linear *L, const sq_act *a, float *y,
                                                                      int64_t r0, int64_t r1, const int LUT) {
    const int64_t N = L->n, ng = L->k / L->g, rb = L->k / 2;
    const int64_t ahead = rows_ahead(rb, 1024);
    for (int64_t gi = 0; gi < ng && r0 + 32 < N; gi++)
        _mm_prefetch((const char *)(L->sz + 2 * (gi * N + r0 + 32)), _MM_HINT_T0);
    for (int64_t n = r0; n < r1; n++) row_x4_a8pair_avx2(L, a, y, n, ahead, LUT);
}

/* rows [r0, r1) for M tokens (outputs y + t * ldy), four tokens per pass over a row. The four
 * tokens' group sums are interleaved first ([group][gsum x 4, gqsum x 4], one vector of zero
 * terms per group for all four: the scalar chain's arithmetic lane by lane, so the same bits),
 * and g128's steps per group fixed at compile time. Measured (tools/gemvbench.c, docs/serving.md):
 * 1.2x at M = 4 on Zen 3, where the per-group scalar work sat beside the one integer-multiply
 * pipe's maddubs/madd. */
#define GT_MAX 768 /* groups x 4-token blocks the stack table holds (24 KiB); beyond it, scalar */
static void gemv_4bit_a8pair_many_avx2(const sq_linear *L, const sq_act *a, int64_t M, float *y, int64_t ldy,
                                       int64_t r0, int64_t r1) {
    const int64_t N = L->n, ng = L->k / L->g, rb = L->k / 2, ahead = rows_ahead(rb, 1024), nb4 = (M + 3) / 4;
    const int lut = L->kind == KIND_LUT4;
    for (int64_t gi = 0; gi < ng && r0 + 32 < N; gi++)
        _mm_prefetch((const char *)(L->sz + 2 * (gi * N + r0 + 32)), _MM_HINT_T0);
    float gTs[8 * GT_MAX] __attribute__((aligned(16)));
    float *gT0 = ng * nb4 <= GT_MAX ? gTs : NULL;
    if (gT0)
        for (int64_t b = 0; b < nb4; b++)
            for (int64_t t = 0; t < 4; t++) {
                float *g = gT0 + 8 * b * ng + t;
                if (4 * b + t < M) {
                    const float *gs = a[4 * b + t].gsum, *gq = a[4 * b + t].gqsum;
                    for (int64_t gi = 0; gi < ng; gi++) g[8 * gi] = gs[gi], g[8 * gi + 4] = gq[gi];
                } else
                    for (int64_t gi = 0; gi < ng; gi++) g[8 * gi] = g[8 * gi + 4] = 0.f;
            }
    const int g128 = L->g == 128;
    for (int64_t n = r0; n < r1; n++)
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const sq_act *x = a + t0;
            float *yt = y + t0 * ldy;
            const float *gT = gT0 ? gT0 + 8 * (t0 / 4) * ng : NULL;
#define SQ_MANY_CASE(T, LUT) \
    case 2 * T + LUT: \
        if (g128) row_x4_a8pair_many_avx2(L, x, yt, ldy, n, ahead, T, LUT, gT, 2); \
        else row_x4_a8pair_many_avx2(L, x, yt, ldy, n, ahead, T, LUT, gT, 0); \
        break;
            switch ((M - t0 < 4 ? M - t0 : 4) * 2 + lut) {
                SQ_MANY_CASE(1, 0) SQ_MANY_CASE(1, 1) SQ_MANY_CASE(2, 0) SQ_MANY_CASE(2, 1)
                SQ_MANY_CASE(3, 0) SQ_MANY_CASE(3, 1) SQ_MANY_CASE(4, 0) SQ_MANY_CASE(4, 1)
            }
#undef SQ_MANY_CASE
        }
}

static void gemv_q4_a8pair_avx2(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    rows_x4_a8pair_avx2(L, a, y, r0, r1, 0);
}

static void gemv_l4_a8pair_avx2(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    rows_x4_a8pair_avx2(L, a, y, r0, r1, 1);
}

static inline __attribute__((always_inline)) void row_q8_a8_avx2(const sq_linear *L, const sq_act *a, float *y, int64_t n,
                                                             const int R) {
    const int64_t K = L->k;
    const int8_t *w = (const int8_t *)L->q + n * K;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + 32 * b));
        const __m256 xs = _mm256_broadcast_ps((const __m128 *)(a->s8 + 4 * b)); /* lanes i, i + 4: sub-block i */
        for (int r = 0; r < R; r++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * K + 32 * b));
            _mm_prefetch((const char *)(w + (r + 2 * R) * K + 32 * b), _MM_HINT_T0); /* two rows ahead */
            const __m256i p = dot4_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), xs, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[n + r] = hsum8(acc[r]) * bf(L->sz[n + r]);
}

static __attribute__((unused)) void gemv_q8_a8_avx2(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    /* one row at a time: measured 2x faster than 2 or 4 rows sharing the activation loads */
    for (int64_t n = r0; n < r1; n++) row_q8_a8_avx2(L, a, y, n, 1);
}
#endif
