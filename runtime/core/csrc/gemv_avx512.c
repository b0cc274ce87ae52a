/* The decode products on AVX512-VNNI: int4 and lut4 x quad int8 activations and int8 x int8 (vpdpbusd).
 * The portable reference is gemv.c; the AVX2 versions (gemv_avx2.c) take rows with more groups
 * than QUAD_MAX_GROUPS. */
#ifdef SQ_AVX512
/* The weight scales of quad step p (128 columns) from a row's fp32 group scales s: one group
 * (g >= 128; gsh = log2(g / 128)), two (g = 64, gsh -1: lanes 0-7, 8-15) or four (g = 32, gsh
 * -2: lanes 4j..4j+3 block 4p + j). */
static inline __m512 step_scales(const float *s, int gsh, int64_t p, int64_t st) { /* s[st * group] */
    if (gsh == -2)
        return _mm512_mask_blend_ps(0xff00, _mm512_mask_blend_ps(0x00f0, _mm512_set1_ps(s[st * 4 * p]), _mm512_set1_ps(s[st * (4 * p + 1)])),
                                    _mm512_mask_blend_ps(0xf000, _mm512_set1_ps(s[st * (4 * p + 2)]), _mm512_set1_ps(s[st * (4 * p + 3)])));
    if (gsh < 0) return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s[st * 2 * p]), _mm512_set1_ps(s[st * (2 * p + 1)]));
    return _mm512_set1_ps(s[st * (p >> gsh)]);
}

static inline int group_shift(int64_t G) { return G == 32 ? -2 : G == 64 ? -1 : __builtin_ctzll((uint64_t)G) - 7; }

/* One quad step p (128 columns) of one row w unpacked: its low and high nibbles, or for lut4 (LUT =
 * 1) the row's levels + 128 they pick (unsigned, as vpdpbusd wants) from tab, its 16 levels in
 * every 128-bit lane (the caller subtracts the 128 with the zero terms); the bytes `ahead` of them
 * prefetched into L2 and those NEAR_L1 on into L1 (sq_simd.h). */
static inline __attribute__((always_inline)) void quad_codes(const uint8_t *w, const uint8_t *ahead, int64_t p, __m512i tab,
                                                             __m512i *lo, __m512i *hi, const int LUT) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), wv = _mm512_loadu_si512((const void *)(w + 64 * p));
    _mm_prefetch((const char *)(ahead + 64 * p), _MM_HINT_T1);
    _mm_prefetch((const char *)(w + 64 * p + NEAR_L1), _MM_HINT_T0);
    *lo = _mm512_and_si512(wv, m4), *hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
    if (LUT) *lo = _mm512_shuffle_epi8(tab, *lo), *hi = _mm512_shuffle_epi8(tab, *hi);
}

/* the 16 lanes' integer dot products of one step's codes (lo, hi) with one token's activations
 * (xl, xh: its 128 codes of the step), each lane over the 8 columns of one activation scale, as fp32 */
static inline __attribute__((always_inline)) __m512 quad_dot(__m512i xl, __m512i xh, __m512i lo, __m512i hi) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh));
}

/* The half step after the last whole quad (K % 128 == 64, then g = 64 or 32): row w's codes of
 * blocks 4p, 4p + 1 against their quad-order activations through 256-bit VNNI, times the
 * activation scales and the weight scales s[st * group] (g = 64: the one group's scale times the
 * sum; g = 32: lanes 0-3 the next-to-last group's, 4-7 the last's, before the sum). */
