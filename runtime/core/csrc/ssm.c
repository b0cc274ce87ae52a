/* The convolution and state-space layer mixers beside the Gated DeltaNet (gdn.c), fp32 throughout:
 *
 * MIXER_SCONV, a gated short convolution (LFM2 / LFM3). From one token's qkv product B | C | x [3 E]:
 *   u[ch] = B[ch] x[ch]; c = (((0 + w0 s0) + w1 s1) ...) + w[K-1] u (the conv over the last K - 1 u,
 *   no activation; the state then shifted); out[ch] = C[ch] c.
 * MIXER_MAMBA, a Mamba-2 layer (Granite 4.0-H, Nemotron-H; Falcon-H1's MIXER_PARALLEL branch through its
 * ssm_in / ssm_gate / ssm_out: parallel_step, parallel_rows). From the qkv product x | B | C [Cm] and the gate product
 *   z | dt [inner + H]:
 *   conv   xBC = silu(bias + conv(x | B | C)) over the last K - 1 inputs (gdn.c's conv, with a bias)
 *   state  per head h (group g = h / (H / G)): dt = softplus(dt_h + dt_bias[h]), a = exp(-exp(a_log[h]) dt);
 *          per row p of its P: S[p][n] = S[p][n] a + (dt x[p]) B_g[n]; y[p] = sum_n S[p][n] C_g[n] + D[h] x[p]
 *   norm   y * silu(z), RMS-normed per group of inner / norm_groups channels (eps gnorm_eps), times gnorm
 *          (norm_groups 0: y * silu(z) alone)
 * and the output goes through o like attention's.
 *
 * As in gdn.c the work is in items whose arithmetic does not depend on the thread or on how many tokens
 * a call holds (conv items: channel blocks, each sequential over the tokens; state items: SSM_PB rows of
 * one head, sequential over the tokens; norm items: one token's group), so the decode step, the prompt
 * and the batched step leave the same bits. */

#define SSM_PB 16 /* state rows per state item */

/* whether the model's Mamba-2 and short-conv shapes are none or ones they can run */
static int ssm_model_ok(const sq_model *m) {
    const int64_t H = m->ssm_heads, G = m->ssm_groups, NG = m->ssm_norm_groups;
    const int conv_ok = m->conv_k >= 1 && m->conv_k <= GDN_KMAX;
    if (m->sc_dim < 0 || (m->sc_dim && !conv_ok)) return 0;
    if (!H && !m->ssm_head_dim && !m->ssm_state && !G && !NG) return 1;
    return H > 0 && G > 0 && H % G == 0 && m->ssm_head_dim > 0 && m->ssm_state > 0 && NG >= 0 &&
           (!NG || ssm_inner(m) % NG == 0) && conv_ok;
}

static int mix_model_ok(const sq_model *m) { return gdn_model_ok(m) && ssm_model_ok(m); }

/* SCONV conv item `it`: channels [it GDN_CB, +GDN_CB) of T tokens, rows of B | C | x at qkv + t ldq;
 * out + t ldo gets C * conv(B * x) (x overwritten by B * x, then by the conv) */
static void sconv_item(const sq_model *m, const sq_layer *L, int64_t it, float *qkv, int64_t ldq, int64_t T,
                       float *out, int64_t ldo) {
    const int64_t E = m->sc_dim, c0 = it * GDN_CB, n = E - c0 < GDN_CB ? E - c0 : GDN_CB;
    for (int64_t t = 0; t < T; t++) {
        float *r = qkv + t * ldq;
        for (int64_t ch = c0; ch < c0 + n; ch++) r[2 * E + ch] *= r[ch];
    }
    conv_item(L->conv_w, NULL, L->conv_state, E, m->conv_k, it, qkv + 2 * E, ldq, T, 0);
    for (int64_t t = 0; t < T; t++) {
        const float *r = qkv + t * ldq;
        for (int64_t ch = c0; ch < c0 + n; ch++) out[t * ldo + ch] = r[E + ch] * r[2 * E + ch];
    }
}

/* Mamba state item `it` (head it / nb, rows SSM_PB (it % nb).. of its P) of T tokens: xbc rows after the
 * conv at xbc + t ldq, z | dt rows at zdt + t ldz; y (before the norm) to out + t ldo. The sum over n in
 * 8 fixed partial sums. */
