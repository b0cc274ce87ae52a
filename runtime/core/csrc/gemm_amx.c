/* The tile GEMM's two instantiations (gemm_tiles.c): over the portable tile model (every build)
 * and, in the amx build (SQ_AMX), over the hardware tiles with AVX512 staging. Tiles need the
 * kernel's permission once per process (arch_prctl ARCH_REQ_XCOMP_PERM, sq_amx_init); until it
 * is granted the amx build's prompts take the bf16 GEMM, and runtime/core/lib.py falls back to
 * the best AVX512 build in one line when it is refused. */
#include "tiles_model.h"
#define T_DEQUANT tiles_dequant_c
#define T_PACK tiles_pack_c
#define T_STORE_OUT tiles_store_c
#include "gemm_tiles.c"
#include "tiles_undef.h"

#ifdef SQ_AMX
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */
#define AMX_GEMM_MIN_M 16 /* fewer tokens: the W4A8 GEMM (docs/performance.md "AMX") */

/* tiles_dequant_c with a 16-lane table per (row, group) and vpermw: the same bits */
static void tiles_dequant_avx512(const sq_linear *L, int64_t n0, uint16_t *wa) {
    const int64_t K = L->k, G = L->g, N = L->n;
    const int lut = L->kind == KIND_LUT4;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i m4 = _mm512_set1_epi16(15);
    for (int64_t r = 0; r < TNB; r++) {
        const int64_t n = n0 + r;
        uint16_t *o = wa + (r / 16) * 512 + (r % 16) * 32;
        if (n >= N) {
            for (int64_t b = 0; b < K / 32; b++) _mm512_storeu_si512((void *)(o + b * 1024), _mm512_setzero_si512());
            continue;
        }
        const __m512 lv = lut ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(L->lut + 16 * n)))) : iota;
        const uint8_t *w = L->q + n * (K / 2);
        for (int64_t gi = 0; gi < K / G; gi++) {
            const uint16_t *p = L->sz + 2 * (gi * N + n);
            const __m512 s = _mm512_set1_ps(bf(p[0])), z = _mm512_set1_ps(bf(p[1]));
            const __m512 c = lut ? z : _mm512_sub_ps(z, _mm512_mul_ps(_mm512_set1_ps(8.f), s));
            const __m512i tab = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(lv, s, c)));
            for (int64_t b = gi * (G / 32); b < (gi + 1) * (G / 32); b++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(w + 16 * b));
                const __m512i idx = _mm512_and_si512(_mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw)), m4);
                _mm512_storeu_si512((void *)(o + b * 1024), _mm512_permutexvar_epi16(idx, tab));
            }
        }
    }
}

/* tiles_pack_c: each token's 32 columns to 16 bf16 pairs (vcvtne2ps2bf16, nearest even), then
 * 16 tokens x 16 pairs transposed into the B tile */
static void tiles_pack_avx512(const void *X, int64_t x_bf16, int64_t M, int64_t K, int64_t j, uint32_t *xb) {
    uint32_t *d = xb + j * (K / 32) * 256;
    for (int64_t cb = 0; cb < K / 32; cb++) {
        __m512i r[16];
        for (int t = 0; t < TTB; t++) {
            const int64_t row = TTB * j + t;
            if (row >= M) r[t] = _mm512_setzero_si512();
            else if (x_bf16) r[t] = _mm512_loadu_si512((const void *)((const uint16_t *)X + row * K + 32 * cb));
            else {
                const float *xf = (const float *)X + row * K + 32 * cb;
                r[t] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + 16), _mm512_loadu_ps(xf));
            }
        }
        tr16x16(r);
        for (int c = 0; c < 16; c++) _mm512_storeu_si512((void *)(d + cb * 256 + c * 16), r[c]);
    }
}

