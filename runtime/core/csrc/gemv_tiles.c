/* The batched decode step's products on AMX-INT8 tiles (opt-in: sq_batch_tiles), int4 and lut4
 * linears, written once against the T_* tile macros and compiled twice (gemv_amx.c): over the
 * portable tile model (every build; the tests' reference) and over the hardware tiles (amx build).
 *
 *   tokens   15-bit activations as two int8 halves (a16_pack, in prep): per token and weight
 *            group a scale c = max|x| / A16_Q and codes q = round(x / c) in [-A16_Q, A16_Q],
 *            q = 128 hi + lo (hi -128..127, lo 0..127: both signed bytes), so one B tile holds
 *            8 tokens: columns 0-7 their hi, 8-15 their lo, in B-tile order
 *            [token block of 8][K / W steps][W / 4 rows][16 columns][4], W = min(g, 64).
 *   weights  A tiles: 16 rows x W codes per step (int4: 0..15; lut4: the row's level + 128),
 *            staged from the mapping a group of 32 rows at a time, just before its tile
 *            instructions (so they read L1); never repacked.
 *   sums     per group, exact (wrapping) int32, one TDPBUSD per A tile and step:
 *            S = 128 C[hi] + C[lo] - off * sum(q) (off 8 for int4's q - 8, 128 for lut4's level +
 *            128), then per (row n, token t), groups in order: acc = fma((float) S, s[g,n] *
 *            c[t,g], acc) and zt = fma(z[g,n], gsum[t,g], zt) (gsum: the group's fp32 sum of x,
 *            a16_sum's order); y = acc + zt.
 * A token's result depends on its own B-tile columns only, so within this path a sequence's bits
 * do not depend on the others in its step; they are not the default products' (W4A8, one int8
 * scale per 8 columns: act.c), which is why the path is opt-in (docs/serving.md "Tiles").
 * A step position p of a W-column step holds column 32 (p' / 16) + p' % 16 (+ 16 for the high
 * nibbles: p >= W / 2, p' = p - W / 2): the low nibbles of the step's W / 2 code bytes, then the
 * high ones, so staging one row is two masks. */
#ifndef SQ_GEMV_TILES_COMMON
#define SQ_GEMV_TILES_COMMON
#define A16_Q 16383      /* activation codes |q| <= A16_Q: every group sum fits int32 (g <= 512) */
#define A16_TB 8         /* tokens per B tile (each two columns) */
#define A16_MAX_G 256    /* the format's largest group (formats/constants.py GROUP_SIZES) */
#define A16_PASS 8       /* token blocks (64 tokens) per pass over the weights */

/* the step's shared 15-bit activations (one per batch workspace, sq_batch_new) */
typedef struct sq_a16 {
    int64_t rows, maxk; /* tokens and columns it has room for */
    int64_t m;          /* tokens in the current step (sq_step_many sets it) */
    int8_t *b;          /* [rows / 8][maxk * 16] B tiles */
    float *c, *gsum;    /* [rows / 8][maxk / 32][8]: scale, fp32 sum of x, per group and token */
    int32_t *qs;        /* [rows / 8][maxk / 32][8]: sum of the codes */
} sq_a16;

static int64_t a16_min_m; /* sq_batch_tiles: the fewest sequences whose step takes the tiles, 0 off */
static int a16_hw;        /* 1: hardware tiles, 0: the tile model */

/* linears the path takes: 4-bit codes, groups of 32 or a multiple of 64 up to A16_MAX_G */
static inline int a16_linear(const sq_linear *L) {
    return is_q4(L) && (L->g == 32 || L->g % 64 == 0) && L->g <= A16_MAX_G;
}

/* whether this step's products of L run on the tiles */
static inline int a16_on(const sq_linear *L, const sq_a16 *ti, int64_t M) {
    return ti && a16_min_m > 0 && M >= a16_min_m && ti->m == M && M <= ti->rows && L->k <= ti->maxk && a16_linear(L);
}

static void a16_free(sq_a16 *ti) {
    if (!ti) return;
    free(ti->b); free(ti->c); free(ti->gsum); free(ti->qs);
    free(ti);
}

