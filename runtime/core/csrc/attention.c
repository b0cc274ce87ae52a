/* Attention in fp32 over the KV cache (bf16, or int8 codes with a bf16 scale per position and KV
 * head): one query token (decode: attention, attend_item / attend_finish) and a chunk of prompt
 * tokens (attention_many), causal and optionally sliding-window. This file: the decode path (its
 * shared pieces, the portable reference attend_block_ref, the dispatch and the schedule); it
 * includes the block kernels per ISA, attention_avx512.c, attention_avx2.c and attention_neon.c, so
 * that it alone gives attention() (tools/attnbench.c includes it). The prompt path is
 * attention_prompt.c. */

/* -- one query token (the decode step) --
 * Flash-decoding: the keys a token sees, [start, end), are cut into blocks of KVB positions from
 * start; a work item is (KV head, block): the grp query heads sharing that KV head read each K and
 * V row of the block once and leave a partial result (their max score, sum of exponentials and
 * unnormalized output); attend_finish combines a head's blocks in block order. Long contexts so
 * spread over every thread (split-K), short ones over the KV heads. The cut depends on (start, end)
 * only, so a token's bits depend neither on the thread count nor on the other sequences of a batch. */
#define KVB 256

typedef struct { const void *k, *v; const uint16_t *ks, *vs; } kv_rows; /* one KV head's rows [cap, D] (+ scales) */

static inline kv_rows kv_head(const sq_model *m, const sq_layer *L, int64_t g) {
    const int64_t o = g * m->cap * m->head_dim;
    kv_rows r;
    if (m->kv_int8) {
        r.k = (const int8_t *)L->kcache + o, r.v = (const int8_t *)L->vcache + o;
        r.ks = L->kscale + g * m->cap, r.vs = L->vscale + g * m->cap;
    } else {
        r.k = (const uint16_t *)L->kcache + o, r.v = (const uint16_t *)L->vcache + o;
        r.ks = r.vs = NULL;
    }
    return r;
}

static inline int64_t attn_blocks(int64_t start, int64_t end) { return (end - start + KVB - 1) / KVB; }

/* floats of one work item's partial result: grp x D outputs, then grp maxima, then grp sums */
static inline int64_t part_floats(const sq_model *m) { return (m->heads / m->kv_heads) * (m->head_dim + 2); }

static inline float kv_at(const void *p, int64_t i, int i8) {
    return i8 ? (float)((const int8_t *)p)[i] : bf(((const uint16_t *)p)[i]);
}

/* K and V rows ahead of the scores loop (the caches stream from memory at long contexts: without
 * the hint the step waited on each row's line; KV_AHEAD rows ahead covers the latency) */
#define KV_AHEAD 16
static inline __attribute__((always_inline)) void kv_prefetch(kv_rows kv, const int i8, int64_t D, int64_t t) {
    const int64_t bytes = D * (i8 ? 1 : 2), at = t * bytes;
    for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch((const char *)kv.k + at + o);
        __builtin_prefetch((const char *)kv.v + at + o);
    }
}

/* The int8 cache's K products are exact integers: each query head becomes int16 codes qi with one
 * scale (qsc: max|q| / 32767 times the attention scale; codes round half to even), so a score is
 * (float)sum(qi * k) * (kscale * qsc) on every build. qi [G, D], qsc [G]. */
static void quant_q16_ref(const float *qs, int64_t D, int G, float scale, int16_t *qi, float *qsc) {
    for (int i = 0; i < G; i++) {
        float amax = 0.f;
        for (int64_t d = 0; d < D; d++) amax = fabsf(qs[i * D + d]) > amax ? fabsf(qs[i * D + d]) : amax;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        qsc[i] = amax / 32767.f * scale;
        for (int64_t d = 0; d < D; d++) qi[i * D + d] = (int16_t)nearbyintf(qs[i * D + d] * inv);
    }
}

/* The reference: G query heads qs [G, D] over keys [t0, t1) of kv, score = scale * q.k; per head
 * i the max score mx[i], the sum of exponentials sm[i] and o[i*D..] = sum_t e^(score - mx) v_t.
 * sc: [G, KVB] scratch (the scores, then the weights of the V rows: e^(score - mx) times the V
 * scale). bf16 cache: the scores round as the prompt path's portable loop does (the dot, then the
 * scale); int8: quant_q16's integer dots, and V as v_i8_avx2 computes it (the weights as int16
 * codes against their max, integer sums with the V codes). */
