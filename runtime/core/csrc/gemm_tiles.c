/* The tile GEMM: W4A16 prompt products for int4 and lut4 linears on AMX-BF16 tiles (TDPBF16PS),
 * written once against the T_* tile macros and compiled twice: over the portable tile model
 * (tile_model.c: every build, sq_gemm_tiles(..., hw = 0), the tests' reference for the blocking
 * and indexing) and, in the amx build, over the hardware tiles (gemm_amx.c).
 *
 *   weights  A tiles: a block of TNB = 32 rows is dequantized into wa, tile-ordered
 *            [K/32][2][16 rows][32 bf16] (each 16 x 64-byte A tile contiguous). Dequantization goes
 *            through a per-row, per-group table of the 16 code values, tab[q] = bf16(fma(q, s,
 *            z - 8 s)) for int4 (the bits of gemm_bf16.c's dequantization) and bf16(fma(lut[q], s,
 *            z)) for lut4, so both kinds cost the same: one lookup per weight (vpermw on AVX512).
 *   tokens   B tiles: activations rounded to bf16 (nearest even) once per call, in VNNI pair
 *            order [M/16][K/32][16 pairs][16 tokens] dwords (each 16 x 64-byte B tile contiguous).
 *   sums     C tiles: 16 rows x 16 tokens, fp32; 2 x 2 C tiles (32 rows x 32 tokens) per pass
 *            over K, then transposed into Y [M, N] (or ybf).
 * Weights are read in place from the mapping and staged per block (K * 64 bytes a thread); the
 * artifact is never repacked. A token's result does not depend on the others in its call. */
#ifndef SQ_GEMM_TILES_COMMON
#define SQ_GEMM_TILES_COMMON
#define TNB 32 /* weight rows per block: two A tiles */
#define TTB 16 /* tokens per B tile */
#ifndef TILES_CHUNK_BYTES
#define TILES_CHUNK_BYTES (2 << 20) /* B tiles of one token chunk: kept in L2 while the row blocks pass */
#endif

/* token tiles per chunk: an even count whose B tiles fill at most TILES_CHUNK_BYTES (at least 2) */
static inline int64_t tiles_per_chunk(int64_t K) {
    const int64_t t = TILES_CHUNK_BYTES / (K / 32 * 1024);
    return t < 2 ? 2 : t - t % 2;
}

/* every tile 16 rows x 64 bytes (palette 1); static: gcc 12 can drop stores to a local config */
static const sq_tilecfg TILES_CFG __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0}, {16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0}};

/* row n's 16 code values in group gi as bf16 */
static void tiles_table_c(const sq_linear *L, int64_t n, int64_t gi, uint16_t tab[16]) {
    const uint16_t *p = L->sz + 2 * (gi * L->n + n);
    const float s = bf(p[0]), z = bf(p[1]);
    const int lut = L->kind == KIND_LUT4;
    for (int j = 0; j < 16; j++) tab[j] = to_bf(lut ? fmaf((float)L->lut[16 * n + j], s, z) : fmaf((float)j, s, z - 8.f * s));
}

/* rows [n0, n0 + TNB) of L (rows >= N as zeros) -> wa, tile-ordered (above) */
static void tiles_dequant_c(const sq_linear *L, int64_t n0, uint16_t *wa) {
    const int64_t K = L->k, G = L->g;
    for (int64_t r = 0; r < TNB; r++) {
        const int64_t n = n0 + r;
        uint16_t tab[16];
        for (int64_t b = 0; b < K / 32; b++) {
            uint16_t *o = wa + ((b * 2 + r / 16) * 16 + r % 16) * 32;
            if (n >= L->n) { memset(o, 0, 64); continue; }
            if (b % (G / 32) == 0) tiles_table_c(L, n, b / (G / 32), tab);
            const uint8_t *w = L->q + n * (K / 2) + 16 * b;
            for (int j = 0; j < 16; j++) {
                o[j] = tab[w[j] & 15];
                o[j + 16] = tab[w[j] >> 4];
            }
        }
    }
}

/* tokens [16 j, 16 j + 16) of X (fp32, or bf16 when x_bf16; tokens >= M as zeros) -> their B
 * tiles xb + j * (K / 32) * 256 */
static void tiles_pack_c(const void *X, int64_t x_bf16, int64_t M, int64_t K, int64_t j, uint32_t *xb) {
    uint32_t *d = xb + j * (K / 32) * 256;
    for (int64_t t = 0; t < TTB; t++) {
        const int64_t row = TTB * j + t;
        for (int64_t c = 0; c < K / 2; c++) {
            uint32_t v = 0;
            if (row < M && x_bf16) {
                const uint16_t *x = (const uint16_t *)X + row * K + 2 * c;
                v = (uint32_t)x[0] | (uint32_t)x[1] << 16;
            } else if (row < M) {
                const float *x = (const float *)X + row * K + 2 * c;
                v = (uint32_t)to_bf(x[0]) | (uint32_t)to_bf(x[1]) << 16;
            }
            d[(c / 16) * 256 + (c % 16) * 16 + t] = v;
        }
    }
}

