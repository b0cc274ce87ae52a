/* Continuous batching: the decode tokens of M sequences through every layer in one pass over
 * the weights (sq_step_many), the head of M hidden states (sq_head_many), and a prompt into one
 * sequence's KV slot (sq_prefill_at). A slot is an element offset (kvoff) into every layer's
 * cache: slot s of a cache laid out [slots, kv_heads, cap, head_dim] starts at
 * s * kv_heads * cap * head_dim (an int8 cache's scales [slots, kv_heads, cap] at kvoff / head_dim; a GDN
 * layer's states: slot s of its conv_state and rec_state, layer_slot). The products are the decode products for M tokens
 * (gemv_dispatch.c products_many), each token's result the single-token product's bit for bit, so
 * a sequence decodes to the same bits alone, beside others, or through sq_step (batch invariance).
 * A multi-token-prediction block (sq_model.fc) steps and prefills through the same code from hidden
 * states (sq_step_many_in, sq_prefill_in_at). */

/* M activation vectors for the products (sq_act_alloc each); NULL when out of memory */
static sq_act *acts_new(int64_t M, int64_t maxk) {
    sq_act *a = calloc(M, sizeof(sq_act));
    int ok = a != NULL;
    for (int64_t t = 0; ok && t < M; t++) ok = sq_act_alloc(&a[t], maxk);
    if (!ok && a) {
        for (int64_t t = 0; t < M; t++) sq_act_free(&a[t]);
        free(a);
        a = NULL;
    }
    return a;
}

static void acts_free(sq_act *a, int64_t M) {
    if (!a) return;
    for (int64_t t = 0; t < M; t++) sq_act_free(&a[t]);
    free(a);
}

/* (inside a parallel region, every thread) logits [M, V] of the final-normed rows xn + t * ldx:
 * the head products, then each row's top logits recomputed exactly, as sq_step's tail does */
static void head_rows(const sq_model *m, sq_work *w, sq_act *a, int64_t M, const float *xn, int64_t ldx,
                      float *logits) {
    const int64_t V = m->head.n;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++) prep(&m->head, xn + t * ldx, &a[t]);
    products_many(&m->head, a, M, logits, V);
    if (m->head.res) {
        for (int64_t t = 0; t < M; t++) { /* the selection uses the workspace: one row at a time */
#pragma omp single
            split_select(&m->head, w, xn + t * ldx, logits + t * V, m->refine_top);
            split_rows(&m->head, w, xn + t * ldx, logits + t * V);
        }
    } else {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M; t++) refine_top(&m->head, xn + t * ldx, logits + t * V, m->refine_top);
    }
}

/* The batched step's buffers for up to `rows` sequences, allocated once (sq_batch_new): fresh
 * buffers per step were trimmed back to the kernel on free and zero-filled again on the next
 * step's first touch (13% of the example's 4-sequence step under perf) */
typedef struct {
    int64_t rows;
    float *x, *xn, *qkv, *att, *h, *gu, *mid, *sc, *part; /* sc, part: attention's work items */
    float *g; /* the attention output gate's products [rows, heads * gate_width] */
    sq_act *a;
    sq_a16 *ti; /* the opt-in tile products' activations (gemv_tiles.c), NULL until a step takes them */
    int64_t *run0, *runT; /* this step's runs: rows of one slot at consecutive positions */
    float *ple, *ple_ctx; /* the rows' per-layer inputs [rows, layers * P] and ple_model products (Gemma 4) */
    float *keep_qkv, *keep_zba; /* where the next step copies its GDN layers' inputs (sq_batch_keep), or NULL */
} sq_batch;

void sq_batch_free(void *p) {
    sq_batch *b = p;
    if (!b) return;
    free(b->x); free(b->xn); free(b->g); free(b->qkv); free(b->att); free(b->h); free(b->gu); free(b->mid); free(b->sc); free(b->part);
    free(b->run0); free(b->runT); free(b->ple); free(b->ple_ctx);
    acts_free(b->a, b->rows);
    a16_free(b->ti);
    free(b);
}

