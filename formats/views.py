"""Derived source tensors: where a family's checkpoints split or join tensors differently from the
recipe's roles, a view names a new tensor as rows of existing ones, in order. The converter
(convert/source.py) and the torch runtime's checkpoint reader (runtime/torchrt/api.py) both read
them; recipes name them like any tensor."""
from __future__ import annotations

Runs = list  # [(source tensor name, first row, end row[, scale])] concatenated in order


def _qwen3_5(config: dict, shapes: dict) -> dict:
    """q_proj [heads * 2 head_dim, hidden] holds each head's query then its output gate ([q_h | g_h]
    per head): ``<q_proj>:query`` and ``<q_proj>:gate``, each [heads * head_dim, hidden]."""
    d = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    out = {}
    for name, shape in shapes.items():
        if name.endswith("self_attn.q_proj.weight"):
            heads = shape[0] // (2 * d)
            for part, suffix in ((0, ":query"), (1, ":gate")):
                out[name + suffix] = ((heads * d, *shape[1:]),
                                      [(name, (2 * h + part) * d, (2 * h + part + 1) * d) for h in range(heads)])
    return out


def _olmo_hybrid(config: dict, shapes: dict) -> dict:
    """The names transformers' OLMo Hybrid conversion writes, as its modeling code reads them: the
    ``attention_layer_norm`` / ``feedforward_layer_norm`` aliases, and the q / k / v conv weights
    joined into one ``conv1d`` (the recipe splits it [key, key, value]; a checkpoint's own split
    sizes are not trusted: transformers' save cuts it in three equal parts)."""
    out = {}
    for name, shape in shapes.items():
        for alias, real in (("attention_layer_norm", "input_layernorm"),
                            ("feedforward_layer_norm", "post_attention_layernorm")):
            if f".{alias}." in name and name.replace(alias, real) not in shapes:
                out[name.replace(alias, real)] = (shape, [(name, 0, shape[0])])
        if name.endswith("linear_attn.q_conv1d.weight") and name.replace("q_conv1d", "conv1d") not in shapes:
            parts = [name.replace("q_conv1d", p) for p in ("q_conv1d", "k_conv1d", "v_conv1d")]
            if all(p in shapes for p in parts):
                out[name.replace("q_conv1d", "conv1d")] = ((sum(shapes[p][0] for p in parts), *shape[1:]),
                                                           [(p, 0, shapes[p][0]) for p in parts])
    return out


def _mamba_in_proj(shapes: dict, suffix: str, heads: int, inner: int) -> dict:
    """A Mamba-2 layer's in_proj [z | x B C | dt] rows: ``<in_proj>:z``, ``:xbc`` and ``:dt`` (the
    recipe's gate is z | dt, its qkv x B C: the conv's input)."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(suffix):
            bounds = {":z": (0, inner), ":xbc": (inner, shape[0] - heads), ":dt": (shape[0] - heads, shape[0])}
            for part, (a, b) in bounds.items():
                out[name + part] = ((b - a, *shape[1:]), [(name, a, b)])
    return out


def _granite_hybrid(config: dict, shapes: dict) -> dict:
    heads = int(config.get("mamba_n_heads", 128))
    return _mamba_in_proj(shapes, "mamba.in_proj.weight", heads, int(config.get("mamba_expand", 2)) * int(config["hidden_size"]))


def _nemotron_h(config: dict, shapes: dict) -> dict:
    heads = int(config.get("mamba_num_heads", 128))
    return _mamba_in_proj(shapes, "mixer.in_proj.weight", heads, heads * int(config.get("mamba_head_dim", 64)))


def _falcon_h1(config: dict, shapes: dict) -> dict:
    """Falcon-H1's multipliers as scaled rows (each run's fourth value): in_proj's z | x | B | C | dt by
    ssm_in_multiplier times its ssm_multipliers ([z | x B C | dt] views as Granite's), out_proj by
    ssm_out_multiplier, q / k / v by attention_in_multiplier (k also by key_multiplier), o by
    attention_out_multiplier, the MLP's gate and down by mlp_multipliers: ``<name>:s``."""
    f = lambda k, d=1.0: float(config.get(k, d))  # noqa: E731
    m = [float(x) for x in config.get("ssm_multipliers") or [1.0] * 5]
    gm, dm = [float(x) for x in config.get("mlp_multipliers") or [1.0, 1.0]]
    g, n = int(config.get("mamba_n_groups", 1)), int(config.get("mamba_d_state", 256))
    inner = int(config.get("mamba_d_ssm") or int(config.get("mamba_expand", 2)) * int(config["hidden_size"]))
    s_in, ain = f("ssm_in_multiplier"), f("attention_in_multiplier")
    scale = {"mamba.out_proj.weight": f("ssm_out_multiplier"), "self_attn.q_proj.weight": ain,
             "self_attn.k_proj.weight": ain * f("key_multiplier"), "self_attn.v_proj.weight": ain,
             "self_attn.o_proj.weight": f("attention_out_multiplier"), "feed_forward.gate_proj.weight": gm,
             "feed_forward.down_proj.weight": dm}
    out = {}
    for name, shape in shapes.items():
        if name.endswith("mamba.in_proj.weight"):
            cuts = [0, inner, 2 * inner, 2 * inner + g * n, 2 * inner + 2 * g * n, shape[0]]
            runs = [(name, cuts[j], cuts[j + 1], s_in * m[j]) for j in range(5)]
            out[name + ":z"] = ((inner, *shape[1:]), runs[:1])
            out[name + ":xbc"] = ((cuts[4] - inner, *shape[1:]), runs[1:4])
            out[name + ":dt"] = ((shape[0] - cuts[4], *shape[1:]), runs[4:])
        for suffix, k in scale.items():
            if name.endswith(suffix):
                out[name + ":s"] = (shape, [(name, 0, shape[0], k)])
    return out


VIEWS = {"qwen3_5": _qwen3_5, "olmo_hybrid": _olmo_hybrid, "granitemoehybrid": _granite_hybrid,
         "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1}  # recipe family -> its views


def views(family: str, config: dict, shapes: dict) -> dict[str, tuple[tuple, Runs]]:
    """name -> (shape, runs) of the family's derived tensors over ``shapes`` (name -> shape)."""
    return VIEWS[family](config, shapes) if family in VIEWS else {}


def runs_between(runs: Runs, r0: int, r1: int) -> Runs:
    """The runs covering rows [r0, r1) of a view."""
    out, base = [], 0
    for name, a, b, *scale in runs:  # (a run may carry a scale: its rows times it)
        lo, hi = max(r0, base), min(r1, base + b - a)
        if lo < hi:
            out.append((name, a + lo - base, a + hi - base, *scale))
        base += b - a
    return out


def scaled(t, run):
    """a run's rows t, times the run's scale where it has one (in fp32, rounded back once)"""
    return t if len(run) < 4 or run[3] == 1.0 else (t.float() * run[3]).to(t.dtype)
