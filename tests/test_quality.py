"""Quantization methods (issue 7): GPTQ math, the calibration forward against transformers,
method selection and its errors, and calibrated conversion end to end."""
import hashlib
import json
from pathlib import Path

import pytest
import torch

from helpers import kernel_builds, make_llama, run_cli
from sparkq.convert.calib import BUNDLED
from sparkq.convert.errors import ConvertError
from sparkq.convert.pipeline import Options, convert
from sparkq.convert.gptq import gptq_factor, gptq_int4, gptq_rows
from sparkq.convert.quantize import quantize_rows
from sparkq.formats import Artifact
from sparkq.formats.layout import dequantize_codes
from sparkq.runtime import load
from test_families import FAMILIES as FAM

FAMILIES = {
    "llama": dict(),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=48),
    "gemma3": dict(arch="gemma3", layers=6, sliding_window=8, head_dim=48, query_pre_attn_scalar=40),
    **{f: FAM[f] for f in ("granite", "olmo2", "phi3", "smollm3", "granitemoehybrid", "gemma3-mm")},
}


def _correlated(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    scale = torch.exp(torch.randn(k, generator=gen))  # outlier channels, as real activations have
    return (torch.randn(n, k, generator=gen) @ mix) * scale


def test_gptq_with_uncorrelated_inputs_is_rounding_with_its_group_params():
    """With H diagonal no error is propagated: GPTQ's codes are plain rounding with the static
    (clip-searched) group parameters, whatever the column order."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen)
    h = torch.diag(torch.rand(256, generator=gen) + 0.5)
    codes, sz, _, _ = gptq_int4(w, 64, *gptq_factor(h))
    ref_codes, ref_sz, _, _ = quantize_rows(w, 64, "clip", fast=True)
    assert torch.equal(sz, ref_sz) and torch.equal(codes, ref_codes)


def test_gptq_lowers_output_error_and_codes_decode_in_kernel_convention():
    x = _correlated(4096, 256, 1)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    h = x.T @ x
    codes, sz, err, ref = gptq_int4(w, 64, *gptq_factor(h))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and sz.shape == (4, 96, 2) and sz.dtype == torch.bfloat16
    deq = dequantize_codes(codes, sz, 64, torch.float32)
    assert abs(err - float(((w - deq) ** 2).sum())) < 1e-3 * err  # the reported error is the real one
    c_codes, c_sz, _, _ = quantize_rows(w, 64, "clip")
    out_err = lambda d: float(((w - d) @ x.T).norm())  # noqa: E731
    gptq_e, clip_e = out_err(deq), out_err(dequantize_codes(c_codes, c_sz, 64, torch.float32))
    assert gptq_e < 0.8 * clip_e, (gptq_e, clip_e)


@pytest.mark.parametrize("block", [512, 64, 80])  # one block; row blocks of the inverse (80: a short last one)
def test_gptq_factor_is_the_upper_cholesky_factor_of_the_damped_inverse(block, monkeypatch):
    from sparkq.convert import gptq
    monkeypatch.setattr(gptq, "INV_BLOCK", block)
    x = _correlated(2048, 192, 5)
    h = x.T @ x
    u, perm, dead = gptq_factor(h)
    hp = h[perm][:, perm].double()
    hp += 0.05 * hp.diagonal().mean() * torch.eye(192, dtype=torch.float64)
    assert torch.equal(u, torch.triu(u)) and (u.diagonal() > 0).all()
    assert torch.allclose(u.double().T @ u.double(), torch.linalg.inv(hp), rtol=1e-3, atol=1e-3 * float(torch.linalg.inv(hp).abs().max()))
    assert torch.equal(perm, torch.argsort(h.diagonal(), descending=True)) and not dead.any()


def test_gptq_factor_runs_in_the_hessians_own_memory():
    """Given H to consume (a list), the factor is returned in H's own buffer: no second K x K
    matrix (the conversion's peak at `down`'s K = 8960 is one of them); the blocked in-place
    inverse equals a triangular solve against the identity whatever lies below the diagonal."""
    from sparkq.convert import gptq
    x = _correlated(1024, 200, 3)
    h = x.T @ x
    ptr = h.data_ptr()
    u, _, _ = gptq_factor([h, lambda: x.T @ x])
    assert u.data_ptr() == ptr
    g = torch.Generator().manual_seed(4)
    up = torch.triu(torch.rand(200, 200, generator=g)) + 4 * torch.eye(200)
    want = torch.linalg.solve_triangular(up.double(), torch.eye(200, dtype=torch.float64), upper=True)
    for block in (64, 80, 512):
        got = up + torch.tril(torch.randn(200, 200, generator=g), -1) * 9  # junk below the diagonal
        gptq._upper_inverse_(got, block)
        assert torch.equal(got, torch.triu(got))
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)


def test_gptq_factor_escalates_the_damping_from_the_restored_matrix():
    """An H that the default damping leaves indefinite: the factorization fails, H comes back
    (recomputed by the caller's function, or kept without one) and the next damping (0.1)
    factors it; the result is that of a fresh factorization at 0.1, row-major (as the C kernel
    reads it)."""
    x = _correlated(2048, 160, 9)
    h = x.T @ x
    lam = float(torch.linalg.eigvalsh(h.double()).min())
    m = float(h.diagonal().mean())
    h -= (lam + 0.07 * m) * torch.eye(160)  # shifts the diagonal mean to m' ~ 0.93 m: 0.05 m' < 0.07 m < 0.1 m'
    calls = []
    u, perm, dead = gptq_factor([h.clone(), lambda: calls.append(1) or h.clone()])
    assert len(calls) == 1  # H freed before the first factorization, recomputed once for the second
    assert torch.equal(gptq_factor([h.clone()])[0], u)  # without the function H is kept instead
    hp = h[perm][:, perm].double()
    mean = float(hp.diagonal().mean())
    eye = torch.eye(160, dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(hp + 0.05 * mean * eye).info) != 0  # the first damping fails
    inv = torch.linalg.inv(hp + 0.1 * mean * eye)
    assert u.is_contiguous() and torch.equal(u, torch.triu(u))
    assert torch.allclose(u.double().T @ u.double(), inv, rtol=1e-3, atol=1e-3 * float(inv.abs().max()))


@pytest.mark.parametrize("levels", [False, True])
def test_gptq_c_block_kernel_equals_the_torch_reference(levels):
    """The C inner loop (sq_gptq_block) and gptq_block_py do the same fp32 operations: the same
    codes, on the uniform grid and on per-row level tables (with a zero-scale group)."""
    from sparkq.runtime import core
    if core.compiler() is None:
        pytest.skip("no C compiler")
    x = _correlated(2048, 256, 6)
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(7))
    u, perm, dead = gptq_factor(x.T @ x)
    _, sz, _, _ = quantize_rows(w, 64, "clip")
    s, z = sz[..., 0].float().T.clone(), sz[..., 1].float().T.clone()
    s[3, 1] = 0.0  # a group with no range
    tab = torch.sort(torch.randn(40, 16, generator=torch.Generator().manual_seed(8)) * 4, dim=1).values if levels else None
    a = gptq_rows(w, 64, s, z, u, perm, dead, tab, use_c=True)
    b = gptq_rows(w, 64, s, z, u, perm, dead, tab, use_c=False)
    assert torch.equal(a, b) and int(a.max()) <= 15


@pytest.mark.parametrize("fast", [False, True])
def test_clip_search_c_equals_the_torch_reference(fast):
    """sq_clip_search (the converter's int4 scale search in C) and quantize_rows' torch loop search
    the same candidates in the same order with the same bf16 roundings; only their float sums
    differ in order, so a few groups may tie differently: codes and (scale, zero) agree on all
    but a few, the reported squared error is the error of what they return, and within 1e-6 of
    the reference's. Covers a constant group (no range), a zero row and g32..g128."""
    from sparkq.runtime import core
    if core.compiler() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(11)
    for g, (r, k) in ((32, (96, 256)), (64, (200, 576)), (128, (64, 1024))):
        with torch.random.fork_rng():  # StudentT draws from the global generator: seeded, the same weights every run
            torch.manual_seed(g)
            w = torch.distributions.StudentT(torch.tensor(4.0)).sample((r, k)) * 0.02
        w[5, :g] = 0.3  # a constant group
        w[7] = 0.0  # a zero row
        w += 1e-4 * torch.randn(r, k, generator=gen) * (torch.arange(r)[:, None] > 7)
        ref = quantize_rows(w, g, "clip", fast=fast, use_c=False)
        got = quantize_rows(w, g, "clip", fast=fast)
        assert (got[0] == ref[0]).float().mean() > 0.999 and (got[1] == ref[1]).all(-1).float().mean() > 0.99
        assert int(got[0].max()) <= 15 and torch.equal(got[0][7], ref[0][7]) and torch.equal(got[1][:, 5], ref[1][:, 5])
        e = float(((w - dequantize_codes(got[0], got[1], g, torch.float32)) ** 2).sum(dtype=torch.float64))
        assert got[2] == pytest.approx(e, rel=1e-5) and got[2] == pytest.approx(ref[2], rel=1e-6)
        assert got[3] == ref[3]
        mm = quantize_rows(w, g, "minmax")  # the search starts from min/max: never worse
        assert got[2] <= mm[2]


def test_gptq_dead_inputs_and_singular_hessian():
    x = _correlated(512, 128, 3)
    x[:, 5] = 0.0  # an input that never fires
    x[:, 7] = x[:, 6]  # and two identical ones: H is singular without damping
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    codes, sz, err, ref = gptq_int4(w, 32, *gptq_factor(x.T @ x))
    assert torch.isfinite(dequantize_codes(codes, sz, 32, torch.float32)).all() and 0 < err < ref


@pytest.mark.parametrize("build", kernel_builds())
def test_gram_of_bf16_inputs_in_c_equals_the_float32_gram(build):
    """sq_gram_bf16 (the down projections' Hessian on AVX512-BF16 builds) multiplies the same
    exact bf16 products as gram()'s float32 blocks, summed in another order: within 1e-5 of the
    largest entry, symmetric, with odd token counts (a zero-paired tail), several token chunks and
    outlier channels. Every other build, and K not a multiple of 32, answer -2 (gram() then takes
    the float32 path)."""
    import ctypes

    from sparkq.convert.calib import gram
    from sparkq.runtime import core

    lib = core.load(build)
    gen = torch.Generator().manual_seed(3)
    for t, k in ((7, 32), (1001, 96), (1536, 544)):
        x = torch.randn(t, k, generator=gen) * torch.rand(k, generator=gen) * 2
        x[:, 5] *= 40.0  # an outlier channel
        x = x.to(torch.bfloat16)
        h = torch.full((k, k), float("nan"))
        rc = lib.sq_gram_bf16(x.data_ptr(), t, k, h.data_ptr())
        if not lib.sq_prefill_bf16():
            assert rc == -2
            continue
        ref = gram(x, use_c=False)
        assert rc == 0 and torch.equal(h, h.T)
        assert (h - ref).abs().max() <= 1e-5 * ref.abs().max(), (t, k)
    y = torch.zeros(16, 48, dtype=torch.bfloat16)
    assert lib.sq_gram_bf16(y.data_ptr(), 16, 48, ctypes.c_void_p(0)) == -2  # K % 32: not this kernel's


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "lut4-g32", "int8"])
def test_calibration_moves_through_the_c_core_as_through_the_dequantized_weight(tmp_path, kernel_build, kind):
    """The calibration forward through a packed CoreLinear (the C core's prompt products, what
    conversions use) and through the same codes dequantized to float32 (the torch reference) give
    the same activations within the W4A8 / W4A16 products' error, through every linear of a
    two-layer model, whose Hessians then agree as closely."""
    import numpy as np

    from sparkq.convert.calib import Calibration
    from sparkq.convert.ccore import CoreLinear
    from sparkq.convert.lut import fit_lut
    from sparkq.convert.plan import plan
    from sparkq.convert.source import read_fused_rows as _read_fused_rows
    from sparkq.convert.quantize import quantize_int8_rows
    from sparkq.convert.source import open_source
    from sparkq.formats.layout import dequantize_codes_lut, get_layout, pack_rows
    from sparkq.runtime import core

    lib = core.load(kernel_build)
    src = make_llama(tmp_path / "m", hidden=128, inter=320, layers=2)
    source = open_source(str(src))
    _, spec, linears, _, srcs = plan(source, Options())
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5))
    ref, got = Calibration(source, spec, srcs, ids), Calibration(source, spec, srcs, ids)
    enc, g = kind.split("-")[0], int(kind.split("-g")[1]) if "-g" in kind else 0
    by = {l.name: l for l in linears}
    for name in [f"layers.{i}.{r}" for i in range(spec.layers) for r in ("qkv", "o", "gate_up", "down")]:
        lin = by[name]
        w = _read_fused_rows(source, lin.sources, spec.part_rows(name, len(lin.sources)), 0, lin.n).float()
        if enc == "int8":
            q, s, _, _ = quantize_int8_rows(w)
            deq = q.float() * s.float()[:, None]
            packed = CoreLinear(lib, "int8", lin.n, lin.k, None, {"qweight": q.numpy(), "scales": s})
        else:
            if enc == "lut4":
                lv, sz, codes = fit_lut(w, g)
                deq = dequantize_codes_lut(codes, sz, lv, g, torch.float32)
            else:
                codes, sz, _, _ = quantize_rows(w, g, "minmax")
                deq, lv = dequantize_codes(codes, sz, g, torch.float32), None
            q = np.ascontiguousarray(pack_rows(codes.numpy(), get_layout("rows32"), lin.n))
            packed = CoreLinear(lib, enc, lin.n, lin.k, g, {"qweight": q, "scales_zeros": sz,
                                                            **({} if lv is None else {"levels": lv})})
        hr, hg = ref.hessian(name), got.hessian(name)
        assert (hg - hr).abs().max() <= 0.03 * hr.abs().max(), name
        ref.advance(name, deq)
        got.advance(name, packed)
        assert got.x.shape == ref.x.shape
    err = (got.x - ref.x).norm() / ref.x.norm()
    assert 0 < err < 0.02, float(err)  # a wrong scale layout, code order or kind is off by far more


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_calibration_forward_matches_transformers(fam, tmp_path):
    """The converter's own fp32 forward (what GPTQ calibrates on), fed the unquantized weights,
    reproduces transformers' fp32 logits: every family feature the recipes switch on is covered."""
    from transformers import AutoModelForCausalLM

    from sparkq.convert.calib import Calibration
    from sparkq.convert.plan import plan
    from sparkq.convert.source import open_source
    from sparkq.convert.source import read_fused_rows as _read_fused_rows
    from sparkq.runtime.torchrt.layers import Layers

    src = make_llama(tmp_path / fam, dtype=torch.float32, **FAMILIES[fam])
    source = open_source(str(src))
    recipe, spec, linears, _, srcs = plan(source, Options())
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    cal = Calibration(source, spec, srcs, ids)
    by = {l.name: l for l in linears}
    order = [f"layers.{i}.{r}" for i in range(spec.layers) for r in ("qkv", "o", "gate_up", "down")] + ["lm_head"]
    for name in order:
        h = cal.hessian(name)
        assert h.shape == (by[name].k, by[name].k)
        w = _read_fused_rows(source, by[name].sources, spec.part_rows(name, len(by[name].sources)), 0, by[name].n)
        if name == "lm_head":
            ours = Layers(spec, None).logits((cal.inp @ w.T).view(2, 24, -1))  # (divisor, softcap)
        cal.advance(name, w)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = m(ids).logits
    # the down projections read bf16 inputs (convert/calib.py: the largest activations, kept in bf16):
    # logits within 1.5% of the fp32 model's largest, where a wrong norm, RoPE or mask is off by tens
    assert (ours - ref).abs().max() < 1.5e-2 * ref.abs().max(), fam


