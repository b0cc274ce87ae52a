/* The head's logits made exact where they matter: the top REFINE_TOP of an int8/int4 head
 * recomputed in fp64 from the stored weights (refine_top), and a split head's refinement: the
 * REFINE_SPLIT largest first-plane logits selected (select_top) and recomputed from both planes
 * (split_select, split_rows). */

/* Recompute the k largest logits exactly (fp32 activations, no A8), so that greedy picks
 * and near-ties do not depend on the activation rounding (the torch path does the same). */
static void refine_top(const sq_linear *H, const float *x, float *logits, int64_t k) {
    int64_t idx[16];
    float val[16];
    int cnt = 0;
    if (k > 16) k = 16;
    if (k <= 0) return;
    for (int64_t i = 0; i < H->n; i++) {
        float v = logits[i];
        if (cnt == k && v <= val[cnt - 1]) continue;
        int j = cnt < k ? cnt++ : (int)k - 1;
        while (j > 0 && val[j - 1] < v) { val[j] = val[j - 1]; idx[j] = idx[j - 1]; j--; }
        val[j] = v;
        idx[j] = i;
    }
    for (int c = 0; c < cnt; c++) logits[idx[c]] = (float)exact_row_dot(H, idx[c], x);
}

/* A split head's refinement. The head product read the first (int4) plane only; the k largest of those logits are
 * recomputed in fp32 from both planes (fp32 activations, no A8) -- the set torch's topk gives
 * (up to ties). Selection in ~3 passes: the max; a threshold from a histogram of every 8th
 * logit (buckets of 1/32 below the max) that leaves somewhat more than k above it; every
 * logit at or above it (lowered until there are >= k); among those, the same histogram to find
 * the k-th, and of its bucket the largest (value, then lower index). Row dots per group g:
 * with D_q = sum x q, D_r = sum x r, X = sum x over the group, the stored row gives
 *   s D_q + rs D_r + (z - 8 s - 8 rs) X. */
#define SEL_BUCKETS 4096

/* whether index i comes before j in the selection's order: larger value first, then lower index */
static inline int sel_before(const float *v, int32_t i, int32_t j) {
    return v[i] > v[j] ? 1 : v[i] < v[j] ? 0 : i < j;
}

/* a[0..n) into the selection's order (heapsort: in place, no context-free comparator needed) */
static void sel_sort(int32_t *a, int64_t n, const float *v) {
    for (int64_t end = n, start = n / 2; end > 1;) {
        int64_t root;
        if (start > 0) {
            root = --start; /* heapify */
        } else {
            const int32_t t = a[0]; /* move the last-ordered element to the end */
            a[0] = a[--end];
            a[end] = t;
            root = 0;
        }
        for (int64_t c; (c = 2 * root + 1) < end; root = c) { /* sift down: the later-ordered child up */
            if (c + 1 < end && sel_before(v, a[c], a[c + 1])) c++;
            if (!sel_before(v, a[root], a[c])) break;
            const int32_t t = a[root];
            a[root] = a[c];
            a[c] = t;
        }
    }
}

static inline int sel_bucket(float mx, float v) { /* NaN and everything 128 below the max: the last */
    const float d = (mx - v) * 32.f;
    return d < (float)(SEL_BUCKETS - 1) ? (int)d : SEL_BUCKETS - 1;
}

static float max_of(const float *v, int64_t n) {
    float mx = -INFINITY;
    int64_t i = 0;
#ifdef SQ_AVX512
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(v + i)); /* a NaN lane keeps m */
    mx = _mm512_reduce_max_ps(m);
#endif
    for (; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    return mx;
}

/* indices i with v[i] >= t, in order */
static int64_t at_or_above(const float *v, int64_t n, float t, int32_t *out) {
    int64_t c = 0, i = 0;
#ifdef SQ_AVX512
    const __m512 tv = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= n; i += 16, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), tv, _CMP_GE_OQ);
        _mm512_mask_compressstoreu_epi32(out + c, k, idx);
        c += __builtin_popcount(k);
    }
