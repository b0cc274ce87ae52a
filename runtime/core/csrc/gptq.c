/* GPTQ's sequential part, for the converter (convert/gptq.py): inside one block of B columns (in
 * act order), each row's columns are quantized one at a time and each one's error is spread over
 * the row's later columns of the block through the block's part of the upper Cholesky factor of
 * H^-1. Rows are independent given H, so the rows go over the threads; the update of the columns
 * after the block is a GEMM the caller does (err @ hinv[block, rest]).
 *
 * The arithmetic is the reference's (convert/gptq.py gptq_block_py), operation for operation in
 * fp32: uniform int4 codes q = clamp(rint((x - z) / s + 8), 0, 15), w' = (q - 8) s + z; with a
 * level table (a lut4 linear: ascending levels per row), q = the nearest level of (x - z) / s
 * (the lower one on a tie), w' = level[q] s + z. A group with s <= 0 takes code 8 (int4) or the
 * level nearest 0 (lut4), as the quantizer does. */

/* the code of v among 16 ascending levels t: the nearest, the lower on a tie */
static inline int nearest_level(const float *t, float v) {
    int q = 0;
    for (int j = 1; j < 16; j++)
        if (v > 0.5f * (t[j - 1] + t[j])) q = j;
    return q;
}

/* w [R, ldw]: the block's B columns, updated in place; hinv [B, B] with row stride ldh; s, z
 * [R, ngroups] per-group scale and zero, grp [B] each block column's group; tab NULL (int4) or
 * [R, 16] levels; codes [R, ldq] (the block's B columns) and err [R, B] out. */
int sq_gptq_block(float *w, int64_t ldw, const float *hinv, int64_t ldh, const float *s, const float *z,
                  int64_t ngroups, const int32_t *grp, const float *tab, int64_t R, int64_t B, uint8_t *codes,
                  int64_t ldq, float *err) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        float *wr = w + r * ldw, *er = err + r * B;
        const float *sr = s + r * ngroups, *zr = z + r * ngroups, *tr = tab ? tab + r * 16 : NULL;
        uint8_t *qr = codes + r * ldq;
        for (int64_t i = 0; i < B; i++) {
            const float x = wr[i], sc = sr[grp[i]], zc = zr[grp[i]];
            float dq;
            int q;
            if (tr) {
                q = sc > 0.f ? nearest_level(tr, (x - zc) / sc) : nearest_level(tr, 0.f);
                dq = tr[q] * sc + zc;
            } else {
                q = sc > 0.f ? (int)fminf(fmaxf(rintf((x - zc) / sc + 8.f), 0.f), 15.f) : 8;
                dq = ((float)q - 8.f) * sc + zc;
            }
            qr[i] = (uint8_t)q;
            const float e = (x - dq) / hinv[i * ldh + i];
            er[i] = e;
            const float *hi = hinv + i * ldh;
            for (int64_t j = i + 1; j < B; j++) wr[j] -= e * hi[j];
        }
    }
    return 0;
}

/* ---- lut4 level tables (convert/lut.py fit_lut is the reference, in torch) ----
 * Per row: weighted Lloyd iterations over its K weights -- assign each weight its nearest level
 * in the normalized domain (w - z) / s of its group, refit each group's (s, z) by weighted least
 * squares on the assigned levels, move each level to the weighted centroid of its members (weights
 * a[k] s^2: the error in weight units) -- then levels scaled to peak 127 and rounded to int8, the
 * groups refit on them and rounded to bf16, and the final nearest codes. Rows over the threads. */
static void lut_fit_groups(const float *w, const float *t, const float *a, int64_t K, int64_t g, float *s, float *z) {
    for (int64_t gi = 0; gi < K / g; gi++) {
        double sa = 0, st = 0, sw = 0, stt = 0, stw = 0;
        for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
            const double ak = a[k], tk = t[k], wk = w[k];
            sa += ak, st += ak * tk, sw += ak * wk, stt += ak * tk * tk, stw += ak * tk * wk;
        }
        const double det = sa * stt - st * st;
        if (det > 1e-12 * sa * stt && (sa * stw - st * sw) / det > 0) {
            s[gi] = (float)((sa * stw - st * sw) / det);
            z[gi] = (float)((stt * sw - st * stw) / det);
        } /* else: the group keeps its parameters */
    }
}

