/* The prompt GEMM on AVX512-BF16 builds: W4A16.
 * Many tokens at once amortize a dequantization: each block of NBR weight rows is dequantized
 * (w = q * s + (z - 8 s) in fp32, as sq_dequant_rows, rounded to bf16) into a per-thread scratch
 * of K/2 x NBR dwords -- dword (c, r) holds the bf16 pair (w[r][2c], w[r][2c+1]), 16 rows per
 * cache line -- and every tile of BT tokens multiplies it with vdpbf16ps: per column pair, RV
 * weight loads and, per token, a dword broadcast of its two bf16 activations and RV vdpbf16ps
 * (fp32 accumulators, one lane per row, RV x BT in registers). The activations are rounded
 * to bf16 (vcvtne2ps2bf16: nearest even) once per call into tiles of [K/32][BT][16] pairs. No
 * int8 activations: the prefill then carries no A8 error (its products differ from the decode
 * step's W4A8 ones within that budget). The scratch is transient, per call, per thread
 * (K * 2 * NBR bytes); nothing is kept. Measured on the AVX512-BF16 box (Zen 5, 2 threads,
 * `python tools/gemmbench.py`): docs/performance.md "AVX512 CPUs". */
#ifndef BT
#define BT 8  /* tokens per tile */
#endif
#ifndef RV
#define RV 2  /* 16-row vectors per weight block: RV x BT accumulators */
#endif
#ifdef SQ_BF16
#define NBR (16 * RV) /* rows per weight block */
#define BF16_GEMM_MIN_M 32 /* fewer tokens: the W4A8 GEMM (no dequantization to amortize) */

/* bf16 pairs (a in the low half, b in the high half of each lane), RNE by vcvtne2ps2bf16 */
static inline __m512i bf16_pairs(__m512 a, __m512 b) {
    static const uint16_t ilv16[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i ilv = _mm512_loadu_si512((const void *)ilv16);
    return _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(b, a)); /* [a0..a15 | b0..b15] -> a0 b0 a1 b1 .. */
}

/* rows [n0, n0 + NBR) of L (rows >= N as zeros) -> wp [K/2][NBR] bf16 pairs */
static void dequant_pairs(const sq_linear *L, int64_t n0, uint32_t *wp) {
    const int64_t K = L->k, N = L->n, G = L->g, rb = K / 2;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i pick[4]; /* byte i of each dword -> the dword's low byte, other bytes 0 (vpshufb works
                      * within 16-byte lanes: indices are lane-relative) */
    for (int i = 0; i < 4; i++) {
        char c[64];
        for (int j = 0; j < 64; j++) c[j] = j % 4 == 0 ? (char)(j % 16 + i) : (char)0x80;
        pick[i] = _mm512_loadu_si512((const void *)c);
    }
    const __m512i rowoff = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)rb));
    for (int h = 0; h < RV; h++) {
        const int64_t r0 = n0 + 16 * h;
        const __mmask16 valid = rows_mask(N - r0);
        if (!valid) {
            for (int64_t c = 0; c < K / 2; c++) _mm512_storeu_si512((void *)(wp + c * NBR + 16 * h), _mm512_setzero_si512());
            continue;
        }
        const uint8_t *base = L->q + r0 * rb;
        for (int64_t gi = 0; gi < K / G; gi++) {
            /* (scale, zero) of 16 rows: one dword each, scale in the low half */
            const __m512i p = _mm512_maskz_loadu_epi32(valid, (const void *)(L->sz + 2 * (gi * N + r0)));
            const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
            const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32((int)0xffff0000)));
            const __m512 cv = _mm512_sub_ps(zv, _mm512_mul_ps(_mm512_set1_ps(8.f), sv));
            for (int64_t b = gi * (G / 32); b < (gi + 1) * (G / 32); b++) {
                __m512i ub[4]; /* dword j / 4 of block b of each of the 16 rows, lane = row */
                if (valid == 0xffff) {
                    /* a 16 x 4 dword transpose of plain loads (a gather is microcoded: 4 of them
                     * cost more than the 16 loads and 8 shuffles): zm holds rows m, 4 + m, 8 + m,
                     * 12 + m in its 128-bit lanes, so the unpacks leave row r in lane r */
                    __m512i z[4];
                    for (int mm = 0; mm < 4; mm++) {
                        const uint8_t *rp = base + mm * rb + 16 * b;
                        z[mm] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)rp));
                        z[mm] = _mm512_inserti32x4(z[mm], _mm_loadu_si128((const __m128i *)(rp + 4 * rb)), 1);
                        z[mm] = _mm512_inserti32x4(z[mm], _mm_loadu_si128((const __m128i *)(rp + 8 * rb)), 2);
                        z[mm] = _mm512_inserti32x4(z[mm], _mm_loadu_si128((const __m128i *)(rp + 12 * rb)), 3);
                    }
                    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
                    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
                    ub[0] = _mm512_unpacklo_epi64(t0, t2);
                    ub[1] = _mm512_unpackhi_epi64(t0, t2);
                    ub[2] = _mm512_unpacklo_epi64(t1, t3);
                    ub[3] = _mm512_unpackhi_epi64(t1, t3);
                } else {
                    for (int j = 0; j < 4; j++)
                        ub[j] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid,
                                                            _mm512_add_epi32(rowoff, _mm512_set1_epi32((int)(16 * b + 4 * j))),
                                                            (const void *)base, 1);
                }
                for (int j = 0; j < 16; j += 4) {
                    /* bytes 16b + j .. + 3 of each row: columns 32b + j + i (low nibbles) and
                     * 32b + 16 + j + i (high nibbles), i < 4 */
                    const __m512i u = ub[j / 4];
                    const __m512i lo = _mm512_and_si512(u, m4), hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), m4);
                    __m512 f[8];
                    for (int i = 0; i < 4; i++) {
                        f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(lo, pick[i])), sv, cv);
                        f[4 + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_epi8(hi, pick[i])), sv, cv);
                    }
                    uint32_t *d0 = wp + (16 * b + j / 2) * NBR + 16 * h, *d1 = wp + (16 * b + 8 + j / 2) * NBR + 16 * h;
                    _mm512_storeu_si512((void *)d0, bf16_pairs(f[0], f[1]));
                    _mm512_storeu_si512((void *)(d0 + NBR), bf16_pairs(f[2], f[3]));
                    _mm512_storeu_si512((void *)d1, bf16_pairs(f[4], f[5]));
                    _mm512_storeu_si512((void *)(d1 + NBR), bf16_pairs(f[6], f[7]));
                }
            }
        }
    }
}

