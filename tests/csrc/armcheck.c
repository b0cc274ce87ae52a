/* The Arm builds' check driver (tests/test_arm.py compiles it for aarch64 scalar, neon and neon-i8mm,
 * and natively for x86 scalar, with builds.BUILDS' flags, and runs the Arm ones under qemu). It
 * includes the whole C core so it can call the static kernels.
 *   kernels: random rows32 int4 / lut4 / int8 linears (several K, K % 128 == 64 among them, g32 /
 *     g64 / g128, N not a multiple of 16) x activations from act.c's quantizer: the build's decode
 *     products (rows(), the dispatch table) against the portable references gemv_*_a8_c in this
 *     binary (fp32 within REL; with unit scales, where every partial sum is an integer below 2^24,
 *     exactly: the int32 dot products themselves); the batched products (rows_many) against the
 *     single ones, bit for bit; the prompt GEMM (linear_batch, fp32 and bf16 out) against per-token
 *     references, and on Arm builds its int32 sums exactly (unit scales).
 *   attention: the decode attention's block kernel against attend_block_ref, bf16 and int8 caches.
 *   model: a tiny random model (3 layers of attention + gated MLP, int4 / lut4 / int8 linears, tied
 *     int4 head; bf16 and int8 KV caches) through sq_prefill of 21 tokens and 4 sq_step decode
 *     steps; prints the logits.
 * Output: "simd <n>" (sq_simd()), "hwcap asimddp <0|1> i8mm <0|1>" (aarch64 Linux), "fail ..." lines,
 * "kernels <checks> <fails> worst <rel>", "logits <cache>-<name> v..." lines, "chunked <cache> <0|1>"
 * (1: the prompt in chunks of 8 gave other hidden states than whole). Argument "kernels" or "model":
 * that part only. Exit status: the number of failed kernel checks (capped). */
#include "../../runtime/core/csrc/sq.c"
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h> /* what the CPU (or qemu's -cpu) offers: HWCAP_ASIMDDP, HWCAP2_I8MM */
#endif

#define REL 1e-5 /* a product's fp32 result against the reference: summation order only */

static uint64_t rs = 0x243F6A8885A308D3ull;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rs += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float urand(void) { return (float)(rnd() >> 40) / 16777216.f; }
static float nrand(void) { return (urand() + urand() + urand() + urand() - 2.f) * 1.7320508f; }
static int cmp_i8(const void *a, const void *b) { return *(const int8_t *)a - *(const int8_t *)b; }

/* a random linear; unit: scales 1, zeros 0 (every product an exact integer sum) */
static sq_linear mk(int kind, int64_t N, int64_t K, int64_t g, int unit) {
    sq_linear L;
    memset(&L, 0, sizeof L);
    L.kind = kind, L.n = N, L.k = K, L.g = kind == KIND_INT8 ? 32 : g;
    const float s0 = (kind == KIND_INT4 ? 0.22f : 0.014f) / sqrtf((float)K); /* weights ~ N(0, 1/K) */
    if (kind == KIND_INT8) {
        int8_t *q = malloc(N * K);
        uint16_t *sz = malloc(2 * N);
        for (int64_t i = 0; i < N * K; i++) q[i] = (int8_t)((int)(rnd() % 255) - 127);
        for (int64_t n = 0; n < N; n++) sz[n] = to_bf(unit ? 1.f : s0 * (0.5f + urand()));
        L.q = (const uint8_t *)q, L.sz = sz;
        return L;
    }
    uint8_t *q = malloc(N * K / 2);
    uint16_t *sz = malloc(2 * 2 * (K / g) * N);
    for (int64_t i = 0; i < N * K / 2; i++) q[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < (K / g) * N; i++) {
        const float s = s0 * (0.5f + urand());
        sz[2 * i] = to_bf(unit ? 1.f : s), sz[2 * i + 1] = to_bf(unit ? 0.f : 2.f * s * (urand() - 0.5f));
    }
    L.q = q, L.sz = sz;
    if (kind == KIND_LUT4) { /* each row's 16 ascending levels, the extremes +-127 among them */
        int8_t *lut = malloc(16 * N);
        for (int64_t n = 0; n < N; n++) {
            int8_t *t = lut + 16 * n;
            for (int j = 0; j < 16; j++) t[j] = (int8_t)((int)(rnd() % 255) - 127);
            t[0] = -127, t[15] = 127;
            qsort(t, 16, 1, cmp_i8);
        }
        L.lut = lut;
    }
    return L;
}

static void unmk(sq_linear *L) { free((void *)L->q); free((void *)L->sz); free((void *)L->lut); }

