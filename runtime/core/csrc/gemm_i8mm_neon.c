/* The prompt GEMM's tiles on Arm I8MM (armv8.2-a+i8mm: smmla / vmmlaq_s32, a 2x8 by 8x2 int8
 * product into a 2x2 int32 block), included by gemm_neon.c on the neon-i8mm build.
 * The 8 columns of one smmla must share an activation scale: one sub-block (act.c: columns 4i..4i+3
 * and 16+4i..16+4i+3 of a 32-column block). rows32 is read in place: a row's block unpacks to lo
 * (columns 0..15) and hi (16..31); zip1/zip2 of 32-bit lanes put [lo 4i..4i+3 | hi 4i..4i+3] side by
 * side (one sub-block, 8 bytes), and a 64-bit zip pairs two rows in one operand. The activations
 * are packed once per call in the same order, two tokens per operand, with their scales laid out
 * as the 2x2 result's lanes: [t0 r0, t0 r1, t1 r0, t1 r1]. Tiles: 4 rows x 8 tokens. Every (row,
 * token) result is one lane with its own fp32 chain, so a token's result does not depend on the
 * tokens sharing its tile; it differs from the decode product (gemv_neon.c) in summation order only. */
#ifdef SQ_I8MM
static inline int8x16_t zip1_32_s8(int8x16_t a, int8x16_t b) {
    return vreinterpretq_s8_s32(vzip1q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b)));
}
static inline int8x16_t zip2_32_s8(int8x16_t a, int8x16_t b) {
    return vreinterpretq_s8_s32(vzip2q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b)));
}
static inline int8x16_t zip1_64_s8(int8x16_t a, int8x16_t b) {
    return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}
static inline int8x16_t zip2_64_s8(int8x16_t a, int8x16_t b) {
    return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
}

/* 128 bytes per token pair and 32-column block: 4 x 16 code bytes (sub-block i: [t0 | t1], 8 each),
 * then 4 x 4 scales (sub-block i: t0, t0, t1, t1). An odd M's last pair has a zero token. NULL: OOM. */
static void *i8mm_pack(const sq_linear *L, const sq_act *a, int64_t M) {
    const int64_t nb = L->k / 32, np = (M + 1) / 2;
    uint8_t *pk = alloc64((size_t)(np * nb * 128));
    if (!pk) return NULL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < np; p++) {
        const sq_act *x0 = a + 2 * p, *x1 = 2 * p + 1 < M ? x0 + 1 : NULL;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = pk + (p * nb + b) * 128;
            const int8x16_t z = vdupq_n_s8(0);
            const int8x16_t a0 = vld1q_s8(x0->q + 32 * b), a1 = vld1q_s8(x0->q + 32 * b + 16);
            const int8x16_t b0 = x1 ? vld1q_s8(x1->q + 32 * b) : z, b1 = x1 ? vld1q_s8(x1->q + 32 * b + 16) : z;
            const int8x16_t p01 = zip1_32_s8(a0, a1), p23 = zip2_32_s8(a0, a1); /* [sb0 | sb1], [sb2 | sb3] */
            const int8x16_t q01 = zip1_32_s8(b0, b1), q23 = zip2_32_s8(b0, b1);
            vst1q_s8((int8_t *)o, zip1_64_s8(p01, q01));
            vst1q_s8((int8_t *)o + 16, zip2_64_s8(p01, q01));
            vst1q_s8((int8_t *)o + 32, zip1_64_s8(p23, q23));
            vst1q_s8((int8_t *)o + 48, zip2_64_s8(p23, q23));
            float *s = (float *)(o + 64);
            for (int i = 0; i < 4; i++) {
                const float s0 = x0->s8[4 * b + i], s1 = x1 ? x1->s8[4 * b + i] : 0.f;
                s[4 * i] = s[4 * i + 1] = s0, s[4 * i + 2] = s[4 * i + 3] = s1;
            }
        }
    }
    return pk;
}