static sq_a16 *a16_new(int64_t rows, int64_t maxk) {
    sq_a16 *ti = calloc(1, sizeof(sq_a16));
    if (!ti) return NULL;
    const int64_t nb = (rows + A16_TB - 1) / A16_TB, ng = (maxk + 31) / 32;
    ti->rows = nb * A16_TB, ti->maxk = maxk;
    ti->b = alloc64(nb * maxk * 16);
    ti->c = alloc64(sizeof(float) * nb * ng * 8), ti->gsum = alloc64(sizeof(float) * nb * ng * 8);
    ti->qs = alloc64(sizeof(int32_t) * nb * ng * 8);
    if (!(ti->b && ti->c && ti->gsum && ti->qs)) {
        a16_free(ti);
        return NULL;
    }
    /* zeros: the columns of tokens a step does not fill are computed and dropped, and garbage
     * there could be denormal scales (each a microcode assist in the epilogue's FMAs) */
    memset(ti->b, 0, nb * maxk * 16);
    memset(ti->c, 0, sizeof(float) * nb * ng * 8);
    memset(ti->gsum, 0, sizeof(float) * nb * ng * 8);
    memset(ti->qs, 0, sizeof(int32_t) * nb * ng * 8);
    return ti;
}

/* the step position of column kc of a W-column step (the header's order, inverted) */
static inline int64_t a16_pos(int64_t kc, int64_t W) {
    const int64_t blk = kc / 32, j = kc % 32;
    return j < 16 ? 16 * blk + j : W / 2 + 16 * blk + j - 16;
}

/* the offset of token block tb's group scales / sums in sq_a16.c, gsum, qs */
static inline int64_t a16_goff(const sq_a16 *ti, int64_t tb) { return tb * ((ti->maxk + 31) / 32) * 8; }
/* a16_pack's group sum: 16 lanes (lane j: columns j, j + 16, ... in order), then lanes i + 8,
 * + 4, + 2, + 1 (the AVX512 version's order) */
static inline float a16_sum(const float *x, int64_t G) {
    float l[16] = {0.f};
    for (int64_t k = 0; k < G; k++) l[k % 16] += x[k];
    for (int h = 8; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) l[i] += l[i + h];
    return l[0];
}

/* token t's x [K] -> its two columns of the B tiles, scales and sums (for L's groups) */
static __attribute__((unused)) void a16_pack_c(const sq_linear *L, const float *x, sq_a16 *ti, int64_t t) {
    const int64_t K = L->k, G = L->g, W = G < 64 ? G : 64, tb = t / A16_TB, col = t % A16_TB;
    int8_t *bt = ti->b + tb * ti->maxk * 16;
    const int64_t gb = a16_goff(ti, tb);
    for (int64_t gi = 0; gi < K / G; gi++) {
        const float *xg = x + gi * G;
        float amax = 0.f;
        for (int64_t k = 0; k < G; k++) amax = fabsf(xg[k]) > amax ? fabsf(xg[k]) : amax;
        const float inv = amax > 0.f ? (float)A16_Q / amax : 0.f;
        int32_t qsum = 0;
        for (int64_t k = 0; k < G; k++) {
            long q = lrintf(xg[k] * inv);
            q = q > A16_Q ? A16_Q : q < -A16_Q ? -A16_Q : q;
            qsum += (int32_t)q;
            const int64_t kk = gi * G + k, p = a16_pos(kk % W, W);
            const int64_t o = (kk / W) * 16 * W + (p / 4) * 64 + col * 4 + p % 4;
            bt[o] = (int8_t)(q >> 7);       /* hi: floor(q / 128) */
            bt[o + 32] = (int8_t)(q & 127); /* lo, column col + 8 */
        }
        ti->c[gb + gi * 8 + col] = amax / (float)A16_Q;
        ti->gsum[gb + gi * 8 + col] = a16_sum(xg, G);
        ti->qs[gb + gi * 8 + col] = qsum;
    }
}

/* group gi of the 32 rows at n0 (nv of them in L) -> wa [2 halves][G / W steps][16 rows][W]
 * (rows >= nv zero), just before its tile instructions: the A tiles are read from L1 (staged a
 * whole row block ahead, they came from L2, and those tile loads neither kept pace nor overlapped
 * the weight stream: docs/serving.md "Tiles") */
