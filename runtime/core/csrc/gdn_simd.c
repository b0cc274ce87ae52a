/* The Gated DeltaNet state loops (gdn.c's gdn_decay / gdn_update) on AVX512 and AVX2: per value
 * column the portable version's arithmetic, in its order, 64 (AVX512) or 32 (AVX2) columns a pass. */
#if defined(SQ_AVX512)
/* 64 columns as 4 vectors of 16 (the vectors named, not an array: gcc kept an array's on the stack) */
#define GDN_U4(X) X(0) X(1) X(2) X(3)
#define GDN_MASKS const __mmask16 m0 = rows_mask(nj), m1 = rows_mask(nj - 16), m2 = rows_mask(nj - 32), m3 = rows_mask(nj - 48);
static inline void gdn_decay(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, float decay, float *kv) {
    GDN_MASKS
    const __m512 dec = _mm512_set1_ps(decay);
#define GDN_Z(u) __m512 a##u = _mm512_setzero_ps();
    GDN_U4(GDN_Z)
    for (int64_t i = 0; i < dk; i++) {
        float *s = S + i * ld;
        const __m512 ki = _mm512_set1_ps(k[i]);
#define GDN_P1(u) { const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m##u, s + 16 * u), dec); \
                    _mm512_mask_storeu_ps(s + 16 * u, m##u, x); a##u = _mm512_fmadd_ps(ki, x, a##u); }
        GDN_U4(GDN_P1)
    }
#define GDN_KV(u) _mm512_mask_storeu_ps(kv + 16 * u, m##u, a##u);
    GDN_U4(GDN_KV)
}
static inline void gdn_update(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, const float *q,
                              const float *v, float beta, float *kv, float *o, const float *kn, float dn) {
    GDN_MASKS
    const __m512 b = _mm512_set1_ps(beta), dec = _mm512_set1_ps(dn);
#define GDN_D(u) const __m512 d##u = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m##u, v + 16 * u), \
                     _mm512_maskz_loadu_ps(m##u, kv + 16 * u)), b); __m512 a##u = _mm512_setzero_ps(), e##u = a##u;
    GDN_U4(GDN_D)
    if (kn) {
        for (int64_t i = 0; i < dk; i++) {
            float *s = S + i * ld;
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]), ni = _mm512_set1_ps(kn[i]);
#define GDN_P2N(u) { const __m512 x = _mm512_fmadd_ps(ki, d##u, _mm512_maskz_loadu_ps(m##u, s + 16 * u)); \
                     a##u = _mm512_fmadd_ps(qi, x, a##u); const __m512 y = _mm512_mul_ps(x, dec);        \
                     _mm512_mask_storeu_ps(s + 16 * u, m##u, y); e##u = _mm512_fmadd_ps(ni, y, e##u); }
            GDN_U4(GDN_P2N)
        }
#define GDN_KVN(u) _mm512_mask_storeu_ps(kv + 16 * u, m##u, e##u);
        GDN_U4(GDN_KVN)
    } else {
        for (int64_t i = 0; i < dk; i++) {
            float *s = S + i * ld;
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
#define GDN_P2(u) { const __m512 x = _mm512_fmadd_ps(ki, d##u, _mm512_maskz_loadu_ps(m##u, s + 16 * u)); \
                    _mm512_mask_storeu_ps(s + 16 * u, m##u, x); a##u = _mm512_fmadd_ps(qi, x, a##u); }
            GDN_U4(GDN_P2)
        }
    }
#define GDN_O(u) _mm512_mask_storeu_ps(o + 16 * u, m##u, a##u);
    GDN_U4(GDN_O)
}
#undef GDN_Z
#undef GDN_P1
#undef GDN_KV
#undef GDN_D
#undef GDN_P2N
#undef GDN_KVN
#undef GDN_P2
#undef GDN_O
#undef GDN_MASKS
#undef GDN_U4
#elif defined(SQ_AVX2)
/* 32 columns at a time as 4 vectors of 8: full (plain loads and stores) or fewer (masked: the same
 * arithmetic per column) */
#define GDN_U4(X) X(0) X(1) X(2) X(3)
#define GDN_MASKS const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                    \
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nj), lane),                        \
                  m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nj - 8)), lane),                  \
                  m2 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nj - 16)), lane),                 \
                  m3 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nj - 24)), lane);
