"""The split head (`--head split`, formats/constants.py): an int4 plane that the decode step's
head product reads, a 4-bit residual plane that the refinement of the top logits and the
embedding add."""
import json
import shutil

import numpy as np
import pytest
import torch

from helpers import kernel_builds, make_llama
from sparkq.convert.pipeline import Options, convert
from sparkq.formats.artifact import Artifact, ArtifactError
from sparkq.formats.layout import dequantize_codes, unpack
from sparkq.runtime.common import REFINE_SPLIT

VOCAB = 4096  # > REFINE_SPLIT: the selection of the refined rows matters


@pytest.fixture(scope="module")
def split_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    src = make_llama(d / "src", vocab=VOCAB, seed=3)
    convert(str(src), str(d / "split"), Options(progress=False, method="minmax", head="split"))
    convert(str(src), str(d / "int4"), Options(progress=False, method="minmax", head="int4"))
    return src, d / "split", d / "int4"


def _source_head(src) -> torch.Tensor:
    from safetensors.torch import load_file
    return load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"].float()


def test_format_planes_and_reconstruction(split_pair):
    src, sp, i4 = split_pair
    assert REFINE_SPLIT < VOCAB
    a, b = Artifact.open(sp), Artifact.open(i4)
    lin = a.linears["lm_head"]
    assert lin.kind == "int4" and lin.residual and not b.linears["lm_head"].residual
    n, k, g = lin.n, lin.k, lin.group_size
    assert a.infos["lm_head.residual"].dtype == "U8" and a.infos["lm_head.residual"].shape == (n, k // 2)
    assert a.infos["lm_head.residual_scales"].dtype == "BF16" and a.infos["lm_head.residual_scales"].shape == (n, k // g)
    assert a.summary()["group_sizes"].get(f"g{g}+residual") == 1
    ta, tb = a.map(), b.map()
    # the first plane is exactly the int4 head of the same method
    for t in ("lm_head.qweight", "lm_head.scales_zeros"):
        assert torch.equal(ta[t].view(torch.uint8), tb[t].view(torch.uint8))
    # stored weight = first plane + (r - 8) * rscale, within half a residual step of the source
    w = _source_head(src)
    first = dequantize_codes(unpack(ta["lm_head.qweight"], a.layout, n, k), ta["lm_head.scales_zeros"], g, torch.float32)
    r = unpack(ta["lm_head.residual"], "rows32", n, k).float().view(n, k // g, g)
    rs = ta["lm_head.residual_scales"].float()
    stored = first + ((r - 8) * rs[..., None]).view(n, k)
    step = rs.repeat_interleave(g, 1)
    assert ((stored - w).abs() <= 0.5 * step + 1e-6 * w.abs().max()).all()
    err_split, err_first = (stored - w).norm() / w.norm(), (first - w).norm() / w.norm()
    assert err_split < err_first / 8  # ~4 more bits
    assert abs(a.manifest.linears["lm_head"].rel_error - float(err_split)) < 1e-4
    # a manifest that drops the flag leaves the second plane unexpected: refused
    bad = sp.parent / "bad"
    shutil.copytree(sp, bad)
    m = json.loads((bad / "sparkq.json").read_text())
    del m["linears"]["lm_head"]["residual"]
    (bad / "sparkq.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="unexpected tensor 'lm_head.residual"):
        Artifact.open(bad)


def test_torch_runtime_refines_the_top_logits(split_pair):
    """Model._head: the head product (first plane), then exactly its REFINE_SPLIT largest
    logits replaced by the stored weight's fp32 dot, whether the rows are gathered (few
    positions) or every logit is computed (many)."""
    from sparkq.runtime import load
    src, sp, _ = split_pair
    m = load(str(sp), max_model_len=64)
    head = m.model.head
    x = torch.randn(6, m.model.spec.hidden, generator=torch.Generator().manual_seed(0))
    exact = x @ head.rows(torch.arange(head.n), torch.float32).T
    for rows in (x[:2], x):  # the gather path (<= 4 rows) and the dense one
        screen = head(rows.contiguous(), out_dtype=torch.float32)
        got = m.model._head(rows.contiguous())
        for t in range(len(rows)):
            top = screen[t].topk(REFINE_SPLIT).indices
            changed = torch.nonzero(got[t] != screen[t]).flatten()
            assert set(changed.tolist()) <= set(top.tolist()) and len(changed) > 0.99 * REFINE_SPLIT
            assert torch.allclose(got[t, top], exact[t, top], rtol=1e-5, atol=1e-5)
    # embedding rows carry both planes
    ids = torch.tensor([0, 7, 4095])
    assert torch.equal(m.model.embedding.embed(ids), m.model.head.rows(ids))
    assert not torch.equal(m.model.head.rows(ids, torch.float32),
                           dequantize_codes(unpack(m.model.head.qweight, m.model.head.layout, VOCAB, m.model.head.k),
                                            m.model.head.scales_zeros, m.model.head.g, torch.float32)[ids])


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_c_core_selects_exactly_the_top_k_and_refines_them(split_pair, kernel_build):
    """sq_head with the refinement off gives the first plane's logits (W4A8); with it on,
    exactly the REFINE_SPLIT largest of those change, to the stored weight's fp32 dot."""
    from sparkq.runtime.lite import load
    _, sp, _ = split_pair
    m = load(str(sp), max_model_len=64)
    sess = m.session
    head = sess.m.head
    assert sess.m.refine_top == REFINE_SPLIT and head.res and head.rsc
    rng = np.random.default_rng(1)
    for trial in range(3):
        xn = rng.standard_normal(m.spec.hidden).astype(np.float32)
        sess.m.refine_top = 0
        screen = sess.head(xn).copy()
        sess.m.refine_top = REFINE_SPLIT
        got = sess.head(xn).copy()
        top = np.argsort(-screen, kind="stable")[:REFINE_SPLIT]
        changed = np.nonzero(got != screen)[0]
        assert set(changed) <= set(top) and len(changed) > 0.99 * REFINE_SPLIT
        # the refined values against the stored weight in float64
        stored = _stored_numpy(m.tensors, VOCAB, m.spec.hidden)
        ref = stored[top] @ xn.astype(np.float64)
        np.testing.assert_allclose(got[top], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def _stored_numpy(t, n, k):
    """The stored weight of a rows32 split head from the mapped numpy arrays (float64)."""
    sz = t["lm_head.scales_zeros"].view(np.uint16).astype(np.uint32) << 16
    sz = sz.view(np.float32).astype(np.float64)  # [K/g, N, 2]
    g = k // sz.shape[0]

    def codes(b):
        b = b.reshape(n, k // 32, 16)
        return np.concatenate([b & 15, b >> 4], axis=2).reshape(n, k).astype(np.float64)
    q, r = codes(t["lm_head.qweight"]), codes(t["lm_head.residual"])
    rs = (t["lm_head.residual_scales"].view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    s, z = sz[..., 0].T.repeat(g, 1), sz[..., 1].T.repeat(g, 1)
    return (q - 8) * s + z + (r - 8) * rs.repeat(g, 1)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_runtimes_agree_and_decode_reads_one_plane(split_pair, kernel_build):
    """Greedy tokens of the torch runtime (C step) and the lite one are the same; the torch-only
    path (no C core) agrees on the first token; bench's bytes per token count the first plane
    in full and the second for the refined rows only."""
    from sparkq.runtime import load
    from sparkq.runtime import lite
    from sparkq.runtime.bench import decode_bytes_per_token
    _, sp, i4 = split_pair
    ids = [5, 17, 300, 2001, 9, 44]
    a = load(str(sp), max_model_len=64)
    b = lite.load(str(sp), max_model_len=64)
    ta = list(a.stream_ids(ids, max_new_tokens=12, stop_ids=[]))
    assert ta == list(b.stream_ids(ids, max_new_tokens=12, stop_ids=[]))
    ref = load(str(sp), max_model_len=64)
    ref.model.fast = None  # torch only: torch embedding (both planes), torch head + _refine_split
    assert int(ref.model.forward(torch.tensor(ids), 0)[0].argmax()) == ta[0]
    art = Artifact.open(sp)
    res = art.infos["lm_head.residual"].nbytes + art.infos["lm_head.residual_scales"].nbytes
    bpt = decode_bytes_per_token(a)
    total = sum(i.nbytes for n, i in art.infos.items() if not n.startswith("_pad"))
    assert bpt == total - res + res * REFINE_SPLIT // VOCAB
    assert bpt == decode_bytes_per_token(load(str(i4), max_model_len=64)) + res * REFINE_SPLIT // VOCAB


def test_untied_embedding_is_split_too(tmp_path):
    src = make_llama(tmp_path / "untied", vocab=320, tied=False, seed=4)
    convert(str(src), str(tmp_path / "u"), Options(progress=False, method="minmax", head="split"))
    art = Artifact.open(tmp_path / "u")
    assert art.linears["embed"].residual and art.linears["lm_head"].residual
