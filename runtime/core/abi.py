"""The ctypes mirror of the C core's ABI (csrc/sq_abi.h) and the functions the library exports.

The mirror is checked against the library at load: ``sq_abi_desc()`` lists every struct's
size and every field's name and offset as compiled, and the linear kind codes; a library that
disagrees with the mirror is refused (naming the first difference), so a stale or mismatched
build can never be handed a wrongly laid-out struct. Kind codes come from the library, by the
kind names formats/constants.py uses.
"""
from __future__ import annotations

import ctypes

from sparkq.formats.mixers import MIXERS as FORMAT_MIXERS

from .builds import KernelUnavailable

ABI = 18
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class SqLinear(ctypes.Structure):
    _fields_ = [("q", _P), ("sz", _P), ("bias", _P), ("kind", _I), ("n", _I), ("k", _I), ("g", _I),
                ("res", _P), ("rsc", _P), ("lut", _P), ("rmap", _P)]


class SqLayer(ctypes.Structure):
    _fields_ = [("qkv", SqLinear), ("o", SqLinear), ("gate_up", SqLinear), ("down", SqLinear)] + [
        (n, _P) for n in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "cos", "sin",
                          "kcache", "vcache", "kscale", "vscale")] + [("rot", _I), ("window", _I), ("gate", SqLinear)] + [
        ("mixer", _I)] + [(n, _P) for n in ("conv_w", "a_log", "dt_bias", "gnorm", "conv_state", "rec_state")] + [
        ("head_dim", _I), ("kv_shared", _I), ("scalar", _D), ("ple_gate", SqLinear), ("ple_proj", SqLinear),
        ("ple_norm", _P), ("conv_b", _P), ("ssm_d", _P), ("ssm_in", SqLinear), ("ssm_gate", SqLinear), ("ssm_out", SqLinear)]


class SqModel(ctypes.Structure):
    _fields_ = [(n, _I) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "cap", "act",
                                  "norm_offset", "refine_top", "kv_int8", "qk_norm_full")] + [
        (n, _D) for n in ("eps", "attn_scale", "embed_mult", "res_mult")] + [("gate_width", _I)] + [
        ("layer", ctypes.POINTER(SqLayer)), ("head", SqLinear), ("embed", SqLinear), ("final_norm", _P)] + [
        (n, _I) for n in ("lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim", "conv_k")] + [
        (n, _D) for n in ("beta_scale", "gnorm_eps")] + [("fc", SqLinear), ("fc_enorm", _P), ("fc_hnorm", _P)] + [
        ("v_norm", _I), ("ple_dim", _I), ("ple_embed", SqLinear), ("ple_model", SqLinear), ("ple_in_norm", _P)] + [
        (n, _I) for n in ("sc_dim", "ssm_heads", "ssm_head_dim", "ssm_state", "ssm_groups", "ssm_norm_groups")]


# sq_layer.mixer codes by mixer name (formats/mixers.py MIXERS; csrc/sq_abi.h MIXER_*), checked
# against the library's at load
MIXERS = {m.name: m.code for m in FORMAT_MIXERS.values()}  # formats/mixers.py, checked against the library


# the norm vectors of a layer, by their field names (also the artifact's names: layers.L.<name>.weight)
LAYER_NORMS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")