#endif
    for (; i < n; i++)
        if (v[i] >= t) out[c++] = (int32_t)i;
    return c;
}

/* the k largest of v[cand[0..c)] (c >= k) into out */
static int64_t top_of(const float *v, const int32_t *cand, int64_t c, int64_t k, float mx, int32_t *out,
                      int32_t *tie) {
    uint32_t hist[SEL_BUCKETS] = {0};
    for (int64_t i = 0; i < c; i++) hist[sel_bucket(mx, v[cand[i]])]++;
    int64_t above = 0, o = 0, t = 0;
    int b = 0;
    while (above + (int64_t)hist[b] < k) above += hist[b++];
    for (int64_t i = 0; i < c; i++) {
        const int bi = sel_bucket(mx, v[cand[i]]);
        if (bi < b) out[o++] = cand[i];
        else if (bi == b) tie[t++] = cand[i];
    }
    sel_sort(tie, t, v);
    for (int64_t i = 0; o < k && i < t; i++) out[o++] = tie[i];
    return o;
}

/* tie: room for n indices */
static int64_t select_top(const float *v, int64_t n, int64_t k, int32_t *out, int32_t *tie) {
    if (k <= 0) return 0;
    if (k >= n) {
        for (int64_t i = 0; i < n; i++) out[i] = (int32_t)i;
        return n;
    }
    const float mx = max_of(v, n);
    if (!(mx > -INFINITY)) return 0; /* every logit NaN or -inf: nothing to refine */
    uint32_t hist[SEL_BUCKETS] = {0};
    for (int64_t i = 0; i < n; i += 8) hist[sel_bucket(mx, v[i])]++;
    const int64_t want = k / 8 + k / 32 + 8; /* sampled logits above the threshold */
    int64_t above = 0;
    int b = 0;
    while (b < SEL_BUCKETS - 1 && above + (int64_t)hist[b] < want) above += hist[b++];
    float t = b < SEL_BUCKETS - 1 ? mx - (float)(b + 1) / 32.f : -INFINITY;
    int64_t c;
    for (;;) {
        c = at_or_above(v, n, t, tie);
        if (c >= k || t == -INFINITY) break;
        const float d = 2.f * (mx - t);
        t = d > 128.f ? -INFINITY : mx - d;
    }
    if (c <= k) { /* NaN logits are never candidates */
        memcpy(out, tie, sizeof(int32_t) * (size_t)c);
        return c;
    }
    return top_of(v, tie, c, k, mx, out, tie + c);
}

#ifdef SQ_AVX512
typedef __m512 nibv; /* nib_dot's accumulator */
#define nib_zero _mm512_setzero_ps
#define nib_sum _mm512_reduce_add_ps
#define nib_fma(v, c, acc) _mm512_fmadd_ps(v, _mm512_set1_ps(c), acc)
static inline __m512 nib_dot(__m128i b, const float *xb, __m512 acc) { /* 32 codes of a rows32 block */
    const __m128i m = _mm_set1_epi8(15);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m))), _mm512_loadu_ps(xb), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m))),
                           _mm512_loadu_ps(xb + 16), acc);
}
#elif defined(SQ_AVX2)
typedef __m256 nibv;
#define nib_zero _mm256_setzero_ps
#define nib_sum hsum8
#define nib_fma(v, c, acc) _mm256_fmadd_ps(v, _mm256_set1_ps(c), acc)
static inline __m256 nib_dot(__m128i b, const float *xb, __m256 acc) {
    const __m128i m = _mm_set1_epi8(15), lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xb), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xb + 8), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xb + 16), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xb + 24), acc);
}
#endif

