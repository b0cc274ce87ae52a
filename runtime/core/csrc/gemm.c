/* The prompt products (GEMM, Y [M, N] = X [M, K] W^T): the dispatch (the tile GEMM on the amx
 * build from AMX_GEMM_MIN_M tokens, bf16 GEMM on AVX512-BF16 builds from BF16_GEMM_MIN_M tokens,
 * the SIMD W4A8 GEMMs, the portable per-token products), the
 * int4 row blocks' zero terms, and row dequantization for the torch runtime's dense GEMM. */
#ifdef SQ_AVX2
/* rows [n0, n1) of the output for all M tokens: fp32 into Y [M, N], or, with ybf, bf16 into
 * ybf [M, N] through yblk [M, n1 - n0] (fp32 scratch); buf: (n1 - n0) * 3 * groups floats.
 * Columns go in chunks of KC_BYTES of int8 activations per token. The zero and -8 terms are
 * added after the tiles, 8 rows at a time (per token: 2 FMAs per group for 8 outputs). */
static void gemm_q4_block(const sq_linear *L, const sq_act *a, int64_t M, float *Y, uint16_t *ybf, int64_t n0,
                            int64_t n1, float *buf, float *yblk) {
    const int64_t N = L->n, ng = L->k / L->g, ppg = L->g / 64, nb = n1 - n0;
    float *sw = buf, *zt = buf + nb * ng; /* zt: [2 ng][nb], z[g] rows then -off s[g] rows */
    const int lut = L->kind == KIND_LUT4;
    /* the codes' offset: int4 q - 8; lut4 levels + 128 on VNNI (unsigned), as they are on AVX2 */
    const float off = lut ? (a[0].paired == 2 ? 128.f : 0.f) : 8.f;
    float *Yw = ybf ? yblk : Y + n0; /* row t of the block's output at Yw + t * ldy */
    const int64_t ldy = ybf ? nb : N;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t g = 0; g < ng; g++) {
            const float s = bf(L->sz[2 * (g * N + n)]), z = bf(L->sz[2 * (g * N + n) + 1]);
            sw[(n - n0) * ng + g] = s;
            zt[g * nb + n - n0] = z;
            zt[(ng + g) * nb + n - n0] = -off * s;
        }
#ifdef SQ_AVX512
    if (a[0].paired == 2) {
        const int64_t nq = L->k / 128, qc = KC_BYTES / 128; /* quad steps, per column chunk */
        for (int64_t q0 = 0; q0 < nq || (q0 == 0 && L->k % 128); q0 += qc) {
            const int64_t q1 = q0 + qc < nq ? q0 + qc : nq;
            (lut ? gemm_l4_a8quad_avx512 : gemm_q4_a8quad_avx512)(L, a, M, sw, Yw, ldy, n0, n1, q0, q1,
                                                                  q1 == nq && L->k % 128, q0 > 0);
        }
    } else
#endif
    {
    const int64_t gc = KC_BYTES / L->g > 0 ? KC_BYTES / L->g : 1; /* groups per column chunk */
    for (int64_t g0 = 0; g0 < ng; g0 += gc) {
        const int64_t g1 = g0 + gc < ng ? g0 + gc : ng;
        if (ppg == 0 && lut) gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 0, 1); /* g32 */
        else if (ppg == 0) gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 0, 0);
        else if (lut) {
            if (ppg == 1) gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 1, 1);
            else if (ppg == 2) gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 2, 1);
            else gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 4, 1);
        } else {
            if (ppg == 1) gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 1, 0);
            else if (ppg == 2) gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 2, 0);
            else gemm_q4_a8pair_avx2(L, a, M, sw, Yw, ldy, n0, n1, g0, g1, g0 > 0, 4, 0);
        }
    }
    }
    for (int64_t t = 0; t < M; t++) {
        const float *gs = a[t].gsum, *gq = a[t].gqsum;
        float *y = Yw + t * ldy;
        int64_t j = 0;
        for (; j + 8 <= nb; j += 8) {
            __m256 v = _mm256_loadu_ps(y + j);
            for (int64_t g = 0; g < ng; g++) {
                v = _mm256_fmadd_ps(_mm256_loadu_ps(zt + g * nb + j), _mm256_broadcast_ss(gs + g), v);
                v = _mm256_fmadd_ps(_mm256_loadu_ps(zt + (ng + g) * nb + j), _mm256_broadcast_ss(gq + g), v);
            }
            if (ybf) _mm_storeu_si128((__m128i *)(ybf + t * N + n0 + j), to_bf8(v));
            else _mm256_storeu_ps(y + j, v);
        }
        for (; j < nb; j++) {
            float acc = y[j];
            for (int64_t g = 0; g < ng; g++) acc += zt[g * nb + j] * gs[g] + zt[(ng + g) * nb + j] * gq[g];
            if (ybf) ybf[t * N + n0 + j] = to_bf(acc);
            else y[j] = acc;
        }
    }
}
#endif