_PTR = ctypes.POINTER
_SIGNATURES = {  # name -> (restype, argtypes)
    "sq_abi": (ctypes.c_int, []),
    "sq_abi_desc": (ctypes.c_char_p, []),
    "sq_simd": (ctypes.c_int, []),
    "sq_prefill_bf16": (ctypes.c_int, []),
    "sq_prefill_amx": (ctypes.c_int, []),
    "sq_amx_init": (ctypes.c_int, []),
    "sq_w4a16_min_m": (ctypes.c_int, []),
    "sq_gemm_tiles": (ctypes.c_int, [_PTR(SqLinear), _P, _I, _P, _I]),
    "sq_tile_op": (ctypes.c_int, [_I, _P, _P, _P, _I]),
    "sq_batch_tiles": (ctypes.c_int, [_I, _I]),
    "sq_linear_a16": (ctypes.c_int, [_PTR(SqLinear), _P, _I, _P, _I]),
    "sq_set_threads": (None, [ctypes.c_int]),
    "sq_work_new": (_P, [_PTR(SqModel)]),
    "sq_work_free": (None, [_P]),
    "sq_step": (ctypes.c_int, [_PTR(SqModel), _P, _I, _I, _P, _P]),
    "sq_head": (ctypes.c_int, [_PTR(SqModel), _P, _P, _P]),
    "sq_prefill": (ctypes.c_int, [_PTR(SqModel), _P, _I, _I, _I, _P, _I]),
    "sq_prefill_at": (ctypes.c_int, [_PTR(SqModel), _I, _P, _I, _I, _I, _P, _I]),
    "sq_batch_new": (_P, [_PTR(SqModel), _I]),
    "sq_batch_free": (None, [_P]),
    "sq_step_many": (ctypes.c_int, [_PTR(SqModel), _P, _P, _I, _P, _P, _P, _P]),
    "sq_step_many_in": (ctypes.c_int, [_PTR(SqModel), _P, _P, _I, _P, _P, _P, _P, _P]),
    "sq_prefill_in_at": (ctypes.c_int, [_PTR(SqModel), _I, _P, _P, _I, _I, _I, _P, _I]),
    "sq_head_many": (ctypes.c_int, [_PTR(SqModel), _P, _I, _P, _P]),
    "sq_batch_xn": (ctypes.c_int, [_PTR(SqModel), _P, _I, _P]),
    "sq_batch_keep": (ctypes.c_int, [_P, _P, _P]),
    "sq_head_exact": (ctypes.c_int, [_PTR(SqModel), _P, _P, _I, _P]),
    "sq_linear_f32": (ctypes.c_int, [_PTR(SqLinear), _P, _P]),
    "sq_linear_batch": (ctypes.c_int, [_PTR(SqLinear), _P, _I, _I, _P, _P]),
    "sq_dequant_rows": (ctypes.c_int, [_PTR(SqLinear), _I, _I, _P]),
    "sq_gptq_block": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _P, _P, _I, _I, _P, _I, _P]),
    "sq_lut_fit": (ctypes.c_int, [_P, _I, _I, _I, _P, _I, _P, _P, _P, _P]),
    "sq_clip_search": (ctypes.c_int, [_P, _I, _I, _I, _P, _I, _P, _I, _P, _P, _P]),
    "sq_gram_bf16": (ctypes.c_int, [_P, _I, _I, _P]),
    "sq_glu": (ctypes.c_int, [_I, _P, _I, _P]),
    "sq_mix": (ctypes.c_int, [_PTR(SqModel), _PTR(SqLayer), _I, _P, _P, _I, _P]),
}


def _mirror(struct) -> tuple[int, list[tuple[str, int]]]:
    return ctypes.sizeof(struct), [(name, getattr(struct, name).offset) for name, _ in struct._fields_]


def parse_desc(desc: str) -> tuple[int, dict[str, int], dict[str, tuple[int, list[tuple[str, int]]]]]:
    """sq_abi_desc() -> (abi, {kind name: code}, {struct: (size, [(field, offset)])})"""
    parts = dict(p.split("=", 1) for p in desc.split(";"))
    parts.pop("mixers", None)  # mixer_codes()
    kinds = {k: int(v) for k, v in (kv.split(":") for kv in parts.pop("kinds").split(","))}
    abi = int(parts.pop("abi"))
    structs = {}
    for name, body in parts.items():
        size, fields = body.split(":", 1)
        structs[name] = (int(size), [(f, int(o)) for f, o in (x.split("@") for x in fields.split(","))])
    return abi, kinds, structs


def mixer_codes(desc: str) -> dict[str, int]:
    """sq_abi_desc() -> {mixer name: sq_layer.mixer code} ({} from a library without mixers)"""
    parts = dict(p.split("=", 1) for p in desc.split(";"))
    return {k: int(v) for k, v in (kv.split(":") for kv in parts["mixers"].split(","))} if "mixers" in parts else {}


def check(lib, path) -> dict[str, int]:
    """Refuse a library whose ABI differs from this mirror; returns its kind codes."""
    if lib.sq_abi() != ABI:
        raise KernelUnavailable(f"{path}: ABI {lib.sq_abi()} != {ABI}; delete it and run again")
    desc = lib.sq_abi_desc().decode()
    abi, kinds, structs = parse_desc(desc)
    if mixer_codes(desc) != MIXERS:
        raise KernelUnavailable(f"{path}: layer mixer codes {mixer_codes(desc)} in the library but {MIXERS} in "
                                "runtime/core/abi.py; the two must change together")
    for name, struct in (("sq_linear", SqLinear), ("sq_layer", SqLayer), ("sq_model", SqModel)):
        if structs.get(name) != _mirror(struct):
            got, want = structs.get(name), _mirror(struct)
            raise KernelUnavailable(f"{path}: struct {name} is laid out as {got} in the library but {want} in "
                                    "runtime/core/abi.py; the two must change together")
    return kinds


def declare(lib) -> None:
    for name, (res, args) in _SIGNATURES.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