int sq_lut_fit(const float *w, int64_t R, int64_t K, int64_t g, const float *a, int64_t iters, const float *init,
               int8_t *levels, uint16_t *sz, uint8_t *codes) {
    const int64_t G = K / g;
    int fail = 0;
#pragma omp parallel
    {
        float *t = malloc(sizeof(float) * K), *s = malloc(sizeof(float) * G), *z = malloc(sizeof(float) * G);
        uint8_t *q = malloc((size_t)K);
        if (!t || !s || !z || !q) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < R; r++) {
            if (!t || !s || !z || !q) continue;
            const float *wr = w + r * K;
            float lv[16];
            for (int j = 0; j < 16; j++) lv[j] = init[j];
            for (int64_t gi = 0; gi < G; gi++) { /* the init grid spans the group's range */
                float lo = wr[gi * g], hi = lo;
                for (int64_t k = gi * g; k < (gi + 1) * g; k++) lo = fminf(lo, wr[k]), hi = fmaxf(hi, wr[k]);
                s[gi] = fmaxf((hi - lo) / (lv[15] - lv[0]), 1e-12f);
                z[gi] = lo - lv[0] * s[gi];
            }
            for (int64_t it = 0; it < iters; it++) {
                for (int64_t gi = 0; gi < G; gi++) {
                    const float zg = z[gi], inv = 1.f / s[gi];
                    for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                        q[k] = (uint8_t)nearest_level(lv, (wr[k] - zg) * inv);
                        t[k] = lv[q[k]];
                    }
                }
                lut_fit_groups(wr, t, a, K, g, s, z);
                float num[16] = {0}, den[16] = {0};
                for (int64_t gi = 0; gi < G; gi++) {
                    const float sg = s[gi], zg = z[gi], s2 = sg * sg, inv = 1.f / sg;
                    for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                        const float wt = a[k] * s2;
                        num[q[k]] += wt * (wr[k] - zg) * inv;
                        den[q[k]] += wt;
                    }
                }
                for (int j = 0; j < 16; j++)
                    if (den[j] > 0) lv[j] = fminf(fmaxf(num[j] / den[j], -127.f), 127.f);
                for (int i = 1; i < 16; i++) /* keep them ascending */
                    for (int j = i; j > 0 && lv[j - 1] > lv[j]; j--) {
                        const float x = lv[j]; lv[j] = lv[j - 1]; lv[j - 1] = x;
                    }
            }
            float peak = 1e-6f; /* the full int8 range: the scales absorb the factor */
            for (int j = 0; j < 16; j++) peak = fmaxf(peak, fabsf(lv[j]));
            float li[16];
            for (int j = 0; j < 16; j++) li[j] = fminf(fmaxf(rintf(lv[j] * 127.f / peak), -127.f), 127.f);
            for (int i = 1; i < 16; i++)
                for (int j = i; j > 0 && li[j - 1] > li[j]; j--) {
                    const float x = li[j]; li[j] = li[j - 1]; li[j - 1] = x;
                }
            for (int64_t gi = 0; gi < G; gi++) s[gi] *= peak / 127.f;
            for (int64_t gi = 0; gi < G; gi++)
                for (int64_t k = gi * g; k < (gi + 1) * g; k++) t[k] = li[nearest_level(li, (wr[k] - z[gi]) / s[gi])];
            lut_fit_groups(wr, t, a, K, g, s, z);
            for (int64_t gi = 0; gi < G; gi++) {
                sz[2 * (gi * R + r)] = to_bf(s[gi]);
                sz[2 * (gi * R + r) + 1] = to_bf(z[gi]);
            }
            for (int j = 0; j < 16; j++) levels[16 * r + j] = (int8_t)li[j];
            for (int64_t gi = 0; gi < G; gi++) {
                const float sb = bf(sz[2 * (gi * R + r)]), zb = bf(sz[2 * (gi * R + r) + 1]);
                for (int64_t k = gi * g; k < (gi + 1) * g; k++)
                    codes[r * K + k] = (uint8_t)nearest_level(li, sb > 0.f ? (wr[k] - zb) / sb : 0.f);
            }
        }
        free(t); free(s); free(z); free(q);
    }
    return fail ? -1 : 0;
}

