/* Attention in fp32 over the KV cache (bf16, or int8 codes with a bf16 scale per position and KV
 * head): one query token (decode: attention, attend_item / attend_finish) and a chunk of prompt
 * tokens (attention_many), causal and optionally sliding-window. */

/* -- one query token (the decode step) --
 * Flash-decoding: the keys a token sees, [start, end), are cut into blocks of KVB positions from
 * start; a work item is (KV head, block): the grp query heads sharing that KV head read each K and
 * V row of the block once and leave a partial result (their max score, sum of exponentials and
 * unnormalized output); attend_finish combines a head's blocks in block order. Long contexts so
 * spread over every thread (split-K), short ones over the KV heads. The cut depends on (start, end)
 * only, so a token's bits depend neither on the thread count nor on the other sequences of a batch. */
#define KVB 256

typedef struct { const void *k, *v; const uint16_t *ks, *vs; } kv_rows; /* one KV head's rows [cap, D] (+ scales) */

static inline kv_rows kv_head(const sq_model *m, const sq_layer *L, int64_t g) {
    const int64_t o = g * m->cap * m->head_dim;
    kv_rows r;
    if (m->kv_int8) {
        r.k = (const int8_t *)L->kcache + o, r.v = (const int8_t *)L->vcache + o;
        r.ks = L->kscale + g * m->cap, r.vs = L->vscale + g * m->cap;
    } else {
        r.k = (const uint16_t *)L->kcache + o, r.v = (const uint16_t *)L->vcache + o;
        r.ks = r.vs = NULL;
    }
    return r;
}

static inline int64_t attn_blocks(int64_t start, int64_t end) { return (end - start + KVB - 1) / KVB; }

/* floats of one work item's partial result: grp x D outputs, then grp maxima, then grp sums */
static inline int64_t part_floats(const sq_model *m) { return (m->heads / m->kv_heads) * (m->head_dim + 2); }

static inline float kv_at(const void *p, int64_t i, int i8) {
    return i8 ? (float)((const int8_t *)p)[i] : bf(((const uint16_t *)p)[i]);
}

/* The int8 cache's K products are exact integers: each query head becomes int16 codes qi with one
 * scale (qsc: max|q| / 32767 times the attention scale; codes round half to even), so a score is
 * (float)sum(qi * k) * (kscale * qsc) on every build. qi [G, D], qsc [G]. */
static void quant_q16_ref(const float *qs, int64_t D, int G, float scale, int16_t *qi, float *qsc) {
    for (int i = 0; i < G; i++) {
        float amax = 0.f;
        for (int64_t d = 0; d < D; d++) amax = fabsf(qs[i * D + d]) > amax ? fabsf(qs[i * D + d]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        qsc[i] = amax / 32767.f * scale;
        for (int64_t d = 0; d < D; d++) qi[i * D + d] = (int16_t)nearbyintf(qs[i * D + d] * inv);
    }
}

/* The reference: G query heads qs [G, D] over keys [t0, t1) of kv, score = scale * q.k; per head
 * i the max score mx[i], the sum of exponentials sm[i] and o[i*D..] = sum_t e^(score - mx) v_t.
 * sc: [G, KVB] scratch (the scores, then the weights of the V rows: e^(score - mx) times the V
 * scale). bf16 cache: the scores round as the prompt path's portable loop does (the dot, then the
 * scale); int8: quant_q16's integer dots, and V as v_i8_avx2 computes it (the weights as int16
 * codes against their max, integer sums with the V codes). */
static void attend_block_ref(kv_rows kv, int i8, int64_t D, const float *qs, float scale, int G, int64_t t0,
                             int64_t t1, float *sc, float *o, float *mx, float *sm) {
    const int64_t n = t1 - t0;
    int16_t qi[i8 ? G * D : 1];
    float qsc[8];
    if (i8) quant_q16_ref(qs, D, G, scale, qi, qsc);
    for (int64_t t = 0; t < n; t++) {
        for (int i = 0; i < G; i++) {
            if (i8) {
                int64_t acc = 0; /* an int32 for head_dim <= 512 (the SIMD kernels' bound) */
                for (int64_t d = 0; d < D; d++) acc += qi[i * D + d] * ((const int8_t *)kv.k)[(t0 + t) * D + d];
                sc[i * KVB + t] = (float)acc * (bf(kv.ks[t0 + t]) * qsc[i]);
            } else {
                float acc = 0.f;
                for (int64_t d = 0; d < D; d++) acc += qs[i * D + d] * kv_at(kv.k, (t0 + t) * D + d, 0);
                sc[i * KVB + t] = acc * scale;
            }
        }
    }
    for (int i = 0; i < G; i++) {
        float *p = sc + i * KVB, m_ = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) m_ = p[t] > m_ ? p[t] : m_;
        for (int64_t t = 0; t < n; t++) { p[t] = expf(p[t] - m_); sum += p[t]; }
        mx[i] = m_, sm[i] = sum;
        if (i8) { /* the weights as int16 codes against their max: exact integer sums with the V codes */
            float pm = 0.f;
            for (int64_t t = 0; t < n; t++) {
                p[t] *= bf(kv.vs[t0 + t]);
                pm = p[t] > pm ? p[t] : pm;
            }
            const float inv = pm > 0.f ? 32767.f / pm : 0.f, osc = pm / 32767.f;
            for (int64_t t = 0; t < n; t++) p[t] = nearbyintf(p[t] * inv);
            for (int64_t d = 0; d < D; d++) {
                int32_t acc = 0; /* n <= KVB keys of at most 32767 x 127 */
                for (int64_t t = 0; t < n; t++) acc += (int32_t)p[t] * ((const int8_t *)kv.v)[(t0 + t) * D + d];
                o[i * D + d] = (float)acc * osc;
            }
            continue;
        }
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.f;
            for (int64_t t = 0; t < n; t++) acc += p[t] * kv_at(kv.v, (t0 + t) * D + d, 0);
            o[i * D + d] = acc;
        }
    }
}
_Static_assert(KVB * 32767LL * 127 < 2147483647LL, "the int8 cache's V sums of a block must fit int32");

