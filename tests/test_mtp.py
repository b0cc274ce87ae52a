"""Multi-token prediction (runtime/mtp.py): a Qwen3.5 checkpoint's mtp.* block converted into the
artifact (kept by default, --no-mtp drops it, refused where it needs what sparkq lacks), its logits
against transformers' attention layer on the block's dequantized weights (the block's input built as
vLLM's Qwen3_5MultiTokenPredictor builds it) through the prompt path and the batched step, on every
build; --draft mtp changes no token (greedy and seeded, both runtimes, the server's batched steps)."""
import json

import numpy as np
import pytest
import torch

from helpers import generate_at_once, kernel_builds, make_hybrid, run_cli
from sparkq.convert.pipeline import Options, convert
from sparkq.formats import Artifact
from sparkq.runtime.sampling import SamplingParams

PROMPT = [ord(c) for c in "abcabcabd hello hello world, hello hello there; abcabc"]


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    src = make_hybrid(d / "q35", "qwen3_5", mtp=True)
    convert(str(src), str(d / "q"), Options(progress=False))
    return src, d / "q"


def test_conversion_keeps_the_block_and_no_mtp_drops_it(art, tmp_path):
    src, out = art
    a = Artifact.open(out)
    assert a.spec.mtp_layers == 1 and a.manifest.features["mtp_layers"] == 1
    assert {"mtp.fc", "mtp.layers.0.qkv", "mtp.layers.0.gate", "mtp.layers.0.down"} <= set(a.linears)
    assert {"mtp.norm.weight", "mtp.enorm.weight", "mtp.hnorm.weight", "mtp.layers.0.q_norm.weight"} <= set(a.infos)
    assert a.linears["mtp.fc"].kind == "int4" and (a.linears["mtp.fc"].n, a.linears["mtp.fc"].k) == (128, 256)
    convert(str(src), str(tmp_path / "n"), Options(progress=False, method="minmax", mtp=False))
    n = Artifact.open(tmp_path / "n")
    assert n.spec.mtp_layers == 0 and not [k for k in n.infos if k.startswith("mtp.")]
    # the published multimodal wrapper's block (top-level mtp.*) comes along with its text model
    vl = make_hybrid(tmp_path / "vl", "qwen3_5_vl", mtp=True)
    convert(str(vl), str(tmp_path / "vl-q"), Options(progress=False, method="minmax"))
    assert Artifact.open(tmp_path / "vl-q").spec.mtp_layers == 1
    # a checkpoint whose block wants its own embedding is refused by name
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "ded").mkdir()
    for f in src.iterdir():
        (tmp_path / "ded" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "ded" / "config.json").write_text(json.dumps({**cfg, "mtp_use_dedicated_embeddings": True}))
    r = run_cli("spark-convert", str(tmp_path / "ded"), str(tmp_path / "ded-q"), "--quiet")
    assert r.returncode == 2 and "mtp_use_dedicated_embeddings" in r.stderr and "--no-mtp" in r.stderr
    assert not (tmp_path / "ded-q").exists()


