"""lut4 (formats/constants.py): 4-bit codes into a 16-level table learned per row. The fit (C and
torch), conversion end to end, both runtimes, the torch fallback, refusals. The products of every
build against fp64 are in test_kernels.py (the lut4-* cases)."""
import json

import numpy as np
import pytest
import torch

from helpers import dequant_reference, kernel_builds, make_llama, run_cli
from sparkq.convert.lut import fit_lut, fit_lut_py
from sparkq.convert.pipeline import Options, convert
from sparkq.convert.quantize import quantize_rows
from sparkq.formats import Artifact
from sparkq.formats.layout import dequantize_codes, dequantize_codes_lut


@pytest.mark.parametrize("g", [64, 128])
def test_fit_learns_a_grid_better_than_uniform_int4(g):
    """On heavy-tailed rows the learned levels reconstruct better than int4's best (the clip
    search) at the same group size; the C fit and the torch reference reach the same error; the
    levels are ascending int8 and the codes are their nearest."""
    torch.manual_seed(0)
    w = torch.distributions.StudentT(torch.tensor(4.0)).sample((256, 1024))
    imp = torch.rand(1024) ** 3
    lv, sz, codes = fit_lut(w, g, imp)
    assert lv.dtype == torch.int8 and torch.equal(lv, torch.sort(lv, dim=1).values) and sz.dtype == torch.bfloat16
    err = lambda d: float((((w - d) ** 2) * imp).sum() / ((w ** 2) * imp).sum())  # noqa: E731
    e_c = err(dequantize_codes_lut(codes, sz, lv, g, torch.float32))
    lv2, sz2, c2 = fit_lut_py(w, g, imp)
    e_py = err(dequantize_codes_lut(c2, sz2, lv2, g, torch.float32))
    qc, szc, _, _ = quantize_rows(w, g, "clip")
    e_int4 = err(dequantize_codes(qc, szc, g, torch.float32))
    assert abs(e_c - e_py) < 0.02 * e_py, (e_c, e_py)
    assert e_c < 0.85 * e_int4, (e_c, e_int4)


@pytest.fixture(scope="module")
def lut_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("lut4")
    src = make_llama(d / "src", layers=2, hidden=192, inter=384, heads=6, kv_heads=2, seed=5)
    convert(str(src), str(d / "int4"), Options(progress=False, method="minmax", head="int8"))
    convert(str(src), str(d / "lut4"), Options(progress=False, method="minmax", head="int8", kind="lut4"))
    return src, d / "int4", d / "lut4"


def test_artifact_holds_levels_and_is_closer_to_the_source(lut_pair):
    from sparkq.runtime import load

    src, i4, l4 = lut_pair
    art = Artifact.open(l4)
    assert {e.kind for n, e in art.linears.items() if n.startswith("layers.")} == {"lut4"}
    assert art.linears["lm_head"].kind == "int8"
    assert art.infos["layers.0.qkv.levels"].shape == (art.linears["layers.0.qkv"].n, 16)
    assert art.verify() is None
    assert set(art.summary()["group_sizes"]) == {"g64/lut4", "g128/lut4", "int8"}
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = load(str(src), max_model_len=64).logits(ids).log_softmax(-1)
    kl = lambda p: torch.nn.functional.kl_div(load(str(p), max_model_len=64).logits(ids).log_softmax(-1), ref,  # noqa: E731
                                              log_target=True, reduction="batchmean").item()
    assert kl(l4) < kl(i4), (kl(l4), kl(i4))


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_runtimes_agree_and_match_the_stored_weights(lut_pair, kernel_build):
    """Both runtimes: the same logits and tokens; the C core within the W4A8 budget of an fp32
    forward of the stored weights; the torch fallback (no C core) of the same weights agrees."""
    from sparkq.runtime import load, load_lite

    _, _, l4 = lut_pair
    q = load(str(l4), max_model_len=64)
    lm = load_lite(str(l4), max_model_len=64)
    assert q.model.fast is not None and q.model.prefill_off is None
    t = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3))
    assert np.array_equal(lm.prefill(t.numpy()).copy(), q.model.forward(t, 0, last_only=True)[0].numpy())
    assert list(lm.stream_ids(t.tolist(), max_new_tokens=8, stop_ids=[])) == \
        list(q.stream_ids(t.tolist(), max_new_tokens=8, stop_ids=[]))
    c = q.model.forward(t, 0, last_only=False)
    b32 = dequant_reference(q, torch.float32).forward(t, 0, last_only=False)
    b16 = dequant_reference(q, torch.bfloat16).forward(t, 0, last_only=False)
    assert (c - b32).abs().max() <= 2.5 * (b16 - b32).abs().max() + 0.01 * b32.abs().max()
    ref = load(str(l4), max_model_len=64)
    ref.model.fast = None
    for lin in ref.model.lin.values():
        lin.c = None  # the torch path: dequantize with a gather, dense GEMMs
    tf = ref.model.forward(t, 0, last_only=False)
    assert ((tf - b32).abs().max() <= 2.5 * (b16 - b32).abs().max() + 0.01 * b32.abs().max())


def test_gptq_lut4_conversion_and_refusals(tmp_path):
    src = make_llama(tmp_path / "m", layers=2)
    out = tmp_path / "g"
    r = run_cli("spark-convert", src, out, "--kind", "lut4", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["method"] == "gptq" and any(k.endswith("/lut4") for k in s["group_sizes"])
    assert Artifact.open(out).verify() is None
    bad = run_cli("spark-convert", src, tmp_path / "n", "--kind", "lut4", "--target", "avx2")
    assert bad.returncode == 2 and "--target rows32" in bad.stderr and not (tmp_path / "n").exists()
    bad = run_cli("spark-convert", src, tmp_path / "n", "--kind", "lut5")
    assert bad.returncode == 2 and "--kind" in bad.stderr
    # a lut4 linear claimed by a torch-layout artifact is refused at open
    m = json.loads((out / "sparkq.json").read_text())
    m["layout"] = "avx2"
    (out / "sparkq.json").write_text(json.dumps(m))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["layout"] = "avx2"
    (out / "config.json").write_text(json.dumps(cfg))
    r = run_cli("sparkq", "inspect", out)
    assert r.returncode == 2 and ("lut4" in r.stderr or "header metadata" in r.stderr), r.stderr
