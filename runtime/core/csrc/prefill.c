/* A prompt through every layer (sq_prefill): the arithmetic of sq_step for a chunk of tokens at a
 * time -- fp32 residual stream and pointwise parts, the prompt GEMMs (gemm.c), the KV cache (bf16 or int8), and
 * causal (optionally sliding-window) attention over the cache (attention.c); a GDN layer's chunk
 * through its conv and state (gdn.c: the decode step's arithmetic per token, so its states are
 * those a token-by-token decode leaves given the same products). */

/* Y [M, N] = X [M, K] L^T (+ bias), fp32 in and out */
static int linear_many(const sq_linear *L, const float *X, int64_t M, float *Y, void *xtbuf) {
    const int64_t K = L->k, N = L->n;
#ifdef SQ_EXACT
    const int exact = 1;
#else
    const int exact = 0;
#endif
    if (exact || L->kind == KIND_BF16) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < M; t++) {
#ifdef SQ_EXACT
            if (L->kind != KIND_BF16) { gemv_exact_f32(L, X + t * K, Y + t * N, 0, N); continue; }
#endif
            gemv_bf16_f32(L, X + t * K, Y + t * N, 0, N);
        }
    } else if (linear_batch(L, X, 0, M, Y, NULL, xtbuf)) {
        return -1;
    }
    if (L->bias)
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < M; t++)
            for (int64_t n = 0; n < N; n++) Y[t * N + n] += bf(L->bias[n]);
    return 0;
}

/* Tokens [pos0, pos0 + T) of a prompt through every layer, `chunk` tokens at a time (their
 * K/V go to the cache). out: the final-normed hidden state (fp32 [E]) of every token
 * (all != 0, out [T, E]) or of the last one. Returns 0, -1 out of memory, -2 beyond the cache (or GDN
 * layers of a shape they cannot run, gdn.c), -5 an MTP block without hidden states (prefill_rows: with
 * hin [T, E], sq_prefill_in_at). */
