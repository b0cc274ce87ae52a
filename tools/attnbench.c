/* Decode attention alone (csrc/attention.c's attention(), int8 or bf16 cache): one query token
 * through LAYERS layers' caches of DEPTH positions, the median time of REPS steps. With --cold a
 * 256 MiB buffer is read between steps, so the caches come from memory as in a real decode step
 * (the weights stream through the caches between two layers' attention).
 *
 *   gcc -O3 -std=c11 -march=native -mno-avx512f -fopenmp -I runtime/core/csrc tools/attnbench.c -o /tmp/attnbench -lm
 *   OMP_NUM_THREADS=2 /tmp/attnbench [layers 30] [depth 2000] [heads 9] [kv_heads 3] [head_dim 64] [int8 1] [cold 0] [reps 200]
 *
 * Compile it against another checkout's csrc (-I) to compare two kernels on the same box. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <time.h>

#include "sq_simd.h"
#include "attention.c"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int64_t a[8] = {30, 2000, 9, 3, 64, 1, 0, 200};
    int64_t v[8];
    for (int i = 0; i < 8; i++) v[i] = argc > i + 1 ? atoll(argv[i + 1]) : a[i];
    const int64_t NL = v[0], depth = v[1], reps = v[7];
    sq_model m;
    memset(&m, 0, sizeof m);
    m.layers = NL, m.heads = v[2], m.kv_heads = v[3], m.head_dim = v[4], m.cap = depth + 8, m.kv_int8 = v[5];
    m.attn_scale = 1.0 / sqrt((double)m.head_dim);
    const int64_t D = m.head_dim, KV = m.kv_heads, n = KV * m.cap * D, esz = m.kv_int8 ? 1 : 2;
    sq_layer *Ls = calloc(NL, sizeof(sq_layer));
    srand(1);
    for (int64_t l = 0; l < NL; l++) { /* codes uniform in +-127 (or bf16 values in +-1), scales near 1/127 */
        uint8_t *k = aligned_alloc(64, (n * esz + 63) / 64 * 64), *vv = aligned_alloc(64, (n * esz + 63) / 64 * 64); /* as the runtimes' caches */
        uint16_t *ks = malloc(KV * m.cap * 2), *vs = malloc(KV * m.cap * 2);
        for (int64_t i = 0; i < n; i++) {
            if (m.kv_int8) k[i] = (uint8_t)(rand() % 255 - 127), vv[i] = (uint8_t)(rand() % 255 - 127);
            else ((uint16_t *)k)[i] = to_bf((rand() % 2001 - 1000) / 1000.f), ((uint16_t *)vv)[i] = to_bf((rand() % 2001 - 1000) / 1000.f);
        }
        for (int64_t i = 0; i < KV * m.cap; i++) ks[i] = to_bf((1 + rand() % 64 / 64.f) / 127.f), vs[i] = to_bf(1.f / 127.f);
        Ls[l].kcache = k, Ls[l].vcache = vv, Ls[l].kscale = m.kv_int8 ? ks : NULL, Ls[l].vscale = m.kv_int8 ? vs : NULL;
    }
    float *q = malloc(m.heads * D * sizeof(float)), *att = malloc(m.heads * D * sizeof(float));
    for (int64_t i = 0; i < m.heads * D; i++) q[i] = (rand() % 2001 - 1000) / 500.f;
    const int64_t nb = attn_blocks(0, depth);
    float *scores = malloc(KV * nb * (m.heads / KV) * KVB * sizeof(float)), *part = malloc(KV * nb * part_floats(&m) * sizeof(float));
    const size_t TB = (size_t)256 << 20;
    volatile uint8_t *tb = v[6] ? malloc(TB) : NULL;
    if (tb) memset((void *)tb, 1, TB);
    double *ts = malloc(reps * sizeof(double)), sum = 0.;
    for (int64_t r = 0; r < reps; r++) {
        if (tb) for (size_t i = 0; i < TB; i += 64) (void)tb[i];
        const double t = now();
#pragma omp parallel
        for (int64_t l = 0; l < NL; l++) attention(&m, &Ls[l], q, depth - 1, scores, part, att);
        ts[r] = now() - t;
    }
    for (int64_t i = 0; i < m.heads * D; i++) sum += fabs(att[i]) * (double)(1 + i % 13); /* weighted: a misplaced output counts */
    qsort(ts, reps, sizeof(double), cmp);
    printf("%s cache, %ld layers x %ld KV heads x %ld positions, head_dim %ld, G %ld, %s: median %.3f ms per step "
           "[q1 %.3f, q3 %.3f], %.2f ns per (key, KV head) (checksum %.9g)\n",
           m.kv_int8 ? "int8" : "bf16", (long)NL, (long)KV, (long)depth, (long)D, (long)(m.heads / KV),
           tb ? "cold" : "warm", ts[reps / 2] * 1e3, ts[reps / 4] * 1e3, ts[3 * reps / 4] * 1e3,
           ts[reps / 2] * 1e9 / (double)(NL * KV * depth), sum);
    return 0;
}
