/* The prompt GEMM on AVX512-VNNI: int4 and lut4 x quad int8 activations in register tiles. */
#ifdef SQ_AVX512
/* AVX512-VNNI (quad activations): register tiles of R weight rows x T tokens. Per 128 columns
 * each row's 64 weight bytes are unpacked once (and, shift, and) for all T tokens and each
 * token's activations are loaded once for all R rows; per (row, token) two vpdpbusd, a
 * convert, a multiply by the activation scales and an FMA by the row's weight scales. */
#ifndef PR /* overridable for tuning builds */
#define PR 2
#define PT 6
#endif
static inline __attribute__((always_inline)) void tile_q4_a8quad_avx512(const sq_linear *L, const sq_act *a, const float *sw,
                                                               float *Y, int64_t ldy, int64_t col, int64_t n, int64_t t0,
                                                               int64_t q0, int64_t q1, int tail, int add, const int R,
                                                               const int T, const int LUT) {
    const int64_t K = L->k, rb = K / 2, ng = K / L->g;
    const int gsh = group_shift(L->g);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const int8_t *xq[PT];
    const float *xs8[PT];
    for (int t = 0; t < T; t++) xq[t] = a[t0 + t].q, xs8[t] = a[t0 + t].s8;
    __m512 acc[PR][PT];
    __m512i tab[PR]; /* lut4: each row's levels + 128 (gemv_avx512.c) */
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
        tab[r] = LUT ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(L->lut + 16 * (n + r)))),
                                        _mm512_set1_epi8((char)0x80))
                     : _mm512_setzero_si512();
    }
    for (int64_t p = q0; p < q1; p++) {
        __m512i lo[PR], hi[PR];
        __m512 sv[PR];
        for (int r = 0; r < R; r++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(L->q + (n + r) * rb + 64 * p));
            lo[r] = _mm512_and_si512(wv, m4);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
            if (LUT) lo[r] = _mm512_shuffle_epi8(tab[r], lo[r]), hi[r] = _mm512_shuffle_epi8(tab[r], hi[r]);
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
    if (tail) /* K % 128 == 64: the last 64 columns (g = 64: one group; g = 32: two) */
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                tl[r][t] = half_step(L->q + (n + r) * rb, xq[t], xs8[t], q1, tab[r], sw + r * ng, 1, ng, gsh, LUT);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            float *o = Y + (t0 + t) * ldy + col + r;
            const float v = _mm512_reduce_add_ps(acc[r][t]) + tl[r][t];
            *o = add ? *o + v : v;
        }
}

/* Y[t * ldy + n - n0]: tiles for rows [n0, n1) and all M tokens over quad steps [q0, q1) */
static inline __attribute__((always_inline)) void gemm_x4_a8quad_avx512(const sq_linear *L, const sq_act *a, int64_t M,
                                                                        const float *sw, float *Y, int64_t ldy, int64_t n0,
                                                                        int64_t n1, int64_t q0, int64_t q1, int tail, int add,
                                                                        const int LUT) {
    const int64_t ng = L->k / L->g;
    int64_t t = 0;
    for (; t + PT <= M; t += PT) {
        int64_t n = n0;
        for (; n + PR <= n1; n += PR) tile_q4_a8quad_avx512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, PR, PT, LUT);
        for (; n < n1; n++) tile_q4_a8quad_avx512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, 1, PT, LUT);
    }
    for (; t < M; t++) {
        int64_t n = n0;
        for (; n + PR <= n1; n += PR) tile_q4_a8quad_avx512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, PR, 1, LUT);
        for (; n < n1; n++) tile_q4_a8quad_avx512(L, a, sw + (n - n0) * ng, Y, ldy, n - n0, n, t, q0, q1, tail, add, 1, 1, LUT);
    }
}

static void gemm_q4_a8quad_avx512(const sq_linear *L, const sq_act *a, int64_t M, const float *sw, float *Y, int64_t ldy,
                                  int64_t n0, int64_t n1, int64_t q0, int64_t q1, int tail, int add) {
    gemm_x4_a8quad_avx512(L, a, M, sw, Y, ldy, n0, n1, q0, q1, tail, add, 0);
}

static void gemm_l4_a8quad_avx512(const sq_linear *L, const sq_act *a, int64_t M, const float *sw, float *Y, int64_t ldy,
                                  int64_t n0, int64_t n1, int64_t q0, int64_t q1, int tail, int add) {
    gemm_x4_a8quad_avx512(L, a, M, sw, Y, ldy, n0, n1, q0, q1, tail, add, 1);
}
#endif