#ifdef SQ_AVX2
static inline float hmax8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}

/* [sum a, sum b, sum c, sum d] */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* K and V rows ahead of the scores loop (the caches stream from memory at long contexts: without
 * the hint the step waited on each row's line; KV_AHEAD rows ahead covers the latency) */
#define KV_AHEAD 16
static inline __attribute__((always_inline)) void kv_prefetch(kv_rows kv, const int i8, int64_t D, int64_t t) {
    const int64_t bytes = D * (i8 ? 1 : 2), at = t * bytes;
    for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch((const char *)kv.k + at + o);
        __builtin_prefetch((const char *)kv.v + at + o);
    }
}

/* lanes < left of 8 */
static inline __m256i mask8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* quant_q16_ref on 8 lanes (the same codes: cvtps rounds half to even); D % 8 == 0 */
static inline void quant_q16_avx2(const float *qs, int64_t D, int G, float scale, int16_t *qi, float *qsc) {
    const __m256 sgn = _mm256_set1_ps(-0.f);
    for (int i = 0; i < G; i++) {
        __m256 vm = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) vm = _mm256_max_ps(vm, _mm256_andnot_ps(sgn, _mm256_loadu_ps(qs + i * D + d)));
        const float amax = hmax8(vm), inv = amax > 0.f ? 32767.f / amax : 0.f;
        qsc[i] = amax / 32767.f * scale;
        for (int64_t d = 0; d < D; d += 8) {
            const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qs + i * D + d), _mm256_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(qi + i * D + d), _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
        }
    }
}

