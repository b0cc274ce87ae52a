"""llama.cpp's ``qwen35`` GGUF layout undone (convert/gguf_source.py reads it): Qwen3.5's value heads
tiled rather than grouped by key head, per DeltaNet tensor a row or column map; its config from
the metadata llama.cpp's Qwen3_5TextModel writes."""
from __future__ import annotations

import numpy as np


def tiled_to_grouped(k_heads: int, v_heads: int, dim: int = 1) -> np.ndarray:
    """For each index of the value axis in HF's grouped order (value head h = g * ratio + j reads
    key head g; dim elements a head), the index llama.cpp's qwen35 converter moved it to: the tiled
    order (h' = j * k_heads + g), so ``hf = gguf[perm]`` (_LinearAttentionVReorderBase)."""
    r = v_heads // k_heads
    return np.arange(v_heads * dim).reshape(r, k_heads, dim).transpose(1, 0, 2).reshape(-1)


def qwen35_maps(config: dict, names) -> tuple[dict, dict]:
    """Row maps (HF row -> GGUF row) and column maps of a qwen35 GGUF's DeltaNet tensors, by HF
    name; empty where there is one value head per key head (llama.cpp reorders nothing then)."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if hk == hv:
        return {}, {}
    qk = 2 * hk * config["linear_key_head_dim"]
    per_value = tiled_to_grouped(hk, hv, config["linear_value_head_dim"])
    per_head = tiled_to_grouped(hk, hv)
    with_qk = np.concatenate([np.arange(qk), qk + per_value])  # q | k rows as they are, then v
    rows = {"in_proj_qkv.weight": with_qk, "conv1d.weight": with_qk, "in_proj_z.weight": per_value,
            "in_proj_b.weight": per_head, "in_proj_a.weight": per_head, "A_log": per_head, "dt_bias": per_head}
    row_map, col_map = {}, {}
    for n in names:
        leaf = n.partition(".linear_attn.")[2]
        if leaf in rows:
            row_map[n] = rows[leaf]
        elif leaf == "out_proj.weight":
            col_map[n] = per_value
    return row_map, col_map


def qwen35_config(field, a: str, config: dict, tensors) -> None:
    """Qwen3_5TextConfig's fields from the metadata llama.cpp's Qwen3_5TextModel writes (only
    the fields recipes/qwen3_5.toml knows): the DeltaNet geometry (ssm.*), the partial rotary
    width and the mrope sections, the layer types from the tensors each layer has."""
    head_dim, v_heads = config["head_dim"], int(field(f"{a}.ssm.time_step_rank"))
    theta = config.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": theta,
            "partial_rotary_factor": int(field(f"{a}.rope.dimension_count", head_dim // 4)) / head_dim}
    sections = [int(x) for x in field(f"{a}.rope.dimension_sections", [])]
    while sections and sections[-1] == 0:  # padded to four by llama.cpp
        sections.pop()
    if sections:  # (text-only, the interleaved mrope is plain RoPE)
        rope.update(mrope_section=sections, mrope_interleaved=True)
    linear = {int(n.split(".")[2]) for n in tensors if n.endswith("linear_attn.in_proj_qkv.weight")}
    config.update(
        rope_parameters=rope, attention_bias=False,
        linear_conv_kernel_dim=int(field(f"{a}.ssm.conv_kernel")),
        linear_key_head_dim=int(field(f"{a}.ssm.state_size")),
        linear_num_key_heads=int(field(f"{a}.ssm.group_count")),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=int(field(f"{a}.ssm.inner_size")) // v_heads,
        full_attention_interval=int(field(f"{a}.full_attention_interval", 4)),
        layer_types=["linear_attention" if i in linear else "full_attention"
                     for i in range(config["num_hidden_layers"])])
