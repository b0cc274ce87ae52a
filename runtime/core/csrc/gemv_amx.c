/* The batched decode products on int8 tiles (gemv_tiles.c) twice: over the portable tile model
 * (every build) and, in the amx build, over the hardware tiles with AVX512 staging; the switch
 * (sq_batch_tiles) and a whole-linear entry for tests (sq_linear_a16). */
#ifdef SQ_AMX
static int sq_amx_on; /* the kernel granted this process the tile state (sq_amx_init, gemm_amx.c) */
/* the tile configuration this thread loaded for the batched products, NULL when none: loaded once
 * per thread and step rather than per claimed block of rows (a few dozen tile instructions each);
 * the batched step releases it at its end (a16_release), and the prompt GEMM's own release clears it */
static _Thread_local const sq_tilecfg *a16_cfg;

static inline void a16_config(const sq_tilecfg *cfg) {
    if (a16_cfg != cfg) _tile_loadconfig(cfg), a16_cfg = cfg;
}
#endif

#include "gemv_tiles.c" /* the common part (its body needs the T_* macros: below) */

/* (every thread of the batched step's region, at its end) give back the tile state and the
 * scales buffer */
static inline void a16_release(void) {
#ifdef SQ_AMX
    if (a16_cfg) _tile_release(), a16_cfg = NULL;
#endif
    free(a16_buf);
    a16_buf = NULL, a16_buf_bytes = 0;
}

#include "tiles_model.h"
#define T_STAGE a16_stage_c
#define T_EPI a16_epi_c
#define T_OUT a16_out_c
#include "gemv_tiles.c"
#include "tiles_undef.h"

#ifdef SQ_AMX
/* a16_stage_c: two masks per row step (and a vpshufb through the row's levels + 128 for lut4);
 * each row's codes A16_AHEAD bytes on prefetched into L2 and the next group's into L1 */
#ifndef A16_AHEAD
#define A16_AHEAD 1024
#endif
static void a16_stage_avx512(const sq_linear *L, int64_t n0, int64_t nv, int64_t gi, uint8_t *wa) {
    const int64_t K = L->k, G = L->g, W = G < 64 ? G : 64, rbytes = K / 2, at = gi * G / 2;
    const int lut = L->kind == KIND_LUT4, pf = at % 64 == 0; /* a new line of each row */
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t r = 0; r < (nv > 16 ? 32 : 16); r++) { /* rows 16-31 only where the block has them */
        const int64_t n = n0 + r;
        uint8_t *o = wa + (r / 16) * 16 * G + (r % 16) * W;
        if (r >= nv) {
            for (int64_t s = 0; s < G / W; s++) memset(o + s * 16 * W, 0, W);
            continue;
        }
        const uint8_t *w = L->q + n * rbytes + at;
        if (pf) {
            if (at + A16_AHEAD < rbytes) _mm_prefetch((const char *)(w + A16_AHEAD), _MM_HINT_T1);
            else _mm_prefetch((const char *)(w + A16_AHEAD + 32 * rbytes - rbytes), _MM_HINT_T1); /* the next block's row */
            _mm_prefetch((const char *)(w + 64), _MM_HINT_T0);
        }
        const __m512i tab = lut ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(L->lut + 16 * n))),
                                                   _mm512_set1_epi8((char)0x80))
                                : _mm512_setzero_si512();
        if (W == 64) {
            for (int64_t s = 0; s < G / 64; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * s));
                __m512i row = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
                row = _mm512_and_si512(row, m4);
                if (lut) row = _mm512_shuffle_epi8(tab, row);
                _mm512_store_si512((void *)(o + s * 1024), row);
            }
        } else {
            const __m128i v = _mm_loadu_si128((const __m128i *)w);
            __m256i row = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm512_castsi512_si256(m4));
            if (lut) row = _mm256_shuffle_epi8(_mm512_castsi512_si256(tab), row);
            _mm256_store_si256((__m256i *)o, row);
        }
    }
}

