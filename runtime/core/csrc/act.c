/* Activation quantization for the W4A8 products: one fp32 vector -> int8 codes with a scale
 * per 8 columns, in the column order the build's int4 products read (natural, AVX2 "paired",
 * AVX512 "quad"), plus the per-group sums the zero terms need. */

#define QUAD_MAX_GROUPS 256 /* more weight groups per row: the AVX2 (paired) products instead */

typedef struct {
    int8_t *q;    /* [K rounded up to 128] codes; natural column order, or "paired"/"quad" (see quantize_act) */
    float *s8;    /* [K/32 * 4] scale per 8 columns: s8[4b + i] for sub-block i of block b */
    float *gsum;  /* [K/g] exact fp32 sum of x per weight group */
    float *gqsum; /* [K/g] sum of the quantized x per weight group */
    const float *x;
    int paired;   /* 0 natural order, 1 paired (AVX2 int4), 2 quad (AVX512 int4) */
    uint64_t epoch;       /* product counter (32 bits), see products() */
    struct sq_slot *slot; /* [SQ_MAXT] work-stealing ranges, one cache line each */
    struct sq_a16 *ti;    /* the batched step's shared tile activations (gemv_tiles.c), or NULL */
    int64_t col;          /* this token's index in them */
} sq_act;

#define SQ_MAXT 64
typedef struct sq_slot { uint64_t v; char pad[56]; } sq_slot;

/* 64-byte aligned (a whole number of cache lines): the AVX512 products load the codes and the
 * scales 64 bytes at a time, and a load that straddles two lines costs more */