static inline __m256 gdn_ld8(const float *p, __m256i mk, int full) {
    return full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mk);
}
static inline void gdn_st8(float *p, __m256i mk, __m256 x, int full) {
    if (full) _mm256_storeu_ps(p, x);
    else _mm256_maskstore_ps(p, mk, x);
}
static inline void gdn_decay32(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, float decay, float *kv,
                               const int full) {
    GDN_MASKS
    const __m256 dec = _mm256_set1_ps(decay);
#define GDN_Z(u) __m256 a##u = _mm256_setzero_ps();
    GDN_U4(GDN_Z)
    for (int64_t i = 0; i < dk; i++) {
        float *s = S + i * ld;
        const __m256 ki = _mm256_set1_ps(k[i]);
#define GDN_P1(u) { const __m256 x = _mm256_mul_ps(gdn_ld8(s + 8 * u, m##u, full), dec); \
                    gdn_st8(s + 8 * u, m##u, x, full); a##u = _mm256_fmadd_ps(ki, x, a##u); }
        GDN_U4(GDN_P1)
    }
#define GDN_KV(u) gdn_st8(kv + 8 * u, m##u, a##u, full);
    GDN_U4(GDN_KV)
}
static inline void gdn_update32(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, const float *q,
                                const float *v, float beta, float *kv, float *o, const float *kn, float dn,
                                const int full) {
    GDN_MASKS
    const __m256 b = _mm256_set1_ps(beta), dec = _mm256_set1_ps(dn);
#define GDN_D(u) const __m256 d##u = _mm256_mul_ps(_mm256_sub_ps(gdn_ld8(v + 8 * u, m##u, full), \
                     gdn_ld8(kv + 8 * u, m##u, full)), b); __m256 a##u = _mm256_setzero_ps(), e##u = a##u;
    GDN_U4(GDN_D)
    if (kn) {
        for (int64_t i = 0; i < dk; i++) {
            float *s = S + i * ld;
            const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]), ni = _mm256_set1_ps(kn[i]);
#define GDN_P2N(u) { const __m256 x = _mm256_fmadd_ps(ki, d##u, gdn_ld8(s + 8 * u, m##u, full));  \
                     a##u = _mm256_fmadd_ps(qi, x, a##u); const __m256 y = _mm256_mul_ps(x, dec); \
                     gdn_st8(s + 8 * u, m##u, y, full); e##u = _mm256_fmadd_ps(ni, y, e##u); }
            GDN_U4(GDN_P2N)
        }
#define GDN_KVN(u) gdn_st8(kv + 8 * u, m##u, e##u, full);
        GDN_U4(GDN_KVN)
    } else {
        for (int64_t i = 0; i < dk; i++) {
            float *s = S + i * ld;
            const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
#define GDN_P2(u) { const __m256 x = _mm256_fmadd_ps(ki, d##u, gdn_ld8(s + 8 * u, m##u, full)); \
                    gdn_st8(s + 8 * u, m##u, x, full); a##u = _mm256_fmadd_ps(qi, x, a##u); }
            GDN_U4(GDN_P2)
        }
    }
#define GDN_O(u) gdn_st8(o + 8 * u, m##u, a##u, full);
    GDN_U4(GDN_O)
}
#undef GDN_Z
#undef GDN_P1
#undef GDN_KV
#undef GDN_D
#undef GDN_P2N
#undef GDN_KVN
#undef GDN_P2
#undef GDN_O
#undef GDN_MASKS
#undef GDN_U4
static inline void gdn_decay(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, float decay, float *kv) {
    for (int64_t j = 0; j < nj; j += 32) {
        if (nj - j >= 32) gdn_decay32(S + j, dk, ld, 32, k, decay, kv + j, 1);
        else gdn_decay32(S + j, dk, ld, nj - j, k, decay, kv + j, 0);
    }
}
static inline void gdn_update(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, const float *q,
                              const float *v, float beta, float *kv, float *o, const float *kn, float dn) {
    for (int64_t j = 0; j < nj; j += 32) {
        if (nj - j >= 32) gdn_update32(S + j, dk, ld, 32, k, q, v + j, beta, kv + j, o + j, kn, dn, 1);
        else gdn_update32(S + j, dk, ld, nj - j, k, q, v + j, beta, kv + j, o + j, kn, dn, 0);
    }
}
#endif