/* a16_pack_c, 16 columns per vector: the same codes, scales and sums */
static void a16_pack_avx512(const sq_linear *L, const float *x, sq_a16 *ti, int64_t t) {
    const int64_t K = L->k, G = L->g, W = G < 64 ? G : 64, tb = t / A16_TB, col = t % A16_TB;
    int8_t *bt = ti->b + tb * ti->maxk * 16;
    const int64_t gb = a16_goff(ti, tb);
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m512i qmax = _mm512_set1_epi32(A16_Q), qmin = _mm512_set1_epi32(-A16_Q), m7 = _mm512_set1_epi32(127);
    for (int64_t gi = 0; gi < K / G; gi++) {
        const float *xg = x + gi * G;
        __m512 mx = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
        for (int64_t k = 0; k < G; k += 16) {
            const __m512 v = _mm512_loadu_ps(xg + k);
            mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, v));
            sm = _mm512_add_ps(sm, v);
        }
        const float amax = _mm512_reduce_max_ps(mx), inv = amax > 0.f ? (float)A16_Q / amax : 0.f;
        const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(sm), _mm512_extractf32x8_ps(sm, 1));
        const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
        const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        __m512i qs = _mm512_setzero_si512();
        for (int64_t k = 0; k < G; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + k), _mm512_set1_ps(inv)));
            q = _mm512_max_epi32(_mm512_min_epi32(q, qmax), qmin);
            qs = _mm512_add_epi32(qs, q);
            const __m128i hb = _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 7)), lb = _mm512_cvtepi32_epi8(_mm512_and_si512(q, m7));
            const int64_t kk = gi * G + k, o = (kk / W) * 16 * W + (a16_pos(kk % W, W) / 4) * 64 + col * 4;
            uint32_t hv[4], lv[4];
            _mm_storeu_si128((__m128i *)hv, hb);
            _mm_storeu_si128((__m128i *)lv, lb);
            for (int d = 0; d < 4; d++) {
                memcpy(bt + o + 64 * d, &hv[d], 4);
                memcpy(bt + o + 64 * d + 32, &lv[d], 4);
            }
        }
        ti->c[gb + gi * 8 + col] = amax / (float)A16_Q;
        ti->gsum[gb + gi * 8 + col] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
        ti->qs[gb + gi * 8 + col] = _mm512_reduce_add_epi32(qs);
    }
}

/* a16_epi_c, two rows per vector: the same operations, lane by lane */
static void a16_epi_avx512(const sq_linear *L, int64_t nr, const int32_t *cb, const float *sc, const float *c,
                           const int32_t *qs, float *acc) {
    const __m512i q2 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
    const __m512i offq = _mm512_mullo_epi32(_mm512_set1_epi32(L->kind == KIND_LUT4 ? 128 : 8), q2);
    const __m512 cv = _mm512_broadcast_f32x8(_mm256_loadu_ps(c));
    for (int64_t r = 0; r < nr; r += 2) { /* rows r, r + 1 (a row past nr: computed, not used) */
        const __m512i x = _mm512_load_si512((const void *)(cb + 16 * r)), y = _mm512_load_si512((const void *)(cb + 16 * r + 16));
        const __m512i hi = _mm512_shuffle_i64x2(x, y, 0x44), lo = _mm512_shuffle_i64x2(x, y, 0xee);
        const __m512i S = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo), offq);
        const __m512 s = _mm512_mul_ps(_mm512_insertf32x8(_mm512_set1_ps(sc[r]), _mm256_set1_ps(sc[r + 1]), 1), cv);
        _mm512_store_ps(acc + 8 * r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), s, _mm512_load_ps(acc + 8 * r)));
    }
}

/* a16_out_c with the zero terms of 8 tokens in a register per row */
static void a16_out_avx512(const sq_linear *L, int64_t nr, int64_t nt, const float *zr, const float *gs, const float *acc,
                           float *y, int64_t ldy) {
    const int64_t ng = L->k / L->g;
    for (int64_t r = 0; r < nr; r++) {
        __m256 zt = _mm256_setzero_ps();
        for (int64_t gi = 0; gi < ng; gi++) zt = _mm256_fmadd_ps(_mm256_set1_ps(zr[gi * 32 + r]), _mm256_loadu_ps(gs + gi * 8), zt);
        float v[8] __attribute__((aligned(32)));
        _mm256_store_ps(v, _mm256_add_ps(_mm256_load_ps(acc + 8 * r), zt));
        for (int64_t t = 0; t < nt; t++) y[t * ldy + r] = v[t];
    }
}