/* a C tile (16 rows x 16 tokens fp32) -> Y [t0 + t][n0 + r] (or ybf), tokens t < nt, rows r < nr */
static void tiles_store_c(const float *c, float *Y, uint16_t *ybf, int64_t N, int64_t t0, int64_t nt, int64_t n0, int64_t nr) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t r = 0; r < nr; r++) {
            if (ybf) ybf[(t0 + t) * N + n0 + r] = to_bf(c[r * 16 + t]);
            else Y[(t0 + t) * N + n0 + r] = c[r * 16 + t];
        }
}
#endif /* SQ_GEMM_TILES_COMMON */

/* The driver, once per tile implementation (T_FN names it; T_* are its tile operations, T_DEQUANT,
 * T_PACK and T_STORE its staging). xbuf: room for the B tiles ((M rounded up to 16) x K bf16),
 * or NULL to allocate them here. Returns 0, or -1 when out of memory. */
static int T_FN(gemm_q4_a16_tiles)(const sq_linear *L, const void *X, int64_t x_bf16, int64_t M, float *Y, uint16_t *ybf,
                                   uint32_t *xbuf) {
    const int64_t K = L->k, N = L->n, KB = K / 32, ntiles = (M + TTB - 1) / TTB, nblk = (N + TNB - 1) / TNB;
    const int64_t tpc = tiles_per_chunk(K);
    uint32_t *xb = xbuf ? xbuf : alloc64(sizeof(uint32_t) * ntiles * TTB * (K / 2));
    if (!xb) return -1;
    int oom = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < ntiles; j++) T_PACK(X, x_bf16, M, K, j, xb);
        uint16_t *wa = alloc64(sizeof(uint16_t) * TNB * K);
        float *cbuf = alloc64(sizeof(float) * 4 * 256);
        if (!wa || !cbuf) {
#pragma omp atomic write
            oom = 1;
        }
        T_DECL;
        T_CONFIG(&TILES_CFG);
        for (int64_t c0 = 0; c0 < ntiles; c0 += tpc) { /* a chunk of tokens at a time, every row block over it */
            const int64_t c1 = c0 + tpc < ntiles ? c0 + tpc : ntiles;
#pragma omp for schedule(dynamic, 1)
            for (int64_t blk = 0; blk < nblk; blk++) {
                if (!wa || !cbuf) continue;
                const int64_t n0 = TNB * blk;
                T_DEQUANT(L, n0, wa);
                for (int64_t j = c0; j < c1; j += 2) {
                    const int two = j + 1 < c1;
                    const uint32_t *b0 = xb + j * KB * 256, *b1 = b0 + KB * 256;
                    T_ZERO(0);
                    T_ZERO(1);
                    T_ZERO(2);
                    T_ZERO(3);
                    for (int64_t cb = 0; cb < KB; cb++) {
                        T_LOAD(4, wa + cb * 1024, 64);
                        T_LOAD(5, wa + cb * 1024 + 512, 64);
                        T_LOAD(6, b0 + cb * 256, 64);
                        T_DPBF16PS(0, 4, 6);
                        T_DPBF16PS(2, 5, 6);
                        if (two) {
                            T_LOAD(7, b1 + cb * 256, 64);
                            T_DPBF16PS(1, 4, 7);
                            T_DPBF16PS(3, 5, 7);
                        }
                    }
                    T_STORE(0, cbuf, 64);
                    T_STORE(1, cbuf + 256, 64);
                    T_STORE(2, cbuf + 512, 64);
                    T_STORE(3, cbuf + 768, 64);
                    for (int h = 0; h < 2; h++)
                        for (int jj = 0; jj < 1 + two; jj++) {
                            const int64_t t0 = TTB * (j + jj), nt = M - t0 < TTB ? M - t0 : TTB;
                            const int64_t r0 = n0 + 16 * h, nr = N - r0 < 16 ? N - r0 : 16;
                            if (nr > 0) T_STORE_OUT(cbuf + 256 * (2 * h + jj), Y, ybf, N, t0, nt, r0, nr);
                        }
                }
            }
        }
        T_RELEASE();
        free(wa);
        free(cbuf);
    }
    if (!xbuf) free(xb);
    return oom ? -1 : 0;
}
