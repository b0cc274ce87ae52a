/* The Gated DeltaNet layer mixer (sq_layer.mixer MIXER_GDN: Qwen3.5, Qwen3-Next, OLMo Hybrid), fp32
 * throughout. For each token of one sequence, from its qkv product u [C] (C = 2 Kd + Vd) and its gate
 * product z | b | a [Vd + 2 Hv]:
 *   conv   c[ch] = silu(sum_{j < K-1} w[ch][j] state[ch][j] + w[ch][K-1] u[ch]), the state then
 *          shifted (oldest dropped, u appended): a depthwise causal conv over the pre-conv inputs
 *   q, k   c[0:Kd], c[Kd:2Kd] as Hk heads of dk, each l2-normed (x / sqrt(sum x^2 + 1e-6)), q then
 *          times 1/sqrt(dk); v = c[2Kd:] as Hv heads of dv
 *   gates  beta = beta_scale sigmoid(b), decay = exp(-exp(a_log) softplus(a + dt_bias))
 *   state  per value head h (key head h / (Hv / Hk)): S *= decay; kv = S^T k; delta = (v - kv) beta;
 *          S += k delta^T; o = S^T q (the updated S)
 *   norm   o = o / sqrt(mean(o^2) + gnorm_eps) * gnorm * silu(z), per head over dv
 * and the layer's output o [Vd] goes through o (out_proj) like attention's.
 *
 * The work is split in items whose arithmetic never depends on which thread runs them or on how
 * many tokens a call holds: conv items (GDN_CB channels, each sequential over the tokens), l2 items
 * (one token's q or k head), state items (GDN_JB columns of one value head's S: columns are
 * independent in the delta rule, each sequential over the tokens) and norm items (one token's value
 * head). The decode step (one token), the prompt (a chunk of tokens: the
 * same items over more tokens) and the batched step (each row's items on its own slot) run the
 * same per-token, per-column arithmetic, so a prompt leaves the bits a token-by-token decode would,
 * at any thread count, given the same products. No sum is split across threads. */

#define GDN_CB 64   /* conv channels per conv item */
#define GDN_JB 64   /* state columns per state item */
#define GDN_KMAX 16 /* the longest conv kernel */

/* the layer shape's per-token widths (work.c sizes the buffers by them) */
static inline int64_t gdn_kd(const sq_model *m) { return m->lin_k_heads * m->lin_k_dim; }

/* whether the model's GDN shape can run (sq_mix checks it; sq_work_new and sq_prefill mix_model_ok) */
static int gdn_shape_ok(const sq_model *m) {
    return m->lin_k_heads > 0 && m->lin_v_heads > 0 && m->lin_v_heads % m->lin_k_heads == 0 && m->lin_k_dim > 0 &&
           m->lin_v_dim > 0 && m->conv_k >= 1 && m->conv_k <= GDN_KMAX;
}

/* whether the model's GDN shape is none (all 0: no GDN layers) or one they can run (conv_k: any
 * recurrent mixer's, checked by the mixer that has one) */
static int gdn_model_ok(const sq_model *m) {
    if (!m->lin_k_heads && !m->lin_v_heads && !m->lin_k_dim && !m->lin_v_dim) return 1;
    return gdn_shape_ok(m);
}

static inline float gdn_silu(float x) { return x / (1.f + expf(-x)); }

/* y[j] = silu(x[j]) (in place allowed): silu_mul's arithmetic (pointwise.c), exp8 / exp16 on the
 * SIMD lanes, expf on the tail */
static inline void gdn_silu_n(const float *x, float *y, int64_t n) {
    int64_t j = 0;
#ifdef SQ_AVX512
    for (; j + 16 <= n; j += 16) {
        const __m512 g = _mm512_loadu_ps(x + j);
        const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(87.f)));
        _mm512_storeu_ps(y + j, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    }
#endif
#ifdef SQ_AVX2
    for (; j + 8 <= n; j += 8) {
        const __m256 g = _mm256_loadu_ps(x + j);
        const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(87.f)));
        _mm256_storeu_ps(y + j, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    }
#endif
    for (; j < n; j++) y[j] = gdn_silu(x[j]);
}

/* sum of x[i]^2 over n in 8 fixed partial sums (i % 8), then combined in order: a fixed order the
 * compiler can vectorize */
static inline float gdn_sumsq(const float *x, int64_t n) {
    float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) p[l] += x[i + l] * x[i + l];
    for (; i < n; i++) p[i % 8] += x[i] * x[i];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

static inline int64_t gdn_conv_items(const sq_model *m) { return (gdn_c(m) + GDN_CB - 1) / GDN_CB; }

