"""Qwen3.5 GGUF input (llama.cpp's ``qwen35`` architecture, convert/gguf_source.py): a tiny
make_hybrid checkpoint with 2 key heads and 4 or 6 value heads (llama.cpp's value-head reorder
applies; with 6 it is not its own inverse) or 2 (none), written as llama.cpp's converter writes it
(tests/ggufwrite.py: 1 + w norms, -exp(A_log), the squeezed conv, value heads tiled, a
multi-token-prediction block), reads back as the checkpoint's tensors, converts to the
checkpoint's artifact, imports to a checkpoint transformers runs; transformers' own GGUF loader
reads the file as the checkpoint (the writer is llama.cpp's layout, not just sparkq's inverse of
itself); the mixture-of-experts architectures are refused by name."""
import json

import numpy as np
import pytest
import torch

from ggufwrite import write_gguf
from helpers import make_hybrid
from sparkq.convert.errors import ConvertError
from sparkq.convert.pipeline import Options, convert
from sparkq.convert.source import open_source
from sparkq.formats import Artifact
from sparkq.formats import constants as C
from sparkq.formats.recipe import recipe_for_config
from sparkq.formats.spec import ModelSpec
from sparkq.formats.tensorfile import read_header

SEQ = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3)).tolist()
# key scaling off: it measures keys on calibration text, which the test writer's vocabulary (merges
# added) tokenizes differently from the checkpoint's byte tokenizer (as in tests/test_gguf.py)
OPTS = Options(progress=False, method="minmax", key_scaling=False)


@pytest.fixture(scope="module", params=[4, 6, 2], ids=["v4", "v6", "v2"])
def q35(tmp_path_factory, request):
    """(dir, checkpoint, {qtype: gguf}): F32 with one MTP block after the decoder's, BF16 without;
    2 key heads, request.param value heads."""
    d = tmp_path_factory.mktemp("q35gguf")
    src = make_hybrid(d / "q35", "qwen3_5", linear_num_value_heads=request.param)
    return d, src, {"F32": write_gguf(src, d / "q35-F32.gguf", "F32", mtp=1),
                    "BF16": write_gguf(src, d / "q35-BF16.gguf", "BF16")}


def _all(source, name):
    return source.read_rows(name, 0, source.shapes[name][0])


@pytest.mark.parametrize("qtype", ["F32", "BF16"])
def test_gguf_tensors_are_the_checkpoints(q35, qtype):
    """Every tensor (the q_proj views and every DeltaNet parameter included) read through the GGUF
    source equals the checkpoint's (A_log within fp32 rounding: the file holds -exp(A_log)), read
    whole or in row slices across the value heads' runs; the MTP block is dropped; the rebuilt
    config gives the checkpoint's ModelSpec."""
    _, src, ggufs = q35
    a, b = open_source(str(src)), open_source(str(ggufs[qtype]))
    try:
        assert a.shapes == b.shapes
        assert any(n.endswith(":gate") for n in b.shapes) and not any(".layers.4." in n for n in b.shapes)
        for n in sorted(a.shapes):
            x, y = _all(a, n), _all(b, n)
            if n.endswith("A_log"):
                torch.testing.assert_close(y, x, rtol=0, atol=5e-7)  # (log of exp: fp32 ulps)
                assert b.read_rows(n, 0, 1).dtype == torch.float32
            else:
                assert torch.equal(x, y), n
            rows = a.shapes[n][0]
            if rows > 1:  # slices that cut value heads
                parts = torch.cat([b.read_rows(n, r, min(rows, r + 7)) for r in range(0, rows, 7)])
                assert torch.equal(parts, y), n
        ra, rb = recipe_for_config(a.config), recipe_for_config(b.config)
        assert ra.family == rb.family == "qwen3_5"
        sa, sb = ModelSpec.from_recipe(a.config, ra), ModelSpec.from_recipe(b.config, rb)
        assert sa.mixers == sb.mixers and sa.gdn == sb.gdn and sa.layers == sb.layers == 4
        assert sa.rope_by_type == sb.rope_by_type and sa.attn_gate == sb.attn_gate
    finally:
        a.close()
        b.close()


