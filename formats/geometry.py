"""Per-layer geometry, where a config varies it by layer (Gemma 4): each layer's head dim (the full
layers' ``global_head_dim``, or ``per_layer_config``), the layer whose KV cache it reads
(``num_kv_shared_layers``: the last layers keep no cache of their own and read the last earlier layer
of their type), its MLP width (``use_double_wide_mlp``: twice on those sharing layers) and the
per-layer input embedding (``hidden_size_per_layer_input``). Empty tuples: every layer the model's."""
from __future__ import annotations

from .recipe import SpecError


def head_dims(cfg: dict, types: tuple[str, ...], head_dim: int) -> tuple[int, ...]:
    """each layer's head dim (empty: head_dim everywhere)"""
    plc = cfg.get("per_layer_config")
    if plc is None and "global_head_dim" not in cfg:
        return ()
    out = [head_dim] * len(types)
    if plc is None:  # the Hub configs: full-attention layers at global_head_dim
        g = cfg["global_head_dim"]
        if type(g) is not int or g <= 0:
            raise SpecError(f"config.json: global_head_dim must be a positive integer, got {g!r}")
        return tuple(g if t == "full_attention" else head_dim for t in types)
    if not isinstance(plc, dict):
        raise SpecError("config.json: per_layer_config must be an object of layer index -> {head_dim: N}")
    for key, v in plc.items():
        if not isinstance(v, dict) or set(v) - {"head_dim", "num_key_value_heads"}:
            raise SpecError(f"config.json: per_layer_config[{key!r}] may set head_dim only (got {v!r})")
        if "num_key_value_heads" in v:
            raise SpecError("config.json: per_layer_config sets num_key_value_heads per layer (global KV heads): "
                            "not implemented")
        idx = [i for i, t in enumerate(types) if t == key] if key in set(types) else [int(key)] if str(key).isdigit() else None
        if not idx or any(not 0 <= i < len(types) for i in idx) or type(v.get("head_dim")) is not int:
            raise SpecError(f"config.json: per_layer_config key {key!r} names no layer, or its head_dim is not an integer")
        for i in idx:
            out[i] = v["head_dim"]
    return tuple(out)


def kv_sources(cfg: dict, types: tuple[str, ...]) -> tuple[int, ...]:
    """per layer the layer whose K/V it attends over (itself, or for the last num_kv_shared_layers the
    last earlier layer of its type); empty where no layer shares"""
    n = cfg.get("num_kv_shared_layers") or 0
    if type(n) is not int or n < 0:
        raise SpecError(f"config.json: num_kv_shared_layers must be a non-negative integer, got {n!r}")
    if not n:
        return ()
    first = len(types) - n
    out = list(range(len(types)))
    for i in range(first, len(types)):
        src = [j for j in range(first) if types[j] == types[i]]
        if not src:
            raise SpecError(f"config.json: num_kv_shared_layers={n} leaves layer {i} ({types[i]}) no earlier layer "
                            "of its type to share the KV cache of")
        out[i] = src[-1]
    return tuple(out)


def mlp_widths(cfg: dict, kv_from: tuple[int, ...], inter: int) -> tuple[int, ...]:
    """each layer's MLP width: twice on KV-sharing layers where use_double_wide_mlp (empty: inter everywhere)"""
    if not cfg.get("use_double_wide_mlp") or not kv_from:
        return ()
    return tuple(2 * inter if src != i else inter for i, src in enumerate(kv_from))


def per_layer_input(cfg: dict) -> tuple[int, int]:
    """(width per layer, table rows) of the per-layer input embedding; (0, 0): none"""
    p = cfg.get("hidden_size_per_layer_input") or 0
    if not p:
        return 0, 0
    v = cfg.get("vocab_size_per_layer_input", cfg.get("vocab_size"))
    if type(p) is not int or p < 0 or type(v) is not int or v <= 0:
        raise SpecError("config.json: hidden_size_per_layer_input / vocab_size_per_layer_input must be positive integers")
    return p, v