static void rand_x(float *x, int64_t K) { /* N(0, 1) with an outlier channel */
    for (int64_t k = 0; k < K; k++) x[k] = nrand();
    x[K / 3] *= 25.f;
}

static void ref_rows(const sq_linear *L, const sq_act *a, float *y) {
    if (L->kind == KIND_INT4) gemv_q4_a8_c(L, a, y, 0, L->n);
    else if (L->kind == KIND_LUT4) gemv_l4_a8_c(L, a, y, 0, L->n);
    else gemv_q8_a8_c(L, a, y, 0, L->n);
}

static int checks, fails;
static double worst;

/* y against ref: within rel of max|ref| (rel 0: bit for bit); ctx names the case */
static void expect(const char *what, const char *ctx, const float *y, const float *ref, int64_t n, double rel) {
    double mx = 0.0, err = 0.0;
    for (int64_t i = 0; i < n; i++) mx = fabs(ref[i]) > mx ? fabs(ref[i]) : mx;
    for (int64_t i = 0; i < n; i++) err = fabs((double)y[i] - ref[i]) > err ? fabs((double)y[i] - ref[i]) : err;
    const int bad = rel == 0.0 ? memcmp(y, ref, sizeof(float) * n) != 0 : !(err <= rel * mx);
    if (rel > 0.0 && mx > 0.0 && err / mx > worst) worst = err / mx;
    checks++;
    if (bad) {
        fails++;
        printf("fail %s %s err=%.3g max=%.3g\n", what, ctx, err, mx);
    }
}

/* M tokens' activations for L (unit: scales 1 and no group sums, so a product is its integer sum) */
static sq_act *acts(const sq_linear *L, int64_t M, const float *X, int unit) {
    sq_act *a = calloc(M, sizeof(sq_act));
    for (int64_t t = 0; t < M; t++) {
        sq_act_alloc(&a[t], L->k);
        quantize_act(X + t * L->k, L, &a[t]);
        if (unit) {
            for (int64_t i = 0; i < L->k / 8; i++) a[t].s8[i] = 1.f;
            for (int64_t i = 0; i < L->k / L->g; i++) a[t].gsum[i] = a[t].gqsum[i] = 0.f;
        }
    }
    return a;
}

static void unacts(sq_act *a, int64_t M) {
    for (int64_t t = 0; t < M; t++) sq_act_free(&a[t]);
    free(a);
}

static void check_linear(int kind, int64_t N, int64_t K, int64_t g) {
    const int64_t M = 11; /* prompt tokens: odd, more than one 8-token tile */
    float *X = malloc(sizeof(float) * M * K), *Y = malloc(sizeof(float) * M * N), *R = malloc(sizeof(float) * M * N);
    float *S = malloc(sizeof(float) * M * N);
    uint16_t *yb = malloc(2 * M * N), *rb = malloc(2 * M * N);
    for (int64_t t = 0; t < M; t++) rand_x(X + t * K, K);
    for (int unit = 0; unit < 2; unit++) {
        sq_linear L = mk(kind, N, K, g, unit);
        sq_act *a = acts(&L, M, X, unit);
        char c[64];
        snprintf(c, sizeof c, "kind=%d K=%lld N=%lld g=%lld", kind, (long long)K, (long long)N, (long long)g);
        for (int64_t t = 0; t < M; t++) ref_rows(&L, &a[t], R + t * N);
        rows(&L, &a[0], Y, 0, N); /* the decode product */
        expect(unit ? "gemv-int" : "gemv", c, Y, R, N, unit ? 0.0 : REL);
        rows_many(&L, a, 5, Y, N, 0, N); /* the batched step's products: the single ones' bits */
        for (int64_t t = 0; t < 5; t++) {
            rows(&L, &a[t], S + t * N, 0, N);
            expect("batched", c, Y + t * N, S + t * N, N, 0.0);
        }
#ifdef SQ_NEON
        if (unit && is_q4(&L)) { /* the prompt GEMM's int32 sums (sdot or smmla tiles) */
            gemm_4bit_a8_neon(&L, a, M, Y, NULL);
            expect("gemm-int", c, Y, R, M * N, 0.0);
        }
#endif
        if (!unit) { /* the prompt GEMM as prefill calls it, fp32 and bf16 out */
            linear_batch(&L, X, 0, M, Y, NULL, NULL);
            for (int64_t t = 0; t < M; t++) expect("gemm", c, Y + t * N, R + t * N, N, REL);
#if defined(SQ_NEON) && !defined(SQ_I8MM) /* sdot tiles: each token's decode product, bit for bit */
            for (int64_t t = 0; t < M; t++) {
                rows(&L, &a[t], S + t * N, 0, N);
                expect("gemm=gemv", c, Y + t * N, S + t * N, N, 0.0);
            }
#endif
            linear_batch(&L, X, 0, M, NULL, yb, NULL);
            for (int64_t i = 0; i < M * N; i++) rb[i] = to_bf(Y[i]);
            checks++;
            if (memcmp(yb, rb, 2 * M * N)) fails++, printf("fail gemm-bf16 %s\n", c);
        }
        unacts(a, M);
        unmk(&L);
    }
    free(X); free(Y); free(R); free(S); free(yb); free(rb);
}

