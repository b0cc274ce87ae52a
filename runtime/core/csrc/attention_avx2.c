/* The decode attention's block kernels on AVX2 (attend_block_avx2; the int8 cache's in integers, on
 * every SIMD build). The reference is attention.c; the AVX512 pieces are in attention_avx512.c. */
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

/* acc + the pairwise int16 products of a and b: one vpdpwssd where AVX512-VNNI (VL: on 8 lanes) or
 * AVX-VNNI is (it wraps as vpaddd does, so the same bits), vpmaddwd + vpaddd on AVX2 */
static inline __attribute__((always_inline)) __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(SQ_AVX512) || (defined(SQ_AVXVNNI) && defined(SQ_VNNI_EVEX))
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(SQ_AVXVNNI)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
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