static void a16_stage_c(const sq_linear *L, int64_t n0, int64_t nv, int64_t gi, uint8_t *wa) {
    const int64_t K = L->k, G = L->g, W = G < 64 ? G : 64;
    const int lut = L->kind == KIND_LUT4;
    for (int64_t r = 0; r < (nv > 16 ? 32 : 16); r++) /* rows 16-31 only where the block has them */
        for (int64_t s = 0; s < G / W; s++) {
            uint8_t *o = wa + (r / 16) * 16 * G + (s * 16 + r % 16) * W;
            if (r >= nv) {
                memset(o, 0, W);
                continue;
            }
            const int64_t n = n0 + r;
            const uint8_t *w = L->q + n * (K / 2) + gi * G / 2 + s * W / 2;
            for (int64_t i = 0; i < W / 2; i++) {
                const int l = w[i] & 15, h = w[i] >> 4;
                o[i] = lut ? (uint8_t)(L->lut[16 * n + l] + 128) : (uint8_t)l;
                o[W / 2 + i] = lut ? (uint8_t)(L->lut[16 * n + h] + 128) : (uint8_t)h;
            }
        }
}

/* the calling thread's buffer of at least `bytes` for a block's scales (kept between calls;
 * a16_release frees it) */
static _Thread_local uint8_t *a16_buf;
static _Thread_local int64_t a16_buf_bytes;

static uint8_t *a16_buf_get(int64_t bytes) {
    if (bytes > a16_buf_bytes) {
        free(a16_buf);
        a16_buf = alloc64(bytes);
        a16_buf_bytes = a16_buf ? bytes : 0;
    }
    return a16_buf;
}

/* a block's weight scales and zeros as fp32, group-major: [ng][32] of rows n0.. (rows past the
 * block's nv as zeros) */
static void a16_scales(const sq_linear *L, int64_t n0, int64_t nv, float *sc, float *zr) {
    for (int64_t gi = 0; gi < L->k / L->g; gi++)
        for (int64_t r = 0; r < 32; r++) {
            const uint16_t *p = L->sz + 2 * (gi * L->n + n0 + r);
            sc[gi * 32 + r] = r < nv ? bf(p[0]) : 0.f;
            zr[gi * 32 + r] = r < nv ? bf(p[1]) : 0.f;
        }
}

/* one group's sums cb (a C tile: 16 rows x (8 tokens' hi, their lo)) into acc [16 rows][8
 * tokens]; sc: the rows' scales in the group; c, qs: the group's 8 tokens' scales and code sums */
static void a16_epi_c(const sq_linear *L, int64_t nr, const int32_t *cb, const float *sc, const float *c,
                      const int32_t *qs, float *acc) {
    const uint32_t off = L->kind == KIND_LUT4 ? 128u : 8u;
    for (int64_t r = 0; r < nr; r++)
        for (int t = 0; t < A16_TB; t++) {
            const uint32_t S = (uint32_t)cb[r * 16 + t] * 128u + (uint32_t)cb[r * 16 + 8 + t] - off * (uint32_t)qs[t];
            acc[r * 8 + t] = fmaf((float)(int32_t)S, sc[r] * c[t], acc[r * 8 + t]);
        }
}

/* y [t][r] = acc + the zero terms (groups in order: zt = fma(z, gsum, zt)), tokens t < nt; zr:
 * the rows' zeros [ng][32], gs: the tokens' group sums [ng][8] */
static void a16_out_c(const sq_linear *L, int64_t nr, int64_t nt, const float *zr, const float *gs, const float *acc,
                      float *y, int64_t ldy) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t t = 0; t < nt; t++) {
            float zt = 0.f;
            for (int64_t gi = 0; gi < L->k / L->g; gi++) zt = fmaf(zr[gi * 32 + r], gs[gi * 8 + t], zt);
            y[t * ldy + r] = acc[r * 8 + t] + zt;
        }
}

/* tiles 0-3: C (16 rows x 16 int32: rows 0-15 x token blocks 0, 1; rows 16-31 x blocks 0, 1);
 * 4 and 7: A (16 rows x 64, or 32, bytes: rows 0-15, 16-31); 5, 6: B (16, or 8, rows x 64 bytes:
 * token blocks 0, 1). Static: gcc 12 can drop stores to a local config. */
static const sq_tilecfg A16_CFG64 __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0}, {16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0}};
static const sq_tilecfg A16_CFG32 __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 32, 64, 64, 32, 0, 0, 0, 0, 0, 0, 0, 0}, {16, 16, 16, 16, 16, 8, 8, 16, 0, 0, 0, 0, 0, 0, 0, 0}};
#endif /* SQ_GEMV_TILES_COMMON */

#ifdef T_FN

/* rows [r0, r1) of Y[t] = L x_t for the step's M tokens (Y + t * ldy): blocks of 32 rows (two A
 * tiles, staged a group at a time) x pairs of token blocks of 8 (two B tiles): 4 C tiles; up to
 * A16_PASS token blocks per pass over the weights */
