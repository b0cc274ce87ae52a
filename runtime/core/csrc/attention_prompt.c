/* Attention for a chunk of prompt tokens (attention_many): blocks of PQB queries against one KV
 * head's rows in fp32, scores transposed (scores_t); the AVX512, AVX2 and portable loops inline. */

#ifdef SQ_AVX512
#define PQB 16 /* queries per attention work item: one lane each */
#else
#define PQB 8
#endif

/* pt[(j - klo) * PQB + i] = scale * q_i . K_j for queries i < nq (rows of q, stride ldq) and
 * keys j in [klo, khi) of one KV head, read from Kf (fp32 [*, D], the head's cache rows
 * converted once per chunk by attention_many): the scores of one key for all PQB queries are
 * contiguous, so the softmax runs across queries in one vector and P.V reads one cache line per
 * key. AVX2 (8 queries) and AVX512 (16): the (scaled) queries transposed to qt [D][PQB], so one
 * FMA multiplies one key element (broadcast) with all PQB queries; 4 keys x 2 accumulators in
 * registers, no horizontal sums. Lanes i >= nq get 0 (masked by the softmax). */
static void scores_t(const sq_model *m, const float *Kf, const float *q, int64_t ldq, int64_t nq, int64_t klo,
                     int64_t khi, float scale, float *pt) {
    const int64_t D = m->head_dim;
#ifdef SQ_AVX512
    if (D % 2 == 0 && D <= 512) { /* the AVX2 loop below on 16 lanes */
        float qt[512 * PQB] __attribute__((aligned(64)));
        for (int64_t d = 0; d < D; d++)
            for (int64_t i = 0; i < PQB; i++) qt[d * PQB + i] = i < nq ? q[i * ldq + d] * scale : 0.f;
        int64_t j = klo;
        for (; j + 4 <= khi; j += 4) {
            const float *k0 = Kf + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t d = 0; d < D; d += 2) {
                const __m512 q0 = _mm512_load_ps(qt + d * PQB), q1 = _mm512_load_ps(qt + (d + 1) * PQB);
                a0 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k0[d]), a0);
                b0 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k0[d + 1]), b0);
                a1 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k1[d]), a1);
                b1 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k1[d + 1]), b1);
                a2 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k2[d]), a2);
                b2 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k2[d + 1]), b2);
                a3 = _mm512_fmadd_ps(q0, _mm512_set1_ps(k3[d]), a3);
                b3 = _mm512_fmadd_ps(q1, _mm512_set1_ps(k3[d + 1]), b3);
            }
            float *o = pt + (j - klo) * PQB;
            _mm512_storeu_ps(o, _mm512_add_ps(a0, b0));
            _mm512_storeu_ps(o + PQB, _mm512_add_ps(a1, b1));
            _mm512_storeu_ps(o + 2 * PQB, _mm512_add_ps(a2, b2));
            _mm512_storeu_ps(o + 3 * PQB, _mm512_add_ps(a3, b3));
        }
        for (; j < khi; j++) {
            const float *kr = Kf + j * D;
            __m512 a = _mm512_setzero_ps(), b = a;
            for (int64_t d = 0; d < D; d += 2) {
                a = _mm512_fmadd_ps(_mm512_load_ps(qt + d * PQB), _mm512_set1_ps(kr[d]), a);
                b = _mm512_fmadd_ps(_mm512_load_ps(qt + (d + 1) * PQB), _mm512_set1_ps(kr[d + 1]), b);
            }
            _mm512_storeu_ps(pt + (j - klo) * PQB, _mm512_add_ps(a, b));
        }
        return;
    }
#elif defined(SQ_AVX2)
    if (D % 2 == 0 && D <= 512 && PQB == 8) {
        float qt[512 * PQB] __attribute__((aligned(32)));
        for (int64_t d = 0; d < D; d++)
            for (int64_t i = 0; i < PQB; i++) qt[d * PQB + i] = i < nq ? q[i * ldq + d] * scale : 0.f;
        int64_t j = klo;
        for (; j + 4 <= khi; j += 4) {
            const float *k0 = Kf + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t d = 0; d < D; d += 2) {
                const __m256 q0 = _mm256_load_ps(qt + d * PQB), q1 = _mm256_load_ps(qt + (d + 1) * PQB);
                a0 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k0 + d), a0);
                b0 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k0 + d + 1), b0);
                a1 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k1 + d), a1);
                b1 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k1 + d + 1), b1);
                a2 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k2 + d), a2);
                b2 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k2 + d + 1), b2);
                a3 = _mm256_fmadd_ps(q0, _mm256_broadcast_ss(k3 + d), a3);
                b3 = _mm256_fmadd_ps(q1, _mm256_broadcast_ss(k3 + d + 1), b3);
            }
            float *o = pt + (j - klo) * PQB;
            _mm256_storeu_ps(o, _mm256_add_ps(a0, b0));
            _mm256_storeu_ps(o + PQB, _mm256_add_ps(a1, b1));
            _mm256_storeu_ps(o + 2 * PQB, _mm256_add_ps(a2, b2));
            _mm256_storeu_ps(o + 3 * PQB, _mm256_add_ps(a3, b3));
        }
        for (; j < khi; j++) {
            const float *kr = Kf + j * D;
            __m256 a = _mm256_setzero_ps(), b = a;
            for (int64_t d = 0; d < D; d += 2) {
                a = _mm256_fmadd_ps(_mm256_load_ps(qt + d * PQB), _mm256_broadcast_ss(kr + d), a);
                b = _mm256_fmadd_ps(_mm256_load_ps(qt + (d + 1) * PQB), _mm256_broadcast_ss(kr + d + 1), b);
            }
            _mm256_storeu_ps(pt + (j - klo) * PQB, _mm256_add_ps(a, b));
        }
        return;
    }