static inline int32_t hsum_i32x8(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

/* acc + the pairwise int16 products of a and b: one vpdpwssd where AVX512-VNNI is (VL: on 8 lanes;
 * it wraps as vpaddd does, so the same bits), vpmaddwd + vpaddd on AVX2 */
static inline __attribute__((always_inline)) __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#ifdef SQ_AVX512
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 16 K codes at d as int16 (8 when only 8 are left: the rest 0, so the q codes they meet, past
 * the head's row but inside qi, add nothing) */
static inline __attribute__((always_inline)) __m256i k16(const int8_t *k, int64_t d, int64_t D) {
    return _mm256_cvtepi8_epi16(d + 16 <= D ? _mm_loadu_si128((const __m128i *)(k + d)) : _mm_loadl_epi64((const __m128i *)(k + d)));
}

/* a[i] = 8-lane int32 partial sums of head i's q codes times one K row's codes */
static inline __attribute__((always_inline)) void dots_i8_avx2(const int8_t *k, const int16_t *qi, int64_t D, const int G,
                                                               __m256i *a) {
    for (int i = 0; i < G; i++) a[i] = _mm256_setzero_si256();
    for (int64_t d = 0; d < D; d += 16) {
        const __m256i x = k16(k, d, D);
        for (int i = 0; i < G; i++) a[i] = madd_acc(a[i], _mm256_loadu_si256((const __m256i *)(qi + i * D + d)), x);
    }
}

/* the int8 cache's scores on 8 lanes: int16 q codes x sign-extended K codes (madd: exact int32
 * sums, head_dim <= 512), 8 keys at a time so their horizontal sums reduce in one tree (per key
 * and head, a reduction cost as much as a 64-channel dot). D % 8 == 0; qi holds G * D + 8 codes. */
static inline __attribute__((always_inline)) void scores_i8_avx2(kv_rows kv, int64_t D, const int16_t *qi,
                                                                 const float *qsc, const int G, int64_t t0, int64_t n,
                                                                 float *sc) {
    const int8_t *K = (const int8_t *)kv.k;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256i P[8][4]; /* per head and key pair u: hadd of the two keys' 8-lane sums */
        for (int u = 0; u < 4; u++) {
            const int8_t *k0 = K + (t0 + t + 2 * u) * D, *k1 = k0 + D;
            kv_prefetch(kv, 1, D, t0 + t + 2 * u + KV_AHEAD);
            kv_prefetch(kv, 1, D, t0 + t + 2 * u + 1 + KV_AHEAD);
            if (G <= 4) { /* both keys at once: 2G accumulators, each q vector loaded once */
                __m256i a0[4], a1[4];
                for (int i = 0; i < G; i++) a0[i] = a1[i] = _mm256_setzero_si256();
                for (int64_t d = 0; d < D; d += 16) {
                    const __m256i x0 = k16(k0, d, D), x1 = k16(k1, d, D);
                    for (int i = 0; i < G; i++) {
                        const __m256i qv = _mm256_loadu_si256((const __m256i *)(qi + i * D + d));
                        a0[i] = madd_acc(a0[i], qv, x0);
                        a1[i] = madd_acc(a1[i], qv, x1);
                    }
                }
                for (int i = 0; i < G; i++) P[i][u] = _mm256_hadd_epi32(a0[i], a1[i]);
            } else { /* one key at a time (G accumulators) */
                __m256i a0[8], a1[8];
                dots_i8_avx2(k0, qi, D, G, a0);
                dots_i8_avx2(k1, qi, D, G, a1);
                for (int i = 0; i < G; i++) P[i][u] = _mm256_hadd_epi32(a0[i], a1[i]);
            }
        }
        const __m256 ks = load_bf8(kv.ks + t0 + t);
        for (int i = 0; i < G; i++) {
            const __m256i x = _mm256_hadd_epi32(P[i][0], P[i][1]), y = _mm256_hadd_epi32(P[i][2], P[i][3]);
            const __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20), _mm256_permute2x128_si256(x, y, 0x31));
            _mm256_storeu_ps(sc + i * KVB + t, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ks, _mm256_set1_ps(qsc[i]))));
        }
    }
    for (; t < n; t++) {
        __m256i a[8];
        dots_i8_avx2(K + (t0 + t) * D, qi, D, G, a);
        const float s0 = bf(kv.ks[t0 + t]);
        for (int i = 0; i < G; i++) sc[i * KVB + t] = (float)hsum_i32x8(a[i]) * (s0 * qsc[i]);
    }
}

#ifdef SQ_AVX512
/* v_i8_avx2's sums on 16 lanes (the same weight codes, so the same exact sums and bits), D % 64 == 0:
 * 64 channels per pass over the keys, each pair of V rows converted and interleaved once for up
 * to 4 heads (4 accumulators each: 32 registers hold them), where v_i8_avx2 converts every row
 * once per 16 channels. wq: the weights' int16 codes [G][KVB + 8], osc [G]. */