/* NULL when out of memory */
void *sq_batch_new(const sq_model *m, int64_t rows) {
    if (rows < 1) return NULL;
    sq_batch *b = calloc(1, sizeof(sq_batch));
    if (!b) return NULL;
    const int64_t M = rows, E = m->hidden, H = m->heads, KV = m->kv_heads, I = imax2(m->inter, m->ple_dim);
    const int64_t maxk = mix_maxk(m);
    b->rows = M;
    b->x = malloc(sizeof(float) * M * E), b->xn = malloc(sizeof(float) * M * maxk);
    b->qkv = malloc(sizeof(float) * M * mix_qkv(m)), b->att = malloc(sizeof(float) * M * mix_att(m));
    b->h = malloc(sizeof(float) * M * E), b->gu = malloc(sizeof(float) * M * 2 * I);
    const int64_t items = M * KV * attn_blocks(0, m->cap);
    b->g = malloc(sizeof(float) * M * mix_gate(m));
    b->mid = malloc(sizeof(float) * M * I), b->sc = malloc(sizeof(float) * items * (H / KV) * KVB);
    b->part = malloc(sizeof(float) * items * part_floats(m));
    b->a = acts_new(M, maxk);
    b->run0 = malloc(sizeof(int64_t) * M), b->runT = malloc(sizeof(int64_t) * M);
    if (m->ple_dim) {
        b->ple = malloc(sizeof(float) * M * m->layers * m->ple_dim), b->ple_ctx = malloc(sizeof(float) * M * m->layers * m->ple_dim);
        if (!b->ple || !b->ple_ctx) {
            sq_batch_free(b);
            return NULL;
        }
    }
    for (int64_t t = 0; b->a && t < M; t++) b->a[t].col = t; /* b->ti: on the first step that takes the tiles */
    if (!(b->x && b->xn && b->g && b->qkv && b->att && b->h && b->gu && b->mid && b->sc && b->part && b->a && b->run0 && b->runT)) {
        sq_batch_free(b);
        return NULL;
    }
    return b;
}

/* Token tok[t] of sequence t at position pos[t] of the KV slot at kvoff[t], for t < M, through
 * every layer and the head: logits fp32 [M, vocab] (a final softcap, if any, is the caller's).
 * Rows of one slot form a run: adjacent rows at consecutive positions (a sequence's drafted tokens
 * checked in one pass: runtime/speculate.py); each row sees the K/V of the rows before it, and a GDN
 * layer advances the slot's states through the run's tokens in order (the prompt path's items over
 * T tokens: the bits of one token at a time). sq_step's arithmetic for every row: one parallel
 * region, the decode products for M tokens (products_many: each weight read once per step),
 * attention over each sequence's own slot; batch: an sq_batch_new workspace of >= M rows. Returns
 * 0, -1 out of memory (the tile products' activations), -2 a position beyond the cache, -3 no
 * workspace for M rows, -4 one slot's rows not one run. */