def _calib_text(path, chars=60_000):
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
             "every jovial knight of old castles near rivers and mountains").split()
    g = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (chars // 5,), generator=g).tolist())
    path.write_text(text)
    return path


def test_gptq_conversion_end_to_end(tiny_tied, tmp_path):
    calib = _calib_text(tmp_path / "calib.txt")
    out = tmp_path / "g"
    s = convert(str(tiny_tied), str(out), Options(progress=False, calib=str(calib), calib_tokens=1024))
    assert s["method"] == "gptq"  # auto + calibration text
    c = s["calibration"]
    assert c["tokens"] == 1024 and c["sequences"] == 2 and c["start_char"] == len(calib.read_text()) // 2
    art = Artifact.open(out)
    assert art.manifest.method == "gptq" and art.manifest.calibration["sha256"] == c["sha256"]
    # the default head on rows32: split (int4 plane + residual plane, gptq on the first)
    assert art.linears["lm_head"].kind == "int4" and art.linears["lm_head"].residual
    art.verify()
    from sparkq.convert.publish import model_card
    assert "| method | gptq, calibrated on 1024 tokens of calib.txt |" in model_card(art, "me/g", ["rows32"]).text
    # held-out text (the first half): the calibrated artifact is closer to the bf16 model than minmax
    mm = tmp_path / "m"
    convert(str(tiny_tied), str(mm), Options(progress=False, method="minmax"))
    ref, g, m = (load(str(p), max_model_len=160) for p in (tiny_tied, out, mm))
    ids = ref.tokenizer.encode(calib.read_text()[:400])[:128]
    lr = ref.logits(ids).log_softmax(-1)
    kl = lambda a: float((lr.exp() * (lr - a.logits(ids).log_softmax(-1))).sum(-1).mean())  # noqa: E731
    assert kl(g) < kl(m), (kl(g), kl(m))


def test_method_defaults_and_errors(tiny_tied, tmp_path):
    s = convert(str(tiny_tied), str(tmp_path / "a"), Options(progress=False, calib_tokens=1024))
    c = s["calibration"]  # auto with a tokenizer: gptq on the bundled text, whole (from char 0)
    assert s["method"] == "gptq" and c["file"] == "calibration.txt (bundled)" and c["start_char"] == 0
    assert c["tokens"] == 1024 and c["sha256"] == hashlib.sha256(BUNDLED.read_bytes()).hexdigest()
    # the bundled text is not wikitext: no line of it appears in the held-out corpus
    corpus = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "wikitext2-valid.txt"
    if corpus.is_file():
        held = corpus.read_text()
        assert not [ln for ln in BUNDLED.read_text().splitlines() if len(ln) > 40 and ln in held]
    s = convert(str(tiny_tied), str(tmp_path / "a2"), Options(progress=False, method="clip"))
    assert s["method"] == "clip" and s["calibration"] is None
    with pytest.raises(ConvertError, match="no such file"):
        convert(str(tiny_tied), str(tmp_path / "b"), Options(progress=False, calib=str(tmp_path / "nope.txt")))
    short = tmp_path / "short.txt"
    short.write_text("too short " * 20)
    with pytest.raises(ConvertError, match="lower --calib-tokens"):
        convert(str(tiny_tied), str(tmp_path / "b"), Options(progress=False, calib=str(short)))
    assert not (tmp_path / "b").exists()
    r = run_cli("spark-convert", tiny_tied, tmp_path / "c", "--calib", tmp_path / "nope.txt")
    assert r.returncode == 2 and "--calib" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("spark-convert", tiny_tied, tmp_path / "c", "--method", "awq")
    assert r.returncode == 2 and "unknown --method" in r.stderr


def test_no_tokenizer_for_calibration(tmp_path):
    src = make_llama(tmp_path / "nt")
    (src / "tokenizer.json").unlink()
    calib = _calib_text(tmp_path / "c.txt")
    with pytest.raises(ConvertError, match="no tokenizer.json"):
        convert(str(src), str(tmp_path / "o"), Options(progress=False, calib=str(calib)))
    with pytest.raises(ConvertError, match="no tokenizer.json"):  # gptq asked for, bundled text unreadable
        convert(str(src), str(tmp_path / "o"), Options(progress=False, method="gptq"))
    s = convert(str(src), str(tmp_path / "o"), Options(progress=False))
    assert json.loads((tmp_path / "o" / "sparkq.json").read_text())["method"] == s["method"] == "clip"


def test_recipe_head_group_size_and_mixed_int8(tiny_tied, tmp_path):
    """Recipe options for mixed precision: ``head_group_size`` gives the int4 head its own
    (smaller) groups, ``keep_int8`` takes any role; the runtime reads the mix."""
    text = (Path(__file__).resolve().parents[1] / "recipes" / "llama.toml").read_text()
    recipe = tmp_path / "mixed.toml"
    recipe.write_text(text.replace('keep_int8 = ["lm_head", "embed"]', 'keep_int8 = ["down"]\nhead_group_size = 32'))
    out = tmp_path / "mixed"
    convert(str(tiny_tied), str(out), Options(progress=False, method="minmax", head="int4", recipe=str(recipe)))
    art = Artifact.open(out)
    art.verify()
    assert art.linears["lm_head"].kind == "int4" and art.linears["lm_head"].group_size == 32
    assert art.linears["layers.0.down"].kind == "int8"
    assert art.linears["layers.0.qkv"].kind == "int4" and art.linears["layers.0.qkv"].group_size > 32
    ref, m = load(str(tiny_tied), max_model_len=64), load(str(out), max_model_len=64)
    ids = ref.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert float((ref.logits(ids) - m.logits(ids)).abs().max()) < 0.5 * float(ref.logits(ids).abs().max())
    recipe.write_text(text.replace('keep_int8 = ["lm_head", "embed"]', "head_group_size = 48"))
    r = run_cli("spark-convert", tiny_tied, tmp_path / "bad", "--recipe", recipe)
    assert r.returncode == 2 and "head_group_size must be one of" in r.stderr and not (tmp_path / "bad").exists()
    recipe.write_text(text.replace('keep_int8 = ["lm_head", "embed"]', 'keep_int8 = ["downn"]'))
    r = run_cli("spark-convert", tiny_tied, tmp_path / "bad", "--recipe", recipe)
    assert r.returncode == 2 and "keep_int8 must list roles" in r.stderr and len(r.stderr.strip().splitlines()) == 1
