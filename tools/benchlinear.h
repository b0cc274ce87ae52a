/* The random linears the kernel benches time (gemvbench.c, exactbench.c), after csrc's sq.c:
 * `copies` copies of one K x N linear with group size G, int4 or (lut) lut4, from srand(1). */
static sq_linear *bench_linears(int64_t copies, int64_t K, int64_t N, int64_t G, int lut) {
    sq_linear *L = calloc(copies, sizeof(sq_linear));
    srand(1);
    for (int64_t c = 0; c < copies; c++) { /* codes uniform, scales 0.01..0.07, zeros small */
        uint8_t *q = aligned_alloc(64, N * K / 2);
        uint16_t *sz = malloc(sizeof(uint16_t) * 2 * N * (K / G));
        for (int64_t i = 0; i < N * K / 2; i++) q[i] = (uint8_t)rand();
        for (int64_t i = 0; i < N * (K / G); i++) {
            sz[2 * i] = to_bf(0.01f * (1 + rand() % 7));
            sz[2 * i + 1] = to_bf(-0.001f * (rand() % 5));
        }
        int8_t *lv = NULL;
        if (lut) { /* lut4: 16 ascending levels per row, spanning most of the int8 range */
            lv = malloc(16 * N);
            for (int64_t n = 0; n < N; n++)
                for (int j = 0; j < 16; j++) lv[16 * n + j] = (int8_t)(-120 + 16 * j + rand() % 8);
        }
        L[c] = (sq_linear){.q = q, .sz = sz, .lut = lv, .kind = lut ? KIND_LUT4 : KIND_INT4, .n = N, .k = K, .g = G};
    }
    return L;
}