/* NBR rows (wp) x BT tokens (xt: the tile's pairs, [K/32][BT][16]: 16 column pairs of one
 * token in one cache line) -> Y / ybf rows t0.. (first nt valid), columns n0.. (m[h]: the valid
 * rows of vector h) */
static void bf16_tile(const uint32_t *wp, const uint32_t *xt, int64_t K, int64_t N, int64_t t0, int64_t nt, int64_t n0,
                      const __mmask16 *m, float *Y, uint16_t *ybf) {
    __m512 acc[RV][BT];
    for (int h = 0; h < RV; h++)
        for (int t = 0; t < BT; t++) acc[h][t] = _mm512_setzero_ps();
    for (int64_t cb = 0; cb < K / 32; cb++) {
        const uint32_t *xb = xt + cb * BT * 16, *wb = wp + cb * 16 * NBR;
        for (int ci = 0; ci < 16; ci++) {
            __m512bh w[RV];
            for (int h = 0; h < RV; h++) w[h] = (__m512bh)_mm512_loadu_si512((const void *)(wb + ci * NBR + 16 * h));
            for (int t = 0; t < BT; t++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[t * 16 + ci]);
                for (int h = 0; h < RV; h++) acc[h][t] = _mm512_dpbf16_ps(acc[h][t], w[h], xv);
            }
        }
    }
    for (int64_t t = 0; t < nt; t++)
        for (int h = 0; h < RV; h++) {
            if (!m[h]) continue;
            const int64_t o = (t0 + t) * N + n0 + 16 * h;
            if (ybf) {
                const __m256i v = _mm256_setr_m128i(to_bf8(_mm512_castps512_ps256(acc[h][t])), to_bf8(_mm512_extractf32x8_ps(acc[h][t], 1)));
                _mm256_mask_storeu_epi16((void *)(ybf + o), m[h], v);
            } else {
                _mm512_mask_storeu_ps(Y + o, m[h], acc[h][t]);
            }
        }
}

/* xtbuf: room for the activation tiles ((M rounded up to BT) x K bf16), or NULL to allocate them
 * here (sq_prefill passes one buffer for all its products: a fresh multi-MiB allocation per
 * product is mmapped and page-faulted anew, 6% of a 1.7B prefill in `perf`). Returns 0, or -1
 * when out of memory. */
static int gemm_q4_a16_bf16(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf,
                     uint32_t *xtbuf) {
    const int64_t K = L->k, N = L->n, ntiles = (M + BT - 1) / BT, nblk = (N + NBR - 1) / NBR;
    uint32_t *xt = xtbuf ? xtbuf : malloc(sizeof(uint32_t) * ntiles * BT * (K / 2));
    if (!xt) return -1;
    int oom = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < ntiles; tile++) {
            uint32_t *d = xt + tile * BT * (K / 2);
            for (int t = 0; t < BT; t++) {
                const int64_t row = tile * BT + t;
                for (int64_t cb = 0; cb < K / 32; cb++) {
                    __m512i v = _mm512_setzero_si512(); /* 32 columns = 16 pairs (bf16 in memory order) */
                    if (row < M && x_bf16) {
                        v = _mm512_loadu_si512((const void *)((const uint16_t *)X + row * K + 32 * cb));
                    } else if (row < M) {
                        const float *xf = (const float *)X + row * K + 32 * cb;
                        v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + 16), _mm512_loadu_ps(xf));
                    }
                    _mm512_storeu_si512((void *)(d + cb * BT * 16 + t * 16), v);
                }
            }
        }
        uint32_t *wp = aligned_alloc(64, sizeof(uint32_t) * NBR * (K / 2));
        if (!wp) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t blk = 0; blk < nblk; blk++) {
            if (!wp) continue;
            const int64_t n0 = NBR * blk;
            __mmask16 m[RV];
            for (int h = 0; h < RV; h++) m[h] = rows_mask(N - n0 - 16 * h);
            dequant_pairs(L, n0, wp);
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t t0 = tile * BT, nt = M - t0 < BT ? M - t0 : BT;
                bf16_tile(wp, xt + tile * BT * (K / 2), K, N, t0, nt, n0, m, ybf ? NULL : Y, ybf);
            }
        }
        free(wp);
    }
    if (!xtbuf) free(xt);
    return oom ? -1 : 0;
}
#endif
