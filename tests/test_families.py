"""Families beyond Llama: one model file, recipes as data. For each: bf16 runtime vs
transformers (prefill + cached decode), then the int4 artifact against its own dequantized weights."""
import pytest
import torch

from helpers import make_llama
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.runtime import load
from sparkq.runtime.model import Model
from sparkq.runtime.weights import DenseLinear

FAMILIES = {
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=48),           # head_dim != hidden/heads, q/k norm
    "mistral": dict(arch="mistral", sliding_window=8),  # prompt longer than the window
}


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_family_bf16_vs_transformers_and_int4(fam, tmp_path):
    src = make_llama(tmp_path / fam, **FAMILIES[fam])
    m = load(str(src), max_model_len=64)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [m.model.forward(torch.tensor(ids), 0, last_only=False)]
    seq = list(ids)
    for _ in range(8):
        seq.append(int(steps[-1][-1].argmax()))
        steps.append(m.model.forward(torch.tensor(seq[-1:]), len(seq) - 1))
    ours, ref = torch.cat(steps), _hf_logits(src, seq)
    scale = ref.abs().max()
    assert (ours - ref).abs().max() < 0.03 * scale, (fam, (ours - ref).abs().max(), scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9

    out = tmp_path / f"{fam}-int4"
    convert(str(src), str(out), Options(progress=False))
    art = Artifact.open(out)
    assert art.spec.family == fam
    q = load(str(out), max_model_len=64)
    dense = {n: DenseLinear(n, lin.dequant()) for n, lin in q.model.lin.items()}
    deq = Model(q.model.spec, dense, q.model.norms, max_model_len=64, kv_capacity=64)
    a = q.model.forward(torch.tensor(seq), 0, last_only=False)
    b = deq.forward(torch.tensor(seq), 0, last_only=False)
    assert ((a - b).abs().max() / b.abs().max()) < 0.03


def test_unknown_architecture_lists_supported(tmp_path):
    import json

    from helpers import run_cli
    src = make_llama(tmp_path / "x")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    p = run_cli("spark-convert", src, tmp_path / "o")
    assert p.returncode == 2
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "--recipe"):
        assert arch in p.stderr, p.stderr