static void attend_block_ref(kv_rows kv, int i8, int64_t D, const float *qs, float scale, int G, int64_t t0,
                             int64_t t1, float *sc, float *o, float *mx, float *sm) {
    const int64_t n = t1 - t0;
    int16_t qi[i8 ? G * D : 1];
    float qsc[8];
    if (i8) quant_q16_ref(qs, D, G, scale, qi, qsc);
    for (int64_t t = 0; t < n; t++) {
        for (int i = 0; i < G; i++) {
            if (i8) {
                int64_t acc = 0; /* an int32 for head_dim <= 512 (the SIMD kernels' bound) */
                for (int64_t d = 0; d < D; d++) acc += qi[i * D + d] * ((const int8_t *)kv.k)[(t0 + t) * D + d];
                sc[i * KVB + t] = (float)acc * (bf(kv.ks[t0 + t]) * qsc[i]);
            } else {
                float acc = 0.f;
                for (int64_t d = 0; d < D; d++) acc += qs[i * D + d] * kv_at(kv.k, (t0 + t) * D + d, 0);
                sc[i * KVB + t] = acc * scale;
            }
        }
    }
    for (int i = 0; i < G; i++) {
        float *p = sc + i * KVB, m_ = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) m_ = p[t] > m_ ? p[t] : m_;
        for (int64_t t = 0; t < n; t++) { p[t] = expf(p[t] - m_); sum += p[t]; }
        mx[i] = m_, sm[i] = sum;
        if (i8) { /* the weights as int16 codes against their max: exact integer sums with the V codes */
            float pm = 0.f;
            for (int64_t t = 0; t < n; t++) {
                p[t] *= bf(kv.vs[t0 + t]);
                pm = p[t] > pm ? p[t] : pm;
            }
            const float inv = pm > 0.f ? 32767.f / pm : 0.f, osc = pm / 32767.f;
            for (int64_t t = 0; t < n; t++) p[t] = nearbyintf(p[t] * inv);
            for (int64_t d = 0; d < D; d++) {
                int32_t acc = 0; /* n <= KVB keys of at most 32767 x 127 */
                for (int64_t t = 0; t < n; t++) acc += (int32_t)p[t] * ((const int8_t *)kv.v)[(t0 + t) * D + d];
                o[i * D + d] = (float)acc * osc;
            }
            continue;
        }
        for (int64_t d = 0; d < D; d++) {
            float acc = 0.f;
            for (int64_t t = 0; t < n; t++) acc += p[t] * kv_at(kv.v, (t0 + t) * D + d, 0);
            o[i * D + d] = acc;
        }
    }
}
_Static_assert(KVB * 32767LL * 127 < 2147483647LL, "the int8 cache's V sums of a block must fit int32");

/* the block kernels per ISA (they use the pieces above; the dispatch below calls them);
 * attention_avx512.c first: v_i8_avx2 calls v_i8_avx512 */
#include "attention_avx512.c"
#include "attention_avx2.c"
#include "attention_neon.c" /* Arm: both caches' blocks */

/* the dispatch: this build's widest block kernel for D, G (<= 8) and the cache type */
static void attend_block(const sq_model *m, kv_rows kv, const float *qs, int G, int64_t t0, int64_t t1, float *sc,
                         float *o, float *mx, float *sm) {
    const int64_t D = m->head_dim;
    const int i8 = (int)m->kv_int8;
    const float scale = (float)m->attn_scale;
#define SQ_BLOCK_CASE(isa, g) \
    case g: i8 ? attend_block_##isa(kv, 1, D, qs, scale, g, t0, t1, sc, o, mx, sm) \
               : attend_block_##isa(kv, 0, D, qs, scale, g, t0, t1, sc, o, mx, sm); return;
#define SQ_BLOCK_CASES(isa) SQ_BLOCK_CASE(isa, 1) SQ_BLOCK_CASE(isa, 2) SQ_BLOCK_CASE(isa, 3) SQ_BLOCK_CASE(isa, 4) \
    SQ_BLOCK_CASE(isa, 5) SQ_BLOCK_CASE(isa, 6) SQ_BLOCK_CASE(isa, 7) SQ_BLOCK_CASE(isa, 8)
#ifdef SQ_AVX512
#define SQ_BLOCK_CASE512(g) case g: attend_block_avx512(kv, D, qs, scale, g, t0, t1, sc, o, mx, sm); return;
    if (D % 16 == 0 && !i8) switch (G) {
        SQ_BLOCK_CASE512(1) SQ_BLOCK_CASE512(2) SQ_BLOCK_CASE512(3) SQ_BLOCK_CASE512(4)
        SQ_BLOCK_CASE512(5) SQ_BLOCK_CASE512(6) SQ_BLOCK_CASE512(7) SQ_BLOCK_CASE512(8)
    }
#undef SQ_BLOCK_CASE512
#endif
#ifdef SQ_AVX2
    if (D % 8 == 0 && (!i8 || D <= 512)) switch (G) { SQ_BLOCK_CASES(avx2) }
#endif
#ifdef SQ_NEON
    if (i8 ? D % 8 == 0 && D <= 512 : D % 4 == 0) switch (G) { SQ_BLOCK_CASES(neon) }
#endif
#undef SQ_BLOCK_CASES
#undef SQ_BLOCK_CASE
    attend_block_ref(kv, i8, D, qs, scale, G, t0, t1, sc, o, mx, sm);
}

