"""The batched decode step's opt-in products on int8 tiles (csrc/gemv_tiles.c, `sparkq serve
--batch-tiles`): the kernel over the tile model on every build against the arithmetic its header
defines (numpy, bit for bit), the amx build's hardware tiles and AVX512 packing against the model,
and the step: batch invariance within the mode, the default products below its threshold."""
import ctypes
import json

import numpy as np
import pytest
import torch

from helpers import kernel_builds, make_chat_llama, run_cli
from test_amx import AMX, _linear

K_ = pytest.importorskip("sparkq.runtime.core")
if K_.compiler() is None:
    pytest.skip("no C compiler on this machine", allow_module_level=True)

Q = 16383  # csrc/gemv_tiles.c A16_Q


def _codes(cl, n, k):
    q = cl.q.numpy().reshape(n, k // 32, 16).astype(np.int64)
    c = np.empty((n, k // 32, 32), np.int64)
    c[:, :, :16], c[:, :, 16:] = q & 15, q >> 4
    return c.reshape(n, k)


def _reference(cl, kind, n, k, g, x):
    """y = W x as the header defines it: per token and group 15-bit codes of one scale, exact
    integer sums, then fp32 fma over the groups in order (numpy; fp64 then one rounding = fma)"""
    codes = _codes(cl, n, k)
    a = cl.lut.numpy().astype(np.int64)[np.arange(n)[:, None], codes] + 128 if kind == "lut4" else codes
    off = 128 if kind == "lut4" else 8
    sz = cl.sz.float().numpy()
    y = np.empty((x.shape[0], n), np.float32)
    for t in range(x.shape[0]):
        acc, zt = np.zeros(n, np.float32), np.zeros(n, np.float32)
        for gi in range(k // g):
            xg = x[t, gi * g:(gi + 1) * g].astype(np.float32)
            amax = np.float32(np.abs(xg).max())
            lanes = np.zeros(16, np.float32)
            for j, v in enumerate(xg):
                lanes[j % 16] = np.float32(lanes[j % 16] + v)
            for h in (8, 4, 2, 1):
                lanes[:h] = (lanes[:h] + lanes[h:2 * h]).astype(np.float32)
            inv = np.float32(Q) / amax if amax > 0 else np.float32(0)
            q = np.clip(np.rint((xg * inv).astype(np.float32)), -Q, Q).astype(np.int64)
            S = a[:, gi * g:(gi + 1) * g] @ q - off * q.sum()
            sc = (sz[gi, :, 0] * np.float32(amax / np.float32(Q))).astype(np.float32)
            acc = (S.astype(np.float32).astype(np.float64) * sc + acc).astype(np.float32)
            zt = (sz[gi, :, 1].astype(np.float64) * lanes[0] + zt).astype(np.float32)
        y[t] = acc + zt
    return y


# (N, K, G, M): row tails (33, 40, 48, 80 rows: a 32-row block and a part one), every group kind
# (32: 32-column tiles; 64..256), one token to nine token blocks of 8 (two passes over the weights)
SHAPES = [(64, 256, 64, 3), (48, 128, 32, 17), (80, 384, 128, 1), (96, 512, 256, 8), (33, 1024, 256, 9), (40, 128, 64, 70)]


def _a16(lib, L, x, hw):
    y = torch.full((x.shape[0], L.n), float("nan"))
    assert lib.sq_linear_a16(ctypes.byref(L), x.data_ptr(), x.shape[0], y.data_ptr(), hw) == 0
    return y


@pytest.mark.parametrize("build", kernel_builds())
@pytest.mark.parametrize("kind", ["int4", "lut4"])
def test_tile_products_over_the_model_are_the_defined_arithmetic(build, kind):
    """Over the tile model, on every build: the header's arithmetic bit for bit (the B-tile order,
    the 32-row blocks and row tails, the hi/lo halves, the int4 -8 and lut4 +128 offsets, group
    sums in their lane order); the product's error against fp64 is a tenth of the W4A8 products'
    here (15-bit activations; with an outlier channel 30x the others: `-s` prints both)."""
    lib = K_.load(build)
    for i, (n, k, g, m) in enumerate(SHAPES):
        L, w, cl = _linear(lib, kind, n, k, g, i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i))
        x[:, 5] *= 30
        y = _a16(lib, L, x, 0)
        assert np.array_equal(y.numpy(), _reference(cl, kind, n, k, g, x.numpy())), (n, k, g, m)
        exact = x.double() @ w.double().T
        err = float((y.double() - exact).abs().max() / exact.abs().max())
        assert err < 1e-3, (n, k, g, m, err)
        if m < max(lib.sq_w4a16_min_m(), 1) or lib.sq_w4a16_min_m() == 0:  # this build's W4A8 products
            ya8 = torch.empty(m, n)
            assert lib.sq_linear_batch(ctypes.byref(L), x.data_ptr(), 0, m, ya8.data_ptr(), None) == 0
            err8 = float((ya8.double() - exact).abs().max() / exact.abs().max())
            print(f"{build} {kind} N={n} K={k} g{g} M={m}: tiles {err:.1e}, W4A8 {err8:.1e} of the largest output")
            assert err * 3 < err8
    from sparkq.formats import constants as C

    i8 = K_.CLinear(C.KIND_INT8, 16, 64, 0, torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, dtype=torch.bfloat16))
    Lb = K_.linear_struct(lib, i8)
    assert lib.sq_linear_a16(ctypes.byref(Lb), x.data_ptr(), 1, y.data_ptr(), 0) == -2  # int8 rows: not this path
    if build != "amx":
        assert lib.sq_batch_tiles(16, 1) == -3 and lib.sq_linear_a16(ctypes.byref(L), x.data_ptr(), 1, y.data_ptr(), 1) == -3


@pytest.mark.parametrize("build", AMX)
@pytest.mark.parametrize("kind", ["int4", "lut4"])
def test_tile_products_on_amx_are_the_models(build, kind):
    """The amx build: the hardware tiles (AVX512 staging, packing, epilogue) give the model's bits,
    and the model in the amx build (AVX512 packing) another build's (portable packing)."""
    lib, other = K_.load(build), K_.load("avx512-bf16")
    for i, (n, k, g, m) in enumerate(SHAPES):
        L, _, cl = _linear(lib, kind, n, k, g, i)
        Lo, _, _ = _linear(other, kind, n, k, g, i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i))
        y = _a16(lib, L, x, 1)
        assert torch.equal(y, _a16(lib, L, x, 0)), (n, k, g, m)
        assert torch.equal(y, _a16(other, Lo, x, 0)), (n, k, g, m)


@pytest.fixture(scope="module")
def tile_arts(tmp_path_factory):
    """a tiny chat model as int4 g64 + split head and as lut4 g32 + int8 head"""
    from sparkq.convert.pipeline import Options, convert

    d = tmp_path_factory.mktemp("tiles")
    src = make_chat_llama(d / "m", layers=2, seed=5)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 256}))
    out = {}
    for name, o in {"int4-g64-split": Options(progress=False, method="minmax", kind="int4", group_size=64, head="split"),
                    "lut4-g32-int8head": Options(progress=False, method="minmax", kind="lut4", group_size=32,
                                                 head="int8")}.items():
        convert(str(src), str(d / name), o)
        out[name] = d / name
    return out