static int prefill_rows(const sq_model *m, const int64_t *tokens, const float *hin, int64_t T, int64_t pos0,
                        int64_t chunk, float *out, int64_t all) {
    if (!m->fc.q != !hin) return -5; /* an MTP block (fc) reads hidden states, a model none */
    if (T <= 0 || pos0 < 0 || pos0 + T > m->cap || !mix_model_ok(m)) return -2;
    if (chunk <= 0 || chunk > T) chunk = T;
    const int64_t E = m->hidden, H = m->heads, D = m->head_dim, I = m->inter, P = m->ple_dim, NLP = m->layers * P;
    const int64_t maxk = mix_maxk(m), wide = imax2(imax2(imax2(2 * I, mix_qkv(m)), 2 * E), NLP);
    const int off = (int)m->norm_offset;
    int nthr = 1;
#ifdef _OPENMP
    nthr = omp_get_max_threads();
#endif
    float *x = malloc(sizeof(float) * chunk * E), *xn = malloc(sizeof(float) * chunk * maxk);
    float *big = malloc(sizeof(float) * chunk * wide), *att = malloc(sizeof(float) * chunk * mix_att(m));
    const int64_t gw = H * (m->gate_width > 0 ? m->gate_width : 1); /* the output gate's values per token */
    float *gv = malloc(sizeof(float) * chunk * mix_gate(m)); /* or a GDN layer's z | b | a */
    float *scr = malloc(sizeof(float) * nthr * PQB * m->cap);
    float *kf = malloc(sizeof(float) * (pos0 + T) * D), *vf = malloc(sizeof(float) * (pos0 + T) * D); /* attention_many */
    float *ple = P ? malloc(sizeof(float) * chunk * NLP) : NULL; /* the chunk's per-layer inputs (Gemma 4) */
    void *xt = NULL; /* the bf16 GEMM's activation tiles, shared by every product */
#ifdef SQ_BF16
    xt = alloc64(sizeof(uint16_t) * ((chunk + 15) / 16 * 16) * maxk); /* BT (8) or the tile GEMM's 16 tokens */
    int rc = (x && xn && big && att && scr && kf && vf && gv && xt && (!P || ple)) ? 0 : -1;
#else
    int rc = (x && xn && big && att && scr && kf && vf && gv && (!P || ple)) ? 0 : -1;
#endif
    if (!rc && pos0 == 0) mix_reset_slot(m, 0); /* a new sequence: empty recurrent states (m: the slot's view) */
    for (int64_t c0 = 0; c0 < T && !rc; c0 += chunk) {
        const int64_t n = c0 + chunk < T ? chunk : T - c0, p0 = pos0 + c0;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            embed_row(&m->embed, tokens[c0 + t], x + t * E);
            if (m->embed_mult != 0.0)
                for (int64_t i = 0; i < E; i++) x[t * E + i] = bf(to_bf(x[t * E + i] * (float)m->embed_mult));
            if (hin) { /* an MTP block's input rows [normed embedding | normed hidden state], then fc */
                rms_norm(x + t * E, m->fc_enorm, E, m->eps, off, big + t * 2 * E);
                rms_norm(hin + (c0 + t) * E, m->fc_hnorm, E, m->eps, off, big + t * 2 * E + E);
            }
        }
        if (hin && (rc = linear_many(&m->fc, big, n, x, xt))) break;
        if (P) { /* the chunk's per-layer inputs (Gemma 4): the ple_model products into big, then each row's */
            if ((rc = linear_many(&m->ple_model, x, n, big, xt))) break;
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) ple_combine(m, tokens[c0 + t], big + t * NLP, ple + t * NLP);
        }
        for (int64_t li = 0; li < m->layers && !rc; li++) {
            const sq_layer *L = &m->layer[li];
            sq_model lm_;
            const sq_model *ml = layer_model(m, L, &lm_); /* its head dim (Gemma 4) */
            const int64_t nq = L->qkv.n, Il = mlp_width(m, L), qd = ml->heads * ml->head_dim; /* its row widths */
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) rms_norm(x + t * E, L->attn_norm, E, m->eps, off, xn + t * E);
            if ((rc = linear_many(&L->qkv, xn, n, big, xt))) break;
            if (L->gate.q && (rc = linear_many(&L->gate, xn, n, gv, xt))) break;
            if (!has_attn(L)) { /* the chunk through a recurrent mixer (gdn.c, ssm.c), o's input [n, no] */
                int64_t mq, ng, no;
                mix_widths(m, L, &mq, &ng, &no);
#pragma omp parallel
                mix_team(m, L, big, mq, gv, ng, n, att, no);
            } else {
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) qk_rope_cache(ml, L, big + t * nq, p0 + t);
                attention_many(ml, L, big, nq, p0, n, att, scr, kf, vf);
                if (L->gate.q)