static int step_rows(const sq_model *m, void *work, void *batch, int64_t M, const int64_t *tok, const int64_t *pos,
                     const int64_t *kvoff, const float *hin, float *logits) {
    sq_work *w = work;
    if (!m->fc.q != !hin) return -5;
    sq_batch *b = batch;
    for (int64_t t = 0; t < M; t++)
        if (pos[t] < 0 || pos[t] >= m->cap) return -2;
    if (M <= 0) return 0;
    if (!b || M > b->rows) return -3;
    int64_t R = 0; /* the runs */
    for (int64_t t = 0; t < M; t++) {
        if (t > 0 && kvoff[t] == kvoff[t - 1] && pos[t] == pos[t - 1] + 1) {
            b->runT[R - 1]++;
            continue;
        }
        for (int64_t r = 0; r < R; r++)
            if (kvoff[b->run0[r]] == kvoff[t]) return -4;
        b->run0[R] = t, b->runT[R] = 1, R++;
    }
    float *keep_qkv = b->keep_qkv, *keep_zba = b->keep_zba;
    b->keep_qkv = b->keep_zba = NULL; /* one step's */
    const int64_t E = m->hidden, H = m->heads, KV = m->kv_heads, D = m->head_dim, P = m->ple_dim, I = imax2(m->inter, P);
    const int64_t qd = H * D, nqkv = qd + 2 * KV * D, maxk = mix_maxk(m), grp = H / KV, NLP = m->layers * P;
    const int64_t gc = gdn_c(m), gvd = gdn_vd(m), gnz = gdn_nz(m); /* a GDN layer's row widths */
    const int off = (int)m->norm_offset;
    float *x = b->x, *xn = b->xn, *qkv = b->qkv, *att = b->att, *h = b->h, *gu = b->gu, *mid = b->mid, *sc = b->sc;
    float *part = b->part;
    sq_act *a = b->a;
    if (a16_min_m > 0 && M >= a16_min_m && !b->ti) { /* the first step on the tiles: their activations */
        if (!(b->ti = a16_new(b->rows, maxk))) return -1;
        for (int64_t t = 0; t < b->rows; t++) a[t].ti = b->ti;
    }
    if (b->ti) b->ti->m = M; /* whether this step's products take the tiles (a16_on) */
    for (int64_t t = 0; t < M; t++)
        if (pos[t] == 0) mix_reset_slot(m, kvoff[t]); /* a new sequence: empty recurrent states */
    {
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M; t++) {
                embed_row(&m->embed, tok[t], x + t * E);
                if (m->embed_mult != 0.0)
                    for (int64_t i = 0; i < E; i++) x[t * E + i] = bf(to_bf(x[t * E + i] * (float)m->embed_mult));
                if (hin) { /* an MTP block's input: fc over [its normed embedding | its normed hidden state] */
                    rms_norm(x + t * E, m->fc_enorm, E, m->eps, off, xn + t * maxk);
                    rms_norm(hin + t * E, m->fc_hnorm, E, m->eps, off, xn + t * maxk + E);
                    prep(&m->fc, xn + t * maxk, &a[t]);
                }
            }
            if (hin) products_many(&m->fc, a, M, x, E);
            if (P) { /* the rows' per-layer inputs (Gemma 4) */
#pragma omp for schedule(static)
                for (int64_t t = 0; t < M; t++) prep(&m->ple_model, x + t * E, &a[t]);
                products_many(&m->ple_model, a, M, b->ple_ctx, NLP);
#pragma omp for schedule(static)
                for (int64_t t = 0; t < M; t++) ple_combine(m, tok[t], b->ple_ctx + t * NLP, b->ple + t * NLP);
            }
            int64_t gi = 0; /* GDN layers so far (each thread's own count) */
            for (int64_t li = 0; li < m->layers; li++) {
                const sq_layer *L = &m->layer[li];
                sq_model lm_;
                const sq_model *ml = layer_model(m, L, &lm_); /* its head dim (Gemma 4): D, the attention's */
                const int64_t Dl = layer_hd(m, L), pf = part_floats(ml), Il = mlp_width(m, L), nh = rope_heads(ml, L);
#pragma omp for schedule(static)
                for (int64_t t = 0; t < M; t++) {
                    rms_norm(x + t * E, L->attn_norm, E, m->eps, off, xn + t * maxk);
                    prep(&L->qkv, xn + t * maxk, &a[t]);
                }
                const int gdn = L->mixer == MIXER_GDN;
                int64_t lq = nqkv, ng, no; /* its rows' widths */
                if (!has_attn(L)) mix_widths(m, L, &lq, &ng, &no);
                products_many(&L->qkv, a, M, qkv, lq);
                if (L->gate.q) { /* the output gate's products (a GDN layer's z | b | a), from the same normed inputs */
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) prep(&L->gate, xn + t * maxk, &a[t]);
                    products_many(&L->gate, a, M, b->g, L->gate.n);
                }
                if (gdn) { /* each run's GDN items on its own slot's states: sq_step's, over the run's tokens */
                    const int64_t nc = gdn_conv_items(m), ns = gdn_state_items(m), Hv = m->lin_v_heads;
                    if (keep_qkv) { /* the inputs, for a caller that rewinds the states (sq_batch_keep) */
#pragma omp single
                        {
                            memcpy(keep_qkv + gi * M * gc, qkv, sizeof(float) * (size_t)(M * gc));
                            memcpy(keep_zba + gi * M * gnz, b->g, sizeof(float) * (size_t)(M * gnz));
                        }
                    }
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < R * nc; it++) {
                        const int64_t r = it / nc, t = b->run0[r];
                        const sq_layer Ls = layer_slot(m, L, kvoff[t]);
                        gdn_conv_item(m, &Ls, it % nc, qkv + t * gc, gc, b->runT[r]);
                    }
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < M * 2 * m->lin_k_heads; it++) gdn_l2_item(m, it, qkv, gc); /* row it / (2 Hk) */
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < R * ns; it++) {
                        const int64_t r = it / ns, t = b->run0[r];
                        const sq_layer Ls = layer_slot(m, L, kvoff[t]);
                        gdn_state_item(m, &Ls, it % ns, qkv + t * gc, gc, b->g + t * gnz, gnz, b->runT[r], att + t * gvd,
                                       gvd);
                    }
                    gi++;
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < M * Hv; it++) gdn_norm(m, L, it % Hv, b->g + it / Hv * gnz, att + it / Hv * gvd);
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) prep(&L->o, att + t * gvd, &a[t]);
                } else if (!has_attn(L)) { /* a short conv or Mamba-2 layer: each run on its slot (ssm.c) */
                    if (keep_qkv) {
#pragma omp single
                        {
                            memcpy(keep_qkv + gi * M * lq, qkv, sizeof(float) * (size_t)(M * lq));
                            if (ng) memcpy(keep_zba + gi * M * ng, b->g, sizeof(float) * (size_t)(M * ng));
                        }
                    }
                    mix_runs(m, L, R, b->run0, b->runT, kvoff, qkv, b->g, att);
                    gi++;
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) prep(&L->o, att + t * no, &a[t]);
                } else { /* attention */
                    if (m->qk_norm_full) {
#pragma omp for schedule(static)
                        for (int64_t t = 0; t < M; t++) qk_norm_wide(ml, L, qkv + t * nqkv);
                    }
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < M * nh; it++) {
                        const int64_t t = it / nh;
                        const sq_layer Ls = layer_slot(ml, L, layer_kvoff(m, L, kvoff[t])); /* this sequence's slot */
                        qk_rope_head(ml, &Ls, qkv + t * nqkv, pos[t], it % nh);
                    }
                    /* each sequence's attention work items (attention.c), nbm blocks apart: the items
                     * of sq_step's attention(), their partials laid out as there */
                    int64_t nbm = 1;
                    for (int64_t t = 0; t < M; t++) {
                        const int64_t nb = attn_blocks(window_start(L, pos[t]), pos[t] + 1);
                        nbm = nb > nbm ? nb : nbm;
                    }
