"""GGUF import on the real example (SmolLM2-135M-Instruct Q4_1) against transformers' own GGUF loading."""
import json

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
