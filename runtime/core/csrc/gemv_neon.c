/* The decode products (GEMV, rows [r0, r1) of y = W x) on Arm NEON with the dot product extension
 * (armv8.2-a+dotprod, sdot / vdotq_s32): int4, lut4 and int8 weights x natural-order int8
 * activations (act.c, paired = 0). rows32 is read in place: a 16-byte block's low nibbles are
 * columns 0..15 and its high nibbles 16..31, so vdotq_s32(lo, x[0..15]) then vdotq_s32(hi,
 * x[16..31]) leaves in lane i exactly sub-block i's integer sum (columns 4i..4i+3 and
 * 16+4i..16+4i+3), the lane whose activation scale is s8[4b + i]. sdot is signed x signed, so
 * int4 codes (0..15) and lut4 levels (int8, picked by one tbl) need no sign trick. The portable
 * reference is gemv.c; the prompt GEMM (gemm_neon.c) runs the same tile with T tokens. */
#ifdef SQ_NEON
/* lane i: sub-block i's exact int32 dot of one 32-column block (LUT: the codes pick tab's levels) */
static inline __attribute__((always_inline)) int32x4_t dot_4bit_blk_neon(uint8x16_t lo, uint8x16_t hi, int8x16_t tab,
                                                                        const int8_t *xb, const int LUT) {
    const int8x16_t l = LUT ? vqtbl1q_s8(tab, lo) : vreinterpretq_s8_u8(lo);
    const int8x16_t h = LUT ? vqtbl1q_s8(tab, hi) : vreinterpretq_s8_u8(hi);
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), l, vld1q_s8(xb)), h, vld1q_s8(xb + 16));
}

/* Y[t * ldy + r] = row n + r of a 4-bit L times token t's activations a[t], for R rows (1..4) and
 * T tokens (1..4). Per (row, token) the arithmetic never depends on R or T: per group one fp32
 * chain g = fma(g, float(d_b), s8_b) over its blocks, acc = fma(acc, g, s), the zero terms
 * z * gsum - 8 s * gqsum in the reference's order; so the decode step (T = 1), the batched step
 * and the prompt GEMM give a token the same bits. PF: prefetch `ahead` rows on (decode). */
static inline __attribute__((always_inline)) void tile_4bit_a8_neon(const sq_linear *L, const sq_act *a, float *Y,
                                                                   int64_t ldy, int64_t n, int64_t ahead, const int R,
                                                                   const int T, const int LUT, const int PF) {
    const int64_t K = L->k, N = L->n, bpg = L->g / 32, ng = K / L->g, rb = K / 2;
    const uint8x16_t m4 = vdupq_n_u8(15);
    const uint8_t *w[4];
    int8x16_t tab[4];
    float32x4_t acc[4][4], zt[4]; /* zt[t]: token t's zero terms, lane r for row n + r */
    for (int r = 0; r < R; r++) {
        w[r] = L->q + (n + r) * rb;
        tab[r] = LUT ? vld1q_s8(L->lut + 16 * (n + r)) : vdupq_n_s8(0);
        for (int t = 0; t < T; t++) acc[r][t] = vdupq_n_f32(0.f);
    }
    for (int t = 0; t < T; t++) zt[t] = vdupq_n_f32(0.f);
    for (int64_t gi = 0; gi < ng; gi++) {
        float32x4_t g[4][4];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) g[r][t] = vdupq_n_f32(0.f);
        for (int64_t b = gi * bpg; b < (gi + 1) * bpg; b++) {
            float32x4_t xs[4];
            for (int t = 0; t < T; t++) xs[t] = vld1q_f32(a[t].s8 + 4 * b);
            for (int r = 0; r < R; r++) {
                if (PF) __builtin_prefetch(w[r] + ahead * rb + 16 * b);
                const uint8x16_t wv = vld1q_u8(w[r] + 16 * b);
                const uint8x16_t lo = vandq_u8(wv, m4), hi = vshrq_n_u8(wv, 4);
                for (int t = 0; t < T; t++)
                    g[r][t] = vfmaq_f32(g[r][t], vcvtq_f32_s32(dot_4bit_blk_neon(lo, hi, tab[r], a[t].q + 32 * b, LUT)), xs[t]);
            }
        }
        /* the R rows' (scale, zero) as lanes: one ld2 for four rows (their pairs are adjacent) */
        float32x4_t sv, zv;
        if (R == 4) {
            const uint16x4x2_t p = vld2_u16(L->sz + 2 * (gi * N + n));
            sv = vreinterpretq_f32_u32(vshll_n_u16(p.val[0], 16)), zv = vreinterpretq_f32_u32(vshll_n_u16(p.val[1], 16));
        } else {
            float s4[4] = {0.f, 0.f, 0.f, 0.f}, z4[4] = {0.f, 0.f, 0.f, 0.f};
            for (int r = 0; r < R; r++) s4[r] = bf(L->sz[2 * (gi * N + n + r)]), z4[r] = bf(L->sz[2 * (gi * N + n + r) + 1]);
            sv = vld1q_f32(s4), zv = vld1q_f32(z4);
        }
        float s[4];
        vst1q_f32(s, sv);
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) acc[r][t] = vfmaq_n_f32(acc[r][t], g[r][t], s[r]);
        /* z gsum - (8 s) gqsum per lane: the reference's operations in its order (the same bits) */
        for (int t = 0; t < T; t++) {
            const float32x4_t zg = vmulq_n_f32(zv, a[t].gsum[gi]);
            zt[t] = vaddq_f32(zt[t], LUT ? zg : vsubq_f32(zg, vmulq_n_f32(vmulq_n_f32(sv, 8.f), a[t].gqsum[gi])));
        }
    }
    for (int t = 0; t < T; t++) {
        float z[4];
        vst1q_f32(z, zt[t]);
        for (int r = 0; r < R; r++) Y[t * ldy + r] = vaddvq_f32(acc[r][t]) + z[r];
    }
}

