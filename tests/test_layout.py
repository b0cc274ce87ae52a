"""Packing: byte-exact against torch's own packer under every CPU capability, and the
kernel reading our bytes equals a float64 reference of the dequantized weight."""
import json

import numpy as np
import pytest
import torch

from helpers import host_capabilities, run_py
from sparkq.formats.layout import ATEN_LAYOUTS, LAYOUTS, ROWS32, dequantize_t, gather_rows, pack_rows, unpack

SHAPES = [(16, 64), (32, 64), (48, 128), (64, 32), (80, 64), (96, 64), (112, 128), (144, 64), (960, 64), (1024, 128)]


def torch_loop_reference(q: np.ndarray, layout: str) -> np.ndarray:
    """Independent transliteration of weight_to_int4pack_kernel (aten/.../int4mm_kernel.cpp)."""
    n, k = q.shape
    B = LAYOUTS[layout].block_rows
    out = np.zeros(n * k // 2, np.uint8)
    for i in range((n + B - 1) // B):
        nb = min(B, n - i * B)
        src = q[i * B: i * B + nb]
        base = i * k * B // 2
        for kk in range(k):
            if layout == "avx512" and nb == B:
                for d in range(16):
                    out[base + kk * 32 + d] = src[d, kk] | (src[d + 32, kk] << 4)
                    out[base + kk * 32 + 16 + d] = src[d + 16, kk] | (src[d + 48, kk] << 4)
            elif layout == "avx2" and nb == B:
                for d in range(16):
                    out[base + kk * 16 + d] = src[d, kk] | (src[d + 16, kk] << 4)
            else:
                for j in range(0, nb, 2):
                    out[base + kk * nb // 2 + j // 2] = src[j, kk] | (src[j + 1, kk] << 4)
    return out


@pytest.mark.parametrize("layout", sorted(ATEN_LAYOUTS))
@pytest.mark.parametrize("n,k", [(16, 8), (48, 4), (64, 4), (80, 6), (160, 4)])
def test_pack_matches_kernel_source_loop(layout, n, k):
    q = np.random.default_rng(n * k).integers(0, 16, (n, k), dtype=np.uint8)
    assert np.array_equal(pack_rows(q, layout, n), torch_loop_reference(q, layout))


def test_rows32_bytes_follow_the_documented_rule():
    """rows32 (read by runtime/core/csrc): row n at n*K/2, 16 bytes per 32 columns,
    byte j of block b = q[32b+j] | q[32b+j+16] << 4; packing row blocks concatenates."""
    n, k = 48, 96
    q = np.random.default_rng(3).integers(0, 16, (n, k), dtype=np.uint8)
    ref = np.zeros(n * k // 2, np.uint8)
    for r in range(n):
        for b in range(k // 32):
            for j in range(16):
                ref[r * k // 2 + b * 16 + j] = q[r, 32 * b + j] | (q[r, 32 * b + j + 16] << 4)
    assert np.array_equal(pack_rows(q, ROWS32, n), ref)
    assert np.array_equal(np.concatenate([pack_rows(q[i:i + 16], ROWS32, n) for i in range(0, n, 16)]), ref)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unpack_gather_roundtrip_and_row_blocks(layout):
    n, k = 208, 64  # 3 full avx512 blocks + a 16-row tail
    q = np.random.default_rng(1).integers(0, 16, (n, k), dtype=np.uint8)
    whole = pack_rows(q, layout, n)
    B = LAYOUTS[layout].block_rows
    # packing in row blocks concatenates to the whole
    parts = np.concatenate([pack_rows(q[r:r + 2 * B], layout, n) for r in range(0, n, 2 * B)])
    assert np.array_equal(parts, whole)
    pt = torch.from_numpy(whole)
    assert torch.equal(unpack(pt, layout, n, k), torch.from_numpy(q))
    rows = torch.tensor([0, 1, 15, 16, 31, 32, 63, 64, 191, 192, 200, 207, 5, 5])
    assert torch.equal(gather_rows(pt, layout, n, k, rows), torch.from_numpy(q)[rows])


CHILD = r"""
import json, sys, numpy as np, torch
sys.path.insert(0, %(tests)r)
from sparkq.formats.layout import host_layout, pack_rows, dequantize_codes
lay = host_layout()
res = {"layout": lay, "cap": torch.backends.cpu.get_cpu_capability(), "pack": [], "mm": []}
for n, k in %(shapes)r:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(n + k))
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).numpy().reshape(-1)
    mine = pack_rows(q.numpy().astype(np.uint8), lay, n)
    res["pack"].append(bool(np.array_equal(ref, mine)))
    for g in (32, 64):
        if k %% g: continue
        gen = torch.Generator().manual_seed(k)
        sz = torch.stack([torch.rand(k // g, n, generator=gen) * 0.02 + 0.001,
                          torch.randn(k // g, n, generator=gen) * 0.01], -1).to(torch.bfloat16).contiguous()
        x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch.from_numpy(mine).view(n, k // 2), g, sz)
        w = dequantize_codes(q.to(torch.uint8), sz, g, torch.float64)
        ref64 = x.double() @ w.T
        err = ((out.double() - ref64).abs() / (ref64.abs() + 1e-2)).max().item()
        res["mm"].append(err)
print(json.dumps(res))
"""


@pytest.mark.parametrize("cap", host_capabilities())
def test_byte_exact_vs_torch_and_kernel_reads_our_bytes(cap):
    import os
    p = run_py(CHILD % {"tests": os.path.dirname(__file__), "shapes": SHAPES}, env={"ATEN_CPU_CAPABILITY": cap})
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["cap"].lower() == cap and res["layout"] == cap
    assert all(res["pack"]), res
    # bf16 output rounding (2^-8 relative) plus fp32 accumulation order
    assert max(res["mm"]) < 1.6e-2, res["mm"]


def test_dequantize_t_matches_codes_path():
    from sparkq.formats.layout import dequantize_codes
    n, k, g = 208, 128, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    sz = torch.stack([torch.rand(k // g, n) * 0.05, torch.randn(k // g, n) * 0.1], -1).to(torch.bfloat16)
    for layout in LAYOUTS:
        packed = torch.from_numpy(pack_rows(q.numpy(), layout, n))
        out = torch.empty(k, n, dtype=torch.float32)
        dequantize_t(packed, sz, layout, n, k, g, out)
        ref = dequantize_codes(q, sz, g, torch.float64)
        assert torch.allclose(out.double().T, ref, atol=1e-6, rtol=1e-6)


def test_tensor_writer_writes_aligned_pieces_and_the_planned_bytes(tmp_path, monkeypatch):
    """spark-convert's writer hands the file whole, aligned 4 MiB pieces (all but the last), so
    Linux caches a fresh artifact in 2 MiB folios (docs/performance.md "Memory"); the
    bytes are those of the plan whatever the sizes of the pieces written."""
    import numpy as np

    from sparkq.formats import tensorfile as TF

    monkeypatch.setattr(TF.TensorFileWriter, "STAGE", 4096)  # the same logic, small numbers
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate([10, 5000, 4096, 77, 12289, 3])}
    entries = [(k, "U8", (v.size,)) for k, v in tensors.items()]
    path = tmp_path / "x.safetensors"
    w = TF.TensorFileWriter(str(path), entries, {"k": "v"})
    writes, real = [], w._write_all
    monkeypatch.setattr(w, "_write_all", lambda mv: (writes.append((w.fpos, mv.nbytes)), real(mv)))
    for k, v in tensors.items():
        w.begin(k)
        for piece in np.array_split(v, 3):  # uneven pieces, as the converter's row blocks are
            w.write(piece)
        w.end()
    w.close()
    assert writes and all(off % 4096 == 0 for off, _ in writes)
    assert all(n == 4096 for _, n in writes[:-1]) and 0 < writes[-1][1] <= 4096
    infos, meta = TF.read_header(str(path))
    data = path.read_bytes()
    for k, v in tensors.items():
        t = infos[k]
        assert data[t.start:t.start + t.nbytes] == v.tobytes()
    assert sum(n for _, n in writes) == len(data)
