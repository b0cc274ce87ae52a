"""GGUF import on the real example (SmolLM2-135M-Instruct Q4_1) against transformers' own GGUF loading."""
import json

import pytest
import torch

from helpers import example_gguf


def test_import_gguf_files_and_tokenizer(example_bf16):
    cfg = json.loads((example_bf16 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 576
    assert cfg["num_key_value_heads"] == 3 and cfg["tie_word_embeddings"] is True
    tcfg = json.loads((example_bf16 / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(example_bf16 / "tokenizer.json"))
    assert tok.encode("In 2024").tokens == ["In", "Ġ", "2", "0", "2", "4"]
    assert tok.decode(tok.encode("Hello, world! 123").ids) == "Hello, world! 123"
    assert tok.encode("<|im_start|>user").ids[0] == 1  # control tokens are special, not split


def test_import_gguf_logits_match_transformers_gguf(example_bf16):
    g = example_gguf()
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(example_bf16, dtype=torch.float32).eval()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(example_bf16 / "tokenizer.json"))
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. In 2024, the capital of France").ids])
    with torch.no_grad():
        a = ref(ids).logits[0]
        b = ours(ids).logits[0]
    # ours went through bf16 (the checkpoint's dtype); transformers kept fp32 dequantized weights
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 0.02, rel


# every family the runtime supports, as llama.cpp writes it (tests/ggufwrite.py): mistral as the
# llama architecture with a SentencePiece vocabulary, gemma3 with Gemma's; F16 and Q8_0 linears in
# two of them. head_dim 128 (qwen3) and 256 = query_pre_attn_scalar (gemma3): the values
# transformers' GGUF loader assumes, since it reads neither from the file (llama.cpp and sparkq
# read qwen3's key_length and scale gemma3's queries by head_dim ** -0.5)
GGUF_FAMILIES = {
    "llama": (dict(arch="llama"), "F32"),
    "qwen2": (dict(arch="qwen2", tied=False), "F16"),
    "qwen3": (dict(arch="qwen3", head_dim=128), "Q8_0"),
    "mistral": (dict(arch="mistral", sliding_window=64), "F32"),
    "gemma3": (dict(arch="gemma3", layers=6, sliding_window=8, head_dim=256, query_pre_attn_scalar=256), "F32"),
}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "  the  lazy\tdog 123 ", "fox\nquick brown", "über 北京"]


@pytest.mark.parametrize("fam", sorted(GGUF_FAMILIES))
def test_gguf_family_import_matches_transformers_gguf(fam, tmp_path):
    """import-gguf of a family's GGUF: the same tokens as transformers' GGUF tokenizer, a checkpoint
    whose logits are transformers' GGUF model's (ours went through bf16) and the source
    checkpoint's, the chat template carried; the GGUF converts and generates directly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tokenizers import Tokenizer

    from ggufwrite import CHAT_TEMPLATE, write_gguf
    from helpers import make_llama, run_cli

    kw, qtype = GGUF_FAMILIES[fam]
    src = make_llama(tmp_path / fam, dtype=torch.float32, **kw)
    gg = write_gguf(src, tmp_path / f"{fam}.gguf", qtype)
    imp = tmp_path / f"{fam}-bf16"
    r = run_cli("sparkq", "import-gguf", gg, imp, "--json")
    assert r.returncode == 0, r.stderr
    ref_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gg.name)
    ours = Tokenizer.from_file(str(imp / "tokenizer.json"))
    for text in TEXTS:
        want = ref_tok(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == want, (fam, text)
        assert ours.decode(want) == ref_tok.decode(want), (fam, text)
    assert json.loads((imp / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    ids = torch.tensor([ref_tok("The quick brown fox jumps over the lazy dog", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gg.name, dtype=torch.float32).eval()
        ref = model(ids).logits[0]
        for p in model.parameters():  # its weights rounded to bf16, as the imported checkpoint's are
            p.data = p.data.to(torch.bfloat16).float()
        ref16 = model(ids).logits[0]
        got = AutoModelForCausalLM.from_pretrained(imp, dtype=torch.float32).eval()(ids).logits[0]
        orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits[0]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # the same weights as transformers reads from the file (then bf16), and a faithful round trip
    assert rel(got, ref16) < 1e-4, (fam, rel(got, ref16))
    assert rel(ref, orig) < {"F32": 1e-5, "F16": 0.01, "Q8_0": 0.05}[qtype], (fam, rel(ref, orig))
    out = tmp_path / f"{fam}-int4"
    r = run_cli("spark-convert", gg, out, "--method", "minmax", "--json")
    assert r.returncode == 0, r.stderr
    g = run_cli("sparkq", "generate", out, "The quick brown", "--max-new-tokens", "4", "--json")
    assert g.returncode == 0 and json.loads(g.stdout)["token_ids"], g.stderr


def test_chat_templates_see_the_variables_transformers_provides(tmp_path):
    """Real templates (Qwen2.5's, from its GGUF) test `tools` and call strftime_now: they render
    with tools unset, as transformers' apply_chat_template does."""
    from sparkq.runtime.tokenizer import ChatTokenizer

    from helpers import make_llama
    src = make_llama(tmp_path / "m")
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = ("{%- if tools %}TOOLS{%- endif %}{{ strftime_now('%Y')[:2] }}"
                             "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    (src / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tok = ChatTokenizer.from_dir(src, json.loads((src / "config.json").read_text()))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "20[user]hi"


@pytest.mark.parametrize("fam", ["phi3", "smollm3", "granite", "granitemoehybrid", "olmo2", "qwen3"])
def test_gguf_input_gives_the_safetensors_artifact(fam, tmp_path):
    """A family's GGUF, as llama.cpp writes it (fused qkv and gate_up for phi3 with its LongRoPE
    factor tensors, q/k permuted for smollm3 and granite, Granite 4.0's shared MLP split into
    ffn_gate / ffn_up, OLMo 2's post norms), converts to the same weights file as the safetensors
    checkpoint it came from (minmax; key scaling off: it measures keys on calibration text, and the
    test writer's vocabulary tokenizes that text differently from the checkpoint's)."""
    from ggufwrite import write_gguf
    from helpers import make_llama
    from test_families import FAMILIES

    from sparkq.convert.pipeline import Options, convert
    from sparkq.formats import Artifact

    src = make_llama(tmp_path / fam, **FAMILIES[fam])
    gg = write_gguf(src, tmp_path / f"{fam}.gguf", "F32")
    opts = Options(progress=False, method="minmax", key_scaling=False)
    convert(str(src), str(tmp_path / "st"), opts)
    convert(str(gg), str(tmp_path / "gg"), opts)
    a, b = Artifact.open(tmp_path / "st"), Artifact.open(tmp_path / "gg")
    assert {n: lin.encoding for n, lin in a.linears.items()} == {n: lin.encoding for n, lin in b.linears.items()}
    assert a.weights_path.read_bytes() == b.weights_path.read_bytes(), fam
    assert a.spec.nope_layers == b.spec.nope_layers and a.spec.layer_attention(0) == b.spec.layer_attention(0)
    for f in ("residual_multiplier", "logits_divisor", "embedding_multiplier", "attn_scale"):  # (float32 in GGUF)
        x, y = getattr(a.spec, f), getattr(b.spec, f)
        assert (x is None and y is None) or x == pytest.approx(y, rel=1e-6), (f, x, y)