static inline int64_t gdn_state_items(const sq_model *m) {
    return m->lin_v_heads * ((m->lin_v_dim + GDN_JB - 1) / GDN_JB);
}

/* Conv item `it` of a depthwise causal conv over C channels (w [C, K], bias [C] or NULL, the slot's
 * state [C, K - 1]): channels [it GDN_CB, +GDN_CB) of T tokens (row t at x + t * ldx: pre-conv in,
 * conv out, in place; act 1: SiLU'd), the state advanced by T tokens. The weights and the window of
 * previous inputs are held transposed meanwhile (a ring of K - 1 rows of channels), so each token's
 * channels are one vector loop. Per channel: c = ((bias (or 0) + w0 s0) + w1 s1) ...  + w[K-1] u. */
static void conv_item(const float *w_, const float *bias, float *state, int64_t C, int64_t K, int64_t it, float *x0,
                      int64_t ldx, int64_t T, int act) {
    const int64_t c0 = it * GDN_CB, n = C - c0 < GDN_CB ? C - c0 : GDN_CB;
    float wt[GDN_KMAX][GDN_CB], win[GDN_KMAX][GDN_CB], acc[GDN_CB], b0[GDN_CB];
    const float *w = w_ + c0 * K;
    float *st = state + c0 * (K - 1);
    for (int64_t ch = 0; ch < n; ch++) {
        for (int64_t j = 0; j < K; j++) wt[j][ch] = w[ch * K + j];
        for (int64_t j = 0; j < K - 1; j++) win[j][ch] = st[ch * (K - 1) + j];
        b0[ch] = bias ? bias[c0 + ch] : 0.f;
    }
    int64_t r0 = 0; /* the oldest row of the window */
    for (int64_t t = 0; t < T; t++) {
        float *x = x0 + t * ldx + c0;
        if (K == 4) { /* the models' kernel: one pass, the sums in registers (the same sums) */
            const float *s0 = win[r0], *s1 = win[(r0 + 1) % 3], *s2 = win[(r0 + 2) % 3];
            for (int64_t ch = 0; ch < n; ch++)
                acc[ch] = (((b0[ch] + wt[0][ch] * s0[ch]) + wt[1][ch] * s1[ch]) + wt[2][ch] * s2[ch]) + wt[3][ch] * x[ch];
        } else {
            for (int64_t ch = 0; ch < n; ch++) acc[ch] = b0[ch];
            for (int64_t j = 0; j < K - 1; j++) {
                const float *wr = wt[j], *sr = win[(r0 + j) % (K - 1)];
                for (int64_t ch = 0; ch < n; ch++) acc[ch] += wr[ch] * sr[ch];
            }
            const float *wl = wt[K - 1];
            for (int64_t ch = 0; ch < n; ch++) acc[ch] += wl[ch] * x[ch];
        }
        if (K > 1) {
            memcpy(win[r0], x, sizeof(float) * (size_t)n); /* the oldest input out, this one in */
            r0 = (r0 + 1) % (K - 1);
        }
        if (act)
            gdn_silu_n(acc, x, n);
        else
            memcpy(x, acc, sizeof(float) * (size_t)n);
    }
    for (int64_t ch = 0; ch < n; ch++)
        for (int64_t j = 0; j < K - 1; j++) st[ch * (K - 1) + j] = win[(r0 + j) % (K - 1)][ch];
}

/* the GDN layer's conv item: q | k | v channels, no bias, SiLU */
static void gdn_conv_item(const sq_model *m, const sq_layer *L, int64_t it, float *qkv, int64_t ldq, int64_t T) {
    conv_item(L->conv_w, NULL, L->conv_state, gdn_c(m), m->conv_k, it, qkv, ldq, T, 1);
}

/* Head it % (2 Hk) of token it / (2 Hk) (q heads, then k heads) l2-normed in place after the conv,
 * eps inside the root (fla's l2norm); a q head also times 1/sqrt(dk) */
static void gdn_l2_item(const sq_model *m, int64_t it, float *qkv, int64_t ldq) {
    const int64_t Hk = m->lin_k_heads, dk = m->lin_k_dim, hh = it % (2 * Hk);
    float *v = qkv + it / (2 * Hk) * ldq + hh * dk;
    const float r = 1.f / sqrtf(gdn_sumsq(v, dk) + 1e-6f);
    if (hh < Hk) {
        const float qscale = (float)(1.0 / sqrt((double)dk));
        for (int64_t i = 0; i < dk; i++) v[i] = v[i] * r * qscale;
    } else {
        for (int64_t i = 0; i < dk; i++) v[i] *= r;
    }
}

