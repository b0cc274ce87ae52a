/* The C core's ABI: the structs the Python binding fills (runtime/core/abi.py mirrors them
 * with ctypes and checks the mirror against sq_abi_desc() at load), the linear kind codes, and
 * the ABI number. Every field is 8 bytes wide, so the layout has no padding questions. */
#ifndef SQ_ABI_H
#define SQ_ABI_H
#include <stdint.h>

#define SQ_ABI 18

/* linear kinds (formats/constants.py KIND_* by name; the binding reads the codes from sq_abi_desc) */
enum { KIND_INT4 = 0, KIND_INT8 = 1, KIND_BF16 = 2, KIND_LUT4 = 3 };
/* layer mixers (sq_layer.mixer; formats/mixers.py Mixer.code, checked against sq_abi_desc) */
enum { MIXER_ATTN = 0, MIXER_GDN = 1, MIXER_SCONV = 2, MIXER_MAMBA = 3, MIXER_PARALLEL = 4 };

/* one linear: W [N, K] in the artifact's mapping, read in place.
 *   q    int4, lut4: rows32 bytes [N, K/2]; int8: int8 [N, K]; bf16: bf16 [N, K]
 *   sz   int4, lut4: bf16 (scale, zero) [K/g, N, 2]; int8: bf16 scales [N]; bf16: unused
 *   lut  lut4: int8 [N, 16], each row's ascending levels (w = lut[n][q] * scale + zero); else NULL
 *   bias bf16 [N] or NULL
 *   res, rsc  a split int4 linear's second plane (formats/constants.py), else NULL: rows32 codes
 *        r [N, K/2] and bf16 scales [N, K/g]; stored weight = (q - 8) s + z + (r - 8) rs.
 *        Products read the first plane only; the head refinement and embedding rows add it.
 *   rmap a split linear whose second plane covers some rows only: int32 [N], row n's row in
 *        res / rsc, or -1 (no second plane: the row is its first plane); NULL: row n is row n */
#define SQ_LINEAR_FIELDS(F)                                                                       \
    F(const uint8_t *, q) F(const uint16_t *, sz) F(const uint16_t *, bias) F(int64_t, kind)     \
    F(int64_t, n) F(int64_t, k) F(int64_t, g) F(const uint8_t *, res) F(const uint16_t *, rsc)          \
    F(const int8_t *, lut) F(const int32_t *, rmap)

/* one decoder layer: its linears, norms (bf16 [D] or NULL: attn_norm / mlp_norm NULL is no norm
 * before attention / the MLP, OLMo2), RoPE tables (bf16 [rope_len, rot]; rot 0: no RoPE, SmolLM3),
 * its KV cache [kv_heads, cap, head_dim] (bf16, or int8 codes with kscale / vscale: one bf16 scale
 * per (KV head, position) [kv_heads, cap], x = code * scale; NULL for a bf16 cache), rotary dims,
 * sliding window (0 = full), and the attention output gate's linear (gate.q NULL: no gate; see
 * gate_width).
 * mixer: MIXER_ATTN, or MIXER_GDN, a Gated DeltaNet layer (gdn.c; shapes in sq_model lin_*), which
 * reads qkv (in_proj_qkv [C, E], C = 2 Kd + Vd: rows q (Hk dk) | k (Hk dk) | v (Hv dv)), gate (z
 * [Vd] | b [Hv] | a [Hv] rows as one linear), o (out_proj [E, Vd]) and its fp32 parameters:
 * conv_w [C, K] (the depthwise causal conv), a_log [Hv], dt_bias [Hv], gnorm [dv] (the gated
 * RMSNorm's weight, x * w form), and its per-sequence fp32 state: conv_state [slots, C, K - 1]
 * (the previous K - 1 pre-conv inputs, oldest first) and rec_state [slots, Hv, dk, dv] (S[h][i][j],
 * i the key dim); a sequence at position 0 empties its slot's states first (gdn.c gdn_reset_slot).
 * q_norm, k_norm, cos, sin and the KV cache are unused (NULL) there.
 * MIXER_SCONV, a gated short convolution (ssm.c; LFM2): qkv is in_proj [3 E, E] (rows B | C | x), o
 * out_proj; conv_w [E, K]; conv_state [slots, E, K - 1] (the previous K - 1 values of B * x).
 * MIXER_MAMBA, a Mamba-2 layer (ssm.c; shapes in sq_model ssm_*): qkv is in_proj's x | B | C rows
 * [Cm, E] (Cm = inner + 2 G N), gate its z | dt rows [inner + H, E], o out_proj [E, inner]; conv_w
 * [Cm, K], conv_b [Cm] or NULL, a_log [H], dt_bias [H], ssm_d [H], gnorm [inner]; conv_state [slots,
 * Cm, K - 1] and rec_state [slots, H, P, N] (S[h][p][n]).
 * MIXER_PARALLEL (Falcon-H1): an attention layer (all its fields) whose Mamba-2 branch reads the same
 * normed input through ssm_in (x | B | C), ssm_gate (z | dt) and ssm_out, with MIXER_MAMBA's parameters
 * and states; both outputs are added to the residual (attention's first).
 * Per-layer geometry (Gemma 4; 0 / NULL: none): head_dim (this layer's; the model's head_dim is the
 * largest, and a KV slot's offset is in its units), kv_shared (1: qkv holds q rows only and the caches
 * are an earlier layer's, read, never written), scalar (the layer's output times it), and after the
 * MLP the per-layer input branch: x += norm(ple_proj(act(ple_gate x) * ple_l), ple_norm). The MLP
 * width is gate_up.n / 2 (the model's inter is the largest; act 3: gate_up.n, up rows alone); gate_up.q
 * NULL: no MLP (the layer is its mixer and residual only). */