/* Y [M, N] = X [M, K] times L (no bias). X is fp32, or bf16 when x_bf16 (converted row by row
 * as it is quantized). The result goes to Y (fp32) or, when ybf is not NULL, to ybf as bf16
 * (round to nearest even, as torch); Y may then be NULL: the int4 GEMM converts each row
 * block from a per-thread scratch, the other paths from an [M, N] fp32 buffer they allocate
 * (a given Y is used as that buffer). Returns 0, or -1 when out of memory. */
static int linear_batch(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf,
                        void *xtbuf) {
    const int64_t K = L->k, N = L->n;
    if (L->kind == KIND_BF16 || (!Y && !ybf)) return -2;
#ifdef SQ_AMX
    if (is_q4(L) && M >= AMX_GEMM_MIN_M && sq_amx_on) return gemm_q4_a16_tiles_amx(L, X, x_bf16, M, Y, ybf, xtbuf);
#endif
#ifdef SQ_BF16
    if (L->kind == KIND_INT4 && M >= BF16_GEMM_MIN_M) return gemm_q4_a16_bf16(L, X, x_bf16, M, Y, ybf, xtbuf);
#else
    (void)xtbuf;
#endif
    sq_act *a = calloc(M, sizeof(sq_act));
    const int64_t Kp = (K + 127) / 128 * 128; /* quad order pads the codes to 128 columns */
    /* per token: gsum, gqsum, s8, each starting on a cache line */
    const int64_t g16 = (K / 32 + 1 + 15) / 16 * 16, fs = 2 * g16 + ((K / 32 + 2) * 4 + 15) / 16 * 16;
    int8_t *qbuf = alloc64(M * Kp);
    float *fbuf = alloc64(sizeof(float) * M * fs);
    if (!a || !qbuf || !fbuf) { free(a); free(qbuf); free(fbuf); return -1; }
    int oom = 0;
#pragma omp parallel
    {
        float *row = x_bf16 ? malloc(sizeof(float) * K) : NULL;
        if (x_bf16 && !row) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M; t++) {
            float *f = fbuf + t * fs;
            a[t].q = qbuf + t * Kp;
            a[t].gsum = f;
            a[t].gqsum = f + g16;
            a[t].s8 = f + 2 * g16;
            const float *x = (const float *)X + t * K;
            if (x_bf16) {
                if (!row) continue;
                const uint16_t *xb = (const uint16_t *)X + t * K;
                for (int64_t k = 0; k < K; k++) row[k] = bf(xb[k]);
                x = row;
            }
            quantize_act(x, L, &a[t]);
        }
        free(row);
    }
    if (oom) { free(a); free(qbuf); free(fbuf); return -1; }
    int fused = 0; /* the int4 GEMM writes ybf itself */
#ifdef SQ_AVX2
    if (is_q4(L) && a[0].paired) {
        /* blocks of at most NCB_BYTES of weights (16-row multiples), as many as a multiple of
         * the thread count so that every thread gets the same number of rows */
        int64_t nc = NCB_BYTES / (K / 2), nthr = 1;
#ifdef _OPENMP
        nthr = omp_get_max_threads();
#endif
        nc = nc < 16 ? 16 : nc - nc % 16;
        int64_t nblocks = (N + nc - 1) / nc;
        nblocks = (nblocks + nthr - 1) / nthr * nthr;
        nc = ((N + nblocks - 1) / nblocks + 15) / 16 * 16;
        nblocks = (N + nc - 1) / nc;
#pragma omp parallel
        {
            float *buf = malloc(sizeof(float) * nc * 3 * (K / L->g));
            float *yblk = ybf ? malloc(sizeof(float) * M * nc) : NULL;
            if (!buf || (ybf && !yblk)) {
#pragma omp atomic write
                oom = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < nblocks; b++)
                if (buf && (yblk || !ybf))
                    gemm_q4_block(L, a, M, Y, ybf, b * nc, (b + 1) * nc < N ? (b + 1) * nc : N, buf, yblk);
            free(buf);
            free(yblk);
        }
        fused = 1;
    }
