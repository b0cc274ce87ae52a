"""Whole vs chunked C prefill, per layer and position, against fp64 compute on the same weights.

    SPARKQ_KERNEL=avx2 .venv/bin/python docs/chunked_prefill_diag.py HEADS HEAD_DIM [WORKDIR]

The test model of tests/test_kernels.py (mistral, 3 layers, sliding window 8, minmax int4),
30 prompt tokens through sq_prefill whole and in chunks of 7, after 1, 2 and 3 layers
(the final-normed hidden state); the reference is the same dequantized weights in float64.
Results and what they showed: docs/correctness.md.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import dequant_reference, make_llama  # noqa: E402
from sparkq.convert.pipeline import Options, convert  # noqa: E402
from sparkq.runtime import load  # noqa: E402
from sparkq.runtime.torchrt.layers import rms_norm  # noqa: E402

heads, hd = int(sys.argv[1]), (None if sys.argv[2] == "None" else int(sys.argv[2]))
tmp = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/sparkq-diag") / f"m{heads}-{hd}"
if not (tmp / "int4").exists():
    src = make_llama(tmp / "src", arch="mistral", layers=3, sliding_window=8, heads=heads, head_dim=hd)
    convert(str(src), str(tmp / "int4"), Options(progress=False, method="minmax"))
q = load(str(tmp / "int4"), max_model_len=64)
m = q.model
fd = m.fast
print("path", q.info.extra["decode_path"])
t = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2))
ref = dequant_reference(q, torch.float64)


@torch.inference_mode()
def ref_hidden(L):
    s, n = ref.spec, ref.norms
    x = ref.embedding.embed(t).double()
    for i in range(L):
        h = ref._attention(i, rms_norm(x, n[f"layers.{i}.attn_norm.weight"], s.rms_eps, s.norm_offset), 0)
        x = x + h
        h = ref._mlp(i, rms_norm(x, n[f"layers.{i}.mlp_norm.weight"], s.rms_eps, s.norm_offset))
        x = x + h
    return rms_norm(x, n["norm.weight"], s.rms_eps, s.norm_offset)


def c_hidden(L, chunk):  # fd: the model's core.Session; its struct's layer count cut to L
    fd.m.layers, fd.prefill_chunk = L, chunk
    try:
        return torch.from_numpy(fd.prefill(t.numpy(), 0, False)).double()
    finally:
        fd.m.layers, fd.prefill_chunk = ref.spec.layers, 512

def fmt(v):
    return " ".join(f"{x:.1e}" if x else "0" for x in v.tolist())


for L in range(1, ref.spec.layers + 1):
    r = ref_hidden(L)
    w, c = c_hidden(L, 512), c_hidden(L, 7)
    nrm = r.abs().amax(-1)
    ew, ec = (w - r).abs().amax(-1) / nrm, (c - r).abs().amax(-1) / nrm
    d = (c - w).abs().amax(-1) / nrm
    print(f"layers={L}: |chunk7 - whole| per position: {fmt(d)}")
    print(f"   error vs fp64, whole : median {ew.median():.2e} max {ew.max():.2e}")
    print(f"   error vs fp64, chunk7: median {ec.median():.2e} max {ec.max():.2e}")
    print(f"   positions where chunk7 is further from fp64 than whole: {(ec > ew).sum().item()}/30, "
          f"mean ratio {(ec / ew).mean():.3f}")
