/* The prompt GEMM on Arm NEON (Y [M, N] = X [M, K] W^T, int4 and lut4 rows32 read in place, W4A8
 * with natural-order activations): rows in blocks of NEON_NCB_BYTES of weights (kept in L2 while
 * every token tile passes over them), tiles of 2 rows x 4 tokens through gemv_neon.c's
 * tile_4bit_a8_neon, so a token's result is its decode product's, bit for bit, whatever tokens
 * share the call. On the neon-i8mm build the tiles are 4 rows x 8 tokens on smmla instead
 * (gemm_i8mm_neon.c). Int8 linears take the decode product per token (gemm.c). */
#ifdef SQ_NEON
#define NEON_NCB_BYTES (128 * 1024)

#ifdef SQ_I8MM
#include "gemm_i8mm_neon.c"
#endif

/* rows [n0, n1) for all M tokens into Yw (token t's row at Yw + t * ldy, column n - n0) */
static void gemm_4bit_block_neon(const sq_linear *L, const sq_act *a, int64_t M, float *Yw, int64_t ldy, int64_t n0,
                                 int64_t n1) {
    const int lut = L->kind == KIND_LUT4;
    for (int64_t t = 0; t < M; t += 4)
        for (int64_t n = n0; n < n1; n += 2) {
            const int R = n1 - n < 2 ? 1 : 2, T = M - t < 4 ? (int)(M - t) : 4;
            float *y = Yw + t * ldy + (n - n0);
#define SQ_GEMM_CASE(R_, T_) \
    case 8 * R_ + T_: \
        if (lut) tile_4bit_a8_neon(L, a + t, y, ldy, n, 0, R_, T_, 1, 0); \
        else tile_4bit_a8_neon(L, a + t, y, ldy, n, 0, R_, T_, 0, 0); \
        break;
            switch (8 * R + T) {
                SQ_GEMM_CASE(1, 1) SQ_GEMM_CASE(1, 2) SQ_GEMM_CASE(1, 3) SQ_GEMM_CASE(1, 4)
                SQ_GEMM_CASE(2, 1) SQ_GEMM_CASE(2, 2) SQ_GEMM_CASE(2, 3) SQ_GEMM_CASE(2, 4)
            }
#undef SQ_GEMM_CASE
        }
}

/* Y [M, N] (fp32), or ybf [M, N] (bf16, round to nearest even) when ybf is not NULL (Y may then be
 * NULL: each row block goes through a per-thread scratch). Returns 0, or -1 out of memory. */
static int gemm_4bit_a8_neon(const sq_linear *L, const sq_act *a, int64_t M, float *Y, uint16_t *ybf) {
    const int64_t K = L->k, N = L->n;
    int64_t nc = NEON_NCB_BYTES / (K / 2), nthr = 1;
#ifdef _OPENMP
    nthr = omp_get_max_threads();
#endif
    nc = nc < 16 ? 16 : nc - nc % 16;
    int64_t nblocks = (N + nc - 1) / nc;
    nblocks = (nblocks + nthr - 1) / nthr * nthr; /* a multiple of the threads: the same rows each */
    nc = ((N + nblocks - 1) / nblocks + 15) / 16 * 16;
    nblocks = (N + nc - 1) / nc;
    void *pk = NULL;
#ifdef SQ_I8MM
    if (M >= 2 && !(pk = i8mm_pack(L, a, M))) return -1;
#endif
    int oom = 0;
#pragma omp parallel
    {
        float *yblk = ybf ? malloc(sizeof(float) * M * nc) : NULL;
        if (ybf && !yblk) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t n0 = b * nc, n1 = (b + 1) * nc < N ? (b + 1) * nc : N;
            if (ybf && !yblk) continue;
            float *Yw = ybf ? yblk : Y + n0;
            const int64_t ldy = ybf ? n1 - n0 : N;
            if (pk) {
#ifdef SQ_I8MM
                gemm_4bit_block_i8mm(L, a, pk, M, Yw, ldy, n0, n1);
#endif
            } else {
                gemm_4bit_block_neon(L, a, M, Yw, ldy, n0, n1);
            }
            if (ybf)
                for (int64_t t = 0; t < M; t++)
                    for (int64_t j = 0; j < n1 - n0; j++) ybf[t * N + n0 + j] = to_bf(yblk[t * (n1 - n0) + j]);
        }
        free(yblk);
    }
    free(pk);
    return oom ? -1 : 0;
}
#endif