def _oracle(out, hidden, tokens):
    """transformers' logits of the block: a 1-layer Qwen3_5 text model (the block's layer, mtp.norm,
    the model's head) fed fc([norm_e(embed(t)) | norm_h(h)]) as its input embeddings, all fp32 on the
    artifact's dequantized weights"""
    import transformers
    from sparkq.runtime import load
    q = load(str(out), max_model_len=128, kv_dtype="bf16")
    from helpers import dequant_reference
    ref = dequant_reference(q)
    W = {n: lin.weight.float() for n, lin in ref.lin.items()}
    norms = {k: v.float() for k, v in q.model.norms.items()}
    spec = q.model.spec
    H, KV, D, E, inter = spec.heads, spec.kv_heads, spec.head_dim, spec.hidden, spec.intermediate
    cfg = json.loads((out / "config.json").read_text())
    tc = transformers.Qwen3_5TextConfig(**{k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_parameters")}, num_hidden_layers=1, layer_types=["full_attention"])
    m = transformers.Qwen3_5ForCausalLM(tc).float().eval()
    qkv, gate = W["mtp.layers.0.qkv"], W["mtp.layers.0.gate"]
    qp = torch.stack([qkv[:H * D].view(H, D, E), gate.view(H, D, E)], 1).reshape(2 * H * D, E)  # [q_h | g_h] per head
    sd = {"self_attn.q_proj.weight": qp, "self_attn.k_proj.weight": qkv[H * D:H * D + KV * D],
          "self_attn.v_proj.weight": qkv[H * D + KV * D:], "self_attn.o_proj.weight": W["mtp.layers.0.o"],
          "mlp.gate_proj.weight": W["mtp.layers.0.gate_up"][:inter], "mlp.up_proj.weight": W["mtp.layers.0.gate_up"][inter:],
          "mlp.down_proj.weight": W["mtp.layers.0.down"], "input_layernorm.weight": norms["mtp.layers.0.attn_norm.weight"],
          "post_attention_layernorm.weight": norms["mtp.layers.0.mlp_norm.weight"],
          "self_attn.q_norm.weight": norms["mtp.layers.0.q_norm.weight"],
          "self_attn.k_norm.weight": norms["mtp.layers.0.k_norm.weight"]}
    with torch.no_grad():
        for k, v in sd.items():
            m.model.layers[0].get_parameter(k).copy_(v)
        m.model.norm.weight.copy_(norms["mtp.norm.weight"])
        m.lm_head.weight.copy_(W["lm_head"])

        def rms(x, w):  # Qwen3.5's (1 + w) RMSNorm
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.rms_eps) * (1 + w)
        e = W["embed"][torch.tensor(tokens)]
        x = torch.cat([rms(e, norms["mtp.enorm.weight"]), rms(torch.from_numpy(hidden), norms["mtp.hnorm.weight"])], -1)
        x = x @ W["mtp.fc"].T
        return m(inputs_embeds=x[None], position_ids=torch.arange(len(tokens))[None]).logits[0].float().numpy()


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
def test_block_logits_against_transformers(kernel_build, art):
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.mtp import MtpBlock
    _, out = art
    seq = PROMPT[:41]
    m = load_lite(str(out), max_model_len=128, kv_dtype="bf16")
    h = m.session.prefill(seq[:40], 0, last_only=False)  # the model's final-normed states h_0..h_39
    ref = _oracle(out, h, seq[1:41])  # pair p: (h_p, token p + 1) at position p
    b = MtpBlock(out, slots=2, cap=128, threads=2)
    prompt = b.session.head_many(b.session.prefill(seq[1:41], 0, last_only=False, hin=h))
    steps = b.session.step_many(seq[1:41], range(40), [b.slot_elems] * 40, hin=h)  # one run in slot 1
    scale = np.abs(ref).max()
    for got in (prompt, steps):  # W4A8 products against fp32 on the same weights
        assert np.abs(got - ref).max() <= 0.05 * scale, np.abs(got - ref).max() / scale
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    # the drafter: its first draft is the block's best token after the prompt's pairs
    d = m.drafter("mtp")
    m.first_logits(seq[:40])
    assert d.propose_many([(0, seq[:41], 1)]) == [[int(ref[-1].argmax())]] or \
        abs(np.sort(ref[-1])[-1] - np.sort(ref[-1])[-2]) < 0.05 * scale


@pytest.mark.parametrize("kernel_build", kernel_builds(), indirect=True)
@pytest.mark.parametrize("lite", [True, False], ids=["lite", "torch"])
def test_draft_mtp_changes_no_token(kernel_build, lite, art):
    from sparkq.runtime import load
    from sparkq.runtime.lite import load as load_lite
    m = (load_lite if lite else load)(str(art[1]), max_model_len=256)
    for sp in (SamplingParams(), SamplingParams(0.9, 0.95, top_k=40, seed=7)):
        base = list(m.stream_ids(PROMPT, max_new_tokens=50, sampling=sp))
        got = list(m.stream_ids(PROMPT, max_new_tokens=50, sampling=sp, draft="mtp", draft_tokens=4))
        assert got == base
        assert m.last_stats.drafted > 0  # the block drafted (random weights: rarely right)


def test_draft_mtp_in_the_server_and_refusals(art, tmp_path):
    """3 requests at once through the engine's batched steps with the block drafting for each slot:
    each gets its tokens alone without a draft; --draft mtp without a block is one line, exit 2"""
    from sparkq.runtime.lite import load as load_lite
    from sparkq.runtime.serve.engine import Engine
    from sparkq.runtime.speculate import drafter
    ids = [PROMPT, PROMPT[5:30], PROMPT[::-1]]
    kws = [{}, {"temperature": 0.8, "seed": 4}, {}]
    plain = Engine(load_lite(str(art[1]), max_model_len=128, kv_budget_mib=8, slots=1))
    ref = [plain.generate(i, 30, **kw) for i, kw in zip(ids, kws)]
    plain.close()
    m = load_lite(str(art[1]), max_model_len=128, kv_budget_mib=8, slots=3)
    e = Engine(m, draft=drafter("mtp", m, slots=3), draft_tokens=4)
    got, load_ = generate_at_once(e, ids, 30, kws)
    assert [g["ids"] for g in got] == [r["ids"] for r in ref]
    assert load_["drafted"] > 0, load_
    src = make_hybrid(tmp_path / "plain", "qwen3_5")
    convert(str(src), str(tmp_path / "plain-q"), Options(progress=False, method="minmax"))
    r = run_cli("sparkq", "generate", str(tmp_path / "plain-q"), "hello", "--draft", "mtp", "--max-new-tokens", "4")
    assert r.returncode == 2 and "no multi-token-prediction block" in r.stderr and len(r.stderr.strip().splitlines()) == 1