static void mamba_state_item(const sq_model *m, const sq_layer *L, int64_t it, const float *xbc, int64_t ldq,
                             const float *zdt, int64_t ldz, int64_t T, float *out, int64_t ldo) {
    const int64_t H = m->ssm_heads, P = m->ssm_head_dim, N = m->ssm_state, nb = (P + SSM_PB - 1) / SSM_PB;
    const int64_t h = it / nb, p0 = (it % nb) * SSM_PB, np = P - p0 < SSM_PB ? P - p0 : SSM_PB;
    const int64_t inner = ssm_inner(m), g = h / (H / m->ssm_groups);
    const float A = -expf(L->a_log[h]), D = L->ssm_d[h];
    float *S = L->rec_state + (h * P + p0) * N;
    for (int64_t t = 0; t < T; t++) {
        const float *r = xbc + t * ldq, *B = r + inner + g * N, *Cv = r + inner + m->ssm_groups * N + g * N;
        const float d0 = zdt[t * ldz + inner + h] + L->dt_bias[h];
        const float dt = d0 > 20.f ? d0 : log1pf(expf(d0)), a = expf(dt * A); /* softplus, torch's threshold */
        for (int64_t p = 0; p < np; p++) {
            float *s = S + p * N, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            const float xp = r[h * P + p0 + p], dx = dt * xp;
            int64_t n = 0;
            for (; n + 8 <= N; n += 8)
                for (int l = 0; l < 8; l++) {
                    const float v = s[n + l] * a + dx * B[n + l];
                    s[n + l] = v;
                    acc[l] += v * Cv[n + l];
                }
            for (; n < N; n++) {
                const float v = s[n] * a + dx * B[n];
                s[n] = v;
                acc[n % 8] += v * Cv[n];
            }
            out[t * ldo + h * P + p0 + p] = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + D * xp;
        }
    }
}

/* The gated norm of one token's group q: y (in place) times silu(z), RMS-normed over the group, times
 * gnorm; the sum of squares in fp64, 4 fixed partial sums */
static void mamba_norm(const sq_model *m, const sq_layer *L, int64_t q, const float *zr, float *y) {
    const int64_t w = ssm_inner(m) / m->ssm_norm_groups, c0 = q * w;
    float *v = y + c0, sz[64];
    double p[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t j0 = 0; j0 < w; j0 += 64) {
        const int64_t n = w - j0 < 64 ? w - j0 : 64;
        gdn_silu_n(zr + c0 + j0, sz, n);
        for (int64_t i = 0; i < n; i++) v[j0 + i] *= sz[i];
    }
    int64_t j = 0;
    for (; j + 4 <= w; j += 4)
        for (int l = 0; l < 4; l++) p[l] += (double)v[j + l] * v[j + l];
    for (; j < w; j++) p[j % 4] += (double)v[j] * v[j];
    const float r = (float)(1.0 / sqrt(((p[0] + p[1]) + (p[2] + p[3])) / (double)w + m->gnorm_eps));
    for (int64_t i = 0; i < w; i++) v[i] = v[i] * r * L->gnorm[c0 + i];
}

/* T tokens of one sequence through a SCONV or MAMBA layer's mixer (L: its slot's view): qkv [T] rows
 * at stride ldq (overwritten), g [T] gate rows at stride ldg (Mamba's z | dt; unused by SCONV), out [T]
 * rows at stride ldo. Worksharing loops, as gdn_mix_team. */
static void ssm_mix_team(const sq_model *m, const sq_layer *L, float *qkv, int64_t ldq, const float *g, int64_t ldg,
                         int64_t T, float *out, int64_t ldo) {
    if (L->mixer == MIXER_SCONV) {
        const int64_t nc = (m->sc_dim + GDN_CB - 1) / GDN_CB;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < nc; it++) sconv_item(m, L, it, qkv, ldq, T, out, ldo);
        return;
    }
    const int64_t C = ssm_c(m), nc = (C + GDN_CB - 1) / GDN_CB, NG = m->ssm_norm_groups;
    const int64_t ns = m->ssm_heads * ((m->ssm_head_dim + SSM_PB - 1) / SSM_PB);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nc; it++) conv_item(L->conv_w, L->conv_b, L->conv_state, C, m->conv_k, it, qkv, ldq, T, 1);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < ns; it++) mamba_state_item(m, L, it, qkv, ldq, g, ldg, T, out, ldo);
    if (!NG) { /* no norm (Falcon-H1's mamba_rms_norm false): y * silu(z) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float sz[64], *y = out + t * ldo;
            for (int64_t j0 = 0; j0 < ssm_inner(m); j0 += 64) {
                const int64_t n = ssm_inner(m) - j0 < 64 ? ssm_inner(m) - j0 : 64;
                gdn_silu_n(g + t * ldg + j0, sz, n);
                for (int64_t i = 0; i < n; i++) y[j0 + i] *= sz[i];
            }
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < T * NG; it++) mamba_norm(m, L, it % NG, g + it / NG * ldg, out + it / NG * ldo);
}

/* Any recurrent mixer over T tokens (gdn.c or here), worksharing: the steps' one call */
static void mix_team(const sq_model *m, const sq_layer *L, float *qkv, int64_t ldq, const float *g, int64_t ldg,
                     int64_t T, float *out, int64_t ldo) {
    if (L->mixer == MIXER_GDN)
        gdn_mix_team(m, L, qkv, ldq, g, ldg, T, out, ldo);
    else
        ssm_mix_team(m, L, qkv, ldq, g, ldg, T, out, ldo);
}

/* The batched step's recurrent layer (batch.c): M rows in R runs (run r: rows run0[r].. runT[r] of one
 * slot at kvoff[run0[r]]), qkv / g / out rows at strides mix_widths; each run through mix_team on its
 * own slot's states. GDN layers take batch.c's own items (their runs' items in one loop). */
static void mix_runs(const sq_model *m, const sq_layer *L, int64_t R, const int64_t *run0, const int64_t *runT,
                     const int64_t *kvoff, float *qkv, const float *g, float *out) {
    int64_t nq, ng, no;
    mix_widths(m, L, &nq, &ng, &no);
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = run0[r];
        const sq_layer Ls = layer_slot(m, L, kvoff[t]);
        ssm_mix_team(m, &Ls, qkv + t * nq, nq, g + t * ng, ng, runT[r], out + t * no, no);
    }
}