static inline __attribute__((always_inline)) void v_i8_avx512(const int8_t *V, int64_t D, const int G, int64_t n,
                                                              const int16_t (*wq)[KVB + 8], const float *osc, float *o) {
    /* lanes of an unpacked pair (per 128-bit lane k: lo channels 8k..8k+3, hi 8k+4..8k+7) back in channel order */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i0 = 0; i0 < G; i0 += 4) {
        const int GG = G - i0 < 4 ? G - i0 : 4;
        for (int64_t d = 0; d < D; d += 64) {
            __m512i a[4][4];
            for (int i = 0; i < GG; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_si512();
            for (int64_t t = 0; t < n; t += 2) {
                const int8_t *r0 = V + t * D + d, *r1 = r0 + D;
                const int two = t + 1 < n; /* the odd last key: its partner row is zeros */
                const __m512i v0a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)r0));
                const __m512i v0b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r0 + 32)));
                const __m512i v1a = two ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)r1)) : _mm512_setzero_si512();
                const __m512i v1b = two ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r1 + 32))) : _mm512_setzero_si512();
                const __m512i u[4] = {_mm512_unpacklo_epi16(v0a, v1a), _mm512_unpackhi_epi16(v0a, v1a),
                                      _mm512_unpacklo_epi16(v0b, v1b), _mm512_unpackhi_epi16(v0b, v1b)};
                for (int i = 0; i < GG; i++) {
                    int32_t pair;
                    if (two) memcpy(&pair, wq[i0 + i] + t, 4);
                    else pair = (int32_t)(uint16_t)wq[i0 + i][t];
                    const __m512i w = _mm512_set1_epi32(pair);
                    for (int c = 0; c < 4; c++) a[i][c] = _mm512_dpwssd_epi32(a[i][c], u[c], w);
                }
            }
            for (int i = 0; i < GG; i++) {
                const __m512 sv = _mm512_set1_ps(osc[i0 + i]);
                float *oi = o + (i0 + i) * D + d;
                _mm512_storeu_ps(oi, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a[i][0], first, a[i][1])), sv));
                _mm512_storeu_ps(oi + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a[i][0], second, a[i][1])), sv));
                _mm512_storeu_ps(oi + 32, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a[i][2], first, a[i][3])), sv));
                _mm512_storeu_ps(oi + 48, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(a[i][2], second, a[i][3])), sv));
            }
        }
    }
}
#endif

/* The int8 cache's V side in integers: head i's weights p (sc rows: e^(score - max) x V scale) as
 * int16 codes against their max (w = round(p * 32767 / pmax), half to even: at most 1.5e-5 of the
 * largest weight), two keys' V codes interleaved so one vpmaddwd multiplies both with their
 * weights; o = (float)sum(w * v) * pmax / 32767, exact int32 sums (n <= KVB keys of at most
 * 32767 x 127), the reference's arithmetic. Half the multiply instructions of fp32 FMAs over
 * converted codes. Heads in passes of up to 4, 16 channels per pass over the keys; pmax [G]. */
static inline __attribute__((always_inline)) void v_i8_avx2(kv_rows kv, int64_t D, const int G, int64_t t0, int64_t n,
                                                            const float *sc, const float *pmax, float *o) {
    int16_t wq[8][KVB + 8] __attribute__((aligned(32)));
    float osc[8];
    for (int i = 0; i < G; i++) {
        const float inv = pmax[i] > 0.f ? 32767.f / pmax[i] : 0.f;
        osc[i] = pmax[i] / 32767.f;
        const __m256 vi = _mm256_set1_ps(inv);
        for (int64_t t = 0; t < n; t += 8) {
            const __m256 pv = _mm256_and_ps(_mm256_loadu_ps(sc + i * KVB + t), _mm256_castsi256_ps(mask8(n - t)));
            const __m256i x = _mm256_cvtps_epi32(_mm256_mul_ps(pv, vi));
            _mm_storeu_si128((__m128i *)(wq[i] + t), _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
        }
    }
    const int8_t *V = (const int8_t *)kv.v + t0 * D;
#ifdef SQ_AVX512
    if (D % 64 == 0) {
        v_i8_avx512(V, D, G, n, (const int16_t (*)[KVB + 8])wq, osc, o);
        return;
    }
#endif
    for (int i0 = 0; i0 < G; i0 += 4) {
        const int GG = G - i0 < 4 ? G - i0 : 4;
        for (int64_t d = 0; d < D; d += 16) {
            __m256i a[4][2];
            for (int i = 0; i < GG; i++) a[i][0] = a[i][1] = _mm256_setzero_si256();
            int64_t t = 0;
            for (; t + 2 <= n; t += 2) {
                const __m256i v0 = k16(V + t * D, d, D), v1 = k16(V + (t + 1) * D, d, D);
                const __m256i lo = _mm256_unpacklo_epi16(v0, v1), hi = _mm256_unpackhi_epi16(v0, v1);
                for (int i = 0; i < GG; i++) {
                    int32_t pair;
                    memcpy(&pair, wq[i0 + i] + t, 4);
                    const __m256i w = _mm256_set1_epi32(pair);
                    a[i][0] = madd_acc(a[i][0], lo, w);
                    a[i][1] = madd_acc(a[i][1], hi, w);
                }
            }
            if (t < n) { /* the odd last key: its partner row is zeros */
                const __m256i v0 = k16(V + t * D, d, D), z = _mm256_setzero_si256();
                const __m256i lo = _mm256_unpacklo_epi16(v0, z), hi = _mm256_unpackhi_epi16(v0, z);
                for (int i = 0; i < GG; i++) {
                    const __m256i w = _mm256_set1_epi32((int32_t)(uint16_t)wq[i0 + i][t]);
                    a[i][0] = madd_acc(a[i][0], lo, w);
                    a[i][1] = madd_acc(a[i][1], hi, w);
                }
            }
            /* a[i][0]: channels d+0..3 | d+8..11, a[i][1]: d+4..7 | d+12..15 */
            for (int i = 0; i < GG; i++) {
                const __m256 s = _mm256_set1_ps(osc[i0 + i]);
                float *oi = o + (i0 + i) * D + d;
                _mm256_storeu_ps(oi, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(a[i][0], a[i][1], 0x20)), s));
                if (d + 16 <= D)
                    _mm256_storeu_ps(oi + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(a[i][0], a[i][1], 0x31)), s));
            }
        }
    }
}

