/* The pointwise parts between the products, per token, fp32: RMS norms, RoPE, the q/k norms
 * and the KV-cache write, the attention output gate, residual adds, SwiGLU / GELU, and embedding rows. */

/* 1 / rms(x) (eps inside the root), the sum of squares in fp64 */
static float rms_inv(const float *x, int64_t d, double eps) {
    double ss = 0.0;
    int64_t i0 = 0;
#ifdef SQ_AVX512
    { /* the sum of squares in fp64 on 8 lanes x 2 chains (a serial fp64 sum waits on each add) */
        __m512d a = _mm512_setzero_pd(), b = a;
        for (; i0 + 16 <= d; i0 += 16) {
            const __m512d u = _mm512_cvtps_pd(_mm256_loadu_ps(x + i0)), v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i0 + 8));
            a = _mm512_fmadd_pd(u, u, a);
            b = _mm512_fmadd_pd(v, v, b);
        }
        ss = _mm512_reduce_add_pd(_mm512_add_pd(a, b));
    }
#endif
    for (int64_t i = i0; i < d; i++) ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / d + eps));
}

static void rms_norm(const float *x, const uint16_t *w, int64_t d, double eps, int offset, float *out) {
    if (!w) { /* a layer without this norm (OLMo2 has none before attention and the MLP) */
        if (out != x) memcpy(out, x, sizeof(float) * d);
        return;
    }
    const float r = rms_inv(x, d, eps);
    for (int64_t i = 0; i < d; i++) out[i] = x[i] * r * (offset ? 1.f + bf(w[i]) : bf(w[i]));
}

static void rope(float *v, const uint16_t *cos, const uint16_t *sin, int64_t rot) {
    int64_t h = rot / 2, i = 0;
#ifdef SQ_AVX512
    for (; i + 16 <= h; i += 16) {
        const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + i + h);
        _mm512_storeu_ps(v + i, _mm512_sub_ps(_mm512_mul_ps(a, load_bf16x16(cos + i)), _mm512_mul_ps(b, load_bf16x16(sin + i))));
        _mm512_storeu_ps(v + i + h, _mm512_add_ps(_mm512_mul_ps(b, load_bf16x16(cos + i + h)), _mm512_mul_ps(a, load_bf16x16(sin + i + h))));
    }
#endif
    for (; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * bf(cos[i]) - b * bf(sin[i]);
        v[i + h] = b * bf(cos[i + h]) + a * bf(sin[i + h]);
    }
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}


/* x [n] -> int8 codes and one bf16 scale: s = bf16(max|x| / 127), code = round-to-even(x / s)
 * within +-127 (all zero when s is 0); x ~ code * s. The torch runtime's KVCache.quantize does
 * the same arithmetic. */
static void quant_row_q8(const float *x, int64_t n, int8_t *code, uint16_t *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    *scale = to_bf(amax / 127.f);
    const float s = bf(*scale);
    for (int64_t i = 0; i < n; i++) {
        const float r = s > 0.f ? nearbyintf(x[i] / s) : 0.f;
        code[i] = (int8_t)(r > 127.f ? 127 : r < -127.f ? -127 : (int)r);
    }
}

/* layer L's view of the KV slot at element offset kvoff of its caches (batch.c: a slot of a
 * [slots, kv_heads, cap, head_dim] cache; the scales' slot offset is kvoff / head_dim); a recurrent
 * layer's view of the same slot's states, slot kvoff / (kv_heads * cap * head_dim) of its
 * conv_state and rec_state (mix_state_floats each) */
static inline sq_layer layer_slot(const sq_model *m, const sq_layer *L, int64_t kvoff) {
    sq_layer s = *L;
    if (L->mixer != MIXER_ATTN) {
        const int64_t per = m->kv_heads * m->cap * m->head_dim, slot = per > 0 ? kvoff / per : 0;
        int64_t nc, nr;
        mix_state_floats(m, L, &nc, &nr);
        if (L->conv_state) s.conv_state = L->conv_state + slot * nc;
        if (L->rec_state) s.rec_state = L->rec_state + slot * nr;
        if (!has_attn(L)) return s;
    }
    if (m->kv_int8) {
        s.kcache = (int8_t *)L->kcache + kvoff, s.vcache = (int8_t *)L->vcache + kvoff;
        s.kscale = L->kscale + kvoff / m->head_dim, s.vscale = L->vscale + kvoff / m->head_dim;
    } else {
        s.kcache = (uint16_t *)L->kcache + kvoff, s.vcache = (uint16_t *)L->vcache + kvoff;
    }
    return s;
}