#endif
    for (int64_t j = klo; j < khi; j++)
        for (int64_t i = 0; i < PQB; i++) {
            float acc = 0.f;
            if (i < nq)
                for (int64_t d = 0; d < D; d++) acc += q[i * ldq + d] * Kf[j * D + d];
            pt[(j - klo) * PQB + i] = acc * scale;
        }
}

/* att[t, h*D..] for the queries t in [0, T) at positions p0 + t, head by head, over the cache.
 * qkv: [T, ldq] rows whose first H*D values are the (normed, rotated) queries. scratch: per
 * thread PQB * cap floats; kf, vf: (p0 + T) * D floats each (one KV head's rows in fp32). Query t
 * sees keys (p - window, p], all of [0, p] without one. */
static void attention_many(const sq_model *m, const sq_layer *L, const float *qkv, int64_t ldq, int64_t p0,
                           int64_t T, float *att, float *scratch, float *kf, float *vf) {
    const int64_t H = m->heads, D = m->head_dim, cap = m->cap, grp = H / m->kv_heads, nqb = (T + PQB - 1) / PQB;
    const float scale = (float)m->attn_scale;
    /* keys any query of the chunk sees: [kbeg, p0 + T) */
    const int64_t kbeg = L->window > 0 && p0 + 1 > L->window ? p0 + 1 - L->window : 0;
#pragma omp parallel
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *pt = scratch + (int64_t)tid * PQB * cap;
        for (int64_t g = 0; g < m->kv_heads; g++) { /* one KV head at a time: its rows in fp32, then its queries */
            const kv_rows kv = kv_head(m, L, g);
            const int i8 = (int)m->kv_int8;
#pragma omp for schedule(static)
            for (int64_t j = kbeg; j < p0 + T; j++) {
                const float ks = i8 ? bf(kv.ks[j]) : 1.f, vs = i8 ? bf(kv.vs[j]) : 1.f;
                for (int64_t d = 0; d < D; d++) {
                    kf[j * D + d] = kv_at(kv.k, j * D + d, i8) * ks;
                    vf[j * D + d] = kv_at(kv.v, j * D + d, i8) * vs;
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < grp * nqb; it++) {
                /* largest blocks first: the causal cost grows with the query position */
                const int64_t h = g * grp + it % grp, qb = nqb - 1 - it / grp, t0 = qb * PQB, t1 = t0 + PQB < T ? t0 + PQB : T;
                const int64_t nq = t1 - t0;
                int32_t lo[PQB], hi[PQB]; /* visible keys [lo, hi) per query; empty for i >= nq */
                int64_t klo = p0 + t1, khi = 0;
                for (int64_t i = 0; i < PQB; i++) {
                    const int64_t p = p0 + t0 + i;
                    hi[i] = i < nq ? (int32_t)(p + 1) : 0;
                    lo[i] = i < nq && L->window > 0 && p + 1 > L->window ? (int32_t)(p + 1 - L->window) : 0;
                    if (i < nq) {
                        klo = lo[i] < klo ? lo[i] : klo;
                        khi = hi[i] > khi ? hi[i] : khi;
                    }
                }
                scores_t(m, kf, qkv + t0 * ldq + h * D, ldq, nq, klo, khi, scale, pt);
                /* softmax across the keys, all PQB queries in one vector (masked lanes give 0) */
                float inv[PQB];
    #if defined(SQ_AVX512)
                {
                    const __m512i vlo = _mm512_loadu_si512((const void *)lo), vhi = _mm512_loadu_si512((const void *)hi);
                    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    #define SQ_VALID(j) (_mm512_cmpgt_epi32_mask(vhi, _mm512_set1_epi32((int32_t)(j))) & \
                         _mm512_cmple_epi32_mask(vlo, _mm512_set1_epi32((int32_t)(j))))
                    for (int64_t j = klo; j < khi; j++)
                        mx = _mm512_mask_max_ps(mx, SQ_VALID(j), mx, _mm512_loadu_ps(pt + (j - klo) * PQB));
                    for (int64_t j = klo; j < khi; j++) {
                        float *pj = pt + (j - klo) * PQB;
                        const __m512 e = _mm512_maskz_mov_ps(SQ_VALID(j), exp16(_mm512_sub_ps(_mm512_loadu_ps(pj), mx)));
                        _mm512_storeu_ps(pj, e);
                        sum = _mm512_add_ps(sum, e);
                    }
    #undef SQ_VALID
                    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
                }
    #elif defined(SQ_AVX2)
                {
                    const __m256i vlo = _mm256_loadu_si256((const __m256i *)lo), vhi = _mm256_loadu_si256((const __m256i *)hi);
                    const __m256 ninf = _mm256_set1_ps(-INFINITY);
                    __m256 mx = ninf, sum = _mm256_setzero_ps();
    #define SQ_VALID(j) _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(vlo, _mm256_set1_epi32((int32_t)(j))), \
                                                                _mm256_cmpgt_epi32(vhi, _mm256_set1_epi32((int32_t)(j)))))
                    for (int64_t j = klo; j < khi; j++)
                        mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(pt + (j - klo) * PQB), SQ_VALID(j)));
                    for (int64_t j = klo; j < khi; j++) {
                        float *pj = pt + (j - klo) * PQB;
                        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(pj), mx)), SQ_VALID(j));
                        _mm256_storeu_ps(pj, e);
                        sum = _mm256_add_ps(sum, e);
                    }
    #undef SQ_VALID
                    _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.f), sum));
                }
    #else
                for (int i = 0; i < PQB; i++) {
                    float mx = -INFINITY, sum = 0.f;
                    for (int64_t j = lo[i]; j < hi[i]; j++) mx = pt[(j - klo) * PQB + i] > mx ? pt[(j - klo) * PQB + i] : mx;
                    for (int64_t j = klo; j < khi; j++) {
                        float *e = pt + (j - klo) * PQB + i;
                        *e = j >= lo[i] && j < hi[i] ? expf(*e - mx) : 0.f;
                        sum += *e;
                    }
                    inv[i] = sum > 0.f ? 1.f / sum : 0.f;
                }
    #endif
                /* out = P V / sum: per 16 (AVX512) or 8 columns, the PQB outputs stay in registers
                 * over the keys */
                int64_t dbeg = 0;
    #ifdef SQ_AVX512
                for (; dbeg + 16 <= D; dbeg += 16) {
                    __m512 acc[PQB];
                    for (int i = 0; i < PQB; i++) acc[i] = _mm512_setzero_ps();
                    for (int64_t j = klo; j < khi; j++) {
                        const __m512 v = _mm512_loadu_ps(vf + j * D + dbeg);
                        const float *pj = pt + (j - klo) * PQB;
                        for (int i = 0; i < PQB; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(pj[i]), v, acc[i]);
                    }
                    for (int i = 0; i < PQB; i++)
                        if (i < nq) _mm512_storeu_ps(att + (t0 + i) * H * D + h * D + dbeg, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv[i])));
                }
    #endif
                for (int64_t d0 = dbeg; d0 < D; d0 += 8) {
    #ifdef SQ_AVX2
                    if (d0 + 8 <= D) {
                        __m256 acc[PQB];
                        for (int i = 0; i < PQB; i++) acc[i] = _mm256_setzero_ps();
                        for (int64_t j = klo; j < khi; j++) {
                            const __m256 v = _mm256_loadu_ps(vf + j * D + d0);
                            const float *pj = pt + (j - klo) * PQB;
                            for (int i = 0; i < PQB; i++) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(pj + i), v, acc[i]);
                        }
                        for (int i = 0; i < PQB; i++) /* a constant bound keeps acc[] in registers */
                            if (i < nq)
                                _mm256_storeu_ps(att + (t0 + i) * H * D + h * D + d0,
                                                 _mm256_mul_ps(acc[i], _mm256_set1_ps(inv[i])));
                        continue;
                    }
    #endif
                    const int64_t d1 = d0 + 8 < D ? d0 + 8 : D;
                    for (int64_t i = 0; i < nq; i++)
                        for (int64_t d = d0; d < d1; d++) {
                            float acc = 0.f;
                            for (int64_t j = klo; j < khi; j++) acc += pt[(j - klo) * PQB + i] * vf[j * D + d];
                            att[(t0 + i) * H * D + h * D + d] = acc * inv[i];
                        }
                }
            }
        }
    }
}