/* row n of a split linear's first plane alone (a row its second plane does not cover) */
static float first_row_dot(const sq_linear *L, int64_t n, const float *x, const float *gsum) {
    const int64_t K = L->k, g = L->g, G = K / g;
    const uint8_t *w = L->q + n * (K / 2);
    float acc = 0.f;
#ifdef SQ_AVX2
    nibv av = nib_zero();
    for (int64_t gi = 0; gi < G; gi++) {
        nibv aq = nib_zero();
        for (int64_t b = gi * g / 32; b < (gi + 1) * g / 32; b++)
            aq = nib_dot(_mm_loadu_si128((const __m128i *)(w + 16 * b)), x + 32 * b, aq);
        const uint16_t *p = L->sz + 2 * (gi * L->n + n);
        const float s = bf(p[0]), z = bf(p[1]);
        av = nib_fma(aq, s, av);
        acc += (z - 8.f * s) * gsum[gi];
    }
    return nib_sum(av) + acc;
#else
    for (int64_t gi = 0; gi < G; gi++) {
        float dq = 0.f;
        for (int64_t b = gi * g / 32; b < (gi + 1) * g / 32; b++) {
            const uint8_t *wb = w + 16 * b;
            const float *xb = x + 32 * b;
            for (int j = 0; j < 16; j++) dq += (float)(wb[j] & 15) * xb[j] + (float)(wb[j] >> 4) * xb[j + 16];
        }
        const uint16_t *p = L->sz + 2 * (gi * L->n + n);
        const float s = bf(p[0]), z = bf(p[1]);
        acc += s * dq + (z - 8.f * s) * gsum[gi];
    }
    return acc;
#endif
}

static float split_row_dot(const sq_linear *L, int64_t n, const float *x, const float *gsum) {
    const int64_t K = L->k, g = L->g, G = K / g, rn = res_row(L, n);
    if (rn < 0) return first_row_dot(L, n, x, gsum);
    const uint8_t *w = L->q + n * (K / 2), *r = L->res + rn * (K / 2);
    const uint16_t *rs = L->rsc + rn * G;
    float acc = 0.f;
#ifdef SQ_AVX2
    /* the planes' group dots stay in vectors, scaled there: one horizontal sum per row */
    nibv av = nib_zero();
    for (int64_t gi = 0; gi < G; gi++) {
        nibv aq = nib_zero(), ar = nib_zero();
        for (int64_t b = gi * g / 32; b < (gi + 1) * g / 32; b++) {
            aq = nib_dot(_mm_loadu_si128((const __m128i *)(w + 16 * b)), x + 32 * b, aq);
            ar = nib_dot(_mm_loadu_si128((const __m128i *)(r + 16 * b)), x + 32 * b, ar);
        }
        const uint16_t *p = L->sz + 2 * (gi * L->n + n);
        const float s = bf(p[0]), z = bf(p[1]), q = bf(rs[gi]);
        av = nib_fma(aq, s, nib_fma(ar, q, av));
        acc += (z - 8.f * s - 8.f * q) * gsum[gi];
    }
    return nib_sum(av) + acc;
#else
    for (int64_t gi = 0; gi < G; gi++) {
        float dq = 0.f, dr = 0.f;
        for (int64_t b = gi * g / 32; b < (gi + 1) * g / 32; b++) {
            const uint8_t *wb = w + 16 * b, *rb = r + 16 * b;
            const float *xb = x + 32 * b;
            for (int j = 0; j < 16; j++) {
                dq += (float)(wb[j] & 15) * xb[j] + (float)(wb[j] >> 4) * xb[j + 16];
                dr += (float)(rb[j] & 15) * xb[j] + (float)(rb[j] >> 4) * xb[j + 16];
            }
        }
        const uint16_t *p = L->sz + 2 * (gi * L->n + n);
        const float s = bf(p[0]), z = bf(p[1]), q = bf(rs[gi]);
        acc += s * dq + q * dr + (z - 8.f * s - 8.f * q) * gsum[gi];
    }
    return acc;
#endif
}