/* attend_block_ref on 8 lanes, G (<= 8) and the cache type fixed at compile time; D % 8 == 0.
 * Scores: each K row converted once for the G heads; V: int8 cache v_i8_avx2, bf16 G x 32, 16 or
 * 8 outputs in registers over the block's rows. */
static inline __attribute__((always_inline)) void attend_block_avx2(kv_rows kv, const int i8, int64_t D, const float *qs,
                                                                    float scale, const int G, int64_t t0, int64_t t1,
                                                                    float *sc, float *o, float *mx, float *sm) {
    const int64_t n = t1 - t0;
    for (int64_t t = 0; t < KV_AHEAD && t < n; t++) kv_prefetch(kv, i8, D, t0 + t);
    if (i8) {
        int16_t qi[8 * 512 + 8] __attribute__((aligned(32)));
        float qsc[8];
        quant_q16_avx2(qs, D, G, scale, qi, qsc);
        memset(qi + G * D, 0, 8 * sizeof(int16_t));
        scores_i8_avx2(kv, D, qi, qsc, G, t0, n, sc);
    }
    /* bf16 cache: scores in fp32, KT keys at a time (their G x KT dot products in registers, 4
     * sums reduced at once) */
    const int KT = G <= 3 ? 4 : G <= 6 ? 2 : 1;
    int64_t t = i8 ? n : 0;
    for (; KT > 1 && t + KT <= n; t += KT) {
        __m256 acc[12];
        for (int j = 0; j < KT * G; j++) acc[j] = _mm256_setzero_ps();
        for (int u = 0; u < KT; u++) kv_prefetch(kv, 0, D, t0 + t + u + KV_AHEAD);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 k[4];
            for (int u = 0; u < KT; u++) k[u] = load_bf8((const uint16_t *)kv.k + (t0 + t + u) * D + d);
            for (int i = 0; i < G; i++) {
                const __m256 qv = _mm256_loadu_ps(qs + i * D + d);
                for (int u = 0; u < KT; u++) acc[u * G + i] = _mm256_fmadd_ps(qv, k[u], acc[u * G + i]);
            }
        }
        const __m128 s4 = _mm_set1_ps(scale);
        for (int i = 0; i < G; i++) {
            const __m128 r = _mm_mul_ps(KT == 4 ? hsum4x8(acc[i], acc[G + i], acc[2 * G + i], acc[3 * G + i])
                                                : hsum4x8(acc[i], acc[G + i], acc[i], acc[G + i]), s4);
            if (KT == 4) _mm_storeu_ps(sc + i * KVB + t, r);
            else _mm_storel_pi((__m64 *)(sc + i * KVB + t), r);
        }
    }
    for (; t < n; t++) {
        __m256 acc[8];
        for (int i = 0; i < G; i++) acc[i] = _mm256_setzero_ps();
        const int64_t row = (t0 + t) * D;
        kv_prefetch(kv, 0, D, t0 + t + KV_AHEAD);
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 k = load_bf8((const uint16_t *)kv.k + row + d);
            for (int i = 0; i < G; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + i * D + d), k, acc[i]);
        }
        for (int i = 0; i < G; i++) sc[i * KVB + t] = hsum8(acc[i]) * scale;
    }
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    float pmax[8];
    for (int i = 0; i < G; i++) {
        float *p = sc + i * KVB;
        __m256 vm = ninf, vsum = _mm256_setzero_ps();
        /* sc rows hold KVB floats: whole vectors past n stay inside the row, masked (AMD's
         * vmaskmov stores cost more than the exponentials) */
        for (int64_t t = 0; t < n; t += 8)
            vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, _mm256_loadu_ps(p + t), _mm256_castsi256_ps(mask8(n - t))));
        const float m_ = hmax8(vm);
        const __m256 vmx = _mm256_set1_ps(m_);
        __m256 vpm = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), vmx));
            vsum = _mm256_add_ps(vsum, e);
            const __m256 w = i8 ? _mm256_mul_ps(e, load_bf8(kv.vs + t0 + t)) : e;
            if (i8) vpm = _mm256_max_ps(vpm, w);
            _mm256_storeu_ps(p + t, w);
        }
        float pm_ = i8 ? hmax8(vpm) : 0.f; /* the int8 cache's largest V weight (v_i8_avx2) */
        if (t < n) {
            float e[8];
            _mm256_storeu_ps(e, _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), vmx)), _mm256_castsi256_ps(mask8(n - t))));
            vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(e));
            for (int64_t u = t; u < n; u++) {
                p[u] = i8 ? e[u - t] * bf(kv.vs[t0 + u]) : e[u - t];
                if (i8) pm_ = p[u] > pm_ ? p[u] : pm_;
            }
        }
        mx[i] = m_, sm[i] = hsum8(vsum), pmax[i] = pm_;
    }
    if (i8) {
        v_i8_avx2(kv, D, G, t0, n, sc, pmax, o);
        return;
    }
    /* bf16 cache: V in fp32 */
    int64_t d = 0;
    if (G <= 3) /* 4G accumulators: enough independent FMA chains to fill both pipes */
        for (; d + 32 <= D; d += 32) {
            __m256 a[3][4];
            for (int i = 0; i < G; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                __m256 w[3];
                for (int i = 0; i < G; i++) w[i] = _mm256_broadcast_ss(sc + i * KVB + t);
                for (int c = 0; c < 4; c++) {
                    const __m256 v = load_bf8((const uint16_t *)kv.v + (t0 + t) * D + d + 8 * c);
                    for (int i = 0; i < G; i++) a[i][c] = _mm256_fmadd_ps(w[i], v, a[i][c]);
                }
            }
            for (int i = 0; i < G; i++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + i * D + d + 8 * c, a[i][c]);
        }
    if (G <= 6)
        for (; d + 16 <= D; d += 16) {
            __m256 a0[6], a1[6];
            for (int i = 0; i < G; i++) a0[i] = a1[i] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                const __m256 v0 = load_bf8((const uint16_t *)kv.v + (t0 + t) * D + d), v1 = load_bf8((const uint16_t *)kv.v + (t0 + t) * D + d + 8);
                for (int i = 0; i < G; i++) {
                    const __m256 w = _mm256_broadcast_ss(sc + i * KVB + t);
                    a0[i] = _mm256_fmadd_ps(w, v0, a0[i]);
                    a1[i] = _mm256_fmadd_ps(w, v1, a1[i]);
                }
            }
            for (int i = 0; i < G; i++) {
                _mm256_storeu_ps(o + i * D + d, a0[i]);
                _mm256_storeu_ps(o + i * D + d + 8, a1[i]);
            }
        }
    for (; d < D; d += 8) {
        __m256 a0[8];
        for (int i = 0; i < G; i++) a0[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m256 v0 = load_bf8((const uint16_t *)kv.v + (t0 + t) * D + d);
            for (int i = 0; i < G; i++) a0[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + i * KVB + t), v0, a0[i]);
        }
        for (int i = 0; i < G; i++) _mm256_storeu_ps(o + i * D + d, a0[i]);
    }
}
#endif

