"""The decoder's layer math, defined once: norms, RoPE, attention with sliding windows, the gated
MLP, and the order a layer applies them in. The torch runtime (model.py) runs it in bf16 over its
KV cache; the converter's calibration (convert/calib.py) runs it in fp32 over whole windows, one
linear at a time. Neither the linears nor their storage appear here: a caller multiplies, this
module does everything between the products.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from sparkq.formats import constants as C
from sparkq.formats.mixers import MIXERS
from sparkq.formats.rope import rope_attention_factor, rope_inv_freq
from sparkq.formats.spec import ModelSpec


def prefill_dtype() -> torch.dtype:
    """The dtype of many-row GEMMs: bf16 pays only on CPUs with native bf16 (AVX512-BF16/AMX); else fp32."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native else torch.float32


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, the result in x's dtype (Gemma's ``offset``: times 1 + w)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma: scale by (1 + w) in fp32, then round
        return (xf * (1.0 + w.float())).to(x.dtype)
    return w * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x's first cos.shape[-1] features; cos and sin broadcast against them
    ([T, 1, r] for x [T, heads, D])."""
    r = cos.shape[-1]
    xr, h = x[..., :r], r // 2
    out = xr * cos + torch.cat([-xr[..., h:], xr[..., :h]], dim=-1) * sin
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, start: int, window: int | None,
           scale: float, per_group: bool = False) -> torch.Tensor:
    """Causal attention of queries at positions pos0.. over keys at start..: q [H, T, D], k and v
    [KV, S, D] (grouped-query: H a multiple of KV) -> [H, T, D]. A whole prompt from position 0
    without a window is plain causal (is_causal beats the same mask); else a mask of the window.
    ``per_group``: one KV head's query group at a time, always masked: the score transients stay
    one group's (the calibration's fp32 windows)."""
    t, end = q.shape[1], start + k.shape[1]
    causal, mask = start == pos0 == 0 and window is None and not per_group, None
    if not causal:
        qpos = torch.arange(pos0, pos0 + t)[:, None]
        kpos = torch.arange(start, end)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
    if per_group:
        grp, out = q.shape[0] // k.shape[0], torch.empty_like(q)
        for h in range(k.shape[0]):
            out[h * grp:(h + 1) * grp] = F.scaled_dot_product_attention(
                q[h * grp:(h + 1) * grp], k[h:h + 1].expand(grp, -1, -1), v[h:h + 1].expand(grp, -1, -1),
                attn_mask=mask, scale=scale)
        return out
    # 4-D inputs: with 3-D ones torch takes its math path (2.4x slower at 512 tokens, measured)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=q.shape[0] != k.shape[0])[0]


def rope_cos_sin(spec: ModelSpec, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [length, rotary_dim] of a layer's RoPE (frequencies and YaRN's factor from
    formats/rope.py), evaluated in torch fp32: the calibration's tables (the runtimes read
    formats.rope's bf16 tables)."""
    theta, rot, _ = spec.layer_attention(layer)
    inv = rope_inv_freq(spec, rot, theta, layer, context=length)
    f = torch.outer(torch.arange(length, dtype=torch.float32), torch.from_numpy(inv))
    emb = torch.cat([f, f], -1)
    att = rope_attention_factor(spec, layer)
    return emb.cos() * att, emb.sin() * att


# ModelSpec.act -> the MLP gate's activation
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu,
    "relu2": lambda u: F.relu(u).square()}