/* ---- int4 scale search (convert/quantize.py quantize_rows "clip" is the reference, in torch) ----
 * Per row and group of g columns: start from the group's [min, max] on 0..15; for each shrink s
 * of the range (grid) and shift of its centre (shifts), assign codes on that range, refit scale and
 * offset by least squares on those codes, and keep whichever of the two reconstructs the group with
 * the least squared error (the first on a tie). Scales and zeros are bf16-rounded before the codes
 * are chosen, as the kernel reads them. One group at a time in cache, rows over the threads, where
 * the torch version makes ~40 passes over the whole [R, K] tensor. */
static inline float bf_round(float x) { return bf(to_bf(x)); }

static inline int int4_code(float w, float s, float z) {
    if (!(s > 0.f)) return 8;
    return (int)fminf(fmaxf(rintf((w - z) / s + 8.f), 0.f), 15.f);
}

static inline float int4_err(const float *w, int64_t g, float s, float z, uint8_t *q) {
    float e = 0.f;
    for (int64_t j = 0; j < g; j++) {
        q[j] = (uint8_t)int4_code(w[j], s, z);
        const float d = w[j] - (((float)q[j] - 8.f) * s + z);
        e += d * d;
    }
    return e;
}

/* w [R, K] -> codes [R, K], sz bf16 [K/g, R, 2] (scale, zero: w ~ (q - 8) scale + zero); *err: the
 * sum of the groups' squared errors. grid [ngrid] range shrinks, shifts [nshift] centre shifts (as
 * fractions of the range); ngrid = 0: min/max only. */
int sq_clip_search(const float *w, int64_t R, int64_t K, int64_t g, const double *grid, int64_t ngrid,
                   const double *shifts, int64_t nshift, uint8_t *codes, uint16_t *sz, double *err) {
    const int64_t G = K / g;
    double total = 0.0;
    int fail = 0;
#pragma omp parallel reduction(+ : total)
    {
        uint8_t *tq = malloc((size_t)g), *bq = malloc((size_t)g);
        if (!tq || !bq) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(dynamic, 16)
        for (int64_t r = 0; r < R; r++) {
            if (!tq || !bq) continue;
            for (int64_t gi = 0; gi < G; gi++) {
                const float *wg = w + r * K + gi * g;
                float lo = wg[0], hi = wg[0], wsum = 0.f;
                for (int64_t j = 0; j < g; j++) lo = fminf(lo, wg[j]), hi = fmaxf(hi, wg[j]), wsum += wg[j];
                float s = bf_round((hi - lo) / 15.f), z = bf_round(lo + 8.f * s);
                float best = int4_err(wg, g, s, z, bq);
                const float rng = hi - lo, mid = (hi + lo) / 2.f, wm = wsum / (float)g;
                for (int64_t a = 0; a < ngrid; a++)
                    for (int64_t b = 0; b < nshift; b++) {
                        const float clo = mid - rng * (float)(grid[a] / 2 - shifts[b]);
                        const float cs = bf_round(rng * (float)grid[a] / 15.f), cz = bf_round(clo + 8.f * cs);
                        float e = int4_err(wg, g, cs, cz, tq);
                        if (e < best) best = e, s = cs, z = cz, memcpy(bq, tq, (size_t)g);
                        /* least squares on these codes: w ~ a (q - 8) + b */
                        float xs = 0.f;
                        for (int64_t j = 0; j < g; j++) xs += (float)tq[j] - 8.f;
                        const float xm = xs / (float)g;
                        float var = 0.f, cov = 0.f;
                        for (int64_t j = 0; j < g; j++) {
                            const float dx = (float)tq[j] - 8.f - xm;
                            var += dx * dx, cov += dx * (wg[j] - wm);
                        }
                        const float sl = var > 0.f ? cov / fmaxf(var, 1e-20f) : cs;
                        const float rs = bf_round(fmaxf(sl, 0.f)), rz = bf_round(wm - sl * xm);
                        e = int4_err(wg, g, rs, rz, tq);
                        if (e < best) best = e, s = rs, z = rz, memcpy(bq, tq, (size_t)g);
                    }
                memcpy(codes + r * K + gi * g, bq, (size_t)g);
                sz[2 * (gi * R + r)] = to_bf(s);
                sz[2 * (gi * R + r) + 1] = to_bf(z);
                total += best;
            }
        }
        free(tq); free(bq);
    }
    *err = total;
    return fail ? -1 : 0;
}