#pragma omp parallel for schedule(static)
                    for (int64_t t = 0; t < n; t++) attn_gate(ml, gv + t * gw, att + t * qd);
            }
            int64_t pq = 0, pg = 0, po = 0; /* a parallel layer's Mamba-2 branch (Falcon-H1): its products from xn first */
            if (L->mixer == MIXER_PARALLEL) {
                mix_widths(m, L, &pq, &pg, &po);
                if ((rc = linear_many(&L->ssm_in, xn, n, big, xt)) || (rc = linear_many(&L->ssm_gate, xn, n, gv, xt))) break;
            }
            if ((rc = linear_many(&L->o, att, n, xn, xt))) break;
            if (L->mixer == MIXER_PARALLEL) { /* attention's output in, then the branch's (the decode step's order) */
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) add_residual(m, L->post_attn_norm, xn + t * E, x + t * E);
#pragma omp parallel
                mix_team(m, L, big, pq, gv, pg, n, att, po);
                if ((rc = linear_many(&L->ssm_out, att, n, xn, xt))) break;
            }
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) {
                add_residual(m, L->post_attn_norm, xn + t * E, x + t * E);
                rms_norm(x + t * E, L->mlp_norm, E, m->eps, off, xn + t * E);
            }
            if (L->gate_up.q) { /* (none: a layer without an MLP) */
                const int64_t gw_ = L->gate_up.n; /* a product row: [gate | up], or up alone (relu2) */
                if ((rc = linear_many(&L->gate_up, xn, n, big, xt))) break;
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) silu_mul(big + t * gw_, Il, (int)m->act, xn + t * Il);
                if ((rc = linear_many(&L->down, xn, n, big, xt))) break;
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) add_residual(m, L->post_mlp_norm, big + t * E, x + t * E);
            }
            if (L->ple_gate.q) { /* the per-layer input branch (Gemma 4): [g | ple_l] rows in att, act(g) * ple_l */
                if ((rc = linear_many(&L->ple_gate, x, n, big, xt))) break;
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) {
                    memcpy(att + t * 2 * P, big + t * P, sizeof(float) * (size_t)P);
                    memcpy(att + t * 2 * P + P, ple + t * NLP + li * P, sizeof(float) * (size_t)P);
                    silu_mul(att + t * 2 * P, P, (int)m->act, xn + t * P);
                }
                if ((rc = linear_many(&L->ple_proj, xn, n, big, xt))) break;
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) add_residual(m, L->ple_norm, big + t * E, x + t * E);
            }
            if (L->scalar != 0.0)
#pragma omp parallel for schedule(static)
                for (int64_t t = 0; t < n; t++) layer_scale(m, L, x + t * E);
        }
        if (rc) break;
        if (all) {
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < n; t++) rms_norm(x + t * E, m->final_norm, E, m->eps, off, out + (c0 + t) * E);
        } else if (c0 + n == T) {
            rms_norm(x + (n - 1) * E, m->final_norm, E, m->eps, off, out);
        }
    }
    free(x); free(xn); free(big); free(att); free(gv); free(scr); free(kf); free(vf); free(xt); free(ple);
    return rc;
}

int sq_prefill(const sq_model *m, const int64_t *tokens, int64_t T, int64_t pos0, int64_t chunk, float *out,
               int64_t all) {
    return prefill_rows(m, tokens, NULL, T, pos0, chunk, out, all);
}

int sq_prefill_in_at(const sq_model *m, int64_t kvoff, const int64_t *tokens, const float *hin, int64_t T, int64_t pos0,
                     int64_t chunk, float *out, int64_t all);

/* sq_prefill into the KV slot at element offset kvoff of every layer's cache */
int sq_prefill_at(const sq_model *m, int64_t kvoff, const int64_t *tokens, int64_t T, int64_t pos0, int64_t chunk,
                  float *out, int64_t all) {
    return sq_prefill_in_at(m, kvoff, tokens, NULL, T, pos0, chunk, out, all);
}

/* sq_prefill_at of a multi-token-prediction block (m->fc set; hin [T, hidden]: sq_step_many_in's) */
int sq_prefill_in_at(const sq_model *m, int64_t kvoff, const int64_t *tokens, const float *hin, int64_t T, int64_t pos0,
                     int64_t chunk, float *out, int64_t all) {
    sq_model at = *m;
    sq_layer *ls = malloc(sizeof(sq_layer) * (m->layers > 0 ? m->layers : 1));
    if (!ls) return -1;
    for (int64_t li = 0; li < m->layers; li++) { /* (a layer of its own head dim: its slot offset in its units) */
        sq_model lm_;
        const sq_layer *L = &m->layer[li];
        ls[li] = layer_slot(layer_model(m, L, &lm_), L, layer_kvoff(m, L, kvoff));
    }
    at.layer = ls;
    const int rc = prefill_rows(&at, tokens, hin, T, pos0, chunk, out, all);
    free(ls);
    return rc;
}