def test_gguf_layout_is_reordered(q35):
    """The file really holds llama.cpp's transforms (the tests above are not an identity): value
    rows of attn_qkv tiled, ssm_a = -exp(A_log), norms 1 + w except ssm_norm."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    _, src, ggufs = q35
    hf = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    t = {x.name: np.asarray(x.data) for x in GGUFReader(str(ggufs["F32"])).tensors}
    cfg = json.loads((src / "config.json").read_text())
    qk, dv = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qkv = hf["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert np.array_equal(t["blk.0.attn_qkv.weight"][:qk], qkv[:qk])
    r = cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    # tiled value head 1 is key head 1's first (grouped head r)
    assert np.array_equal(t["blk.0.attn_qkv.weight"][qk + dv:qk + 2 * dv], qkv[qk + r * dv:qk + (r + 1) * dv])
    tiled = [g * r + j for j in range(r) for g in range(2)]
    assert np.allclose(t["blk.0.ssm_a"], -np.exp(hf["model.layers.0.linear_attn.A_log"][tiled]))
    assert t["blk.0.ssm_conv1d.weight"].shape == (qkv.shape[0], cfg["linear_conv_kernel_dim"])
    assert np.array_equal(t["blk.3.attn_q_norm.weight"], hf["model.layers.3.self_attn.q_norm.weight"] + 1)
    assert np.array_equal(t["blk.0.ssm_norm.weight"], hf["model.layers.0.linear_attn.norm.weight"])
    assert "blk.4.nextn.eh_proj.weight" in t


def _logits(path):
    from sparkq.runtime import load
    m = load(str(path), max_model_len=64, kv_dtype="bf16")
    with torch.no_grad():
        return m.model.forward(torch.tensor(SEQ), 0, last_only=False).float()


def test_gguf_converts_and_imports_as_the_checkpoint(q35):
    """spark-convert of the GGUF gives the checkpoint's artifact (every tensor's bytes, A_log's to
    fp32 rounding) and its logits; `sparkq import-gguf` gives a checkpoint (the DeltaNet parameters
    fp32) that converts to the same bytes as the GGUF and that transformers runs as the original,
    with transformers' tokenization of the GGUF's vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tokenizers import Tokenizer

    from sparkq.convert.gguf_source import import_gguf

    d, src, ggufs = q35
    gg = ggufs["BF16"]
    convert(str(src), str(d / "st"), OPTS)
    convert(str(gg), str(d / "gg"), OPTS)
    a, b = Artifact.open(d / "st"), Artifact.open(d / "gg")
    assert {n: lin.encoding for n, lin in a.linears.items()} == {n: lin.encoding for n, lin in b.linears.items()}
    ha, _ = read_header(str(a.weights_path))
    hb, _ = read_header(str(b.weights_path))
    assert ha.keys() == hb.keys()
    ba, bb = a.weights_path.read_bytes(), b.weights_path.read_bytes()
    raw = lambda buf, i: buf[i.start:i.start + i.nbytes]  # noqa: E731
    differ = [n for n in ha if raw(ba, ha[n]) != raw(bb, hb[n])]
    assert all(n.endswith(".a_log") for n in differ), differ
    for n in differ:
        x, y = (np.frombuffer(raw(buf, h[n]), np.float32) for buf, h in ((ba, ha), (bb, hb)))
        np.testing.assert_allclose(y, x, rtol=0, atol=5e-7)
    la, lb = _logits(d / "st"), _logits(d / "gg")
    assert (la - lb).abs().max() <= 1e-4 * la.abs().max(), (la - lb).abs().max()

    imp = d / "imported"
    import_gguf(str(gg), str(imp), progress=False)
    hi, _ = read_header(str(imp / "model.safetensors"))
    hf_names = read_header(str(src / "model.safetensors"), require_alignment=False)[0].keys()
    assert {n for n in hi if not n.startswith(C.PAD_PREFIX)} == set(hf_names)  # (the views are the reader's)
    assert {n: hi[f"model.layers.0.linear_attn.{n}"].dtype for n in ("A_log", "conv1d.weight", "in_proj_qkv.weight")} \
        == {"A_log": "F32", "conv1d.weight": "F32", "in_proj_qkv.weight": "BF16"}
    convert(str(imp), str(d / "imp-int4"), OPTS)
    assert Artifact.open(d / "imp-int4").weights_path.read_bytes() == bb
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits[0]
        got = AutoModelForCausalLM.from_pretrained(imp, dtype=torch.float32).eval()(ids).logits[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
    ref_tok = AutoTokenizer.from_pretrained(d, gguf_file=gg.name)
    ours = Tokenizer.from_file(str(imp / "tokenizer.json"))
    for text in ("The quick brown fox jumps over the lazy dog.", "  the  lazy\tdog 123 ", "über 北京 naïve"):
        assert ours.encode(text, add_special_tokens=False).ids == ref_tok(text, add_special_tokens=False)["input_ids"], text


def test_transformers_reads_the_gguf_as_the_checkpoint(q35):
    """transformers' qwen35 GGUF loader (its inverse of llama.cpp's converter) gives the
    checkpoint's weights and logits from the test writer's file, MTP block and all."""
    from transformers import AutoModelForCausalLM

    d, src, ggufs = q35
    ids = torch.tensor([SEQ])
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=ggufs["F32"].name, dtype=torch.float32).eval()
    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    sr, so = ref.state_dict(), orig.state_dict()
    assert sr.keys() == so.keys()
    for k in so:
        torch.testing.assert_close(sr[k], so[k], rtol=0, atol=5e-7, msg=k)
    with torch.no_grad():
        a, b = ref(ids).logits[0], orig(ids).logits[0]
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_moe_ggufs_are_refused_by_name(arch, tmp_path):
    from ggufwrite import write_moe_stub
    p = write_moe_stub(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ConvertError, match="mixture-of-experts"):
        open_source(str(p))


def test_gguf_of_the_multimodal_wrapper(tmp_path):
    """The published Qwen3_5ForConditionalGeneration checkpoint, as llama.cpp writes its text model
    (language_model. stripped, the vision tower to a separate mmproj file), reads back as that
    checkpoint's text model does."""
    src = make_hybrid(tmp_path / "vl", "qwen3_5_vl")
    a, b = open_source(str(src)), open_source(str(write_gguf(src, tmp_path / "vl.gguf", "BF16")))
    try:
        assert a.shapes == b.shapes and a.config["tie_word_embeddings"] == b.config["tie_word_embeddings"]
        for n in sorted(a.shapes):
            x, y = _all(a, n), _all(b, n)
            assert torch.equal(x, y) if not n.endswith("A_log") else torch.allclose(x, y, rtol=0, atol=5e-7), n
    finally:
        a.close()
        b.close()