static void *alloc64(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

static int sq_act_alloc(sq_act *a, int64_t maxk) {
    a->q = alloc64((maxk + 127) / 128 * 128);
    a->s8 = alloc64(sizeof(float) * (maxk / 32 + 2) * 4);
    a->gsum = malloc(sizeof(float) * (maxk / 32 + 1));
    a->gqsum = malloc(sizeof(float) * (maxk / 32 + 1));
    a->slot = aligned_alloc(64, sizeof(sq_slot) * SQ_MAXT);
    if (a->slot) memset(a->slot, 0, sizeof(sq_slot) * SQ_MAXT);
    a->epoch = 0;
    a->ti = NULL, a->col = 0;
    return a->q && a->s8 && a->gsum && a->gqsum && a->slot;
}

static void sq_act_free(sq_act *a) {
    free(a->q); free(a->s8); free(a->gsum); free(a->gqsum); free(a->slot);
}

/* Quantize x [k] for a product with L, one int8 scale per 8 columns (a->s8[4b + i]):
 * sub-block i of 32-column block b holds columns 4i..4i+3 and 16+4i..16+4i+3. Those are the
 * eight activations that meet one 32-bit lane of the AVX2 products (int4: the four low and
 * four high nibbles of weight bytes 4i..4i+3; int8: lanes i and i + 4), so the scales cost
 * the products nothing; against one scale per 32 columns they cut the A8 error of a product
 * with an outlier channel from ~1% to ~0.6% and the example's W4A8 KL excess 3-fold
 * (docs/performance.md "Prompt processing").
 * For an int4 L on AVX2 with K % 64 == 0 (any g: g32 scales the two blocks' lanes apart) the codes go in "paired" order: for
 * block pair p, bytes 64p..64p+31 hold columns 0..15 of blocks 2p and 2p+1, bytes 64p+32..63
 * their columns 16..31 -- the order in which one 32-byte load of two weight blocks yields its
 * low and high nibbles. With AVX512-VNNI the same holds for 64-byte loads ("quad" order): for
 * block quad p, bytes 128p..128p+63 hold columns 0..15 of blocks 4p..4p+3, bytes 128p+64..127
 * their columns 16..31 (a last quad of two blocks when K % 128 == 64 keeps the same offsets, so
 * the buffer is K rounded up to 128). Lane l of a VNNI product of quad p then covers sub-block
 * l % 4 of block 4p + l / 4, whose scale is s8[16p + l]. */
static void quantize_act(const float *x, const sq_linear *L, sq_act *a) {
    const int64_t k = L->k, G = is_q4(L) ? L->g : 32;
    a->x = x;
#if defined(SQ_AVX512) /* quad where a 16-row chunk's scales fit gemv_q4_a8quad_avx512's buffer, else paired */
    a->paired = is_q4(L) && k % 64 == 0 && (G % 64 == 0 || G == 32) ? (k / G <= QUAD_MAX_GROUPS ? 2 : 1) : 0;
#elif defined(SQ_AVX2)
    a->paired = is_q4(L) && k % 64 == 0 && (G % 64 == 0 || G == 32);
#else
    a->paired = 0;
#endif
    for (int64_t gi = 0; gi < k / G; gi++) a->gsum[gi] = a->gqsum[gi] = 0.f;
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        const int64_t span = a->paired == 2 ? 128 : 64; /* bytes per pair / quad of blocks */
        int8_t *dst = a->q + (a->paired ? span * (b / (span / 32)) + 16 * (b % (span / 32)) : 32 * b);
        float d[4] = {0.f, 0.f, 0.f, 0.f}, sum = 0.f;
        int32_t qs[4] = {0, 0, 0, 0};
#ifdef SQ_AVX2
        /* the same arithmetic as the portable loop below (cvtps rounds half to even, as lrintf) */
        __m256 v[4], ab[4];
        const __m256 sign = _mm256_set1_ps(-0.f), c127 = _mm256_set1_ps(127.f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            ab[i] = _mm256_andnot_ps(sign, v[i]);
        }
        sum = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        /* m02: lanes 0-3 = columns 0-3 and 16-19 (sub-block 0), 4-7 = sub-block 1; m13: 2 and 3 */
        __m256 m02 = _mm256_max_ps(ab[0], ab[2]), m13 = _mm256_max_ps(ab[1], ab[3]);
        m02 = _mm256_max_ps(m02, _mm256_permute_ps(m02, 0x4e));
        m02 = _mm256_max_ps(m02, _mm256_permute_ps(m02, 0xb1));
        m13 = _mm256_max_ps(m13, _mm256_permute_ps(m13, 0x4e));
        m13 = _mm256_max_ps(m13, _mm256_permute_ps(m13, 0xb1));
        const __m256 id02 = _mm256_and_ps(_mm256_div_ps(c127, m02), _mm256_cmp_ps(m02, _mm256_setzero_ps(), _CMP_GT_OQ));
        const __m256 id13 = _mm256_and_ps(_mm256_div_ps(c127, m13), _mm256_cmp_ps(m13, _mm256_setzero_ps(), _CMP_GT_OQ));
        float dv[16];
        _mm256_storeu_ps(dv, _mm256_div_ps(m02, c127));
        _mm256_storeu_ps(dv + 8, _mm256_div_ps(m13, c127));
        d[0] = dv[0], d[1] = dv[4], d[2] = dv[8], d[3] = dv[12];
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id02)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id13));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id02)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id13));
        __m256i s02 = _mm256_add_epi32(i0, i2), s13 = _mm256_add_epi32(i1, i3);
        s02 = _mm256_add_epi32(s02, _mm256_shuffle_epi32(s02, 0x4e));
        s02 = _mm256_add_epi32(s02, _mm256_shuffle_epi32(s02, 0xb1));
        s13 = _mm256_add_epi32(s13, _mm256_shuffle_epi32(s13, 0x4e));
        s13 = _mm256_add_epi32(s13, _mm256_shuffle_epi32(s13, 0xb1));
        int32_t qv[16];
        _mm256_storeu_si256((__m256i *)qv, s02);
        _mm256_storeu_si256((__m256i *)(qv + 8), s13);
        qs[0] = qv[0], qs[1] = qv[4], qs[2] = qv[8], qs[3] = qv[12];
        __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (a->paired) {
            _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(q8));
            _mm_storeu_si128((__m128i *)(dst + span / 2), _mm256_extracti128_si256(q8, 1));
        } else {
            _mm256_storeu_si256((__m256i *)dst, q8);
        }
#else
        float amax[4] = {0.f, 0.f, 0.f, 0.f}, id[4];
        for (int j = 0; j < 32; j++) {
            const int i = (j % 16) / 4;
            float v = fabsf(xb[j]);
            amax[i] = v > amax[i] ? v : amax[i];
            sum += xb[j];
        }
        for (int i = 0; i < 4; i++) {
            d[i] = amax[i] / 127.f;
            id[i] = amax[i] > 0.f ? 127.f / amax[i] : 0.f;
        }
        for (int j = 0; j < 32; j++) {
            const int i = (j % 16) / 4;
            int8_t v = (int8_t)lrintf(xb[j] * id[i]);
            qs[i] += v;
            dst[j] = v;
        }
#endif
        for (int i = 0; i < 4; i++) a->s8[4 * b + i] = d[i];
        a->gsum[32 * b / G] += sum;
        a->gqsum[32 * b / G] += d[0] * (float)qs[0] + d[1] * (float)qs[1] + d[2] * (float)qs[2] + d[3] * (float)qs[3];
    }
}
