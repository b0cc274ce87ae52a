/* The decode workspace (sq_work_new / sq_work_free): per-model buffers of sq_step and sq_head. */

typedef struct {
    float *xn, *qkv, *att, *h, *gu, *mid, *scores, *part; /* scores, part: attention's work items (attention.c) */
    float *g; /* the gate product: attention's output gate [heads * gate_width], a GDN layer's z | b | a */
    sq_act a;
    int64_t maxk;
    int32_t *cand, *tie; /* refine_split: the candidate rows, and a bucket's members while selecting */
    float *gsum;         /* refine_split: per-group sums of the activations */
    int64_t ncand;
    float *ple, *ple_ctx; /* per-layer inputs: the token's [layers * P], and the ple_model product */
} sq_work;

void sq_work_free(void *p);

/* A Gated DeltaNet layer's per-token widths (gdn.c; 0 in a model without such layers): the qkv
 * product C = 2 Kd + Vd (the conv's channels), the output Vd (o's input), the gate product
 * z | b | a = Vd + 2 Hv */
static inline int64_t gdn_vd(const sq_model *m) { return m->lin_v_heads * m->lin_v_dim; }
static inline int64_t gdn_c(const sq_model *m) { return 2 * m->lin_k_heads * m->lin_k_dim + gdn_vd(m); }
static inline int64_t gdn_nz(const sq_model *m) { return gdn_vd(m) + 2 * m->lin_v_heads; }
static inline int64_t imax2(int64_t a, int64_t b) { return a > b ? a : b; }
/* a Mamba-2 layer's (ssm.c; 0 without such layers): the inner width (o's input), the conv's channels
 * x | B | C (the qkv product), the gate product z | dt */
static inline int64_t ssm_inner(const sq_model *m) { return m->ssm_heads * m->ssm_head_dim; }
static inline int64_t ssm_c(const sq_model *m) { return ssm_inner(m) + 2 * m->ssm_groups * m->ssm_state; }
static inline int64_t ssm_nz(const sq_model *m) { return ssm_inner(m) + m->ssm_heads; }

/* a layer's MLP width: gate_up [gate | up] rows / 2, or its up rows alone (act 3, relu2: no gate) */
static inline int64_t mlp_width(const sq_model *m, const sq_layer *L) {
    return m->act == 3 ? L->gate_up.n : L->gate_up.n / 2;
}

/* whether layer L attends over its KV cache (attention, or a parallel layer's attention branch) */
static inline int has_attn(const sq_layer *L) { return L->mixer == MIXER_ATTN || L->mixer == MIXER_PARALLEL; }

/* a recurrent layer's row widths per token: its qkv product, its gate product (0: none), its output (o's input) */
static inline void mix_widths(const sq_model *m, const sq_layer *L, int64_t *nq, int64_t *ng, int64_t *no) {
    *nq = *ng = *no = 0;
    if (L->mixer == MIXER_GDN) *nq = gdn_c(m), *ng = gdn_nz(m), *no = gdn_vd(m);
    if (L->mixer == MIXER_SCONV) *nq = 3 * m->sc_dim, *no = m->sc_dim;
    if (L->mixer == MIXER_MAMBA || L->mixer == MIXER_PARALLEL) *nq = ssm_c(m), *ng = ssm_nz(m), *no = ssm_inner(m);
}

/* a recurrent layer's per-slot state sizes in floats: its conv window, its recurrent state */
static inline void mix_state_floats(const sq_model *m, const sq_layer *L, int64_t *conv, int64_t *rec) {
    const int64_t km = m->conv_k - 1;
    *conv = *rec = 0;
    if (L->mixer == MIXER_GDN) *conv = gdn_c(m) * km, *rec = m->lin_v_heads * m->lin_k_dim * m->lin_v_dim;
    if (L->mixer == MIXER_SCONV) *conv = m->sc_dim * km;
    if (L->mixer == MIXER_MAMBA || L->mixer == MIXER_PARALLEL)
        *conv = ssm_c(m) * km, *rec = m->ssm_heads * m->ssm_head_dim * m->ssm_state;
}