/* the decode attention's block kernel (attend_block: the build's) against attend_block_ref, bf16 and
 * int8 caches: outputs, maxima and sums within REL (the int8 cache's: bit for bit, integer sums) */
static void check_attention(void) {
    static const int64_t Ds[] = {32, 64, 128}, ns[] = {37, 256};
    static const int Gs[] = {1, 3, 8};
    for (int di = 0; di < 3; di++)
        for (int ni = 0; ni < 2; ni++)
            for (int gi = 0; gi < 3; gi++)
                for (int i8 = 0; i8 < 2; i8++) {
                    const int64_t D = Ds[di], n = ns[ni];
                    const int G = Gs[gi];
                    sq_model m;
                    memset(&m, 0, sizeof m);
                    m.head_dim = D, m.kv_int8 = i8, m.attn_scale = 1.0 / sqrt((double)D);
                    uint16_t *k = malloc(2 * n * D), *v = malloc(2 * n * D), *ks = malloc(2 * n), *vs = malloc(2 * n);
                    for (int64_t i = 0; i < n * D; i++) {
                        if (i8) ((int8_t *)k)[i] = (int8_t)((int)(rnd() % 255) - 127), ((int8_t *)v)[i] = (int8_t)((int)(rnd() % 255) - 127);
                        else k[i] = to_bf(nrand()), v[i] = to_bf(nrand());
                    }
                    for (int64_t i = 0; i < n; i++) ks[i] = to_bf(0.01f * (0.5f + urand())), vs[i] = to_bf(0.01f * (0.5f + urand()));
                    const kv_rows kv = {k, v, i8 ? ks : NULL, i8 ? vs : NULL};
                    float qs[8 * 128], sc[8 * KVB], o[2][8 * 128], mx[2][8], sm[2][8];
                    for (int64_t i = 0; i < G * D; i++) qs[i] = nrand();
                    attend_block(&m, kv, qs, G, 0, n, sc, o[0], mx[0], sm[0]);
                    attend_block_ref(kv, i8, D, qs, (float)m.attn_scale, G, 0, n, sc, o[1], mx[1], sm[1]);
                    char c[64];
                    snprintf(c, sizeof c, "D=%lld n=%lld G=%d i8=%d", (long long)D, (long long)n, G, i8);
                    expect("attn-o", c, o[0], o[1], G * D, i8 ? 0.0 : REL); /* int8: the same integers */
                    expect("attn-max", c, mx[0], mx[1], G, i8 ? 0.0 : REL);
                    expect("attn-sum", c, sm[0], sm[1], G, i8 ? 0.0 : REL);
                    free(k); free(v); free(ks); free(vs);
                }
}

static void check_kernels(void) {
    check_attention();
    static const int64_t Ks[] = {64, 192, 256, 576}, Ns[] = {13, 50};
    static const int64_t gs[] = {32, 64, 128};
    for (int ki = 0; ki < 4; ki++)
        for (int ni = 0; ni < 2; ni++) {
            const int64_t K = Ks[ki], N = Ns[ni];
            for (int gi = 0; gi < 3; gi++)
                if (K % gs[gi] == 0) {
                    check_linear(KIND_INT4, N, K, gs[gi]);
                    check_linear(KIND_LUT4, N, K, gs[gi]);
                }
            check_linear(KIND_INT8, N, K, 32);
        }
    printf("kernels %d %d worst %.3g\n", checks, fails, worst);
}

/* ------------------------------------------------------------------ the tiny model */
enum { E = 192, H = 4, KV = 2, D = 32, I = 256, V = 300, CAP = 32, NL = 3 };

static uint16_t *bf_vec(int64_t n, float base, float spread) {
    uint16_t *v = malloc(2 * n);
    for (int64_t i = 0; i < n; i++) v[i] = to_bf(base + spread * (urand() - 0.5f));
    return v;
}

static void print_logits(const char *cache, const char *name, const float *l) {
    printf("logits %s-%s", cache, name);
    for (int i = 0; i < V; i++) printf(" %.9g", l[i]);
    printf("\n");
}

