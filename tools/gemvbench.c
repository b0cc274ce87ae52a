/* The decode products alone (csrc's products_many: what one linear costs inside sq_step /
 * sq_step_many) for M tokens, on random int4 codes: COPIES copies of one K x N linear with group
 * size G, so that with enough copies the weights come from memory as in a real step; prints the
 * best and mean of REPS passes and the weight bytes per second.
 *
 *   gcc -O3 -std=c11 -march=native -fopenmp -I runtime/core/csrc tools/gemvbench.c -o /tmp/gemvbench -lm
 *   OMP_NUM_THREADS=2 /tmp/gemvbench [K 2048] [N 12288] [G 128] [M 4] [copies 8] [reps 10] [lut4 0]
 *
 * Add -mno-avx512f for the avx2 build; compile against another checkout's csrc (-I) to compare. */
#define _POSIX_C_SOURCE 199309L
#include <time.h>

#include "sq.c"
#include "benchlinear.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int64_t d[7] = {2048, 12288, 128, 4, 8, 10, 0};
    int64_t v[7];
    for (int i = 0; i < 7; i++) v[i] = argc > i + 1 ? atoll(argv[i + 1]) : d[i];
    const int64_t K = v[0], N = v[1], G = v[2], M = v[3], copies = v[4], reps = v[5], lut = v[6];
    if (K % G || G % 32 || M < 1 || copies < 1) {
        fprintf(stderr, "need K a multiple of G, G a multiple of 32, M >= 1, copies >= 1\n");
        return 2;
    }
    sq_linear *L = bench_linears(copies, K, N, G, (int)lut);
    sq_act *a = acts_new(M, K);
    float *x = malloc(sizeof(float) * K * M), *Y = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * N);
    for (int64_t i = 0; i < K * M; i++) x[i] = (float)(rand() % 2001 - 1000) / 1000.f; /* each token its own */
    double best = 1e30, tot = 0;
    for (int64_t r = 0; r < reps; r++) {
        const double t0 = now();
#pragma omp parallel
        for (int64_t c = 0; c < copies; c++) {
#pragma omp single
            for (int64_t t = 0; t < M; t++) prep(&L[c], x + t * K, &a[t]);
            products_many(&L[c], a, M, Y, N);
        }
        const double t = now() - t0;
        best = t < best ? t : best, tot += t;
    }
    /* every token's batched row against its product alone (the last copy's, which Y holds) */
    int64_t differ = 0;
    for (int64_t t = 0; t < M; t++) {
        prep(&L[copies - 1], x + t * K, &a[t]); /* the same codes again, and a new schedule epoch */
#pragma omp parallel
        products_many(&L[copies - 1], a + t, 1, y1, N);
        differ += memcmp(y1, Y + t * N, sizeof(float) * N) != 0;
    }
    const double bytes = (double)copies * N * K / 2;
    printf("%sK=%lld N=%lld g=%lld M=%lld copies=%lld: best %.2f ms (%.1f GB/s), mean %.2f ms, check %.9g, "
           "tokens unlike alone %lld\n",
           lut ? "lut4 " : "", (long long)K, (long long)N, (long long)G, (long long)M, (long long)copies, best * 1e3, bytes / best / 1e9,
           tot / reps * 1e3, Y[0] + Y[N - 1], (long long)differ);
    return 0;
}