#define SQ_BATCH_ITEM(it) do { \
                        const int64_t t = (it) / (KV * nbm), g = (it) / nbm % KV, bb = (it) % nbm, start = window_start(L, pos[t]); \
                        const int64_t nb = attn_blocks(start, pos[t] + 1); \
                        if (bb < nb) { \
                            const sq_layer Ls = layer_slot(ml, L, layer_kvoff(m, L, kvoff[t])); \
                            attend_item(ml, &Ls, qkv + t * nqkv, start, pos[t] + 1, g, bb, sc + (it) * grp * KVB, \
                                        part + (t * KV * nbm + g * nb + bb) * pf); \
                        } \
                    } while (0)
                    if (M == 1) { /* one sequence: sq_step's static runs of blocks (attention.c) */
#pragma omp for schedule(static)
                        for (int64_t it = 0; it < KV * nbm; it++) SQ_BATCH_ITEM(it);
                    } else { /* sequences of different lengths: their items balanced dynamically */
#pragma omp for schedule(dynamic, 1)
                        for (int64_t it = 0; it < M * KV * nbm; it++) SQ_BATCH_ITEM(it);
                    }
#undef SQ_BATCH_ITEM
#pragma omp for schedule(static)
                    for (int64_t it = 0; it < M * H; it++) {
                        const int64_t t = it / H, hh = it % H, nb = attn_blocks(window_start(L, pos[t]), pos[t] + 1);
                        attend_finish(ml, part + (t * KV * nbm + hh / grp * nb) * pf, nb, hh % grp, att + t * qd + hh * Dl);
                    }
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) {
                        if (L->gate.q) attn_gate(ml, b->g + t * L->gate.n, att + t * qd);
                        prep(&L->o, att + t * qd, &a[t]);
                    }
                }
                products_many(&L->o, a, M, h, E);
                if (L->mixer == MIXER_PARALLEL) { /* attention's output in, then the Mamba-2 branch's to h (ssm.c) */
                    int64_t pq, pg, po;
                    mix_widths(m, L, &pq, &pg, &po);
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) add_residual(m, L->post_attn_norm, h + t * E, x + t * E);
                    parallel_rows(m, L, M, R, b->run0, b->runT, kvoff, xn, maxk, a, qkv, b->g, att, h,
                                  keep_qkv ? keep_qkv + gi * M * pq : NULL, keep_qkv ? keep_zba + gi * M * pg : NULL);
                    gi++;
                }
