/* sparkq's C core: one whole decode step (embedding -> layers -> head, sq_step), a whole prompt
 * (sq_prefill, chunks of tokens through every layer), the head of a hidden state (sq_head) and
 * the products they share. One translation unit (a unity build: runtime/core/builds.py compiles
 * this file, which includes the others in dependency order); the public entry points are here.
 *
 * Weights are read in place from the artifact's mapping; nothing is repacked or copied. Int4
 * linears use the "rows32" layout (formats/layout.py is the contract): row-major, each row K/2
 * bytes, 32-column blocks of 16 bytes, byte j = q[32b+j] | q[32b+j+16] << 4, with bf16
 * scales_zeros [K/g, N, 2] and w = (q - 8) * scale + zero.
 *
 * Products are W4A8: the activation vector is quantized to int8 with one scale per 8 columns
 * (scale = max|x| / 127, round to nearest; act.c), the code x activation dot products are exact
 * integers (AVX2 maddubs / AVX-VNNI and AVX512-VNNI vpdpbusd: unsigned codes x signed activations), and
 *   y[n] = sum_g s[g,n] * (sum_{b in g} xs[b] * (dot(q_b, xq_b) - 8 sum(xq_b))) + z[g,n] * sum_{k in g} x[k]
 * (b: the 8-column sub-blocks). The -8 offset uses the quantized sums (it belongs to the codes:
 * exact sums there leave an uncancelled 8*s*sum(x^ - x) error, measured 4x the A8 KL); the zero
 * term uses the unquantized x, so it carries no activation error. Int8 linears (per-row scale)
 * use the same activation scales; bf16 linears are multiplied in fp32. Everything between the
 * products (norms, RoPE, attention, activations, residual) is fp32; the KV cache is bf16, or int8
 * codes with a bf16 scale per (position, KV head) (pointwise.c writes it, attention*.c read it).
 * Prompts of >= BF16_GEMM_MIN_M tokens on AVX512-BF16 builds take a W4A16 GEMM instead
 * (gemm_bf16.c), and of >= AMX_GEMM_MIN_M tokens on the amx build a W4A16 GEMM on tiles
 * (gemm_tiles.c), int4 and lut4. A token's result never depends on which other tokens share its call.
 *
 * Files: sq_abi.h (the structs the binding fills), sq_simd.h (ISA switches, vector helpers),
 * act.c (activation quantization), work.c (the decode workspace), gemv*.c (decode products: portable reference, AVX2, AVX512,
 * gemv_tiles.c the batched step's opt-in int8 tile products over tile_model.c or AMX (gemv_amx.c),
 * and gemv_dispatch.c: the dispatch table and the work-stealing schedule; Arm: gemv_neon.c, gemm_neon.c
 * with gemm_i8mm_neon.c, attention_neon.c, natural-order activations, sdot / smmla), gemm*.c (prompt products; gemm_tiles.c the tile GEMM over tile_model.c or AMX), pointwise.c (norms, RoPE,
 * activations, embedding rows), gdn.c (the Gated DeltaNet layer mixer: conv, delta-rule state, gated norm; its state loops on AVX512 / AVX2 in gdn_simd.c), attention*.c (attention.c decode attention: the portable reference,
 * the dispatch and the schedule, including its block kernels attention_avx2.c / attention_avx512.c;
 * attention_prompt.c prompt attention), head.c (top-k
 * selection and exact refinement of the head's logits), step.c (workspace, sq_step, sq_head),
 * prefill.c (sq_prefill), batch.c (continuous batching: sq_step_many, sq_head_many, sq_prefill_at), gptq.c (the converter's GPTQ inner loop). Naming: <op>_<weight>_<activation>[_<isa>], e.g. gemv_q4_a8quad_avx512. */
#include <stddef.h>
#include <stdio.h>

#include "sq_simd.h"

#include "act.c"
#include "attention.c" /* and its block kernels, attention_avx512.c and attention_avx2.c */
#include "attention_prompt.c"
#include "work.c"
#include "gemv.c"
#include "gemv_avx2.c"
#include "gemv_avx512.c"
#include "gemv_neon.c"
#include "tile_model.c"
#include "gemv_amx.c" /* the batched products on int8 tiles, gemv_tiles.c twice */
#include "gemv_dispatch.c"
#include "gemm_avx2.c"
#include "gemm_avx512.c"
#include "gemm_bf16.c"
#include "gemm_amx.c"
#include "gemm_neon.c" /* and gemm_i8mm_neon.c */
#include "gemm.c"
#include "pointwise.c"
#include "gdn.c"
#include "ssm.c" /* the short-conv and Mamba-2 mixers */
#include "head.c"
#include "step.c"
#include "prefill.c"
#include "batch.c"
#include "gptq.c"