static void T_FN(many_q4_a16)(const sq_linear *L, const sq_a16 *ti, int64_t M, float *Y, int64_t ldy, int64_t r0,
                              int64_t r1) {
    const int64_t K = L->k, G = L->g, W = G < 64 ? G : 64, ng = K / G, spg = G / W, ntb = (M + A16_TB - 1) / A16_TB;
    float *sc = (float *)a16_buf_get(2 * sizeof(float) * 32 * ng), *zr = sc + 32 * ng;
    uint8_t wa[32 * A16_MAX_G] __attribute__((aligned(64)));
    int32_t cb[256] __attribute__((aligned(64)));
    float acc[2][A16_PASS][128] __attribute__((aligned(64))); /* [rows 0-15, 16-31][token block][16 x 8] */
    if (!sc) abort(); /* out of memory for a block's scales */
    T_DECL;
    T_CONFIG(W == 64 ? &A16_CFG64 : &A16_CFG32);
    for (int64_t tp = 0; tp < ntb; tp += A16_PASS) {
        const int64_t nb = ntb - tp < A16_PASS ? ntb - tp : A16_PASS;
        for (int64_t n0 = r0; n0 < r1; n0 += 32) {
            const int64_t nr[2] = {r1 - n0 < 16 ? r1 - n0 : 16, r1 - n0 - 16 < 16 ? r1 - n0 - 16 : 16};
            const int two = nr[1] > 0;
            memset(acc[0], 0, sizeof(float) * 128 * nb);
            memset(acc[1], 0, sizeof(float) * 128 * nb);
            a16_scales(L, n0, r1 - n0, sc, zr);
            for (int64_t gi = 0; gi < ng; gi++) {
                const float *s0 = sc + gi * 32;
                T_STAGE(L, n0, r1 - n0, gi, wa);
                for (int64_t b = 0; b < nb; b += 2) {
                    const int tw = b + 1 < nb; /* a second token block */
                    const int8_t *b0 = ti->b + (tp + b) * ti->maxk * 16, *b1 = b0 + ti->maxk * 16;
                    const int64_t g0 = a16_goff(ti, tp + b) + gi * 8, g1 = a16_goff(ti, tp + b + 1) + gi * 8;
                    T_ZERO(0);
                    T_ZERO(1);
                    T_ZERO(2);
                    T_ZERO(3);
                    for (int64_t s = 0; s < spg; s++) {
                        const int64_t step = gi * spg + s;
                        T_LOAD(4, wa + s * 16 * W, W);
                        T_LOAD(5, b0 + step * 16 * W, 64);
                        T_DPBUSD(0, 4, 5);
                        if (two) {
                            T_LOAD(7, wa + 16 * G + s * 16 * W, W);
                            T_DPBUSD(2, 7, 5);
                        }
                        if (tw) {
                            T_LOAD(6, b1 + step * 16 * W, 64);
                            T_DPBUSD(1, 4, 6);
                            if (two) T_DPBUSD(3, 7, 6);
                        }
                    }
                    T_STORE(0, cb, 64);
                    T_EPI(L, nr[0], cb, s0, ti->c + g0, ti->qs + g0, acc[0][b]);
                    if (two) {
                        T_STORE(2, cb, 64);
                        T_EPI(L, nr[1], cb, s0 + 16, ti->c + g0, ti->qs + g0, acc[1][b]);
                    }
                    if (tw) {
                        T_STORE(1, cb, 64);
                        T_EPI(L, nr[0], cb, s0, ti->c + g1, ti->qs + g1, acc[0][b + 1]);
                        if (two) {
                            T_STORE(3, cb, 64);
                            T_EPI(L, nr[1], cb, s0 + 16, ti->c + g1, ti->qs + g1, acc[1][b + 1]);
                        }
                    }
                }
            }
            for (int h = 0; h < 1 + two; h++)
                for (int64_t b = 0; b < nb; b++) {
                    const int64_t t0 = (tp + b) * A16_TB, nt = M - t0 < A16_TB ? M - t0 : A16_TB;
                    T_OUT(L, nr[h], nt, zr + 16 * h, ti->gsum + a16_goff(ti, tp + b), acc[h][b], Y + t0 * ldy + n0 + 16 * h, ldy);
                }
        }
    }
    T_RELEASE();
}
#endif /* T_FN */