#pragma omp for schedule(static)
                for (int64_t t = 0; t < M; t++) {
                    add_residual(m, L->post_attn_norm, h + t * E, x + t * E);
                    rms_norm(x + t * E, L->mlp_norm, E, m->eps, off, xn + t * maxk);
                    if (L->gate_up.q) prep(&L->gate_up, xn + t * maxk, &a[t]);
                }
                if (L->gate_up.q) { /* (none: a layer without an MLP) */
                    products_many(&L->gate_up, a, M, gu, 2 * I);
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) {
                        silu_mul(gu + t * 2 * I, Il, (int)m->act, mid + t * I);
                        prep(&L->down, mid + t * I, &a[t]);
                    }
                    products_many(&L->down, a, M, h, E);
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) add_residual(m, L->post_mlp_norm, h + t * E, x + t * E);
                }
#pragma omp for schedule(static)
                for (int64_t t = 0; t < M; t++)
                    if (L->ple_gate.q) prep(&L->ple_gate, x + t * E, &a[t]);
                if (L->ple_gate.q) { /* the per-layer input branch (Gemma 4), sq_step's per row */
                    products_many(&L->ple_gate, a, M, gu, 2 * I);
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) {
                        memcpy(gu + t * 2 * I + P, b->ple + t * NLP + li * P, sizeof(float) * (size_t)P);
                        silu_mul(gu + t * 2 * I, P, (int)m->act, mid + t * I);
                        prep(&L->ple_proj, mid + t * I, &a[t]);
                    }
                    products_many(&L->ple_proj, a, M, h, E);
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) add_residual(m, L->ple_norm, h + t * E, x + t * E);
                }
                if (L->scalar != 0.0) {
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < M; t++) layer_scale(m, L, x + t * E);
                }
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M; t++) rms_norm(x + t * E, m->final_norm, E, m->eps, off, xn + t * maxk);
            head_rows(m, w, a, M, xn, maxk, logits);
            a16_release();
        }
    }
    return 0;
}

int sq_step_many(const sq_model *m, void *work, void *batch, int64_t M, const int64_t *tok, const int64_t *pos,
                 const int64_t *kvoff, float *logits) {
    return step_rows(m, work, batch, M, tok, pos, kvoff, NULL, logits);
}

/* sq_step_many of a multi-token-prediction block (m->fc set): row t's input is fc over its token's
 * normed embedding and hin + t * hidden (the model's final-normed hidden state at the position before,
 * or the block's own for a chained draft), not the embedding alone. -5: fc and hin not both given. */
int sq_step_many_in(const sq_model *m, void *work, void *batch, int64_t M, const int64_t *tok, const int64_t *pos,
                    const int64_t *kvoff, const float *hin, float *logits) {
    return step_rows(m, work, batch, M, tok, pos, kvoff, hin, logits);
}

/* The next sq_step_many copies each GDN layer's inputs before its conv: the qkv products to
 * qkv + (g * M + t) * C and the gate's z | b | a to zba + (g * M + t) * (Vd + 2 Hv), for the g-th GDN
 * layer and row t < M, so a caller can rewind a slot's states to an earlier row of its run (restore
 * a copy, then sq_mix over the kept rows: runtime/core/session.py). NULL, NULL: no copies.
 * Returns 0, -1 no workspace. */
int sq_batch_keep(void *batch, float *qkv, float *zba) {
    sq_batch *b = batch;
    if (!b) return -1;
    b->keep_qkv = qkv, b->keep_zba = zba;
    return 0;
}

/* Logits fp32 [M, vocab] of M final-normed hidden states xn [M, hidden] (sq_head for each row,
 * the products shared). Returns 0, or -1 out of memory. */
int sq_head_many(const sq_model *m, void *work, int64_t M, const float *xn, float *logits) {
    if (M <= 0) return 0;
    sq_act *a = acts_new(M, m->head.k);
    if (!a) return -1;
#pragma omp parallel
    head_rows(m, work, a, M, xn, m->hidden, logits);
    acts_free(a, M);
    return 0;
}

/* The final-normed hidden state (fp32 [hidden]) of row t of the last sq_step_many: what a caller
 * needs for exact logits of head rows the step did not refine (sq_head_exact). Returns 0, -1 no
 * such row. */
int sq_batch_xn(const sq_model *m, void *batch, int64_t t, float *out) {
    const sq_batch *b = batch;
    if (!b || t < 0 || t >= b->rows) return -1;
    const int64_t maxk = mix_maxk(m);
    memcpy(out, b->xn + t * maxk, sizeof(float) * (size_t)m->hidden);
    return 0;
}