/* Work item (g, b) of one token's decode attention: the query heads of KV head g (q: the token's
 * normed, rotated q heads [H, D]) over block b of keys [start, end) of L's cache. sc: grp * KVB
 * floats of scratch; part: the item's partial result (part_floats). */
static void attend_item(const sq_model *m, const sq_layer *L, const float *q, int64_t start, int64_t end, int64_t g,
                        int64_t b, float *sc, float *part) {
    const int64_t D = m->head_dim, grp = m->heads / m->kv_heads;
    const int64_t t0 = start + b * KVB, t1 = t0 + KVB < end ? t0 + KVB : end;
    const kv_rows kv = kv_head(m, L, g);
    for (int64_t s0 = 0; s0 < grp; s0 += 8) { /* query heads in passes of up to 8 (the kernels' registers) */
        const int G = (int)(grp - s0 < 8 ? grp - s0 : 8);
        attend_block(m, kv, q + (g * grp + s0) * D, G, t0, t1, sc, part + s0 * D, part + grp * D + s0,
                     part + grp * D + grp + s0);
    }
}

/* Head i (of the grp sharing a KV head) from the partials of its nb blocks (part: the first of
 * them, part_floats apart): out [D] = softmax(scale q.K) V */
static void attend_finish(const sq_model *m, const float *part, int64_t nb, int64_t i, float *out) {
    const int64_t D = m->head_dim, grp = m->heads / m->kv_heads, pf = part_floats(m);
    float mx = -INFINITY, tot = 0.f;
    for (int64_t b = 0; b < nb; b++) mx = part[b * pf + grp * D + i] > mx ? part[b * pf + grp * D + i] : mx;
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const float *pb = part + b * pf, w = expf(pb[grp * D + i] - mx);
        tot += w * pb[grp * D + grp + i];
        for (int64_t d = 0; d < D; d++) out[d] += w * pb[i * D + d];
    }
    const float inv = 1.f / tot;
    for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* keys [start, end) a query at pos sees in layer L: the sliding window's, else all of [0, pos] */
static inline int64_t window_start(const sq_layer *L, int64_t pos) {
    return L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
}

/* (inside sq_step's parallel region) the attention of the decode token at pos in layer L: q its
 * query heads, att [H, D] the result; scores, part: the workspace's (work.c) */
static void attention(const sq_model *m, const sq_layer *L, const float *q, int64_t pos, float *scores, float *part,
                      float *att) {
    const int64_t H = m->heads, KV = m->kv_heads, D = m->head_dim, grp = H / KV, pf = part_floats(m);
    const int64_t start = window_start(L, pos), end = pos + 1, nb = attn_blocks(start, end);
    /* static: each thread takes a run of consecutive blocks, so the rows the kernel prefetches
     * past a block's end are its own next item's (dynamic scheduling interleaved the threads'
     * blocks, and each item began on rows still in memory) */
#pragma omp for schedule(static)
    for (int64_t it = 0; it < KV * nb; it++)
        attend_item(m, L, q, start, end, it / nb, it % nb, scores + it * grp * KVB, part + it * pf);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < H; h++) attend_finish(m, part + (h / grp) * nb * pf, nb, h % grp, att + h * D);
}
