/* A portable model of the AMX tile unit (Intel SDM vol. 2, TILELOADD / TILESTORED / TILEZERO /
 * TDPBUSD / TDPBF16PS, palette 1): eight tiles of at most 16 rows x 64 bytes and the per-tile
 * shape of the loaded configuration. The AMX kernels are written once against the T_* macros
 * (gemm_tiles.c); compiled over this model they run, and are tested, on every CPU, and the AMX
 * build's hardware tiles are tested against it (tests/test_amx.py).
 *
 * TDPBUSD is exact (int32 sums, wrapping). TDPBF16PS follows the SDM's pseudocode: per pair the
 * two products (exact in fp32) are added to the accumulator one after the other, each addition
 * rounded to nearest even, denormal inputs and results flushed to zero. */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile i (i < 8) */
    uint8_t rows[16];   /* rows of tile i */
} sq_tilecfg;           /* the 64-byte LDTILECFG operand */

typedef struct {
    sq_tilecfg cfg;
    uint8_t t[8][16][64];
} sq_tiles;

static void tm_loadconfig(sq_tiles *tm, const sq_tilecfg *cfg) {
    tm->cfg = *cfg;
    memset(tm->t, 0, sizeof tm->t);
}

static void tm_zero(sq_tiles *tm, int i) { memset(tm->t[i], 0, sizeof tm->t[i]); }

/* rows of tile i from base, one every `stride` bytes; the bytes past colsb and rows are zero */
static void tm_load(sq_tiles *tm, int i, const void *base, int64_t stride) {
    memset(tm->t[i], 0, sizeof tm->t[i]);
    for (int r = 0; r < tm->cfg.rows[i]; r++) memcpy(tm->t[i][r], (const uint8_t *)base + r * stride, tm->cfg.colsb[i]);
}

static void tm_store(const sq_tiles *tm, int i, void *base, int64_t stride) {
    for (int r = 0; r < tm->cfg.rows[i]; r++) memcpy((uint8_t *)base + r * stride, tm->t[i][r], tm->cfg.colsb[i]);
}

/* C[m][n] (int32) += sum_{k, j<4} A[m] byte 4k+j (unsigned) * B[k] byte 4n+j (signed) */
static void tm_dpbusd(sq_tiles *tm, int c, int a, int b) {
    const int M = tm->cfg.rows[c], N = tm->cfg.colsb[c] / 4, K = tm->cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t acc;
            memcpy(&acc, tm->t[c][m] + 4 * n, 4);
            uint32_t u = (uint32_t)acc; /* wrapping sums, as the hardware's */
            for (int k = 0; k < K; k++)
                for (int j = 0; j < 4; j++)
                    u += (uint32_t)((int32_t)tm->t[a][m][4 * k + j] * (int32_t)(int8_t)tm->t[b][k][4 * n + j]);
            memcpy(tm->t[c][m] + 4 * n, &u, 4);
        }
}

static inline float tm_ftz(float x) { return fabsf(x) < 1.17549435e-38f ? 0.f * x : x; }

static inline float tm_bf(const uint8_t *p) { /* a bf16 in memory order -> fp32, denormals as zero */
    uint16_t h;
    memcpy(&h, p, 2);
    return tm_ftz(bf(h));
}

/* C[m][n] (fp32) += A[m] bf16 pair k . B[k] bf16 pair n, pair by pair */
static void tm_dpbf16ps(sq_tiles *tm, int c, int a, int b) {
    const int M = tm->cfg.rows[c], N = tm->cfg.colsb[c] / 4, K = tm->cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, tm->t[c][m] + 4 * n, 4);
            for (int k = 0; k < K; k++) {
                const volatile float p0 = tm_bf(tm->t[a][m] + 4 * k) * tm_bf(tm->t[b][k] + 4 * n);
                const volatile float p1 = tm_bf(tm->t[a][m] + 4 * k + 2) * tm_bf(tm->t[b][k] + 4 * n + 2);
                acc = tm_ftz(acc + p0); /* volatile: no fused or reassociated form of these sums */
                acc = tm_ftz(acc + p1);
            }
            memcpy(tm->t[c][m] + 4 * n, &acc, 4);
        }
}