/* The delta rule on nj <= GDN_JB columns of one value head's state S [dk rows, stride ld] (from its
 * first column; v, o, kv from it too), in two kinds of passes over S, per column j:
 *   gdn_decay  (token t's first half)  S[i][j] *= decay_t; kv[j] = sum_i k_t[i] S[i][j]
 *   gdn_update (its second half)       d = (v_t[j] - kv[j]) beta_t; S[i][j] += k_t[i] d;
 *                                      o_t[j] = sum_i q_t[i] S[i][j]
 *              and, given the next token (kn: k_{t+1}, dn: decay_{t+1}), its first half in the same
 *              pass: S[i][j] *= dn; kv[j] = sum_i kn[i] S[i][j]
 * Every sum is over i ascending, every value the one the separate passes give (the fused pass only
 * skips a store and a load), so a token gets the same bits whether its neighbours share its call.
 * The SIMD versions use fused multiply-adds, every column alike (tails masked). */
#if defined(SQ_AVX512) || defined(SQ_AVX2)
#include "gdn_simd.c" /* the state loops on AVX512 / AVX2: the same arithmetic per column */
#else
static inline void gdn_decay(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, float decay, float *kv) {
    for (int64_t j = 0; j < nj; j++) kv[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        float *s = S + i * ld;
        const float ki = k[i];
        for (int64_t j = 0; j < nj; j++) {
            const float x = s[j] * decay;
            s[j] = x;
            kv[j] += ki * x;
        }
    }
}
static inline void gdn_update(float *S, int64_t dk, int64_t ld, int64_t nj, const float *k, const float *q,
                              const float *v, float beta, float *kv, float *o, const float *kn, float dn) {
    float d[GDN_JB], acc[GDN_JB];
    for (int64_t j = 0; j < nj; j++) d[j] = (v[j] - kv[j]) * beta, acc[j] = 0.f, kv[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        float *s = S + i * ld;
        const float ki = k[i], qi = q[i], ni = kn ? kn[i] : 0.f;
        if (kn) {
            for (int64_t j = 0; j < nj; j++) {
                const float x = s[j] + ki * d[j], y = x * dn;
                acc[j] += qi * x;
                s[j] = y;
                kv[j] += ni * y;
            }
        } else {
            for (int64_t j = 0; j < nj; j++) {
                const float x = s[j] + ki * d[j];
                s[j] = x;
                acc[j] += qi * x;
            }
        }
    }
    for (int64_t j = 0; j < nj; j++) o[j] = acc[j];
}
#endif

/* token t's gates for value head h from its gate products zr (z | b | a): beta, decay */
static inline void gdn_gates(const sq_model *m, const sq_layer *L, int64_t h, const float *zr, float *beta,
                             float *decay) {
    const int64_t Vd = gdn_vd(m), Hv = m->lin_v_heads;
    *beta = (float)m->beta_scale * (1.f / (1.f + expf(-zr[Vd + h])));
    const float a = zr[Vd + Hv + h] + L->dt_bias[h], sp = a > 20.f ? a : log1pf(expf(a)); /* softplus, torch's threshold */
    *decay = expf(-expf(L->a_log[h]) * sp);
}

/* State item `it` (value head it / nb, its columns GDN_JB * (it % nb).. of nb per head) of T tokens:
 * the gates of each token from its gate products (row t at zba + t * ldz: z [Vd] | b [Hv] | a [Hv]),
 * the state advanced, the un-normed outputs to out + t * ldo (o [Vd]). qkv: after the conv and l2
 * items. */
