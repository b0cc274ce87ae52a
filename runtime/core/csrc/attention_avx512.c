/* The decode attention's block kernels on AVX512: the int8 cache's V sums (v_i8_avx512, which
 * v_i8_avx2 calls) and the bf16 cache's block (attend_block_avx512). The reference is attention.c. */
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