#ifdef SQ_AVX512
/* attend_block_avx2's bf16-cache path on 16 lanes; D % 16 == 0 (the int8 cache takes the AVX2
 * kernel: its integer scores are the reference's bits) */
static inline __attribute__((always_inline)) void attend_block_avx512(kv_rows kv, int64_t D,
                                                                      const float *qs, float scale, const int G,
                                                                      int64_t t0, int64_t t1, float *sc, float *o,
                                                                      float *mx, float *sm) {
    const int64_t n = t1 - t0;
    for (int64_t t = 0; t < KV_AHEAD && t < n; t++) kv_prefetch(kv, 0, D, t0 + t);
    for (int64_t t = 0; t < n; t++) {
        __m512 acc[8];
        for (int i = 0; i < G; i++) acc[i] = _mm512_setzero_ps();
        const int64_t row = (t0 + t) * D;
        kv_prefetch(kv, 0, D, t0 + t + KV_AHEAD);
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 k = load_bf16x16((const uint16_t *)kv.k + row + d);
            for (int i = 0; i < G; i++) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + i * D + d), k, acc[i]);
        }
        for (int i = 0; i < G; i++) sc[i * KVB + t] = _mm512_reduce_add_ps(acc[i]) * scale;
    }
    for (int i = 0; i < G; i++) {
        float *p = sc + i * KVB;
        __m512 vm = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) vm = _mm512_mask_max_ps(vm, rows_mask(n - t), vm, _mm512_maskz_loadu_ps(rows_mask(n - t), p + t));
        const float m_ = _mm512_reduce_max_ps(vm);
        for (int64_t t = 0; t < n; t += 16) {
            const __mmask16 k = rows_mask(n - t);
            const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + t), _mm512_set1_ps(m_))));
            vsum = _mm512_add_ps(vsum, e);
            _mm512_mask_storeu_ps(p + t, k, e);
        }
        mx[i] = m_, sm[i] = _mm512_reduce_add_ps(vsum);
    }
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m512 a0[8], a1[8];
        for (int i = 0; i < G; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 v0 = load_bf16x16((const uint16_t *)kv.v + (t0 + t) * D + d), v1 = load_bf16x16((const uint16_t *)kv.v + (t0 + t) * D + d + 16);
            for (int i = 0; i < G; i++) {
                const __m512 w = _mm512_set1_ps(sc[i * KVB + t]);
                a0[i] = _mm512_fmadd_ps(w, v0, a0[i]);
                a1[i] = _mm512_fmadd_ps(w, v1, a1[i]);
            }
        }
        for (int i = 0; i < G; i++) {
            _mm512_storeu_ps(o + i * D + d, a0[i]);
            _mm512_storeu_ps(o + i * D + d + 16, a1[i]);
        }
    }
    for (; d < D; d += 16) {
        __m512 a0[8];
        for (int i = 0; i < G; i++) a0[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 v0 = load_bf16x16((const uint16_t *)kv.v + (t0 + t) * D + d);
            for (int i = 0; i < G; i++) a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(sc[i * KVB + t]), v0, a0[i]);
        }
        for (int i = 0; i < G; i++) _mm512_storeu_ps(o + i * D + d, a0[i]);
    }
}
#endif

