/* Throughput of the zmm instructions the AVX512 products issue, alone and beside vpdpbusd: TSC
 * cycles per instruction over 8 independent chains of each (so latency does not bound them). Two
 * instructions that cost together what one costs alone run on different pipes; ones whose costs
 * add share one.
 *
 *   gcc -O2 -march=native tools/portbench.c -o /tmp/portbench && /tmp/portbench
 *
 * The first line converts TSC cycles to core cycles (a chain of dependent scalar adds, 1 a cycle). */
#include <immintrin.h>
#include <stdio.h>
#include <x86intrin.h>

#define N 40000000L
#define CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define KEEP(v) __asm__ volatile("" : "+v"(v##0), "+v"(v##1), "+v"(v##2), "+v"(v##3), "+v"(v##4), "+v"(v##5), "+v"(v##6), "+v"(v##7));
#define RUN(name, OPA, OPB, per)                                                                                   \
    {                                                                                                          \
        __m512i a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7;                                \
        __m512 f0, f1, f2, f3, f4, f5, f6, f7;                                                                 \
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = _mm512_set1_epi32(1);  \
        f0 = f1 = f2 = f3 = f4 = f5 = f6 = f7 = _mm512_set1_ps(1.f);                                           \
        __m512i x = _mm512_set1_epi32(0x01020304), y = _mm512_set1_epi32(0x05060708);                          \
        __m512 fx = _mm512_set1_ps(1.0000001f), fy = _mm512_set1_ps(0.f);                                     \
        __asm__ volatile("" : "+v"(x), "+v"(y), "+v"(fx), "+v"(fy));                                           \
        const unsigned long long t0 = __rdtsc();                                                               \
        for (long n = 0; n < N / 8; n++) {                                                                     \
            CHAINS(OPA) CHAINS(OPB) KEEP(a) KEEP(b) KEEP(f)                                                    \
        }                                                                                                      \
        printf("%-24s %.3f TSC cycles per %s\n", name, (double)(__rdtsc() - t0) / N, per);                    \
    }
#define NONE(i)
#define DP(i) a##i = _mm512_dpbusd_epi32(a##i, x, y);
#define DP2(i) b##i = _mm512_dpbusd_epi32(b##i, x, y);
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, fx, fy);
#define MUL(i) f##i = _mm512_mul_ps(f##i, fx);
#define FADD(i) f##i = _mm512_add_ps(f##i, fx);
#define CVT(i) f##i = _mm512_cvtepi32_ps(b##i), b##i = _mm512_castps_si512(f##i);
#define IADD(i) b##i = _mm512_add_epi32(b##i, x);
#define AND(i) b##i = _mm512_and_si512(b##i, x);
#define SRL(i) b##i = _mm512_srli_epi16(b##i, 4);
#define SLLV(i) b##i = _mm512_sllv_epi32(b##i, x);
#define GF(i) b##i = _mm512_gf2p8affine_epi64_epi8(b##i, x, 0);
#define PSHUFB(i) b##i = _mm512_shuffle_epi8(b##i, x);

int main(void) {
    long v = 1;
    const unsigned long long t0 = __rdtsc();
    for (long i = 0; i < N * 10; i++) __asm__ volatile("add $1, %0" : "+r"(v));
    const double tsc = (double)(__rdtsc() - t0) / (N * 10);
    printf("scalar add chain: %.3f TSC cycles per add (core clock %.2fx the TSC's)\n", tsc, 1 / tsc);
    RUN("vpdpbusd", DP, NONE, "instruction")
    RUN("vfmadd231ps", NONE, FMA, "instruction")
    RUN("vmulps", NONE, MUL, "instruction")
    RUN("vaddps", NONE, FADD, "instruction")
    RUN("vcvtdq2ps", NONE, CVT, "instruction")
    RUN("vpaddd", NONE, IADD, "instruction")
    RUN("vpandd", NONE, AND, "instruction")
    RUN("vpsrlw", NONE, SRL, "instruction")
    RUN("vpsllvd", NONE, SLLV, "instruction")
    RUN("vgf2p8affineqb", NONE, GF, "instruction")
    RUN("vpdpbusd + vpdpbusd", DP, DP2, "pair")
    RUN("vpdpbusd + vfmadd231ps", DP, FMA, "pair")
    RUN("vpdpbusd + vmulps", DP, MUL, "pair")
    RUN("vpdpbusd + vaddps", DP, FADD, "pair")
    RUN("vpdpbusd + vcvtdq2ps", DP, CVT, "pair")
    RUN("vpdpbusd + vpaddd", DP, IADD, "pair")
    RUN("vpdpbusd + vpandd", DP, AND, "pair")
    RUN("vpdpbusd + vpsrlw", DP, SRL, "pair")
    RUN("vpdpbusd + vpsllvd", DP, SLLV, "pair")
    RUN("vpdpbusd + vgf2p8affine", DP, GF, "pair")
    RUN("vpdpbusd + vpshufb", DP, PSHUFB, "pair")
    return 0;
}