/* Y[t * ldy + r] for rows n + r (r < nrows <= 4) and tokens t0 .. t0 + 2 TP (those < M; t0 even) */
static inline __attribute__((always_inline)) void tile_4bit_a8_i8mm(const sq_linear *L, const sq_act *a, const uint8_t *pk,
                                                                   int64_t M, float *Y, int64_t ldy, int64_t n,
                                                                   int64_t nrows, int64_t t0, const int TP, const int LUT) {
    const int64_t K = L->k, N = L->n, bpg = L->g / 32, ng = K / L->g, nb = K / 32, rb = K / 2;
    const uint8x16_t m4 = vdupq_n_u8(15);
    const uint8_t *w[4];
    int8x16_t tab[4];
    int64_t row[4];
    for (int r = 0; r < 4; r++) { /* rows past the block's end repeat row n and are not stored */
        row[r] = r < nrows ? n + r : n;
        w[r] = L->q + row[r] * rb;
        tab[r] = LUT ? vld1q_s8(L->lut + 16 * row[r]) : vdupq_n_s8(0);
    }
    const uint8_t *pp = pk + (t0 / 2) * nb * 128;
    float32x4_t acc[2][4];
    float zt[8][4] __attribute__((aligned(16))); /* token t's zero terms, lane r for row n + r */
    for (int rp = 0; rp < 2; rp++)
        for (int tp = 0; tp < TP; tp++) acc[rp][tp] = vdupq_n_f32(0.f);
    for (int t = 0; t < 2 * TP; t++) vst1q_f32(zt[t], vdupq_n_f32(0.f));
    for (int64_t gi = 0; gi < ng; gi++) {
        float32x4_t g[2][4];
        for (int rp = 0; rp < 2; rp++)
            for (int tp = 0; tp < TP; tp++) g[rp][tp] = vdupq_n_f32(0.f);
        for (int64_t b = gi * bpg; b < (gi + 1) * bpg; b++) {
            int8x16_t B[2][4]; /* row pair rp, sub-block i: [row 2rp | row 2rp + 1], 8 bytes each */
            for (int rp = 0; rp < 2; rp++) {
                int8x16_t lo[2], hi[2];
                for (int j = 0; j < 2; j++) {
                    const uint8x16_t wv = vld1q_u8(w[2 * rp + j] + 16 * b);
                    const uint8x16_t l = vandq_u8(wv, m4), h = vshrq_n_u8(wv, 4);
                    lo[j] = LUT ? vqtbl1q_s8(tab[2 * rp + j], l) : vreinterpretq_s8_u8(l);
                    hi[j] = LUT ? vqtbl1q_s8(tab[2 * rp + j], h) : vreinterpretq_s8_u8(h);
                }
                int8x16_t p = zip1_32_s8(lo[0], hi[0]), q = zip1_32_s8(lo[1], hi[1]);
                B[rp][0] = zip1_64_s8(p, q), B[rp][1] = zip2_64_s8(p, q);
                p = zip2_32_s8(lo[0], hi[0]), q = zip2_32_s8(lo[1], hi[1]);
                B[rp][2] = zip1_64_s8(p, q), B[rp][3] = zip2_64_s8(p, q);
            }
            for (int tp = 0; tp < TP; tp++) {
                const uint8_t *xb = pp + (tp * nb + b) * 128;
                for (int i = 0; i < 4; i++) {
                    const int8x16_t A = vld1q_s8((const int8_t *)xb + 16 * i);
                    const float32x4_t S = vld1q_f32((const float *)(xb + 64) + 4 * i);
                    for (int rp = 0; rp < 2; rp++)
                        g[rp][tp] = vfmaq_f32(g[rp][tp], vcvtq_f32_s32(vmmlaq_s32(vdupq_n_s32(0), A, B[rp][i])), S);
                }
            }
        }
        /* the 4 rows' (scale, zero) as lanes: one ld2 where all 4 are rows of the block */
        float32x4_t sv, zv;
        if (nrows == 4) {
            const uint16x4x2_t p = vld2_u16(L->sz + 2 * (gi * N + n));
            sv = vreinterpretq_f32_u32(vshll_n_u16(p.val[0], 16)), zv = vreinterpretq_f32_u32(vshll_n_u16(p.val[1], 16));
        } else {
            float s4[4], z4[4];
            for (int r = 0; r < 4; r++) s4[r] = bf(L->sz[2 * (gi * N + row[r])]), z4[r] = bf(L->sz[2 * (gi * N + row[r]) + 1]);
            sv = vld1q_f32(s4), zv = vld1q_f32(z4);
        }
        for (int rp = 0; rp < 2; rp++) { /* lanes t0r0 t0r1 t1r0 t1r1: row pair rp's scales twice */
            const float32x2_t s2 = rp ? vget_high_f32(sv) : vget_low_f32(sv);
            for (int tp = 0; tp < TP; tp++) acc[rp][tp] = vfmaq_f32(acc[rp][tp], g[rp][tp], vcombine_f32(s2, s2));
        }
        const float32x4_t s8v = vmulq_n_f32(sv, 8.f);
        for (int t = 0; t < 2 * TP && t0 + t < M; t++) { /* z gsum - (8 s) gqsum, the reference's order */
            const float32x4_t zg = vmulq_n_f32(zv, a[t0 + t].gsum[gi]);
            vst1q_f32(zt[t], vaddq_f32(vld1q_f32(zt[t]), LUT ? zg : vsubq_f32(zg, vmulq_n_f32(s8v, a[t0 + t].gqsum[gi]))));
        }
    }
    for (int rp = 0; rp < 2; rp++)
        for (int tp = 0; tp < TP; tp++) {
            float v[4];
            vst1q_f32(v, acc[rp][tp]);
            for (int j = 0; j < 4; j++) {
                const int r = 2 * rp + (j & 1), t = 2 * tp + (j >> 1);
                if (r < nrows && t0 + t < M) Y[(t0 + t) * ldy + r] = v[j] + zt[t][r];
            }
        }
}

/* rows [n0, n1) for all M tokens into Yw (token t's row at Yw + t * ldy, column n - n0) */
static void gemm_4bit_block_i8mm(const sq_linear *L, const sq_act *a, const void *pk, int64_t M, float *Yw, int64_t ldy,
                                 int64_t n0, int64_t n1) {
    const int lut = L->kind == KIND_LUT4;
    for (int64_t t0 = 0; t0 < M; t0 += 8) {
        const int TP = M - t0 >= 8 ? 4 : (int)((M - t0 + 1) / 2);
        for (int64_t n = n0; n < n1; n += 4) {
            const int64_t nr = n1 - n < 4 ? n1 - n : 4;
            float *y = Yw + (n - n0);
#define SQ_I8MM_CASE(TP_) \
    case TP_: \
        if (lut) tile_4bit_a8_i8mm(L, a, pk, M, y, ldy, n, nr, t0, TP_, 1); \
        else tile_4bit_a8_i8mm(L, a, pk, M, y, ldy, n, nr, t0, TP_, 0); \
        break;
            switch (TP) { SQ_I8MM_CASE(1) SQ_I8MM_CASE(2) SQ_I8MM_CASE(3) SQ_I8MM_CASE(4) }
#undef SQ_I8MM_CASE
        }
    }
}
#endif