static inline __attribute__((always_inline)) float half_step(const uint8_t *w, const int8_t *xq, const float *s8,
                                                             int64_t p, __m512i tab, const float *s, int64_t st,
                                                             int64_t ng, int gsh, const int LUT) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), wv = _mm256_loadu_si256((const __m256i *)(w + 64 * p));
    __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
    if (LUT) {
        const __m256i t = _mm512_castsi512_si256(tab);
        lo = _mm256_shuffle_epi8(t, lo), hi = _mm256_shuffle_epi8(t, hi);
    }
    __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(xq + 128 * p)));
    d = _mm256_dpbusd_epi32(d, hi, _mm256_loadu_si256((const __m256i *)(xq + 128 * p + 64)));
    const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_loadu_ps(s8 + 16 * p));
    if (gsh == -2) return hsum8(_mm256_mul_ps(x, _mm256_set_m128(_mm_set1_ps(s[st * (ng - 1)]), _mm_set1_ps(s[st * (ng - 2)]))));
    return hsum8(x) * s[st * (ng - 1)];
}

/* Steps [p0, p1) of R rows n.. (1 or 2) of int4 x quad int8 activations (VNNI; g 32, 64, or a
 * multiple of 128; for g >= 256, p0 and p1 on group boundaries) for T tokens (1..4), into acc[4 r +
 * t]: each step's codes unpacked once for all T, every token's arithmetic the single-token
 * product's (the batched decode step's bits are the decode step's). sc: row n's fp32 weight
 * scales, one every 16 floats (its chunk's scales are group-major: sc[16 gi + row]; row n + r's at
 * sc + r). Per 128 columns and row one 64-byte weight load, two masks, and per token two vpdpbusd,
 * a convert and two FMAs (activation scales, weight scales; g >= 256: the weight scale once per
 * group, through a group accumulator); two rows share each token's activation loads. */
static inline __attribute__((always_inline)) void span_x4_a8quad_avx512(const sq_linear *L, const sq_act *a, const int T,
                                                                        int64_t n, const float *sc, int64_t ahead,
                                                                        int64_t p0, int64_t p1, __m512 *acc, const int LUT,
                                                                        const int R) {
    const int64_t K = L->k, G = L->g, rb = K / 2;
    const uint8_t *w = L->q + n * rb, *wa = w + ahead * rb;
    __m512i tab[2], lo[2], hi[2];
    for (int r = 0; r < R; r++)
        tab[r] = LUT ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(L->lut + 16 * (n + r)))),
                                        _mm512_set1_epi8((char)0x80))
                     : _mm512_setzero_si512();
    if (G <= 128) { /* one step per scale vector: no group accumulator */
        const int gsh = group_shift(G);
        for (int64_t p = p0; p < p1; p++) {
            __m512 ws[2];
            for (int r = 0; r < R; r++) {
                quad_codes(w + r * rb, wa + r * rb, p, tab[r], &lo[r], &hi[r], LUT);
                ws[r] = step_scales(sc + r, gsh, p, 16);
            }
            for (int t = 0; t < T; t++) {
                const __m512i xl = _mm512_loadu_si512((const void *)(a[t].q + 128 * p));
                const __m512i xh = _mm512_loadu_si512((const void *)(a[t].q + 128 * p + 64));
                const __m512 s8 = _mm512_loadu_ps(a[t].s8 + 16 * p);
                for (int r = 0; r < R; r++)
                    acc[4 * r + t] = _mm512_fmadd_ps(_mm512_mul_ps(quad_dot(xl, xh, lo[r], hi[r]), s8), ws[r], acc[4 * r + t]);
            }
        }
    } else {
        const int64_t spg = G / 128;
        for (int64_t gi = p0 / spg; gi < p1 / spg; gi++) {
            __m512 gacc[8];
            for (int i = 0; i < 4 * R; i++) gacc[i] = _mm512_setzero_ps();
            for (int64_t p = gi * spg; p < (gi + 1) * spg; p++) {
                for (int r = 0; r < R; r++) quad_codes(w + r * rb, wa + r * rb, p, tab[r], &lo[r], &hi[r], LUT);
                for (int t = 0; t < T; t++) {
                    const __m512i xl = _mm512_loadu_si512((const void *)(a[t].q + 128 * p));
                    const __m512i xh = _mm512_loadu_si512((const void *)(a[t].q + 128 * p + 64));
                    const __m512 s8 = _mm512_loadu_ps(a[t].s8 + 16 * p);
                    for (int r = 0; r < R; r++)
                        gacc[4 * r + t] = _mm512_fmadd_ps(quad_dot(xl, xh, lo[r], hi[r]), s8, gacc[4 * r + t]);
                }
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++)
                    acc[4 * r + t] = _mm512_fmadd_ps(gacc[4 * r + t], _mm512_set1_ps(sc[16 * gi + r]), acc[4 * r + t]);
        }
    }
}

