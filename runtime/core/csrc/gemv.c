/* The decode products' portable references (natural activation order), rows [r0, r1) of
 * y = W x: int4, lut4 and int8 weights x int8 activations (gemv_*_a8_c), bf16 weights x fp32, and the
 * exact fp64 row dot (the head refinement and the SQ_EXACT build). The SIMD versions are in
 * gemv_avx2.c and gemv_avx512.c, the dispatch between them in gemv_dispatch.c; tests compare
 * every build against these. */

/* int4 (lut == NULL: codes q stand for q - 8, applied through the groups' quantized activation
 * sums) and lut4 (the codes index the row's 16 levels, no offset) */
static inline void gemv_4bit_a8_c(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1, int lut) {
    const int64_t K = L->k, N = L->n, G = L->g, bpg = G / 32, ngroups = K / G;
    static const int8_t ident[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *w = L->q + n * (K / 2);
        const int8_t *t = lut ? L->lut + 16 * n : ident;
        float acc = 0.f;
        for (int64_t gi = 0; gi < ngroups; gi++) {
            const uint16_t *p = L->sz + 2 * (gi * N + n);
            float s = bf(p[0]), z = bf(p[1]), gacc = 0.f;
            for (int64_t b = gi * bpg; b < (gi + 1) * bpg; b++) {
                const uint8_t *wb = w + 16 * b;
                const int8_t *xb = a->q + 32 * b;
                for (int i = 0; i < 4; i++) { /* sub-block i: its own activation scale */
                    int32_t d = 0;
                    for (int j = 4 * i; j < 4 * i + 4; j++) d += t[wb[j] & 15] * xb[j] + t[wb[j] >> 4] * xb[j + 16];
                    gacc += (float)d * a->s8[4 * b + i];
                }
            }
            acc += gacc * s + z * a->gsum[gi] - (lut ? 0.f : 8.f * s * a->gqsum[gi]);
        }
        y[n] = acc;
    }
}

static __attribute__((unused)) void gemv_q4_a8_c(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    gemv_4bit_a8_c(L, a, y, r0, r1, 0);
}

static __attribute__((unused)) void gemv_l4_a8_c(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    gemv_4bit_a8_c(L, a, y, r0, r1, 1);
}

static __attribute__((unused)) void gemv_q8_a8_c(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
    const int64_t K = L->k;
    for (int64_t n = r0; n < r1; n++) {
        const int8_t *w = (const int8_t *)L->q + n * K;
        float acc = 0.f;
        for (int64_t b = 0; b < K / 32; b++) {
            for (int i = 0; i < 4; i++) { /* sub-block i: its own activation scale */
                int32_t d = 0;
                for (int j = 4 * i; j < 4 * i + 4; j++) d += w[32 * b + j] * a->q[32 * b + j] + w[32 * b + j + 16] * a->q[32 * b + j + 16];
                acc += (float)d * a->s8[4 * b + i];
            }
        }
        y[n] = acc * bf(L->sz[n]);
    }
}

/* sum_j bf16(w[j]) * x[j] (bf16 weights, KV cache rows) */
static inline float dot_bf16(const uint16_t *w, const float *x, int64_t K) {
    float acc = 0.f;
    int64_t j = 0;
#ifdef SQ_AVX2
    __m256 v = _mm256_setzero_ps();
    for (; j + 8 <= K; j += 8) {
        __m256i wi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + j))), 16);
        v = _mm256_fmadd_ps(_mm256_castsi256_ps(wi), _mm256_loadu_ps(x + j), v);
    }
    acc = hsum8(v);
#endif
    for (; j < K; j++) acc += bf(w[j]) * x[j];
    return acc;
}

static void gemv_bf16_f32(const sq_linear *L, const float *x, float *y, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; n++) y[n] = dot_bf16((const uint16_t *)L->q + n * L->k, x, L->k);
}

/* Row n of L times fp32 x in double, from the stored weights (no A8): the top-k refinement
 * and the SQ_EXACT reference build. */
static double exact_row_dot(const sq_linear *L, int64_t n, const float *x) {
    const int64_t K = L->k;
    double acc = 0.0;
    if (is_q4(L)) {
        const uint8_t *w = L->q + n * (K / 2);
        for (int64_t k = 0; k < K; k++) {
            uint8_t byte = w[(k / 32) * 16 + (k % 16)];
            int q = (k % 32) < 16 ? (byte & 15) : (byte >> 4);
            const uint16_t *p = L->sz + 2 * ((k / L->g) * L->n + n);
            const float c = L->kind == KIND_LUT4 ? (float)L->lut[16 * n + q] : q - 8.f;
            acc += (double)(c * bf(p[0]) + bf(p[1])) * x[k];
        }
    } else if (L->kind == KIND_INT8) {
        const int8_t *w = (const int8_t *)L->q + n * K;
        const float s = bf(L->sz[n]);
        for (int64_t k = 0; k < K; k++) acc += (double)(w[k] * s) * x[k];
    } else {
        const uint16_t *w = (const uint16_t *)L->q + n * K;
        for (int64_t k = 0; k < K; k++) acc += (double)bf(w[k]) * x[k];
    }
    return acc;
}

#ifdef SQ_EXACT /* reference build: fp32 activations, no A8 (tests measure the A8 error against it) */
static void gemv_exact_f32(const sq_linear *L, const float *x, float *y, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; n++) y[n] = (float)exact_row_dot(L, n, x);
}
#endif