/* Per-layer geometry (Gemma 4): layer L's head dim; the model as L's attention sees it (its head dim,
 * in a copy at *buf where it differs from the model's, the largest); a KV slot's element offset
 * (model units: kv_heads * cap * head_dim per slot) in L's caches */
static inline int64_t layer_hd(const sq_model *m, const sq_layer *L) { return L->head_dim > 0 ? L->head_dim : m->head_dim; }
static inline const sq_model *layer_model(const sq_model *m, const sq_layer *L, sq_model *buf) {
    if (L->head_dim <= 0 || L->head_dim == m->head_dim) return m;
    *buf = *m;
    buf->head_dim = L->head_dim;
    return buf;
}
static inline int64_t layer_kvoff(const sq_model *m, const sq_layer *L, int64_t kvoff) {
    return L->head_dim > 0 && L->head_dim != m->head_dim ? kvoff / m->head_dim * L->head_dim : kvoff;
}

/* x [d] RMS-normed in place without a weight (Gemma 4's v norm) */
static void rms_plain(float *x, int64_t d, double eps) {
    const float r = rms_inv(x, d, eps);
    for (int64_t i = 0; i < d; i++) x[i] *= r;
}

/* one position's K and V rows of KV head g into the layer's cache (bf16, or int8 + scales) */
static void kv_store(const sq_model *m, const sq_layer *L, int64_t g, int64_t pos, const float *k, const float *v) {
    const int64_t D = m->head_dim, at = g * m->cap + pos;
    if (m->kv_int8) {
        quant_row_q8(k, D, (int8_t *)L->kcache + at * D, L->kscale + at);
        quant_row_q8(v, D, (int8_t *)L->vcache + at * D, L->vscale + at);
    } else {
        to_bf_n(k, (uint16_t *)L->kcache + at * D, D);
        to_bf_n(v, (uint16_t *)L->vcache + at * D, D);
    }
}

/* Head h of one token's q/k/v row (q heads, k heads, v heads, contiguous) at position pos: a
 * query (h < H) or key head normed and rotated in place; a key head's K and its V row then go
 * to the layer's cache. */
static void qk_rope_head(const sq_model *m, const sq_layer *L, float *q, int64_t pos, int64_t h) {
    const int64_t H = m->heads, KV = m->kv_heads, D = m->head_dim;
    float *hv = q + h * D; /* q heads then k heads are contiguous */
    if (L->q_norm && !m->qk_norm_full) rms_norm(hv, h < H ? L->q_norm : L->k_norm, D, m->eps, (int)m->norm_offset, hv);
    rope(hv, L->cos + pos * L->rot, L->sin + pos * L->rot, L->rot);
    if (h >= H) {
        float *v = q + (H + KV + h - H) * D;
        if (m->v_norm) rms_plain(v, D, m->eps);
        kv_store(m, L, h - H, pos, hv, v);
    }
}

/* the heads qk_rope_head visits: a KV-sharing layer's queries only */
static inline int64_t rope_heads(const sq_model *m, const sq_layer *L) { return m->heads + (L->kv_shared ? 0 : m->kv_heads); }

/* q and k of one token normed over all their heads (qk_norm_full, OLMo2), before the per-head RoPE */
static void qk_norm_wide(const sq_model *m, const sq_layer *L, float *q) {
    if (!m->qk_norm_full || !L->q_norm) return;
    const int64_t H = m->heads, KV = m->kv_heads, D = m->head_dim;
    rms_norm(q, L->q_norm, H * D, m->eps, (int)m->norm_offset, q);
    rms_norm(q + H * D, L->k_norm, KV * D, m->eps, (int)m->norm_offset, q + H * D);
}

/* every head of one token (the prefill; the decode step spreads the heads over its threads) */
static void qk_rope_cache(const sq_model *m, const sq_layer *L, float *q, int64_t pos) {
    qk_norm_wide(m, L, q);
    for (int64_t h = 0; h < rope_heads(m, L); h++) qk_rope_head(m, L, q, pos, h);
}