def activation(spec: ModelSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[spec.act]


def attn_scale(spec: ModelSpec) -> float:
    return spec.attn_scale or 1.0 / math.sqrt(spec.head_dim)


class Layers:
    """Everything between a model's linear products, over its vectors (``vec(name)``: a norm weight
    or bias by its artifact name). Calls come in a layer's order: ``attn_in``, the qkv product (and
    the gate's, where the family has one), ``qkv_heads``, (rotate, attend), ``gate``, the o product, ``residual``; ``mlp_in``, the gate_up product,
    ``glu``, the down product, ``residual``; at the end ``final``."""

    def __init__(self, spec: ModelSpec, vec: Callable[[str], torch.Tensor]):
        self.spec, self.vec = spec, vec
        self.act = activation(spec)
        self.scale = attn_scale(spec)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.vec(name), self.spec.rms_eps, self.spec.norm_offset)

    def attn_in(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """The mixer's input (attention or another mixer: formats/mixers.py)."""
        return self.norm(x, f"layers.{i}.attn_norm.weight") if self.spec.has_norm(i, "attn_norm") else x

    def mlp_in(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return self.norm(x, f"layers.{i}.mlp_norm.weight") if self.spec.has_norm(i, "mlp_norm") else x

    def gdn(self, i: int, qkv: torch.Tensor, zba: torch.Tensor, conv: torch.Tensor | None = None,
            rec: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Gated DeltaNet layer between its products, fp32, token by token (what the C core does):
        qkv [B, T, conv_dim] (the in-projection before the conv), zba [B, T, value_dim + 2 v_heads]
        (the gate linear: z | b | a), the state before (conv [B, conv_dim, K - 1]: the last K - 1
        inputs, oldest first; rec [B, v_heads, k_dim, v_dim]; None: zeros) -> (the output [B, T,
        value_dim] in qkv's dtype, the conv state after, the recurrent state after)."""
        g = self.spec.gdn
        b_, t_, c_ = qkv.shape
        k_ = g.conv_kernel
        w = self.vec(f"layers.{i}.{C.GDN_CONV}").float()  # [C, K]
        prev = torch.zeros(b_, k_ - 1, c_) if conv is None else conv.transpose(1, 2).float()
        xs = torch.cat([prev, qkv.float()], 1)  # [B, K - 1 + T, C]
        c = xs[:, 0:t_] * w[:, 0]
        for j in range(1, k_):  # the taps in order, oldest first, as the C core sums them
            c = c + xs[:, j:j + t_] * w[:, j]
        new_conv = xs[:, t_:].transpose(1, 2).contiguous()
        c = F.silu(c)
        q, k, v = c.split([g.key_dim, g.key_dim, g.value_dim], -1)
        r = g.v_heads // g.k_heads

        def l2(u):
            return u * torch.rsqrt((u * u).sum(-1, keepdim=True) + 1e-6)
        q = l2(q.reshape(b_, t_, g.k_heads, g.k_dim)).repeat_interleave(r, 2) * (1.0 / math.sqrt(g.k_dim))
        k = l2(k.reshape(b_, t_, g.k_heads, g.k_dim)).repeat_interleave(r, 2)
        v = v.reshape(b_, t_, g.v_heads, g.v_dim)
        z, bb, a = zba.float().split([g.value_dim, g.v_heads, g.v_heads], -1)
        beta = g.beta_scale * torch.sigmoid(bb)
        decay = torch.exp(-torch.exp(self.vec(f"layers.{i}.{C.GDN_A_LOG}").float())
                          * F.softplus(a + self.vec(f"layers.{i}.{C.GDN_DT_BIAS}").float()))  # [B, T, Hv]
        s = torch.zeros(b_, g.v_heads, g.k_dim, g.v_dim) if rec is None else rec.float().clone()
        o = torch.empty(b_, t_, g.v_heads, g.v_dim)
        for t in range(t_):  # the delta rule: decay, read, correct, write, then the query reads the new state
            s *= decay[:, t, :, None, None]
            kt = k[:, t]
            delta = (v[:, t] - torch.einsum("bhi,bhij->bhj", kt, s)) * beta[:, t, :, None]
            s += kt[..., :, None] * delta[..., None, :]
            o[:, t] = torch.einsum("bhi,bhij->bhj", q[:, t], s)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + g.norm_eps)
        o = o * self.vec(f"layers.{i}.{C.GDN_NORM}").float() * F.silu(z.reshape(b_, t_, g.v_heads, g.v_dim))
        return o.reshape(b_, t_, g.value_dim).to(qkv.dtype), new_conv, s

    def conv(self, i: int, u: torch.Tensor, state: torch.Tensor | None, k_: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's depthwise causal conv (weight [C, K], its bias where the layer has one), fp32,
        the taps summed oldest first as the C core sums them: u [B, T, C], the last K - 1 inputs before
        (state [B, C, K - 1] or None: zeros) -> (conv [B, T, C], the state after)."""
        b_, t_, c_ = u.shape
        w = self.vec(f"layers.{i}.{C.GDN_CONV}").float()
        prev = torch.zeros(b_, k_ - 1, c_) if state is None else state.transpose(1, 2).float()
        xs = torch.cat([prev, u.float()], 1)  # [B, K - 1 + T, C]
        c = xs[:, 0:t_] * w[:, 0]
        if self.spec.ssm is not None and self.spec.ssm.conv_bias:
            c = self.vec(f"layers.{i}.{C.CONV_BIAS}").float() + c
        for j in range(1, k_):
            c = c + xs[:, j:j + t_] * w[:, j]
        return c, xs[:, t_:].transpose(1, 2).contiguous()

    def sconv(self, i: int, bcx: torch.Tensor, g: None = None, conv: torch.Tensor | None = None):
        """A gated short convolution (LFM2) between its products: bcx [B, T, 3 E] (in_proj: B | C | x),
        the conv state before -> (C * conv(B * x) [B, T, E] in bcx's dtype, the conv state after)."""
        b, c, x = bcx.float().chunk(3, -1)
        y, st = self.conv(i, b * x, conv, self.spec.sconv.kernel)
        return (c * y).to(bcx.dtype), st

    def mamba(self, i: int, xbc: torch.Tensor, zdt: torch.Tensor, conv: torch.Tensor | None = None,
              rec: torch.Tensor | None = None):
        """A Mamba-2 layer between its products, fp32, token by token (what the C core does): xbc [B,
        T, conv_dim] (in_proj's x | B | C), zdt [B, T, inner + heads] (z | dt), the states before
        (conv [B, conv_dim, K - 1], rec [B, H, P, N]; None: zeros) -> (the gated-normed output [B, T,
        inner] in xbc's dtype, the conv state after, the recurrent state after)."""
        g = self.spec.ssm
        b_, t_, _ = xbc.shape
        c, new_conv = self.conv(i, xbc, conv, g.conv_kernel)
        c = F.silu(c)
        x, bb, cc = c.split([g.inner, g.groups * g.state, g.groups * g.state], -1)
        r = g.heads // g.groups
        x = x.reshape(b_, t_, g.heads, g.head_dim)
        bb = bb.reshape(b_, t_, g.groups, g.state).repeat_interleave(r, 2)  # [B, T, H, N]
        cc = cc.reshape(b_, t_, g.groups, g.state).repeat_interleave(r, 2)
        z, dt = zdt.float().split([g.inner, g.heads], -1)
        dt = F.softplus(dt + self.vec(f"layers.{i}.{C.GDN_DT_BIAS}").float())  # [B, T, H]
        a = -torch.exp(self.vec(f"layers.{i}.{C.GDN_A_LOG}").float())
        d = self.vec(f"layers.{i}.{C.SSM_D}").float()
        s = torch.zeros(b_, g.heads, g.head_dim, g.state) if rec is None else rec.float().clone()
        y = torch.empty(b_, t_, g.heads, g.head_dim)
        for t in range(t_):  # decay, take dt x B^T, read with C, the D skip
            s = s * torch.exp(dt[:, t] * a)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * bb[:, t, :, None, :]
            y[:, t] = torch.einsum("bhpn,bhn->bhp", s, cc[:, t]) + d[:, None] * x[:, t]
        y = y.reshape(b_, t_, g.inner) * F.silu(z)
        if g.norm_groups:  # RMS-normed per group (no norm: Falcon-H1's mamba_rms_norm false)
            y = y.reshape(b_, t_, g.norm_groups, -1)
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + g.norm_eps)
            y = y.reshape(b_, t_, g.inner) * self.vec(f"layers.{i}.{C.GDN_NORM}").float()
        return y.to(xbc.dtype), new_conv, s

    def recurrent(self, i: int, qkv: torch.Tensor, g: torch.Tensor | None, state: dict | None) -> tuple:
        """Layer i's recurrent mixer (formats/mixers.py Mixer.math) between its products: qkv [B, T,
        rows], the gate product g (or None), the state before ({name: [B, ...]}, the mixer's state
        names, or None: empty) -> (the output [B, T, o's input], {name: the state after})."""
        mixer = MIXERS[self.spec.mixers[i]]
        names = tuple(mixer.state(self.spec))
        before = [None] * len(names) if state is None else [state[n] for n in names]
        out = getattr(self, mixer.math)(i, qkv, g, *before)
        return out[0], dict(zip(names, out[1:]))

    def qkv_heads(self, qkv: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The qkv product [..., T, q_dim + 2 kv_dim] -> q [..., T, heads, D], k and v [..., T, kv_heads,
        D]: the bias added, q and k normed (before RoPE), v normed where the family does (Gemma 4,
        no weight). A KV-sharing layer's product is its q alone: k and v None."""
        s, d = self.spec, self.spec.hd(i)
        if s.qkv_bias:
            qkv = qkv + self.vec(f"layers.{i}.qkv.bias")
        lead = qkv.shape[:-1]
        if not s.owns_kv(i):
            q = qkv.reshape(*lead, s.heads, d)
            return (self.norm(q, f"layers.{i}.q_norm.weight") if s.qk_norm else q), None, None
        q, k, v = qkv.split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        if s.qk_norm and s.qk_norm_full:  # over all heads, before the split (OLMo2)
            q, k = self.norm(q, f"layers.{i}.q_norm.weight"), self.norm(k, f"layers.{i}.k_norm.weight")
        q, k = q.reshape(*lead, s.heads, d), k.reshape(*lead, s.kv_heads, d)
        if s.qk_norm and not s.qk_norm_full:
            q, k = self.norm(q, f"layers.{i}.q_norm.weight"), self.norm(k, f"layers.{i}.k_norm.weight")
        v = v.reshape(*lead, s.kv_heads, d)
        if s.v_norm:
            vf = v.float()
            v = (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + s.rms_eps)).to(v.dtype)
        return q, k, v

    def ple_inputs(self, tok: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs [T, layers, width] from each token's table row tok [T, layers *
        width] and the projection of its (scaled) embedding ctx [T, layers * width]: the row times
        sqrt(width) (in its dtype), ctx times hidden^-0.5 normed per layer, their sum times 2^-0.5."""
        s = self.spec
        t, p = tok.shape[0], s.ple_dim
        tok = tok.reshape(t, s.layers, p) * torch.tensor(p ** 0.5, dtype=tok.dtype)
        ctx = self.norm((ctx * s.hidden ** -0.5).reshape(t, s.layers, p), C.PLE_IN_NORM)
        return (ctx + tok) * 2 ** -0.5

    def ple_branch(self, h: torch.Tensor, i: int, ple_i: torch.Tensor, gate, proj) -> torch.Tensor:
        """After layer i's MLP: the residual plus norm(proj(act(gate(h)) * ple_i)), then times the
        layer's scalar (Gemma 4); ``gate`` and ``proj`` the layer's products."""
        s = self.spec
        if s.ple_dim:
            h = h + self.norm(proj(self.act(gate(h)) * ple_i), f"layers.{i}.{C.PLE_NORM}.weight")
        if s.layer_scalar:
            h = h * self.vec(f"layers.{i}.{C.LAYER_SCALAR}.weight")
        return h

    def gate(self, o: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """The attention output o [..., heads * D] times sigmoid of the gate product g [..., heads *
        width] (ModelSpec.attn_gate: one scalar per head, or one per channel); the sigmoid in fp32,
        as vLLM's Spark2_5Attention computes it. No gate: o."""
        s = self.spec
        if not s.attn_gate:
            return o
        lead = o.shape[:-1]
        sg = torch.sigmoid(g.float()).to(o.dtype).reshape(*lead, s.heads, s.attn_gate)
        return (o.reshape(*lead, s.heads, s.head_dim) * sg).reshape(o.shape)

    def glu(self, gu: torch.Tensor) -> torch.Tensor:
        """the MLP between its products: act(gate) * up, or (no gate: relu2) act(up)"""
        if not self.spec.gated_mlp:
            return self.act(gu)
        g, u = gu.chunk(2, dim=-1)
        return self.act(g) * u

    def branch(self, h: torch.Tensor, i: int, role: str) -> torch.Tensor:
        """The o (attention) or down (MLP) product's output as the residual stream adds it:
        sandwich-normed where the family does (Gemma)."""
        post = "post_attn_norm" if role == C.ROLE_O else "post_mlp_norm"
        if self.spec.has_norm(i, post):
            h = self.norm(h, f"layers.{i}.{post}.weight")
        return h * self.spec.residual_multiplier if self.spec.residual_multiplier != 1.0 else h

    def residual(self, x: torch.Tensor, h: torch.Tensor, i: int, role: str) -> torch.Tensor:
        return x + self.branch(h, i, role)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, "norm.weight")

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the model returns it: divided (Granite's logits_scaling), soft-capped (Gemma 2)."""
        s = self.spec
        if s.logits_divisor != 1.0:
            logits = logits / s.logits_divisor
        if s.final_softcap:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits
