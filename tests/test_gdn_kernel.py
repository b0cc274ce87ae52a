"""The C core's Gated DeltaNet layer mixer (runtime/core/csrc/gdn.c) on every build this CPU runs.

sq_mix (T tokens of one sequence from their qkv and z | b | a products) against a float64 numpy
reference of /work/notes/gdn-spec.md §3 (`gdn_ref`, with the states carried in and out); T tokens in
one call against T calls of one token (the same bits, outputs and states); thread counts 1, 2, 3 (the
same bits); two slots (separate states). Then tiny models built directly as C structs (bf16 linears,
whose prompt products are the decode products row for row): sq_step against a float64 forward,
sq_prefill leaving the bits token-by-token decode leaves, and a hybrid model's batched step
(sq_step_many) giving each row the single step's bits.
"""
import ctypes
import os

import numpy as np
import pytest

from helpers import kernel_builds

K_ = pytest.importorskip("sparkq.runtime.core")
if K_.compiler() is None:
    pytest.skip("no C compiler on this machine", allow_module_level=True)

SHAPES = {  # Hk, Hv, dk, dv, K, beta_scale, gnorm eps
    "gqa": dict(Hk=2, Hv=4, dk=16, dv=24, K=4, beta=1.0, eps=1e-6),         # value head h reads key head h // 2
    "wide-negeig": dict(Hk=2, Hv=2, dk=20, dv=80, K=4, beta=2.0, eps=1e-5),  # Hk = Hv, 2 column blocks (tail 16), OLMo's beta
    "k2": dict(Hk=1, Hv=3, dk=8, dv=16, K=2, beta=1.0, eps=1e-6),           # a one-input conv state
}
SLOT = 1 * 4 * 8  # kv_heads * cap * head_dim of the kernel tests' model: one slot's element offset


def _lib(build):
    return K_.load(build)


def _silu(x):
    return x / (1 + np.exp(-x))


def gdn_ref(qkv, zba, conv_w, a_log, dt_bias, gnorm, conv0, S0, Hk, Hv, dk, dv, eps, beta):
    """gdn-spec.md §3 in float64 from the products (qkv [T, C], zba [T, Vd + 2 Hv]) and the states
    (conv0 [C, K - 1] oldest first, S0 [Hv, dk, dv]): (o [T, Vd] before out_proj, conv state, S)."""
    f = np.float64
    qkv, zba, conv_w = qkv.astype(f), zba.astype(f), conv_w.astype(f)
    T, C = qkv.shape
    K = conv_w.shape[1]
    Kd, Vd = Hk * dk, Hv * dv
    pad = np.concatenate([conv0.astype(f).T, qkv], 0)
    conv = _silu(np.stack([(pad[t:t + K] * conv_w.T).sum(0) for t in range(T)]))
    conv_out = pad[len(pad) - (K - 1):].T.copy()
    z, b, a = zba[:, :Vd], zba[:, Vd:Vd + Hv], zba[:, Vd + Hv:]
    q = conv[:, :Kd].reshape(T, Hk, dk)
    k = conv[:, Kd:2 * Kd].reshape(T, Hk, dk)
    v = conv[:, 2 * Kd:].reshape(T, Hv, dv)
    x = a + dt_bias.astype(f)
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    g = -np.exp(a_log.astype(f)) * sp
    bt = beta / (1 + np.exp(-b))
    r = Hv // Hk
    q, k = np.repeat(q, r, 1), np.repeat(k, r, 1)
    l2n = lambda u: u / np.sqrt((u * u).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = l2n(q) / np.sqrt(dk), l2n(k)
    S = S0.astype(f).copy()
    o = np.zeros((T, Hv, dv))
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hi,hij->hj", k[t], S)) * bt[t][:, None]
        S = S + np.einsum("hi,hj->hij", k[t], delta)
        o[t] = np.einsum("hi,hij->hj", q[t], S)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * gnorm.astype(f) * _silu(z.reshape(T, Hv, dv))
    return o.reshape(T, Vd), conv_out, S


class Gdn:
    """One GDN layer as C structs over numpy buffers, `slots` sequences' states."""

    def __init__(self, Hk, Hv, dk, dv, K, beta, eps, slots=1, seed=0):
        rng = np.random.default_rng(seed)
        self.Hk, self.Hv, self.dk, self.dv, self.K, self.beta, self.eps = Hk, Hv, dk, dv, K, beta, eps
        self.C, self.Vd = 2 * Hk * dk + Hv * dv, Hv * dv
        self.nz = self.Vd + 2 * Hv
        self.conv_w = (rng.standard_normal((self.C, K)) * 0.5).astype(np.float32)
        self.a_log = np.log(rng.uniform(0.1, 2.0, Hv)).astype(np.float32)
        self.dt_bias = (rng.standard_normal(Hv) * 0.5).astype(np.float32)
        self.gnorm = rng.uniform(0.5, 1.5, dv).astype(np.float32)
        self.conv = np.zeros((slots, self.C, K - 1), np.float32)
        self.rec = np.zeros((slots, Hv, dk, dv), np.float32)
        m = self.m = K_.SqModel()
        m.layers, m.heads, m.kv_heads, m.cap, m.head_dim = 1, 1, 1, 4, 8  # the slot stride: SLOT elements
        m.lin_k_heads, m.lin_v_heads, m.lin_k_dim, m.lin_v_dim, m.conv_k = Hk, Hv, dk, dv, K
        m.beta_scale, m.gnorm_eps = beta, eps
        L = self.L = K_.SqLayer()
        L.mixer = K_.abi.MIXERS["gdn"]
        L.conv_w, L.a_log, L.dt_bias, L.gnorm = (a.ctypes.data for a in (self.conv_w, self.a_log, self.dt_bias, self.gnorm))
        L.conv_state, L.rec_state = self.conv.ctypes.data, self.rec.ctypes.data
        m.layer = ctypes.pointer(L)

    def inputs(self, T, seed):
        rng = np.random.default_rng(seed)
        qkv = rng.standard_normal((T, self.C)).astype(np.float32)
        zba = rng.standard_normal((T, self.nz)).astype(np.float32)
        if T > 1:
            zba[1, self.Vd + self.Hv] = 25.0  # a + dt_bias > 20: softplus's linear branch
        return qkv, zba

    def mix(self, lib, qkv, zba, slot=0):
        out = np.full((qkv.shape[0], self.Vd), np.nan, np.float32)
        rc = lib.sq_mix(ctypes.byref(self.m), ctypes.byref(self.L), slot * SLOT, qkv.ctypes.data, zba.ctypes.data,
                            qkv.shape[0], out.ctypes.data)
        assert rc == 0
        return out

    def ref(self, qkv, zba, conv0, S0):
        return gdn_ref(qkv, zba, self.conv_w, self.a_log, self.dt_bias, self.gnorm, conv0, S0, self.Hk, self.Hv,
                       self.dk, self.dv, self.eps, self.beta)


def _close(got, want, rtol=5e-6):
    """fp32 against float64: each element within rtol of its value plus rtol of the array's scale"""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want) / (np.abs(want) + np.abs(want).max())
    assert np.isfinite(got).all() and err.max() < rtol, err.max()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("build", kernel_builds())
def test_gdn_mix_matches_the_fp64_reference(build, shape):
    """Two calls (5 tokens from zero states, then 7 more) against the reference over all 12: the
    outputs and both states carried between calls."""
    lib, g = _lib(build), Gdn(**SHAPES[shape])
    qkv, zba = g.inputs(12, seed=1)
    o1, o2 = g.mix(lib, qkv[:5].copy(), zba[:5].copy()), g.mix(lib, qkv[5:].copy(), zba[5:].copy())
    want, conv, S = g.ref(qkv, zba, np.zeros((g.C, g.K - 1)), np.zeros((g.Hv, g.dk, g.dv)))
    _close(np.concatenate([o1, o2]), want)
    _close(g.conv[0], conv, 1e-6)
    _close(g.rec[0], S)


@pytest.mark.parametrize("build", kernel_builds())
def test_gdn_mix_tokens_in_one_call_are_token_by_token_bit_for_bit(build):
    """The prompt's chunk (T tokens a call) and decode (one a call) leave the same bits: outputs and
    states, and so do other splits of the same tokens."""
    lib = _lib(build)
    for shape in SHAPES.values():
        runs = []
        for split in ([9], [1] * 9, [4, 5], [2, 6, 1]):
            g = Gdn(**shape)
            qkv, zba = g.inputs(9, seed=2)
            outs, t0 = [], 0
            for n in split:
                outs.append(g.mix(lib, qkv[t0:t0 + n].copy(), zba[t0:t0 + n].copy()))
                t0 += n
            runs.append((np.concatenate(outs), g.conv.copy(), g.rec.copy()))
        for r in runs[1:]:
            for a, b in zip(runs[0], r):
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("build", kernel_builds())
def test_gdn_mix_same_bits_at_any_thread_count(build):
    lib = _lib(build)
    try:
        for shape in SHAPES.values():
            runs = []
            for n in (1, 2, 3):
                lib.sq_set_threads(n)
                g = Gdn(**shape)
                qkv, zba = g.inputs(11, seed=3)
                runs.append((g.mix(lib, qkv, zba), g.conv.copy(), g.rec.copy()))
            for r in runs[1:]:
                for a, b in zip(runs[0], r):
                    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    finally:
        lib.sq_set_threads(os.cpu_count() or 1)


@pytest.mark.parametrize("build", kernel_builds())
def test_gdn_mix_slots_keep_separate_states(build):
    """Two sequences interleaved in slots 0 and 1 give each the bits it gets alone; an attention
    layer is refused."""
    lib = _lib(build)
    shape = SHAPES["gqa"]
    two, alone = Gdn(**shape, slots=2), [Gdn(**shape), Gdn(**shape)]
    ins = [two.inputs(6, seed=10 + s) for s in range(2)]
    got = [[], []]
    for t0, n in ((0, 2), (2, 3), (5, 1)):
        for s in (1, 0):
            got[s].append(two.mix(lib, ins[s][0][t0:t0 + n].copy(), ins[s][1][t0:t0 + n].copy(), slot=s))
    for s in range(2):
        want = alone[s].mix(lib, *ins[s])
        assert np.array_equal(np.concatenate(got[s]), want)
        assert np.array_equal(two.conv[s], alone[s].conv[0]) and np.array_equal(two.rec[s], alone[s].rec[0])
    attn = K_.SqLayer()
    out = np.empty(two.Vd, np.float32)
    assert lib.sq_mix(ctypes.byref(two.m), ctypes.byref(attn), 0, ins[0][0].ctypes.data, ins[0][1].ctypes.data, 1,
                          out.ctypes.data) == -2


def test_shapes_gdn_layers_cannot_run_are_refused():
    """Value heads not a multiple of key heads, or a conv kernel past 16: no workspace, no prompt, no
    mix (sq_work_new NULL, sq_prefill and sq_mix -2)"""
    lib = _lib(K_.host_builds()[0])
    for bad in ({"Hk": 2, "Hv": 3}, {"K": 17}):
        g = Gdn(**{**SHAPES["gqa"], **bad})
        g.m.hidden, g.m.inter, g.m.vocab = 64, 64, 8
        qkv, zba = g.inputs(1, seed=0)
        out = np.empty(g.Vd, np.float32)
        assert lib.sq_mix(ctypes.byref(g.m), ctypes.byref(g.L), 0, qkv.ctypes.data, zba.ctypes.data, 1,
                              out.ctypes.data) == -2
        assert not lib.sq_work_new(ctypes.byref(g.m))
        toks = np.zeros(1, np.int64)
        assert lib.sq_prefill(ctypes.byref(g.m), toks.ctypes.data, 1, 0, 1, np.empty(64, np.float32).ctypes.data, 0) == -2


def test_mixer_codes_are_exported_and_checked():
    from sparkq.runtime.core import abi

    lib = _lib(K_.host_builds()[0])
    desc = lib.sq_abi_desc().decode()
    assert abi.mixer_codes(desc) == abi.MIXERS == {"attention": 0, "gdn": 1, "sconv": 2, "mamba2": 3, "parallel": 4}

    class Swapped:
        def sq_abi(self):
            return abi.ABI

        def sq_abi_desc(self):
            return desc.replace("gdn:1", "gdn:2").encode()

    with pytest.raises(K_.KernelUnavailable, match="mixer codes"):
        abi.check(Swapped(), "libx.so")


# -- whole models as C structs: bf16 linears, GDN and attention layers --

def _bf16(a):
    """fp32 -> (bf16 bits uint16, their float64 values), round to nearest even"""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return b, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


class Tiny:
    """A decoder of `mixers` layers (GDN: SHAPES["gqa"]; attention: 2 heads, 1 KV head, head_dim 16,
    no RoPE), hidden 64, SwiGLU 96, vocab 40, tied head; `slots` sequences' KV caches and states."""
    E, I, V, H, KV, D, CAP = 64, 96, 40, 2, 1, 16, 16

    def __init__(self, lib, mixers, slots=1, seed=0):
        rng = np.random.default_rng(seed)
        self.lib, self.mixers, self.keep, self.w = lib, mixers, [], {}
        E, I, V, H, KV, D, CAP = self.E, self.I, self.V, self.H, self.KV, self.D, self.CAP
        g = self.g = SHAPES["gqa"]
        Hk, Hv, dk, dv, Kc = g["Hk"], g["Hv"], g["dk"], g["dv"], g["K"]
        C, Vd = 2 * Hk * dk + Hv * dv, Hv * dv
        bf16 = K_.kind_code(lib, "bf16")

        def lin(name, n, k, scale=0.15):
            b, w = _bf16(rng.standard_normal((n, k)) * scale)
            self.keep.append(b)
            self.w[name] = w
            return K_.SqLinear(b.ctypes.data, None, None, bf16, n, k, 0)

        def vec(name, a, f32=False):
            a = np.ascontiguousarray(a, np.float32)
            if not f32:
                a, self.w[name] = _bf16(a)
            else:
                self.w[name] = a.astype(np.float64)
            self.keep.append(a)
            return a.ctypes.data

        layers = self.layers = (K_.SqLayer * len(mixers))()
        self.states, self.caches = [], []
        for i, mx in enumerate(mixers):
            L = layers[i]
            L.attn_norm, L.mlp_norm = vec(f"{i}.an", rng.uniform(0.8, 1.2, E)), vec(f"{i}.mn", rng.uniform(0.8, 1.2, E))
            L.gate_up, L.down = lin(f"{i}.gu", 2 * I, E), lin(f"{i}.down", E, I)
            if mx == "gdn":
                L.mixer = K_.abi.MIXERS["gdn"]
                L.qkv, L.gate, L.o = lin(f"{i}.qkv", C, E), lin(f"{i}.zba", Vd + 2 * Hv, E), lin(f"{i}.o", E, Vd)
                L.conv_w = vec(f"{i}.conv", rng.standard_normal((C, Kc)) * 0.5, True)
                L.a_log = vec(f"{i}.a_log", np.log(rng.uniform(0.1, 2.0, Hv)), True)
                L.dt_bias = vec(f"{i}.dt_bias", rng.standard_normal(Hv) * 0.5, True)
                L.gnorm = vec(f"{i}.gnorm", rng.uniform(0.5, 1.5, dv), True)
                st = (np.zeros((slots, C, Kc - 1), np.float32), np.zeros((slots, Hv, dk, dv), np.float32))
                L.conv_state, L.rec_state = st[0].ctypes.data, st[1].ctypes.data
                self.states.append(st)
            else:
                L.qkv, L.o = lin(f"{i}.qkv", (H + 2 * KV) * D, E), lin(f"{i}.o", E, H * D)
                kv = (np.zeros((slots, KV, CAP, D), np.uint16), np.zeros((slots, KV, CAP, D), np.uint16))
                L.kcache, L.vcache = kv[0].ctypes.data, kv[1].ctypes.data
                self.caches.append(kv)
        m = self.m = K_.SqModel()
        m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.inter, m.vocab, m.cap = len(mixers), E, H, KV, D, I, V, CAP
        m.eps, m.attn_scale = 1e-5, 1 / np.sqrt(D)
        m.lin_k_heads, m.lin_v_heads, m.lin_k_dim, m.lin_v_dim, m.conv_k = Hk, Hv, dk, dv, Kc
        m.beta_scale, m.gnorm_eps = g["beta"], g["eps"]
        m.layer = ctypes.cast(layers, ctypes.POINTER(K_.SqLayer))
        m.head = m.embed = lin("head", V, E, 0.3)
        m.final_norm = vec("fn", rng.uniform(0.8, 1.2, E))
        self.work = lib.sq_work_new(ctypes.byref(m))
        self.batch = None
        assert self.work
        self.x = np.empty(E, np.float32)

    def __del__(self):
        self.lib.sq_work_free(self.work)
        if self.batch:
            self.lib.sq_batch_free(self.batch)

    def step(self, tok, pos):
        out = np.empty(self.V, np.float32)
        assert self.lib.sq_step(ctypes.byref(self.m), self.work, tok, pos, self.x.ctypes.data, out.ctypes.data) == 0
        return out

    def prefill(self, toks, pos0=0, chunk=3, slot=0):
        toks = np.asarray(toks, np.int64)
        out = np.empty((len(toks), self.E), np.float32)
        args = (toks.ctypes.data, len(toks), pos0, chunk, out.ctypes.data, 1)
        kvoff = slot * self.KV * self.CAP * self.D
        rc = (self.lib.sq_prefill_at(ctypes.byref(self.m), kvoff, *args) if slot
              else self.lib.sq_prefill(ctypes.byref(self.m), *args))
        assert rc == 0
        return out

    def head(self, xn):
        out = np.empty(self.V, np.float32)
        assert self.lib.sq_head(ctypes.byref(self.m), self.work, np.ascontiguousarray(xn).ctypes.data, out.ctypes.data) == 0
        return out

    def step_many(self, toks, pos, slots):
        M = len(toks)
        if not self.batch:
            self.batch = self.lib.sq_batch_new(ctypes.byref(self.m), 4)
        tok, ps = np.asarray(toks, np.int64), np.asarray(pos, np.int64)
        off = np.asarray(slots, np.int64) * self.KV * self.CAP * self.D
        out = np.empty((M, self.V), np.float32)
        assert self.lib.sq_batch_tiles(0, 0) == 0
        assert self.lib.sq_step_many(ctypes.byref(self.m), self.work, self.batch, M, tok.ctypes.data, ps.ctypes.data,
                                     off.ctypes.data, out.ctypes.data) == 0
        return out

    def forward_ref(self, toks):
        """float64 logits of every token (a model of GDN layers only)"""
        w, g = self.w, self.g
        rms = lambda x, n: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w[n]  # noqa: E731
        x = w["head"][np.asarray(toks)]
        for i, mx in enumerate(self.mixers):
            assert mx == "gdn"
            xn = rms(x, f"{i}.an")
            S0 = np.zeros((g["Hv"], g["dk"], g["dv"]))
            o, _, _ = gdn_ref(xn @ w[f"{i}.qkv"].T, xn @ w[f"{i}.zba"].T, w[f"{i}.conv"], w[f"{i}.a_log"], w[f"{i}.dt_bias"],
                              w[f"{i}.gnorm"], np.zeros((len(w[f"{i}.conv"]), g["K"] - 1)), S0, g["Hk"], g["Hv"],
                              g["dk"], g["dv"], g["eps"], g["beta"])
            x = x + o @ w[f"{i}.o"].T
            gu = rms(x, f"{i}.mn") @ w[f"{i}.gu"].T
            x = x + (_silu(gu[:, :self.I]) * gu[:, self.I:]) @ w[f"{i}.down"].T
        return rms(x, "fn") @ w["head"].T

    def snapshot(self):
        return [a.copy() for st in self.states for a in st] + [a.copy() for kv in self.caches for a in kv]


def _bits_equal(a, b):
    return all(np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8))
               for x, y in zip(a, b))


TOKS = [3, 17, 5, 39, 0, 22, 8]


@pytest.mark.parametrize("build", kernel_builds())
def test_gdn_model_decode_matches_fp64_and_prompts_leave_decode_bits(build):
    """A model of GDN layers: sq_step's logits against a float64 forward; sq_prefill in chunks of 3
    leaves the states token-by-token decode leaves and its hidden states give decode's logits, bit
    for bit (bf16 products are the same row by row in both); decode continues from either alike."""
    lib = _lib(build)
    dec, pre = Tiny(lib, ["gdn", "gdn"]), Tiny(lib, ["gdn", "gdn"])
    steps = np.stack([dec.step(t, p) for p, t in enumerate(TOKS)])
    want = dec.forward_ref(TOKS)
    assert np.abs(steps - want).max() / np.abs(want).max() < 1e-4
    xn = pre.prefill(TOKS, chunk=3)
    assert _bits_equal(pre.snapshot(), dec.snapshot())
    for p in range(len(TOKS)):
        assert np.array_equal(pre.head(xn[p]), steps[p])
    assert np.array_equal(pre.step(11, len(TOKS)), dec.step(11, len(TOKS)))
    assert _bits_equal(pre.snapshot(), dec.snapshot())
    # a new sequence at position 0 starts from empty states, by a step or a prompt
    assert np.array_equal(dec.step(TOKS[0], 0), steps[0])
    assert np.array_equal(pre.head(pre.prefill(TOKS[:4])[-1]), steps[3])


@pytest.mark.parametrize("build", kernel_builds())
def test_hybrid_batched_step_rows_are_single_steps_bits(build):
    """GDN, attention, GDN layers, two sequences: prompts into slots 0 and 1 (sq_prefill /
    sq_prefill_at) leave each slot what a one-slot model's prompt leaves; sq_step_many's rows are
    sq_step's logits bit for bit, each slot's states and KV too, a row at position 0 starting its
    slot afresh; prompt then decode is close to decode alone (attention's prompt and decode
    arithmetic differ)."""
    lib = _lib(build)
    mix = ["gdn", "attention", "gdn"]
    both, one = Tiny(lib, mix, slots=2), [Tiny(lib, mix), Tiny(lib, mix)]
    prompts = [TOKS[:5], TOKS[2:5]]
    for s in (1, 0):
        both.prefill(prompts[s], slot=s)
    for s in range(2):
        one[s].prefill(prompts[s])
        assert _bits_equal([a[s] for a in both.snapshot()], [a[0] for a in one[s].snapshot()])
    pos = [len(p) for p in prompts]
    for k in range(3):
        toks = [7 + k, 30 - k]
        rows = both.step_many(toks, pos, [0, 1])
        for s in range(2):
            assert np.array_equal(rows[s], one[s].step(toks[s], pos[s]))
        pos = [p + 1 for p in pos]
    for s in range(2):
        assert _bits_equal([a[s] for a in both.snapshot()], [a[0] for a in one[s].snapshot()])
    # slot 1 takes a new sequence (position 0: its states emptied) beside slot 0's next token
    fresh = Tiny(lib, mix)
    rows = both.step_many([12, TOKS[0]], [pos[0], 0], [0, 1])
    assert np.array_equal(rows[0], one[0].step(12, pos[0])) and np.array_equal(rows[1], fresh.step(TOKS[0], 0))
    assert _bits_equal([a[1] for a in both.snapshot()][:4], [a[0] for a in fresh.snapshot()][:4])  # the GDN states
    dec = Tiny(lib, mix)
    steps = [dec.step(t, p) for p, t in enumerate(TOKS)]
    pre = Tiny(lib, mix)
    pre.prefill(TOKS[:6])
    last = pre.step(TOKS[6], 6)
    assert np.abs(last - steps[6]).max() < 0.02 * np.abs(steps[6]).max()
