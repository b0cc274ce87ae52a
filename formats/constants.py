"""Names and numbers shared by every sparkq artifact (format version 1).

An artifact is one directory::

    config.json                 source HF config + "quantization_config" (see below)
    model.sparkq.safetensors    every tensor, 64-byte aligned (safetensors-compatible)
    sparkq.json                 the manifest: per-linear and per-tensor metadata
    tokenizer.json, tokenizer_config.json, generation_config.json, ... (copied)

The weights file is deliberately *not* called ``model.safetensors``, and
``quantization_config.quant_method`` is ``"sparkq"``: a plain
``transformers.AutoModelForCausalLM.from_pretrained`` therefore fails (no weights it
can read) instead of building a randomly initialised model.

Tensor names (``L`` is the layer index)::

    <linear>.qweight        uint8 [N, K/2]      packed int4 codes (layout.py)
    <linear>.scales_zeros   bf16  [K/g, N, 2]   per-group scale, zero
    <linear>.weight         bf16  [N, K]        a linear kept in bf16
    <linear>.qweight        int8  [N, K]        an int8 linear (kind int8: w = q * scale[n])
    <linear>.scales         bf16  [N]           its per-row scales
    <norm>.weight           bf16  [D]
    <linear>.bias           bf16  [N]
    <linear>.residual       uint8 [N, K/2]      a split head's 4-bit residual codes (rows32 bytes, see below)
    <linear>.residual_scales bf16 [N, K/g]      their per-group scales
    <linear>.residual_map   int32 [N]           a partial split: each row's row of the two above, or -1
    <linear>.levels         int8  [N, 16]       a lut4 linear's per-row levels (see below)

    linears: layers.L.qkv (q|k|v rows), layers.L.o, layers.L.gate_up (gate|up rows),
             layers.L.down, lm_head, embed (only when the embedding is not tied);
             layers.L.gate in a model with an attention output gate (Spark2_5's g_proj:
             rows [heads * width, hidden], width 1 per head or head_dim per channel)
    norms:   layers.L.attn_norm, layers.L.mlp_norm, norm
    mtp:     a multi-token-prediction block (Qwen3.5's mtp.*; features.mtp_layers > 0): mtp.fc
             [hidden, 2 hidden] over [norm_e(embed(next token)) | norm_h(hidden state)] with
             norms mtp.enorm / mtp.hnorm, then attention layers mtp.layers.J.* (every tensor of
             layers.L.* for an attention layer) and mtp.norm; the head and embedding are shared
    _pad.I   uint8 [n]  alignment padding between tensors (ignored by readers)

A tied embedding is stored once, as ``lm_head``: the runtime gathers and dequantizes
embedding rows from it.

Group sizes: every int4 linear's manifest entry has its own ``group_size`` (the one that
applies). At the top level of the manifest and of ``quantization_config``, ``group_size`` is
the size all int4 linears share, or null when they differ; ``group_sizes`` lists the distinct
sizes, ascending; ``group_size_requested`` is what ``--group-size`` (default: the recipe's
``[quant] group_size``) asked for: a linear whose K it does not divide falls back to the
recipe's ``group_size_fallbacks``.

A *lut4* linear has 4-bit codes like int4 (``qweight`` packed as rows32 in every layout; lut4 is
only written in the rows32 layout) and per-group ``scales_zeros``, plus ``levels`` int8 [N, 16]:
each row's 16 levels, ascending, in -127..127. Its stored weight is
``w = levels[n][q] * scale + zero``: the codes index a grid learned for the row instead of the
uniform ``q - 8``.

A *split* int4 linear (``"residual": true`` in the manifest; ``spark-convert --head split``
makes the head one) adds a second 4-bit plane: ``r[n, k]`` in 0..15, packed like rows32
whatever the artifact's layout (row-major, byte ``j`` of 32-column block ``b`` =
``r[32b+j] | r[32b+j+16] << 4``), and bf16 ``rscale[n, k // g]``. The stored weight is
``w = (q - 8) * scale + zero + (r - 8) * rscale`` (~int8 precision); the first plane alone
is an ordinary int4 linear. The runtime's head product reads only the first plane (half
the bytes of an int8 head) and recomputes the ``REFINE_SPLIT`` largest logits of every
position from both planes (runtime/common.py), so the logits that carry the probability
mass have the stored weight's precision.

A *partial* split (``"residual_rows": M`` in the manifest, M < N) stores the second plane for M
rows only: ``residual`` [M, K/2] and ``residual_scales`` [M, K/g] hold them in ascending row
order, and ``residual_map`` int32 [N] gives each row its row there, or -1 for a row that is its
first plane alone. The converter gives the plane to the rows that carry the probability mass
(the head's tokens by their mean probability on the calibration text: convert/headrows.py).
"""

FORMAT_NAME = "sparkq"
FORMAT_VERSION = 1
QUANT_METHOD = "sparkq"
WEIGHTS_FILE = "model.sparkq.safetensors"
MANIFEST_FILE = "sparkq.json"
CONFIG_FILE = "config.json"
ALIGNMENT = 64
GROUP_SIZES = (32, 64, 128, 256)
BITS = 4
PAD_PREFIX = "_pad."