/* A parallel layer's Mamba-2 branch in the decode step (step.c; every thread calls it): from the layer's
 * normed input xn through ssm_in / ssm_gate, the mixer and ssm_out, to w->h (the caller adds it to the
 * residual, as attention's output before it). w's qkv, g, att, h and a are free here. */
static void parallel_step(const sq_model *m, sq_work *w, const sq_layer *L, const float *xn) {
    int64_t nq, ng, no;
    mix_widths(m, L, &nq, &ng, &no);
#pragma omp single
    prep(&L->ssm_in, xn, &w->a);
    products(&L->ssm_in, &w->a, w->qkv);
#pragma omp single
    prep(&L->ssm_gate, xn, &w->a);
    products(&L->ssm_gate, &w->a, w->g);
    mix_team(m, L, w->qkv, nq, w->g, ng, 1, w->att, no);
#pragma omp single
    prep(&L->ssm_out, w->att, &w->a);
    products(&L->ssm_out, &w->a, w->h);
}

/* The same branch for M rows of the batched step (batch.c): xn rows at stride ldx, a the rows'
 * activations; qkv, g, att and h its buffers (row strides mix_widths; h: hidden, the output the caller
 * adds); keep_q / keep_g: where the rewind's copies of its inputs go, or NULL. */
static void parallel_rows(const sq_model *m, const sq_layer *L, int64_t M, int64_t R, const int64_t *run0,
                          const int64_t *runT, const int64_t *kvoff, const float *xn, int64_t ldx, sq_act *a, float *qkv,
                          float *g, float *att, float *h, float *keep_q, float *keep_g) {
    int64_t nq, ng, no;
    const int64_t E = m->hidden;
    mix_widths(m, L, &nq, &ng, &no);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++) prep(&L->ssm_in, xn + t * ldx, &a[t]);
    products_many(&L->ssm_in, a, M, qkv, nq);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++) prep(&L->ssm_gate, xn + t * ldx, &a[t]);
    products_many(&L->ssm_gate, a, M, g, ng);
    if (keep_q) {
#pragma omp single
        {
            memcpy(keep_q, qkv, sizeof(float) * (size_t)(M * nq));
            memcpy(keep_g, g, sizeof(float) * (size_t)(M * ng));
        }
    }
    mix_runs(m, L, R, run0, runT, kvoff, qkv, g, att);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++) prep(&L->ssm_out, att + t * no, &a[t]);
    products_many(&L->ssm_out, a, M, h, E);
}

/* T tokens of the sequence in the slot at kvoff through recurrent layer L's mixer, from their qkv
 * products [T, nq] and gate products [T, ng] (fp32; not written; mix_widths): out [T, no], the
 * un-projected mixer output, and the slot's states advanced: the arithmetic of sq_step / sq_prefill /
 * sq_step_many on their products (tests; a rewind replays kept rows: runtime/core/rewind.py). Returns 0,
 * -1 out of memory, -2 not a recurrent layer or shape. */
int sq_mix(const sq_model *m, const sq_layer *L, int64_t kvoff, const float *qkv, const float *g, int64_t T,
           float *out) {
    if (L->mixer == MIXER_ATTN || !mix_model_ok(m) || T < 0) return -2;
    if (L->mixer == MIXER_GDN && !gdn_shape_ok(m)) return -2;
    if (T == 0) return 0;
    int64_t nq, ng, no;
    mix_widths(m, L, &nq, &ng, &no);
    float *x = malloc(sizeof(float) * (size_t)(T * nq));
    if (!x) return -1;
    memcpy(x, qkv, sizeof(float) * (size_t)(T * nq));
    const sq_layer s = layer_slot(m, L, kvoff);
#pragma omp parallel
    mix_team(m, &s, x, nq, g, ng, T, out, no);
    free(x);
    return 0;
}