/* rows `ahead` of the current ones whose bytes the decode loops prefetch: ~1 KiB worth, >= 2 */
static inline int64_t rows_ahead_neon(int64_t rowbytes) {
    const int64_t r = (1024 + rowbytes - 1) / rowbytes;
    return r > 2 ? r : 2;
}

/* rows [r0, r1), one token: NEON_DECODE_ROWS rows a pass (independent fp32 chains: one row's chain
 * is one dependent fmla per 16 weight bytes, ~4 cycles, ~12 GB/s at 3 GHz; four rows share the
 * activation loads), the chunk's scales 32 rows on prefetched up front ([K/g, N, 2]: a line per
 * group every 16 rows, K/g streams the hardware prefetcher does not follow). x86 measured one
 * row at a time faster (docs/performance.md "Decode step": interleaved streams); on Arm that is
 * unmeasured: -DNEON_DECODE_ROWS=1 builds the other choice (the same bits either way). */
#ifndef NEON_DECODE_ROWS
#define NEON_DECODE_ROWS 4
#endif
static inline __attribute__((always_inline)) void rows_4bit_a8_neon(const sq_linear *L, const sq_act *a, float *y,
                                                                   int64_t r0, int64_t r1, const int LUT) {
    const int64_t N = L->n, ng = L->k / L->g, ahead = rows_ahead_neon(L->k / 2);
    for (int64_t gi = 0; gi < ng && r0 + 32 < N; gi++) __builtin_prefetch(L->sz + 2 * (gi * N + r0 + 32));
    int64_t n = r0;
    for (; n + NEON_DECODE_ROWS <= r1; n += NEON_DECODE_ROWS)
        tile_4bit_a8_neon(L, a, y + n, 0, n, ahead + NEON_DECODE_ROWS, NEON_DECODE_ROWS, 1, LUT, 1);
    for (; n < r1; n++) tile_4bit_a8_neon(L, a, y + n, 0, n, ahead, 1, 1, LUT, 1);
}

/* rows [r0, r1) for M tokens (outputs y + t * ldy; the batched decode step): two rows x up to four
 * tokens a pass, each weight block unpacked once for them; a token's bits are its single product's */
static void gemv_4bit_a8_many_neon(const sq_linear *L, const sq_act *a, int64_t M, float *y, int64_t ldy, int64_t r0,
                                   int64_t r1) {
    const int lut = L->kind == KIND_LUT4;
    for (int64_t n = r0; n < r1; n += 2)
        for (int64_t t = 0; t < M; t += 4) {
            const int R = r1 - n < 2 ? 1 : 2, T = M - t < 4 ? (int)(M - t) : 4;
            float *yt = y + t * ldy + n;
#define SQ_MANY_CASE(R_, T_) \
    case 8 * R_ + T_: \
        if (lut) tile_4bit_a8_neon(L, a + t, yt, ldy, n, 0, R_, T_, 1, 0); \
        else tile_4bit_a8_neon(L, a + t, yt, ldy, n, 0, R_, T_, 0, 0); \
        break;
            switch (8 * R + T) {
                SQ_MANY_CASE(1, 1) SQ_MANY_CASE(1, 2) SQ_MANY_CASE(1, 3) SQ_MANY_CASE(1, 4)
                SQ_MANY_CASE(2, 1) SQ_MANY_CASE(2, 2) SQ_MANY_CASE(2, 3) SQ_MANY_CASE(2, 4)
            }
#undef SQ_MANY_CASE
        }
}

static void gemv_q4_a8_neon(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    rows_4bit_a8_neon(L, a, y, r0, r1, 0);
}

static void gemv_l4_a8_neon(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    rows_4bit_a8_neon(L, a, y, r0, r1, 1);
}

/* int8 x int8, R rows (1..4) a pass: w[32b..32b+15] and w[32b+16..31] against the block's two
 * activation halves; lane i is again sub-block i */
static inline __attribute__((always_inline)) void rows_q8_a8_neon(const sq_linear *L, const sq_act *a, float *y,
                                                                 int64_t n, const int R) {
    const int64_t K = L->k;
    const int8_t *w = (const int8_t *)L->q + n * K;
    float32x4_t acc[4];
    for (int r = 0; r < R; r++) acc[r] = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < K / 32; b++) {
        const int8x16_t x0 = vld1q_s8(a->q + 32 * b), x1 = vld1q_s8(a->q + 32 * b + 16);
        const float32x4_t xs = vld1q_f32(a->s8 + 4 * b);
        for (int r = 0; r < R; r++) {
            const int8_t *wr = w + r * K + 32 * b;
            __builtin_prefetch(wr + 4 * R * K);
            const int32x4_t d = vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(wr), x0), vld1q_s8(wr + 16), x1);
            acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(d), xs);
        }
    }
    for (int r = 0; r < R; r++) y[n + r] = vaddvq_f32(acc[r]) * bf(L->sz[n + r]);
}

static void gemv_q8_a8_neon(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    int64_t n = r0;
    for (; n + 4 <= r1; n += 4) rows_q8_a8_neon(L, a, y, n, 4);
    for (; n < r1; n++) rows_q8_a8_neon(L, a, y, n, 1);
}
#endif
