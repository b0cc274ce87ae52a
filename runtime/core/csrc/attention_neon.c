/* The decode attention's block kernel on Arm NEON (attend_block_neon). The reference is
 * attend_block_ref. bf16 cache: scores with each K row converted once for the G heads, fp32 dots on
 * 4 lanes (another summation order than the reference's); V rows converted once for the G heads,
 * o += p v as a multiply then an add in row order, the reference's arithmetic. int8 cache: the
 * reference's integers (int16 q codes x int8 K codes, int16 weight codes x int8 V codes, smlal into
 * exact int32 sums, D <= 512) and its float steps: the reference's bits. The softmax is the
 * reference's (expf). */
#ifdef SQ_NEON
static inline float32x4_t bf4_neon(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

/* the int8 cache's scores: sc[i KVB + t] = (float)dot(qi_i, k_t) * (kscale_t * qsc_i); D % 8 == 0 */
static inline __attribute__((always_inline)) void scores_i8_neon(kv_rows kv, int64_t D, const int16_t *qi, const float *qsc,
                                                                 const int G, int64_t t0, int64_t n, float *sc) {
    const int8_t *K = (const int8_t *)kv.k;
    for (int64_t t = 0; t < n; t++) {
        int32x4_t acc[8];
        for (int i = 0; i < G; i++) acc[i] = vdupq_n_s32(0);
        kv_prefetch(kv, 1, D, t0 + t + KV_AHEAD);
        const int8_t *kr = K + (t0 + t) * D;
        for (int64_t d = 0; d < D; d += 8) {
            const int16x8_t k = vmovl_s8(vld1_s8(kr + d));
            for (int i = 0; i < G; i++) {
                const int16x8_t q = vld1q_s16(qi + i * D + d);
                acc[i] = vmlal_high_s16(vmlal_s16(acc[i], vget_low_s16(q), vget_low_s16(k)), q, k);
            }
        }
        const float s0 = bf(kv.ks[t0 + t]);
        for (int i = 0; i < G; i++) sc[i * KVB + t] = (float)vaddvq_s32(acc[i]) * (s0 * qsc[i]);
    }
}

/* the int8 cache's V side: head i's weights p (sc rows, e^(score - max)) times the V scales, as int16
 * codes against their max, then o = (float)sum(w v) * pmax / 32767 (attend_block_ref's steps) */
static inline __attribute__((always_inline)) void v_i8_neon(kv_rows kv, int64_t D, const int G, int64_t t0, int64_t n,
                                                            float *sc, float *o) {
    int16_t wq[8][KVB];
    float osc[8];
    for (int i = 0; i < G; i++) {
        float *p = sc + i * KVB, pm = 0.f;
        for (int64_t t = 0; t < n; t++) {
            p[t] *= bf(kv.vs[t0 + t]);
            pm = p[t] > pm ? p[t] : pm;
        }
        const float inv = pm > 0.f ? 32767.f / pm : 0.f;
        osc[i] = pm / 32767.f;
        for (int64_t t = 0; t < n; t++) wq[i][t] = (int16_t)nearbyintf(p[t] * inv);
    }
    const int8_t *V = (const int8_t *)kv.v + t0 * D;
    for (int64_t d = 0; d < D; d += 8) {
        int32x4_t a[8][2];
        for (int i = 0; i < G; i++) a[i][0] = a[i][1] = vdupq_n_s32(0);
        for (int64_t t = 0; t < n; t++) {
            const int16x8_t v = vmovl_s8(vld1_s8(V + t * D + d));
            for (int i = 0; i < G; i++) {
                a[i][0] = vmlal_n_s16(a[i][0], vget_low_s16(v), wq[i][t]);
                a[i][1] = vmlal_high_n_s16(a[i][1], v, wq[i][t]);
            }
        }
        for (int i = 0; i < G; i++) {
            vst1q_f32(o + i * D + d, vmulq_n_f32(vcvtq_f32_s32(a[i][0]), osc[i]));
            vst1q_f32(o + i * D + d + 4, vmulq_n_f32(vcvtq_f32_s32(a[i][1]), osc[i]));
        }
    }
}

/* G (<= 8) query heads qs [G, D] over keys [t0, t1) of kv; D % 4 == 0 (bf16 cache), D % 8 == 0 and
 * D <= 512 (int8 cache) */
static inline __attribute__((always_inline)) void attend_block_neon(kv_rows kv, const int i8, int64_t D, const float *qs,
                                                                    float scale, const int G, int64_t t0, int64_t t1,
                                                                    float *sc, float *o, float *mx, float *sm) {
    const int64_t n = t1 - t0;
    const uint16_t *K = (const uint16_t *)kv.k, *V = (const uint16_t *)kv.v;
    for (int64_t t = 0; t < KV_AHEAD && t < n; t++) kv_prefetch(kv, i8, D, t0 + t);
    if (i8) {
        int16_t qi[8 * 512];
        float qsc[8];
        quant_q16_ref(qs, D, G, scale, qi, qsc);
        scores_i8_neon(kv, D, qi, qsc, G, t0, n, sc);
    }
    for (int64_t t = 0; !i8 && t < n; t++) {
        float32x4_t acc[8];
        for (int i = 0; i < G; i++) acc[i] = vdupq_n_f32(0.f);
        kv_prefetch(kv, 0, D, t0 + t + KV_AHEAD);
        const uint16_t *kr = K + (t0 + t) * D;
        for (int64_t d = 0; d < D; d += 4) {
            const float32x4_t k = bf4_neon(kr + d);
            for (int i = 0; i < G; i++) acc[i] = vfmaq_f32(acc[i], vld1q_f32(qs + i * D + d), k);
        }
        for (int i = 0; i < G; i++) sc[i * KVB + t] = vaddvq_f32(acc[i]) * scale;
    }
    for (int i = 0; i < G; i++) {
        float *p = sc + i * KVB, m_ = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) m_ = p[t] > m_ ? p[t] : m_;
        for (int64_t t = 0; t < n; t++) { p[t] = expf(p[t] - m_); sum += p[t]; }
        mx[i] = m_, sm[i] = sum;
        for (int64_t d = 0; !i8 && d < D; d += 4) vst1q_f32(o + i * D + d, vdupq_n_f32(0.f));
    }
    if (i8) {
        v_i8_neon(kv, D, G, t0, n, sc, o);
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *vr = V + (t0 + t) * D;
        for (int64_t d = 0; d < D; d += 4) {
            const float32x4_t v = bf4_neon(vr + d);
            for (int i = 0; i < G; i++) {
                float *od = o + i * D + d;
                vst1q_f32(od, vaddq_f32(vld1q_f32(od), vmulq_n_f32(v, sc[i * KVB + t])));
            }
        }
    }
}
#endif