# Files carried from the source checkpoint into the artifact when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

# Roles of linears in the artifact.
ROLE_QKV, ROLE_O, ROLE_GATE_UP, ROLE_DOWN = "qkv", "o", "gate_up", "down"
ROLE_LM_HEAD, ROLE_EMBED = "lm_head", "embed"
ROLE_GATE = "gate"  # the attention output gate's linear (ModelSpec.attn_gate), only where the family has one
LAYER_LINEARS = (ROLE_QKV, ROLE_O, ROLE_GATE_UP, ROLE_DOWN)  # every layer's
HEAD_ROLES = (ROLE_LM_HEAD, ROLE_EMBED)  # the (tied) embedding/head
# the per-layer input embedding (Gemma 4): the table (a row of layers * width per token), the main
# embedding's projection to it and its norm; per layer its gate, projection and post norm; the layer's scalar
ROLE_PLE_EMBED, ROLE_PLE_MODEL, PLE_IN_NORM = "ple_embed", "ple_model", "ple_in_norm.weight"
ROLE_PLE_GATE, ROLE_PLE_PROJ, PLE_NORM, LAYER_SCALAR = "ple_gate", "ple_proj", "ple_norm", "layer_scalar"
ROW_READ = (ROLE_PLE_EMBED,)  # linears read a row per token from the mapping (artifact.py advises them so)
# a parallel layer's Mamba-2 branch (Falcon-H1: attention and Mamba-2 side by side on one normed input):
# its in_proj's x | B | C rows, its z | dt rows, its out_proj
ROLE_SSM_IN, ROLE_SSM_GATE, ROLE_SSM_OUT = "ssm_in", "ssm_gate", "ssm_out"
# the layer linears the calibration forward moves its activations through (a gate's product is
# applied from its bf16 rows by the mixer's math)
FORWARD_LINEARS = LAYER_LINEARS + (ROLE_SSM_IN, ROLE_SSM_OUT)
ROLES = LAYER_LINEARS + (ROLE_GATE,) + HEAD_ROLES + (ROLE_PLE_EMBED, ROLE_PLE_MODEL, ROLE_PLE_GATE, ROLE_PLE_PROJ,
                                                     ROLE_SSM_IN, ROLE_SSM_GATE, ROLE_SSM_OUT)
LAYER_NORMS = ("attn_norm", "mlp_norm")
# the multi-token-prediction block (see above): its input projection and norms, its layers' prefix
MTP_FC, MTP_NORM, MTP_ENORM, MTP_HNORM = "mtp.fc", "mtp.norm.weight", "mtp.enorm.weight", "mtp.hnorm.weight"
MTP_LAYER = "mtp.layers.{j}."
DTYPE_F32 = "F32"

# Layer mixers (formats/mixers.py): what mixes a layer's tokens before its MLP
MIXER_ATTENTION = "attention"  # softmax attention over the KV cache (full or sliding)
MIXER_GDN = "gdn"              # Gated DeltaNet: a short conv and a delta-rule recurrent state (Qwen3.5, OLMo Hybrid)
# a Gated DeltaNet layer's parameters, fp32 in the artifact (never quantized; layers.L.<name>)
GDN_CONV, GDN_A_LOG, GDN_DT_BIAS, GDN_NORM = "conv.weight", "a_log", "dt_bias", "gnorm.weight"
GDN_PARAMS = (GDN_CONV, GDN_A_LOG, GDN_DT_BIAS, GDN_NORM)
MIXER_SCONV = "sconv"          # a gated short convolution: B, C, x; C * conv(B * x) (LFM2, LFM3)
MIXER_MAMBA = "mamba2"         # Mamba-2: conv over x | B | C, a selective state per head, a gated norm (Granite 4.0-H)
MIXER_PARALLEL = "parallel"    # attention and Mamba-2 side by side, both from the layer's normed input (Falcon-H1)
# their parameters besides the conv weight, a_log, dt_bias and gnorm above (fp32, as GDN's)
CONV_BIAS, SSM_D = "conv.bias", "d"
MIXER_PARAMS = GDN_PARAMS + (CONV_BIAS, SSM_D)  # every mixer's fp32 parameter names (layers.L.<name>)

KIND_INT4 = "int4"
KIND_LUT4 = "lut4"  # 4-bit codes into a learned 16-level table per row (rows32 only; see above)
KIND_INT8 = "int8"  # per-row symmetric int8 (torch's _weight_int8pack_mm), for sensitive roles
KIND_BF16 = "bf16"

# safetensors dtype strings we use
DTYPE_U8 = "U8"
DTYPE_I8 = "I8"
DTYPE_BF16 = "BF16"
DTYPE_I32 = "I32"
DTYPE_BYTES = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I8": 1, "I32": 4, "F64": 8,
               "I64": 8, "I16": 2, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