/* the candidates (one thread, then a barrier) ... */
static void split_select(const sq_linear *H, sq_work *w, const float *x, const float *logits, int64_t k) {
    w->ncand = select_top(logits, H->n, k, w->cand, w->tie);
    /* in row order (through a bitmap in the tie buffer, free again): consecutive candidates
     * then share the pages of the [K/g, N, 2] scales, K/g lines far apart per row */
    uint64_t *bits = (uint64_t *)w->tie;
    const int64_t nw = (H->n + 63) / 64;
    memset(bits, 0, sizeof(uint64_t) * (size_t)nw);
    for (int64_t i = 0; i < w->ncand; i++) bits[w->cand[i] >> 6] |= 1ull << (w->cand[i] & 63);
    int64_t o = 0;
    for (int64_t wi = 0; wi < nw; wi++)
        for (uint64_t b = bits[wi]; b; b &= b - 1) w->cand[o++] = (int32_t)(wi * 64 + __builtin_ctzll(b));
    for (int64_t gi = 0; gi < H->k / H->g; gi++) {
        float s = 0.f;
        for (int64_t j = gi * H->g; j < (gi + 1) * H->g; j++) s += x[j];
        w->gsum[gi] = s;
    }
}

/* Every cache line split_row_dot reads for row n requested ahead: both planes' bytes, the
 * residual scales and one (scale, zero) line per group. The first line of each plane and of
 * the residual scales by a demand load: the rows are scattered over ~300 MB of 4 KiB pages and
 * a software prefetch that misses the TLB is dropped (prefetches alone measured no faster);
 * the loads walk the page tables early. */
static inline void touch(const void *p) {
    const uint8_t v = *(const volatile uint8_t *)p;
    __asm__ volatile("" ::"r"(v));
}

static inline void split_row_prefetch(const sq_linear *L, int64_t n) {
    const int64_t K = L->k, G = K / L->g, rn = res_row(L, n);
    touch(L->q + n * (K / 2));
    if (rn >= 0) {
        touch(L->res + rn * (K / 2));
        touch(L->rsc + rn * G);
    }
    for (int64_t o = 64; o < K / 2; o += 64) {
        __builtin_prefetch(L->q + n * (K / 2) + o);
        if (rn >= 0) __builtin_prefetch(L->res + rn * (K / 2) + o);
    }
    for (int64_t gi = 0; gi < G; gi++) __builtin_prefetch(L->sz + 2 * (gi * L->n + n));
}

/* ... and their rows, by every thread of the region, each requested SPLIT_AHEAD rows before it
 * is read. Split head of the 1.7B shape, 2048 rows (per-step timers in a scratch build, not
 * kept; medians of 192 steps, 2 rounds): 618-639 us -> 450-455 with the candidates in row
 * order and these requests (the row order alone, or software prefetches alone: no change) */
#define SPLIT_AHEAD 4
static void split_rows(const sq_linear *H, sq_work *w, const float *x, float *logits) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < w->ncand; i++) {
        if (i + SPLIT_AHEAD < w->ncand) split_row_prefetch(H, w->cand[i + SPLIT_AHEAD]);
        logits[w->cand[i]] = split_row_dot(H, w->cand[i], x, w->gsum);
    }
}

/* Exact logits of head rows ids[0..n) for the final-normed state x: both planes of a split head
 * (split_row_dot, as its refinement computes them), else the stored weights in fp64 (refine_top's),
 * the same bits the step gives the rows it refines. A grammar's allowed tokens are refined so
 * (runtime/serve/engine.py). Returns 0, -1 out of memory. */
int sq_head_exact(const sq_model *m, const float *x, const int32_t *ids, int64_t n, float *out) {
    const sq_linear *H = &m->head;
    if (!H->res) {
        for (int64_t i = 0; i < n; i++) out[i] = (float)exact_row_dot(H, ids[i], x);
        return 0;
    }
    const int64_t G = H->k / H->g;
    float *gsum = malloc(sizeof(float) * (size_t)G);
    if (!gsum) return -1;
    for (int64_t gi = 0; gi < G; gi++) { /* split_select's sums */
        float s = 0.f;
        for (int64_t j = gi * H->g; j < (gi + 1) * H->g; j++) s += x[j];
        gsum[gi] = s;
    }
    for (int64_t i = 0; i < n; i++) out[i] = split_row_dot(H, ids[i], x, gsum);
    free(gsum);
    return 0;
}