/* The sums of four accumulators (lanes 0, 4, 8, 12 of the result), each by one fixed tree: lane i
 * + lane i + 8, then + 4, + 2, + 1 (the pairs _mm512_reduce_add_ps forms), so a sum does not
 * depend on which accumulators share the call: 11 operations for the four where four separate
 * reductions take ~32 (docs/serving.md "Per-row sums"). */
static inline __attribute__((always_inline)) __m512 reduce4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee)); /* a8 | b8 */
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd)); /* a4 b4 c4 d4 */
    const __m512 h = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4e));
    return _mm512_add_ps(h, _mm512_permute_ps(h, 0xb1));
}

/* Row n's outputs y + t * ldy from its accumulators, the four tokens summed by one tree whatever T
 * is (a token's bits do not depend on its batch), a last half step (K % 128 == 64, then g = 64 or
 * 32) through 256-bit VNNI, and zt[16 t]: token t's zero and -8 terms */
static inline __attribute__((always_inline)) void row_end_a8quad_avx512(const sq_linear *L, const sq_act *a, const int T,
                                                                        float *y, int64_t ldy, int64_t n, const float *sc,
                                                                        const float *zt, const __m512 *acc, const int LUT) {
    const int64_t K = L->k, G = L->g, rb = K / 2, nq = K / 128, ng = K / G;
    const uint8_t *w = L->q + n * rb;
    const __m512i tab = LUT ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(L->lut + 16 * n))),
                                               _mm512_set1_epi8((char)0x80))
                            : _mm512_setzero_si512();
    const __m512 z = _mm512_setzero_ps();
    float sum[16] __attribute__((aligned(64)));
    _mm512_store_ps(sum, reduce4_ps(acc[0], T > 1 ? acc[1] : z, T > 2 ? acc[2] : z, T > 3 ? acc[3] : z));
    for (int t = 0; t < T; t++) {
        const float tl = K % 128 ? half_step(w, a[t].q, a[t].s8, nq, tab, sc, 16, ng, group_shift(G), LUT) : 0.f;
        y[t * ldy + n] = sum[4 * t] + tl + zt[16 * t];
    }
}


/* Rows [r0, r1), 16 at a time. A chunk's scales and zeros are one cache line per group
 * ([K/g, N, 2]); they are converted up front, 16 rows per vector, into group-major scales and
 * per-row zero terms, so the row loop reads only the weights and the activations. Their lines
 * (K/g streams the hardware prefetcher does not follow) are prefetched 3 chunks ahead, a few
 * per row: the same prefetches issued together at the chunk's start (2 and 3 chunks ahead)
 * stalled the weight stream behind them, 5% of the whole decode step (1.7B shape, 4
 * interleaved rounds of 3 x 64 lite steps: 42.2 -> 45.7 tok/s contended, 64.6 -> 66.7 quiet;
 * re-measure with `tools/stepbench.py ART --rows 1` on two checkouts' builds).
 * One row at a time: the weights are then one sequential stream per thread. Two rows sharing
 * the activation loads (before) interleaved two streams 1 row apart, which the prefetchers
 * followed worse: every body product of the 1.7B shape in step order (3 interleaved rounds with
 * a streaming-read probe) 27.6 -> 33.0-34.0 GB/s on one thread (probe ~41), 34 -> 40 on two
 * (probe ~49); re-measure with `tools/gemmbench.py --rows 1` on two checkouts' builds. */