static void gdn_state_item(const sq_model *m, const sq_layer *L, int64_t it, const float *qkv, int64_t ldq,
                           const float *zba, int64_t ldz, int64_t T, float *out, int64_t ldo) {
    const int64_t Hv = m->lin_v_heads, dk = m->lin_k_dim, dv = m->lin_v_dim, Kd = gdn_kd(m);
    const int64_t nb = (dv + GDN_JB - 1) / GDN_JB, h = it / nb, j0 = (it % nb) * GDN_JB;
    const int64_t nj = dv - j0 < GDN_JB ? dv - j0 : GDN_JB, g = h / (Hv / m->lin_k_heads);
    float *S = L->rec_state + h * dk * dv + j0, *blk = NULL, *W = S, kv[GDN_JB];
    int64_t ld = dv;
    /* several tokens: the columns contiguous meanwhile (the same values: a copy). In place their rows
     * (nj of dv) fill only part of the L1 sets, and every token's passes streamed them from L2
     * (2.2x the time at dk = dv = 128, T = 512). */
    if (T > 1 && (blk = alloc64(sizeof(float) * (size_t)(dk * nj)))) {
        for (int64_t i = 0; i < dk; i++) memcpy(blk + i * nj, S + i * dv, sizeof(float) * (size_t)nj);
        W = blk, ld = nj;
    }
    const float *x = qkv; /* token t's conv outputs: q at g dk, k at Kd + g dk, v at 2 Kd + h dv */
    float beta, decay, nbeta = 0.f, ndecay = 0.f;
    gdn_gates(m, L, h, zba, &beta, &decay);
    gdn_decay(W, dk, ld, nj, x + Kd + g * dk, decay, kv);
    for (int64_t t = 0; t < T; t++, x += ldq) {
        const float *kn = NULL;
        if (t + 1 < T) {
            gdn_gates(m, L, h, zba + (t + 1) * ldz, &nbeta, &ndecay);
            kn = x + ldq + Kd + g * dk;
        }
        gdn_update(W, dk, ld, nj, x + Kd + g * dk, x + g * dk, x + 2 * Kd + h * dv + j0, beta, kv,
                   out + t * ldo + h * dv + j0, kn, ndecay);
        beta = nbeta;
    }
    if (blk) {
        for (int64_t i = 0; i < dk; i++) memcpy(S + i * dv, blk + i * nj, sizeof(float) * (size_t)nj);
        free(blk);
    }
}

/* The gated RMSNorm of one token's value head h: o [Vd] (in place) with its z (zr: the token's gate
 * products). The sum of squares in fp64, 4 fixed partial sums. */
static void gdn_norm(const sq_model *m, const sq_layer *L, int64_t h, const float *zr, float *o) {
    const int64_t dv = m->lin_v_dim;
    float *y = o + h * dv, sz[64];
    const float *z = zr + h * dv;
    double p[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t j = 0;
    for (; j + 4 <= dv; j += 4)
        for (int l = 0; l < 4; l++) p[l] += (double)y[j + l] * y[j + l];
    for (; j < dv; j++) p[j % 4] += (double)y[j] * y[j];
    const float r = (float)(1.0 / sqrt(((p[0] + p[1]) + (p[2] + p[3])) / (double)dv + m->gnorm_eps));
    for (int64_t j0 = 0; j0 < dv; j0 += 64) {
        const int64_t n = dv - j0 < 64 ? dv - j0 : 64;
        gdn_silu_n(z + j0, sz, n);
        for (int64_t i = 0; i < n; i++) y[j0 + i] = y[j0 + i] * r * L->gnorm[j0 + i] * sz[i];
    }
}

/* T tokens of one sequence through a GDN layer's mixer (L: its slot's view, layer_slot): qkv [T] rows
 * of C at stride ldq (overwritten: the conv outputs), zba [T] rows of Vd + 2 Hv at stride ldz, out
 * [T] rows of Vd at stride ldo. Worksharing loops: every thread of a parallel region calls it (the
 * decode step), or one thread outside any (it then runs alone). */
static void gdn_mix_team(const sq_model *m, const sq_layer *L, float *qkv, int64_t ldq, const float *zba, int64_t ldz,
                         int64_t T, float *out, int64_t ldo) {
    const int64_t Hk = m->lin_k_heads, Hv = m->lin_v_heads, nc = gdn_conv_items(m), ns = gdn_state_items(m);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nc; it++) gdn_conv_item(m, L, it, qkv, ldq, T);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < T * 2 * Hk; it++) gdn_l2_item(m, it, qkv, ldq);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < ns; it++) gdn_state_item(m, L, it, qkv, ldq, zba, ldz, T, out, ldo);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < T * Hv; it++) gdn_norm(m, L, it % Hv, zba + it / Hv * ldz, out + it / Hv * ldo);
}

/* The recurrent layers' states of the slot at kvoff emptied: a sequence at position 0 (sq_step,
 * sq_prefill, a row of sq_step_many) starts from zero states, as attention reads nothing of its
 * cache past the position, so a slot is reused without clearing it first */
static void mix_reset_slot(const sq_model *m, int64_t kvoff) {
    for (int64_t li = 0; li < m->layers; li++) {
        if (m->layer[li].mixer == MIXER_ATTN) continue;
        const sq_layer s = layer_slot(m, &m->layer[li], kvoff);
        int64_t nc, nr;
        mix_state_floats(m, &m->layer[li], &nc, &nr);
        if (s.conv_state && nc) memset(s.conv_state, 0, sizeof(float) * (size_t)nc);
        if (s.rec_state && nr) memset(s.rec_state, 0, sizeof(float) * (size_t)nr);
    }
}