/* x += h (one token's residual stream), h normed first where the layer has a post-norm (gemma),
 * times res_mult where the model has one (Granite) */
static void add_residual(const sq_model *m, const uint16_t *post_norm, float *h, float *x) {
    if (post_norm) rms_norm(h, post_norm, m->hidden, m->eps, (int)m->norm_offset, h);
    if (m->res_mult != 0.0 && m->res_mult != 1.0) {
        const float r = (float)m->res_mult;
        for (int64_t i = 0; i < m->hidden; i++) x[i] += h[i] * r;
        return;
    }
    for (int64_t i = 0; i < m->hidden; i++) x[i] += h[i];
}


/* exact GELU x * Phi(x) = x/2 (1 + erf(x / sqrt 2)); the SIMD versions below take erf from
 * Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7 absolute: the rational term times exp(-z^2)) */
static inline float gelu_erf(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }

static const float ERF_A[6] = {1.061405429f, -1.453152027f, 1.421413741f, -0.284496736f, 0.254829592f, 0.3275911f};

#ifdef SQ_AVX2
static inline __m256 gelu_erf8(__m256 x) {
    const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));
    const __m256 az = _mm256_andnot_ps(_mm256_set1_ps(-0.f), z);
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(az, _mm256_set1_ps(ERF_A[5]), _mm256_set1_ps(1.f)));
    __m256 p = _mm256_set1_ps(ERF_A[0]);
    for (int i = 1; i < 5; i++) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(ERF_A[i]));
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_min_ps(_mm256_mul_ps(az, az), _mm256_set1_ps(87.f))));
    const __m256 r = _mm256_fnmadd_ps(_mm256_mul_ps(p, t), e, _mm256_set1_ps(1.f)); /* erf(|z|) */
    const __m256 erf = _mm256_or_ps(r, _mm256_and_ps(z, _mm256_set1_ps(-0.f)));    /* its sign */
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.f), erf));
}
#endif
#ifdef SQ_AVX512
static inline __m512 gelu_erf16(__m512 x) { /* gelu_erf8 on 16 lanes */
    const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
    const __m512 az = _mm512_abs_ps(z);
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(az, _mm512_set1_ps(ERF_A[5]), _mm512_set1_ps(1.f)));
    __m512 p = _mm512_set1_ps(ERF_A[0]);
    for (int i = 1; i < 5; i++) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(ERF_A[i]));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_min_ps(_mm512_mul_ps(az, az), _mm512_set1_ps(87.f))));
    const __m512 r = _mm512_fnmadd_ps(_mm512_mul_ps(p, t), e, _mm512_set1_ps(1.f));
    const __m512 erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r),
        _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.f), erf));
}
#endif

/* out [I] = act(gate) * up of one token's gate_up product [gate I | up I]; act 0 SiLU, 1 GELU-tanh,
 * 2 GELU (erf) */
static inline void silu_mul(const float *gu, int64_t I, int act, float *out) {
    int64_t i = 0;
#ifdef SQ_AVX512
    if (act == 0)
        for (; i + 16 <= I; i += 16) { /* the AVX2 loop below on 16 lanes */
            const __m512 g = _mm512_loadu_ps(gu + i);
            const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(87.f)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                                    _mm512_loadu_ps(gu + I + i)));
        }
    else if (act == 2)
        for (; i + 16 <= I; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(gelu_erf16(_mm512_loadu_ps(gu + i)), _mm512_loadu_ps(gu + I + i)));
#endif
#ifdef SQ_AVX2
    if (act == 0)
        for (; i + 8 <= I; i += 8) {
            const __m256 g = _mm256_loadu_ps(gu + i);
            /* g / (1 + e^-g); e^-g for g < -87 is clamped (the quotient is then -0 or tiny) */
            const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(87.f)));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                                    _mm256_loadu_ps(gu + I + i)));
        }
    else if (act == 2)
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu_erf8(_mm256_loadu_ps(gu + i)), _mm256_loadu_ps(gu + I + i)));
#endif
    for (; i < I; i++) {
        const float g = gu[i];
        if (act == 3) { /* relu2: squared ReLU of gu [I], no gate (Nemotron-H) */
            out[i] = g > 0.f ? g * g : 0.f;
            continue;
        }
        out[i] = (act == 0 ? g / (1.f + expf(-g)) : act == 1 ? gelu_tanh(g) : gelu_erf(g)) * gu[I + i];
    }
}

