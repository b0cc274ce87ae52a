/* The decode workspace (sq_work_new / sq_work_free): per-model buffers of sq_step and sq_head. */

typedef struct {
    float *xn, *qkv, *att, *h, *gu, *mid, *scores, *part; /* scores, part: attention's work items (attention.c) */
    float *g; /* the attention output gate's product [heads * gate_width] */
    sq_act a;
    int64_t maxk;
    int32_t *cand, *tie; /* refine_split: the candidate rows, and a bucket's members while selecting */
    float *gsum;         /* refine_split: per-group sums of the activations */
    int64_t ncand;
} sq_work;

void sq_work_free(void *p);

/* NULL when out of memory (nothing left allocated) */
void *sq_work_new(const sq_model *m) {
    sq_work *w = calloc(1, sizeof(sq_work));
    if (!w) return NULL;
    int64_t qd = m->heads * m->head_dim, kvd = m->kv_heads * m->head_dim;
    int64_t maxk = max3(m->hidden, m->inter, qd);
    w->maxk = maxk;
    w->xn = malloc(sizeof(float) * maxk);
    w->qkv = malloc(sizeof(float) * (qd + 2 * kvd));
    w->att = malloc(sizeof(float) * qd);
    w->h = malloc(sizeof(float) * m->hidden);
    w->gu = malloc(sizeof(float) * 2 * m->inter);
    w->mid = malloc(sizeof(float) * m->inter);
    w->g = malloc(sizeof(float) * m->heads * (m->gate_width > 0 ? m->gate_width : 1));
    const int64_t items = m->kv_heads * attn_blocks(0, m->cap); /* the most decode attention work items */
    w->scores = malloc(sizeof(float) * items * (m->heads / m->kv_heads) * KVB);
    w->part = malloc(sizeof(float) * items * part_floats(m));
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
    free(w->cand); free(w->tie); free(w->gsum);
    sq_act_free(&w->a);
    free(w);
}
