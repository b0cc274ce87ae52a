/* The decode products' dispatch (which version a build runs) and schedule (how a product's rows
 * are split over the threads of the decode step's parallel region). */

/* Products are split in two so that a whole decode step runs in one parallel region:
 * prep() runs on one thread (inside an `omp single`), products() is entered by every thread of
 * the region and ends in a barrier. */
static void prep(const sq_linear *L, const float *x, sq_act *a) {
    if (a->ti && a16_on(L, a->ti, a->ti->m)) a16_pack(L, x, a->ti, a->col); /* the step's products take the tiles */
    else if (L->kind != KIND_BF16) quantize_act(x, L, a);
    a->x = x;
    a->epoch = (a->epoch + 1) & 0xffffffffu;
}

/* The dispatch table: the decode product each (weight kind, activation order) takes in this build.
 * int4 and lut4 are indexed by sq_act.paired (0 natural, 1 AVX2 paired, 2 AVX512 quad: act.c). */
typedef void (*gemv_fn)(const sq_linear *, const sq_act *, float *, int64_t, int64_t);
static const gemv_fn GEMV_Q4[3] = {
#ifdef SQ_NEON
    gemv_q4_a8_neon, /* Arm: natural order, sdot (gemv_neon.c) */
#else
    gemv_q4_a8_c,
#endif
#ifdef SQ_AVX2
    gemv_q4_a8pair_avx2,
#else
    gemv_q4_a8_c,
#endif
#ifdef SQ_AVX512
    gemv_q4_a8quad_avx512,
#else
    gemv_q4_a8_c,
#endif
};
static const gemv_fn GEMV_L4[3] = {
#ifdef SQ_NEON
    gemv_l4_a8_neon,
#else
    gemv_l4_a8_c,
#endif
#ifdef SQ_AVX2
    gemv_l4_a8pair_avx2,
#else
    gemv_l4_a8_c,
#endif
#ifdef SQ_AVX512
    gemv_l4_a8quad_avx512,
#else
    gemv_l4_a8_c,
#endif
};
#if defined(SQ_AVX512)
static const gemv_fn GEMV_Q8 = gemv_q8_a8_avx512;
#elif defined(SQ_AVX2)
static const gemv_fn GEMV_Q8 = gemv_q8_a8_avx2;
#elif defined(SQ_NEON)
static const gemv_fn GEMV_Q8 = gemv_q8_a8_neon;
#else
static const gemv_fn GEMV_Q8 = gemv_q8_a8_c;
#endif

/* rows [r0, r1) of y = L x (+ bias) */
static void rows(const sq_linear *L, const sq_act *a, float *y, int64_t r0, int64_t r1) {
#ifdef SQ_EXACT
    if (L->kind != KIND_BF16) gemv_exact_f32(L, a->x, y, r0, r1);
    else
#endif
    if (L->kind == KIND_INT4) GEMV_Q4[a->paired](L, a, y, r0, r1);
    else if (L->kind == KIND_LUT4) GEMV_L4[a->paired](L, a, y, r0, r1);
    else if (L->kind == KIND_INT8) GEMV_Q8(L, a, y, r0, r1);
    else gemv_bf16_f32(L, a->x, y, r0, r1);
    if (L->bias)
        for (int64_t n = r0; n < r1; n++) y[n] += bf(L->bias[n]);
}

/* Work stealing. The blocks of a product are split into one contiguous range per thread, as a
 * static schedule would; a thread takes blocks from the front of its own range and, when that
 * is empty, from the back of the other threads' ranges. On a quiet machine each thread streams
 * its own contiguous rows (what the hardware prefetcher wants; a dynamic schedule that deals
 * blocks out in turn was measured ~8% slower); on a shared one a thread that loses its core
 * for a while no longer holds up the whole step at the next barrier with its untouched half.
 * A slot packs (epoch:32 | lo:16 | hi:16) in one word changed by compare-and-swap; a slot whose
 * epoch is not the current product's is read as its initial range, so no barrier is needed to
 * reset the slots (every owner rewrites its own slot once per product, so a stale epoch is one
 * product old; only a slot above a later-lowered thread count could wait 2^32 products). */