/* The attention output gate of one token: each query head's output att [H * D] times sigmoid of
 * its gate values g [H * gate_width] (one per head, or one per channel when gate_width is D) */
static void attn_gate(const sq_model *m, const float *g, float *att) {
    const int64_t H = m->heads, D = m->head_dim, W = m->gate_width;
    if (!W) return;
    for (int64_t h = 0; h < H; h++) {
        float s = 0.f;
        for (int64_t d = 0; d < D; d++) {
            if (d == 0 || W > 1) s = 1.f / (1.f + expf(-g[h * W + (W == 1 ? 0 : d)])); /* once per gate value */
            att[h * D + d] *= s;
        }
    }
}


/* embedding row -> fp32 */
static void embed_row(const sq_linear *E, int64_t id, float *x) {
    const int64_t K = E->k;
    if (is_q4(E)) {
        const uint8_t *w = E->q + id * (K / 2);
        const int64_t rid = E->res ? res_row(E, id) : -1; /* its row of a split embedding's second plane */
        float t[16]; /* the codes' values: q - 8 (int4) or the row's levels (lut4) */
        for (int j = 0; j < 16; j++) t[j] = E->kind == KIND_LUT4 ? (float)E->lut[16 * id + j] : j - 8.f;
        for (int64_t b = 0; b < K / 32; b++)
            for (int j = 0; j < 16; j++) {
                int64_t k0 = 32 * b + j, k1 = k0 + 16;
                const uint16_t *p0 = E->sz + 2 * ((k0 / E->g) * E->n + id), *p1 = E->sz + 2 * ((k1 / E->g) * E->n + id);
                x[k0] = t[w[16 * b + j] & 15] * bf(p0[0]) + bf(p0[1]);
                x[k1] = t[w[16 * b + j] >> 4] * bf(p1[0]) + bf(p1[1]);
                if (rid >= 0) { /* a split embedding: add the second plane */
                    const uint8_t r = E->res[rid * (K / 2) + 16 * b + j];
                    const uint16_t *rs = E->rsc + rid * (K / E->g);
                    x[k0] += ((r & 15) - 8.f) * bf(rs[k0 / E->g]);
                    x[k1] += ((r >> 4) - 8.f) * bf(rs[k1 / E->g]);
                }
                x[k0] = bf(to_bf(x[k0]));
                x[k1] = bf(to_bf(x[k1]));
            }
    } else if (E->kind == KIND_INT8) {
        const int8_t *w = (const int8_t *)E->q + id * K;
        float s = bf(E->sz[id]);
        for (int64_t k = 0; k < K; k++) x[k] = bf(to_bf(w[k] * s));
    } else {
        const uint16_t *w = (const uint16_t *)E->q + id * K;
        for (int64_t k = 0; k < K; k++) x[k] = bf(w[k]);
    }
}

/* One token's per-layer inputs (Gemma 4) ple [layers * P] from ctx [layers * P], the ple_model
 * product of its scaled embedding (overwritten): per layer l, (norm(ctx_l / sqrt(hidden), ple_in_norm)
 * + ple_embed[token]_l * sqrt(P)) / sqrt(2), sqrt(P) rounded to bf16 as transformers' scale is */
static void ple_combine(const sq_model *m, int64_t token, float *ctx, float *ple) {
    const int64_t P = m->ple_dim;
    embed_row(&m->ple_embed, token, ple);
    const float sp = bf(to_bf(sqrtf((float)P))), se = (float)(1.0 / sqrt((double)m->hidden));
    for (int64_t l = 0; l < m->layers; l++) {
        float *c = ctx + l * P, *p = ple + l * P;
        for (int64_t i = 0; i < P; i++) c[i] *= se;
        rms_norm(c, m->ple_in_norm, P, m->eps, (int)m->norm_offset, c);
        for (int64_t i = 0; i < P; i++) p[i] = (c[i] + p[i] * sp) * 0.70710678118654752f;
    }
}

/* x [hidden] times the layer's scalar (Gemma 4), where it has one */
static inline void layer_scale(const sq_model *m, const sq_layer *L, float *x) {
    if (L->scalar == 0.0) return;
    const float s = (float)L->scalar;
    for (int64_t i = 0; i < m->hidden; i++) x[i] *= s;
}