/* tiles_store_c: the C tile transposed in registers, a masked row store per token */
static void tiles_store_avx512(const float *c, float *Y, uint16_t *ybf, int64_t N, int64_t t0, int64_t nt, int64_t n0,
                               int64_t nr) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(c + 16 * i));
    tr16x16(r);
    const __mmask16 m = rows_mask(nr);
    for (int64_t t = 0; t < nt; t++) {
        if (ybf) {
            uint16_t tmp[16];
            to_bf_n((const float *)&r[t], tmp, 16);
            _mm256_mask_storeu_epi16((void *)(ybf + (t0 + t) * N + n0), m, _mm256_loadu_si256((const __m256i *)tmp));
        } else {
            _mm512_mask_storeu_ps(Y + (t0 + t) * N + n0, m, _mm512_castsi512_ps(r[t]));
        }
    }
}

#define T_FN(name) name##_amx
#define T_DECL
#define T_CONFIG(cfg) _tile_loadconfig(cfg)
#define T_RELEASE() (_tile_release(), a16_cfg = NULL)
#define T_ZERO(i) _tile_zero(i)
#define T_LOAD(i, p, s) _tile_loadd(i, p, s)
#define T_STORE(i, p, s) _tile_stored(i, p, s)
#define T_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define T_DEQUANT tiles_dequant_avx512
#define T_PACK tiles_pack_avx512
#define T_STORE_OUT tiles_store_avx512
#include "gemm_tiles.c"
#endif /* SQ_AMX */

/* Ask the kernel for the tile state (once per process). 0: granted; -1: refused; -2: this build
 * has no AMX kernels. */
int sq_amx_init(void) {
#ifdef SQ_AMX
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return -1;
    sq_amx_on = 1;
    return 0;
#else
    return -2;
#endif
}

/* Whether prompts take the AMX tile GEMM (an amx build whose tile state was granted) */
int sq_prefill_amx(void) {
#ifdef SQ_AMX
    return sq_amx_on;
#else
    return 0;
#endif
}

/* The fewest tokens whose products take a W4A16 GEMM in this build (int4 on avx512-bf16, int4 and
 * lut4 on amx), 0 where none does: a prompt chunk of fewer takes the W4A8 GEMM, so its tokens'
 * bits differ from the same tokens in a longer chunk (tests size their prompts by it) */
int sq_w4a16_min_m(void) {
#ifdef SQ_AMX
    if (sq_amx_on) return AMX_GEMM_MIN_M;
#endif
#ifdef SQ_BF16
    return BF16_GEMM_MIN_M;
#else
    return 0;
#endif
}

/* Y [M, N] = X [M, K] W^T (fp32) through the tile GEMM: hw = 0 over the tile model (every build),
 * 1 over the hardware tiles. Returns 0, -1 out of memory, -2 not an int4/lut4 linear, -3 no
 * hardware tiles here. (tests and tools) */
int sq_gemm_tiles(const sq_linear *L, const float *X, int64_t M, float *Y, int64_t hw) {
    if (!is_q4(L) || M <= 0) return -2;
    if (!hw) return gemm_q4_a16_tiles_model(L, X, 0, M, Y, NULL, NULL);
#ifdef SQ_AMX
    if (sq_amx_on) return gemm_q4_a16_tiles_amx(L, X, 0, M, Y, NULL, NULL);
#endif
    return -3;
}

/* One tile instruction on 16 x 64-byte tiles (a, b read; c read and written): op 0 TDPBUSD, 1
 * TDPBF16PS; hw as sq_gemm_tiles. (tests: the model against the hardware) */
int sq_tile_op(int64_t op, const void *a, const void *b, void *c, int64_t hw) {
    if (op != 0 && op != 1) return -2;
    if (!hw) {
        sq_tiles tm;
        tm_loadconfig(&tm, &TILES_CFG);
        tm_load(&tm, 0, c, 64);
        tm_load(&tm, 1, a, 64);
        tm_load(&tm, 2, b, 64);
        if (op == 0) tm_dpbusd(&tm, 0, 1, 2);
        else tm_dpbf16ps(&tm, 0, 1, 2);
        tm_store(&tm, 0, c, 64);
        return 0;
    }
#ifdef SQ_AMX
    if (!sq_amx_on) return -3;
    _tile_loadconfig(&TILES_CFG);
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    if (op == 0) _tile_dpbusd(0, 1, 2);
    else _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    a16_cfg = NULL;
    return 0;
#else
    return -3;
#endif
}