/* The steps' buffer widths per token, the largest of attention's and the recurrent mixers': the qkv
 * product, the mixer output (o's input), the gate product, and the widest activation a product takes */
static inline int64_t mix_qkv(const sq_model *m) {
    return imax2(imax2((m->heads + 2 * m->kv_heads) * m->head_dim, gdn_c(m)), imax2(3 * m->sc_dim, ssm_c(m)));
}
static inline int64_t mix_att(const sq_model *m) {
    return imax2(imax2(imax2(m->heads * m->head_dim, gdn_vd(m)), 2 * m->ple_dim), imax2(m->sc_dim, ssm_inner(m)));
}
static inline int64_t mix_gate(const sq_model *m) {
    return imax2(imax2(m->heads * (m->gate_width > 0 ? m->gate_width : 1), gdn_nz(m)), ssm_nz(m));
}
static inline int64_t mix_maxk(const sq_model *m) {
    return imax2(imax2(imax2(max3(m->hidden, m->inter, m->heads * m->head_dim), gdn_vd(m)), m->fc.q ? m->fc.k : 0),
                 ssm_inner(m));
}

static int mix_model_ok(const sq_model *m); /* ssm.c */

/* NULL when out of memory (nothing left allocated), or recurrent layers of a shape they cannot run */
void *sq_work_new(const sq_model *m) {
    if (!mix_model_ok(m)) return NULL;
    sq_work *w = calloc(1, sizeof(sq_work));
    if (!w) return NULL;
    int64_t maxk = mix_maxk(m);
    w->maxk = maxk;
    w->xn = malloc(sizeof(float) * maxk);
    w->qkv = malloc(sizeof(float) * mix_qkv(m));
    w->att = malloc(sizeof(float) * mix_att(m));
    w->h = malloc(sizeof(float) * m->hidden);
    w->gu = malloc(sizeof(float) * 2 * imax2(m->inter, m->ple_dim)); /* (the per-layer input branch's [g | ple_l] too) */
    w->mid = malloc(sizeof(float) * imax2(m->inter, m->ple_dim));
    w->g = malloc(sizeof(float) * mix_gate(m));
    const int64_t items = m->kv_heads * attn_blocks(0, m->cap); /* the most decode attention work items */
    w->scores = malloc(sizeof(float) * items * (m->heads / m->kv_heads) * KVB);
    w->part = malloc(sizeof(float) * items * part_floats(m));
    if (m->ple_dim) {
        w->ple = malloc(sizeof(float) * m->layers * m->ple_dim);
        w->ple_ctx = malloc(sizeof(float) * m->layers * m->ple_dim);
        if (!w->ple || !w->ple_ctx) {
            sq_work_free(w);
            return NULL;
        }
    }
    if (!sq_act_alloc(&w->a, maxk) || !w->xn || !w->qkv || !w->att || !w->h || !w->gu || !w->mid || !w->g || !w->scores || !w->part) {
        sq_work_free(w);
        return NULL;
    }
    if (m->head.res) {
        w->cand = malloc(sizeof(int32_t) * (m->refine_top > 0 ? m->refine_top : 1));
        w->tie = malloc(sizeof(int32_t) * 2 * m->head.n); /* candidates, then a bucket of them */
        w->gsum = malloc(sizeof(float) * (m->head.k / m->head.g));
        if (!w->cand || !w->tie || !w->gsum) {
            sq_work_free(w);
            return NULL;
        }
    }
    return w;
}

void sq_work_free(void *p) {
    sq_work *w = p;
    if (!w) return;
    free(w->xn); free(w->qkv); free(w->att); free(w->h); free(w->gu); free(w->mid); free(w->g); free(w->scores); free(w->part);
    free(w->cand); free(w->tie); free(w->gsum); free(w->ple); free(w->ple_ctx);
    sq_act_free(&w->a);
    free(w);
}