/* H = X^T X (fp32 [K, K], row-major, both triangles) for X bf16 [T, K] row-major: the Hessian of
 * GPTQ's widest inputs (the down projections', which the converter keeps in bf16). On AVX512-BF16
 * builds: per chunk of GRAM_TC tokens, the chunk's rows are interleaved in pairs (dword (p, c) =
 * X[2p][c], X[2p+1][c]; an odd tail pairs with 0) and every tile of 32 columns (two 16-lane
 * vectors) x 8 rows (dword broadcasts) on or below the 32-column diagonal blocks accumulates its
 * vdpbf16ps sums (fp32) into H; the rest is mirrored at the end. bf16 x bf16 products are exact in
 * fp32, so only the summation order differs from the float32 GEMM of convert/calib.py gram(),
 * which is the reference (and the path of every other build: this one returns -2 there, or when
 * K is not a multiple of 32). Returns 0, -1 out of memory, -2 not available. */
#define GRAM_TC 512
int sq_gram_bf16(const uint16_t *X, int64_t T, int64_t K, float *H) {
#ifdef SQ_BF16
    if (K % 32 || T < 1) return -2;
    const int64_t P = GRAM_TC / 2, ncb = K / 32;
    uint32_t *xp = aligned_alloc(64, sizeof(uint32_t) * P * K);
    if (!xp) return -1;
    memset(H, 0, sizeof(float) * K * K);
    for (int64_t t0 = 0; t0 < T; t0 += GRAM_TC) {
        const int64_t np = ((T - t0 < GRAM_TC ? T - t0 : GRAM_TC) + 1) / 2;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < np; p++) {
                const uint16_t *a = X + (t0 + 2 * p) * K, *b = t0 + 2 * p + 1 < T ? a + K : NULL;
                uint32_t *d = xp + p * K;
                for (int64_t c = 0; c < K; c++) d[c] = (uint32_t)a[c] | (b ? (uint32_t)b[c] << 16 : 0u);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t cb = 0; cb < ncb; cb++) {
                const int64_t c0 = 32 * cb;
                for (int64_t j0 = c0; j0 < K; j0 += 8) {
                    __m512 acc[2][8];
                    for (int h = 0; h < 2; h++)
                        for (int t = 0; t < 8; t++) acc[h][t] = _mm512_setzero_ps();
                    for (int64_t p = 0; p < np; p++) {
                        const uint32_t *row = xp + p * K;
                        const __m512bh w0 = (__m512bh)_mm512_load_si512((const void *)(row + c0));
                        const __m512bh w1 = (__m512bh)_mm512_load_si512((const void *)(row + c0 + 16));
                        for (int t = 0; t < 8; t++) {
                            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)row[j0 + t]);
                            acc[0][t] = _mm512_dpbf16_ps(acc[0][t], w0, xv);
                            acc[1][t] = _mm512_dpbf16_ps(acc[1][t], w1, xv);
                        }
                    }
                    for (int t = 0; t < 8; t++)
                        for (int h = 0; h < 2; h++) {
                            float *o = H + (j0 + t) * K + c0 + 16 * h;
                            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[h][t]));
                        }
                }
            }
        }
    }
    free(xp);
    /* rows r above column c's 32-block were not computed: H[r][c] = H[c][r] */
#pragma omp parallel for schedule(dynamic, 32)
    for (int64_t r = 0; r < K; r++)
        for (int64_t c = (r / 32 + 1) * 32; c < K; c++) H[r * K + c] = H[c * K + r];
    return 0;
#else
    (void)X, (void)T, (void)K, (void)H;
    return -2;
#endif
}
