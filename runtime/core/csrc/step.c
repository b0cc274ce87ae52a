/* The decode step (sq_step: one token through every layer and the head) and the head alone
 * (sq_head: the logits of a final-normed hidden state, the tail of sq_step). */
/* One decode step: token at position pos -> logits fp32 [vocab]. x is fp32 [hidden] scratch.
 * Returns 0, or -1 if pos is outside the cache. */
int sq_step(const sq_model *m, void *work, int64_t token, int64_t pos, float *x, float *logits) {
    sq_work *w = work;
    if (pos < 0 || pos >= m->cap) return -1;
    const int64_t E = m->hidden, P = m->ple_dim;
    const int off = (int)m->norm_offset;
    if (pos == 0) mix_reset_slot(m, 0); /* a new sequence: empty recurrent states */
    /* one parallel region per token: `single` blocks for the serial parts, worksharing loops
     * for the products and attention (each ends in a barrier), no fork/join per product */
#pragma omp parallel
    {
#pragma omp single
        {
            embed_row(&m->embed, token, x);
            if (m->embed_mult != 0.0)
                for (int64_t i = 0; i < E; i++) x[i] = bf(to_bf(x[i] * (float)m->embed_mult));
            if (P) prep(&m->ple_model, x, &w->a);
        }
        if (P) { /* the per-layer inputs (Gemma 4) */
            products(&m->ple_model, &w->a, w->ple_ctx);
#pragma omp single
            ple_combine(m, token, w->ple_ctx, w->ple);
        }
        for (int64_t li = 0; li < m->layers; li++) {
            const sq_layer *L = &m->layer[li];
            sq_model lm_;
            const sq_model *ml = layer_model(m, L, &lm_); /* its head dim (Gemma 4) */
            const int64_t I = mlp_width(m, L);
#pragma omp single
            {
                rms_norm(x, L->attn_norm, E, m->eps, off, w->xn);
                prep(&L->qkv, w->xn, &w->a);
            }
            products(&L->qkv, &w->a, w->qkv);
            if (L->gate.q) { /* the output gate's product, from the same normed input */
#pragma omp single
                prep(&L->gate, w->xn, &w->a);
                products(&L->gate, &w->a, w->g);
            }
            if (!has_attn(L)) { /* a recurrent mixer (gdn.c, ssm.c): its gate product, if any, is its own */
                int64_t nq, ng, no;
                mix_widths(m, L, &nq, &ng, &no);
                mix_team(m, L, w->qkv, nq, w->g, ng, 1, w->att, no);
            } else {
                if (m->qk_norm_full) {
#pragma omp single
                    qk_norm_wide(ml, L, w->qkv);
                }
#pragma omp for schedule(static)
                for (int64_t h = 0; h < rope_heads(ml, L); h++) qk_rope_head(ml, L, w->qkv, pos, h);
                attention(ml, L, w->qkv, pos, w->scores, w->part, w->att);
            }
#pragma omp single
            {
                if (L->gate.q && has_attn(L)) attn_gate(ml, w->g, w->att);
                prep(&L->o, w->att, &w->a);
            }
            products(&L->o, &w->a, w->h);
            if (L->mixer == MIXER_PARALLEL) { /* attention's output in, then the Mamba-2 branch's (ssm.c) */
#pragma omp single
                add_residual(m, L->post_attn_norm, w->h, x);
                parallel_step(m, w, L, w->xn);
            }
#pragma omp single
            {
                add_residual(m, L->post_attn_norm, w->h, x);
                rms_norm(x, L->mlp_norm, E, m->eps, off, w->xn);
                if (L->gate_up.q) prep(&L->gate_up, w->xn, &w->a);
            }
            if (L->gate_up.q) { /* (a layer without an MLP: gate_up.q NULL, Nemotron-H's mixer blocks) */
                products(&L->gate_up, &w->a, w->gu);
#pragma omp single
                {
                    silu_mul(w->gu, I, (int)m->act, w->mid);
                    prep(&L->down, w->mid, &w->a);
                }
                products(&L->down, &w->a, w->h);
#pragma omp single
                add_residual(m, L->post_mlp_norm, w->h, x);
            }
#pragma omp single
            if (L->ple_gate.q) prep(&L->ple_gate, x, &w->a);
            if (L->ple_gate.q) { /* the per-layer input branch (Gemma 4) */
                products(&L->ple_gate, &w->a, w->gu);
#pragma omp single
                {
                    memcpy(w->gu + P, w->ple + li * P, sizeof(float) * (size_t)P);
                    silu_mul(w->gu, P, (int)m->act, w->mid);
                    prep(&L->ple_proj, w->mid, &w->a);
                }
                products(&L->ple_proj, &w->a, w->h);
#pragma omp single
                add_residual(m, L->ple_norm, w->h, x);
            }
#pragma omp single
            layer_scale(m, L, x);
        }
#pragma omp single
        {
            rms_norm(x, m->final_norm, E, m->eps, off, w->xn);
            prep(&m->head, w->xn, &w->a);
        }
        products(&m->head, &w->a, logits); /* a final softcap, if any, is applied by the caller */
        if (m->head.res) {
#pragma omp single
            split_select(&m->head, w, w->xn, logits, m->refine_top);
            split_rows(&m->head, w, w->xn, logits);
        } else {
#pragma omp single
            refine_top(&m->head, w->xn, logits, m->refine_top);
        }
    }
    return 0;
}

/* Logits fp32 [vocab] from a final-normed hidden state xn [hidden] (what sq_prefill returns):
 * the tail of sq_step (head product, top logits recomputed exactly). */
int sq_head(const sq_model *m, void *work, const float *xn, float *logits) {
    sq_work *w = work;
    prep(&m->head, xn, &w->a);
#pragma omp parallel
    products(&m->head, &w->a, logits);
    if (m->head.res) {
        split_select(&m->head, w, xn, logits, m->refine_top);
#pragma omp parallel
        split_rows(&m->head, w, xn, logits);
    } else {
        refine_top(&m->head, xn, logits, m->refine_top);
    }
    return 0;
}