static int claim(sq_slot *s, uint64_t ep, uint64_t lo0, uint64_t hi0, int back, int64_t *blk, int64_t *cnt) {
    uint64_t cur = __atomic_load_n(&s->v, __ATOMIC_ACQUIRE);
    for (;;) {
        const int fresh = (cur >> 32) == ep;
        const uint64_t lo = fresh ? (cur >> 16) & 0xffff : lo0, hi = fresh ? cur & 0xffff : hi0;
        if (lo >= hi) {
            if (!fresh) __atomic_compare_exchange_n(&s->v, &cur, ep << 32 | lo << 16 | hi, 0, __ATOMIC_ACQ_REL,
                                                    __ATOMIC_ACQUIRE);
            return 0;
        }
        /* the owner takes up to 4 blocks while a quarter of its range is left (fewer compare-and-
         * swaps: each one is a full barrier, ~2% of a decode step at one per block) */
        uint64_t q = back ? 1 : (hi - lo) / 4;
        q = q < 1 ? 1 : q > 8 ? 8 : q;
        const uint64_t nlo = back ? lo : lo + q, nhi = back ? hi - 1 : hi;
        if (__atomic_compare_exchange_n(&s->v, &cur, ep << 32 | nlo << 16 | nhi, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *blk = back ? (int64_t)hi - 1 : (int64_t)lo;
            *cnt = (int64_t)q;
            return 1;
        }
    }
}

/* rows [r0, r1) of Y[t] = L x_t (+ bias) for M tokens (Y + t * ldy): the batched decode step's
 * products (batch.c). Each token's result is the single-token product's (rows()), bit for bit:
 * int4/lut4 share each row's unpacked codes between four tokens (AVX512: and its chunk's scales,
 * converted once); the other kinds and builds run rows() per token on the row chunk, still in
 * cache from the previous token. */
static void rows_many(const sq_linear *L, const sq_act *a, int64_t M, float *Y, int64_t ldy, int64_t r0, int64_t r1) {
    void (*many)(const sq_linear *, const sq_act *, int64_t, float *, int64_t, int64_t, int64_t) = NULL;
    if (a16_on(L, a[0].ti, M)) many = many_q4_a16; /* opt-in: int8 tiles, 15-bit activations (gemv_tiles.c) */
    else if (M == 1) { /* the decode step's products */
        rows(L, a, Y, r0, r1);
        return;
    }
#if defined(SQ_AVX2) && !defined(SQ_EXACT)
    else if (is_q4(L) && a[0].paired == 1) many = gemv_4bit_a8pair_many_avx2;
#ifdef SQ_AVX512
    else if (is_q4(L) && a[0].paired == 2) many = gemv_4bit_a8quad_many_avx512;
#endif
#endif
#if defined(SQ_NEON) && !defined(SQ_EXACT)
    else if (is_q4(L)) many = gemv_4bit_a8_many_neon; /* two rows x four tokens a pass (gemv_neon.c) */
#endif
    if (!many) {
        for (int64_t t = 0; t < M; t++) rows(L, a + t, Y + t * ldy, r0, r1);
        return;
    }
    many(L, a, M, Y, ldy, r0, r1);
    if (L->bias)
        for (int64_t t = 0; t < M; t++)
            for (int64_t n = r0; n < r1; n++) Y[t * ldy + n] += bf(L->bias[n]);
}

/* Y[t] = L x_t for M tokens (Y + t * ldy), entered by every thread of the parallel region, ending
 * in a barrier; a[0] carries the schedule's epoch and slots */
static void products_many(const sq_linear *L, const sq_act *a, int64_t M, float *Y, int64_t ldy) {
    const int64_t N = L->n, chunks = (N + 15) / 16;
#ifdef _OPENMP
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    const int nt = 1, t = 0;
#endif
    if (nt == 1 && a16_on(L, a[0].ti, M)) { /* the tile products in one call: 32-row blocks */
        rows_many(L, a, M, Y, ldy, 0, N);
        return;
    }
    if (nt == 1 || nt > SQ_MAXT) {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) rows_many(L, a, M, Y, ldy, c * 16, c * 16 + 16 < N ? c * 16 + 16 : N);
        return;
    }
    /* blocks of >= 16 KiB of weights (one compare-and-swap per ~1 us of streaming) */
    const int64_t rowbytes = is_q4(L) ? L->k / 2 : L->kind == KIND_INT8 ? L->k : 2 * L->k;
    int64_t per = (16384 + 16 * rowbytes - 1) / (16 * rowbytes);
    if (per < 1) per = 1;
    if (per < 2 && a16_on(L, a[0].ti, M)) per = 2; /* the tile products' 32-row blocks */
    if ((chunks + per - 1) / per > 0xffff) per = (chunks + 0xfffe) / 0xffff; /* 16-bit block indices */
    const int64_t nb = (chunks + per - 1) / per, rpb = 16 * per;
    const uint64_t ep = a[0].epoch;
    int64_t b, q;
    for (int i = 0; i < nt; i++) {
        const int v = (t + i) % nt;
        while (claim(&a[0].slot[v], ep, (uint64_t)(nb * v / nt), (uint64_t)(nb * (v + 1) / nt), i > 0, &b, &q))
            rows_many(L, a, M, Y, ldy, b * rpb, (b + q) * rpb < N ? (b + q) * rpb : N);
    }
#pragma omp barrier
}

/* one token's products (the decode step) */
static void products(const sq_linear *L, const sq_act *a, float *y) { products_many(L, a, 1, y, L->n); }

/* y = L x (+ bias), from outside a parallel region */
static void linear(const sq_linear *L, const float *x, sq_act *a, float *y) {
    prep(L, x, a);
#pragma omp parallel
    products(L, a, y);
}