PROMPTS = ["hello there", "the quick brown fox", "a", "0123456789" * 3]


@pytest.mark.parametrize("variant", ["int4-g64-split", "lut4-g32-int8head"])
@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_step_many_on_tiles_is_batch_invariant_within_the_mode(tile_arts, variant, kernel_build):
    """With the tile products from 2 sequences on (the model off AMX): a sequence's logits are the
    same bits in any company of 2 or more; they differ from the default products' (the path ran)
    by at most the W4A8 error; a lone sequence (below the threshold) keeps the single step's bits."""
    from sparkq.runtime.lite import load

    art = tile_arts[variant]
    batch = load(str(art), max_model_len=128, kv_budget_mib=8, threads=2, slots=4)
    single = load(str(art), max_model_len=128, kv_budget_mib=8, threads=2, slots=1)
    s, tok = batch.session, batch.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    offs = [i * batch.slot_elems for i in range(4)]
    for i, p in enumerate(ids):
        s.prefill(p, 0, kvoff=offs[i])
    nxt, pos = [7, 8, 9, 10], [len(p) for p in ids]
    default = s.step_many(nxt, pos, offs)
    s.set_batch_tiles(2, model=kernel_build != "amx")
    tiles = s.step_many(nxt, pos, offs)
    for sub in ([1, 0], [3, 2, 0], [2, 3]):
        assert np.array_equal(s.step_many([nxt[i] for i in sub], [pos[i] for i in sub], [offs[i] for i in sub]),
                              tiles[sub]), sub
    assert not np.array_equal(tiles, default)
    assert float(np.abs(tiles - default).max()) < 0.02 * float(np.abs(default).max())
    single.prefill(ids[2])
    assert np.array_equal(s.step_many([nxt[2]], [pos[2]], [offs[2]])[0], single.step(nxt[2], pos[2]))
    s.set_batch_tiles(0)
    assert np.array_equal(s.step_many(nxt, pos, offs), default)
    if kernel_build != "amx":
        from sparkq.runtime.errors import RuntimeUserError

        with pytest.raises(RuntimeUserError, match="need AMX tiles"):
            s.set_batch_tiles(16)


def test_serve_batch_tiles_without_amx_is_one_line_exit_2(tile_arts):
    """`sparkq serve --batch-tiles` where the build has no tiles (here the portable build, on any
    CPU): one line naming the need and the fix, exit 2, before serving."""
    r = run_cli("sparkq", "serve", str(tile_arts["int4-g64-split"]), "--port", "0", "--batch-tiles",
                env={"SPARKQ_KERNEL": "scalar"}, timeout=120)
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and "need AMX tiles" in err[0] and "SPARKQ_KERNEL=amx" in err[0], r.stderr