int sq_abi(void) { return SQ_ABI; }

/* The ABI as this build compiled it: "abi=14;kinds=int4:0,...;mixers=attention:0,gdn:1;sq_linear=SIZE:q@0,sz@8,...;..."
 * (each field name@offset; sizes and offsets in bytes). runtime/core/abi.py compares it with its
 * ctypes mirror at load and refuses a library that disagrees. */
#define SQ_DESC_FIELD(type, name) p += snprintf(p, (size_t)(end - p), "%s%s@%zu", first ? "" : ",", #name, \
                                                 offsetof(SQ_DESC_T, name)), first = 0;
const char *sq_abi_desc(void) {
    static char buf[4096];
    char *p = buf, *end = buf + sizeof buf;
    int first;
    p += snprintf(p, (size_t)(end - p), "abi=%d;kinds=int4:%d,int8:%d,bf16:%d,lut4:%d", SQ_ABI, KIND_INT4, KIND_INT8, KIND_BF16, KIND_LUT4);
    p += snprintf(p, (size_t)(end - p), ";mixers=attention:%d,gdn:%d,sconv:%d,mamba2:%d,parallel:%d", MIXER_ATTN,
                  MIXER_GDN, MIXER_SCONV, MIXER_MAMBA, MIXER_PARALLEL);
#define SQ_DESC_T sq_linear
    p += snprintf(p, (size_t)(end - p), ";sq_linear=%zu:", sizeof(sq_linear)), first = 1;
    SQ_LINEAR_FIELDS(SQ_DESC_FIELD)
#undef SQ_DESC_T
#define SQ_DESC_T sq_layer
    p += snprintf(p, (size_t)(end - p), ";sq_layer=%zu:", sizeof(sq_layer)), first = 1;
    SQ_LAYER_FIELDS(SQ_DESC_FIELD)
#undef SQ_DESC_T
#define SQ_DESC_T sq_model
    p += snprintf(p, (size_t)(end - p), ";sq_model=%zu:", sizeof(sq_model)), first = 1;
    SQ_MODEL_FIELDS(SQ_DESC_FIELD)
#undef SQ_DESC_T
    return buf;
}

/* The products this build has: 4 AVX2 + AVX-VNNI, 3 AVX512-VNNI, 2 AVX2, 6 Arm dotprod + i8mm,
 * 5 Arm dotprod, 0 portable */
int sq_simd(void) {
#if defined(SQ_AVX512)
    return 3;
#elif defined(SQ_AVXVNNI)
    return 4;
#elif defined(SQ_AVX2)
    return 2;
#elif defined(SQ_I8MM)
    return 6;
#elif defined(SQ_NEON)
    return 5;
#else
    return 0;
#endif
}

/* Whether int4 products of >= BF16_GEMM_MIN_M tokens take the bf16 GEMM (an avx512-bf16 build) */
int sq_prefill_bf16(void) {
#ifdef SQ_BF16
    return 1;
#else
    return 0;
#endif
}

/* Threads of the parallel regions that follow on the calling thread (the binding sets it
 * before each call, so sessions with different counts can share the process) */
void sq_set_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* y[N] = W x for one linear (tests and tools); x fp32 [K]. Returns 0, or -1 out of memory. */
int sq_linear_f32(const sq_linear *L, const float *x, float *y) {
    sq_act a;
    int ok = sq_act_alloc(&a, L->k);
    if (ok) linear(L, x, &a, y);
    sq_act_free(&a);
    return ok ? 0 : -1;
}

/* out [I] = act(gate) * up of one token's gate_up product gu [2I], or relu(gu)^2 of gu [I] (act 3) (the steps' pointwise GLU;
 * act as sq_model.act): each build's version, for the tests against the portable one */
int sq_glu(int64_t act, const float *gu, int64_t I, float *out) {
    if (act < 0 || act > 3 || I < 0) return -1;
    silu_mul(gu, I, (int)act, out);
    return 0;
}