static inline __attribute__((always_inline)) void chunk_x4_a8quad_avx512(const sq_linear *L, const sq_act *a, const int T,
                                                                         float *y, int64_t ldy, int64_t r0, int64_t r1,
                                                                         const int LUT) {
    const int64_t N = L->n, ng = L->k / L->g, rb = L->k / 2, nr = r1 - r0;
    const int64_t ahead = rows_ahead(rb, 8192);
    float sc[16 * QUAD_MAX_GROUPS] __attribute__((aligned(64))), zt[4][16];
    const __mmask16 valid = rows_mask(nr);
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000);
    __m512 ztv[4];
    for (int t = 0; t < T; t++) ztv[t] = _mm512_setzero_ps();
    for (int64_t gi = 0; gi < ng; gi++) {
        const uint16_t *p = L->sz + 2 * (gi * N + r0);
        const __m512i v = _mm512_maskz_loadu_epi32(valid, (const void *)p); /* (scale, zero) per row, scale low */
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), z = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
        _mm512_store_ps(sc + 16 * gi, s);
        for (int t = 0; t < T; t++)
            ztv[t] = _mm512_add_ps(ztv[t], _mm512_sub_ps(_mm512_mul_ps(z, _mm512_set1_ps(a[t].gsum[gi])),
                                                         _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(LUT ? 128.f : 8.f), s),
                                                                       _mm512_set1_ps(a[t].gqsum[gi]))));
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(zt[t], ztv[t]);
    const int64_t per = (ng + 15) / 16, nq = L->k / 128; /* scale lines of the chunk 3 on, spread over the rows */
    const int64_t spg = L->g > 128 ? L->g / 128 : 1, cap = SPAN_L1 * 2 / (3 * 128 * T); /* steps per span */
    if (T == 1 || nq <= cap || cap < spg) { /* one span: each row start to end, one sequential stream */
        for (int64_t i = 0; i < nr; i++) {
            if (r0 + 64 < N)
                for (int64_t gi = i * per; gi < (i + 1) * per && gi < ng; gi++)
                    _mm_prefetch((const char *)(L->sz + 2 * (gi * N + r0 + 48)), _MM_HINT_T0);
            __m512 acc[4];
            for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
            span_x4_a8quad_avx512(L, a, T, r0 + i, sc + i, ahead, 0, nq, acc, LUT, 1);
            row_end_a8quad_avx512(L, a, T, y, ldy, r0 + i, sc + i, zt[0] + i, acc, LUT);
        }
        return;
    }
    const int64_t span = cap / spg * spg;
    __m512 acc[16][4];
    for (int64_t i = 0; i < nr; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < nq; p0 += span) {
        const int64_t p1 = p0 + span < nq ? p0 + span : nq;
        for (int64_t i = 0; i < nr; i += 2) {
            if (p0 == 0 && r0 + 64 < N)
                for (int64_t gi = i * per; gi < (i + 2) * per && gi < ng; gi++)
                    _mm_prefetch((const char *)(L->sz + 2 * (gi * N + r0 + 48)), _MM_HINT_T0);
            /* the pair's accumulators through a local copy: acc[i] itself may alias the loads
             * in the compiler's view, which then stored them every step (down 6144 x 2048 g128,
             * M = 4, in cache 9.1 -> 11.4 GB/s) */
            __m512 ra[8];
            const int R = i + 1 < nr ? 2 : 1;
            for (int j = 0; j < 4 * R; j++) ra[j] = acc[i + j / 4][j % 4];
            if (R == 2)
                span_x4_a8quad_avx512(L, a, T, r0 + i, sc + i, ahead, p0, p1, ra, LUT, 2);
            else
                span_x4_a8quad_avx512(L, a, T, r0 + i, sc + i, ahead, p0, p1, ra, LUT, 1);
            for (int j = 0; j < 4 * R; j++) acc[i + j / 4][j % 4] = ra[j];
        }
    }
    for (int64_t i = 0; i < nr; i++) row_end_a8quad_avx512(L, a, T, y, ldy, r0 + i, sc + i, zt[0] + i, acc[i], LUT);
}

