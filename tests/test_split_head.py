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
        screen, got, top = _screen_and_refined(sess, xn)
        changed = np.nonzero(got != screen)[0]
        assert set(changed) <= set(top) and len(changed) > 0.99 * REFINE_SPLIT
        # the refined values against the stored weight in float64
        stored = _stored_numpy(m.tensors, VOCAB, m.spec.hidden)
        ref = stored[top] @ xn.astype(np.float64)
        np.testing.assert_allclose(got[top], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def _screen_and_refined(sess, xn):
    """sq_head's logits with the refinement off and on, and the REFINE_SPLIT largest of the first."""
    sess.m.refine_top = 0
    screen = sess.head(xn).copy()
    sess.m.refine_top = REFINE_SPLIT
    got = sess.head(xn).copy()
    return screen, got, np.argsort(-screen, kind="stable")[:REFINE_SPLIT]


def _codes(b, rows, k):
    b = b.reshape(rows, k // 32, 16)
    return np.concatenate([b & 15, b >> 4], axis=2).reshape(rows, k).astype(np.float64)


def _bf16(a):
    return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _first_numpy(t, n, k):
    """The first plane of a rows32 split head from the mapped numpy arrays (float64)."""
    sz = _bf16(t["lm_head.scales_zeros"])  # [K/g, N, 2]
    g = k // sz.shape[0]
    return (_codes(t["lm_head.qweight"], n, k) - 8) * sz[..., 0].T.repeat(g, 1) + sz[..., 1].T.repeat(g, 1)


def _stored_numpy(t, n, k):
    """The stored weight of a rows32 split head (float64): the first plane, plus the second on
    every row, or on the rows residual_map names (a partial split)."""
    out = _first_numpy(t, n, k)
    mp = t.get("lm_head.residual_map")
    mp = np.arange(n) if mp is None else np.asarray(mp)
    m = t["lm_head.residual"].shape[0]
    rs = _bf16(t["lm_head.residual_scales"])
    cov = mp >= 0
    out[cov] += ((_codes(t["lm_head.residual"], m, k) - 8) * rs.repeat(k // rs.shape[1], 1))[mp[cov]]
    return out


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_runtimes_agree_and_decode_reads_one_plane(split_pair, kernel_build):
    """Greedy tokens of the torch runtime (C step) and the lite one are the same; the torch-only
    path (no C core) agrees on the first token; bench's bytes per token count the first plane
    in full and the second for the refined rows only."""
    from sparkq.runtime import load
    from sparkq.runtime import lite
    from sparkq.runtime.measure.bench import decode_bytes_per_token
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


# ---- a partial split (--head-rows, and the budget's partial candidates): the second plane on
# the rows of the most probable tokens only, found through residual_map

SHARE = 0.25


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    d = tmp_path_factory.mktemp("partial")
    src = make_llama(d / "src", vocab=VOCAB, seed=3)
    convert(str(src), str(d / "p"), Options(progress=False, method="gptq", head="split", head_rows=SHARE,
                                            calib_tokens=1024))
    return src, d / "p"


def test_partial_split_format(partial):
    from sparkq.convert.headrows import share_rows
    src, p = partial
    a = Artifact.open(p)
    lin = a.linears["lm_head"]
    m = share_rows(SHARE, VOCAB)
    assert lin.residual and lin.residual_rows == m == VOCAB // 4
    assert "residual on 25.0% of rows" in lin.encoding
    assert a.infos["lm_head.residual"].shape == (m, lin.k // 2)
    assert a.infos["lm_head.residual_scales"].shape == (m, lin.k // lin.group_size)
    assert a.infos["lm_head.residual_map"].dtype == "I32" and a.infos["lm_head.residual_map"].shape == (VOCAB,)
    t = a.map_numpy()
    mp = t["lm_head.residual_map"]
    covered = np.flatnonzero(mp >= 0)
    assert len(covered) == m and np.array_equal(mp[covered], np.arange(m))
    # the covered rows are the most probable next tokens on the calibration text: against the
    # source model's own mean probabilities (transformers, fp32; the conversion's forward runs
    # through the quantized layers, so a few rows near the cut may differ; chance: 25%)
    import transformers
    from sparkq.convert.calib import calibration_ids
    from sparkq.convert.source import open_source
    ids, _ = calibration_ids(open_source(str(src)), None, 1024)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        prob = ref(ids).logits.softmax(-1).mean((0, 1)).numpy()
    want = np.argsort(-prob)[:m]
    assert np.isin(want, covered).mean() > 0.9
    # stored weight: both planes on covered rows, the first plane alone elsewhere
    w = _source_head(src)
    stored = _stored_numpy(t, VOCAB, lin.k)
    first = _first_numpy(t, VOCAB, lin.k)
    assert np.array_equal(stored[mp < 0], first[mp < 0])
    e_cov = np.abs(stored[covered] - w[covered].double().numpy()).mean()
    e_first = np.abs(first[covered] - w[covered].double().numpy()).mean()
    assert e_cov < e_first / 6  # ~4 more bits (GPTQ first plane: 7.9x here)
    rel = np.linalg.norm(stored - w.double().numpy()) / np.linalg.norm(w.double().numpy())
    assert abs(a.manifest.linears["lm_head"].rel_error - rel) < 1e-4


def test_partial_split_torch_rows_and_refinement(partial):
    from sparkq.runtime import load
    _, p = partial
    m = load(str(p), max_model_len=64)
    head = m.model.head
    assert head.rmap is not None
    stored = torch.from_numpy(_stored_numpy(Artifact.open(p).map_numpy(), VOCAB, head.k))
    ids = torch.arange(VOCAB)
    assert torch.allclose(head.rows(ids, torch.float32).double(), stored, atol=1e-6)
    assert torch.equal(m.model.embedding.embed(ids[:300]), head.rows(ids[:300]))
    x = torch.randn(6, m.model.spec.hidden, generator=torch.Generator().manual_seed(0))
    exact = (x.double() @ stored.T)
    for rows in (x[:2], x):  # the gather path and the dense one
        screen = head(rows.contiguous(), out_dtype=torch.float32)
        got = m.model._head(rows.contiguous())
        for t_ in range(len(rows)):
            top = screen[t_].topk(REFINE_SPLIT).indices
            assert torch.allclose(got[t_, top].double(), exact[t_, top], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_partial_split_c_core(partial, kernel_build):
    """sq_head refines the REFINE_SPLIT largest first-plane logits to the stored weight (second
    plane where the map has it, the first alone elsewhere); the lite and torch runtimes decode
    the same tokens; the torch-only path (torch embedding, torch refinement) the same first one."""
    from sparkq.runtime import load
    from sparkq.runtime.lite import load as load_lite
    _, p = partial
    m = load_lite(str(p), max_model_len=64)
    sess = m.session
    assert sess.m.head.rmap and sess.m.refine_top == REFINE_SPLIT
    stored = _stored_numpy(m.tensors, VOCAB, m.spec.hidden)
    rng = np.random.default_rng(1)
    for _ in range(3):
        xn = rng.standard_normal(m.spec.hidden).astype(np.float32)
        _, got, top = _screen_and_refined(sess, xn)
        ref = stored[top] @ xn.astype(np.float64)
        np.testing.assert_allclose(got[top], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        covered = np.asarray(m.tensors["lm_head.residual_map"])[top] >= 0
        assert covered.any() and (~covered).any()  # both kinds of rows were refined
    ids = [5, 17, 300, 2001, 9, 44]
    a = load(str(p), max_model_len=64)
    ta = list(a.stream_ids(ids, max_new_tokens=12, stop_ids=[]))
    assert ta == list(m.stream_ids(ids, max_new_tokens=12, stop_ids=[]))
    a.model.fast = None
    assert int(a.model.forward(torch.tensor(ids), 0)[0].argmax()) == ta[0]


def test_partial_split_map_is_checked(partial, tmp_path):
    """A row map that points outside the planes (or names a row twice) is refused at load,
    before any kernel indexes with it; so is --head-rows where it cannot apply."""
    import struct
    from sparkq.convert.errors import ConvertError
    from sparkq.runtime.errors import RuntimeUserError
    _, p = partial
    for bad_value in (VOCAB, -2, 0):
        bad = tmp_path / f"bad{bad_value}"
        shutil.copytree(p, bad)
        f = bad / "model.sparkq.safetensors"
        raw = bytearray(f.read_bytes())
        hlen = struct.unpack("<Q", raw[:8])[0]
        a0, _ = json.loads(raw[8:8 + hlen])["lm_head.residual_map"]["data_offsets"]
        mp = np.frombuffer(raw, dtype=np.int32, count=VOCAB, offset=8 + hlen + a0).copy()
        i = int(np.flatnonzero(mp >= 0)[-1])  # the last covered row: 0 repeats the first row's index
        mp[i] = bad_value
        raw[8 + hlen + a0: 8 + hlen + a0 + 4 * VOCAB] = mp.tobytes()
        f.write_bytes(bytes(raw))
        art = Artifact.open(bad)
        for m in (art.map, art.map_numpy):
            with pytest.raises(ArtifactError, match="residual_map.*re-convert"):
                m()
    from sparkq.runtime.lite import load as load_lite
    with pytest.raises((ArtifactError, RuntimeUserError), match="residual_map"):
        load_lite(str(tmp_path / "bad0"), max_model_len=64)
    src = partial[0]
    for kw, msg in ((dict(head="int4", head_rows=0.5), "--head split"), (dict(head="split", head_rows=1.5), "share"),
                    (dict(head="split", head_rows=0.5, method="minmax"), "calibration")):
        with pytest.raises(ConvertError, match=msg):
            convert(str(src), str(tmp_path / "x"), Options(progress=False, **{"method": "gptq", **kw}))