/* kv_int8: the runtime's default cache (int8 codes, a bf16 scale per position and KV head), else bf16 */
static int run_model(int kv_int8) {
    /* per layer: qkv, o, gate_up, down as (kind, g) */
    static const int kinds[NL][4] = {{KIND_INT4, KIND_LUT4, KIND_INT8, KIND_INT4},
                                     {KIND_LUT4, KIND_INT4, KIND_INT4, KIND_LUT4},
                                     {KIND_INT8, KIND_INT8, KIND_LUT4, KIND_INT8}};
    static const int gsz[NL][4] = {{64, 128, 32, 128}, {32, 32, 64, 64}, {32, 32, 32, 32}};
    sq_model m;
    sq_layer ls[NL];
    rs = 0x13198A2E03707344ull; /* the same model whether or not the kernel checks ran first */
    memset(&m, 0, sizeof m);
    memset(ls, 0, sizeof ls);
    m.layers = NL, m.hidden = E, m.heads = H, m.kv_heads = KV, m.head_dim = D, m.inter = I, m.vocab = V, m.cap = CAP;
    m.eps = 1e-6, m.attn_scale = 1.0 / sqrt((double)D), m.layer = ls;
    m.kv_int8 = kv_int8;
    const char *cache = kv_int8 ? "int8" : "bf16";
    m.embed = mk(KIND_INT4, V, E, 32, 0);
    m.head = m.embed; /* tied */
    m.final_norm = bf_vec(E, 1.f, 0.2f);
    uint16_t *cs = malloc(2 * CAP * D), *sn = malloc(2 * CAP * D);
    for (int p = 0; p < CAP; p++)
        for (int i = 0; i < D; i++) {
            const double th = p * pow(10000.0, -(double)(i % (D / 2)) / (D / 2));
            cs[p * D + i] = to_bf((float)cos(th)), sn[p * D + i] = to_bf((float)sin(th));
        }
    for (int l = 0; l < NL; l++) {
        sq_layer *L = &ls[l];
        L->qkv = mk(kinds[l][0], (H + 2 * KV) * D, E, gsz[l][0], 0);
        L->o = mk(kinds[l][1], E, H * D, gsz[l][1], 0);
        L->gate_up = mk(kinds[l][2], 2 * I, E, gsz[l][2], 0);
        L->down = mk(kinds[l][3], E, I, gsz[l][3], 0);
        L->attn_norm = bf_vec(E, 1.f, 0.2f), L->mlp_norm = bf_vec(E, 1.f, 0.2f);
        L->cos = cs, L->sin = sn, L->rot = D;
        L->kcache = calloc(KV * CAP * D, 2), L->vcache = calloc(KV * CAP * D, 2);
        L->kscale = calloc(KV * CAP, 2), L->vscale = calloc(KV * CAP, 2);
    }
    void *w = sq_work_new(&m);
    float *out = malloc(sizeof(float) * 21 * E), *x = malloc(sizeof(float) * E), *lg = malloc(sizeof(float) * V);
    int64_t toks[21];
    for (int t = 0; t < 21; t++) toks[t] = (int64_t)(rnd() % V);
    int rc = sq_prefill(&m, toks, 21, 0, 0, out, 0);
    rc |= sq_head(&m, w, out, lg);
    print_logits(cache, "prefill", lg);
    for (int s = 0; s < 4; s++) {
        char name[16];
        snprintf(name, sizeof name, "step%d", s);
        rc |= sq_step(&m, w, (int64_t)(rnd() % V), 21 + s, x, lg);
        print_logits(cache, name, lg);
    }
    /* the same prompt in chunks of 8 (M = 8, 8, 5: other tiles): the whole prompt's hidden states */
    float *out2 = malloc(sizeof(float) * 21 * E);
    rc |= sq_prefill(&m, toks, 21, 0, 0, out, 1);
    rc |= sq_prefill(&m, toks, 21, 0, 8, out2, 1);
    printf("chunked %s %d\n", cache, memcmp(out, out2, sizeof(float) * 21 * E) != 0);
    sq_work_free(w);
    return rc;
}

int main(int argc, char **argv) {
    printf("simd %d\n", sq_simd());
#if defined(__aarch64__) && defined(__linux__)
    printf("hwcap asimddp %d i8mm %d\n", !!(getauxval(AT_HWCAP) & (1ul << 20)), !!(getauxval(AT_HWCAP2) & (1ul << 13)));
#endif
    if (argc < 2 || strcmp(argv[1], "model")) check_kernels();
    if (argc < 2 || strcmp(argv[1], "kernels"))
        for (int i8 = 0; i8 < 2; i8++) printf("model rc %d\n", run_model(i8));
    return fails > 100 ? 100 : fails;
}