#define SQ_LAYER_FIELDS(F)                                                                        \
    F(sq_linear, qkv) F(sq_linear, o) F(sq_linear, gate_up) F(sq_linear, down)                    \
    F(const uint16_t *, attn_norm) F(const uint16_t *, mlp_norm) F(const uint16_t *, post_attn_norm) \
    F(const uint16_t *, post_mlp_norm) F(const uint16_t *, q_norm) F(const uint16_t *, k_norm)    \
    F(const uint16_t *, cos) F(const uint16_t *, sin) F(void *, kcache) F(void *, vcache)               \
    F(uint16_t *, kscale) F(uint16_t *, vscale) F(int64_t, rot) F(int64_t, window) F(sq_linear, gate)   \
    F(int64_t, mixer) F(const float *, conv_w) F(const float *, a_log) F(const float *, dt_bias)  \
    F(const float *, gnorm) F(float *, conv_state) F(float *, rec_state) F(int64_t, head_dim) F(int64_t, kv_shared) \
    F(double, scalar) F(sq_linear, ple_gate) F(sq_linear, ple_proj) F(const uint16_t *, ple_norm)                   \
    F(const float *, conv_b) F(const float *, ssm_d) F(sq_linear, ssm_in) F(sq_linear, ssm_gate) F(sq_linear, ssm_out)

/* the model: shape, act (0 SiLU, 1 GELU-tanh, 2 GELU (erf): gated MLPs; 3 relu2: relu(up)^2, no gate), norm_offset (1: (1 + w) norms), refine_top (top
 * logits recomputed exactly), kv_int8 (1: the layers' caches hold int8 codes + scales, 0: bf16),
 * qk_norm_full (1: q_norm / k_norm span all heads' q [H*D] and k [KV*D], OLMo2; 0: per head),
 * embed_mult (0 = off), res_mult (the branch outputs' factor before the residual add, Granite;
 * 0 = 1), gate_width (the attention output gate: each query head's output times sigmoid of its
 * gate_width values of the layer's gate product, 1 per head or head_dim per channel; 0 none), the
 * layers, head, embedding (the head's linear when tied), final norm; the Gated DeltaNet layers'
 * shape (all 0 without such layers): lin_k_heads Hk, lin_v_heads Hv (a multiple of Hk: value head
 * h reads key head h / (Hv / Hk)), lin_k_dim dk, lin_v_dim dv, conv_k K (the conv's kernel, <= 16),
 * beta_scale (1, or 2: OLMo Hybrid's allow_neg_eigval), gnorm_eps (the gated RMSNorm's); a multi-token-
 * prediction block's input (fc.q NULL: none): fc [hidden, 2 hidden] over [norm(embed(token), fc_enorm) |
 * norm(hidden state, fc_hnorm)] replaces the embedding row (sq_step_many_in, sq_prefill_in_at); v_norm (1: each
 * V head RMS-normed without a weight before the cache, Gemma 4); per-layer inputs (ple_dim P > 0, Gemma 4):
 * per token ple_l = (norm(ple_model(x)_l / sqrt(hidden), ple_in_norm) + ple_embed[token]_l * sqrt(P)) / sqrt(2)
 * for each layer l, x the scaled embedding (pointwise.c ple_combine); the short convolutions' channels sc_dim
 * (0: none); the Mamba-2 layers' shape (all 0: none): ssm_heads H, ssm_head_dim P, ssm_state N, ssm_groups G
 * (B and C per group; head h reads group h / (H / G)), ssm_norm_groups (the gated norm's groups); both
 * with conv_k and (Mamba) gnorm_eps. */
#define SQ_MODEL_FIELDS(F)                                                                        \
    F(int64_t, layers) F(int64_t, hidden) F(int64_t, heads) F(int64_t, kv_heads) F(int64_t, head_dim) \
    F(int64_t, inter) F(int64_t, vocab) F(int64_t, cap) F(int64_t, act) F(int64_t, norm_offset)   \
    F(int64_t, refine_top) F(int64_t, kv_int8) F(int64_t, qk_norm_full) F(double, eps) F(double, attn_scale)          \
    F(double, embed_mult) F(double, res_mult) F(int64_t, gate_width)                                                \
    F(sq_layer *, layer) F(sq_linear, head) F(sq_linear, embed) F(const uint16_t *, final_norm)            \
    F(int64_t, lin_k_heads) F(int64_t, lin_v_heads) F(int64_t, lin_k_dim) F(int64_t, lin_v_dim)   \
    F(int64_t, conv_k) F(double, beta_scale) F(double, gnorm_eps) F(sq_linear, fc) F(const uint16_t *, fc_enorm)  \
    F(const uint16_t *, fc_hnorm) F(int64_t, v_norm) F(int64_t, ple_dim) F(sq_linear, ple_embed) F(sq_linear, ple_model) \
    F(const uint16_t *, ple_in_norm) F(int64_t, sc_dim) F(int64_t, ssm_heads) F(int64_t, ssm_head_dim)            \
    F(int64_t, ssm_state) F(int64_t, ssm_groups) F(int64_t, ssm_norm_groups)

#define SQ_FIELD_DECL(type, name) type name;
typedef struct { SQ_LINEAR_FIELDS(SQ_FIELD_DECL) } sq_linear;
typedef struct { SQ_LAYER_FIELDS(SQ_FIELD_DECL) } sq_layer;
typedef struct { SQ_MODEL_FIELDS(SQ_FIELD_DECL) } sq_model;

#endif