#define T_FN(name) name##_amx
#define T_DECL
#define T_CONFIG(cfg) a16_config(cfg)
#define T_RELEASE() ((void)0)
#define T_ZERO(i) _tile_zero(i)
#define T_LOAD(i, p, s) _tile_loadd(i, p, s)
#define T_STORE(i, p, s) _tile_stored(i, p, s)
#define T_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define T_STAGE a16_stage_avx512
#define T_EPI a16_epi_avx512
#define T_OUT a16_out_avx512
#include "gemv_tiles.c"
#include "tiles_undef.h"
#endif /* SQ_AMX */

/* token t's activations for the tile products */
static void a16_pack(const sq_linear *L, const float *x, sq_a16 *ti, int64_t t) {
#ifdef SQ_AMX
    a16_pack_avx512(L, x, ti, t);
#else
    a16_pack_c(L, x, ti, t);
#endif
}

/* whether hw (1: the hardware tiles, 0: the model) can run here */
static int a16_hw_here(int64_t hw) {
#ifdef SQ_AMX
    return !hw || sq_amx_on;
#else
    return !hw;
#endif
}

/* rows [r0, r1) of L x_t for the M tokens packed in ti, on the tiles hw chose (no bias) */
static void a16_rows(const sq_linear *L, const sq_a16 *ti, int hw, int64_t M, float *Y, int64_t ldy, int64_t r0,
                     int64_t r1) {
#ifdef SQ_AMX
    if (hw) {
        many_q4_a16_amx(L, ti, M, Y, ldy, r0, r1);
        return;
    }
#else
    (void)hw; /* no hardware tiles in this build: sq_batch_tiles and sq_linear_a16 refuse hw */
#endif
    many_q4_a16_model(L, ti, M, Y, ldy, r0, r1);
}

/* rows_many's tile products: the step's activations a[0].ti, the switch's choice of tiles */
static void many_q4_a16(const sq_linear *L, const sq_act *a, int64_t M, float *Y, int64_t ldy, int64_t r0, int64_t r1) {
    a16_rows(L, a[0].ti, a16_hw, M, Y, ldy, r0, r1);
}

/* The batched decode step's int4 / lut4 products on int8 tiles from min_m sequences on (0: never,
 * the default W4A8 products), over the hardware tiles (hw 1: an amx build whose tile state was
 * granted) or the tile model (hw 0, any build: tests). Process-wide. Returns 0, -2 min_m < 0, -3
 * no hardware tiles here. */
int sq_batch_tiles(int64_t min_m, int64_t hw) {
    if (min_m < 0) return -2;
    if (min_m == 0) hw = 0; /* off: always possible */
    if (!a16_hw_here(hw)) return -3;
    a16_min_m = min_m, a16_hw = (int)hw;
    return 0;
}

/* Y [M, N] = X [M, K] W^T (the bias not added) through the tile path (hw as sq_batch_tiles), one
 * thread: tests and tools. Returns 0, -1 out of memory, -2 a linear the path does not take, -3 no
 * hardware tiles. */
int sq_linear_a16(const sq_linear *L, const float *X, int64_t M, float *Y, int64_t hw) {
    if (!a16_linear(L) || M <= 0) return -2;
    if (!a16_hw_here(hw)) return -3;
    sq_a16 *ti = a16_new(M, L->k);
    if (!ti) return -1;
    for (int64_t t = 0; t < M; t++) a16_pack(L, X + t * L->k, ti, t);
    a16_rows(L, ti, (int)hw, M, Y, L->n, 0, L->n);
    a16_release();
    a16_free(ti);
    return 0;
}