/* the dispatch: this build's widest block kernel for D, G (<= 8) and the cache type */
static void attend_block(const sq_model *m, kv_rows kv, const float *qs, int G, int64_t t0, int64_t t1, float *sc,
                         float *o, float *mx, float *sm) {
    const int64_t D = m->head_dim;
    const int i8 = (int)m->kv_int8;
    const float scale = (float)m->attn_scale;
#define SQ_BLOCK_CASE(isa, g) \
    case g: i8 ? attend_block_##isa(kv, 1, D, qs, scale, g, t0, t1, sc, o, mx, sm) \
               : attend_block_##isa(kv, 0, D, qs, scale, g, t0, t1, sc, o, mx, sm); return;
#define SQ_BLOCK_CASES(isa) SQ_BLOCK_CASE(isa, 1) SQ_BLOCK_CASE(isa, 2) SQ_BLOCK_CASE(isa, 3) SQ_BLOCK_CASE(isa, 4) \
    SQ_BLOCK_CASE(isa, 5) SQ_BLOCK_CASE(isa, 6) SQ_BLOCK_CASE(isa, 7) SQ_BLOCK_CASE(isa, 8)
#ifdef SQ_AVX512
#define SQ_BLOCK_CASE512(g) case g: attend_block_avx512(kv, D, qs, scale, g, t0, t1, sc, o, mx, sm); return;
    if (D % 16 == 0 && !i8) switch (G) {
        SQ_BLOCK_CASE512(1) SQ_BLOCK_CASE512(2) SQ_BLOCK_CASE512(3) SQ_BLOCK_CASE512(4)
        SQ_BLOCK_CASE512(5) SQ_BLOCK_CASE512(6) SQ_BLOCK_CASE512(7) SQ_BLOCK_CASE512(8)
    }
#undef SQ_BLOCK_CASE512
#endif
#ifdef SQ_AVX2
    if (D % 8 == 0 && (!i8 || D <= 512)) switch (G) { SQ_BLOCK_CASES(avx2) }
#endif
#undef SQ_BLOCK_CASES
#undef SQ_BLOCK_CASE
    attend_block_ref(kv, i8, D, qs, scale, G, t0, t1, sc, o, mx, sm);
}

