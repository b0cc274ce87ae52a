"""LFM2, Granite 4.0-H, Nemotron-H and Falcon-H1 GGUF input (llama.cpp's ``lfm2``, ``granitehybrid``,
``nemotron_h`` and ``falcon-h1`` architectures, convert/gguf_hybrids.py): a tiny make_ssm checkpoint
written as llama.cpp's converter writes it (tests/ggufwrite.py: per-layer KV head counts and MLP
widths, squeezed convs, LFM2's final norm as token_embd_norm, Granite's shared MLP split into
ffn_gate / ffn_up, -exp(A_log), A and D as [H, 1], the grouped norm, q/k permuted, Falcon-H1's
multipliers folded into its weights) reads back as the checkpoint's tensors (Falcon-H1's: folded)
and config, converts to an artifact with the checkpoint's logits, imports to a checkpoint
transformers runs as the original; transformers' own lfm2 GGUF loader reads the file as the
checkpoint; Granite 4.0-H and Nemotron-H with experts are refused by name."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from ggufwrite import falcon_fold, write_gguf
from ssm_models import make_ssm
from sparkq.convert.errors import ConvertError
from sparkq.convert.pipeline import Options, convert
from sparkq.convert.source import open_source
from sparkq.formats.recipe import recipe_for_config
from sparkq.formats.spec import ModelSpec

SEQ = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3)).tolist()
# key scaling off: calibration text tokenizes differently through the test writer's vocabulary
OPTS = Options(progress=False, method="minmax", key_scaling=False)
NOPE_CONTEXT = 2**20  # GraniteHybridModel's context_length for a model without RoPE (the real one is not stored)
GGUF_ARCH = {"lfm2": "lfm2", "granite_h": "granitehybrid", "nemotron_h": "nemotron_h", "falcon_h1": "falcon-h1"}
FAMILY = {"lfm2": "lfm2", "granite_h": "granitemoehybrid", "nemotron_h": "nemotron_h", "falcon_h1": "falcon_h1"}
MAMBA_PARAMS = tuple(f"{m}.{p}" for m in ("mamba", "mixer") for p in ("A_log", "dt_bias", "D", "conv1d.weight",
                                                                     "conv1d.bias", "norm.weight"))
# Falcon-H1: the GGUF holds the weights times the multipliers, which sparkq reads rounded to bf16
# (as `sparkq import-gguf` writes them), while the checkpoint's artifact scales its bf16 weights in
# fp32 before quantizing: some int4 codes round the other way. Measured on the tiny model (largest
# logit difference / largest logit): the GGUF's artifact vs the checkpoint's 0.111, each vs the
# fp32 transformers logits 0.318 and 0.308 (root mean square 0.0672 and 0.0685: the GGUF's no
# farther from the model than the checkpoint's); the imported checkpoint (folded, bf16) vs the
# original in transformers 0.0057. Allowed: FALCON_TOL, FALCON_IMPORT_TOL, and the GGUF artifact's
# RMS error against the fp32 logits at most FALCON_RMS_RATIO times the checkpoint artifact's
FALCON_TOL, FALCON_IMPORT_TOL, FALCON_RMS_RATIO = 0.15, 0.01, 1.1


@pytest.fixture(scope="module", params=["lfm2", "granite_h", "nemotron_h", "falcon_h1"])
def ssm(tmp_path_factory, request):
    """(dir, arch, checkpoint, {qtype: gguf}). Granite: no experts per token (as the dense Granite
    4.0-H configs; llama.cpp refuses to load experts used > experts)."""
    d = tmp_path_factory.mktemp(f"{request.param}gguf")
    extra = {"num_experts_per_tok": 0} if request.param == "granite_h" else {}
    src = make_ssm(d / request.param, request.param, **extra)
    return d, request.param, src, {q: write_gguf(src, d / f"{request.param}-{q}.gguf", q) for q in ("F32", "BF16")}


def _all(source, name):
    return source.read_rows(name, 0, source.shapes[name][0])


def _folded(src, name, x):
    """A Falcon-H1 checkpoint tensor as the GGUF source reads it: folded as llama.cpp folds it
    (ggufwrite.falcon_fold), rounded to bf16 (the Mamba parameters, fp32, are not folded)."""
    cfg = json.loads((src / "config.json").read_text())
    return torch.from_numpy(falcon_fold(name, x.numpy(), cfg)).to(torch.bfloat16).float()


@pytest.mark.parametrize("qtype", ["F32", "BF16"])
def test_gguf_tensors_and_config_are_the_checkpoints(ssm, qtype):
    """Every tensor read through the GGUF source equals the checkpoint's (A_log within fp32
    rounding: the file holds -exp(A_log); Falcon-H1's folded by its multipliers, rounded to bf16),
    whole or in row slices (across Granite's gate / up boundary); the Mamba parameters read as fp32;
    the rebuilt config gives the checkpoint's ModelSpec (but the context length of Granite 4.0-H and
    Nemotron-H, which llama.cpp does not store for a NoPE model, and Falcon-H1's embedding and
    lm_head multipliers, which it folds: 1 in the GGUF's config)."""
    _, arch, src, ggufs = ssm
    a, b = open_source(str(src)), open_source(str(ggufs[qtype]))
    try:
        assert a.shapes == b.shapes
        for n in sorted(a.shapes):
            x, y = _all(a, n), _all(b, n)
            if arch == "falcon_h1" and ":" in n:  # (views: the checkpoint's scale by its multipliers in fp32,
                torch.testing.assert_close(y, x, rtol=2**-8, atol=0, msg=n)  # the GGUF's by 1, read in bf16)
            elif arch == "falcon_h1" and not n.endswith(MAMBA_PARAMS):
                assert torch.equal(_folded(src, n, x), y), n
            elif n.endswith("A_log"):
                torch.testing.assert_close(y, x, rtol=0, atol=5e-7)
            else:
                assert torch.equal(x, y), n
            if n.endswith(MAMBA_PARAMS):
                assert getattr(b, "base", b).fp32(n) and y.dtype == torch.float32, n
            rows = a.shapes[n][0]
            if rows > 1 and not n.endswith("A_log"):
                parts = torch.cat([b.read_rows(n, r, min(rows, r + 7)) for r in range(0, rows, 7)])
                assert torch.equal(parts, y), n
        ra, rb = recipe_for_config(a.config), recipe_for_config(b.config)
        assert ra.family == rb.family == FAMILY[arch]
        sa, sb = ModelSpec.from_recipe(a.config, ra), ModelSpec.from_recipe(b.config, rb)
        if arch in ("granite_h", "nemotron_h"):
            assert sb.max_position == NOPE_CONTEXT and sb.nope_layers
            sb = dataclasses.replace(sb, max_position=sa.max_position)
        if arch == "falcon_h1":
            assert (sa.embedding_multiplier, sa.logits_divisor) == (3.0, 2.0)
            assert (sb.embedding_multiplier, sb.logits_divisor) == (None, 1.0)
            sa = dataclasses.replace(sa, embedding_multiplier=None, logits_divisor=1.0)
        if arch == "nemotron_h":
            assert sb.blocks == ((0, 1), (2, -1), (3, 4), (5, -1), (6, 7))
        assert sa == sb and sa.mixers == sb.mixers and (sa.sconv or sa.ssm)
        assert (sa.sconv, sa.ssm, sa.layer_types) == (sb.sconv, sb.ssm, sb.layer_types)
    finally:
        a.close()
        b.close()


def test_gguf_layout_is_llamacpps(ssm):
    """The file really holds llama.cpp's layout (the test above is not an identity)."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    _, arch, src, ggufs = ssm
    hf = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    r = GGUFReader(str(ggufs["F32"]))
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    a = GGUF_ARCH[arch]
    assert r.fields["general.architecture"].contents() == a
    kv = r.fields[f"{a}.attention.head_count_kv"].contents()
    if arch == "nemotron_h":  # blocks M - M * - M M -
        assert kv == [0, 0, 0, 2, 0, 0, 0, 0]
        assert r.fields[f"{a}.feed_forward_length"].contents() == [0, 256, 0, 0, 256, 0, 0, 256]
        assert np.allclose(t["blk.0.ssm_a"][:, 0], -np.exp(hf["backbone.layers.0.mixer.A_log"]))
        assert t["blk.0.ssm_norm.weight"].shape == (2, 96) and t["blk.0.ssm_conv1d.weight"].shape == (320, 4)
        assert "blk.1.ffn_up.weight" in t and "blk.1.ssm_in.weight" not in t and "blk.1.ffn_gate.weight" not in t
        assert np.array_equal(t["blk.1.attn_norm.weight"], hf["backbone.layers.1.norm.weight"])
        assert not np.array_equal(t["blk.3.attn_q.weight"], hf["backbone.layers.3.mixer.q_proj.weight"])  # permuted
        return
    if arch == "falcon_h1":  # the multipliers folded (none in the metadata); the pre-MLP norm unsuffixed
        cfg = json.loads((src / "config.json").read_text())
        assert kv == 2 and not [k for k in r.fields if "scale" in k or "multiplier" in k]
        assert "blk.0.ffn_norm" in t and "blk.0.ffn_norm.weight" not in t
        assert np.array_equal(t["blk.0.ffn_norm"], hf["model.layers.0.pre_ff_layernorm.weight"])
        assert np.array_equal(t["token_embd.weight"], 3.0 * hf["model.embed_tokens.weight"])
        assert np.array_equal(t["output.weight"], 0.5 * hf["lm_head.weight"])
        z, dt = t["blk.0.ssm_in.weight"], hf["model.layers.0.mamba.in_proj.weight"]
        assert np.allclose(z[:256], dt[:256] * 1.25 * 0.35, rtol=1e-6) and np.allclose(z[-8:], dt[-8:] * 1.25 * 0.35)
        assert np.allclose(t["blk.0.attn_k.weight"], hf["model.layers.0.self_attn.k_proj.weight"] * 0.4 * 1.5)
        assert "blk.0.ssm_norm.weight" not in t and not cfg["mamba_rms_norm"]
        return
    if arch == "lfm2":
        assert kv == [0, 0, 2, 0] and "output_norm.weight" not in t
        assert np.array_equal(t["token_embd_norm.weight"], hf["model.embedding_norm.weight"])
        assert t["blk.0.shortconv.conv.weight"].shape == (128, 3)
        assert np.array_equal(t["blk.2.attn_q.weight"], hf["model.layers.2.self_attn.q_proj.weight"])
        return
    assert kv == [0, 0, 0, 2] and not r.fields[f"{a}.rope.scaling.finetuned"].contents()
    assert np.allclose(t["blk.0.ssm_a"][:, 0], -np.exp(hf["model.layers.0.mamba.A_log"]))
    assert t["blk.0.ssm_norm.weight"].shape == (2, 128) and t["blk.0.ssm_conv1d.weight"].shape == (384, 4)
    gu = hf["model.layers.0.shared_mlp.input_linear.weight"]
    assert np.array_equal(np.concatenate([t["blk.0.ffn_gate.weight"], t["blk.0.ffn_up.weight"]]), gu)
    assert not np.array_equal(t["blk.3.attn_q.weight"], hf["model.layers.3.self_attn.q_proj.weight"])  # permuted


def _logits(path):
    from sparkq.runtime import load
    m = load(str(path), max_model_len=64, kv_dtype="bf16")
    with torch.no_grad():
        return m.model.forward(torch.tensor(SEQ), 0, last_only=False).float()


def test_gguf_converts_and_imports_as_the_checkpoint(ssm):
    """spark-convert of the GGUF gives an artifact with the checkpoint's artifact's logits (Falcon-H1's
    within its folding's rounding, FALCON_TOL, and no farther from the fp32 model); `sparkq
    import-gguf` gives a checkpoint (Mamba parameters fp32) that transformers runs as the original."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from sparkq.convert.gguf_source import import_gguf

    d, arch, src, ggufs = ssm
    gg = ggufs["F32" if arch == "falcon_h1" else "BF16"]
    tol, import_tol = (FALCON_TOL, FALCON_IMPORT_TOL) if arch == "falcon_h1" else (1e-4, 1e-4)
    convert(str(src), str(d / "st"), OPTS)
    convert(str(gg), str(d / "gg"), OPTS)
    la, lb = _logits(d / "st"), _logits(d / "gg")
    assert (la - lb).abs().max() <= tol * la.abs().max(), ((la - lb).abs().max() / la.abs().max()).item()
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits[0]
    if arch == "falcon_h1":
        rms_a, rms_b = ((la - want).pow(2).mean().sqrt(), (lb - want).pow(2).mean().sqrt())
        assert rms_b <= FALCON_RMS_RATIO * rms_a, (rms_b / rms_a).item()

    imp = d / "imported"
    import_gguf(str(gg), str(imp), progress=False)
    if arch != "lfm2":
        pre = "backbone.layers.0.mixer" if arch == "nemotron_h" else "model.layers.0.mamba"
        with safe_open(str(imp / "model.safetensors"), "pt") as f:
            assert f.get_slice(f"{pre}.A_log").get_dtype() == "F32"
            assert f.get_slice(f"{pre}.in_proj.weight").get_dtype() == "BF16"
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(imp, dtype=torch.float32).eval()(ids).logits[0]
    assert (got - want).abs().max() <= import_tol * want.abs().max(), ((got - want).abs().max() / want.abs().max()).item()


def test_transformers_reads_the_lfm2_gguf_as_the_checkpoint(ssm):
    """transformers' lfm2 GGUF loader (its inverse of llama.cpp's converter) gives the checkpoint's
    weights from the test writer's file (transformers 5.25 has no granitehybrid, nemotron_h or
    falcon-h1 loader)."""
    from transformers import AutoModelForCausalLM

    d, arch, src, ggufs = ssm
    if arch != "lfm2":
        pytest.skip(f"transformers has no {GGUF_ARCH[arch]} GGUF loader")
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=ggufs["F32"].name, dtype=torch.float32).eval()
    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    sr, so = ref.state_dict(), orig.state_dict()
    assert sr.keys() == so.keys()
    for k in so:
        torch.testing.assert_close(sr[k], so[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("arch", ["granitehybrid", "nemotron_h", "nemotron_h_moe"])
def test_moe_gguf_is_refused_by_name(tmp_path, arch):
    """Experts (ffn_*_exps tensors, an expert count) in a granitehybrid or nemotron_h file, and every
    nemotron_h_moe file (llama.cpp's Nemotron-H with E blocks), refused in one line."""
    from ggufwrite import write_moe_stub
    p = write_moe_stub(tmp_path / f"{arch}-moe.gguf", arch, experts=4)
    with pytest.raises(ConvertError, match="mixture-of-experts") as e:
        open_source(str(p))
    assert "\n" not in str(e.value) and arch in str(e.value)