#endif
#ifdef SQ_NEON
    if (is_q4(L)) { /* Arm: sdot tiles, or smmla on the neon-i8mm build (gemm_neon.c) */
        if (gemm_4bit_a8_neon(L, a, M, Y, ybf)) oom = 1;
        fused = 1;
    }
#endif
    float *own = NULL; /* the fp32 result buffer of the other paths when only ybf was given */
    if (!fused && !Y && !(Y = own = malloc(sizeof(float) * M * N))) oom = 1;
    if (!fused && Y) {
#ifdef SQ_AVX2
        if (L->kind == KIND_INT8) {
#pragma omp parallel for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                int64_t t = 0;
                for (; t + TB <= M; t += TB) gemm_q8_a8_avx2(L, a, Y, n, t, TB);
                for (; t < M; t++) gemm_q8_a8_avx2(L, a, Y, n, t, 1);
            }
        } else
#endif
        {
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < M; t++) {
#ifndef SQ_AVX2
                if (L->kind == KIND_INT8) GEMV_Q8(L, &a[t], Y + t * N, 0, N); /* the build's decode product */
                else
#endif
                (L->kind == KIND_LUT4 ? gemv_l4_a8_c : gemv_q4_a8_c)(L, &a[t], Y + t * N, 0, N);
            }
        }
        if (ybf) {
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < M * N; i++) ybf[i] = to_bf(Y[i]);
        }
    }
    free(own); free(a); free(qbuf); free(fbuf);
    return oom ? -1 : 0;
}

int sq_linear_batch(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf) {
    return linear_batch(L, X, x_bf16, M, Y, ybf, NULL);
}

/* W rows [r0, r1) of an int4 or lut4 rows32 linear, dequantized to fp32 [r1 - r0, K] (prefill:
 * the caller multiplies with a dense GEMM). */
int sq_dequant_rows(const sq_linear *L, int64_t r0, int64_t r1, float *out) {
    const int64_t K = L->k, N = L->n, G = L->g;
    if (!is_q4(L) || r0 < 0 || r1 > N || r0 > r1) return -1;
    const int lut = L->kind == KIND_LUT4;
#pragma omp parallel for schedule(static)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *w = L->q + n * (K / 2);
        float *o = out + (n - r0) * K;
        int8_t t[16]; /* the codes' values: q - 8 (int4) or the row's levels */
        for (int j = 0; j < 16; j++) t[j] = lut ? L->lut[16 * n + j] : (int8_t)(j - 8);
        for (int64_t gi = 0; gi < K / G; gi++) {
            const uint16_t *p = L->sz + 2 * (gi * N + n);
            const float s = bf(p[0]), z = bf(p[1]);
            for (int64_t b = gi * (G / 32); b < (gi + 1) * (G / 32); b++) {
                const uint8_t *wb = w + 16 * b;
                float *ob = o + 32 * b;
#ifdef SQ_AVX2
                if (!lut) { /* (q - 8) s + z as q s + (z - 8 s), as before the lut4 kind */
                    const __m256 sv = _mm256_set1_ps(s), cv = _mm256_set1_ps(z - 8.f * s);
                    __m128i raw = _mm_loadu_si128((const __m128i *)wb);
                    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
                    _mm256_storeu_ps(ob, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sv, cv));
                    _mm256_storeu_ps(ob + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sv, cv));
                    _mm256_storeu_ps(ob + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sv, cv));
                    _mm256_storeu_ps(ob + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sv, cv));
                    continue;
                }
#endif
                for (int j = 0; j < 16; j++) {
                    if (lut) {
                        ob[j] = t[wb[j] & 15] * s + z;
                        ob[j + 16] = t[wb[j] >> 4] * s + z;
                    } else {
                        ob[j] = (wb[j] & 15) * s + (z - 8.f * s);
                        ob[j + 16] = (wb[j] >> 4) * s + (z - 8.f * s);
                    }
                }
            }
        }
    }
    return 0;
}