static void gemv_q4_a8quad_avx512(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    for (int64_t c = r0; c < r1; c += 16) chunk_x4_a8quad_avx512(L, a, 1, y, 0, c, c + 16 < r1 ? c + 16 : r1, 0);
}

static void gemv_l4_a8quad_avx512(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    for (int64_t c = r0; c < r1; c += 16) chunk_x4_a8quad_avx512(L, a, 1, y, 0, c, c + 16 < r1 ? c + 16 : r1, 1);
}

/* rows [r0, r1) for M tokens (outputs y + t * ldy), four tokens per pass over a chunk: its scales
 * converted and each step's codes unpacked once for the four; every token's arithmetic is the
 * single-token product's, so the same bits (batch.c) */
static void gemv_4bit_a8quad_many_avx512(const sq_linear *L, const sq_act *a, int64_t M, float *y, int64_t ldy,
                                         int64_t r0, int64_t r1) {
    const int lut = L->kind == KIND_LUT4;
    for (int64_t c = r0; c < r1; c += 16) {
        const int64_t c1 = c + 16 < r1 ? c + 16 : r1;
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const sq_act *x = a + t0;
            float *yt = y + t0 * ldy;
            switch ((M - t0 < 4 ? M - t0 : 4) * 2 + lut) {
            case 2: chunk_x4_a8quad_avx512(L, x, 1, yt, ldy, c, c1, 0); break;
            case 3: chunk_x4_a8quad_avx512(L, x, 1, yt, ldy, c, c1, 1); break;
            case 4: chunk_x4_a8quad_avx512(L, x, 2, yt, ldy, c, c1, 0); break;
            case 5: chunk_x4_a8quad_avx512(L, x, 2, yt, ldy, c, c1, 1); break;
            case 6: chunk_x4_a8quad_avx512(L, x, 3, yt, ldy, c, c1, 0); break;
            case 7: chunk_x4_a8quad_avx512(L, x, 3, yt, ldy, c, c1, 1); break;
            case 8: chunk_x4_a8quad_avx512(L, x, 4, yt, ldy, c, c1, 0); break;
            default: chunk_x4_a8quad_avx512(L, x, 4, yt, ldy, c, c1, 1); break;
            }
        }
    }
}
#endif

#ifdef SQ_AVX512
/* Int8 rows (natural activation order) with VNNI. vpdpbusd wants unsigned x signed bytes: the
 * weights go in with their sign bit flipped (w + 128) and each product starts from
 * -128 * (the sum of the activations in its lane), computed per 64 columns.
 * Lane l of 64 columns p covers columns 4(l % 8).. of block 2p + l / 8: sub-block l % 4. */
static inline __attribute__((always_inline)) void row_q8_a8_avx512(const sq_linear *L, const sq_act *a, float *y, int64_t n,
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
        _mm_prefetch((const char *)(w + ahead * K + 64 * p), _MM_HINT_T1);
        _mm_prefetch((const char *)(w + 64 * p + NEAR_L1), _MM_HINT_T0);
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
 * head alone (2 threads, 3 interleaved rounds) 56-57 -> 78 GB/s against two rows sharing the
 * activation loads (re-measure: `tools/stepbench.py ART --rows 1` on an artifact with --head int8) */
static void gemv_q8_a8_avx512(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    const int64_t ahead = rows_ahead(L->k, 8192);
    for (int64_t n = r0; n < r1; n++) row_q8_a8_avx512(L, a, y, n, ahead);
}
#endif