/* Work item (g, b) of one token's decode attention: the query heads of KV head g (q: the token's
 * normed, rotated q heads [H, D]) over block b of keys [start, end) of L's cache. sc: grp * KVB
 * floats of scratch; part: the item's partial result (part_floats). */
static void attend_item(const sq_model *m, const sq_layer *L, const float *q, int64_t start, int64_t end, int64_t g,
                        int64_t b, float *sc, float *part) {
    const int64_t D = m->head_dim, grp = m->heads / m->kv_heads;
    const int64_t t0 = start + b * KVB, t1 = t0 + KVB < end ? t0 + KVB : end;
    const kv_rows kv = kv_head(m, L, g);
    for (int64_t s0 = 0; s0 < grp; s0 += 8) { /* query heads in passes of up to 8 (the kernels' registers) */
        const int G = (int)(grp - s0 < 8 ? grp - s0 : 8);
        attend_block(m, kv, q + (g * grp + s0) * D, G, t0, t1, sc, part + s0 * D, part + grp * D + s0,
                     part + grp * D + grp + s0);
    }
}

/* Head i (of the grp sharing a KV head) from the partials of its nb blocks (part: the first of
 * them, part_floats apart): out [D] = softmax(scale q.K) V */
static void attend_finish(const sq_model *m, const float *part, int64_t nb, int64_t i, float *out) {
    const int64_t D = m->head_dim, grp = m->heads / m->kv_heads, pf = part_floats(m);
    float mx = -INFINITY, tot = 0.f;
    for (int64_t b = 0; b < nb; b++) mx = part[b * pf + grp * D + i] > mx ? part[b * pf + grp * D + i] : mx;
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const float *pb = part + b * pf, w = expf(pb[grp * D + i] - mx);
        tot += w * pb[grp * D + grp + i];
        for (int64_t d = 0; d < D; d++) out[d] += w * pb[i * D + d];
    }
    const float inv = 1.f / tot;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* keys [start, end) a query at pos sees in layer L: the sliding window's, else all of [0, pos] */
static inline int64_t window_start(const sq_layer *L, int64_t pos) {
    return L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
}

/* (inside sq_step's parallel region) the attention of the decode token at pos in layer L: q its
 * query heads, att [H, D] the result; scores, part: the workspace's (work.c) */
static void attention(const sq_model *m, const sq_layer *L, const float *q, int64_t pos, float *scores, float *part,
                      float *att) {
    const int64_t H = m->heads, KV = m->kv_heads, D = m->head_dim, grp = H / KV, pf = part_floats(m);
    const int64_t start = window_start(L, pos), end = pos + 1, nb = attn_blocks(start, end);
    /* static: each thread takes a run of consecutive blocks, so the rows the kernel prefetches
     * past a block's end are its own next item's (dynamic scheduling interleaved the threads'
     * blocks, and each item began on rows still in memory) */
#pragma omp for schedule(static)
    for (int64_t it = 0; it < KV * nb; it++)
        attend_item(m, L, q, start, end, it / nb, it % nb, scores + it * grp * KVB, part + it * pf);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++) attend_finish(m, part + (h / grp) * nb * pf, nb, h % grp, att + h * D);
}

/* -- a chunk of prompt tokens -- */

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
